"""The run config of `flashdraft train`: a file plus dotted overrides, every key checked."""

from __future__ import annotations

import pytest

from flashdraft import cli
from flashdraft import config as cfg
from flashdraft.train.config import RunConfig, load_run_config

REQUIRED = ["output=x", "target.path=y", 'data.datasets=["z"]']


def test_config_errors_are_clear(capsys) -> None:
    args = [a for item in [*REQUIRED, "optim.lrr=1"] for a in ("--set", item)]
    assert cli.main(["train", *args]) == 2
    assert "unknown config key(s) optim.lrr" in capsys.readouterr().err
    with pytest.raises(ValueError, match="overlong"):
        load_run_config(None, [*REQUIRED, "data.overlong=cut"])
    with pytest.raises(ValueError, match=r"optim\.lr = -1 is not allowed: must be > 0"):
        load_run_config(None, [*REQUIRED, "optim.lr=-1"])
    with pytest.raises(ValueError, match="missing config key"):
        load_run_config(None, ["output=x"])


def test_defaults_and_the_settings_a_resume_may_change() -> None:
    config = load_run_config(None, REQUIRED)
    assert config.data.datasets == ["z"] and config.optim.betas == [0.9, 0.95]
    assert cfg.build(RunConfig, config.to_dict()) == config  # what `train` writes, read back
    safe = cfg.settings(config, "resume_safe")
    assert {"max_steps", "prefetch", "preflight", "keep", "tensorboard"} <= set(safe)
    assert not {"lr", "row_tokens", "seed", "anchors", "block_size"} & set(safe)
