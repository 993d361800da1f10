"""A graceful stop for `flashdraft train`: SIGTERM writes a checkpoint instead of losing the
steps since the last one.

SIGTERM is how a run is told to go: a scheduler's preemption or time limit (Slurm and
Kubernetes send it, then SIGKILL after a grace period), `kill`, `timeout`, and torchrun, which
sends its own SIGTERM on to every worker and kills them 30 s later. Python's default is to
die at once. While a `StopRequest` is installed, SIGTERM only sets a flag, however often it
comes (under Slurm a worker gets Slurm's and torchrun's; the launcher's SIGKILL still ends a
run that overstays). The trainer folds the flag into the sum it already all-reduces at every
log point (no extra collective, no extra sync), so every rank stops after the same step: the
first log point after the flag at which the target's run-ahead group (`target.forward_rows`)
ends, so that the resumed run forms the same groups and logs the same intervals. With
`log.every` a multiple of the steps in a group (forward_rows / grad_accum, as in the presets)
that is the next log point; otherwise it may be the next checkpoint, eval or the run's end
(then the run just finishes). There it writes the checkpoint and exits with `EXIT_CODE`;
`--resume` continues exactly as from any other checkpoint.

The grace period has to cover the steps to that log point, an in-training eval if one falls
there, and the checkpoint. The handler is installed once the run is planned (before the
target and the drafter are built), so a SIGTERM during their set-up or the first compile
stops the run at its first such log point. Only the colocated placement stops this way: in the
split placement the target ranks run ahead of the drafters through a queue, so a stop agreed
among the drafters would leave them sending; there SIGTERM still ends the process and
`--resume` goes back to the last periodic checkpoint.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

# 128 + SIGTERM: what a shell reports for a process SIGTERM ended, so a script that checks
# the status sees an unfinished run. Under torchrun each worker exits with it and torchrun
# itself exits 1, as for any failed worker.
EXIT_CODE = 128 + signal.SIGTERM
# How the stop's one line begins (`TrainingStopped`): a supervisor reads it in a log.
STOPPED = "stopped by SIGTERM after step"


class TrainingStopped(Exception):
    """Raised on every rank once the run stopped for SIGTERM, after its checkpoint. `go_on`:
    what the user runs next, which a caller that resumes by itself (the demo) rewrites."""

    def __init__(self, step: int, total: int, checkpoint: str) -> None:
        super().__init__(f"{STOPPED} {step} of {total}; checkpoint {checkpoint} written")
        self.step = step
        self.go_on = "run the same command with --resume to go on"


class StopRequest:
    """Notes SIGTERM while installed (a context manager; only in the main thread, where
    Python runs signal handlers). `enabled=False` installs nothing: `requested` stays False."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self._previous: Any = signal.SIG_DFL

    def __enter__(self) -> StopRequest:
        if self.enabled:
            previous = signal.signal(signal.SIGTERM, self._note)
            # None: a handler not installed from Python; put the default back after
            self._previous = signal.SIG_DFL if previous is None else previous
            # Restart the system calls SIGTERM interrupts that can be (Python's handlers do
            # not by default): fewer blocking calls in gloo / NCCL / store threads see EINTR.
            signal.siginterrupt(signal.SIGTERM, False)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag here (a handler runs between any two bytecodes, a log call's included);
        # the trainer says what happens once the ranks agree.
        self.requested = True
