"""The online step on one GPU: target forward alone, drafter step alone, and the full step.

A random-weight Qwen3-8B-shaped target (36 layers, width 4096, 32/8 heads, intermediate
12288, vocab 151936; no weights needed), a 5-layer drafter, B = 16, A = 512, packed rows of
8192 tokens (documents of 300..3000 tokens, 80% of each trained). Everything runs through
the real trainer (`flashdraft.train.Trainer`): the same row stream, target forward, drafter
step and optimizer as `flashdraft train`.

Reports tokens/s, system MFU ((target forward + drafter fwd/bwd FLOPs) / time / measured
peak) and the overhead ratio full / (target + drafter); then the full step at 16384-token
rows (must not OOM) and with the row prefetch thread off (the effect of overlap).

`--geometry` picks the target: `8b` (above), `27b-hybrid` (Qwen3.6-27B-shaped: 64 layers in
16 groups of 3 Gated DeltaNet + 1 gated full attention, width 5120, intermediate 17408, 24/4
heads of 256, linear 16 key / 48 value heads of 128, vocab 248320, partial interleaved RoPE)
or `27b-dense`, its dense stand-in (the same shape with full attention in every layer, a
Qwen3). Hybrid: the linear layers run fla's varlen kernels when fla imports (see
dev/gpu/fla_wheels.sh), else the per-document fallback (said at start-up); `--compare-paths`
also times the full step with the per-document path (packed vs one document at a time through
the linear layers). `--target-layers N` shortens the target if it does not fit (say so).

    python bench/trainer.py                                          # on a GPU
    python bench/trainer.py --geometry 27b-hybrid --compare-paths    # the issue-20 numbers
    python bench/trainer.py --precision fp8                          # the target in FP8
    python bench/trainer.py --smoke [--geometry 27b-hybrid]          # tiny, CPU, checks it runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from flashdraft.benchutil import environment, free_memory, matmul_peak, print_json, print_table
from flashdraft.log import get_logger
from flashdraft.model import varlen
from flashdraft.model.attention import FLEX_OPTIONS
from flashdraft.model.fp8 import fp8_products
from flashdraft.train.bench import COLUMNS, summarise, time_trainer
from flashdraft.train.config import load_run_config
from flashdraft.train.parallel import init_distributed
from flashdraft.train.plan import plan_run
from flashdraft.train.step_rows import PHASES, Interval, StepRows
from flashdraft.train.trainer import Trainer

log = get_logger("bench.trainer")


class SyntheticDataset:
    """The PreparedDataset interface over random documents (no files)."""

    def __init__(self, docs: int, lo: int, hi: int, vocab: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.num_tokens = rng.integers(lo, hi, docs)
        self._tokens = [rng.integers(0, vocab - 1, n).astype(np.int32) for n in self.num_tokens]

    def __len__(self) -> int:
        return len(self.num_tokens)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = self._tokens[index]
        mask = np.zeros(len(tokens), dtype=np.int8)
        mask[len(tokens) // 5 :] = 1
        return tokens, mask


def target_model(args: argparse.Namespace, device: torch.device):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    shape = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.target_layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        attn_implementation="flex_attention" if device.type == "cuda" else "sdpa",
    )
    attention = getattr(args, "target_attention", None)
    if attention == "varlen" or (attention is None and device.type == "cuda"):
        shape["attn_implementation"] = varlen.implementation("varlen")
    if getattr(args, "geometry", "8b") == "27b-hybrid":
        # transformers has no flex_attention for the hybrid classes: varlen where it runs,
        # as `flashdraft train` loads them (target.default_attention), or sdpa with the
        # dense document mask (`--target-attention sdpa`, the records before 2026-12-08).
        varlen_runs = device.type == "cuda" and varlen.available() and attention != "sdpa"
        shape["attn_implementation"] = varlen.implementation("varlen") if varlen_runs else "sdpa"
        # Layer types from full_attention_interval 4 (linear x 3, full); Qwen3.6's RoPE: a
        # quarter of head_dim rotated, T/H/W sections interleaved.
        pairs = args.head_dim // 4 // 2  # rotated frequencies, split T/H/W: 32 -> 11, 11, 10
        t = -(-pairs // 3)
        h = -(-(pairs - t) // 2)
        section = [t, h, pairs - t - h]
        config: Any = Qwen3_5TextConfig(
            **shape,
            linear_num_key_heads=args.linear_key_heads,
            linear_num_value_heads=args.linear_value_heads,
            linear_key_head_dim=args.linear_head_dim,
            linear_value_head_dim=args.linear_head_dim,
            linear_conv_kernel_dim=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
                "mrope_section": section,
                "mrope_interleaved": True,
            },
        )
        cls: Any = Qwen3_5ForCausalLM
    else:
        config, cls = Qwen3Config(**shape), Qwen3ForCausalLM
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    # Built in the target dtype: a 27B model built in fp32 and cast would leave ~100 GB in
    # the allocator's cache (the first 27B run's preflight saw 36 GB free).
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval().requires_grad_(False)


def run_overrides(args: argparse.Namespace, row_tokens: int) -> list[str]:
    """The run config of these benchmarks (synthetic data, the drafter and loss from the
    flags), as `--set` overrides; `bench/plan.py` plans the same run."""
    return [
        "target.path=unused",
        'data.datasets=["synthetic"]',
        f"data.row_tokens={row_tokens}",
        f"drafter.num_layers={args.layers}",
        f"drafter.mask_token_id={args.vocab - 1}",
        f"loss.anchors={args.anchors}",
        f"loss.chunk_rows={args.chunk_rows}",
        f"optim.grad_accum={args.rows_per_forward}",
        f"optim.rows_per_forward={args.rows_per_forward}",
        f"target.precision={args.precision}",
    ]


def make_trainer(args, device, model, row_tokens: int, overlap: bool) -> Trainer:
    overrides = [
        f"output={tempfile.mkdtemp(prefix='flashdraft-bench-')}",
        *run_overrides(args, row_tokens),
        "log.tensorboard=false",
        "log.progress=false",
        f"parallel.overlap={str(overlap).lower()}",
        f"compile={str(not args.no_compile).lower()}",
        *args.set,
    ]
    config = load_run_config(None, overrides)
    dataset = SyntheticDataset(args.docs, args.doc_min, args.doc_max, args.vocab)
    info = init_distributed("cuda" if device.type == "cuda" else "cpu")
    plan = plan_run(config, info, resume=False, target_config=model.config, dataset=dataset)
    trainer = Trainer(plan, target_model=model)
    if args.drafter_fp8:  # before the first step: the compiled layers trace the FP8 products
        count = fp8_products(trainer.drafter)
        log.info(f"bench: the drafter's products in FP8 ({count} linear layers)")
    return trainer


def bench_row_length(args, device, model, row_tokens: int, first: bool) -> list[dict]:
    trainer = make_trainer(args, device, model, row_tokens, overlap=True)
    # The first step compiles (cold, when the inductor cache is empty): its wall time.
    (compile_s,) = timed_steps(trainer, 1)
    log.info(f"bench: first step at {row_tokens}-token rows {compile_s:.1f} s (compilation)")
    results = time_trainer(
        trainer,
        parts=first,
        warmup=args.warmup,
        iters=args.iters,
        without_overlap=first and not args.skip_overlap_off,
    )
    if first and args.profile and device.type == "cuda":
        profile_steps(trainer)
    full = next(r for r in results if r["what"] == "full online step")
    full["first_step_s"] = round(compile_s, 3)  # a smoke step on a fast CPU is < 0.05 s
    target = trainer.target
    if first and args.compare_paths and target is not None and target.linear is not None:
        # Packed (the path chosen at start-up) vs one document at a time through the linear
        # layers, on the same trainer, fresh rows.
        for r in results:
            r["linear_path"] = target.linear.path
        target.pack_linear_layers("per-document")
        for r in time_trainer(trainer, parts=False, warmup=args.warmup, iters=args.iters):
            r["what"] += " (per-document linear layers)"
            r["linear_path"] = target.linear.path
            results.append(r)
    return results


# Target shapes by name: hidden, intermediate, heads, kv heads, head_dim, layers, vocab.
GEOMETRIES = {
    "8b": (4096, 12288, 32, 8, 128, 36, 151936),
    "27b-hybrid": (5120, 17408, 24, 4, 256, 64, 248320),
    "27b-dense": (5120, 17408, 24, 4, 256, 64, 248320),
}
SHAPE = ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "target_layers", "vocab")


def add_geometry_arguments(p: argparse.ArgumentParser) -> None:
    """The Qwen3-8B-shaped target, the drafter and the synthetic documents (shared with
    bench/parallel.py)."""
    defaults = dict(zip(SHAPE, GEOMETRIES["8b"], strict=True))
    for name in SHAPE:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=defaults[name])
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--docs", type=int, default=2000)
    p.add_argument("--doc-min", type=int, default=300)
    p.add_argument("--doc-max", type=int, default=3000)


def smoke_geometry(args: argparse.Namespace) -> None:
    args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim = 64, 128, 4, 2, 16
    args.target_layers, args.vocab, args.layers, args.anchors = 6, 1000, 2, 16
    args.docs, args.doc_min, args.doc_max = 200, 20, 200
    if getattr(args, "geometry", "8b") == "27b-hybrid":  # 2 x (3 linear, 1 full); rotary 8
        args.target_layers, args.head_dim = 8, 32
        args.linear_key_heads, args.linear_value_heads, args.linear_head_dim = 2, 4, 16


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_geometry_arguments(p)
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b")
    p.add_argument("--linear-key-heads", type=int, default=16, help="27b-hybrid")
    p.add_argument("--linear-value-heads", type=int, default=48, help="27b-hybrid")
    p.add_argument("--linear-head-dim", type=int, default=128, help="27b-hybrid")
    p.add_argument("--rows", default="8192,16384")
    p.add_argument("--chunk-rows", type=int, default=2048)
    p.add_argument(
        "--rows-per-forward",
        type=int,
        default=1,
        help="rows stacked in one target + drafter forward (optim.rows_per_forward; a step "
        "takes that many rows)",
    )
    p.add_argument(
        "--target-attention",
        choices=("flex", "varlen", "sdpa"),
        default=None,
        help="the target's packed attention: varlen flash attention over the documents' "
        "boundaries (the default on CUDA, as `flashdraft train` picks it there for these "
        "dense targets, target.default_attention), or flex with the document BlockMask (the "
        "default of the records before 2026-12-02); hybrids run varlen, or sdpa with the dense "
        "document mask (sdpa)",
    )
    p.add_argument(
        "--precision",
        choices=("bf16", "fp8"),
        default="bf16",
        help="target.precision: the target's decoder-layer linear layers in bf16, or in FP8 "
        "(e4m3 weights with per-channel scales, per-token activation scales, torch._scaled_mm; "
        "converted in place after the bf16 build); MFU stays against the bf16 matmul peak",
    )
    p.add_argument(
        "--drafter-fp8",
        action="store_true",
        help="experimental: the drafter's linear layers run their forward and backward "
        "products in FP8 (row-wise scales; fp32 master weights: fp8.fp8_products)",
    )
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--skip-overlap-off", action="store_true")
    p.add_argument(
        "--compare-paths",
        action="store_true",
        help="hybrid: also time the full step with the per-document linear layers",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run-config override, as `flashdraft train --set` (e.g. target.compile_scope=layers)",
    )
    p.add_argument(
        "--first-step",
        action="store_true",
        help="only the cold start: build the trainer, time its first two steps, print where "
        "compilation spent its time (run it with an empty inductor cache)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: after the timings, the top kernels of a few full steps (torch.profiler)",
    )
    p.add_argument(
        "--flex-options",
        type=json.loads,
        default={},
        metavar="JSON",
        help="the drafter's flex_attention kernel_options, e.g. '{\"BLOCK_M\": 64, "
        '"BLOCK_N": 64, "num_stages": 2}\' (default: torch\'s)',
    )
    p.add_argument("--smoke", action="store_true")
    # The geometry's shape is the default; flags given explicitly still win.
    geometry = p.parse_known_args()[0].geometry
    p.set_defaults(**dict(zip(SHAPE, GEOMETRIES[geometry], strict=True)))
    args = p.parse_args()
    if args.smoke:
        smoke_geometry(args)
        args.rows, args.warmup, args.iters, args.chunk_rows, args.no_compile = (
            "256,512",
            1,
            3,
            64,
            True,
        )
    return args


def timed_steps(trainer: Trainer, count: int) -> list[float]:
    """Wall seconds of each of `count` full steps (`optim.grad_accum` rows each), the device
    synchronised after each: the first of a trainer includes its compilation."""
    rows = StepRows(trainer, trainer.stream.iterate(iter(range(10**9)), 0))
    times = []
    for _ in range(count):
        start = time.perf_counter()
        trainer.train_step(rows.take(), Interval())
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    while rows.upcoming:  # the rest of a group the target ran ahead for, untimed
        trainer.train_step(rows.take(), Interval())
    return times


def first_step(args: argparse.Namespace, device: torch.device) -> int:
    """The cold start of a run: trainer built, then its first two steps timed apart, and
    dynamo's own account of the compilation."""
    from torch._dynamo.utils import compile_times

    from flashdraft.train.bench import slowest_kernels, unique_graphs

    start = time.perf_counter()
    model = target_model(args, device)
    row = int(args.rows.split(",")[0])
    trainer = make_trainer(args, device, model, row, overlap=True)
    built = time.perf_counter() - start
    times = timed_steps(trainer, 2)
    target, drafter = (trainer.stopwatch.seconds(k, keep=True) for k in PHASES)
    log.info(compile_times(repr="str", aggregate=True))
    result = {
        "bench": "trainer-first-step",
        "build_s": round(built, 1),
        "first_step_s": round(times[0], 1),
        "second_step_s": round(times[1], 3),  # the drafter's alone when the target ran ahead
        "target_forward_rows": trainer.config.target.forward_rows,
        "target_precision": args.precision,
        "first_two_target_s": round(target, 1),
        "first_two_drafter_s": round(drafter, 1),
        "graphs": unique_graphs(),
        # the kernels whose (parallel) Triton compiles took longest, seconds each
        "slowest_kernels": [[name, round(s, 2)] for name, s in slowest_kernels()],
        "settings": args.set,
        **environment(),
    }
    log.info(
        f"first step {times[0]:.1f} s (target {target:.1f} s, drafter {drafter:.1f} s over "
        f"two steps), second {times[1] * 1e3:.1f} ms, {result['graphs']} graphs"
    )
    print_json(result)
    return 0


def profile_steps(trainer: Trainer, steps: int = 3) -> None:
    """The top CUDA kernels of a few full steps, and how much of the step the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile

    rows = StepRows(trainer, trainer.stream.iterate(iter(range(10**9)), 2))
    for _ in range(rows.group_size()):  # a whole group: the profiled steps start the next one
        trainer.train_step(rows.take(), Interval())
    group = rows.group_size()
    steps = -(-steps // group) * group  # the target running ahead: whole groups
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(rows.take(), Interval())
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    log.info(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    log.info(
        f"profile: {steps} steps in {wall * 1e3:.1f} ms wall (under the profiler), GPU busy "
        f"{busy * 1e3:.1f} ms ({busy / wall:.0%}); kernels launched "
        f"{sum(e.count for e in events if e.device_type.name == 'CUDA')}"
    )


def main() -> int:
    args = parse()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    FLEX_OPTIONS.update(args.flex_options)  # the dict the drafter's attention reads
    if args.first_step:
        return first_step(args, device)
    peak = matmul_peak(device)
    model = target_model(args, device)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for i, row in enumerate(rows):
        results += bench_row_length(args, device, model, row, first=i == 0)
        free_memory()
    summary = summarise(
        [r for r in results if r["row"] == rows[0] and "no overlap" not in r["what"]], peak
    )
    summarise(results, peak)
    by = {(r["what"], r["row"]): r for r in results}
    if ("full online step (no overlap)", rows[0]) in by:
        summary["overlap_speedup"] = round(
            by[("full online step (no overlap)", rows[0])]["s"]
            / by[("full online step", rows[0])]["s"],
            3,
        )
    if args.geometry != "8b":
        summary["geometry"] = f"{args.geometry}, {args.target_layers} target layers"
    log.info(f"measured matmul peak: {peak / 1e12:.0f} TFLOP/s on {device}")
    print_table(results, COLUMNS)
    log.info("  ".join(f"{k}={v}" for k, v in summary.items()))
    for r in results:
        r.pop("s")
    print_json(
        {
            "bench": "trainer",
            "peak_tflops": round(peak / 1e12, 1),
            "target_attention": model.config._attn_implementation,
            "target_precision": args.precision,
            "drafter_fp8": args.drafter_fp8,
            "flex_options": args.flex_options,
            **summary,
            "results": results,
            **environment(),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
