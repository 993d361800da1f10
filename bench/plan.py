"""The memory plan on one GPU: plan, run the chosen layout, predicted vs measured.

Plans the run of `bench/trainer.py`'s random-weight target (`--geometry`) for `--gpus` GPUs
of `--gb` GB (`flashdraft.train.layout`), caps this process's CUDA memory to `--gb`
(`torch.cuda.set_per_process_memory_fraction`), builds the real trainer with the chosen
layout's settings (one GPU: colocated layouts), times the target forward, the drafter step
and the full step (`flashdraft.train.bench.time_trainer`), re-plans with the measured parts,
and prints the plan, then one JSON line: predicted vs measured peak memory and tokens/s.

    python bench/plan.py --geometry 27b-hybrid --gb 80            # the issue-73 goals
    python bench/plan.py --geometry 27b-hybrid --gb 96
    python bench/plan.py --geometry 27b-hybrid --gpus 4 --gb 96 --plan-only
    python bench/plan.py --smoke                                  # tiny, CPU
"""

from __future__ import annotations

import argparse
import sys

import torch
import trainer as bench_trainer
from trainer import (
    GEOMETRIES,
    SHAPE,
    add_geometry_arguments,
    make_trainer,
    run_overrides,
    smoke_geometry,
)

from flashdraft.benchutil import environment, print_json
from flashdraft.log import get_logger
from flashdraft.train import layout, preflight
from flashdraft.train.bench import time_trainer
from flashdraft.train.config import load_run_config
from flashdraft.train.plan import build_drafter_config

log = get_logger("bench.plan")
GB = 2**30


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_geometry_arguments(p)
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="27b-hybrid")
    p.add_argument("--linear-key-heads", type=int, default=16)
    p.add_argument("--linear-value-heads", type=int, default=48)
    p.add_argument("--linear-head-dim", type=int, default=128)
    p.add_argument("--gpus", type=int, default=1, help="GPUs to plan for")
    p.add_argument("--gb", type=float, default=None, help="GB per GPU (default: this one's)")
    p.add_argument("--rows", type=int, default=8192, help="data.row_tokens")
    p.add_argument("--chunk-rows", type=int, default=2048)
    p.add_argument("--rows-per-forward", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--precision",
        choices=("bf16", "fp8"),
        default="bf16",
        help="target.precision, as bench/trainer.py (the plan counts FP8 weights at 1 byte)",
    )
    p.add_argument("--plan-only", action="store_true", help="print the plan, run nothing")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--smoke", action="store_true")
    geometry = p.parse_known_args()[0].geometry
    p.set_defaults(**dict(zip(SHAPE, GEOMETRIES[geometry], strict=True)))
    args = p.parse_args()
    args.compare_paths = args.profile = args.drafter_fp8 = False
    args.skip_overlap_off = True
    if args.smoke:
        smoke_geometry(args)
        args.rows, args.chunk_rows, args.no_compile, args.warmup, args.iters = 256, 64, True, 1, 2
        args.gb = args.gb or 1.0
    return args


def run_config(args: argparse.Namespace, extra: list[str]):
    return load_run_config(
        None, ["output=unused", *run_overrides(args, args.rows), *args.set, *extra]
    )


def main() -> int:
    args = parse()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        gb = args.gb or total / GB
        torch.cuda.set_per_process_memory_fraction(min(1.0, gb * GB / total), device)
    else:
        gb = args.gb or 1.0
    model_device = torch.device("meta")
    target = bench_trainer.target_model(args, model_device)  # the config, no memory
    config = run_config(args, [])
    drafter, _ = build_drafter_config(config, target.config)
    counts = preflight.sizes(target.config, drafter)
    plan = layout.plan_layouts(config, drafter, target.config, args.gpus, gb * GB, counts=counts)
    log.info(plan.table())
    best = plan.best
    result: dict = {"bench": "plan", "geometry": args.geometry, "gpus": args.gpus, "gb": gb}
    if best is None:
        print_json({**result, "chosen": None, **environment()})
        return 1
    for role, estimate in best.memory.items():  # the terms, to re-fit them from a run
        log.info(f"predicted memory of a {role} GPU:\n{estimate.table()}")
    result["chosen"] = best.layout.describe(args.gpus)
    result["overrides"] = best.layout.overrides(config)
    result["predicted_peak_gb"] = {r: round(m.peak / GB, 2) for r, m in best.memory.items()}
    result["predicted_tokens_per_s_flops"] = round(best.tokens_per_s)
    if args.plan_only or args.gpus > 1:
        print_json({**result, **environment()})
        return 0
    # Run the chosen layout on this GPU: the bench's trainer with the layout's settings.
    model = bench_trainer.target_model(args, device)
    args.set = [*args.set, *best.layout.overrides(config)]
    chosen = best.layout.apply(config)
    trainer = make_trainer(args, device, model, chosen.data.row_tokens, overlap=True)
    if device.type == "cuda":  # the run's peak, not the build's (an FP8 target: bf16 first)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    results = time_trainer(trainer, parts=True, warmup=args.warmup, iters=args.iters)
    by = {r["what"]: r for r in results}
    peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else 0.0
    # The measured parts, per row at the planned row length, the drafter's without the
    # checkpointing's recomputation (the plan adds it back): the plan again from them.
    target_s = by["target forward"]["s"] / by["target forward"]["rows"]
    drafter_s = by["drafter step"]["s"] / by["drafter step"]["rows"]
    if best.layout.checkpointing:
        drafter_s /= layout.checkpoint_factor(drafter, chosen.data.row_tokens, chosen.loss.anchors)
    f = best.layout.row_divisor
    timings = layout.Timings(target_s * f, drafter_s * f, f"measured on {device.type}")
    measured_plan = layout.plan_layouts(
        config, drafter, target.config, 1, gb * GB, timings=timings, counts=counts
    )
    log.info(measured_plan.table())
    again = next(c for c in measured_plan.candidates if c.layout == best.layout)
    full = by["full online step"]
    result.update(
        predicted_tokens_per_s=round(again.tokens_per_s),
        measured_tokens_per_s=full["tokens_per_s"],
        measured_peak_gb=round(peak, 2),
        peak_error=round(best.peak / GB / peak - 1, 3) if peak else None,
        target_forward_ms=round(target_s * 1e3, 1),
        drafter_step_ms=round(by["drafter step"]["s"] / by["drafter step"]["rows"] * 1e3, 1),
        full_step_ms=round(full["s"] * 1e3, 1),
        same_choice_with_measured_times=measured_plan.best is not None
        and measured_plan.best.layout == best.layout,
    )
    print_json({**result, **environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
