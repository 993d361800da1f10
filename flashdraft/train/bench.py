"""`flashdraft bench`: how fast will my run be, and where does the time go?

Builds the run from its config exactly as `flashdraft train` does (the real target, the real
data, the configured drafter) and times, on this device: the target forward alone (taps +
labels), the drafter step alone (forward, backward, AdamW) and the full online step, with
tokens/s, MFU against a matmul peak measured in the same process, and peak memory next to the
pre-flight estimate. Nothing is written to the run directory but its resolved config.

    flashdraft bench --config run.toml [--set data.row_tokens=16384] [--iters 10]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flashdraft.benchutil import measure
from flashdraft.train.trainer import Interval, Trainer


def unique_graphs() -> int:
    """Graphs torch.compile has built so far in this process (recompiles show up here)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def time_trainer(
    trainer: Trainer, *, parts: bool, warmup: int, iters: int, without_overlap: bool = False
) -> list[dict[str, Any]]:
    """Median times of target forward / drafter step (if `parts`) and the full online step
    (also with rows built inline, no prefetch thread, if `without_overlap`).

    FLOPs: the target's stack forward over the row (`Target.flops_per_token`) plus its LM
    head at the label positions; the drafter's fwd + bwd (x3) plus its LM head forward and
    gradient w.r.t. the hidden state (x2, the head is frozen).
    """
    assert trainer.target is not None, "bench needs the target on this rank (colocated)"
    config, device = trainer.config, trainer.device
    row_tokens, anchors = config.data.row_tokens, config.loss.anchors
    hidden, vocab = trainer.drafter_config.hidden_size, trainer.drafter_config.vocab_size
    rows = trainer.stream.iterate(iter(range(10**9)), config.data.prefetch)
    head_rows = anchors * (trainer.block - 1)
    target_flops = trainer.target.flops_per_token(row_tokens) * row_tokens
    target_flops += 2 * hidden * vocab * head_rows
    queries = anchors * trainer.block
    drafter_flops = 3 * trainer.drafter.num_flops_per_query_token(row_tokens, queries) * queries
    drafter_flops += 2 * 2 * hidden * vocab * head_rows
    sample_rows = [next(rows) for _ in range(4)]
    real_tokens = float(np.mean([r.tokens for r in sample_rows]))
    results: list[dict[str, Any]] = []

    def record(what: str, fn: Any, flops: float, **extra: Any) -> None:
        timing = measure(fn, device, warmup, iters)
        results.append(
            dict(
                what=what,
                row=row_tokens,
                flops=flops,
                s=timing.median_s,
                **timing.as_dict(),
                **extra,
            )
        )

    if parts:
        from flashdraft.train.step import draft_loss

        batch = trainer._batch(sample_rows[0])
        counter = iter(range(10**9))
        normaliser = torch.tensor(float(queries), device=device)

        def target_only() -> None:
            trainer._batch(sample_rows[next(counter) % len(sample_rows)])

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
                )
            loss.backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)

        record("target forward", target_only, target_flops)
        record("drafter step", drafter_only, drafter_flops)
        del batch

    def full() -> None:
        trainer.train_step([next(rows)], Interval())

    graphs = unique_graphs()
    record("full online step", full, target_flops + drafter_flops)
    results[-1]["recompiles_while_timed"] = unique_graphs() - graphs
    if without_overlap:
        # Rows the prefetching run has not touched, so both see fresh rows.
        start = min(100, trainer.stream.total_rows() // 2)
        inline = trainer.stream.iterate(iter(range(start, 10**9)), prefetch=0)

        def full_inline() -> None:
            trainer.train_step([next(inline)], Interval())

        record("full online step (no overlap)", full_inline, target_flops + drafter_flops)
    for r in results:
        r["tokens_per_s"] = round(real_tokens / r["s"])
    return results


def summarise(results: list[dict[str, Any]], peak: float) -> dict[str, Any]:
    """Per-row TFLOP/s and MFU, and the overhead ratio full / (target + drafter)."""
    for r in results:
        r["tflops"] = round(r["flops"] / r["s"] / 1e12, 2)
        r["mfu"] = round(r["flops"] / r["s"] / peak, 3)
    by = {r["what"]: r for r in results}
    out: dict[str, Any] = {}
    if {"target forward", "drafter step", "full online step"} <= set(by):
        t, d, f = by["target forward"]["s"], by["drafter step"]["s"], by["full online step"]["s"]
        out = {
            "overhead_ratio": round(f / (t + d), 3),
            "system_mfu": by["full online step"]["mfu"],
            "tokens_per_s": by["full online step"]["tokens_per_s"],
        }
    return out


COLUMNS = [
    "what",
    "row",
    "median_ms",
    "p10_ms",
    "p90_ms",
    "tokens_per_s",
    "tflops",
    "mfu",
    "peak_mem_gb",
    "recompiles_while_timed",
]
