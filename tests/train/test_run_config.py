"""The run config of `flashdraft train`: a file plus dotted overrides, every key checked, and
what a resumed run may change."""

from __future__ import annotations

import copy

import pytest

from flashdraft import cli
from flashdraft import config as cfg
from flashdraft.train.config import RunConfig, load_run_config, resume_changes, resume_safe_keys
from flashdraft.train.presets import RunSource

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
    with pytest.raises(
        ValueError, match=r"optim\.rows_per_forward = 2 .* divide optim\.grad_accum"
    ):
        load_run_config(None, [*REQUIRED, "optim.grad_accum=3", "optim.rows_per_forward=2"])
    assert load_run_config(None, [*REQUIRED, "optim.grad_accum=4", "optim.rows_per_forward=2"])


def test_defaults_and_the_settings_a_resume_may_change() -> None:
    config = load_run_config(None, REQUIRED)
    assert config.data.datasets == ["z"] and config.optim.betas == [0.9, 0.95]
    assert cfg.build(RunConfig, config.to_dict()) == config  # what `train` writes, read back
    safe = cfg.settings(config, "resume_safe")
    assert {"max_steps", "prefetch", "preflight", "keep", "tensorboard"} <= set(safe)
    assert not {"lr", "row_tokens", "seed", "anchors", "block_size"} & set(safe)


def test_resume_safe_keys_are_told_apart_by_their_path() -> None:
    safe = resume_safe_keys()
    assert {"log.every", "checkpoint.every", "eval.every", "optim.max_steps", "output"} <= safe
    assert {"parallel.placement", "parallel.target_ranks", "device", "compile"} <= safe
    unsafe = {"seed", "data.row_tokens", "data.datasets", "drafter.block_size", "loss.gamma"}
    assert not unsafe & safe
    assert not {"drafter.target_layer_ids", "drafter.mask_token_id", "optim.lr"} & safe


def test_a_resume_refuses_what_changes_the_training_and_lists_every_key() -> None:
    before = load_run_config(None, REQUIRED).to_dict()
    now = load_run_config(
        None, [*REQUIRED, "drafter.block_size=4", "seed=1", "data.row_tokens=4096", "log.every=3"]
    )
    with pytest.raises(ValueError) as refused:
        resume_changes(before, now, rows_per_step=(1, 1), allow=False)
    text = str(refused.value)
    assert "drafter.block_size 16 -> 4" in text and "seed 0 -> 1" in text
    assert "data.row_tokens 8192 -> 4096" in text and "log.every" not in text
    assert "--allow-config-change" in text and "\n" not in text
    changes, forced = resume_changes(before, now, rows_per_step=(1, 1), allow=True)
    assert changes["log.every"] == [10, 3] and changes["seed"] == [0, 1]
    assert forced == ["data.row_tokens", "drafter.block_size", "seed"]


def test_a_resume_may_change_what_is_safe_and_the_world_size_at_the_same_global_batch() -> None:
    before = load_run_config(None, REQUIRED).to_dict()
    safe = load_run_config(
        None, [*REQUIRED, "optim.max_steps=9", "eval.every=5", "optim.grad_accum=2"]
    )
    # 2 replicas x 1 row before, 1 replica x 2 rows now: the same 2 rows per step.
    changes, forced = resume_changes(before, safe, rows_per_step=(2, 2), allow=False)
    assert set(changes) == {"optim.max_steps", "eval.every", "optim.grad_accum"} and not forced
    assert resume_changes(
        before, load_run_config(None, REQUIRED), rows_per_step=(1, 1), allow=False
    ) == ({}, [])
    with pytest.raises(ValueError, match=r"rows per step .* 1 -> 2"):
        resume_changes(before, safe, rows_per_step=(1, 2), allow=False)
    # A config written by an earlier version (ints for floats, keys added since): same run.
    old = copy.deepcopy(before)
    old["optim"]["weight_decay"] = 0  # an int where a float is read
    del old["log"]["progress"]
    assert resume_changes(
        old, load_run_config(None, REQUIRED), rows_per_step=(1, 1), allow=False
    ) == ({}, [])


def test_muon_is_refused_on_fsdp_shards_with_the_reason() -> None:
    base = ["output=x", "target.path=t", 'data.datasets=["d"]', 'optim.optimizer="muon"']
    assert load_run_config(None, base).optim.optimizer == "muon"  # DDP (the default): fine
    with pytest.raises(cfg.ConfigError, match="orthogonalises whole weight matrices"):
        load_run_config(None, [*base, 'parallel.drafter_sharding="fsdp"'])
    with pytest.raises(cfg.ConfigError, match=r"optim\.optimizer"):
        load_run_config(None, ['optim.optimizer="sgd"', *base[:3]])


def test_the_target_runs_ahead_over_whole_steps_and_only_colocated() -> None:
    base = ["output=x", "target.path=t", 'data.datasets=["d"]']
    config = load_run_config(None, [*base, "target.forward_rows=8", "optim.grad_accum=2"])
    assert config.target.forward_rows == 8
    assert "target.forward_rows" in resume_safe_keys()  # it does not change the training
    assert load_run_config(None, [*base, "optim.grad_accum=3"]).target.forward_rows == 1
    assert config.target_rows == 8  # what one target forward holds (preflight, bench)
    stacked = [*base, "optim.grad_accum=4", "optim.rows_per_forward=2"]
    assert load_run_config(None, stacked).target_rows == 2  # the drafter's forward, shared
    with pytest.raises(cfg.ConfigError, match=r"multiple of optim\.grad_accum \(4\)"):
        load_run_config(None, [*base, "target.forward_rows=6", "optim.grad_accum=4"])
    with pytest.raises(cfg.ConfigError, match="applies to the colocated placement"):
        load_run_config(None, [*base, "target.forward_rows=2", 'parallel.placement="split"'])


def test_the_argmax_mix_is_a_share_of_soft_labels_only() -> None:
    base = ["output=x", "target.path=t", 'data.datasets=["d"]']
    soft = [*base, 'loss.labels="soft"']
    assert load_run_config(None, [*soft, "loss.argmax_mix=0.5"]).loss.argmax_mix == 0.5
    assert load_run_config(None, base).loss.argmax_mix == 0.0  # off unless asked for
    with pytest.raises(cfg.ConfigError, match=r"loss\.argmax_mix = 0\.5.*only with labels"):
        load_run_config(None, [*base, "loss.argmax_mix=0.5"])  # hard labels: nothing to mix
    # the smollm2-135m preset mixes 0.5 in: hard labels over it say which key to reset
    preset = RunSource(preset="smollm2-135m")
    with pytest.raises(cfg.ConfigError, match=r"or loss\.argmax_mix = 0 \(a preset may set it\)"):
        preset.load("loss.labels=target")
    assert preset.load("loss.labels=target", "loss.argmax_mix=0").loss.labels == "target"
    with pytest.raises(cfg.ConfigError, match=r"loss\.argmax_mix"):
        load_run_config(None, [*soft, "loss.argmax_mix=1.5"])
    assert "loss.argmax_mix" not in resume_safe_keys()  # it changes what is trained
