"""One writer per run directory (`train/lock.py`): a second `train` into a directory that a
live run holds is refused naming the holder; a dead holder's lease is taken over; the lease
is refreshed while held and given back at exit; local disks and object storage alike."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import fsspec
import pytest
from helpers import train_settings

from flashdraft import cli
from flashdraft.train import lock
from flashdraft.train.lock import LOCK, RunLock, RunLocked


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _lease(run, **fields) -> None:
    lease = {"host": socket.gethostname(), "pid": os.getpid(), "started": "then"}
    lease |= {"refreshed": time.time(), "token": "theirs", **fields}
    fs, path = fsspec.core.url_to_fs(f"{run}/{LOCK}")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe(path, json.dumps(lease).encode())


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_second_writer_is_refused_naming_the_holder_until_the_first_exits(
    tmp_path, where
) -> None:
    run = str(tmp_path / "run") if where == "local" else f"memory://{tmp_path}/run"
    with RunLock(run):
        with pytest.raises(RunLocked) as refused, RunLock(run):
            pass
        assert f"pid {os.getpid()} on {socket.gethostname()}" in str(refused.value)
        assert "pass --take-over" in str(refused.value)
    assert not fsspec.core.url_to_fs(f"{run}/{LOCK}")[0].exists(f"{run}/{LOCK}".split("://")[-1])
    with RunLock(run):  # given back at exit: the next run takes it
        pass


def test_a_dead_holders_lease_is_taken_over_and_a_live_one_only_when_asked(
    tmp_path, caplog
) -> None:
    run = str(tmp_path / "run")
    _lease(run, pid=_dead_pid())  # a run killed (-9) on this host
    with RunLock(run):
        pass
    assert "no longer exists" in caplog.text
    _lease(run, host="elsewhere", refreshed=time.time() - lock.STALE_S - 1)  # a lost node
    with RunLock(run):
        pass
    assert "last refreshed" in caplog.text
    _lease(run, host="elsewhere")  # alive, as far as anyone can tell
    with pytest.raises(RunLocked, match=r"pid .* on elsewhere"):
        RunLock(run).acquire()
    with RunLock(run, take_over=True):
        pass
    assert "--take-over was given" in caplog.text
    (tmp_path / "run" / LOCK).write_text('{"host": "cut')  # a lease cut mid-write
    with RunLock(run):
        pass


def test_the_lease_is_refreshed_and_a_take_over_is_noticed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lock, "REFRESH_S", 0.05)
    run = tmp_path / "run"
    with RunLock(str(run)) as held:
        first = json.loads((run / LOCK).read_text())["refreshed"]
        time.sleep(0.3)
        assert json.loads((run / LOCK).read_text())["refreshed"] > first
        _lease(str(run), token="another")  # --take-over by another run
        time.sleep(0.3)
        assert held.lost is not None and held.lost["token"] == "another"
    assert json.loads((run / LOCK).read_text())["token"] == "another"  # theirs, left alone


def test_two_trains_into_one_output_the_second_is_refused_in_one_line(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys
) -> None:
    """A job submitted twice: while the first holds the directory, the second writes
    nothing and says who holds it."""
    run = tmp_path / "run"
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 1})
    with RunLock(str(run)):
        assert cli.main(["train", *settings]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"flashdraft train: error: {run} is being written by another run")
        assert len(err.splitlines()) == 1
        assert sorted(p.name for p in run.iterdir()) == [LOCK]


def test_a_run_whose_lease_was_taken_over_stops_without_writing_its_checkpoint(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys, monkeypatch
) -> None:
    """Another run took the directory (--take-over) while this one trained: it stops at its
    next checkpoint, in one line, and writes none."""
    from flashdraft.train import trainer

    monkeypatch.setattr(lock, "REFRESH_S", 0.05)
    run = tmp_path / "run"

    def taken_over(event: str, **fields: object) -> None:
        if event == "row" and fields.get("step") == 1:
            _lease(str(run), host="elsewhere", token="another")
            time.sleep(0.3)  # the refresh notices

    monkeypatch.setattr(trainer, "trace", taken_over)
    fast = {"optim.max_steps": 2, "checkpoint.every": 1, "drafter.mask_token_id": 151669}
    assert cli.main(["train", *train_settings(run, tiny_qwen3_dir, qwen_data, **fast)]) == 2
    err = capsys.readouterr().err
    assert f"flashdraft train: error: {run} was taken over by another run (pid" in err
    assert "before step 1's checkpoint; stopping without writing" in err
    assert not (run / "checkpoints").exists()
    assert json.loads((run / LOCK).read_text())["token"] == "another"


@pytest.mark.slow  # a moto server's start-up (3 s): memory:// runs the same code by default
def test_the_lease_on_s3_refuses_a_second_writer_and_is_taken_over_when_stale(s3) -> None:
    """Object storage (moto's S3 server): no exclusive create, the lease is written and read
    back; a stale one (a lost node's) is taken over."""
    fs, _ = s3
    run = "s3://runs/run"
    with RunLock(run), pytest.raises(RunLocked, match=f"{run} is being written by another run"):
        RunLock(run).acquire()
    assert not fs.exists("runs/run/LOCK")
    stale = {"host": "elsewhere", "pid": 1, "started": "then", "token": "theirs"}
    fs.pipe(
        "runs/run/LOCK", json.dumps({**stale, "refreshed": time.time() - lock.STALE_S - 1}).encode()
    )
    with RunLock(run) as held:
        assert json.loads(fs.cat("runs/run/LOCK"))["token"] == held.token
