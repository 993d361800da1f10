"""The work of `generate`: input records -> jobs (one per turn to regenerate) -> batches.

A job is one assistant turn to answer: its stable id, where it came from, and the
conversation before it. Ids are the record's own `id`, else a hash of the record, then `#`
and the index of the regenerated message, so a re-run (or another shard) names the same
turn the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flashdraft.data.formats import Message, RecordError, parse_prompt, record_id, record_tools


@dataclass(slots=True)
class Job:
    id: str
    source: str  # file:line
    prompt: list[Message]  # the conversation before the regenerated turn
    tools: list[dict[str, Any]] | None = None  # the record's function schemas, for the template


@dataclass(slots=True)
class BadInput:
    source: str
    reason: str


def record_key(record: dict[str, Any]) -> str:
    """The record's own id, else a hash of its content: the same record, the same key."""
    own = record_id(record)
    if own is not None:
        return own
    canonical = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def jobs_from_record(record: Any, source: str, turns: str) -> list[Job]:
    """The turns of one input record to regenerate (raises RecordError with the reason):
    its last assistant turn (`turns="last"`) or every one, where a conversation that ends
    without one asks for it.

    Only turns `prepare` would train are answered: the assistant turns inside a prompt
    record's prompt are context (`Message.trained`), with or without a completion. Written
    as the completion of their own records they would be trained, and `--turns all` over
    `generate`'s own output would answer each earlier turn once per later record.

    Earlier assistant turns stay as the dataset wrote them: each turn is answered to the
    conversation as it stood, so the turns of one record are independent jobs.
    """
    conversation = parse_prompt(record)
    if {"messages", "conversations", "completion", "response"} & record.keys():
        answers = [i for i, m in enumerate(conversation) if m.role == "assistant" and m.trained]
    else:  # a bare prompt record is all prompt (formats marks `trained` where a completion is)
        answers = []
    if conversation[-1].role != "assistant":
        answers.append(len(conversation))  # the open turn after the last message
    if not answers:
        raise RecordError("no assistant turn to regenerate (a prompt's turns are context)")
    chosen = answers[-1:] if turns == "last" else answers
    key, tools = record_key(record), record_tools(record)
    return [Job(f"{key}#{i}", source, conversation[:i], tools) for i in chosen]


def shard_of(job_id: str, num_shards: int) -> int:
    return int(hashlib.sha256(job_id.encode()).hexdigest()[:8], 16) % num_shards


def plan_batches(
    lengths: list[int], *, batch_size: int, max_batch_tokens: int | None, max_new_tokens: int
) -> list[list[int]]:
    """Indices grouped into batches of similar prompt length, longest first.

    Left padding costs (longest - shortest) slots per row, so sorting keeps it small; the
    token budget bounds the KV cache, rows × (longest prompt + max_new_tokens). Longest first:
    a batch that does not fit in memory fails at the start of a run, not hours into it.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size:
            rows, longest = len(batches[-1]) + 1, lengths[batches[-1][0]]
            if max_batch_tokens is None or rows * (longest + max_new_tokens) <= max_batch_tokens:
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches


def batch_seed(seed: int, ids: Iterable[str]) -> int:
    """The sampling seed of one batch: the run seed and the batch's ids, so that a batch draws
    the same tokens whatever ran before it (a resumed run matches an uninterrupted one)."""
    digest = hashlib.sha256("\n".join([str(seed), *ids]).encode()).hexdigest()
    return int(digest[:15], 16)
