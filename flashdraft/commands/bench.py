"""`flashdraft bench --config RUN.toml`: target, drafter and full-step timing of a run."""

from __future__ import annotations

import argparse
import tempfile

from flashdraft.benchutil import environment, matmul_peak, print_json, print_table
from flashdraft.train.bench import COLUMNS, summarise, time_trainer
from flashdraft.train.config import load_run_config
from flashdraft.train.trainer import Trainer, plan_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config (TOML or JSON), as for `flashdraft train`")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)


def run(args: argparse.Namespace) -> int:
    from flashdraft.train.parallel import init_distributed

    overrides = [*args.set, f"output={tempfile.mkdtemp(prefix='flashdraft-bench-')}"]
    config = load_run_config(args.config, overrides)
    info = init_distributed(config.device)
    if info.distributed:
        raise ValueError("run `flashdraft bench` as one process (it measures one device)")
    trainer = Trainer(plan_run(config, info, resume=False))
    peak = matmul_peak(trainer.device)
    results = time_trainer(trainer, parts=True, warmup=args.warmup, iters=args.iters)
    summary = summarise(results, peak)
    print(f"measured matmul peak: {peak / 1e12:.1f} TFLOP/s on {trainer.device}")
    print_table(results, COLUMNS)
    print("  ".join(f"{k}={v}" for k, v in summary.items()))
    for r in results:
        r.pop("s")
    print_json({"bench": "run", **summary, "results": results, **environment()})
    return 0
