"""fsspec helpers: URLs, atomic writes, compressed line reading, input expansion, tensors."""

from __future__ import annotations

import errno
import gzip
import os

import pytest
import torch

from flashdraft import storage


def test_join_and_locality() -> None:
    assert storage.is_local("/a/b") and storage.is_local("file:///a") and storage.is_local("a")
    assert not storage.is_local("s3://bucket/x")
    assert (
        storage.join("s3://bucket/run", "step_1", "state.json")
        == "s3://bucket/run/step_1/state.json"
    )
    assert storage.join("/tmp/run", "x") == os.path.join("/tmp/run", "x")


def test_atomic_writes_leave_no_temporary_file(tmp_path) -> None:
    url = str(tmp_path / "sub" / "a.json")
    storage.write_json_atomic(url, {"x": 1})
    storage.write_json_atomic(url, {"x": 2})  # replaces, never appends
    assert storage.read_json(url) == {"x": 2}
    assert sorted(os.listdir(tmp_path / "sub")) == ["a.json"]


def test_iter_lines_reads_plain_gzip_and_zstd_as_bytes(tmp_path) -> None:
    import zstandard

    lines = [b'{"a": 1}', b"\xff not utf-8", b"", b"last"]
    body = b"\n".join(lines) + b"\n"
    (tmp_path / "p.jsonl").write_bytes(body)
    (tmp_path / "g.jsonl.gz").write_bytes(gzip.compress(body))
    (tmp_path / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    for name in ("p.jsonl", "g.jsonl.gz", "z.jsonl.zst"):
        got = list(storage.iter_lines(str(tmp_path / name)))
        assert got == list(enumerate(lines, start=1)), name


def test_expand_inputs_globs_directories_and_names_what_matched_nothing(tmp_path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    for name in ("d/a.jsonl", "d/e/b.jsonl.gz", "d/notes.txt", "c.jsonl"):
        (tmp_path / name).write_text("{}\n")
    found = storage.expand_inputs([str(tmp_path / "d"), str(tmp_path / "*.jsonl")])
    assert found == [
        str(tmp_path / "d" / "a.jsonl"),
        str(tmp_path / "d" / "e" / "b.jsonl.gz"),
        str(tmp_path / "c.jsonl"),
    ]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        storage.expand_inputs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(FileNotFoundError, match="matched no data files"):
        storage.expand_inputs([str(tmp_path / "*.parquet")])


def test_tensors_round_trip_on_local_and_memory_filesystems(tmp_path) -> None:
    tensors = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(2)}
    for url in (str(tmp_path / "t.safetensors"), "memory://flashdraft-test/t.safetensors"):
        storage.write_tensors(url, tensors, {"format": "pt"})
        back = storage.read_tensors(url)
        assert set(back) == {"w", "b"} and torch.equal(back["w"], tensors["w"]), url


def test_object_store_urls_go_through_fsspec() -> None:
    url = "memory://flashdraft-test/run/config.json"
    storage.write_json_atomic(url, {"ok": True})
    assert storage.exists(url) and storage.read_json(url) == {"ok": True}
    storage.makedirs("memory://flashdraft-test/run/sub")
    assert storage.exists("memory://flashdraft-test/run/config.json")


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path) -> None:
    body = storage.BOM + b'{"a": 1}\n' + storage.BOM + b"kept on line 2\n"
    (tmp_path / "bom.jsonl").write_bytes(body)
    (tmp_path / "bom.jsonl.gz").write_bytes(gzip.compress(body))
    for name in ("bom.jsonl", "bom.jsonl.gz"):
        lines = list(storage.iter_lines(str(tmp_path / name)))
        assert lines == [(1, b'{"a": 1}'), (2, storage.BOM + b"kept on line 2")], name
    (tmp_path / "bom.json").write_bytes(storage.BOM + b'{"ok": true}')
    assert storage.read_json(str(tmp_path / "bom.json")) == {"ok": True}


def test_bad_json_is_an_error_naming_the_file(tmp_path) -> None:
    (tmp_path / "state.json").write_text('{"step": 3,')
    with pytest.raises(ValueError, match=r"state\.json is not valid JSON \(.* line 1, column 12\)"):
        storage.read_json(str(tmp_path / "state.json"))
    (tmp_path / "latin.json").write_bytes(b'{"caf\xe9": 1}')
    with pytest.raises(ValueError, match=r"latin\.json is not valid JSON \(not UTF-8"):
        storage.read_json(str(tmp_path / "latin.json"))


def test_file_digest_is_the_sha256_and_size_of_what_was_written(tmp_path) -> None:
    import hashlib

    data = storage.tensor_bytes({"w": torch.ones(3)})
    for url in (str(tmp_path / "t.safetensors"), "memory://flashdraft-test/d.safetensors"):
        storage.write_bytes_atomic(url, data)
        assert storage.file_digest(url) == (hashlib.sha256(data).hexdigest(), len(data))
    assert storage.json_bytes({"a": [1]}) == b'{\n  "a": [\n    1\n  ]\n}\n'


def test_a_write_that_fails_names_the_file_and_leaves_the_old_one_and_no_debris(
    tmp_path, monkeypatch
) -> None:
    url = str(tmp_path / "a.json")
    storage.write_json_atomic(url, {"x": 1})

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(storage.WriteFailed) as failed:
        storage.write_json_atomic(url, {"x": 2})
    assert str(failed.value) == f"could not write {url}: No space left on device"
    assert failed.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["a.json"] and storage.read_json(url) == {"x": 1}


def test_write_failures_are_told_from_other_os_errors() -> None:
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert storage.is_write_failure(full)
    assert storage.is_write_failure(storage.WriteFailed("x", OSError(errno.EACCES, "denied")))
    assert not storage.is_write_failure(OSError(errno.ECONNRESET, "reset"))
