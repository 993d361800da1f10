"""Resumable checkpoints: complete or ignored, a bounded number kept, the full state back."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import tiny_drafter

from flashdraft.export import save_dflash
from flashdraft.train.checkpoint import (
    complete_checkpoints,
    is_training_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_drafter,
    save_checkpoint,
    step_dir,
)


def _trained_a_little(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    drafter = tiny_drafter(seed=seed)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for p in drafter.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return drafter, optimizer


def test_a_checkpoint_restores_weights_optimizer_state_and_every_rng(tmp_path) -> None:
    run = str(tmp_path)
    drafter, optimizer = _trained_a_little()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    url = save_checkpoint(run, 7, drafter, optimizer, {"cursor": 14}, keep=2, is_main=True)
    assert url == step_dir(run, 7) and is_training_checkpoint(url)
    expected = (random.random(), np.random.rand(), torch.rand(1))

    fresh = tiny_drafter(seed=5)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = load_checkpoint(url, fresh, fresh_optimizer)
    assert state["step"] == 7 and state["cursor"] == 14
    for (name, a), b in zip(drafter.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for p, q in zip(drafter.parameters(), fresh.parameters(), strict=True):
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, fresh_optimizer.state[q][key]), key
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_only_complete_checkpoints_count_and_old_ones_are_deleted(tmp_path) -> None:
    run = str(tmp_path)
    drafter, optimizer = _trained_a_little()
    for step in (1, 2, 3):
        save_checkpoint(run, step, drafter, optimizer, {"cursor": step}, keep=2, is_main=True)
    assert [s for s, _ in complete_checkpoints(run)] == [2, 3]
    assert not (tmp_path / "checkpoints" / "step_00000001").exists()
    (tmp_path / "checkpoints" / "step_00000004").mkdir()  # a crash before COMPLETE
    assert latest_checkpoint(run) == step_dir(run, 3)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(step_dir(run, 4), drafter, optimizer)
    assert save_checkpoint(run, 5, drafter, optimizer, {}, keep=2, is_main=False) is None
    assert latest_checkpoint(str(tmp_path / "nothing")) is None


def test_load_drafter_reads_a_checkpoint_a_run_directory_or_an_export(tmp_path) -> None:
    run = str(tmp_path / "run")
    drafter, optimizer = _trained_a_little()
    save_checkpoint(run, 2, drafter, optimizer, {}, keep=1, is_main=True)
    (tmp_path / "run" / "config.json").write_text("{}")  # the run config, as `train` writes it
    for url in (run, step_dir(run, 2)):
        loaded = load_drafter(url)
        assert torch.equal(loaded.fc.weight, drafter.fc.weight)
    save_dflash(drafter, str(tmp_path / "export"))
    exported = load_drafter(str(tmp_path / "export"))
    assert exported.fc.weight.dtype == torch.float32
    assert torch.equal(exported.fc.weight, drafter.fc.weight.to(torch.bfloat16).float())
    with pytest.raises(FileNotFoundError, match="neither a serving-format drafter"):
        load_drafter(str(tmp_path))
