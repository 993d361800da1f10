"""The SIGTERM / SIGINT flag (`train/stopping.py`) in this process, and the split
placement's stop counted on both sides; the stop it drives, agreed by the ranks of a torchrun
run, is tested in test_parallel.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from flashdraft.train import server
from flashdraft.train.parallel import FeatureReceiver
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


def test_ctrl_c_sets_the_flag_instead_of_raising_keyboard_interrupt() -> None:
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for(stop)
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C raised KeyboardInterrupt under a StopRequest")
        assert stop.requested and stop.by == "SIGINT"
    assert signal.getsignal(signal.SIGINT) == before


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


class _Work:
    def wait(self) -> bool:
        return True


@pytest.mark.parametrize(("depth", "accum", "consumers"), [(1, 1, 1), (2, 2, 1), (5, 2, 2)])
def test_a_split_stop_leaves_no_row_in_flight(monkeypatch, depth, accum, consumers) -> None:
    """The split placement's stop, both sides counted without processes: stopping at step 4
    (log points 2, 4, 6 of 8), a target rank has sent each consumer exactly the rows that
    consumer has posted receives for when it votes (its rows to step 4 and queue_depth - 1
    more: a send never waits on a receive that is not coming, a receive never on a send),
    and it voted on 2 and 4 only; run to the end, it votes at every point."""
    sent: dict[int, int] = {}
    votes: list[bool] = []

    def run(stop_at: int | None) -> int | None:
        sent.clear()
        votes.clear()
        peers = list(range(1, consumers + 1))

        class Sender:
            def __init__(self, peer: int, depth: int) -> None:
                self.peer = peer

            def send(self, outputs: object) -> None:
                sent[self.peer] = sent.get(self.peer, 0) + 1

            def flush(self) -> None:
                pass

        def fake_vote(asked: bool, group: object) -> bool:
            votes.append(asked)
            return len(votes) == {None: 0, 2: 1, 4: 2}[stop_at]

        for name, value in {
            "load_run_target": lambda plan, backend, model: SimpleNamespace(head=None),
            "default_backend": lambda device: "sdpa",
            "head_payload": lambda head: [],
            "send_head": lambda payload, peers: None,
            "FeatureSender": Sender,
            "device_put": lambda device: None,
            "rows_on_device": lambda rows, put: None,
            "target_outputs": lambda *args: None,
            "vote_stop": fake_vote,
        }.items():
            monkeypatch.setattr(server, name, value)
        config = SimpleNamespace(
            parallel=SimpleNamespace(queue_depth=depth, overlap=False),
            data=SimpleNamespace(prefetch=0),
            optim=SimpleNamespace(grad_accum=accum),
            log=SimpleNamespace(every=2),
            checkpoint=SimpleNamespace(every=0),
            loss=None,
        )
        plan = SimpleNamespace(
            config=config,
            info=SimpleNamespace(rank=0, device=torch.device("cpu")),
            placement=SimpleNamespace(
                consumers=lambda rank: peers, drafter_ranks=(0, *peers), control=None
            ),
            stream=SimpleNamespace(iterate=lambda positions, prefetch: iter(positions)),
            positions=lambda dp_rank: iter(range(10**6)),
            drafter_config=SimpleNamespace(block_size=8),
            start_step=0,
            total_steps=8,
            rows_left=8 * accum,
        )
        return server.serve_target(plan, stop=StopRequest(enabled=False))  # type: ignore[arg-type]

    assert run(None) is None and len(votes) == 3  # points 2, 4, 6
    assert sent == dict.fromkeys(range(1, consumers + 1), 8 * accum)
    assert run(4) == 4 and len(votes) == 2

    # The drafter's side: after the receive of its last row of step 4, what it has posted
    receiver = FeatureReceiver(0, (1,), (1,), torch.float32, torch.device("cpu"), depth, 8 * accum)
    monkeypatch.setattr(dist, "irecv", lambda tensor, peer: _Work())
    for _ in range(4 * accum):
        receiver.receive()
    drained = receiver.drain()
    assert sent == dict.fromkeys(range(1, consumers + 1), 4 * accum + drained)
    assert drained == min(depth - 1, 4 * accum) and receiver.remaining == 0


def test_the_console_script_imports_no_torch_for_the_stop() -> None:
    """`flashdraft.cli` imports this module for every command: torch stays out of `audit`."""
    code = "import sys, flashdraft.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
