"""The rows of each optimizer step, and what accumulates between two log lines.

With `target.forward_rows` = R > 1 the target runs ahead over the rows of the next R / G steps
at once (`StepRows`); `group_steps` cuts those groups so that a checkpoint or an eval never
falls inside one, and a resumed run forms the same groups.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from flashdraft.train.config import RunConfig
from flashdraft.train.features import AheadTarget
from flashdraft.train.held_out import HeldOutEval
from flashdraft.train.loss import BlockStats
from flashdraft.train.packing import Row
from flashdraft.train.schedule import Stopwatch

PHASES = ("target", "drafter")  # the step's timed phases (metrics: target_s, drafter_s)


@dataclass(slots=True)
class Interval:
    """What accumulates between two log lines (device tensors: no sync in the step)."""

    stats: BlockStats | None = None
    steps: int = 0
    tokens: int = 0
    rows: int = 0
    empty: Tensor | None = None  # steps with nothing to train (their update skipped)
    started: float = field(default_factory=time.perf_counter)


def group_steps(step: int, total: int, per_group: int, *every: int) -> int:
    """Steps in the group that starts at `step`: `per_group`, fewer before the last step or
    the next multiple of each of `every` (checkpoints, evals; 0: none). A run resumed at a
    checkpoint with the same settings forms the same groups; nothing is held when a
    checkpoint is written or an eval runs."""
    steps = min(per_group, total - step)
    for interval in every:
        if interval > 0:
            steps = min(steps, interval - step % interval)
    return steps


class Stepping(Protocol):
    """What `StepRows` reads of the trainer (a `Trainer`; named here so this module does not
    import it): the run's config, whether evals run, the feature source, the step counters."""

    config: RunConfig
    held_out: HeldOutEval  # `.on`: evals run
    source: Any  # the feature source; an AheadTarget runs ahead
    step: int
    total_steps: int
    stopwatch: Stopwatch


class StepRows:
    """The rows of each optimizer step, in stream order. With `target.forward_rows` = R > 1
    (an `AheadTarget`) it takes the rows of the next R / G steps at once (`group_steps`) and
    has the target run over them before the first of those steps."""

    def __init__(self, trainer: Stepping, rows: Iterator[Row]) -> None:
        self.trainer, self.rows = trainer, rows
        config = trainer.config
        self.accum = config.optim.grad_accum
        self.every = (config.checkpoint.every, config.eval.every if trainer.held_out.on else 0)
        self.per_group = max(1, config.target.forward_rows // self.accum)
        self.ahead = trainer.source if isinstance(trainer.source, AheadTarget) else None
        self.upcoming: deque[Row] = deque()

    def group_size(self) -> int:
        """Steps of the group that starts at the trainer's step."""
        trainer = self.trainer
        return max(1, group_steps(trainer.step, trainer.total_steps, self.per_group, *self.every))

    def take(self) -> list[Row]:
        if not self.upcoming:
            trainer = self.trainer
            group = [next(self.rows) for _ in range(self.group_size() * self.accum)]
            if self.ahead is not None:
                t0 = trainer.stopwatch.mark()
                self.ahead.run_ahead(group)
                trainer.stopwatch.add(PHASES[0], t0, trainer.stopwatch.mark())
            self.upcoming.extend(group)
        return [self.upcoming.popleft() for _ in range(self.accum)]
