"""`flashdraft train` flags: where the run config comes from, and --resume."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from helpers import parse_command, train_settings

from flashdraft import cli
from flashdraft.commands import train as train_command
from flashdraft.train import checkpoint
from flashdraft.train.config import load_run_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _options(*argv: str) -> train_command.TrainOptions:
    options = parse_command(train_command, train_command.TrainOptions, *argv)
    assert isinstance(options, train_command.TrainOptions)
    return options


def test_set_is_repeatable_and_applies_on_top_of_a_file_or_a_preset() -> None:
    options = _options(
        "--config", str(CONFIGS / "qwen3-8b.toml"), "--set", "optim.lr=1e-4", "--set", "seed=3"
    )
    assert options.resume == "off"
    config = options.run.load()
    assert (config.optim.lr, config.seed) == (1e-4, 3)
    assert config.optim.warmup_steps == 500
    preset = _options("--preset", "qwen3-8b", "--set", "seed=3", "--resume")
    assert preset.resume == "on"
    assert _options("--preset", "qwen3-8b", "--resume=auto").resume == "auto"
    assert preset.run.load() == load_run_config(str(CONFIGS / "qwen3-8b.toml"), ["seed=3"])


def test_a_file_and_a_preset_together_are_refused_in_one_line(capsys) -> None:
    code = cli.main(["train", "--preset", "qwen3-8b", "--config", "run.toml"])
    assert code == 2
    assert "give --config FILE or --preset NAME, not both" in capsys.readouterr().err


def test_an_unknown_preset_is_an_argument_error(capsys) -> None:
    with pytest.raises(SystemExit):
        _options("--preset", "llama-9000")
    assert "invalid choice: 'llama-9000'" in capsys.readouterr().err


def test_allow_config_change_is_a_flag_of_resume_only(capsys) -> None:
    options = _options("--preset", "qwen3-8b", "--resume", "--allow-config-change")
    assert options.resume == "on" and options.allow_config_change
    assert not _options("--preset", "qwen3-8b").allow_config_change
    assert cli.main(["train", "--preset", "qwen3-8b", "--allow-config-change"]) == 2
    assert capsys.readouterr().err == (
        "flashdraft train: error: --allow-config-change only applies with --resume\n"
    )


def test_resume_with_no_checkpoint_says_so_and_stops_unless_auto(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys, monkeypatch
) -> None:
    """--resume in an output that has no checkpoint is a mistake (a typo in the output, a
    run that never wrote one): one line, nothing written. --resume=auto starts there; a full
    disk at its checkpoint is one line, leaving neither half a checkpoint nor the run's
    lock, and the same command then runs."""
    run = tmp_path / "run"
    # the mask token the tokenizer would give, set: no tokenizer load (2 s a run here)
    fast = {"optim.max_steps": 1, "drafter.mask_token_id": 151669}
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **fast)
    assert cli.main(["train", *settings, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"flashdraft train: error: --resume: {run} has no checkpoint to resume from (none has "
        "a COMPLETE marker); run without --resume to start the run, or pass --resume=auto to "
        "resume when there is a checkpoint and start otherwise\n"
    )
    assert not (run / "run_config.json").exists()

    def full(self: object, name: str, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint._CheckpointWriter, "write", full)
        assert cli.main(["train", *settings, "--resume=auto"]) == 1
    lines = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert lines == [
        f"flashdraft train: error: could not write {run}/checkpoints/step_00000001: No space "
        "left on device (the checkpoint was removed; make room, then run the same command again "
        "(no checkpoint of this run is complete yet))"
    ]
    assert list((run / "checkpoints").iterdir()) == [] and not (run / "LOCK").exists()
    assert cli.main(["train", *settings, "--resume=auto"]) == 0
    assert (run / "checkpoints" / "step_00000001" / "COMPLETE").exists()
