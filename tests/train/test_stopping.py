"""The SIGTERM flag (`train/stopping.py`) in this process; the stop it drives, agreed by the
ranks of a torchrun run, is tested in test_parallel.py."""

from __future__ import annotations

import os
import signal
import threading
import time

from flashdraft.train.stopping import EXIT_CODE, StopRequest, TrainingStopped


def _wait_for(flag: StopRequest) -> None:
    # A signal a process sends itself is handled before its next few bytecodes run.
    deadline = time.monotonic() + 5
    while not flag.requested and time.monotonic() < deadline:
        time.sleep(0.001)


def test_sigterm_sets_the_flag_and_the_next_one_kills() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.requested and signal.getsignal(signal.SIGTERM) != before
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for(stop)
        assert stop.requested
        # the first SIGTERM asked for a checkpoint; a second one is not caught
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_disabled_request_or_one_outside_the_main_thread_installs_nothing() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest(enabled=False) as stop:
        assert signal.getsignal(signal.SIGTERM) == before and not stop.enabled
    seen: list[bool] = []

    def elsewhere() -> None:  # Python runs signal handlers in the main thread only
        with StopRequest() as other:
            seen.append(other.enabled)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert seen == [False] and signal.getsignal(signal.SIGTERM) == before


def test_the_stop_says_where_to_resume_from_and_exits_as_sigterm_would() -> None:
    stopped = TrainingStopped(6, 12, "runs/r/checkpoints/step_00000006")
    assert str(stopped) == (
        "stopped by SIGTERM after step 6 of 12; checkpoint runs/r/checkpoints/step_00000006 "
        "written: run the same command with --resume to go on"
    )
    assert stopped.step == 6 and EXIT_CODE == 143
