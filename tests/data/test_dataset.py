"""The prepared-dataset layout: written with pyarrow, read by `datasets` and by our reader."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from flashdraft.data.dataset import (
    PreparedDataset,
    ShardStore,
    dataset_identity,
    filter_stream,
    open_dataset,
    open_datasets,
    record_batch,
    stream_bytes,
    token_counts,
    write_dataset,
)


def rows(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray, str]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 40)) if i != 3 else 0  # one empty sample too
        ids = rng.integers(0, 150_000, size=length).astype(np.int32)
        mask = (rng.random(length) < 0.5).astype(np.int8)
        out.append((ids, mask, f"data.jsonl:{i + 1}"))
    return out


def test_reader_returns_what_was_written(tmp_path: Path) -> None:
    written = rows(25)
    write_dataset(str(tmp_path / "ds"), written, shards=3)
    dataset = open_dataset(str(tmp_path / "ds"))
    assert len(dataset) == 25
    assert dataset.num_tokens.dtype == np.int64
    assert dataset.num_tokens.tolist() == [len(r[0]) for r in written]
    assert dataset.num_loss_tokens.tolist() == [int(r[1].sum()) for r in written]
    for i, (ids, mask, source) in enumerate(written):
        got_ids, got_mask = dataset.sample(i)
        assert got_ids.dtype == np.int32 and got_mask.dtype == np.int8
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_mask, mask)
        assert dataset.source(i) == source
    np.testing.assert_array_equal(dataset.sample(-1)[0], written[-1][0])
    with pytest.raises(IndexError):
        dataset.sample(25)
    assert dataset.manifest["counts"]["samples"] == 25


def test_dataset_identity_follows_the_content(tmp_path: Path) -> None:
    write_dataset(str(tmp_path / "a"), rows(12), shards=2)
    write_dataset(str(tmp_path / "b"), rows(12), shards=2, manifest={"note": "other"})
    write_dataset(str(tmp_path / "c"), rows(6), shards=2)
    same, other = dataset_identity(str(tmp_path / "b")), dataset_identity(str(tmp_path / "c"))
    assert dataset_identity(str(tmp_path / "a")) == same != other
    # Rewritten in place with other samples: another identity.
    write_dataset(str(tmp_path / "a"), rows(6), shards=2)
    assert dataset_identity(str(tmp_path / "a")) == other
    # A manifest from before content_sha256: the prefix state.json keeps.
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    del manifest["content_sha256"]
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    assert dataset_identity(str(tmp_path / "c")) == other[:16]


def test_datasets_load_from_disk_opens_it(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    written = rows(10)
    write_dataset(str(tmp_path / "ds"), written, shards=2)
    loaded = datasets.load_from_disk(str(tmp_path / "ds"))
    assert loaded.column_names == [
        "input_ids",
        "loss_mask",
        "num_tokens",
        "num_loss_tokens",
        "source",
    ]
    assert str(loaded.features["input_ids"].feature.dtype) == "int32"
    assert str(loaded.features["loss_mask"].feature.dtype) == "int8"
    assert loaded[7]["input_ids"] == written[7][0].tolist()
    assert loaded[7]["loss_mask"] == written[7][1].tolist()
    assert loaded[7]["source"] == "data.jsonl:8"


def test_concatenation_and_pickling(tmp_path: Path) -> None:
    a, b = rows(5, seed=1), rows(7, seed=2)
    write_dataset(str(tmp_path / "a"), a)
    write_dataset(str(tmp_path / "b"), b, shards=2)
    both = open_datasets([str(tmp_path / "a"), str(tmp_path / "b")])
    assert len(both) == 12
    assert both.manifest["counts"]["samples"] == 12
    np.testing.assert_array_equal(both.sample(6)[0], b[1][0])
    # A DataLoader worker gets the dataset by pickling: it reopens the files.
    clone = pickle.loads(pickle.dumps(both))
    assert isinstance(clone, PreparedDataset)
    np.testing.assert_array_equal(clone.sample(11)[1], b[6][1])


def test_remote_url_through_fsspec() -> None:
    written = rows(6)
    write_dataset("memory://flashdraft-test/ds", written, shards=2)
    dataset = open_dataset("memory://flashdraft-test/ds")
    np.testing.assert_array_equal(dataset.sample(4)[0], written[4][0])


def test_clear_errors_for_what_is_not_a_prepared_dataset(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_dataset(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a prepared dataset"):
        open_dataset(str(tmp_path / "empty"))
    write_dataset(
        str(tmp_path / "failed"), rows(3), manifest={"status": "failed", "problems": ["all-ones"]}
    )
    with pytest.raises(ValueError, match="must not be trained on: all-ones"):
        open_dataset(str(tmp_path / "failed"))
    assert len(open_dataset(str(tmp_path / "failed"), require_complete=False)) == 3
    write_dataset(str(tmp_path / "old"), rows(3), manifest={"version": 0})
    with pytest.raises(ValueError, match="version"):
        open_dataset(str(tmp_path / "old"))
    write_dataset(str(tmp_path / "bad"), rows(3))
    (tmp_path / "bad" / "data-00000-of-00001.arrow").write_bytes(b"not arrow")
    with pytest.raises(ValueError, match="not an Arrow IPC stream"):
        open_dataset(str(tmp_path / "bad"))
    manifest = json.loads((tmp_path / "bad" / "manifest.json").read_text())
    assert manifest["format"] == "flashdraft-prepared-dataset"


def test_shard_store_resumes_only_matching_shards(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    settings = {"tokenizer": "abc", "turns": "all"}
    store = ShardStore(out, settings, overwrite=False)
    written = rows(6)
    for index in range(2):
        data = stream_bytes(record_batch(written[3 * index : 3 * index + 3]))
        store.save(index, f"digest-{index}", data, {"samples": 3}, [("x.jsonl:9", "bad")])
    names = store.finalize([store.markers[0], store.markers[1]])
    assert names == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert (tmp_path / "out" / "rejects.jsonl").read_text().count("x.jsonl:9") == 2

    again = ShardStore(out, settings, overwrite=False)
    assert again.finished(0, "digest-0") is not None
    assert again.finished(1, "changed input") is None
    with pytest.raises(FileExistsError, match="other settings"):
        ShardStore(out, {**settings, "turns": "last"}, overwrite=False)
    ShardStore(out, {**settings, "turns": "last"}, overwrite=True)
    assert not (tmp_path / "out" / names[0]).exists()


def test_token_counts_come_from_the_count_columns(tmp_path: Path) -> None:
    written = rows(9)
    counts = token_counts(record_batch(written))
    assert counts == {
        "samples": 9,
        "tokens": sum(len(ids) for ids, _, _ in written),
        "loss_tokens": sum(int(mask.sum()) for _, mask, _ in written),
    }
    assert token_counts(record_batch([])) == {"samples": 0, "tokens": 0, "loss_tokens": 0}
    write_dataset(str(tmp_path / "ds"), written, shards=2)
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["counts"] == counts


def test_a_data_file_cut_short_is_an_error_naming_it(tmp_path: Path) -> None:
    write_dataset(str(tmp_path / "ds"), rows(40), shards=2)
    path = tmp_path / "ds" / "data-00001-of-00002.arrow"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"data-00001-of-00002\.arrow is damaged or cut short"):
        open_dataset(str(tmp_path / "ds"))


def test_a_damaged_shard_is_not_reused(tmp_path: Path) -> None:
    store = ShardStore(str(tmp_path / "out"), {"v": 1}, overwrite=False)
    data = stream_bytes(record_batch(rows(5)))
    marker = store.save(0, "digest", data, {"samples": 5}, [])
    assert store.finished(0, "digest") == marker
    (tmp_path / "out" / marker["file"]).write_bytes(data[:-8])
    assert store.finished(0, "digest") is None  # redone, not kept


def test_filter_stream_drops_samples_by_source_and_recounts() -> None:
    written = rows(6)
    data, counts = filter_stream(stream_bytes(record_batch(written)), lambda s: s != "data.jsonl:2")
    kept = [r for r in written if r[2] != "data.jsonl:2"]
    assert data == stream_bytes(record_batch(kept))
    assert counts == token_counts(record_batch(kept))
    empty, counts = filter_stream(data, lambda s: False)
    assert counts["samples"] == 0 and empty == stream_bytes(record_batch([]))
