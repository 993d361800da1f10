"""Two torchrun "nodes" on one machine: multi-node training proven, not assumed.

Each node is its own `torchrun --nnodes 2 --nproc-per-node 2` launch, joined by a c10d
rendezvous on a loopback port, gloo on the CPU: 4 processes in all, exactly as on two hosts
(global rank vs local rank, which rank writes, which ranks load which rows). Checked against a
one-process control on the same global batch (4 rows per step), through the run's own trace
(`FLASHDRAFT_TRACE`: every row each rank consumed, every file it wrote, its role):

* the loss curve equals the control's, colocated (4 drafter replicas) and split (the 2 target
  ranks on one node feeding the 2 drafter ranks on the other, grad_accum 2);
* every packed row is consumed exactly once per epoch across the ranks;
* exactly one process writes each checkpoint, the metrics and the export;
* one node killed mid-run: the run resumes on 1 process and on 3 processes (1 target + 2
  drafter ranks) with metrics identical to the uninterrupted run from the resume point on;
* the same with the run directory on S3 (moto's server on loopback): no rank assumes a shared
  local filesystem.

Marked `slow` (each launch starts 4 processes on the CI's 2 cores): `pytest -m slow
tests/train/test_multinode.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import read_metrics, train_settings

from flashdraft import cli
from flashdraft.data.dataset import write_dataset

pytestmark = pytest.mark.slow

COMPARED = ("loss", "tau_hat", "acc", "grad_norm", "trained_slots", "tokens", "rows")
ROWS_PER_STEP = 4
# Small runs: 256-token rows, 2 epochs over ~30 rows each, a checkpoint every 2 steps.
RUN = {
    "optim.epochs": 2,
    "optim.max_steps": 1000,
    "checkpoint.every": 2,
    "checkpoint.keep": 10,
    "log.every": 1,
    "log.tensorboard": "false",
}


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """40 synthetic documents of 60..250 tokens (~30 packed rows of 256 per epoch)."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(40):
        n = int(rng.integers(60, 250))
        ids = rng.integers(0, 151000, n).astype(np.int32)
        mask = np.zeros(n, dtype=np.int8)
        mask[n // 3 :] = 1
        rows.append((ids, mask, f"synthetic:{i}"))
    url = tmp_path_factory.mktemp("multinode") / "data"
    write_dataset(str(url), rows)
    return url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _settings(run: object, target: Path, data: Path, **extra: object) -> list[str]:
    return train_settings(run, target, data, **{**RUN, **extra})


def _env(trace: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FLASHDRAFT_TRACE": str(trace),
        **(extra or {}),
    }


def _node(node_rank: int, port: int, settings: list[str], env: dict[str, str]) -> subprocess.Popen:
    """One "node": its own torchrun agent with 2 local processes, in its own process group
    (so that killing the node kills its agent and its workers, as losing a host would). Its
    output goes to a file next to the trace (a pipe nobody reads could fill and block it)."""
    log = open(Path(env["FLASHDRAFT_TRACE"]).with_suffix(f".node{node_rank}.log"), "w")  # noqa: SIM115
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", f"flashdraft-{port}", "--max-restarts", "0",
        "-m", "flashdraft.cli", "train", *settings,
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _output(env: dict[str, str], node_rank: int) -> str:
    return Path(env["FLASHDRAFT_TRACE"]).with_suffix(f".node{node_rank}.log").read_text()[-6000:]


def _two_nodes(settings: list[str], env: dict[str, str], timeout: float = 900) -> None:
    port = _free_port()
    nodes = [_node(rank, port, settings, env) for rank in (0, 1)]
    for rank, node in enumerate(nodes):
        node.wait(timeout=timeout)
        assert node.returncode == 0, _output(env, rank)


def _events(trace: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(trace.glob("trace-rank*.jsonl")) for line in f.open()]


def _same_curve(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)


def _check_rows_once_per_epoch(events: list[dict], total_steps: int) -> None:
    """Rows consumed across all drafter ranks: no duplicate, none skipped. The stream covers
    the epochs in order and a run takes whole steps, so only the last epoch's final rows
    (fewer than a step's) may be left over."""
    rows = [(e["epoch"], e["index"]) for e in events if e["event"] == "row"]
    assert len(rows) == total_steps * ROWS_PER_STEP
    assert len(set(rows)) == len(rows), Counter(rows).most_common(3)
    by_epoch: dict[int, list[int]] = {}
    for epoch, index in rows:
        by_epoch.setdefault(epoch, []).append(index)
    assert sorted(by_epoch) == [0, 1]
    for epoch, indices in by_epoch.items():
        assert sorted(indices) == list(range(len(indices))), epoch  # contiguous from row 0
    per_epoch = len(by_epoch[0])  # epoch 0 is complete: the next epoch was started
    assert per_epoch - ROWS_PER_STEP < len(by_epoch[1]) <= per_epoch


def _check_single_writers(events: list[dict]) -> None:
    writes = Counter((e["what"], e["url"]) for e in events if e["event"] == "write")
    writers: dict[tuple[str, str], set[int]] = {}
    for e in events:
        if e["event"] == "write":
            writers.setdefault((e["what"], e["url"]), set()).add(e["rank"])
    assert {what for what, _ in writes} == {"checkpoint", "metrics", "export"}
    assert all(len(ranks) == 1 for ranks in writers.values()), writers
    # A checkpoint or the export is written once; the metrics file is opened once per launch.
    assert all(n == 1 for (what, _), n in writes.items() if what != "metrics"), writes


@pytest.fixture(scope="module")
def control(tmp_path_factory, tiny_qwen3_dir, small_data) -> list[dict]:
    """One process, the same global batch: grad_accum 4."""
    run = tmp_path_factory.mktemp("control") / "run"
    settings = _settings(run, tiny_qwen3_dir, small_data, **{"optim.grad_accum": ROWS_PER_STEP})
    assert cli.main(["train", *settings]) == 0
    return read_metrics(run)


@pytest.mark.parametrize(
    ("placement", "extra"),
    [
        ("colocated", {"optim.grad_accum": 1}),  # 4 drafter replicas x 1 row
        (
            "split",  # global ranks 0-1 (node A) run the target, 2-3 (node B) the drafter
            {"optim.grad_accum": 2, "parallel.placement": '"split"', "parallel.target_ranks": 2},
        ),
    ],
)
def test_two_nodes_match_one_process(
    tmp_path, tiny_qwen3_dir, small_data, control, placement, extra
) -> None:
    run, trace = tmp_path / "run", tmp_path / "trace"
    _two_nodes(_settings(run, tiny_qwen3_dir, small_data, **extra), _env(trace))
    _same_curve(read_metrics(run), control)
    events = _events(trace)
    _check_rows_once_per_epoch(events, total_steps=control[-1]["step"])
    _check_single_writers(events)
    roles = {
        e["rank"]: (e["role"], e["node"], e["local_rank"]) for e in events if e["event"] == "role"
    }
    assert sorted(roles) == [0, 1, 2, 3] and {node for _, node, _ in roles.values()} == {"0", "1"}
    # Global rank = node x 2 + local rank: the mapping rank handling must not confuse.
    assert all(rank == int(node) * 2 + local for rank, (_, node, local) in roles.items())
    if placement == "split":
        targets = {node for role, node, _ in roles.values() if role == "target"}
        drafters = {node for role, node, _ in roles.values() if role == "drafter"}
        assert len(targets) == 1 and len(drafters) == 1 and targets != drafters
        assert {e["rank"] for e in events if e["event"] == "row"} == {2, 3}
        # What crosses the network per row: the taps [1, T, K*H] in the target's dtype and the
        # labels [1, A, B-1] int64 (docs/multi-node.md: the Qwen3-8B figure comes from this).
        sends = [e["bytes"] for e in events if e["event"] == "send"]
        row_tokens, taps, hidden, anchors, block = 256, 1, 64, 24, 8  # tests/helpers.py sizes
        assert len(sends) == control[-1]["step"] * ROWS_PER_STEP
        assert set(sends) == {row_tokens * taps * hidden * 4 + anchors * (block - 1) * 8}
    assert (run / "export" / "model.safetensors").exists()


def _kill_node_after_checkpoint(run: Path, settings: list[str], env: dict[str, str], step: int):
    """Start both nodes, wait for checkpoint `step`, SIGKILL node 1 (agent and workers);
    node 0 then fails on its next collective. Returns when both are gone."""
    port = _free_port()
    nodes = [_node(rank, port, settings, env) for rank in (0, 1)]
    marker = run / "checkpoints" / f"step_{step:08d}" / "COMPLETE"
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert time.monotonic() < deadline, "no checkpoint before the kill"
        assert all(n.poll() is None for n in nodes), [_output(env, r) for r in (0, 1)]
        time.sleep(0.2)
    os.killpg(nodes[1].pid, signal.SIGKILL)
    try:
        nodes[0].wait(timeout=120)
    except subprocess.TimeoutExpired:  # a survivor stuck in a collective: the host is lost too
        os.killpg(nodes[0].pid, signal.SIGKILL)
    for node in nodes:
        node.wait()
    assert nodes[0].returncode != 0


def test_a_killed_node_resumes_on_one_and_on_three_processes(
    tmp_path, tiny_qwen3_dir, small_data, control
) -> None:
    run = tmp_path / "run"
    settings = _settings(run, tiny_qwen3_dir, small_data, **{"optim.grad_accum": 1})
    _kill_node_after_checkpoint(run, settings, _env(tmp_path / "trace"), step=4)
    resumed_from = max(
        int(p.name.split("_")[1])
        for p in (run / "checkpoints").iterdir()
        if (p / "COMPLETE").exists()
    )
    assert resumed_from >= 4
    want = [r for r in control if r["step"] > resumed_from]

    # 1 process: 1 replica x 4 rows per step (the same global batch).
    one = tmp_path / "one"
    shutil.copytree(run, one)
    settings_one = _settings(one, tiny_qwen3_dir, small_data, **{"optim.grad_accum": 4})
    assert cli.main(["train", *settings_one, "--resume"]) == 0
    _same_curve([r for r in read_metrics(one) if r["step"] > resumed_from], want)

    # 3 processes: 1 target rank + 2 drafter replicas x 2 rows per step.
    three = tmp_path / "three"
    shutil.copytree(run, three)
    split = {"optim.grad_accum": 2, "parallel.placement": '"split"', "parallel.target_ranks": 1}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
        "-m", "flashdraft.cli", "train",
        *_settings(three, tiny_qwen3_dir, small_data, **split), "--resume",
    ]  # fmt: skip
    env = _env(tmp_path / "trace3")
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _same_curve([r for r in read_metrics(three) if r["step"] > resumed_from], want)


def test_two_nodes_with_the_run_on_s3(tmp_path, tiny_qwen3_dir, small_data, control, s3) -> None:
    fs, aws = s3
    url = "s3://runs/multinode"
    trace = tmp_path / "trace"
    settings = _settings(url, tiny_qwen3_dir, small_data, **{"optim.grad_accum": 1})
    _two_nodes(settings, _env(trace, aws))
    lines = fs.cat("runs/multinode/metrics.jsonl").decode().splitlines()
    _same_curve([json.loads(line) for line in lines], control)
    assert fs.exists("runs/multinode/export/model.safetensors")
    _check_single_writers(_events(trace))
