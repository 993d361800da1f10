"""The memory plan's choices, trained: the layout it picks for the seed's 4 x 96 GB machine
and the Qwen3.6-27B-shaped run, on a tiny target with 4 CPU processes, matches one process
on the same global batch; `parallel.placement = "auto"` resolves on every rank alike."""

from __future__ import annotations

import pytest
import torch
from helpers import read_metrics, train_settings
from test_layout import RECORDS
from test_parallel import _same_curve, _torchrun
from test_preflight import qwen3_6_27b_text_config

from flashdraft import cli
from flashdraft.model.config import DrafterConfig
from flashdraft.train import layout
from flashdraft.train.config import load_run_config
from flashdraft.train.parallel import DistInfo, assign_placement

GB = 2**30


def seeds_choice() -> layout.Layout:
    """The plan for the 27B-shaped hybrid on 4 x 96 GB (docs/multi-node.md)."""
    target = qwen3_6_27b_text_config()
    drafter = DrafterConfig.from_target_config(target, mask_token_id=248319)
    config = load_run_config(None, ["output=x", "target.path=x", 'data.datasets=["z"]'])
    best = layout.plan_layouts(config, drafter, target, 4, 96 * GB, RECORDS).best
    assert best is not None
    return best.layout


@pytest.mark.slow  # 4 processes on the CPU: `pytest -m slow` (docs/testing.md)
@pytest.mark.parametrize("checkpointed", [False, True])
def test_four_processes_of_the_planned_layout_match_one(
    tmp_path, tiny_qwen3_dir, qwen_data, checkpointed
) -> None:
    choice = seeds_choice()
    assert choice == layout.Layout("colocated", drafter_sharding="fsdp")
    small = {"loss.anchors": 8, "optim.max_steps": 4}
    control = tmp_path / "one"
    settings = train_settings(
        control, tiny_qwen3_dir, qwen_data, **small, **{"optim.grad_accum": 4}
    )
    assert cli.main(["train", *settings]) == 0
    run = tmp_path / "planned"
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **small, **{"optim.grad_accum": 1})
    for override in choice.overrides(load_run_config(None, _as_overrides(settings))):
        settings += ["--set", override]
    if checkpointed:
        settings += ["--set", "drafter.activation_checkpointing=true"]
    out = _torchrun(4, settings)
    assert "(drafter sharded, FSDP2)" in out
    _same_curve(read_metrics(run), read_metrics(control))


def _as_overrides(settings: list[str]) -> list[str]:
    return [a for a in settings if a != "--set"]


def test_auto_resolves_to_the_plan_on_this_device(tiny_qwen3_dir) -> None:
    """On the CPU nothing bounds memory: `auto` keeps the configured layout (colocated,
    nothing checkpointed), and the config it returns is a concrete one."""
    config = load_run_config(
        None,
        [
            "output=x",
            f"target.path={tiny_qwen3_dir}",
            'data.datasets=["z"]',
            'parallel.placement="auto"',
        ],
    )
    info = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    resolved = layout.resolve_placement(config, info)
    assert resolved.parallel.placement == "colocated"
    assert not resolved.drafter.activation_checkpointing
    assert resolved.data == config.data and config.parallel.placement == "auto"
    # Unresolved (a command other than train building the run), it says what to set.
    with pytest.raises(ValueError, match="chosen by `flashdraft train` at start-up"):
        assign_placement(info, "auto", 0)
