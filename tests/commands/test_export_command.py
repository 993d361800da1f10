"""`flashdraft export` end to end: a run directory to both serving formats."""

from __future__ import annotations

import json

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
        (tmp_path / ckpt / "COMPLETE").write_text("")
    run = str(tmp_path / "run")
    assert cli.main(["export", run, "--output", str(tmp_path / "dflash")]) == 0
    assert "reload check passed" in capsys.readouterr().out
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
