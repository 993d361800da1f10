"""A graceful stop for `flashdraft train`: SIGTERM or SIGINT (Ctrl-C) writes a checkpoint
instead of losing the steps since the last one.

SIGTERM is how a run is told to go: a scheduler's preemption or time limit (Slurm and
Kubernetes send it, then SIGKILL after a grace period), `kill`, `timeout`, and torchrun, which
sends its own SIGTERM on to every worker and kills them 30 s later. SIGINT is how a user at a
terminal says it (Ctrl-C reaches every process of the job; torchrun passes its own on too).
Python's defaults are to die at once and to raise KeyboardInterrupt wherever the run is.
While a `StopRequest` is installed, either signal only sets a flag, however often it comes
(under Slurm a worker gets Slurm's and torchrun's; the launcher's SIGKILL still ends a run
that overstays). The trainer folds the flag into the sum it already all-reduces at every
log point (no extra collective, no extra sync), so every rank stops after the same step: the
first log point after the flag at which the target's run-ahead group (`target.forward_rows`)
ends, so that the resumed run forms the same groups and logs the same intervals. With
`log.every` a multiple of the steps in a group (forward_rows / grad_accum, as in the presets)
that is the next log point; otherwise it may be the next checkpoint, eval or the run's end
(then the run just finishes). There it writes the checkpoint and exits with `EXIT_CODE`;
`--resume` continues exactly as from any other checkpoint.

In the split placement the target ranks run ahead of the drafters through a queue, so the
stop is agreed by every rank, target ranks included, in a vote over a CPU (gloo) group at each
stop point (`is_stop_point`: the log points before the end, known to both sides from the
config; `parallel.vote_stop`). A drafter rank votes when it reaches the point S; a target rank when its next row for
a consumer would go past the rows that consumer has posted receives for by then (its rows up
to S and `parallel.queue_depth` - 1 more: `FeatureReceiver`). So on a stop every row sent has
a receive posted for it and none is posted without a row: the drafter ranks write the
checkpoint of step S, receive and drop those rows (`FeatureReceiver.drain`), and every rank
meets at a barrier and exits. Only at a stop point is a target rank held to queue_depth - 1
rows ahead; between them it runs ahead as far as the queue lets it.

The grace period has to cover the steps to that log point, an in-training eval if one falls
there, and the checkpoint. The handler is installed once the run is planned (before the
target and the drafter are built), so a signal during their set-up or the first compile
stops the run at its first such log point.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

# 128 + SIGTERM: what a shell reports for a process SIGTERM ended, so a script that checks
# the status sees an unfinished run (a Ctrl-C stop exits with it too: one status for "stopped,
# resumable"). Under torchrun each worker exits with it and torchrun itself exits 1, as for
# any failed worker.
EXIT_CODE = 128 + signal.SIGTERM
SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How the stop's one line begins (`TrainingStopped`): a supervisor reads it in a log.
STOPPED = "stopped by SIGTERM after step"
_NOTICE = (
    b"flashdraft train: Ctrl-C: stopping at the next log point, with a checkpoint "
    b"(kill -9 stops at once and loses the steps since the last checkpoint)\n"
)


def is_stop_point(step: int, total: int, log_every: int, checkpoint_every: int) -> bool:
    """Whether a run may stop after `step`: a log point (every log and checkpoint step log)
    before the end. The split placement votes at exactly these."""
    at_checkpoint = checkpoint_every > 0 and step % checkpoint_every == 0
    return step < total and (step % log_every == 0 or at_checkpoint)


class TrainingStopped(Exception):
    """Raised on every rank once the run stopped for SIGTERM, after its checkpoint. `go_on`:
    what the user runs next, which a caller that resumes by itself (the demo) rewrites."""

    def __init__(self, step: int, total: int, checkpoint: str, by: str = "SIGTERM") -> None:
        stopped = STOPPED.replace("SIGTERM", by)
        super().__init__(f"{stopped} {step} of {total}; checkpoint {checkpoint} written")
        self.step = step
        self.go_on = "run the same command with --resume to go on"


class StopRequest:
    """Notes SIGTERM and SIGINT while installed (a context manager; only in the main thread,
    where Python runs signal handlers). `enabled=False` installs nothing: `requested` stays
    False. `by`: the first signal's name."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self.by = "SIGTERM"
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if self.enabled:
            for signum in SIGNALS:
                previous = signal.signal(signum, self._note)
                # None: a handler not installed from Python; put the default back after
                self._previous[signum] = signal.SIG_DFL if previous is None else previous
                # Restart the system calls the signal interrupts that can be (Python's
                # handlers do not by default): fewer blocking calls in gloo / NCCL / store
                # threads see EINTR.
                signal.siginterrupt(signum, False)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self.enabled:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag here (a handler runs between any two bytecodes, a log call's included);
        # the trainer says what happens once the ranks agree. A user at a terminal gets an
        # answer at once, written raw (no logging lock is taken in a handler).
        if not self.requested:
            self.by = signal.Signals(signum).name
            if signum == signal.SIGINT:
                os.write(2, _NOTICE)
        self.requested = True
