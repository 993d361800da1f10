"""One short measured step for the memory plan (`flashdraft train --plan`).

Times, on this process's device, the target forward and the drafter step of one row of the
run (`train/bench.py`'s `time_trainer`, one warm-up and one timed call), built as `flashdraft
train` builds it with the fastest one-device layout that fits here (`train/layout.py`): a
run too big to train colocated on this device is measured checkpointed, with shorter rows or
smaller LM-head chunks, and the times are brought back to the run's own layout (the
checkpointing's extra forward taken out, shorter rows scaled to the row). On the CPU the step
runs too, so the tests plan tiny targets from a real measurement.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from flashdraft.log import get_logger
from flashdraft.model.config import DrafterConfig
from flashdraft.train import preflight
from flashdraft.train.bench import time_trainer
from flashdraft.train.config import RunConfig
from flashdraft.train.layout import (
    Layout,
    Plan,
    Timings,
    checkpoint_factor,
    device_capacity,
    plan_for_run,
    plan_layouts,
    run_geometry,
)
from flashdraft.train.parallel import init_distributed
from flashdraft.train.plan import plan_run
from flashdraft.train.trainer import Trainer

log = get_logger(__name__)


def measure_timings(
    config: RunConfig, target_config: Any, drafter: DrafterConfig, warmup: int = 1, iters: int = 1
) -> Timings | None:
    """Seconds of one row of `config`'s target forward and drafter step, measured here; None
    when no one-device layout of the run fits this device (the plan then estimates)."""
    info = init_distributed(config.device)
    if info.distributed:
        raise ValueError("flashdraft train --plan measures on one process: run it without torchrun")
    counts = preflight.sizes(target_config, drafter)
    one = plan_layouts(
        config, drafter, target_config, 1, device_capacity(info.device), counts=counts
    )
    best = one.best
    if best is None:
        log.info("flashdraft train --plan: no one-device layout fits here; times estimated")
        return None
    run = best.layout.apply(config)
    run.output = tempfile.mkdtemp(prefix="flashdraft-plan-")
    run.log.tensorboard = run.log.progress = run.log.wandb = False
    run.eval.every = 0
    trainer = Trainer(plan_run(run, info, resume=False))
    if trainer.plan.total_rows < max(4, run.optim.grad_accum):  # what `time_trainer` cycles
        log.info(
            f"flashdraft train --plan: the data makes {trainer.plan.total_rows} rows, too few "
            "to time a step; times estimated"
        )
        return None
    results = time_trainer(trainer, parts=True, warmup=warmup, iters=iters)
    by = {r["what"]: r for r in results}
    target_s = by["target forward"]["s"] / by["target forward"]["rows"]
    drafter_s = by["drafter step"]["s"] / by["drafter step"]["rows"]
    if best.layout.checkpointing:
        drafter_s /= checkpoint_factor(drafter, run.data.row_tokens, run.loss.anchors)
    f = best.layout.row_divisor  # a row f times shorter: f of them make one of the run's
    how = "" if best.layout == Layout("colocated") else f" as {best.layout.describe(1)}"
    return Timings(target_s * f, drafter_s * f, f"measured on {info.device}{how}")


def plan_with_measurement(
    config: RunConfig, gpus: int | None, gb: float | None, measure: bool = True
) -> Plan:
    """`flashdraft train --plan`: the plan for `gpus` GPUs of `gb` GB from one measured step
    on this device (or, `measure` off or nothing fitting here, from FLOP estimates)."""
    geometry = run_geometry(config)
    timings = measure_timings(config, *geometry) if measure else None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return plan_for_run(config, gpus, gb, timings=timings, geometry=geometry)
