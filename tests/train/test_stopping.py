"""The SIGTERM flag (`train/stopping.py`) in this process; the stop it drives, agreed by the
ranks of a torchrun run, is tested in test_parallel.py."""

from __future__ import annotations

import os
import signal
import threading
import time

from flashdraft.train.stopping import StopRequest


def _wait_for(flag: StopRequest) -> None:
    # A signal a process sends itself is handled before its next few bytecodes run.
    deadline = time.monotonic() + 5
    while not flag.requested and time.monotonic() < deadline:
        time.sleep(0.001)


def test_sigterm_sets_the_flag_however_often_it_comes() -> None:
    """Under Slurm a torchrun worker gets SIGTERM twice (Slurm's, then torchrun's): the second
    must not kill it before its checkpoint. The handler is put back on the way out."""
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.requested
        for _ in range(2):
            assert signal.getsignal(signal.SIGTERM) == stop._note  # still caught
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for(stop)
            assert stop.requested
            stop.requested = False  # to see the second one arrive
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
