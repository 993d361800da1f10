"""Evaluation prompts: JSONL records to the token ids the draft-and-verify loop continues.

A record is one of

* OpenAI `messages` or ShareGPT `conversations`: rendered with the target tokenizer's chat
  template and generation prompt; trailing assistant turns are dropped, so training
  conversations can serve as prompts;
* a raw `prompt` string: tokenized as-is (no template), e.g. a code prefix.

Chats are read and rendered exactly as `flashdraft generate` reads and renders the prompts it
answers (`flashdraft.data.jobs`, `flashdraft.data.generate`), so a drafter is evaluated on
prompts shaped like its on-policy training data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flashdraft.data.formats import RecordError, read_records
from flashdraft.data.generate import render_prompt
from flashdraft.data.jobs import jobs_from_record


@dataclass(slots=True)
class EvalPrompt:
    id: str
    input_ids: list[int]


def prompt_ids(record: dict[str, Any], tokenizer: Any) -> list[int]:
    """Token ids of one prompt record (raises RecordError with the reason)."""
    if not isinstance(record, dict):
        raise RecordError(f"record is a JSON {type(record).__name__}, not an object")
    if isinstance(record.get("prompt"), str) and not ({"messages", "conversations"} & set(record)):
        return list(tokenizer(record["prompt"]).input_ids)  # raw text, tokenized as-is
    jobs = jobs_from_record(record, "", "last")
    if not jobs or not jobs[-1].prompt:
        raise RecordError("no user turn to answer")
    # The template's default thinking mode: what a served drafter sees by default.
    return render_prompt(tokenizer, jobs[-1].prompt, thinking=True)


def load_prompts(url: str, tokenizer: Any, limit: int | None = None) -> list[EvalPrompt]:
    """The prompts of a JSONL file (the first `limit`); a bad record is a ValueError naming
    its file:line."""
    prompts: list[EvalPrompt] = []
    for source, record in read_records(url):
        if limit is not None and len(prompts) >= limit:
            break
        try:
            if isinstance(record, RecordError):
                raise record
            ids = prompt_ids(record, tokenizer)
        except RecordError as err:
            raise ValueError(f"{source}: {err}") from None
        prompts.append(EvalPrompt(str(record.get("id") or source), ids))
    if not prompts:
        raise ValueError(f"{url} holds no prompts")
    return prompts


def as_prompt(
    item: EvalPrompt | dict[str, Any] | Sequence[int], index: int, tokenizer: Any
) -> EvalPrompt:
    """An EvalPrompt from a record (rendered with `tokenizer`), a token-id list (id: its
    index) or an EvalPrompt (as it is)."""
    if isinstance(item, EvalPrompt):
        return item
    if isinstance(item, dict):
        if tokenizer is None:
            raise ValueError("prompt records need a tokenizer to be rendered")
        return EvalPrompt(str(item.get("id") or index), prompt_ids(item, tokenizer))
    return EvalPrompt(str(index), [int(t) for t in item])
