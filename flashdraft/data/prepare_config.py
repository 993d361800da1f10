"""`flashdraft prepare`'s options, declared once (`PrepareConfig`: flags, defaults, checks),
and the settings recorded from them: those that decide the data, which a resumed run must
match (`data_settings`, stored in `OUT/.work/`), and those written into the manifest's
`options` (`manifest_options`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.data.audit import Thresholds
from flashdraft.data.dataset import FORMAT_VERSION
from flashdraft.data.loops import DATA_LOOP_KEEP, DATA_LOOP_MIN
from flashdraft.data.preview import PreviewOptions
from flashdraft.data.template import TemplateOptions

# Tags of the fields recorded in the outputs: "data" decides the data (a resumed run must
# match it, `data_settings`); "manifest" is recorded in the manifest's `options`.
_DECIDES = ("data", "manifest")
_RECORDED = ("manifest",)


@dataclass(kw_only=True, slots=True)
class PrepareConfig:
    """`flashdraft prepare`: every option, declared once (flags, defaults, checks, records)."""

    inputs: list[str] = option(
        positional=True,
        metavar="INPUT",
        help="JSONL files, globs or directories (local or fsspec URLs; .gz/.zst)",
    )
    tokenizer: str = option(help="tokenizer (and chat template) of the target: a path or hub name")
    output: str = option(metavar="DIR", help="dataset directory (re-running into it resumes)")
    template: TemplateOptions = field(default_factory=TemplateOptions)  # --thinking, --turns
    max_length: int | None = option(
        None, ge=2, help="longest sample in tokens (default: no limit)", tags=_DECIDES
    )
    max_record_bytes: int | None = option(
        4 << 20,
        ge=1,
        help="reject a record (one JSONL line) of more bytes, before it is parsed or "
        "tokenized (counted as a reject; none: no limit)",
        tags=_RECORDED,  # and in `data_settings` when not the default (`limit_settings`)
    )
    max_record_tokens: int | None = option(
        131_072,
        ge=2,
        help="reject a sample of more tokens, whatever --max-length and --overlong do "
        "(counted as a reject; none: no limit)",
        tags=_RECORDED,
    )
    overlong: Literal["drop", "truncate"] = option(
        "drop",
        help="samples over --max-length: drop (counted as rejects) or truncate (counted as "
        "truncated)",
        tags=_DECIDES,
    )
    loops: Literal["keep", "untrain"] = option(
        "keep",
        help="repetition loops in the trained text (a stretch of at least --loop-min tokens "
        "that repeats with a period of at most 32, e.g. a small target's answer stuck on "
        "'no no no ...'): keep them trained, or untrain all but their first --loop-keep "
        "tokens (they stay in the context; counted as loop_untrained)",
    )
    loop_keep: int = option(
        DATA_LOOP_KEEP,
        ge=0,
        metavar="N",
        help="--loops untrain: tokens of each loop still trained",
    )
    loop_min: int = option(
        DATA_LOOP_MIN,
        ge=2,
        metavar="N",
        help="--loops untrain: the shortest repeating stretch that counts as a loop",
    )
    preview: int = option(
        1, ge=0, metavar="N", help="show N samples with trained tokens highlighted at the end"
    )
    preview_options: PreviewOptions = field(default_factory=PreviewOptions)  # --seed, --color
    shard_size: int = option(
        2048,
        ge=1,
        help="records per output shard, the unit of parallel work and of resume",
        tags=_DECIDES,
    )
    workers: int = option(0, ge=0, help="worker processes (0: every core this process may use)")
    max_reject_rate: float = option(
        0.01,
        ge=0,
        le=1,
        help="fail when more than this share of records is rejected",
        tags=_RECORDED,
    )
    allow_degenerate: bool = option(
        False,
        help="keep a dataset that fails the degenerate-data checks (they become warnings)",
        tags=_RECORDED,
    )
    overwrite: bool = option(
        False, help="replace a dataset prepared in --output with other settings or inputs"
    )
    progress: bool = option(
        True, help="a progress bar on standard error", off_help="no progress bar"
    )
    thresholds: Thresholds = field(default_factory=Thresholds)  # recorded whole

    def __post_init__(self) -> None:
        cfg.validate(self)
        if not self.inputs:
            raise cfg.ConfigError(
                "inputs", self.inputs, "give at least one file, glob or directory"
            )

    def num_workers(self) -> int:
        if self.workers:
            return self.workers
        affinity = getattr(os, "sched_getaffinity", None)
        return len(affinity(0)) if affinity else os.cpu_count() or 1


def data_settings(config: PrepareConfig, tokenizer_sha256: str) -> dict[str, Any]:
    """Everything that decides the data; a resumed run must match it exactly."""
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer_sha256": tokenizer_sha256,
        **cfg.settings(config, "data"),
        **loop_settings(config),
        **limit_settings(config),
    }


def limit_settings(config: PrepareConfig) -> dict[str, Any]:
    """The record size limits, recorded only when not the defaults: datasets prepared before
    the limits existed resume unchanged (their finished shards are kept as they are)."""
    limits = {"bytes": config.max_record_bytes, "tokens": config.max_record_tokens}
    defaults = PrepareConfig(inputs=["-"], tokenizer="-", output="-")
    if limits == {"bytes": defaults.max_record_bytes, "tokens": defaults.max_record_tokens}:
        return {}
    return {"record_limits": limits}


def loop_settings(config: PrepareConfig) -> dict[str, Any]:
    """--loops and its sizes, recorded only when loops are untrained: datasets prepared
    before the option existed keep their settings (and resume) unchanged."""
    if config.loops == "keep":
        return {}
    return {"loops": {"mode": config.loops, "keep": config.loop_keep, "min": config.loop_min}}


def manifest_options(config: PrepareConfig) -> dict[str, Any]:
    """The options recorded in the manifest (the thresholds as one table)."""
    return {
        **cfg.settings(config, "manifest"),
        **loop_settings(config),
        "thresholds": cfg.to_dict(config.thresholds),
    }
