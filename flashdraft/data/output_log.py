"""The output of `generate`: one JSON record per regenerated turn, in an append-only log.

A kept answer becomes a prompt/completion record that `prepare` reads as it is; a truncated
(`finish_reason == "length"`), empty or unclosed-thinking answer goes to `OUT.rejected.jsonl`
with a `reason` and the raw `text` but no `completion`, so `prepare` can never train on it by
accident. A request to a server that failed after its last retry (`--backend openai`) goes to
`OUT.errors.jsonl` with its error. All three files are append-only, one complete line per
record, flushed and fsynced per batch; a line cut by a crash is dropped when the log is opened
again, and the ids already written are skipped, rejected ones included (they are not retried);
failed ones are tried again.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from flashdraft import storage
from flashdraft.data.inference import Generated
from flashdraft.data.jobs import Job

_THINK_OPEN = re.compile(r"^\s*<think>")
_THINK_CLOSE = "</think>"


def rejected_url(output: str) -> str:
    return output.removesuffix(".jsonl") + ".rejected.jsonl"


def errors_url(output: str) -> str:
    return output.removesuffix(".jsonl") + ".errors.jsonl"


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
    """The output record of one job answered by an in-process backend, and why to reject it
    (None: keep it)."""
    return answer_record(
        job,
        text=text,
        finish_reason=out.finish_reason,
        prompt_tokens=len(prompt_ids),
        completion_tokens=out.num_generated,
        settings=settings,
        keep_truncated=keep_truncated,
    )


def answer_record(
    job: Job,
    *,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int | None,
    settings: dict[str, Any],
    keep_truncated: bool = False,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    record_id: str | None = None,
) -> tuple[dict[str, Any], str | None]:
    """The output record of one answer and why to reject it (None: keep it).

    `reasoning`: the server's parsed reasoning (then `text` is the answer alone); None
    splits a `<think>` block off `text`. An answer with `tool_calls` is written as a
    one-message completion list (the assistant turn with its calls), which `prepare` reads
    as the trained turn; an answer without text is kept when it calls a tool.
    """
    parsed = reasoning is not None  # the server split it off
    if not parsed:
        reasoning, answer, closed = split_reasoning(text)
    else:
        answer, closed = text, True
    reason = None
    if finish_reason == "length" and not (keep_truncated and closed and answer.strip()):
        reason = "length"
    elif not closed:
        reason = "unclosed_think"
    elif not answer.strip() and not tool_calls:
        reason = "empty"
    record: dict[str, Any] = {"id": record_id or job.id, "source": job.source}
    record["prompt"] = [m.to_openai() for m in job.prompt]
    if job.tools:
        record["tools"] = job.tools
    if reason is None and tool_calls:
        turn: dict[str, Any] = {"role": "assistant", "content": answer, "tool_calls": tool_calls}
        if reasoning is not None:
            turn["reasoning_content"] = reasoning
        record["completion"] = [turn]
    elif reason is None:
        record["completion"] = answer
        if reasoning is not None:
            record["reasoning"] = reasoning
    else:
        record["reason"] = reason
        record["text"] = text  # raw, to inspect; deliberately not a `completion`
        if parsed:
            record["reasoning"] = reasoning
        if tool_calls:
            record["tool_calls"] = tool_calls
    record["finish_reason"] = finish_reason
    record["prompt_tokens"] = prompt_tokens
    record["completion_tokens"] = completion_tokens
    record["generation"] = settings
    return record, reason


def error_record(job: Job, error: str, retries: int, settings: dict[str, Any]) -> dict[str, Any]:
    """A prompt whose request failed after its last retry (`--backend openai`): written to
    `OUT.errors.jsonl`, never counted as done, so running the command again retries it."""
    return {
        "id": job.id,
        "source": job.source,
        "error": error,
        "retries": retries,
        "generation": settings,
    }


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
    """The output and its side files (rejected answers, failed requests): append-only JSONL,
    fsynced per batch.

    Opening it repairs a crash (drops a partial last line) and reads the ids already done.
    Local files are appended in place. Other fsspec URLs use fsspec's "ab" mode, which object
    stores implement by re-uploading or multipart-copying the object on every batch: correct,
    but slow for big outputs and only as crash-safe as the store; for long runs write to a
    local disk and upload the finished file (or one file per --shard).
    """

    def __init__(self, output: str):
        self.urls = {"ok": output, "rejected": rejected_url(output), "errors": errors_url(output)}
        self.done: set[str] = set()
        self.settings: set[str] = set()  # canonical JSON of each `generation` seen
        self.dropped_bytes = 0
        self.unreadable_lines = 0
        self._files: dict[str, Any] = {}
        for key, url in self.urls.items():
            self.dropped_bytes += drop_partial_line(url)
            if key != "errors" and storage.exists(url):  # failed requests are retried
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
