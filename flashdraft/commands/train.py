"""`flashdraft train --config RUN.toml [--set key=value ...] [--resume]`."""

from __future__ import annotations

import argparse

from flashdraft.train.config import load_run_config
from flashdraft.train.trainer import train


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config (TOML or JSON)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set optim.lr=3e-4 (repeatable)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the run's latest complete checkpoint"
    )


def run(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, args.set)
    train(config, resume=args.resume)
    return 0
