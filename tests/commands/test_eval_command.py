"""`flashdraft eval` end to end: a tiny Qwen3 target, drafters exported and checkpointed."""

from __future__ import annotations

import argparse
import json

import pytest
from helpers import drafter_config_for, tiny_config

from flashdraft import cli
from flashdraft.commands import eval as eval_command
from flashdraft.export import save_dflash, save_speculators
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.train.checkpoint import save_drafter, step_dir


def _prompts(tmp_path) -> str:
    prompts = tmp_path / "prompts.jsonl"
    records = [
        {"id": "p0", "messages": [{"role": "user", "content": "Say hi"}]},
        {"id": "p1", "prompt": "The quick brown fox"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(prompts)


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_eval_cli_writes_report_and_plot(tmp_path, tiny_qwen3_dir, capsys) -> None:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    drafter = DFlashDrafter(drafter_config_for(target, mask_token_id=151669, block_size=4))
    drafter.reset_parameters(seed=0)
    save_drafter(str(tmp_path / "ckpt"), drafter)
    save_speculators(drafter, str(tmp_path / "spec"), verifier=str(tiny_qwen3_dir))
    # z-lab's published configs: transformers-4 rope fields, no layer_types, an auto_map.
    save_dflash(drafter, str(tmp_path / "zlab"))
    zlab = json.loads((tmp_path / "zlab" / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "use_sliding_window", "max_window_layers"):
        zlab.pop(key)
    zlab["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (tmp_path / "zlab" / "config.json").write_text(json.dumps(zlab))
    prompts = _prompts(tmp_path)
    for source in ("zlab", "spec", "ckpt"):  # our dflash export is the zlab one, unstripped
        out = tmp_path / f"{source}.json"
        argv = ["eval", "--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / source)]
        argv += ["--prompts", prompts, "--output", str(out), "--max-new-tokens", "12"]
        assert cli.main(argv) == 0
        report = json.loads(out.read_text())
        assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
        assert {"tau", "acceptance_histogram", "per_position_acceptance", "per_prompt"} <= set(
            report
        )
        assert [p["id"] for p in report["per_prompt"]] == ["p0", "p1"]
        assert report["lossless"] is True
        for entry in report["per_prompt"]:
            assert {"acceptance_lengths", "output_ids", "text", "lossless"} <= set(entry)
            assert sum(entry["acceptance_lengths"]) + 1 == len(entry["output_ids"])
        assert report["settings"]["block_size"] == 4
        assert report["settings"]["drafter"] == str(tmp_path / source)
        printed = capsys.readouterr().out
        assert printed.startswith(f"tau {report['tau']:.3f}\n")
        assert f"report: {out}\nplot:   {out.with_suffix('.png')}" in printed


def test_eval_refuses_a_drafter_for_another_target(tmp_path, tiny_qwen3_dir, capsys) -> None:
    config = tiny_config(vocab_size=151936, mask_token_id=151669)  # hidden 32, not 64
    drafter = DFlashDrafter(config)
    save_dflash(drafter, str(tmp_path / "export"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    argv = ["eval", "--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / "export")]
    argv += ["--prompts", str(prompts), "--output", str(tmp_path / "r.json")]
    assert cli.main(argv) == 2
    assert "hidden size 32" in capsys.readouterr().err


def test_eval_flags_are_todays_and_bad_values_name_the_flag(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    required = ["--target", "t", "--drafter", "d", "--prompts", "p", "--output", "r.json"]
    args = parser.parse_args(required)
    assert (args.max_new_tokens, args.temperature, args.block_size, args.limit) == (
        256, 0.0, None, None
    )  # fmt: skip
    assert (args.seed, args.dtype, args.device, args.attn_implementation) == (
        0,
        "auto",
        None,
        "sdpa",
    )
    assert args.reference is True
    assert parser.parse_args([*required, "--no-reference"]).reference is False
    argv = ["eval", *required, "--max-new-tokens", "0"]
    assert cli.main(argv) == 2  # refused before any model is loaded
    err = capsys.readouterr().err
    assert err == "flashdraft eval: error: --max-new-tokens 0 is not allowed: must be >= 1\n"
    assert cli.main(["eval", *required, "--block-size", "0"]) == 2
    assert "--block-size 0" in capsys.readouterr().err


def test_eval_of_a_run_directory_says_which_checkpoint_it_read(
    tmp_path, tiny_qwen3_dir, capsys
) -> None:
    """A damaged newest checkpoint (its marker garbage) is named and skipped, and the step
    read is printed, before anything is measured (here: refused, a drafter of another
    target, which is what makes this test fast)."""
    run = str(tmp_path / "run")
    config = tiny_config(vocab_size=151936, mask_token_id=151669)
    for step in (100, 200):
        save_drafter(step_dir(run, step), DFlashDrafter(config))
    (tmp_path / "run" / "checkpoints" / "step_00000200" / "COMPLETE").write_text("{")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    argv = ["eval", "--target", str(tiny_qwen3_dir), "--drafter", run]
    argv += ["--prompts", str(prompts), "--output", str(tmp_path / "r.json")]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert f"skipping checkpoint {step_dir(run, 200)}: its COMPLETE marker does not parse" in (
        captured.err
    )
    assert f"{run}: reading checkpoint step 100 ({step_dir(run, 100)})" in captured.out
