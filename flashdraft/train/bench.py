"""`flashdraft bench`: how fast will my run be, and where does the time go?

Builds the run from its config exactly as `flashdraft train` does (the real target, the real
data, the configured drafter) and times, on this device: the target forward alone (taps +
labels), the drafter step alone (forward, backward, AdamW) and the full online step, with
tokens/s, MFU against a matmul peak measured in the same process, and peak memory next to the
pre-flight estimate. Nothing is written to the run directory but its resolved config.

    flashdraft bench --config run.toml [--set data.row_tokens=16384] [--iters 10]
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flashdraft import config as cfg
from flashdraft.benchutil import matmul_peak, measure, measure_back_to_back
from flashdraft.config import option
from flashdraft.train.features import (
    AheadTarget,
    LocalTarget,
    device_put,
    draft_batch,
    rows_on_device,
)
from flashdraft.train.packing import Row
from flashdraft.train.parallel import init_distributed
from flashdraft.train.plan import plan_run
from flashdraft.train.presets import RunSource
from flashdraft.train.step import draft_loss
from flashdraft.train.step_rows import Interval, StepRows
from flashdraft.train.trainer import Trainer


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """The options of `flashdraft bench`."""

    run: RunSource = field(default_factory=RunSource)
    warmup: int = option(3, ge=0, help="untimed calls first (compilation, autotuning)")
    iters: int = option(10, ge=1, help="timed calls; the median is reported")

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(slots=True)
class BenchResult:
    device: torch.device
    peak: float  # measured matmul FLOP/s
    results: list[dict[str, Any]]  # one row per timed thing (see COLUMNS)
    summary: dict[str, Any]


def bench_run(config: BenchConfig) -> BenchResult:
    """Build the run of `config` as `flashdraft train` would (into a scratch output) and time
    it on this device."""
    run = config.run.load(f"output={tempfile.mkdtemp(prefix='flashdraft-bench-')}")
    info = init_distributed(run.device)
    if info.distributed:
        raise ValueError("run `flashdraft bench` as one process (it measures one device)")
    trainer = Trainer(plan_run(run, info, resume=False))
    peak = matmul_peak(trainer.device)
    results = time_trainer(trainer, parts=True, warmup=config.warmup, iters=config.iters)
    summary = summarise(results, peak) | {"target_precision": run.target.precision}
    return BenchResult(trainer.device, peak, results, summary)


def unique_graphs() -> int:
    """Graphs torch.compile has built so far in this process (recompiles show up here)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def slowest_kernels(limit: int = 12) -> list[tuple[str, float]]:
    """The Triton kernels that took longest to compile in this process, [(name, seconds)],
    slowest first, from dynamo's compilation metrics (each graph's top kernels by compile
    time). Empty where this torch does not record them. A cold first step spends most of
    its time waiting on these compiles (once 172 of 221 s on an H200), so the names say what
    to cut."""
    import json

    from torch._dynamo.utils import get_compilation_metrics

    times: dict[str, float] = {}
    for metrics in get_compilation_metrics():
        raw = getattr(metrics, "triton_kernel_compile_times_us", None)
        if not raw:
            continue
        for name, us in json.loads(raw) if isinstance(raw, str) else raw:  # [[name, us]]
            times[str(name)] = max(times.get(str(name), 0.0), float(us) / 1e6)
    return sorted(times.items(), key=lambda kv: -kv[1])[:limit]


def step_flops(trainer: Trainer) -> tuple[float, float]:
    """(target, drafter) FLOPs of one row.

    Target: (1) its stack forward over the row (`Target.flops_per_token`); (2) its LM head at
    the label positions. Drafter: (3) forward + backward (x3) of its layers over the A*B
    queries; (4) its LM head forward and the gradient w.r.t. the hidden state (x2: the head
    is frozen, no weight gradient).
    """
    assert trainer.target is not None, "bench needs the target on this rank (colocated)"
    config = trainer.config
    row_tokens, anchors = config.data.row_tokens, config.loss.anchors
    hidden, vocab = trainer.drafter_config.hidden_size, trainer.drafter_config.vocab_size
    head_rows = anchors * (trainer.block - 1)
    target = trainer.target.flops_per_token(row_tokens) * row_tokens  # (1)
    target += 2 * hidden * vocab * head_rows  # (2)
    queries = anchors * trainer.block
    drafter = 3 * trainer.drafter.num_flops_per_query_token(row_tokens, queries) * queries  # (3)
    drafter += 2 * 2 * hidden * vocab * head_rows  # (4)
    return target, drafter


def _time_parts(
    trainer: Trainer,
    rows: list[Row],
    record: Callable[[str, Callable[[], None], float, int], None],
) -> None:
    """Time the target forward alone and the drafter step alone, each on one forward's rows
    (the target's: `target.forward_rows` when it runs ahead, else `optim.rows_per_forward`,
    the drafter's; one fixed batch for the drafter, freed on return so that it does not count
    in the full step's peak memory)."""
    device, config = trainer.device, trainer.config
    per = config.optim.rows_per_forward
    source, ahead = trainer.source, config.target_rows
    local = source.local if isinstance(source, AheadTarget) else source
    assert isinstance(local, LocalTarget), "bench needs the target on this rank (colocated)"
    batch = draft_batch(local, rows[:per], device_put(device))
    counter = iter(range(10**9))
    queries = config.loss.anchors * trainer.block * per
    normaliser = torch.tensor(float(queries), device=device)

    def target_only() -> None:
        group = [rows[next(counter) % len(rows)] for _ in range(ahead)]
        if isinstance(source, AheadTarget):
            local.row_outputs(group, rows_on_device(group, local.put))
        else:
            trainer.make_batch(group)

    def drafter_only() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = draft_loss(
                trainer.drafter,
                trainer.head,
                batch,
                trainer.slot_w,
                normaliser,
                trainer.backend,
                config.loss.chunk_rows,
                forward=trainer.model,
                dpace_alpha=trainer.dpace_alpha,
                residual_dtype=trainer.residual_dtype,
            )
        loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    target_flops, drafter_flops = step_flops(trainer)
    record("target forward", target_only, target_flops * ahead, ahead)
    record("drafter step", drafter_only, drafter_flops * per, per)


def time_trainer(
    trainer: Trainer, *, parts: bool, warmup: int, iters: int, without_overlap: bool = False
) -> list[dict[str, Any]]:
    """Median times of target forward / drafter step (if `parts`: one forward's rows) and the
    full online step (`optim.grad_accum` rows; also with rows built inline, no prefetch
    thread, if `without_overlap`); FLOPs from `step_flops`, tokens/s from the rows' real
    tokens."""
    config, device = trainer.config, trainer.device
    target_flops, drafter_flops = step_flops(trainer)
    per_step = config.optim.grad_accum
    total = trainer.plan.total_rows
    if total < max(4, per_step):
        raise ValueError(
            f"bench needs at least {max(4, per_step)} packed rows; "
            f"{', '.join(config.data.datasets)} make {total} of {config.data.row_tokens} tokens: "
            "add data or lower data.row_tokens"
        )
    # As many rows as timing asks for: the stream cycles over the run's rows.
    rows = trainer.stream.iterate((p % total for p in itertools.count()), config.data.prefetch)
    sample_rows = [next(rows) for _ in range(max(4, config.target_rows))]
    real_tokens = float(np.mean([r.tokens for r in sample_rows]))
    results: list[dict[str, Any]] = []

    def record(what: str, fn: Callable[[], None], flops: float, row_count: int) -> None:
        timing = measure(fn, device, warmup, iters)
        row = config.data.row_tokens
        results.append(
            dict(what=what, row=row, rows=row_count, flops=flops, s=timing.median_s)
            | timing.as_dict()
        )

    if parts:
        _time_parts(trainer, sample_rows, record)

    # A call of `full` is one group of steps when the target runs ahead (its forward comes
    # before the group's first step), else one step.
    feeder = StepRows(trainer, rows)
    steps = feeder.group_size()
    full_rows = per_step * steps

    def full() -> None:
        for _ in range(steps):
            trainer.train_step(feeder.take(), Interval())

    graphs = unique_graphs()
    record("full online step", full, (target_flops + drafter_flops) * full_rows, full_rows)
    results[-1]["recompiles_while_timed"] = unique_graphs() - graphs
    # As a run goes: no sync between steps (the median above syncs after each one).
    steady = measure_back_to_back(full, device, iters)
    results.append(
        dict(
            what=BACK_TO_BACK,
            row=config.data.row_tokens,
            rows=full_rows,
            flops=(target_flops + drafter_flops) * full_rows,
            s=steady.median_s,
        )
        | steady.as_dict()
    )
    if without_overlap:
        # Rows the prefetching run has not touched, so both see fresh rows.
        start = min(100, total // 2)
        inline = StepRows(
            trainer,
            trainer.stream.iterate(((start + p) % total for p in itertools.count()), prefetch=0),
        )

        def full_inline() -> None:
            for _ in range(steps):
                trainer.train_step(inline.take(), Interval())

        record(
            "full online step (no overlap)",
            full_inline,
            (target_flops + drafter_flops) * full_rows,
            full_rows,
        )
    for r in results:
        r["tokens_per_s"] = round(real_tokens * r["rows"] / r["s"])
    return results


BACK_TO_BACK = "full online steps, back to back"


def summarise(results: list[dict[str, Any]], peak: float) -> dict[str, Any]:
    """Per-row TFLOP/s and MFU, the overhead ratio full / (target + drafter, each scaled to
    the full step's rows), and the back-to-back steps' tokens/s (a run's steady state)."""
    for r in results:
        r["tflops"] = round(r["flops"] / r["s"] / 1e12, 2)
        r["mfu"] = round(r["flops"] / r["s"] / peak, 3)
    by = {r["what"]: r for r in results}
    out: dict[str, Any] = {}
    if {"target forward", "drafter step", "full online step"} <= set(by):
        t, d, f = by["target forward"]["s"], by["drafter step"]["s"], by["full online step"]["s"]
        rows = by["full online step"]["rows"]
        parts = t * rows / by["target forward"]["rows"] + d * rows / by["drafter step"]["rows"]
        out = {
            "overhead_ratio": round(f / parts, 3),
            "system_mfu": by["full online step"]["mfu"],
            "tokens_per_s": by["full online step"]["tokens_per_s"],
        }
    if BACK_TO_BACK in by:
        out["tokens_per_s_back_to_back"] = by[BACK_TO_BACK]["tokens_per_s"]
    return out


COLUMNS = [
    "what",
    "row",
    "rows",
    "median_ms",
    "p10_ms",
    "p90_ms",
    "tokens_per_s",
    "tflops",
    "mfu",
    "peak_mem_gb",
    "recompiles_while_timed",
]
