"""Throughput of the online step across GPUs, through the real trainer, under torchrun.

One process per GPU; every process builds the same random-weight Qwen3-8B-shaped target
(bench/trainer.py's) and synthetic packed data. Compared in one session:

  * 1 GPU colocated (the control), 2 GPUs colocated (2 drafter replicas, DDP),
  * 2 GPUs split 1 + 1 (GPU 0 runs only the target and streams features and labels to
    GPU 1, which runs only the drafter).

    python bench/parallel.py --all            # runs the three configurations, prints a table
    torchrun --nproc-per-node 2 bench/parallel.py --placement split   # one configuration
    torchrun --nproc-per-node 4 bench/parallel.py --placement split --target-ranks 2   # 2 + 2
    python bench/parallel.py --all --smoke    # tiny, CPU (gloo), checks the script runs

Global tokens/s = rows per step x real tokens per row / mean step time (logging rank), timed
over --iters steps with one device sync at the end, as the training loop runs.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from trainer import SyntheticDataset, add_geometry_arguments, smoke_geometry, target_model

from flashdraft.benchutil import environment, print_json, print_table
from flashdraft.train.config import RunConfig, load_run_config
from flashdraft.train.parallel import barrier, init_distributed, shutdown
from flashdraft.train.plan import plan_run
from flashdraft.train.server import serve_target
from flashdraft.train.step_rows import Interval
from flashdraft.train.trainer import Trainer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--all", action="store_true", help="run 1-GPU, 2-GPU colocated and split")
    p.add_argument("--placement", default="colocated", choices=["colocated", "split"])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument(
        "--target-ranks",
        type=int,
        default=1,
        help="split: ranks that run the target (2 of 4: 2 + 2)",
    )
    add_geometry_arguments(p)
    p.add_argument("--row-tokens", type=int, default=8192)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--compare-overlap",
        action="store_true",
        help="colocated: also time the steps with rows built inline (parallel.overlap off)",
    )
    p.add_argument("--table", nargs="+", metavar="LOG", help="one table from RESULT lines of logs")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        smoke_geometry(args)
        args.row_tokens, args.warmup, args.iters = 256, 1, 3
    return args


def run_config(args: argparse.Namespace, device_kind: str) -> RunConfig:
    """The run of one configuration: the synthetic data, the geometry of the arguments."""
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
        f"parallel.target_ranks={args.target_ranks}",
        f"compile={str(device_kind == 'cuda').lower()}",
    ]
    return load_run_config(None, overrides)


def worker(args: argparse.Namespace) -> None:
    device_kind = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    t0 = time.perf_counter()
    info = init_distributed(device_kind)

    def phase(what: str) -> None:  # where the start-up time goes (stderr, every rank)
        print(f"[rank {info.rank} {time.perf_counter() - t0:6.1f} s] {what}", file=sys.stderr)

    model = target_model(args, info.device)
    phase("target built")
    config = run_config(args, device_kind)
    dataset = SyntheticDataset(args.docs, args.doc_min, args.doc_max, args.vocab)
    plan = plan_run(config, info, resume=False, target_config=model.config, dataset=dataset)
    if plan.placement.role == "target":
        serve_target(plan, model)
        phase("target served every step")
        barrier(info)
        shutdown(info)
        return
    trainer = Trainer(plan, model)
    phase("trainer built")
    positions = plan.positions(plan.placement.dp_rank)
    rows = trainer.stream.iterate(positions, config.data.prefetch)

    def run_steps(rows: Iterator[Any], n: int) -> float:
        """Seconds for n steps, fetching rows included, one device sync at the end: the loop
        as `flashdraft train` runs it (no per-step sync, so the CPU may run ahead)."""
        sync()
        start = time.perf_counter()
        for _ in range(n):
            step_rows = [next(rows) for _ in range(args.grad_accum)]
            real_tokens.extend(r.tokens for r in step_rows)
            trainer.train_step(step_rows, Interval())
        sync()
        return time.perf_counter() - start

    def sync() -> None:
        if device_kind == "cuda":
            torch.cuda.synchronize()

    real_tokens: list[int] = []
    for step in range(args.warmup):  # compiles here
        run_steps(rows, 1)
        phase(f"warm-up step {step + 1} done")
    real_tokens.clear()
    step_s = run_steps(rows, args.iters) / args.iters
    phase(f"{args.iters} timed steps: {step_s * 1e3:.1f} ms each")
    inline_s = None
    if args.compare_overlap and plan.placement.kind == "colocated":
        # The same steps with rows built inline on the training thread (parallel.overlap off);
        # the plan has no steps left, so restart the positions (same shapes, already compiled).
        inline = trainer.stream.iterate(plan.positions(plan.placement.dp_rank), 0)
        inline_s = run_steps(inline, args.iters) / args.iters
        phase(f"{args.iters} timed steps, rows inline: {inline_s * 1e3:.1f} ms each")
    barrier(info)
    if plan.placement.is_logger:
        tokens_per_row = statistics.mean(real_tokens)
        result = {
            "placement": args.placement,
            "world": info.world,
            "drafter_replicas": plan.placement.dp_world,
            "rows_per_step": plan.rows_per_step,
            "step_ms": round(step_s * 1e3, 1),
            "tokens_per_s": round(plan.rows_per_step * tokens_per_row / step_s),
            "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if device_kind == "cuda"
            else 0.0,
        }
        if inline_s is not None:
            result["step_ms_rows_inline"] = round(inline_s * 1e3, 1)
        print("RESULT " + json.dumps(result), flush=True)  # printed, not logged: `launch` parses it
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
        *(["--compare-overlap"] if nproc == 1 else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(
            f"{placement} x{nproc} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def table(results: list[dict]) -> None:
    one = next((r for r in results if r["world"] == 1), None)
    for r in results:
        if one is not None:
            r["speedup_vs_1gpu"] = round(r["tokens_per_s"] / one["tokens_per_s"], 3)
    columns = ["placement", "world", "drafter_replicas", "rows_per_step", "step_ms"]
    columns += ["tokens_per_s", "speedup_vs_1gpu", "peak_mem_gb", "step_ms_rows_inline"]
    print_table(results, [c for c in columns if any(c in r for r in results)])
    print_json({"bench": "parallel", "results": results, **environment()})


def main() -> int:
    args = parse()
    if args.table:
        lines = [ln for f in args.table for ln in Path(f).read_text().splitlines()]
        table([json.loads(ln[len("RESULT ") :]) for ln in lines if ln.startswith("RESULT ")])
        return 0
    if not args.all:
        worker(args)
        return 0
    table(
        [
            launch(args, 1, "colocated"),
            launch(args, args.gpus, "colocated"),
            launch(args, args.gpus, "split"),
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
