"""`flashdraft export` end to end: a run directory to both serving formats."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from helpers import tiny_drafter

from flashdraft import cli
from flashdraft.export import export_format, load_exported, verify_export
from flashdraft.train.checkpoint import save_drafter, step_dir


def test_export_cli_from_a_run_directory_in_both_formats(tmp_path, capsys) -> None:
    drafter = tiny_drafter()
    for step in (100, 200):
        ckpt = step_dir(str(tmp_path / "run"), step)
        save_drafter(ckpt, drafter if step == 200 else tiny_drafter(seed=5))
    run = str(tmp_path / "run")
    assert cli.main(["export", run, "--output", str(tmp_path / "dflash")]) == 0
    out = capsys.readouterr().out
    assert f"{run}: reading checkpoint step 200 ({step_dir(run, 200)})\n" in out
    assert "reload check passed" in out
    assert export_format(str(tmp_path / "dflash")) == "dflash"
    assert torch.equal(
        load_exported(str(tmp_path / "dflash")).fc.weight, drafter.fc.weight.to(torch.bfloat16)
    )
    argv = ["export", run, "--output", str(tmp_path / "spec"), "--format", "speculators"]
    assert cli.main(argv) == 2
    assert "--verifier" in capsys.readouterr().err
    assert not (tmp_path / "spec").exists()  # refused before anything is written
    assert cli.main([*argv, "--verifier", "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 0
    data = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert data["speculators_config"]["verifier"]["name_or_path"].endswith("SmolLM2-135M-Instruct")
    verify_export(drafter, str(tmp_path / "spec"))


def test_export_cli_reports_what_it_wrote(tmp_path, capsys) -> None:
    drafter = tiny_drafter()
    save_drafter(str(tmp_path / "ckpt"), drafter)
    assert cli.main(["export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    config = drafter.config
    assert capsys.readouterr().out == (
        f"wrote dflash drafter to {tmp_path / 'out'}: {config.num_hidden_layers} layers, "
        f"B={config.block_size}, taps {config.target_layer_ids} (z-lab ids), mask token "
        f"{config.mask_token_id}; reload check passed (identical weights and outputs, "
        "config.json as the engines read it)\n"
    )
    assert cli.main(["export", str(tmp_path / "nothing"), "--output", str(tmp_path / "x")]) == 2
    assert "neither a serving-format drafter" in capsys.readouterr().err
    # The output now holds an export: refused (before the drafter is even loaded) ...
    argv = ["export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    assert cli.main([*argv, "--overwrite"]) == 0  # ... unless asked for
    with pytest.raises(SystemExit):  # argparse: not one of the formats
        cli.main(["export", str(tmp_path / "ckpt"), "--output", "o", "--format", "onnx"])
    assert "invalid choice: 'onnx'" in capsys.readouterr().err


def test_export_from_a_run_whose_newest_checkpoint_is_damaged_says_which_it_read(
    tmp_path, capsys
) -> None:
    run = str(tmp_path / "run")
    for step in (100, 200):
        save_drafter(step_dir(run, step), tiny_drafter(seed=step))
    (tmp_path / "run" / "checkpoints" / "step_00000200" / "COMPLETE").write_text("garbage")
    assert cli.main(["export", run, "--output", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert f"skipping checkpoint {step_dir(run, 200)}: its COMPLETE marker does not parse" in (
        captured.err
    )
    assert (
        f"{run}: reading checkpoint step 100 ({step_dir(run, 100)}), not the 1 damaged newer "
        "one(s) named above" in captured.out
    )


def test_a_failed_export_is_one_line_and_leaves_nothing_that_blocks_the_retry(
    tmp_path, capsys, monkeypatch
) -> None:
    """A full disk while the weights are written: one line (exit 1), no `.tmp` file nor
    half an export left in the output, and the same command then succeeds."""
    save_drafter(str(tmp_path / "ckpt"), tiny_drafter())
    argv = ["export", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", full)
        assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err == (
        f"flashdraft export: error: could not write {tmp_path / 'out'}: No space left on device "
        "(nothing was left there; make room and run again)\n"
    )
    assert not (tmp_path / "out").exists()
    assert cli.main(argv) == 0
