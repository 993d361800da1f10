"""Inputs cut into shards (order, hashes, digests) and the shard loop (resume, reuse)."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np

from flashdraft.data.dataset import ShardStore, record_batch, stream_bytes
from flashdraft.data.shards import Inputs, Lines, ShardResult, process_shards


def write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_inputs_are_cut_in_order_and_hashed_as_stored(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", [b"1", b"", b"2", b"3\r"])  # a blank line is no record
    b = tmp_path / "b.jsonl.gz"
    b.write_bytes(gzip.compress(b"4\n5\n"))
    inputs = Inputs([str(a), str(b)])
    shards = list(inputs.shards(2))
    assert [s.index for s in shards] == [0, 1, 2]
    assert [s.lines for s in shards] == [
        [(f"{a}:1", b"1"), (f"{a}:3", b"2")],
        [(f"{a}:4", b"3"), (f"{b}:1", b"4")],
        [(f"{b}:2", b"5")],
    ]
    assert shards[-1].read_bytes == inputs.total_bytes  # progress reaches the end
    assert [r["records"] for r in inputs.records] == [3, 2]
    assert inputs.records[1]["sha256"] == hashlib.sha256(b.read_bytes()).hexdigest()
    # The digest names the lines and where they came from: the same input, the same digest.
    again = list(Inputs([str(a), str(b)]).shards(2))
    assert [s.digest for s in again] == [s.digest for s in shards]
    moved = list(Inputs([str(b), str(a)]).shards(2))
    assert moved[0].digest != shards[0].digest


CALLS: list[int] = []  # shard indices processed, in order


class Echo:
    """Each record becomes one sample: its line's bytes as token ids, all trained."""

    def __call__(self, index: int, lines: Lines) -> ShardResult:
        CALLS.append(index)
        rows = [
            (np.frombuffer(raw, np.uint8).astype(np.int32), np.ones(len(raw), np.int8), source)
            for source, raw in lines
        ]
        counts = {"records": len(lines), "samples": len(rows), "rejected": 0}
        data = stream_bytes(record_batch(rows))
        return ShardResult(index=index, data=data, counts=counts, rejects=[], cpu_seconds=0.0)


def test_finished_shards_are_reused_and_the_rest_processed(tmp_path: Path) -> None:
    source = write(tmp_path / "in.jsonl", [b"%d" % i for i in range(7)])
    out = str(tmp_path / "out")

    def run() -> list[int]:
        CALLS.clear()
        store = ShardStore(out, {"v": 1}, overwrite=False)
        done = process_shards(
            Inputs([str(source)]), store, Echo, shard_size=3, workers=1, progress=False
        )
        assert [m["index"] for m in done.markers] == [0, 1, 2]
        assert sum(m["counts"]["records"] for m in done.markers) == 7
        store.finalize(done.markers)
        return list(CALLS)

    assert run() == [0, 1, 2]
    assert run() == []  # everything finished: nothing processed, no worker started
    (tmp_path / "out" / ".work" / "shard-00001.json").unlink()
    assert run() == [1]  # an interrupted shard is redone alone
