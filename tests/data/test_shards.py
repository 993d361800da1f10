"""Inputs cut into shards (order, hashes, digests, changes) and the shard loop (resume,
reuse, the ordered stage)."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest
import zstandard

from flashdraft import storage
from flashdraft.data.dataset import ShardStore, record_batch, stream_bytes
from flashdraft.data.shards import Inputs, Lines, ShardResult, inputs_difference, process_shards


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


def test_a_byte_order_mark_opens_the_first_record_not_the_input(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", [b"\xef\xbb\xbf1", b"2"])
    (shard,) = Inputs([str(a)]).shards(8)
    assert shard.lines == [(f"{a}:1", b"1"), (f"{a}:2", b"2")]


class Ordered:
    """An ordered stage that records what it saw; `refuse` makes reused shards redone."""

    def __init__(self, refuse: set[int]) -> None:
        self.refuse, self.seen = refuse, []

    def apply(self, result: ShardResult) -> ShardResult:
        self.seen.append(("apply", result.index))
        result.extra = {"tag": result.index}
        return result

    def replay(self, marker: dict) -> bool:
        self.seen.append(("replay", marker["index"]))
        return marker["index"] not in self.refuse


def test_an_ordered_stage_sees_every_shard_in_order_and_may_redo_reused_ones(
    tmp_path: Path,
) -> None:
    source = write(tmp_path / "in.jsonl", [b"%d" % i for i in range(7)])
    out = str(tmp_path / "out")

    def run(stage: Ordered) -> list[tuple[str, int]]:
        CALLS.clear()
        store = ShardStore(out, {"v": 1}, overwrite=False)
        done = process_shards(
            Inputs([str(source)]),
            store,
            Echo,
            shard_size=3,
            workers=1,
            progress=False,
            ordered=stage,
        )
        assert [m["tag"] for m in done.markers] == [0, 1, 2]  # `extra` is in the marker
        return stage.seen

    assert run(Ordered(set())) == [("apply", 0), ("apply", 1), ("apply", 2)]
    assert run(Ordered({1})) == [("replay", 0), ("replay", 1), ("apply", 1), ("replay", 2)]
    assert CALLS == [1]


def test_changed_inputs_are_named(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", [b"1", b"2"])
    inputs = Inputs([str(a)])
    list(inputs.shards(8))
    assert inputs_difference(inputs.records, [str(a)]) is None
    assert "new: " in (inputs_difference(inputs.records, [str(a), "b.jsonl"]) or "")
    write(a, [b"1", b"3"])  # the same size, other bytes
    assert "its sha256 differs" in (inputs_difference(inputs.records, [str(a)]) or "")
    write(a, [b"1", b"2", b"3"])
    assert "has 6 bytes, 4 when prepared" in (inputs_difference(inputs.records, [str(a)]) or "")


def _damaged_inputs(tmp_path: Path) -> dict[str, tuple[Path, int, str]]:
    """name -> (file, complete lines before the damage, what the error says)."""
    body = b"".join(b'{"prompt": "question %d", "completion": "answer"}\n' % i for i in range(3000))
    frames = zstandard.ZstdCompressor()
    zst = frames.compress(body[:40_000]) + frames.compress(body[40_000:])
    out = {}
    cut = tmp_path / "cut.jsonl.zst"  # the second frame cut in half: the first one is read
    cut.write_bytes(zst[: len(zst) - 2000])
    out["zstd cut"] = (cut, body[:40_000].count(b"\n"), "is cut short: the zstd stream ends")
    small = tmp_path / "small.jsonl.zst"  # once reported as "the file is empty"
    small.write_bytes(frames.compress(body[:500])[:-8])
    out["zstd cut early"] = (small, 0, "is cut short: the zstd stream ends inside a frame")
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(body)[:-100])
    out["gzip cut"] = (gz, -1, "is cut short: the gzip stream ends before its end marker")
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_bytes(body[:200])
    out["not gzip"] = (plain, 0, "is not gzip data or is damaged")
    junk = tmp_path / "junk.jsonl.zst"
    junk.write_bytes(body[:200])
    out["not zstd"] = (junk, 0, "is not zstd data or is damaged")
    return out


@pytest.mark.parametrize("case", ["zstd cut", "zstd cut early", "gzip cut", "not gzip", "not zstd"])
def test_a_damaged_compressed_input_is_refused_where_it_breaks(tmp_path: Path, case: str) -> None:
    """Its readable records come first, then one error naming the file, the byte and the
    last complete line; never a silent end of file, an "empty" file or a codec traceback."""
    path, complete, what = _damaged_inputs(tmp_path)[case]
    good = write(tmp_path / "first.jsonl", [b"1", b"2"])
    seen: list[str] = []
    with pytest.raises(storage.DamagedInput) as err:
        for shard in Inputs([str(good), str(path)]).shards(100):
            seen += [source for source, _ in shard.lines]
    text = str(err.value)
    assert text.startswith(f"{path} {what}") and "\n" not in text
    assert " at byte " in text or "bytes" in text
    if complete > 0:
        assert text.count(f"after line {complete:,};") == 1
    elif complete == 0:
        assert "after line" not in text
    # Every complete line before the damage reached a shard, in order (shards of 100).
    read = err.value.lines
    assert read is not None and read >= max(complete, 0)
    assert len(seen) == (2 + read) // 100 * 100
    # storage.iter_lines (generate's and eval's prompts) says the same.
    with pytest.raises(storage.DamagedInput) as again:
        for _ in storage.iter_lines(str(path)):
            pass
    assert str(again.value) == text
