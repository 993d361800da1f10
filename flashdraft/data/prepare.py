"""`flashdraft prepare`: conversations and completions -> a trainable Arrow dataset.

Pipeline. The main process reads the inputs (files, globs, directories; local or any fsspec
URL; `.gz`/`.zst`), hashes them as it goes, and cuts the stream of records into shards of
`--shard-size` records. Workers (spawned processes with a tokenizer each) parse, render,
tokenize and mask a shard (`flashdraft.data.template`) and send it back as Arrow bytes; the main
process writes each shard with a done marker, in input order.

Order. Output order is input order: files as given (globs and directories sorted), lines
in order, a record's extra samples (`file:line#turn`) before its main one. It depends
neither on `--workers` nor on timing, so a run is byte-for-byte reproducible; the trainer
shuffles. `--seed` picks the samples shown by `--preview`.

Resume. `OUT/.work/` keeps the run's settings and, per finished shard, a marker: counts,
rejects and a digest of the shard's input lines. Running again into OUT with the same
settings skips every shard whose marker matches its input, redoes an interrupted one (it
has no marker), and finishes; different settings are refused unless `--overwrite`.

Checks. A bad record (malformed JSON, invalid UTF-8, unknown role, non-alternating turns,
an empty assistant turn, a template failure, a sample over `--max-length` with
`--overlong drop`) is counted and written to `rejects.jsonl`, never fatal on its own; more
than `--max-reject-rate` of them fails the run. Then the audit checks (`flashdraft.data.audit`)
run on the written dataset and fail the run unless `--allow-degenerate`. A failed dataset
is written with `status: failed` in its manifest, which the trainer refuses; fix the cause
or the thresholds and run again (finished shards are reused).
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import numpy as np

from flashdraft import __version__, storage
from flashdraft.data.audit import (
    Thresholds,
    audit_dataset,
    format_preview,
    format_report,
    preview_indices,
)
from flashdraft.data.dataset import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    REJECTS,
    ShardStore,
    open_dataset,
    record_batch,
    stream_bytes,
)
from flashdraft.data.formats import RecordError, parse_line, parse_record, record_tools
from flashdraft.data.template import (
    ChatTemplate,
    RenderedSample,
    TemplateOptions,
    encode,
    load_tokenizer,
    tokenizer_fingerprint,
)

OVERLONG = ("drop", "truncate")


@dataclass(kw_only=True, slots=True)
class PrepareConfig:
    inputs: list[str]
    tokenizer: str
    output: str
    thinking: str = "keep"
    turns: str = "all"
    max_length: int | None = None
    overlong: str = "drop"
    workers: int = 0  # 0: every core this process may use
    seed: int = 0
    shard_size: int = 2048
    max_reject_rate: float = 0.01
    allow_degenerate: bool = False
    overwrite: bool = False
    preview: int = 1
    color: bool = False  # highlight the preview with colour instead of [[ ]]
    progress: bool = True
    thresholds: Thresholds = field(default_factory=Thresholds)

    def __post_init__(self) -> None:
        TemplateOptions(thinking=self.thinking, turns=self.turns)  # validates both
        if not self.inputs:
            raise ValueError("give at least one input file, glob or directory")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"--max-length must be at least 2, got {self.max_length}")
        if self.overlong not in OVERLONG:
            raise ValueError(
                f"--overlong must be one of {', '.join(OVERLONG)}, got {self.overlong!r}"
            )
        if self.shard_size < 1:
            raise ValueError(f"--shard-size must be positive, got {self.shard_size}")
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0 (0: all cores), got {self.workers}")
        if not 0.0 <= self.max_reject_rate <= 1.0:
            raise ValueError(f"--max-reject-rate is a share in [0, 1], got {self.max_reject_rate}")

    def num_workers(self) -> int:
        if self.workers:
            return self.workers
        affinity = getattr(os, "sched_getaffinity", None)
        return len(affinity(0)) if affinity else os.cpu_count() or 1


# -- reading inputs --------------------------------------------------------------------------


class _HashingReader(io.RawIOBase):
    """Passes a raw byte stream through while hashing and counting it (manifest sha256)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.raw.read(len(buffer))
        buffer[: len(data)] = data
        self.sha256.update(data)
        self.bytes += len(data)
        return len(data)


@dataclass(slots=True)
class _Shard:
    index: int
    lines: list[tuple[str, bytes]]  # (source "url:line", raw JSONL line)
    digest: str
    read_bytes: int  # raw input bytes consumed up to the end of this shard


class _Inputs:
    """The records of all inputs in order, cut into shards; per-file size/hash/records."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.total_bytes = sum(_size(u) for u in files)
        self.records: list[dict[str, Any]] = []

    def shards(self, size: int) -> Iterator[_Shard]:
        lines: list[tuple[str, bytes]] = []
        index = done_bytes = 0
        for url in self.files:
            records = 0
            with fsspec.open(url, "rb") as raw:
                hashing = _HashingReader(raw)
                stream = storage.decompress(io.BufferedReader(hashing, 1 << 20), url)
                for number, line in enumerate(stream, start=1):
                    line = line.rstrip(b"\r\n")
                    if not line.strip():
                        continue
                    records += 1
                    lines.append((f"{url}:{number}", line))
                    if len(lines) == size:
                        yield _Shard(index, lines, _digest(lines), done_bytes + hashing.bytes)
                        index, lines = index + 1, []
            done_bytes += hashing.bytes
            self.records.append(
                {
                    "url": url,
                    "size": hashing.bytes,
                    "sha256": hashing.sha256.hexdigest(),
                    "records": records,
                }
            )
        if lines:
            yield _Shard(index, lines, _digest(lines), done_bytes)


def _size(url: str) -> int:
    fs, path = storage.filesystem(url)
    return int(fs.size(path) or 0)


def _digest(lines: list[tuple[str, bytes]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for source, raw in lines:
        h.update(source.encode())
        h.update(b"\0")
        h.update(raw)
        h.update(b"\n")
    return h.hexdigest()


# -- processing one shard (in a worker) ------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class _Job:
    """What a worker needs to process shards; plain data, sent to each spawned worker."""

    tokenizer: str
    thinking: str
    turns: str
    max_length: int | None
    overlong: str


@dataclass(kw_only=True, slots=True)
class ShardResult:
    index: int
    data: bytes  # Arrow IPC stream
    counts: dict[str, int]
    rejects: list[tuple[str, str]]
    cpu_seconds: float  # of the worker, for throughput reports (never stored: not reproducible)


class ShardProcessor:
    def __init__(self, job: _Job, tokenizer: Any | None = None) -> None:
        self.job = job
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(job.tokenizer)
        self.template = ChatTemplate(
            self.tokenizer, TemplateOptions(thinking=job.thinking, turns=job.turns)
        )

    def __call__(self, index: int, lines: list[tuple[str, bytes]]) -> ShardResult:
        started = time.process_time()
        rejects: list[tuple[str, str]] = []
        rendered = self._render(lines, rejects)
        encoded = encode(self.tokenizer, [sample for _, sample in rendered])
        rows: list[tuple[np.ndarray, np.ndarray, str]] = []
        truncated = 0
        for (source, _), result in zip(rendered, encoded, strict=True):
            if not isinstance(result, RecordError):
                ids, mask = result
                result = self._fit(ids, mask)
                truncated += not isinstance(result, RecordError) and len(result[0]) < len(ids)
            if isinstance(result, RecordError):
                rejects.append((source, str(result)))
                continue
            rows.append((*result, source))
        counts = {
            "records": len(lines),
            "samples": len(rows),
            "rejected": len(rejects),
            "truncated": truncated,
            "tokens": int(sum(len(r[0]) for r in rows)),
            "loss_tokens": int(sum(int(r[1].sum()) for r in rows)),
        }
        return ShardResult(
            index=index,
            data=stream_bytes(record_batch(rows)),
            counts=counts,
            rejects=rejects,
            cpu_seconds=time.process_time() - started,
        )

    def _render(
        self, lines: list[tuple[str, bytes]], rejects: list[tuple[str, str]]
    ) -> list[tuple[str, RenderedSample]]:
        """(source, sample) for every sample of the good records; bad ones go to `rejects`."""
        rendered = []
        for source, raw in lines:
            try:
                record = parse_line(raw)
                samples = self.template.samples(parse_record(record), record_tools(record))
            except RecordError as err:
                rejects.append((source, str(err)))
                continue
            # The last sample holds the record's last trained turn; earlier ones are the
            # turns a template rewrote, named by their message index.
            rendered += [
                (source if k == len(samples) - 1 else f"{source}#{s.turn}", s)
                for k, s in enumerate(samples)
            ]
        return rendered

    def _fit(
        self, ids: np.ndarray, mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | RecordError:
        """Apply --max-length and --overlong to one sample."""
        limit = self.job.max_length
        if limit is None or len(ids) <= limit:
            return ids, mask
        if self.job.overlong == "drop":
            return RecordError(f"{len(ids)} tokens, over --max-length {limit}")
        if not mask[:limit].any():
            return RecordError(f"no trained token within --max-length {limit}")
        return ids[:limit], mask[:limit]


_PROCESSOR: ShardProcessor | None = None


def _init_worker(job: _Job) -> None:
    global _PROCESSOR
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _PROCESSOR = ShardProcessor(job)


def _run_worker(index: int, lines: list[tuple[str, bytes]]) -> ShardResult:
    assert _PROCESSOR is not None, "worker not initialised"
    return _PROCESSOR(index, lines)


class _InlineExecutor:
    """One worker: process in this process, no pickling (also easier to profile)."""

    def __init__(self, job: _Job, tokenizer: Any) -> None:
        self.processor = ShardProcessor(job, tokenizer)

    def submit(self, index: int, lines: list[tuple[str, bytes]]) -> Future[ShardResult]:
        future: Future[ShardResult] = Future()
        future.set_result(self.processor(index, lines))
        return future

    def shutdown(self) -> None:
        pass


class _PoolExecutor:
    def __init__(self, job: _Job, workers: int) -> None:
        # spawn, not fork: a forked Rust tokenizer thread pool can deadlock.
        self.pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(job,),
        )

    def submit(self, index: int, lines: list[tuple[str, bytes]]) -> Future[ShardResult]:
        return self.pool.submit(_run_worker, index, lines)

    def shutdown(self) -> None:
        self.pool.shutdown(cancel_futures=True)


# -- the run ---------------------------------------------------------------------------------


def _reason_kind(reason: str) -> str:
    """A reject reason without its specifics, to group them in the summary."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", reason))


def _settings(config: PrepareConfig, tokenizer_sha256: str) -> dict[str, Any]:
    """Everything that decides the data; a resumed run must match it exactly."""
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer_sha256": tokenizer_sha256,
        "thinking": config.thinking,
        "turns": config.turns,
        "max_length": config.max_length,
        "overlong": config.overlong,
        "shard_size": config.shard_size,
    }


def _tokenizer_name(path: str) -> str:
    # A local path is stored absolute so that `flashdraft audit` finds it from anywhere.
    return os.path.abspath(path) if os.path.exists(path) else path


@dataclass(kw_only=True, slots=True)
class PrepareResult:
    manifest: dict[str, Any]
    report: str  # the audit report, human readable
    preview: str
    seconds: float  # wall, whole run
    process_seconds: float  # wall, reading and processing the shards
    worker_cpu_seconds: float  # CPU time workers spent on shards processed in this run
    reused_shards: int

    @property
    def ok(self) -> bool:
        return self.manifest["status"] == "complete"


def prepare(config: PrepareConfig, *, log: Callable[[str], None] = print) -> PrepareResult:
    """Run the whole pipeline; the dataset and its manifest are in `config.output`."""
    started = time.perf_counter()
    files = storage.expand_inputs(config.inputs)
    tokenizer = load_tokenizer(config.tokenizer)
    ChatTemplate(tokenizer, TemplateOptions(thinking=config.thinking, turns=config.turns)).check()
    if config.thinking == "off" and "enable_thinking" not in str(tokenizer.chat_template):
        log("note: the chat template has no enable_thinking switch; --thinking off acts as strip")
    tokenizer_sha256 = tokenizer_fingerprint(tokenizer)
    workspace = ShardStore(
        config.output, _settings(config, tokenizer_sha256), overwrite=config.overwrite
    )
    inputs = _Inputs(files)
    job = _Job(
        tokenizer=config.tokenizer,
        thinking=config.thinking,
        turns=config.turns,
        max_length=config.max_length,
        overlong=config.overlong,
    )
    workers = config.num_workers()
    log(
        f"prepare: {len(files)} input file(s), {workers} worker(s), shards of {config.shard_size} records"
    )
    process_started = time.perf_counter()
    markers, reused, worker_cpu = _process(config, inputs, workspace, job, workers, tokenizer)
    process_seconds = time.perf_counter() - process_started

    names = workspace.finalize(markers)
    manifest = _manifest(config, inputs, tokenizer_sha256, markers, names)
    manifest_url = storage.join(config.output, MANIFEST)
    # Written before the checks so that a crash in them never leaves a "complete" dataset.
    storage.write_json_atomic(manifest_url, manifest)

    dataset = open_dataset(config.output, require_complete=False)
    audit = audit_dataset(dataset, tokenizer, config.thresholds)
    problems = _reject_problems(config, manifest)
    if audit.problems and config.allow_degenerate and audit.samples:
        manifest["warnings"] = audit.problems
    else:
        problems += audit.problems
    manifest["status"] = "failed" if problems else "complete"
    manifest["problems"] = problems
    manifest["audit"] = {
        k: v for k, v in audit.to_json().items() if k not in ("problems", "top_repeats")
    }
    storage.write_json_atomic(manifest_url, manifest)

    indices = preview_indices(dataset, config.preview, config.seed) if config.preview else []
    return PrepareResult(
        manifest=manifest,
        report=format_report(audit),
        preview=format_preview(dataset, indices, tokenizer, color=config.color) if indices else "",
        seconds=time.perf_counter() - started,
        process_seconds=process_seconds,
        worker_cpu_seconds=worker_cpu,
        reused_shards=reused,
    )


def _manifest(
    config: PrepareConfig,
    inputs: _Inputs,
    tokenizer_sha256: str,
    markers: list[dict[str, Any]],
    data_files: list[str],
) -> dict[str, Any]:
    """The record of what was prepared from what, and how; `status` is set by the checks."""
    keys = ("records", "samples", "rejected", "truncated", "tokens", "loss_tokens")
    reasons = Counter(_reason_kind(r) for m in markers for _, r in m["rejects"])
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "status": "checking",
        "created_by": f"flashdraft {__version__}",
        "inputs": inputs.records,
        "tokenizer": {"name": _tokenizer_name(config.tokenizer), "sha256": tokenizer_sha256},
        "options": {
            "thinking": config.thinking,
            "turns": config.turns,
            "max_length": config.max_length,
            "overlong": config.overlong,
            "seed": config.seed,
            "shard_size": config.shard_size,
            "max_reject_rate": config.max_reject_rate,
            "allow_degenerate": config.allow_degenerate,
            "thresholds": asdict(config.thresholds),
        },
        "counts": {k: sum(m["counts"][k] for m in markers) for k in keys},
        "rejected_by_reason": dict(reasons.most_common()),
        "data_files": data_files,
    }


def _reject_problems(config: PrepareConfig, manifest: dict[str, Any]) -> list[str]:
    counts = manifest["counts"]
    rate = counts["rejected"] / max(counts["records"], 1)
    if rate <= config.max_reject_rate:
        return []
    common = "; ".join(
        f"{n:,} x {kind}" for kind, n in list(manifest["rejected_by_reason"].items())[:3]
    )
    return [
        f"{counts['rejected']:,} of {counts['records']:,} records ({rate:.1%}) were rejected, "
        f"more than --max-reject-rate {config.max_reject_rate:g}. Most common: {common}. "
        f"Each is listed in {storage.join(config.output, REJECTS)}; fix the input or raise "
        "--max-reject-rate."
    ]


def _process(
    config: PrepareConfig,
    inputs: _Inputs,
    workspace: ShardStore,
    job: _Job,
    workers: int,
    tokenizer: Any,
) -> tuple[list[dict[str, Any]], int, float]:
    """Every shard's marker in order (reused when finished before, else processed), the
    number reused, and the worker CPU seconds spent."""
    from tqdm import tqdm

    executor: _InlineExecutor | _PoolExecutor | None = None
    # At most this many shards are read ahead of the oldest unfinished one (memory bound).
    window = 2 * workers + 1
    pending: deque[tuple[_Shard, Future[ShardResult] | None, dict[str, Any] | None]] = deque()
    markers: list[dict[str, Any]] = []
    reused = done_bytes = 0
    cpu = 0.0
    totals: Counter[str] = Counter()
    bar = tqdm(
        total=inputs.total_bytes,
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=not config.progress,
    )

    def finish_one() -> None:
        nonlocal reused, done_bytes, cpu
        shard, future, marker = pending.popleft()
        if future is not None:
            result = future.result()
            cpu += result.cpu_seconds
            marker = workspace.save(
                result.index, shard.digest, result.data, result.counts, result.rejects
            )
        else:
            reused += 1
        assert marker is not None
        markers.append(marker)
        bar.update(shard.read_bytes - done_bytes)
        done_bytes = shard.read_bytes
        totals.update(marker["counts"])
        bar.set_postfix(samples=totals["samples"], rejected=totals["rejected"])

    try:
        for shard in inputs.shards(config.shard_size):
            marker = workspace.finished(shard.index, shard.digest)
            future = None
            if marker is None:
                if executor is None:
                    executor = (
                        _InlineExecutor(job, tokenizer)
                        if workers == 1
                        else _PoolExecutor(job, workers)
                    )
                future = executor.submit(shard.index, shard.lines)
                shard.lines = []  # the worker has them; free the memory
            pending.append((shard, future, marker))
            while len(pending) > window:
                finish_one()
        while pending:
            finish_one()
    finally:
        bar.close()
        if executor is not None:
            executor.shutdown()
    return markers, reused, cpu
