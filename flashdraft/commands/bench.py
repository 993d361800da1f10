"""`flashdraft bench --config RUN.toml`: target, drafter and full-step timing of a run."""

from __future__ import annotations

import argparse

from flashdraft import config as cfg
from flashdraft.benchutil import environment, print_json, print_table
from flashdraft.commands.train import add_set_flag
from flashdraft.log import get_logger
from flashdraft.train.bench import COLUMNS, BenchConfig, bench_run

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, BenchConfig)
    add_set_flag(parser)


def run(args: argparse.Namespace) -> int:
    config: BenchConfig = cfg.from_args(BenchConfig, args)
    out = bench_run(config)
    log.info(f"measured matmul peak: {out.peak / 1e12:.1f} TFLOP/s on {out.device}")
    print_table(out.results, COLUMNS)
    log.info("  ".join(f"{k}={v}" for k, v in out.summary.items()))
    for r in out.results:
        r.pop("s")
    print_json({"bench": "run", **out.summary, "results": out.results, **environment()})
    return 0
