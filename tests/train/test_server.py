"""Split placement at the feature level: a target rank serves, a drafter rank receives the
same features, labels (soft ones included) and head it would compute with the target beside
it (two gloo processes on the CPU)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from helpers import train_settings

from flashdraft.train.config import load_run_config
from flashdraft.train.features import (
    LocalTarget,
    RemoteTarget,
    device_put,
    load_run_target,
    open_feature_source,
    rows_on_device,
)
from flashdraft.train.parallel import init_distributed, shutdown
from flashdraft.train.plan import plan_run
from flashdraft.train.server import serve_target


def _worker(rank: int, jobs: list[tuple[int, list[str], int]]) -> None:
    """Each job in turn, in one process group per job (one spawn start-up for them all)."""
    torch.set_num_threads(1)
    for port, settings, soft in jobs:
        _job(rank, port, settings, soft)


def _job(rank: int, port: int, settings: list[str], soft: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )
    config = load_run_config(None, settings)
    info = init_distributed("cpu")
    try:
        plan = plan_run(config, info, resume=False)
        if rank == 0:
            assert plan.placement.role == "target"
            serve_target(plan)
            return
        source = open_feature_source(plan, "sdpa")
        assert isinstance(source, RemoteTarget) and source.target is None
        local = LocalTarget(
            load_run_target(plan, "sdpa"), config.loss, plan.drafter_config.block_size, info.device
        )
        assert torch.equal(source.head.weight, local.head.weight)
        ids = torch.tensor([[1, 2, 151935]])
        assert torch.equal(source.head.embed(ids), local.head.embed(ids))
        put = device_put(info.device)
        rows = plan.stream.iterate(plan.positions(plan.placement.dp_rank), prefetch=0)
        for _ in range(plan.rows_left):
            row = next(rows)
            on_device = rows_on_device([row], put)
            got, want = source.row_outputs([row], on_device), local.row_outputs([row], on_device)
            for name in ("features", "next_tokens", "soft_ids", "soft_probs"):
                a, b = getattr(got, name), getattr(want, name)
                absent = soft == 0 and name.startswith("soft")
                assert (a is None) == (b is None) == absent, (soft, name)
                assert a is None or torch.equal(a, b), (soft, name)
            if soft:
                assert got.soft_ids is not None and got.soft_ids.shape[-1] == soft
        try:
            source.row_outputs([row], on_device)
        except RuntimeError as err:
            assert "every transfer" in str(err)
        else:
            raise AssertionError("a receive past the sender's last transfer must not hang")
    finally:
        shutdown(info)


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_a_drafter_rank_receives_what_its_target_rank_computes(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    """Hard labels, and soft ones (`loss.labels = "soft"`, top 6): the soft labels travel
    beside the taps and hard labels. Both runs in one pair of spawned processes, one after
    the other (a spawn's start-up, importing torch and the package, is most of its time)."""
    with socket.socket() as s0, socket.socket() as s6:  # two free ports, told apart
        s0.bind(("127.0.0.1", 0))
        s6.bind(("127.0.0.1", 0))
        ports = {0: s0.getsockname()[1], 6: s6.getsockname()[1]}
    jobs = []
    for soft, port in ports.items():
        extra = {
            "optim.max_steps": 2,
            "optim.grad_accum": 2,
            "parallel.placement": '"split"',
            "parallel.target_ranks": 1,
            "parallel.queue_depth": 1,
            **({"loss.labels": '"soft"', "loss.soft_top_k": soft} if soft else {}),
        }
        run = tmp_path / f"soft{soft}"
        settings = train_settings(run, tiny_qwen3_dir, qwen_data, **extra)[1::2]
        jobs.append((port, settings, soft))
    mp.spawn(_worker, args=(jobs,), nprocs=2, join=True)
