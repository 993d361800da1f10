"""`flashdraft train [--config RUN.toml | --preset NAME] [--set key=value ...] [--resume]`."""

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
    resume: bool = option(False, help="continue from the run's latest complete checkpoint")

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
    train(options.run.load(), resume=options.resume)
    return 0
