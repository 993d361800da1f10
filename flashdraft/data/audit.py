"""Audit a prepared dataset: statistics, and the checks that refuse degenerate data.

A drafter is only as good as its trained tokens, and broken data trains without error.
The checks (docs/design.md §8 trap 8), each with a threshold option (`Thresholds`):

* all-ones loss masks: the chat template marked no assistant turn, so prompts are trained;
* empty responses: samples whose trained text is nothing but end-of-turn tokens,
  whitespace or punctuation;
* repeated responses: the share of samples whose trained text repeats another sample's,
  compared exactly and ignoring case, whitespace and punctuation ("OK." = "ok"). A dataset
  once had 87% of samples train only `<think>\\n\\n</think>\\n\\nOK.`: refused here;
* tiny responses: the median number of trained tokens per sample;
* heavy truncation at `--max-length` (from the manifest's counts).

Also reported, not checked: the trained tokens that sit in repetition loops ("no no no ..."
to the end of a small target's answer) past each loop's first 16, which `prepare --loops
untrain` would leave untrained (`flashdraft.data.loops`).

`flashdraft prepare` runs the same checks on what it wrote and fails unless
`--allow-degenerate`; `flashdraft audit` (`audit(AuditConfig)`) exits 1 when any check fails,
and when `prepare` marked the dataset failed (its reject rate, its checks or a crash in them:
the trainer refuses such a dataset, whatever thresholds the audit is given).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.data.dataset import PreparedDataset, open_datasets
from flashdraft.data.loops import DATA_LOOP_KEEP, loop_excess_batch
from flashdraft.data.preview import PreviewOptions, format_preview, preview_indices, preview_json
from flashdraft.data.template import load_tokenizer


@dataclass(kw_only=True, slots=True)
class Thresholds:
    """The check thresholds, shared by `prepare` and `audit` (nested in both configs)."""

    max_repeated_share: float = option(
        0.10,
        ge=0,
        le=1,
        help="largest share of samples whose trained text repeats another's, ignoring case, "
        "whitespace and punctuation",
    )
    min_median_loss_tokens: float = option(
        8.0, ge=0, help="smallest median number of trained tokens per sample"
    )
    max_empty_share: float = option(
        0.01, ge=0, le=1, help="largest share of samples with an empty trained response"
    )
    max_all_ones_share: float = option(
        0.0, ge=0, le=1, help="largest share of samples whose every token is trained"
    )
    max_truncated_share: float = option(
        0.05, ge=0, le=1, help="largest share of samples truncated at --max-length"
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class AuditConfig:
    """`flashdraft audit`: what to audit, how to report it, and the check thresholds."""

    datasets: list[str] = option(
        positional=True, metavar="DIR", help="prepared dataset(s), concatenated"
    )
    preview: int = option(
        0, ge=0, metavar="N", help="show N samples with trained tokens highlighted"
    )
    json_output: bool = option(False, flag="--json", help="print one JSON report instead of text")
    tokenizer: str | None = option(
        None, help="tokenizer path (default: the one named in the manifest)"
    )
    preview_options: PreviewOptions = field(default_factory=PreviewOptions)
    thresholds: Thresholds = field(default_factory=Thresholds)

    def __post_init__(self) -> None:
        cfg.validate(self)
        if not self.datasets:
            raise cfg.ConfigError("datasets", self.datasets, "name at least one dataset")


# -- statistics ------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Repeat:
    count: int
    loss_tokens: int
    text: str  # the trained text of one of them (or its token ids without a tokenizer)
    example: int  # a sample index


@dataclass(kw_only=True, slots=True)
class Audit:
    samples: int
    tokens: int
    loss_tokens: int
    truncated: int | None
    all_ones: int
    empty: int
    identical: int  # samples whose trained tokens equal an earlier sample's
    repeated: int  # the same, ignoring case, whitespace and punctuation
    repeated_by: str  # how `repeated` was compared
    median_tokens: float
    median_loss_tokens: float
    top_repeats: list[Repeat]
    length_histogram: list[tuple[int, int, int]]  # [lo, hi) and count
    loss_histogram: list[tuple[int, int, int]]
    loop_samples: int = 0  # samples whose trained tokens hold a repetition loop
    loop_tokens: int = 0  # trained tokens in loops past each loop's first DATA_LOOP_KEEP
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _key(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=4)
def normalized_keys(tokenizer: Any) -> np.ndarray:
    """Token id -> a key of its text lowercased and stripped to letters and digits.

    0 marks tokens with no such text (whitespace, punctuation, special tokens), which the
    near-duplicate comparison skips. A token that is part of a multi-byte character keeps
    a key of its own id, so non-Latin text is never mistaken for empty.
    """
    size = len(tokenizer)
    pieces = tokenizer.backend_tokenizer.decode_batch(
        [[i] for i in range(size)], skip_special_tokens=False
    )
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    keys = np.zeros(size, dtype=np.uint64)
    for i, piece in enumerate(pieces):
        if i in special:
            continue
        if "\ufffd" in piece:
            keys[i] = _key(b"id:%d" % i)
            continue
        text = "".join(ch for ch in piece.lower() if ch.isalnum())
        if text:
            keys[i] = _key(text.encode())
    return keys


def _histogram(values: np.ndarray) -> list[tuple[int, int, int]]:
    """Counts in power-of-two bins [0, 1), [1, 2), [2, 4), ... up to the largest value."""
    top = int(values.max()) if len(values) else 0
    edges = [0, 1]
    while edges[-1] <= top:
        edges.append(edges[-1] * 2)
    counts, _ = np.histogram(values, bins=np.array(edges))
    return [(edges[i], edges[i + 1], int(c)) for i, c in enumerate(counts)]


def audit_dataset(dataset: PreparedDataset, tokenizer: Any | None, thresholds: Thresholds) -> Audit:
    """Statistics of every sample, then the checks; `problems` lists the failed ones."""
    keys = normalized_keys(tokenizer) if tokenizer is not None else None
    exact: set[int] = set()
    groups: dict[int, list[int]] = {}  # normalized key -> [count, first sample]
    empty = identical = loop_samples = loop_tokens = 0
    index = 0
    for ids, mask, offsets in dataset.batches():
        trained = ids[mask.astype(bool)]
        # cuts[j] = number of trained tokens before sample j: its trained tokens' start
        cuts = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])[offsets]
        excess = loop_excess_batch(trained, cuts)
        loop_samples += int(np.count_nonzero(excess))
        loop_tokens += int(excess.sum())
        for j in range(len(offsets) - 1):
            tokens = trained[int(cuts[j]) : int(cuts[j + 1])]
            key = _key(tokens.tobytes())
            identical += key in exact
            exact.add(key)
            if keys is not None:
                normal = keys[tokens]
                normal = normal[normal != 0]
                empty += len(normal) == 0
                key = _key(normal.tobytes())
            else:
                empty += len(tokens) == 0
            group = groups.setdefault(key, [0, index])
            group[0] += 1
            index += 1
    repeats = sorted(((c, i) for c, i in groups.values() if c > 1), reverse=True)[:5]
    counts = dataset.manifest.get("counts", {})
    truncated = counts.get("truncated")
    result = Audit(
        samples=len(dataset),
        tokens=int(dataset.num_tokens.sum()),
        loss_tokens=int(dataset.num_loss_tokens.sum()),
        truncated=None if truncated is None else int(truncated),
        all_ones=int(np.sum(dataset.num_loss_tokens == dataset.num_tokens)),
        empty=int(empty),
        identical=int(identical),
        repeated=len(dataset) - len(groups),
        repeated_by="text ignoring case, whitespace and punctuation"
        if keys is not None
        else "token ids (tokenizer unavailable)",
        median_tokens=float(np.median(dataset.num_tokens)) if len(dataset) else 0.0,
        median_loss_tokens=float(np.median(dataset.num_loss_tokens)) if len(dataset) else 0.0,
        top_repeats=[
            Repeat(
                count=c,
                loss_tokens=int(dataset.num_loss_tokens[i]),
                text=_trained_text(dataset, i, tokenizer),
                example=i,
            )
            for c, i in repeats
        ],
        length_histogram=_histogram(dataset.num_tokens),
        loss_histogram=_histogram(dataset.num_loss_tokens),
        loop_samples=int(loop_samples),
        loop_tokens=int(loop_tokens),
    )
    result.problems = find_problems(result, thresholds)
    return result


def _trained_text(dataset: PreparedDataset, index: int, tokenizer: Any | None) -> str:
    ids, mask = dataset.sample(index)
    trained = ids[mask.astype(bool)]
    if tokenizer is None:
        return " ".join(map(str, trained[:64].tolist()))
    return str(tokenizer.decode(trained.tolist(), skip_special_tokens=False))


def _share(count: int, total: int) -> str:
    return f"{count:,} of {total:,} samples ({count / max(total, 1):.1%})"


def find_problems(audit: Audit, thresholds: Thresholds) -> list[str]:
    """Each failed check as a plain explanation: what, how much, and what to do."""
    n = audit.samples
    if n == 0:
        return ["the dataset has no samples: every record was rejected (see rejects.jsonl)"]
    problems = []
    if audit.all_ones / n > thresholds.max_all_ones_share:
        problems.append(
            f"{_share(audit.all_ones, n)} train on every token (all-ones loss mask): the chat "
            "template marked no assistant turn, so the drafter would learn to predict prompts. "
            "Prepare again with a chat model's tokenizer."
        )
    if audit.empty / n > thresholds.max_empty_share:
        problems.append(
            f"{_share(audit.empty, n)} have an empty response: their trained tokens are only "
            "end-of-turn tokens, whitespace or punctuation. Filter or regenerate those responses "
            f"(threshold --max-empty-share {thresholds.max_empty_share})."
        )
    if audit.repeated / n > thresholds.max_repeated_share:
        common = "; ".join(
            f"{r.count:,} x {_clip(r.text)} ({r.loss_tokens} trained tokens)"
            for r in audit.top_repeats[:3]
        )
        problems.append(
            f"{_share(audit.repeated, n)} train on a response that another sample also "
            f"trains on (compared by {audit.repeated_by}). Most common: {common}. A drafter "
            "trained on this learns boilerplate; deduplicate, filter or regenerate the "
            "responses, or raise --max-repeated-share if the repetition is intended "
            f"(threshold {thresholds.max_repeated_share})."
        )
    if audit.median_loss_tokens < thresholds.min_median_loss_tokens:
        problems.append(
            f"the median sample trains on only {audit.median_loss_tokens:g} tokens (threshold "
            f"--min-median-loss-tokens {thresholds.min_median_loss_tokens:g}): the responses "
            "are too short to teach multi-token drafting. Use longer responses (e.g. "
            "regenerate them with the target) or lower the threshold."
        )
    if audit.truncated is not None and audit.truncated / n > thresholds.max_truncated_share:
        problems.append(
            f"{_share(audit.truncated, n)} were truncated at --max-length (threshold "
            f"--max-truncated-share {thresholds.max_truncated_share}): raise --max-length or "
            "use --overlong drop."
        )
    return problems


def _clip(text: str, width: int = 60) -> str:
    return repr(text if len(text) <= width else text[:width] + "...")


# -- report ----------------------------------------------------------------------------------


def _bars(histogram: list[tuple[int, int, int]], total: int) -> list[str]:
    top = max((c for _, _, c in histogram), default=0) or 1
    lines = []
    for lo, hi, count in histogram:
        if count == 0 and lo > 0:
            continue
        bar = "#" * max(int(40 * count / top), 1 if count else 0)
        lines.append(
            f"  [{lo:>7,}, {hi:>7,})  {bar:<40}  {count:>9,}  {count / max(total, 1):6.1%}"
        )
    return lines


def format_report(audit: Audit) -> str:
    n = max(audit.samples, 1)
    lines = [
        f"samples          {audit.samples:,}",
        f"tokens           {audit.tokens:,}  (median {audit.median_tokens:g} per sample)",
        f"trained tokens   {audit.loss_tokens:,}  ({audit.loss_tokens / max(audit.tokens, 1):.1%}"
        f" of tokens; median {audit.median_loss_tokens:g} per sample)",
        f"all-ones masks   {audit.all_ones:,}  ({audit.all_ones / n:.1%})",
        f"empty responses  {audit.empty:,}  ({audit.empty / n:.1%})",
        f"identical        {audit.identical:,}  ({audit.identical / n:.1%}) repeat an earlier "
        "sample's trained tokens",
        f"near-identical   {audit.repeated:,}  ({audit.repeated / n:.1%}) by {audit.repeated_by}",
    ]
    if audit.truncated is not None:
        lines.append(f"truncated        {audit.truncated:,}  ({audit.truncated / n:.1%})")
    if audit.loop_tokens:
        lines.append(
            f"loops            {audit.loop_samples:,} samples ({audit.loop_samples / n:.1%}) repeat "
            f"themselves: {audit.loop_tokens:,} trained tokens "
            f"({audit.loop_tokens / max(audit.loss_tokens, 1):.1%}) past each loop's first "
            f"{DATA_LOOP_KEEP} (prepare --loops untrain leaves them untrained)"
        )
    if audit.top_repeats:
        lines.append("most repeated responses:")
        lines += [f"  {r.count:>9,} x {_clip(r.text)}" for r in audit.top_repeats]
    lines.append("tokens per sample:")
    lines += _bars(audit.length_histogram, audit.samples)
    lines.append("trained tokens per sample:")
    lines += _bars(audit.loss_histogram, audit.samples)
    failed = [p for p in audit.problems if p.startswith("PREPARE FAILED")]
    degenerate = [p for p in audit.problems if p not in failed]
    lines += failed
    if degenerate:
        lines.append(f"DEGENERATE DATA ({len(degenerate)} check(s) failed):")
        lines += [f"  - {p}" for p in degenerate]
    if not audit.problems:
        lines.append("all checks passed")
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------


def load_audit_tokenizer(dataset: PreparedDataset, override: str | None) -> tuple[Any, str | None]:
    """The dataset's tokenizer (from its manifest, or `override`) and a note if unavailable."""
    manifest = dataset.manifest.get("parts", [dataset.manifest])[0]
    name = override or manifest.get("tokenizer", {}).get("name")
    if not name:
        return None, "the manifest names no tokenizer (pass --tokenizer)"
    try:
        return load_tokenizer(name), None
    except (OSError, ValueError) as err:
        return None, f"cannot load the tokenizer {name!r} ({err}); pass --tokenizer"


def prepare_failures(dataset: PreparedDataset) -> list[str]:
    """One problem per dataset whose manifest `prepare` did not mark complete."""
    manifests = dataset.manifest.get("parts", [dataset.manifest])
    failures = []
    for url, manifest in zip(dataset.urls, manifests, strict=True):
        status = manifest.get("status")
        if status == "complete":
            continue
        why = "; ".join(map(str, manifest.get("problems") or [])) or "see its manifest.json"
        why += "" if why.endswith(".") else "."
        failures.append(
            f"PREPARE FAILED: {url} has status {status!r} in its manifest, so the trainer "
            f"refuses it: {why} Fix the cause and run `flashdraft prepare` again."
        )
    return failures


def audit(config: AuditConfig) -> tuple[Audit, str]:
    """Audit the datasets of `config`: the statistics and checks, and what to show for them
    (the report, a note when the tokenizer is unavailable, the preview), as text or, with
    `json_output`, as one JSON document."""
    dataset = open_datasets(config.datasets, require_complete=False)
    tokenizer, note = load_audit_tokenizer(dataset, config.tokenizer)
    report = audit_dataset(dataset, tokenizer, config.thresholds)
    report.problems = prepare_failures(dataset) + report.problems
    seed = config.preview_options.seed
    indices = preview_indices(dataset, config.preview, seed) if config.preview > 0 else []
    if config.json_output:
        out = report.to_json()
        out["note"] = note
        if tokenizer is not None:
            out["preview"] = preview_json(dataset, indices, tokenizer)
        return report, json.dumps(out, indent=2)
    lines = [f"note: {note}"] if note else []
    lines.append(format_report(report))
    if indices and tokenizer is not None:
        colored = config.preview_options.colored()
        lines.append(format_preview(dataset, indices, tokenizer, color=colored))
    return report, "\n".join(lines)
