"""`flashdraft demo`: the whole pipeline on SmolLM2-135M, end to end."""

from __future__ import annotations

import argparse

from flashdraft import config as cfg
from flashdraft.demo import DemoConfig, run_demo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, DemoConfig)


def run(args: argparse.Namespace) -> int:
    return run_demo(cfg.from_args(DemoConfig, args))
