"""`flashdraft generate`: regenerate assistant turns with the target (on-policy data) for `prepare`.

A drafter learns the target's own distribution best, so the dataset's answers are replaced by
the target's. Inputs are what `prepare` reads (formats.py) plus bare prompts: a prompt record
without a completion, or a conversation ending in a user turn ("answer this"). Each
regenerated turn becomes one prompt/completion record, one JSON object per line:

    {"id": "chitchat/17#3", "source": "in.jsonl:12", "prompt": [<messages before the turn>],
     "completion": "...", "reasoning": "..." (only when the target thought),
     "finish_reason": "stop", "prompt_tokens": 412, "completion_tokens": 96,
     "generation": {"target": ..., "thinking": ..., "temperature": ..., ...}}

`completion_tokens` counts what the target generated, its stop token included (as OpenAI-style
usage does). Ids are stable: the record's own `id`, else a hash of the record, then `#` and the
index of the regenerated message. A re-run skips ids already written: the output is
append-only, one complete line per record, flushed and fsynced per batch, and a line cut by a
crash is dropped on resume. Truncated (`finish_reason == "length"`), empty and unclosed-thinking
answers go to `OUT.rejected.jsonl` with a `reason` and the raw `text` but no `completion`, so
`prepare` can never train on them by accident; they keep their ids and are not retried.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from flashdraft import storage
from flashdraft.data.formats import (
    ROLES,
    SHAREGPT_ROLES,
    Message,
    RecordError,
    parse_record,
    read_records,
)
from flashdraft.data.inference import DTYPES, Backend, Generated, Sampling

BACKENDS = ("auto", "hf", "vllm")
# Stands in for the turn to generate, so that formats.parse_record validates a bare prompt
# exactly as it validates a full conversation. It never leaves this module.
_PLACEHOLDER = "<flashdraft: the turn to generate>"
_THINK_OPEN = re.compile(r"^\s*<think>")
_THINK_CLOSE = "</think>"
_MAX_EXAMPLES = 10  # bad input lines printed; all are counted


@dataclass(kw_only=True, slots=True)
class GenerateConfig:
    target: str
    prompts: list[str]
    output: str
    sampling: Sampling = field(default_factory=Sampling)
    thinking: bool = False
    turns: str = "last"  # "last": the last assistant turn of each record; "all": every one
    backend: str = "auto"
    batch_size: int = 32
    max_batch_tokens: int | None = None  # rows × (longest prompt + max_new_tokens) per batch
    sort_window: int = 4096  # prompts read ahead and sorted by length into batches
    limit: int | None = None  # only the first N prompts of the input (done ones included)
    seed: int = 0
    shard_index: int = 0
    num_shards: int = 1
    stop_token_ids: list[int] = field(default_factory=list)  # on top of the target's eos ids
    device: str | None = None  # default: cuda when available
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    # Keep answers cut at max_new_tokens in the main output (the chat template will close
    # them with its end-of-turn token): on-policy tokens all the same, for quick runs.
    keep_truncated: bool = False

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("no --prompts given")
        if not self.output.endswith(".jsonl") or self.output.endswith(".rejected.jsonl"):
            raise ValueError(
                f"--output {self.output!r} must be a plain .jsonl file (uncompressed, so that "
                "it can be appended to), not ending in .rejected.jsonl"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.turns not in ("last", "all"):
            raise ValueError(f"turns must be 'last' or 'all', got {self.turns!r}")
        for name in ("batch_size", "sort_window", "num_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit must be >= 0, got {self.limit}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard {self.shard_index}/{self.num_shards}: need 0 <= K < N")

    def settings(self, stop_ids: list[int]) -> dict[str, Any]:
        """What every record carries; a resumed run must match it (batching may differ)."""
        return {
            "target": os.path.basename(self.target.rstrip("/")),
            "thinking": self.thinking,
            **dataclasses.asdict(self.sampling),
            "seed": self.seed,
            "stop_token_ids": stop_ids,
        }


def rejected_url(output: str) -> str:
    return output.removesuffix(".jsonl") + ".rejected.jsonl"


# ---------------------------------------------------------------------------------------------
# Input: records -> jobs, one per assistant turn to regenerate


@dataclass(slots=True)
class Job:
    id: str
    source: str  # file:line
    prompt: list[Message]  # the conversation before the regenerated turn


@dataclass(slots=True)
class BadInput:
    source: str
    reason: str


def record_key(record: dict[str, Any]) -> str:
    """The record's own id, else a hash of its content: the same record, the same key."""
    own = record.get("id")
    if isinstance(own, str | int) and not isinstance(own, bool) and str(own):
        return str(own)
    canonical = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _last_role(turns: Any, key: str, roles: dict[str, str]) -> str | None:
    if not isinstance(turns, list) or not turns or not isinstance(turns[-1], dict):
        return None  # malformed: parse_record says what is wrong
    return roles.get(str(turns[-1].get(key)).lower())


def _open_turn(record: dict[str, Any]) -> dict[str, Any] | None:
    """`record` with a placeholder assistant turn appended if it ends without one, else None.

    Same precedence as formats.parse_record: messages, then conversations, then prompt.
    """
    if "messages" in record:
        turns = record["messages"]
        if _last_role(turns, "role", {r: r for r in ROLES}) not in (None, "assistant"):
            return {**record, "messages": [*turns, {"role": "assistant", "content": _PLACEHOLDER}]}
    elif "conversations" in record:
        turns = record["conversations"]
        if _last_role(turns, "from", SHAREGPT_ROLES) not in (None, "assistant"):
            return {**record, "conversations": [*turns, {"from": "gpt", "value": _PLACEHOLDER}]}
    elif "prompt" in record and "completion" not in record and "response" not in record:
        return {**record, "completion": _PLACEHOLDER}
    return None


def jobs_from_record(record: Any, source: str, turns: str) -> list[Job]:
    """The turns of one input record to regenerate (raises RecordError with the reason).

    Earlier assistant turns stay as the dataset wrote them: each turn is answered to the
    conversation as it stood, so the turns of one record are independent jobs.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record is a JSON {type(record).__name__}, not an object")
    opened = _open_turn(record)
    conversation = parse_record(opened if opened is not None else record)
    key = record_key(record)
    answers = [i for i, m in enumerate(conversation) if m.role == "assistant"]
    chosen = answers[-1:] if turns == "last" else answers
    return [Job(f"{key}#{i}", source, conversation[:i]) for i in chosen]


def shard_of(job_id: str, num_shards: int) -> int:
    return int(hashlib.sha256(job_id.encode()).hexdigest()[:8], 16) % num_shards


def read_jobs(cfg: GenerateConfig, done: set[str], summary: Summary) -> Iterator[Job | BadInput]:
    """Jobs still to do, in input order, and the bad input lines (counted by the caller)."""
    # Never read our own output back as input (an input directory may hold it).
    own = {storage.filesystem(u)[1] for u in (cfg.output, rejected_url(cfg.output))}
    urls = [u for u in storage.expand_inputs(cfg.prompts) if storage.filesystem(u)[1] not in own]
    seen: set[str] = set()
    for url in urls:
        for source, value in read_records(url):
            summary.records_read += 1
            try:
                if isinstance(value, RecordError):
                    raise value
                jobs = jobs_from_record(value, source, cfg.turns)
            except RecordError as err:
                yield BadInput(source, str(err))
                continue
            for job in jobs:
                if cfg.limit is not None and summary.prompts >= cfg.limit:
                    return
                summary.prompts += 1
                if cfg.num_shards > 1 and shard_of(job.id, cfg.num_shards) != cfg.shard_index:
                    continue
                if job.id in seen:
                    summary.duplicates += 1
                    yield BadInput(source, f"duplicate id {job.id!r} (ids must be unique)")
                    continue
                seen.add(job.id)
                if job.id in done:
                    summary.already_done += 1
                    continue
                yield job


def render_prompt(tokenizer: Any, prompt: list[Message], thinking: bool) -> list[int]:
    """Prompt token ids through the target's chat template, generation prompt appended.

    `enable_thinking` is read by templates with a thinking switch (Qwen3), ignored by others.
    """
    text = tokenizer.apply_chat_template(
        [m.to_openai() for m in prompt],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    # The template writes the special tokens (bos included) itself.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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


# ---------------------------------------------------------------------------------------------
# Output: generated ids -> records, appended with resume


def split_reasoning(text: str) -> tuple[str | None, str, bool]:
    """(reasoning, answer, closed) of a raw generation.

    The thinking block opens either in the output (`<think>...</think>answer`) or in the
    template's generation prompt (the output only closes it). `closed` is False for a block
    that never closes: the target did not reach its answer.
    """
    opened = _THINK_OPEN.match(text)
    body = text[opened.end() :] if opened else text
    head, close, tail = body.partition(_THINK_CLOSE)
    if close:
        return head.strip("\n"), tail.lstrip(), True
    if opened:
        return body.strip("\n"), "", False
    return None, text, True


def make_record(
    job: Job,
    prompt_ids: list[int],
    out: Generated,
    text: str,
    settings: dict[str, Any],
    keep_truncated: bool = False,
) -> tuple[dict[str, Any], str | None]:
    """The output record of one job and why to reject it (None: keep it)."""
    reasoning, answer, closed = split_reasoning(text)
    reason = None
    if out.finish_reason == "length" and not (keep_truncated and closed and answer.strip()):
        reason = "length"
    elif not closed:
        reason = "unclosed_think"
    elif not answer.strip():
        reason = "empty"
    record: dict[str, Any] = {"id": job.id, "source": job.source}
    record["prompt"] = [m.to_openai() for m in job.prompt]
    if reason is None:
        record["completion"] = answer
        if reasoning is not None:
            record["reasoning"] = reasoning
    else:
        record["reason"] = reason
        record["text"] = text  # raw, to inspect; deliberately not a `completion`
    record["finish_reason"] = out.finish_reason
    record["prompt_tokens"] = len(prompt_ids)
    record["completion_tokens"] = out.num_generated
    record["generation"] = settings
    return record, reason


def drop_partial_line(url: str) -> int:
    """Cut a file after its last newline (a crash mid-write leaves half a line); bytes cut."""
    if not storage.exists(url):
        return 0
    fs, path = storage.filesystem(url)
    if not storage.is_local(url):
        data = bytes(fs.cat_file(path))
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            storage.write_bytes_atomic(url, data[:keep])
        return len(data) - keep
    size = os.path.getsize(path)
    keep = 0
    with open(path, "rb+") as f:
        end = size
        while end > 0:  # scan back from the end for the last newline
            start = max(0, end - (1 << 16))
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        if keep < size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return size - keep


class OutputLog:
    """The output and its rejected side file: append-only JSONL, fsynced per batch.

    Opening it repairs a crash (drops a partial last line) and reads the ids already done.
    Local files are appended in place. Other fsspec URLs use fsspec's "ab" mode, which object
    stores implement by re-uploading or multipart-copying the object on every batch: correct,
    but slow for big outputs and only as crash-safe as the store; for long runs write to a
    local disk and upload the finished file (or one file per --shard).
    """

    def __init__(self, output: str):
        self.urls = {"ok": output, "rejected": rejected_url(output)}
        self.done: set[str] = set()
        self.settings: set[str] = set()  # canonical JSON of each `generation` seen
        self.dropped_bytes = 0
        self.unreadable_lines = 0
        self._files: dict[str, Any] = {}
        for url in self.urls.values():
            self.dropped_bytes += drop_partial_line(url)
            if storage.exists(url):
                self._read(url)

    def _read(self, url: str) -> None:
        for _, raw in storage.iter_lines(url):
            try:
                record = json.loads(raw)
                self.done.add(record["id"])
                self.settings.add(json.dumps(record["generation"], sort_keys=True))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                self.unreadable_lines += 1

    def check_settings(self, settings: dict[str, Any]) -> None:
        ours = json.dumps(settings, sort_keys=True)
        others = sorted(self.settings - {ours})
        if others:
            theirs = json.loads(others[0])
            diff = "; ".join(
                f"{k} {theirs.get(k)!r} there, {settings.get(k)!r} now"
                for k in sorted(set(theirs) | set(settings))
                if theirs.get(k) != settings.get(k)
            )
            raise ValueError(
                f"{self.urls['ok']} holds records generated with other settings ({diff}); "
                "resume with the same settings or write to a new --output"
            )

    def append(self, key: str, records: list[dict[str, Any]]) -> None:
        """Append whole lines in one write, then flush and fsync (local)."""
        if not records:
            return
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        url = self.urls[key]
        if not storage.is_local(url):
            fs, path = storage.filesystem(url)
            try:
                with fs.open(path, "ab") as f:
                    f.write(data)
            except NotImplementedError:
                raise ValueError(
                    f"{url}: this filesystem cannot append; use a local --output"
                ) from None
            return
        if key not in self._files:
            os.makedirs(os.path.dirname(os.path.abspath(url)), exist_ok=True)
            self._files[key] = open(url, "ab")  # noqa: SIM115 (held open for the run)
        f = self._files[key]
        f.write(data)
        f.flush()
        os.fsync(f.fileno())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


# ---------------------------------------------------------------------------------------------
# The run


@dataclass(slots=True)
class Summary:
    records_read: int = 0
    prompts: int = 0  # turns to regenerate in the input, after --limit, before --shard
    bad_inputs: int = 0
    duplicates: int = 0  # part of bad_inputs
    already_done: int = 0
    written: int = 0
    truncated_kept: int = 0  # finish_reason "length" written with --keep-truncated
    rejected: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0  # generation loop wall time, model loading excluded
    bad_examples: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rejected"] = dict(self.rejected)
        out["tokens_per_s"] = round(self.tokens_per_s, 1)
        return out


def _report_bad(bad: BadInput, summary: Summary) -> None:
    summary.bad_inputs += 1
    if len(summary.bad_examples) < _MAX_EXAMPLES:
        line = f"{bad.source}: {bad.reason}"
        summary.bad_examples.append(line)
        print(f"generate: skipped {line}", file=sys.stderr)


def _windows(items: Iterator[Job | BadInput], size: int, summary: Summary) -> Iterator[list[Job]]:
    window: list[Job] = []
    for item in items:
        if isinstance(item, BadInput):
            _report_bad(item, summary)
            continue
        window.append(item)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def _tokenize(
    window: list[Job], tokenizer: Any, cfg: GenerateConfig, limit: int | None, summary: Summary
) -> tuple[list[Job], list[list[int]]]:
    jobs, prompts = [], []
    for job in window:
        try:
            ids = render_prompt(tokenizer, job.prompt, cfg.thinking)
        except (TemplateError, ValueError) as err:  # e.g. a template's raise_exception
            _report_bad(BadInput(job.source, f"chat template failed: {err}"), summary)
            continue
        if limit is not None and len(ids) + cfg.sampling.max_new_tokens > limit:
            why = f"prompt of {len(ids)} tokens + max_new_tokens exceeds the target's {limit}"
            _report_bad(BadInput(job.source, why), summary)
            continue
        jobs.append(job)
        prompts.append(ids)
    return jobs, prompts


def _progress(enabled: bool) -> Any:
    from tqdm import tqdm

    # Not a terminal (a cluster log): a line every 30 s still shows the run is alive.
    interval = 1.0 if sys.stderr.isatty() else 30.0
    return tqdm(
        desc="generate", unit="tok", unit_scale=True, disable=not enabled, mininterval=interval
    )


def run_generation(
    cfg: GenerateConfig,
    backend: Backend,
    tokenizer: Any,
    *,
    log: OutputLog | None = None,
    summary: Summary | None = None,
) -> Summary:
    """Generate every pending prompt of `cfg` into its output; returns the counts.

    `summary` is filled in place, so a caller still has the counts after an interrupt.
    """
    summary = summary if summary is not None else Summary()
    settings = cfg.settings(backend.stop_ids)
    log = log if log is not None else OutputLog(cfg.output)
    log.check_settings(settings)
    if log.done:
        print(f"generate: resuming, {len(log.done)} ids already done", file=sys.stderr)
    if log.dropped_bytes:
        print(f"generate: dropped a partial last line ({log.dropped_bytes} B)", file=sys.stderr)
    if log.unreadable_lines:
        print(f"generate: {log.unreadable_lines} unreadable output lines", file=sys.stderr)
    bar = _progress(cfg.progress)
    start = time.perf_counter()
    try:
        for window in _windows(read_jobs(cfg, log.done, summary), cfg.sort_window, summary):
            jobs, prompts = _tokenize(window, tokenizer, cfg, backend.max_positions, summary)
            if backend.schedules_batches:
                batches = [list(range(len(jobs)))] if jobs else []
            else:
                batches = plan_batches(
                    [len(p) for p in prompts],
                    batch_size=cfg.batch_size,
                    max_batch_tokens=cfg.max_batch_tokens,
                    max_new_tokens=cfg.sampling.max_new_tokens,
                )
            for batch in batches:
                seed = batch_seed(cfg.seed, (jobs[i].id for i in batch))
                outs = backend.generate([prompts[i] for i in batch], seed, bar.update)
                kept: dict[str, list[dict[str, Any]]] = {"ok": [], "rejected": []}
                for i, out in zip(batch, outs, strict=True):
                    text = tokenizer.decode(out.token_ids, skip_special_tokens=False)
                    record, reason = make_record(
                        jobs[i], prompts[i], out, text, settings, cfg.keep_truncated
                    )
                    kept["ok" if reason is None else "rejected"].append(record)
                    if reason is not None:
                        summary.rejected[reason] += 1
                    elif out.finish_reason == "length":
                        summary.truncated_kept += 1
                    summary.prompt_tokens += len(prompts[i])
                    summary.generated_tokens += out.num_generated
                log.append("ok", kept["ok"])
                log.append("rejected", kept["rejected"])
                summary.written += len(kept["ok"])
                bar.set_postfix(written=summary.written, rejected=sum(summary.rejected.values()))
    finally:
        summary.seconds = time.perf_counter() - start
        bar.close()
        log.close()
    return summary


def format_summary(summary: Summary, cfg: GenerateConfig, backend: str) -> str:
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(summary.rejected.items())) or "none"
    return "\n".join(
        [
            f"generate: {summary.written} written to {cfg.output}"
            + (
                f" ({summary.truncated_kept} cut at max-new-tokens, kept)"
                if summary.truncated_kept
                else ""
            ),
            f"  rejected: {sum(summary.rejected.values())} ({rejected}) "
            f"in {rejected_url(cfg.output)}",
            f"  input: {summary.records_read} records, {summary.prompts} prompts, "
            f"{summary.already_done} already done, {summary.bad_inputs} bad "
            f"({summary.duplicates} duplicate ids)",
            f"  {summary.generated_tokens} tokens generated in {summary.seconds:.1f} s "
            f"= {summary.tokens_per_s:.1f} tok/s ({backend})",
        ]
    )
