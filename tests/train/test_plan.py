"""The run plan: steps, row positions, resume point, the drafter's geometry and the one
builder of the initial drafter."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import tiny_drafter, train_settings

from flashdraft.data.dataset import dataset_identity
from flashdraft.export import save_dflash
from flashdraft.model.drafter import init_seeded
from flashdraft.train.checkpoint import save_checkpoint
from flashdraft.train.config import RunConfig, load_run_config
from flashdraft.train.parallel import DistInfo
from flashdraft.train.plan import (
    CONFIG_CHANGES,
    build_drafter_config,
    initial_drafter,
    load_target_config,
    plan_run,
)

ONE = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"))


def run_config(run, target, data, **extra: object) -> RunConfig:
    args = train_settings(run, target, data, **extra)
    return load_run_config(None, args[1::2])  # the values of the --set pairs


def test_plan_counts_steps_and_walks_the_rows_of_each_replica(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    config = run_config(
        tmp_path / "run", tiny_qwen3_dir, qwen_data, **{"optim.grad_accum": 2, "optim.max_steps": 3}
    )
    plan = plan_run(config, ONE, resume=False)
    assert plan.rows_per_step == 2 and plan.total_steps == 3
    assert plan.total_rows == plan.stream.total_rows() >= 6
    assert list(plan.positions(0)) == [0, 1, 2, 3, 4, 5]
    assert plan.rows_left == 6 and plan.resume_from is None
    written = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert written == plan.config.to_dict()  # the resolved config, next to the outputs
    # what the data holds (its manifest's fingerprint), filled in where the config had none
    assert written["data"]["content_sha256"] == [dataset_identity(str(qwen_data))]
    assert config.data.content_sha256 is None
    assert not (tmp_path / "run" / "config.json").exists()  # the name engines read
    assert plan.drafter_config.block_size == 8 and plan.drafter_config.num_hidden_layers == 1


def test_plan_resumes_from_the_latest_complete_checkpoint_only_when_asked(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    run = tmp_path / "run"
    config = run_config(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 5})
    _checkpoint(run, 2, rows_per_step=2)
    cut = run / "checkpoints" / "step_00000004"  # cut mid-write: no COMPLETE
    cut.mkdir()
    (cut / "state.json").write_text(json.dumps({"step": 4, "cursor": 8}))
    with pytest.raises(FileExistsError, match="--resume"):
        plan_run(config, ONE, resume=False)
    plan = plan_run(config, ONE, resume=True)
    assert plan.resume_from is not None and plan.resume_from.endswith("step_00000002")
    assert (plan.start_step, plan.start_cursor, plan.rows_left) == (2, 4, 3)
    assert list(plan.positions(0)) == [4, 5, 6]


def _checkpoint(run, step: int, rows_per_step: int = 1) -> None:
    """A real checkpoint of a tiny drafter at `step` (the plan reads only its state)."""
    drafter = tiny_drafter()
    optimizer = torch.optim.AdamW(drafter.parameters())
    state = {"cursor": step * rows_per_step, "rows_per_step": rows_per_step}
    save_checkpoint(str(run), step, drafter, optimizer, state, keep=5, is_main=True)


def test_a_resume_is_checked_against_the_runs_config_before_anything_is_written(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    run = tmp_path / "run"
    config = run_config(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 5})
    plan_run(config, ONE, resume=False)
    _checkpoint(run, 2)
    recorded = (run / "run_config.json").read_bytes()
    changed = run_config(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 5, "seed": 7})
    with pytest.raises(ValueError, match=r"seed 0 -> 7.*--allow-config-change"):
        plan_run(changed, ONE, resume=True)
    assert (run / "run_config.json").read_bytes() == recorded
    assert not (run / CONFIG_CHANGES).exists()

    forced = plan_run(changed, ONE, resume=True, allow_config_change=True)
    assert forced.start_step == 2
    assert json.loads((run / "run_config.json").read_text())["seed"] == 7
    safe = run_config(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 6, "seed": 7})
    plan_run(safe, ONE, resume=True)
    history = [json.loads(x) for x in (run / CONFIG_CHANGES).read_text().splitlines()]
    assert history == [
        {"step": 2, "changes": {"seed": [0, 7]}, "forced": ["seed"]},
        {"step": 2, "changes": {"optim.max_steps": [5, 6]}, "forced": []},
    ]


def test_a_run_of_an_earlier_version_resumes_from_its_config_json(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    """Runs written before `run_config.json` kept their run config in `config.json`."""
    run = tmp_path / "run"
    config = run_config(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 5})
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config.to_dict()))
    _checkpoint(run, 2)
    assert plan_run(config, ONE, resume=True).start_step == 2
    changed = run_config(run, tiny_qwen3_dir, qwen_data, **{"drafter.block_size": 4})
    with pytest.raises(ValueError, match=r"drafter\.block_size 8 -> 4"):
        plan_run(changed, ONE, resume=True)


def test_a_resume_skips_and_sets_aside_a_damaged_checkpoint(
    tmp_path, tiny_qwen3_dir, qwen_data, caplog
) -> None:
    run = tmp_path / "run"
    config = run_config(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 9})
    plan_run(config, ONE, resume=False)
    for step in (2, 4):
        _checkpoint(run, step)
    (run / "checkpoints" / "step_00000004" / "drafter.safetensors").write_bytes(b"")
    plan = plan_run(config, ONE, resume=True)
    assert plan.resume_from == str(run / "checkpoints" / "step_00000002")
    assert plan.start_step == 2
    assert (run / "checkpoints" / "unusable_step_00000004" / "COMPLETE").exists()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(w.startswith("skipping checkpoint") and "drafter.safetensors" in w for w in warned)
    (run / "checkpoints" / "step_00000002" / "state.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no checkpoint of .* is usable"):
        plan_run(config, ONE, resume=True)


def test_plan_refuses_data_that_makes_no_step(tmp_path, tiny_qwen3_dir, qwen_data) -> None:
    config = run_config(tmp_path / "run", tiny_qwen3_dir, qwen_data, **{"optim.grad_accum": 100000})
    with pytest.raises(ValueError, match="fewer than one step needs"):
        plan_run(config, ONE, resume=False)


def test_drafter_geometry_follows_the_target_and_the_run_config(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    target = load_target_config(str(tiny_qwen3_dir))
    config = run_config(tmp_path, tiny_qwen3_dir, qwen_data, **{"drafter.num_layers": 3})
    drafter, note = build_drafter_config(config, target)
    assert drafter.num_hidden_layers == 3 and drafter.hidden_size == target.hidden_size
    assert drafter.num_target_layers == target.num_hidden_layers
    assert 0 <= drafter.mask_token_id < target.vocab_size and "set in the run config" not in note
    config.drafter.mask_token_id = 5
    assert build_drafter_config(config, target) == (
        drafter.__class__(**{**drafter.to_dict(), "mask_token_id": 5}),
        "set in the run config",
    )


def test_the_initial_drafter_is_seeded_or_warm_started(tmp_path, tiny_qwen3_dir, qwen_data) -> None:
    target = load_target_config(str(tiny_qwen3_dir))
    config = run_config(tmp_path, tiny_qwen3_dir, qwen_data, seed=3)
    drafter_config, _ = build_drafter_config(config, target)
    seeded = initial_drafter(config, drafter_config)
    reference = init_seeded(drafter_config, 3)
    for a, b in zip(seeded.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    config.drafter.init_seed = 4  # its own seed, apart from the data order's
    other = initial_drafter(config, drafter_config)
    assert not torch.equal(other.fc.weight, seeded.fc.weight)

    save_dflash(seeded, str(tmp_path / "warm"))
    config.drafter.init_from = str(tmp_path / "warm")
    warm = initial_drafter(config, drafter_config)
    assert warm.fc.weight.dtype == torch.float32
    assert torch.equal(warm.fc.weight, seeded.fc.weight.to(torch.bfloat16).float())
    config.drafter.init_from = str(tmp_path / "gone")  # resuming: the checkpoint has them all
    resumed = initial_drafter(config, drafter_config, resuming=True)
    assert torch.equal(resumed.fc.weight, other.fc.weight)  # seeded (init_seed 4), not read
    config.drafter.init_from = str(tmp_path / "warm")

    config.drafter.target_layer_ids = [0, 1]
    other_taps, _ = build_drafter_config(config, target)
    with pytest.raises(ValueError, match="do not match this target"):
        initial_drafter(config, other_taps)
    config.drafter.target_layer_ids = None
    narrow = dataclasses.replace(
        drafter_config, intermediate_size=drafter_config.intermediate_size // 2
    )
    with pytest.raises(
        ValueError, match=r"set drafter\.num_layers=\d+ drafter\.intermediate_size=\d+"
    ):
        initial_drafter(config, narrow)  # e.g. a pruned export (experiments/prune_mlp.py)
