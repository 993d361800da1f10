"""When things happen in a run: the learning-rate schedule, a stopwatch for its phases, and
where a process's time went."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from flashdraft.train.config import OptimSection


def lr_at(step: int, total: int, optim: OptimSection) -> float:
    """Warmup, then cosine or linear to min_lr_ratio, warmup-stable-decay (linear), or
    constant."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    floor = optim.min_lr_ratio
    if optim.schedule == "constant":
        return optim.lr
    if optim.schedule in ("cosine", "linear"):
        progress = min((step - optim.warmup_steps) / max(1, total - optim.warmup_steps), 1.0)
        if optim.schedule == "linear":
            return optim.lr * (1 - (1 - floor) * progress)
        return optim.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    decay_start = total - int(optim.decay_ratio * total)
    if step < decay_start:
        return optim.lr
    progress = (step - decay_start) / max(1, total - decay_start)
    return optim.lr * (1 - (1 - floor) * min(progress, 1.0))


class Stopwatch:
    """Phase times without host syncs in the step: CUDA events, read only when logging."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list[Any]] = {}

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, name: str, start: Any, end: Any) -> None:
        self.spans.setdefault(name, []).append((start, end))

    def seconds(self, name: str, keep: bool = False) -> float:
        """Total seconds of a phase since the last call (syncs on CUDA); `keep`: count them
        again in the next call."""
        spans = self.spans.get(name, []) if keep else self.spans.pop(name, [])
        if self.cuda:
            if spans:
                spans[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1e3
        return float(sum(b - a for a, b in spans))


def time_spent(
    *,
    setup: float,
    looped: float,
    steps: int,
    first: float,
    saved: int,
    checkpoints: float,
    export: float,
) -> str:
    """The line `train` ends with: where this process's time went, set-up to export (a device
    call's start-up and finish outside the steps). `looped`: seconds of
    the step loop, `first` of its first step, `checkpoints` of the `saved` checkpoints in it;
    the steps' share is what is left of the loop after the first step and the checkpoints
    (logging and in-training evals included). The interpreter's start and imports come before
    the set-up; on several ranks a checkpoint's time includes the wait for the others at its
    barrier."""
    rest = max(0.0, looped - first - checkpoints)
    ran = (
        f"first step {first:.1f} s, {steps - 1} more steps {rest:.1f} s"
        if steps
        else "no step left to run"  # resumed at its last step: only the export
    )
    return (
        f"flashdraft train: {setup + looped + export:.1f} s from set-up to export: set up "
        f"{setup:.1f} s, {ran}, {saved} checkpoint(s) {checkpoints:.1f} s, export {export:.1f} s"
    )
