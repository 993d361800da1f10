"""The parallel machinery of `prepare`: inputs cut into shards, processed by workers, in order.

The main process reads the inputs (files, globs, directories; local or any fsspec URL;
`.gz`/`.zst`), hashes them as it goes, and cuts the stream of records into shards of a fixed
number of records (`Inputs`). Each shard goes to a processor (`prepare.ShardProcessor`) in a
spawned worker process, or in this process with one worker, and comes back as Arrow bytes
(`ShardResult`); `process_shards` saves each result into the `ShardStore` with its resume
marker, in input order, and reuses the shards a previous run finished from the same input.
What must be decided across shards (duplicate record ids) is an `OrderedStage`, run in the
main process on each shard in input order, replayed on reused ones. Nothing here knows what a
shard becomes.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import fsspec
from tqdm import tqdm

from flashdraft import storage
from flashdraft.data.dataset import ShardStore

Lines = list[tuple[str, bytes]]  # (source "url:line", raw JSONL line) per record


@dataclass(kw_only=True, slots=True)
class ShardResult:
    index: int
    data: bytes  # Arrow IPC stream
    counts: dict[str, int]
    rejects: list[tuple[str, str]]
    cpu_seconds: float  # of the worker, for throughput reports (never stored: not reproducible)
    ids: list[tuple[str, str]] = field(default_factory=list)  # (source, own id) per record
    truncated: list[str] = field(default_factory=list)  # sources of samples cut to length
    loop_untrained: list[tuple[str, int]] = field(default_factory=list)  # (source, tokens)
    extra: dict[str, Any] = field(default_factory=dict)  # stored in the shard's marker


class OrderedStage(Protocol):
    """A decision across shards, made in input order in the main process: `apply` to each
    newly processed shard's result (before it is saved; `extra` goes into its marker),
    `replay` each reused shard's marker (False: the decision differs now, redo the shard)."""

    def apply(self, result: ShardResult) -> ShardResult: ...

    def replay(self, marker: dict[str, Any]) -> bool: ...


# index, lines -> result; built in each worker by a picklable factory.
Processor = Callable[[int, Lines], ShardResult]


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
class Shard:
    index: int
    lines: Lines
    digest: str
    read_bytes: int  # raw input bytes consumed up to the end of this shard


class Inputs:
    """The records of all inputs in order, cut into shards; per-file size/hash/records."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.total_bytes = sum(_size(u) for u in files)
        self.records: list[dict[str, Any]] = []  # per file, filled as the files are read

    def shards(self, size: int) -> Iterator[Shard]:
        lines: Lines = []
        index = done_bytes = 0
        for url in self.files:
            records = number = 0
            with fsspec.open(url, "rb") as raw:
                # The hash is of the bytes as stored (compressed), so it is read here rather
                # than through storage.iter_lines, which only sees decompressed lines.
                hashing = _HashingReader(raw)
                stream = storage.decompress(io.BufferedReader(hashing, 1 << 20), url)
                try:
                    for number, raw_line in enumerate(stream, start=1):
                        line = storage.clean_line(raw_line, number)  # newline and BOM off
                        if not line.strip():
                            continue
                        records += 1
                        lines.append((f"{url}:{number}", line))
                        if len(lines) == size:
                            yield Shard(index, lines, _digest(lines), done_bytes + hashing.bytes)
                            index, lines = index + 1, []
                except storage.DamagedInput as err:
                    # Refused, not used in part: a dataset silently missing a file's tail
                    # is worse than a run that stops (the shards done so far are kept).
                    err.lines = number
                    raise
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
            yield Shard(index, lines, _digest(lines), done_bytes)


def inputs_difference(recorded: list[dict[str, Any]], files: list[str]) -> str | None:
    """How `files` differ from the inputs an earlier run recorded (`Inputs.records`; None:
    they do not): the list of files first, then each file's size and sha256 as stored."""
    before = [r["url"] for r in recorded]
    if before != files:
        gone, added = sorted(set(before) - set(files)), sorted(set(files) - set(before))
        if gone or added:
            return "; ".join(
                [f"no longer given: {', '.join(gone)}"] * bool(gone)
                + [f"new: {', '.join(added)}"] * bool(added)
            )
        return "the same files in another order"
    for record in recorded:  # sizes first: cheap
        size = _size(record["url"])
        if size != record["size"]:
            return f"{record['url']} has {size:,} bytes, {record['size']:,} when prepared"
    for record in recorded:
        if storage.file_digest(record["url"])[0] != record["sha256"]:
            return f"{record['url']} changed since it was prepared (its sha256 differs)"
    return None


def _size(url: str) -> int:
    fs, path = storage.filesystem(url)
    return int(fs.size(path) or 0)


def _digest(lines: Lines) -> str:
    h = hashlib.blake2b(digest_size=16)
    for source, raw in lines:
        h.update(source.encode())
        h.update(b"\0")
        h.update(raw)
        h.update(b"\n")
    return h.hexdigest()


# -- workers ---------------------------------------------------------------------------------

_PROCESSOR: Processor | None = None


def _init_worker(make_processor: Callable[[], Processor]) -> None:
    global _PROCESSOR
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _PROCESSOR = make_processor()


def _run_worker(index: int, lines: Lines) -> ShardResult:
    assert _PROCESSOR is not None, "worker not initialised"
    return _PROCESSOR(index, lines)


class _InlineExecutor:
    """One worker: process in this process, no pickling (also easier to profile)."""

    def __init__(self, make_processor: Callable[[], Processor]) -> None:
        self.processor = make_processor()

    def submit(self, index: int, lines: Lines) -> Future[ShardResult]:
        future: Future[ShardResult] = Future()
        future.set_result(self.processor(index, lines))
        return future

    def shutdown(self) -> None:
        pass


class _PoolExecutor:
    def __init__(self, make_processor: Callable[[], Processor], workers: int) -> None:
        # spawn, not fork: a forked Rust tokenizer thread pool can deadlock.
        self.pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(make_processor,),
        )

    def submit(self, index: int, lines: Lines) -> Future[ShardResult]:
        return self.pool.submit(_run_worker, index, lines)

    def shutdown(self) -> None:
        self.pool.shutdown(cancel_futures=True)


# -- the loop --------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Processed:
    markers: list[dict[str, Any]]  # every shard's marker, in order
    reused: int  # shards finished by an earlier run
    cpu_seconds: float  # worker CPU time on the shards processed in this run


def process_shards(
    inputs: Inputs,
    store: ShardStore,
    make_processor: Callable[[], Processor],
    *,
    shard_size: int,
    workers: int,
    progress: bool,
    ordered: OrderedStage | None = None,
) -> Processed:
    """Every shard of `inputs`, reused when finished before, else processed and saved.

    `make_processor` builds the processor, once per worker process (it must pickle for
    more than one worker); the workers start only once a shard needs them. `ordered` sees
    every shard in input order (see `OrderedStage`).
    """
    executor: _InlineExecutor | _PoolExecutor | None = None
    # At most this many shards are read ahead of the oldest unfinished one (memory bound).
    window = 2 * workers + 1
    pending: deque[tuple[Shard, Future[ShardResult] | None, dict[str, Any] | None]] = deque()
    out = Processed(markers=[], reused=0, cpu_seconds=0.0)
    done_bytes = 0
    totals: Counter[str] = Counter()
    bar = tqdm(
        total=inputs.total_bytes, unit="B", unit_scale=True, desc="prepare", disable=not progress
    )

    def submit(shard: Shard) -> Future[ShardResult]:
        nonlocal executor
        if executor is None:
            executor = (
                _InlineExecutor(make_processor)
                if workers == 1
                else _PoolExecutor(make_processor, workers)
            )
        future = executor.submit(shard.index, shard.lines)
        shard.lines = []  # the worker has them; free the memory
        return future

    def finish_one() -> None:
        nonlocal done_bytes
        shard, future, marker = pending.popleft()
        if marker is not None and ordered is not None and not ordered.replay(marker):
            future, marker = submit(shard), None  # finished before, but decided otherwise now
        if future is not None:
            result = future.result()
            out.cpu_seconds += result.cpu_seconds
            if ordered is not None:
                result = ordered.apply(result)
            marker = store.save(
                result.index,
                shard.digest,
                result.data,
                result.counts,
                result.rejects,
                extra=result.extra,
            )
        else:
            out.reused += 1
        assert marker is not None
        out.markers.append(marker)
        bar.update(shard.read_bytes - done_bytes)
        done_bytes = shard.read_bytes
        totals.update(marker["counts"])
        bar.set_postfix(samples=totals["samples"], rejected=totals["rejected"])

    try:
        for shard in inputs.shards(shard_size):
            marker = store.finished(shard.index, shard.digest)
            future = submit(shard) if marker is None else None
            pending.append((shard, future, marker))
            while len(pending) > window:
                finish_one()
        while pending:
            finish_one()
    finally:
        bar.close()
        if executor is not None:
            executor.shutdown()
    return out
