"""The run plan: steps, row positions, resume point, the drafter's geometry and the one
builder of the initial drafter."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import train_settings

from flashdraft.export import save_dflash
from flashdraft.model.drafter import init_seeded
from flashdraft.train.config import RunConfig, load_run_config
from flashdraft.train.parallel import DistInfo
from flashdraft.train.plan import (
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
    written = json.loads((tmp_path / "run" / "config.json").read_text())
    assert written == config.to_dict()  # the resolved config, next to the outputs
    assert plan.drafter_config.block_size == 8 and plan.drafter_config.num_hidden_layers == 1


def test_plan_resumes_from_the_latest_complete_checkpoint_only_when_asked(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    run = tmp_path / "run"
    config = run_config(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 5})
    for step, complete in ((2, True), (4, False)):  # step 4 was cut mid-write
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"step": step, "cursor": 2 * step}))
        if complete:
            (ckpt / "COMPLETE").write_text(f"{step}\n")
    with pytest.raises(FileExistsError, match="--resume"):
        plan_run(config, ONE, resume=False)
    plan = plan_run(config, ONE, resume=True)
    assert plan.resume_from is not None and plan.resume_from.endswith("step_00000002")
    assert (plan.start_step, plan.start_cursor, plan.rows_left) == (2, 4, 3)
    assert list(plan.positions(0)) == [4, 5, 6]


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

    config.drafter.target_layer_ids = [0, 1]
    other_taps, _ = build_drafter_config(config, target)
    with pytest.raises(ValueError, match="do not match this target"):
        initial_drafter(config, other_taps)
