"""The pipeline on a hybrid target , through the CLI: a tiny random Qwen3.5 (Gated
DeltaNet linear attention + gated full attention, partial RoPE) with the real Qwen3 tokenizer.
train (packed rows, the target's labels, in-training eval) -> export -> eval, and generate."""

from __future__ import annotations

import json

import pytest
from helpers import read_metrics, train_settings

from flashdraft import cli


def _prompts(path) -> str:
    records = [
        {"id": "p0", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"id": "p1", "messages": [{"role": "user", "content": "Name three colours."}]},
        {"id": "p2", "prompt": "Once upon a time"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_train_export_eval_on_a_tiny_hybrid(tmp_path, tiny_qwen3_5_dir, qwen_data, capsys):
    prompts = _prompts(tmp_path / "held_out.jsonl")
    run = tmp_path / "run"
    extra = {
        "drafter.target_layer_ids": "[1, 3, 6]",  # linear, full, linear
        "loss.anchors": 8,  # not 24: the loss over the 152k-token vocabulary is most of a step
        "optim.max_steps": 8,
        "checkpoint.every": 8,
        "eval.every": 8,
        "eval.prompts": f'"{prompts}"',
        "eval.max_new_tokens": 8,
    }
    assert cli.main(["train", *train_settings(run, tiny_qwen3_5_dir, qwen_data, **extra)]) == 0
    out = capsys.readouterr().out
    # Said once at start-up: on the CPU the linear layers run document by document.
    assert out.count("per-document fallback") == 1
    records = read_metrics(run)
    assert records[-1]["step"] == 8 and all(r["loss"] == r["loss"] for r in records)
    assert any("eval_tau" in r for r in records)
    exported = json.loads((run / "export" / "config.json").read_text())
    assert exported["num_target_layers"] == 8
    assert exported["dflash_config"]["target_layer_ids"] == [1, 3, 6]

    assert cli.main(["export", str(run), "--output", str(tmp_path / "export")]) == 0
    report_path = tmp_path / "report.json"
    argv = ["eval", "--target", str(tiny_qwen3_5_dir), "--drafter", str(tmp_path / "export")]
    argv += ["--prompts", prompts, "--output", str(report_path), "--max-new-tokens", "16"]
    argv += ["--block-size", "4"]
    assert cli.main(argv) == 0
    report = json.loads(report_path.read_text())
    # T = 0 through the hybrid rollback: the drafts change nothing of the target's output.
    assert report["lossless"] is True
    assert [p["id"] for p in report["per_prompt"]] == ["p0", "p1", "p2"]
    for entry in report["per_prompt"]:
        assert sum(entry["acceptance_lengths"]) + 1 == len(entry["output_ids"])


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_generate_with_a_hybrid_target_batched_equals_one_by_one(tmp_path, tiny_qwen3_5_dir):
    """Left-padded batches through the linear layers (their 2D padding mask) give exactly
    the answers of each prompt alone."""
    prompts = _prompts(tmp_path / "prompts.jsonl")
    answers = []
    for batch in ("3", "1"):
        out = tmp_path / f"batch{batch}.jsonl"
        argv = ["generate", "--target", str(tiny_qwen3_5_dir), "--prompts", prompts]
        argv += ["--output", str(out), "--max-new-tokens", "12", "--batch-size", batch]
        argv += ["--keep-truncated", "--no-progress"]
        assert cli.main(argv) == 0
        records = [json.loads(line) for line in out.read_text().splitlines()]
        answers.append({r["id"]: (r["completion"], r["completion_tokens"]) for r in records})
    assert answers[0] == answers[1]
    assert sorted(answers[0]) == ["p0#1", "p1#1", "p2#1"]  # id#turn
    assert all(tokens == 12 for _, tokens in answers[0].values())
