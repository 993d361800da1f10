"""Resumable checkpoints: complete or ignored, checksummed, a bounded number kept, the full
state back; a drafter loaded from a run, a checkpoint or an export, told by their markers."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch
from helpers import tiny_drafter

from flashdraft import storage
from flashdraft.export import save_dflash, save_speculators
from flashdraft.train.checkpoint import (
    STATE_FILES,
    complete_checkpoints,
    is_training_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_drafter,
    save_checkpoint,
    save_drafter,
    set_aside,
    step_dir,
    usable_checkpoint,
    verify_checkpoint,
)
from flashdraft.train.config import OptimSection
from flashdraft.train.optim import build_optimizer


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


def test_muon_and_its_adamw_come_back_from_a_checkpoint(tmp_path) -> None:
    """optim.optimizer = "muon": two torch optimizers behind one `Optimizers`; both states
    (Muon's momentum, AdamW's moments) and both param groups' settings come back."""
    section = OptimSection(optimizer="muon", lr=1e-2, muon_momentum=0.9)
    drafter = tiny_drafter(seed=0)
    optimizer = build_optimizer(drafter, section, torch.device("cpu"))
    for _ in range(2):
        for p in drafter.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    url = save_checkpoint(str(tmp_path), 3, drafter, optimizer, {}, keep=1, is_main=True)
    assert url is not None
    fresh = tiny_drafter(seed=5)
    fresh_optimizer = build_optimizer(fresh, section, torch.device("cpu"))
    load_checkpoint(url, fresh, fresh_optimizer)
    for a, b in zip(optimizer, fresh_optimizer, strict=True):
        assert type(a) is type(b) and len(a.state) == len(b.state) > 0
        for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True):
            assert a.state[p].keys() == b.state[q].keys()
            for key, value in a.state[p].items():
                assert torch.equal(value, b.state[q][key]), key
        assert (
            a.param_groups[0]["momentum" if "momentum" in a.defaults else "betas"]
            == (b.param_groups[0]["momentum" if "momentum" in b.defaults else "betas"])
        )


def test_only_complete_checkpoints_count_and_old_ones_are_deleted(tmp_path) -> None:
    run = str(tmp_path)
    drafter, optimizer = _trained_a_little()
    for step in (1, 2, 3):
        save_checkpoint(run, step, drafter, optimizer, {"cursor": step}, keep=2, is_main=True)
    assert [s for s, _ in complete_checkpoints(run)] == [2, 3]
    assert not (tmp_path / "checkpoints" / "step_00000001").exists()
    (tmp_path / "checkpoints" / "step_00000004").mkdir()  # a crash before COMPLETE
    assert latest_checkpoint(run) == step_dir(run, 3)
    with pytest.raises(ValueError, match="no COMPLETE marker"):
        load_checkpoint(step_dir(run, 4), drafter, optimizer)
    assert save_checkpoint(run, 5, drafter, optimizer, {}, keep=2, is_main=False) is None
    assert latest_checkpoint(str(tmp_path / "nothing")) is None


def test_complete_records_every_file_and_any_change_is_named(tmp_path) -> None:
    run = str(tmp_path)
    drafter, optimizer = _trained_a_little()
    url = save_checkpoint(run, 3, drafter, optimizer, {"cursor": 3}, keep=2, is_main=True)
    assert url is not None
    marker = json.loads((tmp_path / "checkpoints" / "step_00000003" / "COMPLETE").read_text())
    assert marker["step"] == 3 and sorted(marker["files"]) == sorted(STATE_FILES)
    for name, record in marker["files"].items():
        data = (tmp_path / "checkpoints" / "step_00000003" / name).read_bytes()
        assert record == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert verify_checkpoint(url) is None

    folder = tmp_path / "checkpoints" / "step_00000003"
    weights = (folder / "drafter.safetensors").read_bytes()
    (folder / "drafter.safetensors").write_bytes(weights[:-10])  # cut short
    assert "drafter.safetensors: " in (verify_checkpoint(url) or "")
    assert "cut short" in (verify_checkpoint(url) or "")
    flipped = bytearray(weights)
    flipped[-1] ^= 1  # same size, one bit
    (folder / "drafter.safetensors").write_bytes(bytes(flipped))
    assert "sha256 differs" in (verify_checkpoint(url) or "")
    with pytest.raises(ValueError, match=r"is unusable: drafter\.safetensors: its sha256"):
        load_checkpoint(url, drafter, optimizer)
    (folder / "drafter.safetensors").write_bytes(weights)
    (folder / "state.json").unlink()
    assert verify_checkpoint(url) == "state.json: missing"
    # Loading only the drafter needs only the drafter's files.
    assert torch.equal(load_drafter(url).fc.weight, drafter.fc.weight)


def test_resume_walks_back_to_the_newest_checkpoint_that_verifies(tmp_path, caplog) -> None:
    run = str(tmp_path)
    drafter, optimizer = _trained_a_little()
    for step in (2, 4, 6):
        save_checkpoint(run, step, drafter, optimizer, {"cursor": step}, keep=3, is_main=True)
    (tmp_path / "checkpoints" / "step_00000006" / "optimizer.safetensors").write_bytes(b"")
    (tmp_path / "checkpoints" / "step_00000004" / "rng.safetensors").write_bytes(b"x" * 9)
    found, skipped = usable_checkpoint(run)
    assert found == step_dir(run, 2)
    assert [url for url, _ in skipped] == [step_dir(run, 6), step_dir(run, 4)]
    assert skipped[0][1].startswith("optimizer.safetensors: 0 bytes, COMPLETE recorded")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"skipping checkpoint {url}: {why}" for url, why in skipped]
    # A run directory loads its newest usable drafter: 6 and 4 still have good drafter files.
    assert load_drafter(run) is not None
    moved = set_aside(step_dir(run, 6))
    assert moved == str(tmp_path / "checkpoints" / "unusable_step_00000006")
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4]  # never counted again
    assert (tmp_path / "checkpoints" / "unusable_step_00000006" / "COMPLETE").exists()


def test_checkpoints_of_earlier_versions_load_after_a_structural_check(tmp_path, caplog) -> None:
    """Before checksums, COMPLETE held the step number: such checkpoints still load (with a
    warning), and a file cut short is still found by its safetensors header."""
    run = str(tmp_path)
    drafter, optimizer = _trained_a_little()
    url = save_checkpoint(run, 5, drafter, optimizer, {"cursor": 5}, keep=2, is_main=True)
    assert url is not None
    folder = tmp_path / "checkpoints" / "step_00000005"
    (folder / "COMPLETE").write_text("5\n")
    fresh = tiny_drafter(seed=4)
    state = load_checkpoint(url, fresh, torch.optim.AdamW(fresh.parameters()))
    assert state["step"] == 5 and torch.equal(fresh.fc.weight, drafter.fc.weight)
    assert any("has no checksums" in r.getMessage() for r in caplog.records)
    optimizer_file = folder / "optimizer.safetensors"
    optimizer_file.write_bytes(optimizer_file.read_bytes()[:-4])
    assert "optimizer.safetensors: " in (verify_checkpoint(url) or "")
    optimizer_file.write_bytes(b"")
    assert "too short for a safetensors header" in (verify_checkpoint(url) or "")
    (folder / "state.json").write_text("{cut")
    assert verify_checkpoint(url, ("state.json",)) == "state.json: not valid JSON"


def test_load_drafter_tells_runs_checkpoints_and_exports_apart_by_their_markers(
    tmp_path,
) -> None:
    run = tmp_path / "run"
    drafter, optimizer = _trained_a_little()
    save_checkpoint(str(run), 2, drafter, optimizer, {}, keep=1, is_main=True)
    # What `train` writes beside the checkpoints, and what earlier versions wrote (config.json
    # with the run config): neither is read as a drafter.
    (run / "run_config.json").write_text(json.dumps({"target": {"path": "t"}}))
    (run / "config.json").write_text(json.dumps({"target": {"path": "t"}}))
    for url in (run, step_dir(str(run), 2)):
        loaded = load_drafter(str(url))
        assert torch.equal(loaded.fc.weight, drafter.fc.weight)
    save_drafter(str(tmp_path / "drafter-only"), drafter)  # COMPLETE + the drafter's files
    assert is_training_checkpoint(str(tmp_path / "drafter-only"))
    assert torch.equal(load_drafter(str(tmp_path / "drafter-only")).fc.weight, drafter.fc.weight)
    save_dflash(drafter, str(tmp_path / "export"))
    exported = load_drafter(str(tmp_path / "export"))
    assert exported.fc.weight.dtype == torch.float32
    assert torch.equal(exported.fc.weight, drafter.fc.weight.to(torch.bfloat16).float())
    save_speculators(drafter, str(tmp_path / "spec"), verifier="v")
    assert torch.equal(load_drafter(str(tmp_path / "spec")).fc.weight, exported.fc.weight)

    (tmp_path / "model").mkdir()  # a target model directory given by mistake
    (tmp_path / "model" / "config.json").write_text(json.dumps({"architectures": ["Qwen3"]}))
    with pytest.raises(ValueError, match="is not a DFlash drafter's"):
        load_drafter(str(tmp_path / "model"))
    (run / "checkpoints" / "step_00000002" / "COMPLETE").unlink()
    with pytest.raises(FileNotFoundError, match="has no usable checkpoint"):
        load_drafter(str(run))
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        load_drafter(step_dir(str(run), 2))
    with pytest.raises(FileNotFoundError, match="neither a serving-format drafter"):
        load_drafter(str(tmp_path))


@pytest.mark.parametrize(
    "marker", ["garbage", "", '{"step": 3, "files": {"drafter.safetensors": 1}}', "4\n"]
)
def test_a_complete_marker_that_does_not_parse_is_a_damaged_checkpoint(tmp_path, marker) -> None:
    """Never a reason to skip the checksums: a marker neither this version's (JSON with the
    files' sha256 and size) nor an older one's (the checkpoint's own step number) makes the
    checkpoint unusable, and the run walks back past it."""
    run = str(tmp_path)
    drafter, optimizer = _trained_a_little()
    save_checkpoint(run, 2, drafter, optimizer, {"cursor": 2}, keep=3, is_main=True)
    save_checkpoint(run, 3, drafter, optimizer, {"cursor": 3}, keep=3, is_main=True)
    folder = tmp_path / "checkpoints" / "step_00000003"
    weights = folder / "drafter.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))  # changed, not cut: same size
    (folder / "COMPLETE").write_text(marker)
    assert "its COMPLETE marker does not parse" in (verify_checkpoint(step_dir(run, 3)) or "")
    found, skipped = usable_checkpoint(run)
    assert found == step_dir(run, 2) and [u for u, _ in skipped] == [step_dir(run, 3)]


def test_a_checkpoint_that_fails_to_write_is_one_line_and_removed(tmp_path, monkeypatch) -> None:
    """A full disk mid-checkpoint: the error names the checkpoint and what to do; no half
    checkpoint (nor temporary file) is left to fill the disk or be mistaken for one."""
    run = str(tmp_path)
    drafter, optimizer = _trained_a_little()
    save_checkpoint(run, 2, drafter, optimizer, {"cursor": 2}, keep=3, is_main=True)
    calls = []

    def full_at_the_third(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_at_the_third)
    with pytest.raises(storage.WriteFailed) as failed:
        save_checkpoint(run, 4, drafter, optimizer, {"cursor": 4}, keep=3, is_main=True)
    assert str(failed.value) == (
        f"could not write {step_dir(run, 4)}: No space left on device (the checkpoint was "
        f"removed; make room, then run the same command with --resume (it goes on from "
        f"{step_dir(run, 2)}))"
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
