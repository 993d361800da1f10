"""A fast smoke version of `make demo`: every stage on the real SmolLM2 target, tiny sizes."""

import json

from flashdraft import cli


def test_demo_pipeline_end_to_end(tmp_path, smollm2_dir, capsys) -> None:
    out = tmp_path / "demo"
    args = [
        "--output",
        str(out),
        "--samples",
        "6",
        "--steps",
        "3",
        "--eval-prompts",
        "2",
        "--max-new-tokens",
        "12",
        "--device",
        "cpu",
    ]
    assert cli.main(["demo", *args]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tau_untrained"] >= 1.0 and summary["tau_trained"] >= 1.0
    assert summary["lossless_untrained"] and summary["lossless_trained"]
    assert set(summary["seconds"]) >= {"generate", "prepare", "train", "eval trained"}
    for path in (
        "generated.jsonl",
        "data/manifest.json",
        "run/metrics.jsonl",
        "run/export/model.safetensors",
        "eval_untrained.json",
        "eval_trained.json",
        "acceptance.png",
    ):
        assert (out / path).exists(), path
    printed = capsys.readouterr().out
    assert "flashdraft demo: results" in printed and "untrained" in printed
    # A second run reuses every finished stage instead of redoing it.
    assert cli.main(["demo", *args]) == 0
    # An output the target would not have produced (and no near-tie explains) fails the demo.
    report = json.loads((out / "eval_trained.json").read_text())
    report["unexplained_mismatch_prompts"] = 1
    (out / "eval_trained.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert cli.main(["demo", *args]) == 1
    assert "FAILED: 1 output(s) differ" in capsys.readouterr().err
