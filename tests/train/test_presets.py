"""Presets are Python functions returning a run config; --set applies on top of one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashdraft.train.config import load_run_config
from flashdraft.train.presets import PRESETS, RunSource, qwen3_8b, smollm2_135m, smollm2_demo

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_qwen3_8b_preset_is_the_shipped_toml() -> None:
    assert qwen3_8b() == load_run_config(str(CONFIGS / "qwen3-8b.toml"))


def test_the_smollm2_135m_preset_is_the_shipped_toml() -> None:
    assert smollm2_135m() == load_run_config(str(CONFIGS / "smollm2-135m.toml"))


def test_the_reference_recipe_is_the_measured_one() -> None:
    """The reference recipe (docs/reference-recipe.md): 7 layers with MLPs of 352 tapping
    the five layers the 5-layer rule picks, B = 16, A = 2048 anchors per 8192-token row,
    soft labels (top 32) with half the argmax mixed in under D-PACE slot weights, and Muon
    at 1e-3 with 1% warmup and a linear decay to 0."""
    run = smollm2_135m(target="smol", datasets=("d",), output="o", eval_prompts="p", steps=7)
    assert (run.drafter.num_layers, run.drafter.block_size) == (7, 16)
    assert run.drafter.intermediate_size == 352
    assert run.drafter.target_layer_ids == [1, 8, 14, 20, 27]
    assert (run.loss.anchors, run.loss.labels, run.loss.soft_top_k) == (2048, "soft", 32)
    assert (run.loss.weighting, run.loss.argmax_mix) == ("dpace", 0.5)
    assert run.data.row_tokens == 8192
    assert (run.optim.optimizer, run.optim.lr, run.optim.schedule) == ("muon", 1e-3, "linear")
    assert (run.optim.warmup_steps, run.optim.min_lr_ratio, run.optim.max_steps) == (139, 0, 7)
    assert (run.target.path, run.data.datasets, run.output) == ("smol", ["d"], "o")
    assert run.eval.every > 0 and run.eval.prompts == "p"
    assert RunSource(preset="smollm2-135m").load("optim.lr=2e-3").optim.lr == 2e-3


def _demo_settings(cuda: bool, steps: int | None) -> list[str]:
    """The demo's training settings as it passed them to `flashdraft train` before presets."""
    settings = {
        "output": "out/run",
        "target.path": "smol",
        "data.datasets": ["out/data"],
        "data.row_tokens": 8192 if cuda else 1024,
        "drafter.num_layers": 3 if cuda else 2,
        "loss.anchors": 512 if cuda else 48,
        "optim.lr": 1e-3,
        "optim.epochs": 3 if cuda else 4,
        "optim.warmup_steps": 10,
        "log.every": 10,
        "checkpoint.every": 100,
        "device": "cuda" if cuda else "cpu",
        "eval.every": 0,
    }
    if steps is not None:
        settings["optim.max_steps"] = steps
    return [f"{k}={json.dumps(v)}" for k, v in settings.items()]


@pytest.mark.parametrize(("cuda", "steps"), [(False, None), (False, 3), (True, None)])
def test_the_demo_preset_keeps_the_demo_settings(cuda, steps) -> None:
    preset = smollm2_demo(
        target="smol",
        data="out/data",
        output="out/run",
        device="cuda" if cuda else "cpu",
        steps=steps,
    )
    assert preset == load_run_config(None, _demo_settings(cuda, steps))


def test_overrides_apply_on_top_of_a_preset() -> None:
    source = RunSource(preset="qwen3-8b", overrides=["optim.lr=1e-4", 'target.path="/m"'])
    config = source.load("output=elsewhere")
    assert (config.optim.lr, config.target.path, config.output) == (1e-4, "/m", "elsewhere")
    assert config.optim.warmup_steps == 500 and config.eval.every == 2000  # the rest: preset
    with pytest.raises(ValueError, match="unknown config key"):
        RunSource(preset="qwen3-8b", overrides=["optim.lrr=1"]).load()


def test_a_run_source_is_a_preset_or_a_file() -> None:
    assert set(PRESETS) == {"qwen3-8b", "smollm2-demo", "smollm2-135m"}
    with pytest.raises(ValueError, match="not both"):
        RunSource(preset="qwen3-8b", config="run.toml")
    with pytest.raises(ValueError, match="qwen3-8b"):
        RunSource(preset="nope")
    from_file = RunSource(config=str(CONFIGS / "qwen3-8b.toml"), overrides=["seed=5"]).load()
    assert from_file.seed == 5 and from_file.optim.epochs == 3
