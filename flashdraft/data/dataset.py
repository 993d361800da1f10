"""The prepared dataset on disk (docs/design.md §7) and the reader the trainer uses.

Layout: exactly what `datasets.Dataset.save_to_disk` writes, produced with pyarrow alone so
that the training machine needs no `datasets` package:

    OUT/data-00000-of-0000N.arrow   Arrow IPC *stream* files, one per prepare shard
    OUT/dataset_info.json           the HF feature types
    OUT/state.json                  the list of data files (load_from_disk reads it)
    OUT/manifest.json               flashdraft's record: inputs, tokenizer, options, counts
    OUT/rejects.jsonl               one line per rejected record: source and reason

Columns: `input_ids` list<int32>, `loss_mask` list<int8> (1 = trained), `num_tokens` int32,
`num_loss_tokens` int32, `source` string ("file:line", "#k" for extra samples of a record).

`open_dataset` memory-maps local files (nothing is copied: `sample(i)` returns read-only
views into the mapped files) and reads remote ones (s3://...) through fsspec into memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from flashdraft import storage

FORMAT = "flashdraft-prepared-dataset"
FORMAT_VERSION = 1

MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"
STATE = "state.json"
WORK = ".work"
INFO = "dataset_info.json"

# HF `datasets` feature types, as save_to_disk records them.
FEATURES: dict[str, Any] = {
    "input_ids": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int8", "_type": "Value"}, "_type": "List"},
    "num_tokens": {"dtype": "int32", "_type": "Value"},
    "num_loss_tokens": {"dtype": "int32", "_type": "Value"},
    "source": {"dtype": "string", "_type": "Value"},
}
SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("source", pa.string()),
    ],
    metadata={"huggingface": json.dumps({"info": {"features": FEATURES}})},
)


# -- writing ---------------------------------------------------------------------------------


def record_batch(samples: Sequence[tuple[np.ndarray, np.ndarray, str]]) -> pa.RecordBatch:
    """(input_ids, loss_mask, source) per sample -> one record batch of the dataset's columns (docs/design.md §7)."""
    lengths = np.array([len(ids) for ids, _, _ in samples], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32))
    ids = np.concatenate([s[0] for s in samples]) if samples else np.zeros(0, np.int32)
    mask = np.concatenate([s[1] for s in samples]) if samples else np.zeros(0, np.int8)
    loss = np.array([int(s[1].sum()) for s in samples], dtype=np.int32)
    columns = [
        pa.ListArray.from_arrays(offsets, pa.array(ids.astype(np.int32, copy=False))),
        pa.ListArray.from_arrays(offsets, pa.array(mask.astype(np.int8, copy=False))),
        pa.array(lengths),
        pa.array(loss),
        pa.array([s[2] for s in samples], type=pa.string()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)


def token_counts(batch: pa.RecordBatch) -> dict[str, int]:
    """Samples, tokens and trained tokens of a record batch, from its count columns."""
    return {
        "samples": batch.num_rows,
        "tokens": int(batch.column("num_tokens").to_numpy().sum(dtype=np.int64)),
        "loss_tokens": int(batch.column("num_loss_tokens").to_numpy().sum(dtype=np.int64)),
    }


def stream_bytes(batch: pa.RecordBatch) -> bytes:
    """One Arrow IPC stream holding `batch` (an empty batch gives a schema-only stream)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SCHEMA) as writer:
        if batch.num_rows:
            writer.write_batch(batch)
    return bytes(sink.getvalue().to_pybytes())


def filter_stream(data: bytes, keep: Callable[[str], bool]) -> tuple[bytes, dict[str, int]]:
    """An Arrow stream of samples (`stream_bytes`) without the samples whose source `keep`
    refuses, and the `token_counts` of what is left."""
    table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    sources = table.column("source").to_pylist()
    table = table.filter(pa.array([keep(s) for s in sources], type=pa.bool_()))
    batches = table.combine_chunks().to_batches()
    batch = batches[0] if batches else record_batch([])
    return stream_bytes(batch), token_counts(batch)


def data_file_name(index: int, count: int) -> str:
    return f"data-{index:05d}-of-{count:05d}.arrow"


def write_layout(url: str, data_files: Sequence[str], fingerprint: str) -> None:
    """The `datasets` side files that make `load_from_disk(url)` work."""
    state: dict[str, Any] = {
        "_data_files": [{"filename": name} for name in data_files],
        "_fingerprint": fingerprint[:16],
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    info = {
        "citation": "",
        "description": "flashdraft prepared dataset (see manifest.json)",
        "features": FEATURES,
        "homepage": "",
        "license": "",
    }
    storage.write_json_atomic(storage.join(url, INFO), info)
    storage.write_json_atomic(storage.join(url, STATE), state)


def write_dataset(
    url: str,
    rows: Sequence[tuple[np.ndarray, np.ndarray, str]],
    *,
    shards: int = 1,
    manifest: dict[str, Any] | None = None,
) -> None:
    """A complete prepared dataset from samples in memory (tests, small tools).

    `flashdraft prepare` writes the same layout shard by shard; `manifest` adds or
    overrides manifest fields.
    """
    storage.makedirs(url)
    bounds = np.linspace(0, len(rows), shards + 1).astype(int)
    names, digests = [], []
    counts = {"samples": 0, "tokens": 0, "loss_tokens": 0}
    for i in range(shards):
        batch = record_batch(rows[bounds[i] : bounds[i + 1]])
        for key, value in token_counts(batch).items():
            counts[key] += value
        data = stream_bytes(batch)
        names.append(data_file_name(i, shards))
        digests.append(hashlib.sha256(data).hexdigest())
        storage.write_bytes_atomic(storage.join(url, names[-1]), data)
    write_layout(url, names, fingerprint(digests))
    record = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "status": "complete",
        "counts": counts,
        "content_sha256": fingerprint(digests),
    }
    storage.write_json_atomic(storage.join(url, MANIFEST), {**record, **(manifest or {})})


# -- sharded writing with resume --------------------------------------------------------------------


class ShardStore:
    """A dataset directory written shard by shard, with the state to resume.

    OUT/.work/settings.json holds what decides the data; a shard is done once its marker
    OUT/.work/shard-i.json exists (written after its data, with its counts, rejects and
    the digest of its input). `finalize` gives the shards their `data-i-of-N.arrow` names
    and writes the `datasets` side files and rejects.jsonl; the manifest is the caller's.
    """

    def __init__(self, output: str, settings: dict[str, Any], *, overwrite: bool) -> None:
        self.output = output
        self.work = storage.join(output, WORK)
        self.fs, self.path = storage.filesystem(output)
        settings_url = storage.join(self.work, "settings.json")
        fresh = not self.fs.exists(self.path) or self._left_empty()
        if not fresh:
            ours = storage.exists(settings_url) or storage.exists(storage.join(output, MANIFEST))
            if not ours:
                raise FileExistsError(
                    f"output {output!r} exists and is not a flashdraft dataset; choose a new "
                    "or empty directory"
                )
            same = storage.exists(settings_url) and storage.read_json(settings_url) == settings
            if not same:
                if not overwrite:
                    raise FileExistsError(
                        f"output {output!r} holds a dataset prepared with other settings "
                        "(tokenizer, thinking, turns, max length, loops, record limits or shard "
                        "size); pass --overwrite to replace it, or choose another --output"
                    )
                self.fs.rm(self.path, recursive=True)
        storage.makedirs(self.work)
        storage.write_json_atomic(settings_url, settings)
        self.markers: dict[int, dict[str, Any]] = {}
        for path in self.fs.glob(storage.join(self.work, "shard-*.json")):
            with self.fs.open(path, "rb") as f:
                marker = json.load(f)
            self.markers[int(marker["index"])] = marker

    def _left_empty(self) -> bool:
        """An empty output, or one holding only an empty OUT/.work/: what a run leaves that
        failed to write its first file (a full disk), which must not block the retry."""
        names = [os.path.basename(p.rstrip("/")) for p in self.fs.ls(self.path, detail=False)]
        return not names or (names == [WORK] and not self.fs.find(storage.filesystem(self.work)[1]))

    def _url(self, name: str) -> str:
        return storage.join(self.output, name)

    def finished(self, index: int, digest: str) -> dict[str, Any] | None:
        """The marker of shard `index` if it was finished from the same input and its data
        file is still what was written (its sha256)."""
        marker = self.markers.get(index)
        if not marker or marker["digest"] != digest:
            return None
        url = self._url(marker["file"])
        if not storage.exists(url) or storage.file_digest(url)[0] != marker["sha256"]:
            return None
        return marker

    def save(
        self,
        index: int,
        digest: str,
        data: bytes,
        counts: dict[str, int],
        rejects: list[tuple[str, str]],
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        name = f"{WORK}/shard-{index:05d}.arrow"
        storage.write_bytes_atomic(self._url(name), data)
        marker = {
            "index": index,
            "digest": digest,
            "file": name,
            "sha256": hashlib.sha256(data).hexdigest(),
            "counts": counts,
            "rejects": rejects,
            **(extra or {}),
        }
        # The marker is written last: a shard without one is redone on resume.
        self._write_marker(marker)
        return marker

    def _write_marker(self, marker: dict[str, Any]) -> None:
        storage.write_json_atomic(self._url(f"{WORK}/shard-{marker['index']:05d}.json"), marker)
        self.markers[int(marker["index"])] = marker

    def finalize(self, markers: list[dict[str, Any]]) -> list[str]:
        """Move shards to their `data-i-of-N.arrow` names, drop stale files, write the layout."""
        names = [data_file_name(i, len(markers)) for i in range(len(markers))]
        for marker, name in zip(markers, names, strict=True):
            if marker["file"] != name:
                self.fs.mv(self._url(marker["file"]), self._url(name))
                marker["file"] = name
                self._write_marker(marker)
        keep = set(names)
        for path in self.fs.glob(self._url("data-*-of-*.arrow")):
            if os.path.basename(path) not in keep:
                self.fs.rm(path)
        for index in [i for i in self.markers if i >= len(markers)]:
            self.fs.rm(self._url(f"{WORK}/shard-{index:05d}.json"))
            del self.markers[index]
        rejects = "".join(
            json.dumps({"source": source, "reason": reason}) + "\n"
            for marker in markers
            for source, reason in marker["rejects"]
        )
        storage.write_text_atomic(self._url(REJECTS), rejects)
        write_layout(self.output, names, fingerprint(m["sha256"] for m in markers))
        return names


# -- reading ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _Batch:
    """The columns of one record batch as numpy views (zero-copy for local files)."""

    ids: np.ndarray  # all input_ids of the batch, concatenated
    mask: np.ndarray
    offsets: np.ndarray  # sample j is ids[offsets[j]:offsets[j + 1]]
    num_tokens: np.ndarray
    num_loss_tokens: np.ndarray
    sources: pa.Array


def _list_parts(column: pa.Array, dtype: type, url: str) -> tuple[np.ndarray, np.ndarray]:
    if not pa.types.is_list(column.type) or column.null_count:
        raise ValueError(f"{url}: a token column is not a list column without nulls")
    values = column.values.to_numpy(zero_copy_only=True)
    if values.dtype != dtype:
        raise ValueError(f"{url}: expected {np.dtype(dtype).name} tokens, found {values.dtype}")
    return values, column.offsets.to_numpy(zero_copy_only=True)


def _read_batches(url: str) -> list[_Batch]:
    """Every record batch of one data file; a file cut short or damaged is a ValueError
    naming it, never a raw pyarrow error."""
    try:
        return _read_stream(url)
    except (pa.ArrowException, OSError, EOFError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(
            f"{url} is damaged or cut short ({err}); run the `flashdraft prepare` command "
            "that wrote it again: it redoes the damaged parts"
        ) from None


def _read_stream(url: str) -> list[_Batch]:
    if storage.is_local(url):
        path = url.removeprefix("file://")
        source: Any = pa.memory_map(path, "r")
    else:
        fs, path = storage.filesystem(url)
        source = pa.py_buffer(fs.cat_file(path))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid as err:
        raise ValueError(f"{url} is not an Arrow IPC stream file: {err}") from None
    missing = [name for name in SCHEMA.names if name not in reader.schema.names]
    if missing:
        raise ValueError(f"{url} lacks the column(s) {', '.join(missing)}")
    batches = []
    for batch in reader:
        ids, offsets = _list_parts(batch.column("input_ids"), np.int32, url)
        mask, mask_offsets = _list_parts(batch.column("loss_mask"), np.int8, url)
        num_tokens = batch.column("num_tokens").to_numpy(zero_copy_only=False)
        if not np.array_equal(offsets, mask_offsets) or not np.array_equal(
            np.diff(offsets), num_tokens
        ):
            raise ValueError(f"{url}: input_ids, loss_mask and num_tokens disagree in length")
        batches.append(
            _Batch(
                ids=ids,
                mask=mask,
                offsets=offsets,
                num_tokens=num_tokens,
                num_loss_tokens=batch.column("num_loss_tokens").to_numpy(zero_copy_only=False),
                sources=batch.column("source"),
            )
        )
    return batches


class PreparedDataset:
    """Random access to prepared samples, in dataset order, over one or more datasets."""

    manifest: dict[str, Any]
    num_tokens: np.ndarray  # int64, one per sample

    def __init__(
        self,
        urls: Sequence[str],
        manifests: Sequence[dict[str, Any]],
        batches: list[_Batch],
        *,
        require_complete: bool = True,
    ) -> None:
        self.urls = list(urls)
        self._require_complete = require_complete
        self.manifest = manifests[0] if len(manifests) == 1 else _combined(manifests)
        self._batches = batches
        sizes = [len(b.num_tokens) for b in batches]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.num_tokens = (
            np.concatenate([b.num_tokens for b in batches]).astype(np.int64)
            if batches
            else np.zeros(0, np.int64)
        )
        self.num_loss_tokens = (
            np.concatenate([b.num_loss_tokens for b in batches]).astype(np.int64)
            if batches
            else np.zeros(0, np.int64)
        )

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, index: int) -> tuple[_Batch, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        index %= len(self)
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self._batches[k], index - int(self._starts[k])

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32, loss_mask int8) of sample `index`, as read-only views."""
        batch, row = self._locate(index)
        lo, hi = batch.offsets[row], batch.offsets[row + 1]
        return batch.ids[lo:hi], batch.mask[lo:hi]

    def batches(self) -> Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(input_ids, loss_mask, offsets) per stored batch, for bulk readers such as audit.

        Sample j of a batch is `input_ids[offsets[j]:offsets[j + 1]]`; batches come in
        dataset order.
        """
        for batch in self._batches:
            yield batch.ids, batch.mask, batch.offsets

    def source(self, index: int) -> str:
        batch, row = self._locate(index)
        return str(batch.sources[row].as_py())

    def __reduce__(self) -> tuple[Any, ...]:
        # DataLoader workers reopen (and re-map) the files instead of pickling the data.
        return (_reopen, (self.urls, self._require_complete))


def _reopen(urls: list[str], require_complete: bool) -> PreparedDataset:
    return open_datasets(urls, require_complete=require_complete)


def _combined(manifests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for manifest in manifests:
        for key, value in manifest.get("counts", {}).items():
            counts[key] = counts.get(key, 0) + int(value)
    return {"format": FORMAT, "parts": list(manifests), "counts": counts}


def read_manifest(url: str, *, require_complete: bool = True) -> dict[str, Any]:
    """The manifest of a prepared dataset; clear errors if `url` is not one."""
    path = storage.join(url, MANIFEST)
    if not storage.exists(url):
        raise FileNotFoundError(f"dataset {url!r} does not exist")
    if not storage.exists(path):
        raise FileNotFoundError(
            f"{url!r} is not a prepared dataset: it has no {MANIFEST} "
            "(create one with `flashdraft prepare`, or let an interrupted prepare finish)"
        )
    manifest = storage.read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a flashdraft dataset manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{url!r} has dataset format version {manifest.get('version')}, "
            f"this flashdraft reads version {FORMAT_VERSION}; prepare it again"
        )
    if require_complete and manifest.get("status") != "complete":
        problems = "; ".join(manifest.get("problems", [])) or "see its manifest.json"
        raise ValueError(
            f"{url!r} failed its checks when it was prepared and must not be trained on: {problems}"
        )
    return manifest


def _data_files(url: str) -> list[str]:
    state = storage.read_json(storage.join(url, STATE))
    names = [entry["filename"] for entry in state.get("_data_files", [])]
    if not names:
        raise ValueError(f"{url!r} lists no data files in {STATE}")
    return [storage.join(url, name) for name in names]


def open_dataset(url: str, *, require_complete: bool = True) -> PreparedDataset:
    """A prepared dataset (local: memory-mapped; remote: read through fsspec)."""
    return open_datasets([url], require_complete=require_complete)


def open_datasets(urls: Iterable[str], *, require_complete: bool = True) -> PreparedDataset:
    """Several prepared datasets as one, concatenated in the order given."""
    urls = [os.path.abspath(u.removeprefix("file://")) if storage.is_local(u) else u for u in urls]
    if not urls:
        raise ValueError("no dataset given")
    manifests = [read_manifest(u, require_complete=require_complete) for u in urls]
    batches = [b for u in urls for f in _data_files(u) for b in _read_batches(f)]
    return PreparedDataset(urls, manifests, batches, require_complete=require_complete)


def fingerprint(digests: Iterable[str]) -> str:
    """One sha256 over the data files' sha256 digests, in order: the dataset's content."""
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def dataset_identity(url: str) -> str:
    """What a prepared dataset holds, cheaply: the fingerprint of its data files' sha256s
    (manifest `content_sha256`), read without touching the data. A dataset re-prepared in
    place with other samples gets another identity; the same samples, the same one.

    Datasets prepared before the manifest recorded it give the 16-hex-digit prefix that
    `state.json` has always kept (the same digests, truncated).
    """
    manifest = read_manifest(url, require_complete=False)
    content = manifest.get("content_sha256")
    if isinstance(content, str) and content:
        return content
    state = storage.read_json(storage.join(url, STATE))
    short = state.get("_fingerprint") if isinstance(state, dict) else None
    if not isinstance(short, str) or not short:
        raise ValueError(f"{url!r} records no content fingerprint; prepare it again")
    return short
