"""flashdraft/train/held_out.py: when the in-training eval is on, what it refuses, and the best
tau a resumed run starts from (the loop itself runs in tests/train/test_trainer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashdraft import config as cfg
from flashdraft.train.config import RunConfig
from flashdraft.train.held_out import HeldOutEval
from flashdraft.train.presets import smollm2_135m


def _config(tmp_path: Path, *overrides: str) -> RunConfig:
    preset = smollm2_135m(target="t", datasets=("d",), output=str(tmp_path / "run"))
    run: RunConfig = cfg.build(RunConfig, cfg.apply_overrides(preset.to_dict(), list(overrides)))
    return run


def test_the_eval_needs_prompts_and_a_target_on_the_logging_rank(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"eval.every > 0 needs eval.prompts"):
        HeldOutEval(_config(tmp_path, "eval.prompts=none"), None, True, False)
    off = HeldOutEval(_config(tmp_path, "eval.every=0"), object(), True, False)
    assert not off.on and off.prompts == []
    # the split placement: no target on the logging rank, so no eval (a warning says so)
    split = HeldOutEval(_config(tmp_path), None, True, False)
    assert not split.on and split.prompts == []
    # a rank that does not log decides the same, and loads nothing
    other = HeldOutEval(_config(tmp_path), object(), False, False)
    assert other.on and other.prompts == [] and other.tokenizer is None


def test_a_resumed_run_keeps_the_best_tau_it_had(tmp_path: Path) -> None:
    """Only a better tau than the kept export's replaces RUN/best after a resume; a new run
    starts from nothing (a stale best.json in its folder does not count)."""
    best = tmp_path / "run" / "best"
    best.mkdir(parents=True)
    (best / "best.json").write_text(json.dumps({"step": 40, "eval_tau": 2.5}))
    config = _config(tmp_path, "eval.every=0")
    assert HeldOutEval(config, None, True, resuming=True).best_tau == 2.5
    assert HeldOutEval(config, None, True, resuming=False).best_tau == float("-inf")
