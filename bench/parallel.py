"""Throughput of the online step across GPUs, through the real trainer, under torchrun.

One process per GPU; every process builds the same random-weight Qwen3-8B-shaped target
(bench/trainer.py's) and synthetic packed data. Compared in one session:

  * 1 GPU colocated (the control), 2 GPUs colocated (2 drafter replicas, DDP),
  * 2 GPUs split 1 + 1 (GPU 0 runs only the target and streams features and labels to
    GPU 1, which runs only the drafter).

    python bench/parallel.py --all            # runs the three configurations, prints a table
    torchrun --nproc-per-node 2 bench/parallel.py --placement split   # one configuration
    python bench/parallel.py --all --smoke    # tiny, CPU (gloo), checks the script runs

Global tokens/s = rows per step x real tokens per row / median step time (logging rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from trainer import SyntheticDataset, add_geometry_arguments, smoke_geometry, target_model

from flashdraft.benchutil import environment, print_json, print_table
from flashdraft.config import load_run_config
from flashdraft.parallel import barrier, init_distributed, shutdown
from flashdraft.train import Interval, Trainer, plan_run, serve_target


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--all", action="store_true", help="run 1-GPU, 2-GPU colocated and split")
    p.add_argument("--placement", default="colocated", choices=["colocated", "split"])
    p.add_argument("--gpus", type=int, default=2)
    add_geometry_arguments(p)
    p.add_argument("--row-tokens", type=int, default=8192)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        smoke_geometry(args)
        args.row_tokens, args.warmup, args.iters = 256, 1, 3
    return args


def worker(args: argparse.Namespace) -> None:
    device_kind = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    info = init_distributed(device_kind)
    model = target_model(args, info.device)
    steps = args.warmup + args.iters
    overrides = [
        f"output={tempfile.mkdtemp(prefix='flashdraft-par-')}",
        "target.path=unused",
        'data.datasets=["synthetic"]',
        f"data.row_tokens={args.row_tokens}",
        f"drafter.num_layers={args.layers}",
        f"drafter.mask_token_id={args.vocab - 1}",
        f"loss.anchors={args.anchors}",
        f"optim.grad_accum={args.grad_accum}",
        f"optim.max_steps={steps}",
        "log.tensorboard=false",
        "log.progress=false",
        f"parallel.placement={args.placement}",
        "parallel.target_ranks=1",
        f"compile={str(device_kind == 'cuda').lower()}",
    ]
    config = load_run_config(None, overrides)
    dataset = SyntheticDataset(args.docs, args.doc_min, args.doc_max, args.vocab)
    plan = plan_run(config, info, resume=False, target_config=model.config, dataset=dataset)
    if plan.placement.role == "target":
        serve_target(plan, model)
        barrier(info)
        shutdown(info)
        return
    trainer = Trainer(plan, model)
    rows = trainer.stream.iterate(plan.positions(plan.placement.dp_rank), config.data.prefetch)
    times = []
    real_tokens = []
    for step in range(steps):
        step_rows = [next(rows) for _ in range(args.grad_accum)]
        real_tokens += [r.tokens for r in step_rows]
        if device_kind == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(step_rows, Interval())
        if device_kind == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    barrier(info)
    if plan.placement.is_logger:
        median = statistics.median(times)
        tokens_per_row = statistics.mean(real_tokens)
        result = {
            "placement": args.placement,
            "world": info.world,
            "drafter_replicas": plan.placement.dp_world,
            "rows_per_step": plan.rows_per_step,
            "step_ms": round(median * 1e3, 1),
            "tokens_per_s": round(plan.rows_per_step * tokens_per_row / median),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if device_kind == "cuda"
            else 0.0,
        }
        print("RESULT " + json.dumps(result), flush=True)
    shutdown(info)


def launch(args: argparse.Namespace, nproc: int, placement: str) -> dict:
    forwarded = [a for a in sys.argv[1:] if a not in ("--all",)]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(Path(__file__)),
        *forwarded,
        "--placement",
        placement,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(
            f"{placement} x{nproc} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> int:
    args = parse()
    if not args.all:
        worker(args)
        return 0
    results = [
        launch(args, 1, "colocated"),
        launch(args, args.gpus, "colocated"),
        launch(args, args.gpus, "split"),
    ]
    one = results[0]["tokens_per_s"]
    for r in results:
        r["speedup_vs_1gpu"] = round(r["tokens_per_s"] / one, 3)
    print_table(
        results,
        [
            "placement",
            "world",
            "drafter_replicas",
            "rows_per_step",
            "step_ms",
            "tokens_per_s",
            "speedup_vs_1gpu",
            "peak_mem_gb",
        ],
    )
    print_json({"bench": "parallel", "results": results, **environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
