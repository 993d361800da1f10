"""`flashdraft prepare`: conversations and completions -> a trainable Arrow dataset.

Options. `PrepareConfig` and the settings recorded from it (`data_settings`,
`manifest_options`) are in `flashdraft.data.prepare_config`.

Pipeline. The inputs are read in order and cut into shards of `--shard-size` records
(`flashdraft.data.shards`). A `ShardProcessor` per worker parses, renders, tokenizes and
masks a shard (`flashdraft.data.template_fast`) and returns it as Arrow bytes; the main
process writes each shard with a done marker, in input order.

Order. Output order is input order: files as given (globs and directories sorted), lines
in order, a record's extra samples (`file:line#turn`) before its main one. It depends
neither on `--workers` nor on timing, so a run is byte-for-byte reproducible; the trainer
shuffles. `--seed` picks the samples shown by `--preview`.

Resume. `OUT/.work/` keeps the run's settings (`data_settings`: the config fields tagged
"data") and, per finished shard, a marker: counts, rejects and a digest of the shard's input
lines. Running again into OUT with the same settings skips every shard whose marker matches
its input, redoes an interrupted one (it has no marker), and finishes; different settings
are refused unless `--overwrite`. A finished dataset (one with a manifest) records the size
and sha256 of every input: when they differ, running again is refused unless `--overwrite`
(which still reuses the shards whose input lines did not change).

Checks. A bad record (malformed JSON, invalid UTF-8, unknown role, non-alternating turns,
an empty assistant turn, a template failure, a sample over `--max-length` with
`--overlong drop`, an `id` that an earlier record already has, a record over
`--max-record-bytes` (checked before parsing) or a sample over `--max-record-tokens`) is
counted and written to `rejects.jsonl`, never fatal on its own; more than
`--max-reject-rate` of them fails the run. Inputs without a single record are refused ("no
records in FILE") before anything is written; a compressed input cut short or not in its
format stops the run where it breaks (`storage.DamagedInput`; finished shards are kept). Then the audit checks (`flashdraft.data.audit`)
run on the written dataset and fail the run unless `--allow-degenerate`. A failed dataset
is written with `status: failed` in its manifest, which the trainer refuses; fix the cause
or the thresholds and run again (finished shards are reused).
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashdraft import __version__, storage
from flashdraft.data.audit import audit_dataset, format_report
from flashdraft.data.dataset import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    REJECTS,
    ShardStore,
    filter_stream,
    fingerprint,
    open_dataset,
    record_batch,
    stream_bytes,
    token_counts,
)
from flashdraft.data.formats import (
    RecordError,
    parse_line,
    parse_record,
    record_id,
    record_tools,
)
from flashdraft.data.loops import untrain_loops_batch
from flashdraft.data.prepare_config import PrepareConfig, data_settings, manifest_options
from flashdraft.data.preview import format_preview, preview_indices
from flashdraft.data.shards import Inputs, Lines, ShardResult, inputs_difference, process_shards
from flashdraft.data.template import (
    RenderedSample,
    encode,
    load_tokenizer,
    tokenizer_fingerprint,
)
from flashdraft.data.template_fast import FastChatTemplate
from flashdraft.log import get_logger

log = get_logger(__name__)


# -- one shard (in a worker) -----------------------------------------------------------------


class ShardProcessor:
    """Records -> samples: parse, render with the chat template, tokenize and mask, then
    apply --max-length. Built once per worker from the (picklable) config."""

    def __init__(self, config: PrepareConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
        self.template = FastChatTemplate(self.tokenizer, config.template)

    def __call__(self, index: int, lines: Lines) -> ShardResult:
        started = time.process_time()
        rejects: list[tuple[str, str]] = []
        record_ids: list[tuple[str, str]] = []
        rendered = self._render(lines, rejects, record_ids)
        encoded = encode(self.tokenizer, [sample for _, sample in rendered])
        rows: list[tuple[np.ndarray, np.ndarray, str]] = []
        truncated: list[str] = []
        loops: list[tuple[str, int]] = []
        for (source, _), result in zip(rendered, encoded, strict=True):
            if not isinstance(result, RecordError):
                ids, mask = result
                result = self._fit(ids, mask)
                if not isinstance(result, RecordError) and len(result[0]) < len(ids):
                    truncated.append(source)
            if isinstance(result, RecordError):
                rejects.append((source, str(result)))
                continue
            rows.append((*result, source))
        if self.config.loops == "untrain" and rows:
            rows = self._untrain_loops(rows, loops)
        batch = record_batch(rows)
        totals = token_counts(batch)
        counts = {
            "records": len(lines),
            "samples": totals["samples"],
            "rejected": len(rejects),
            "truncated": len(truncated),
            "loop_untrained": sum(n for _, n in loops),
            "tokens": totals["tokens"],
            "loss_tokens": totals["loss_tokens"],
        }
        return ShardResult(
            index=index,
            data=stream_bytes(batch),
            counts=counts,
            rejects=rejects,
            cpu_seconds=time.process_time() - started,
            ids=record_ids,
            truncated=truncated,
            loop_untrained=loops,
        )

    def _render(
        self, lines: Lines, rejects: list[tuple[str, str]], record_ids: list[tuple[str, str]]
    ) -> list[tuple[str, RenderedSample]]:
        """(source, sample) for every sample of the good records; bad ones go to `rejects`,
        (source, id) of the good ones that have their own id to `record_ids`."""
        rendered = []
        bytes_limit = self.config.max_record_bytes
        for source, raw in lines:
            if bytes_limit is not None and len(raw) > bytes_limit:
                # Before parsing: a 50 MB record once took 8.5 GB to tokenize.
                rejects.append((source, f"{len(raw)} bytes, over --max-record-bytes {bytes_limit}"))
                continue
            try:
                record = parse_line(raw)
                samples = self.template.samples(parse_record(record), record_tools(record))
            except RecordError as err:
                rejects.append((source, str(err)))
                continue
            own = record_id(record)
            if own is not None:
                record_ids.append((source, own))
            # The last sample holds the record's last trained turn; earlier ones are the
            # turns a template rewrote, named by their message index.
            rendered += [
                (source if k == len(samples) - 1 else f"{source}#{s.turn}", s)
                for k, s in enumerate(samples)
            ]
        return rendered

    def _untrain_loops(
        self, rows: list[tuple[np.ndarray, np.ndarray, str]], loops: list[tuple[str, int]]
    ) -> list[tuple[np.ndarray, np.ndarray, str]]:
        """--loops untrain on the shard's samples at once; (source, tokens untrained) of each
        that lost some go to `loops`. (A sample left with nothing trained is what the audit's
        empty-response check counts.)"""
        cuts = np.concatenate(([0], np.cumsum([len(ids) for ids, _, _ in rows])))
        masks, lost = untrain_loops_batch(
            np.concatenate([ids for ids, _, _ in rows]),
            np.concatenate([mask for _, mask, _ in rows]),
            cuts,
            self.config.loop_keep,
            self.config.loop_min,
        )
        loops += [(source, int(n)) for (_, _, source), n in zip(rows, lost, strict=True) if n]
        return [
            (ids, masks[cuts[j] : cuts[j + 1]], source) for j, (ids, _, source) in enumerate(rows)
        ]

    def _fit(
        self, ids: np.ndarray, mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | RecordError:
        """Apply --max-record-tokens, then --max-length and --overlong, to one sample."""
        cap = self.config.max_record_tokens
        if cap is not None and len(ids) > cap:
            return RecordError(f"{len(ids)} tokens, over --max-record-tokens {cap}")
        limit = self.config.max_length
        if limit is None or len(ids) <= limit:
            return ids, mask
        if self.config.overlong == "drop":
            return RecordError(f"{len(ids)} tokens, over --max-length {limit}")
        if not mask[:limit].any():
            return RecordError(f"no trained token within --max-length {limit}")
        return ids[:limit], mask[:limit]


# -- the run ---------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class PrepareResult:
    manifest: dict[str, Any]
    report: str  # the audit report, human readable
    preview: str
    degenerate: list[str]  # audit problems that failed the run (--allow-degenerate keeps them)
    seconds: float  # wall, whole run
    process_seconds: float  # wall, reading and processing the shards
    worker_cpu_seconds: float  # CPU time workers spent on shards processed in this run
    reused_shards: int

    @property
    def ok(self) -> bool:
        return self.manifest["status"] == "complete"


class DuplicateIds:
    """Records whose own `id` an earlier record already has are rejected, as `generate`
    does: decided in input order across shards (an `OrderedStage`), so the first one wins
    whatever the number of workers, and again on resume (a reused shard's marker records
    its ids and the duplicates it dropped; if those differ now, the shard is redone)."""

    def __init__(self) -> None:
        self.first: dict[str, str] = {}  # id -> source of the record that has it first

    def _duplicates(self, ids: list[tuple[str, str]]) -> tuple[dict[str, str], dict[str, str]]:
        """({source of a duplicate: source of the first}, {new id: its source})."""
        duplicates: dict[str, str] = {}
        new: dict[str, str] = {}
        for source, own in ids:
            first = self.first.get(own) or new.get(own)
            if first is None:
                new[own] = source
            else:
                duplicates[source] = first
        return duplicates, new

    def apply(self, result: ShardResult) -> ShardResult:
        duplicates, new = self._duplicates(result.ids)
        self.first.update(new)
        result.extra = {"ids": result.ids, "duplicates": list(duplicates)}
        if not duplicates:
            return result
        by_id = dict(result.ids)

        def record_of(source: str) -> str:  # a sample "file:line#turn" -> its record
            return source if source in duplicates else source.rsplit("#", 1)[0]

        result.data, totals = filter_stream(result.data, lambda s: record_of(s) not in duplicates)
        result.counts = {
            **result.counts,
            **totals,
            "rejected": result.counts["rejected"] + len(duplicates),
            "truncated": sum(record_of(s) not in duplicates for s in result.truncated),
            "loop_untrained": sum(
                n for s, n in result.loop_untrained if record_of(s) not in duplicates
            ),
        }
        result.rejects = [
            *result.rejects,
            *(
                (source, f"duplicate id {by_id[source]!r} (ids must be unique; first at {first})")
                for source, first in duplicates.items()
            ),
        ]
        return result

    def replay(self, marker: dict[str, Any]) -> bool:
        if "ids" not in marker:  # a shard of an earlier version: its ids are unknown
            return False
        ids = [(str(source), str(own)) for source, own in marker["ids"]]
        duplicates, new = self._duplicates(ids)
        if list(duplicates) != marker["duplicates"]:
            return False
        self.first.update(new)
        return True


def prepare(config: PrepareConfig) -> PrepareResult:
    """Run the whole pipeline; the dataset and its manifest are in `config.output`."""
    started = time.perf_counter()
    files = storage.expand_inputs(config.inputs)
    tokenizer = load_tokenizer(config.tokenizer)
    FastChatTemplate(tokenizer, config.template).check()
    if config.template.thinking == "off" and "enable_thinking" not in str(tokenizer.chat_template):
        log.info(
            "note: the chat template has no enable_thinking switch; --thinking off acts as strip"
        )
    tokenizer_sha256 = tokenizer_fingerprint(tokenizer)
    check_inputs_unchanged(config, files)
    created = not storage.exists(config.output)
    store = ShardStore(
        config.output, data_settings(config, tokenizer_sha256), overwrite=config.overwrite
    )
    inputs = Inputs(files)
    workers = config.num_workers()
    log.info(
        f"prepare: {len(files)} input file(s), {workers} worker(s), "
        f"shards of {config.shard_size} records"
    )
    process_started = time.perf_counter()
    # One worker processes in this process and reuses the tokenizer loaded above.
    make_processor = functools.partial(ShardProcessor, config, tokenizer if workers == 1 else None)
    processed = process_shards(
        inputs,
        store,
        make_processor,
        shard_size=config.shard_size,
        workers=workers,
        progress=config.progress,
        ordered=DuplicateIds(),
    )
    process_seconds = time.perf_counter() - process_started
    _check_records(inputs, config.output if created else None)

    names = store.finalize(processed.markers)
    manifest = _manifest(config, inputs, tokenizer_sha256, processed.markers, names)
    manifest_url = storage.join(config.output, MANIFEST)
    # Written before the checks so that a crash in them never leaves a "complete" dataset.
    storage.write_json_atomic(manifest_url, manifest)
    try:
        dataset = open_dataset(config.output, require_complete=False)
        audit = audit_dataset(dataset, tokenizer, config.thresholds)
    except BaseException as err:  # interrupted or failed: "failed", never left "checking"
        manifest["status"] = "failed"
        manifest["problems"] = [f"the checks did not finish ({type(err).__name__}: {err})"]
        storage.write_json_atomic(manifest_url, manifest)
        raise
    problems = _reject_problems(config, manifest)
    degenerate = audit.problems
    if audit.problems and config.allow_degenerate and audit.samples:
        manifest["warnings"], degenerate = audit.problems, []
    manifest["status"] = "failed" if problems or degenerate else "complete"
    manifest["problems"] = problems + degenerate
    manifest["audit"] = {
        k: v for k, v in audit.to_json().items() if k not in ("problems", "top_repeats")
    }
    storage.write_json_atomic(manifest_url, manifest)

    seed = config.preview_options.seed
    indices = preview_indices(dataset, config.preview, seed) if config.preview else []
    colored = config.preview_options.colored()
    return PrepareResult(
        manifest=manifest,
        report=format_report(audit),
        preview=format_preview(dataset, indices, tokenizer, color=colored) if indices else "",
        degenerate=degenerate,
        seconds=time.perf_counter() - started,
        process_seconds=process_seconds,
        worker_cpu_seconds=processed.cpu_seconds,
        reused_shards=processed.reused,
    )


def check_inputs_unchanged(config: PrepareConfig, files: list[str]) -> None:
    """A finished dataset in `--output` (it has a manifest) was prepared from exactly these
    inputs (URLs, sizes, sha256), or `--overwrite` is given; else FileExistsError."""
    url = storage.join(config.output, MANIFEST)
    if config.overwrite or not storage.exists(url):
        return
    manifest = storage.read_json(url)
    recorded = manifest.get("inputs") if isinstance(manifest, dict) else None
    if not isinstance(recorded, list):
        return  # not one of ours: ShardStore refuses it
    difference = inputs_difference(recorded, files)
    if difference is not None:
        raise FileExistsError(
            f"output {config.output!r} holds a dataset prepared from other inputs ({difference}); "
            "pass --overwrite to replace it, or choose another --output"
        )


def _check_records(inputs: Inputs, created: str | None) -> None:
    """Refuse inputs without a single record, before anything but the resume state exists
    (removed again when this run `created` the output); warn about each empty file."""
    empty = [r["url"] for r in inputs.records if r["records"] == 0]
    if len(empty) < len(inputs.records):
        for url in empty:
            log.warning(f"prepare: no records in {url} (an empty input; the others are used)")
        return
    if created is not None:
        fs, path = storage.filesystem(created)
        fs.rm(path, recursive=True)
    raise ValueError(
        f"no records in {' or '.join(empty)}: "
        + ("the file is empty" if len(empty) == 1 else "every input is empty")
        + " (or has only blank lines)"
    )


def _reason_kind(reason: str) -> str:
    """A reject reason without its specifics, to group them in the summary."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", reason))


def _tokenizer_name(path: str) -> str:
    # A local path is stored absolute so that `flashdraft audit` finds it from anywhere.
    return os.path.abspath(path) if os.path.exists(path) else path


def _manifest(
    config: PrepareConfig,
    inputs: Inputs,
    tokenizer_sha256: str,
    markers: list[dict[str, Any]],
    data_files: list[str],
) -> dict[str, Any]:
    """The record of what was prepared from what, and how; `status` is set by the checks."""
    keys = ["records", "samples", "rejected", "truncated", "tokens", "loss_tokens"]
    if config.loops != "keep":  # manifests of the default settings stay as they were
        keys.insert(4, "loop_untrained")
    reasons = Counter(_reason_kind(r) for m in markers for _, r in m["rejects"])
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "status": "checking",
        "created_by": f"flashdraft {__version__}",
        "inputs": inputs.records,
        "tokenizer": {"name": _tokenizer_name(config.tokenizer), "sha256": tokenizer_sha256},
        "options": manifest_options(config),
        "counts": {k: sum(m["counts"].get(k, 0) for m in markers) for k in keys},
        "rejected_by_reason": dict(reasons.most_common()),
        "data_files": data_files,
        "content_sha256": fingerprint(m["sha256"] for m in markers),
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
