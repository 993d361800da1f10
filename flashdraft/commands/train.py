"""`flashdraft train [--config RUN.toml | --preset NAME] [--set key=value ...]
[--resume[=auto]] [--allow-config-change] [--take-over]`."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from flashdraft import config as cfg
from flashdraft import storage
from flashdraft.config import option
from flashdraft.log import get_logger
from flashdraft.train.measure import plan_with_measurement
from flashdraft.train.presets import RunSource
from flashdraft.train.trainer import train

log = get_logger(__name__)

RESUME: dict[str, bool | str] = {"off": False, "on": True, "auto": "auto"}  # -> train(resume=)


@dataclass(kw_only=True, slots=True)
class TrainOptions:
    """The options of `flashdraft train` (the run itself is configured by its run config)."""

    run: RunSource = field(default_factory=RunSource)
    # `--resume` alone is "on"; `--resume=auto` is spelled with a value, which the generic
    # flags of `flashdraft.config` do not express: this module declares the flag itself.
    resume: Literal["off", "on", "auto"] = option(
        "off",
        cli=False,
        metavar="auto",
        help="continue from the run's newest checkpoint that verifies (its checksums); refused "
        "when the run has none. --resume=auto: continue when there is one, start otherwise",
    )
    allow_config_change: bool = option(
        False,
        help="with --resume: continue even with settings that change what is trained or the "
        "data order (recorded in the run's run_config_changes.jsonl)",
    )
    take_over: bool = option(
        False,
        help="take the run directory's lock from a run that looks alive (only when that run is "
        "gone for good: a lock whose process is gone, or not refreshed for 10 minutes, is taken "
        "over without it)",
    )
    plan: bool = option(
        False,
        help="print the memory plan and exit: the layouts of this run that fit --plan-gpus "
        "GPUs of --plan-gb GB, their predicted peak memory and tokens/s, the fastest first "
        "(parallel.placement = 'auto' trains with it; docs/multi-node.md)",
    )
    plan_gpus: int | None = option(None, ge=1, help="--plan: GPUs (default: this machine's)")
    plan_gb: float | None = option(
        None, gt=0, help="--plan: GB per GPU (default: this GPU's free memory, else 80)"
    )
    plan_measure: bool = option(
        True,
        help="--plan: time one short step of the run on this device (the target forward and "
        "the drafter step) and predict each layout's tokens/s from it, not from FLOP estimates",
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


def add_set_flag(parser: argparse.ArgumentParser) -> None:
    """The repeatable --set of `RunSource.overrides` (kept off the generic flags: a list
    flag there takes its values once, `--set a=1 b=2`, while --set is given per override)."""
    overrides = next(f for f in dataclasses.fields(RunSource) if f.name == "overrides")
    parser.add_argument(
        cfg.flag_name(overrides),
        dest=overrides.name,
        action="append",
        default=[],
        metavar=overrides.metadata["metavar"],
        help=overrides.metadata["help"],
    )


def add_resume_flag(parser: argparse.ArgumentParser) -> None:
    """--resume (on) and --resume=auto, from `TrainOptions.resume`."""
    resume = next(f for f in dataclasses.fields(TrainOptions) if f.name == "resume")
    parser.add_argument(
        cfg.flag_name(resume),
        dest=resume.name,
        nargs="?",
        const="on",
        default=resume.default,
        choices=("on", "auto"),
        metavar=resume.metadata["metavar"],
        help=resume.metadata["help"],
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, TrainOptions)
    add_set_flag(parser)
    add_resume_flag(parser)


def run(args: argparse.Namespace) -> int:
    options: TrainOptions = cfg.from_args(TrainOptions, args)
    if options.allow_config_change and options.resume == "off":
        raise ValueError("--allow-config-change only applies with --resume")
    if options.plan:
        config = options.run.load()
        plan = plan_with_measurement(
            config, options.plan_gpus, options.plan_gb, options.plan_measure
        )
        print(plan.report(config), flush=True)
        return 0
    try:
        train(
            options.run.load(),
            resume=RESUME[options.resume],
            allow_config_change=options.allow_config_change,
            take_over=options.take_over,
        )
    except OSError as err:  # a full disk: one line, what was written and what next
        if not storage.is_write_failure(err) or os.environ.get("FLASHDRAFT_DEBUG"):
            raise
        then = "" if isinstance(err, storage.WriteFailed) else "; make room, then --resume=auto"
        log.error(f"flashdraft train: error: {err}{then}")
        return 1
    return 0
