"""`flashdraft train [--config RUN.toml | --preset NAME] [--set key=value ...] [--resume]
[--allow-config-change]`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.train.presets import RunSource
from flashdraft.train.trainer import train


@dataclass(kw_only=True, slots=True)
class TrainOptions:
    """The options of `flashdraft train` (the run itself is configured by its run config)."""

    run: RunSource = field(default_factory=RunSource)
    resume: bool = option(
        False, help="continue from the run's newest checkpoint that verifies (its checksums)"
    )
    allow_config_change: bool = option(
        False,
        help="with --resume: continue even with settings that change what is trained or the "
        "data order (recorded in the run's run_config_changes.jsonl)",
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, TrainOptions)
    add_set_flag(parser)


def run(args: argparse.Namespace) -> int:
    options: TrainOptions = cfg.from_args(TrainOptions, args)
    if options.allow_config_change and not options.resume:
        raise ValueError("--allow-config-change only applies with --resume")
    train(
        options.run.load(),
        resume=options.resume,
        allow_config_change=options.allow_config_change,
    )
    return 0
