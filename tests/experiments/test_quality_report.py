"""experiments/quality_report.py: one run's report (its table, the tau-vs-tokens plot, the data
it was prepared from) and the eval's prompt selection."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers import quality_eval_report, synthetic_quality_run


@pytest.fixture(scope="module")
def report(quality: ModuleType) -> ModuleType:
    return sys.modules["quality_report"]


def test_the_report_holds_the_measured_table_and_the_curve(
    report: ModuleType, tmp_path: Path
) -> None:
    synthetic_quality_run(tmp_path / "out")
    env = {"date": "2026-12-01", "commit": "abc1234", "torch": "2", "transformers": "5",
           "python": "3.11", "gpu": "NVIDIA H200"}  # fmt: skip
    md, png, summary = report.write_quality_report(
        tmp_path / "out", "r", tmp_path / "bench", env, "python experiments/quality.py all"
    )
    assert md.name == "quality_h200_20261201_r.md" and png.name == "quality_h200_20261201_r.png"
    assert png.read_bytes().startswith(b"\x89PNG")
    text = md.read_text()
    assert "| tau, chat | 2.500 (8 prompts) | ≥ 3.0 |" in text
    # the target's own repetition loops are counted and tau is also given without them
    assert (
        "| tau, code: HumanEval | 3.750 (8 prompts; 3 end in a loop: 2.900 before the loops) |"
        in text
    )
    assert "| tau, code: mined Python | not measured | — |" in text
    assert "chat 1.80x, humaneval n/a (CPU)" in text
    assert "chat 0.960" in text  # z-lab 2.4 / ours 2.5
    assert "`flashdraft eval` tau (bf16 eval) | chat 0.960" in text  # an older report's parity
    assert "| T = 1, rejection sampling: tau | chat 1.400 | reported |" in text
    assert "trained on / held-out (T = 0): chat 4.60 / 2.50." in text
    # a kind evaluated on trained prompts alone (its held-out eval not run) still shows
    summary["trained"]["code"] = quality_eval_report(4.4, [0.7])
    assert "chat 4.60 / 2.50, code 4.40 / held-out not measured." in report.render(
        summary, env, "cmd"
    )
    assert "| chat | 0.60 | 0.40 | 0.20 |" in text and "7/8 +1 ties" in text
    assert "100 steps, 0.8M packed-row tokens, 612 s" in text
    assert "0.4M: 1.50, 0.8M: 2.25" in text  # the eval curve by cumulative tokens
    assert "seed 3" in text and "chat 30 / 6 (2 of 10 sources held out)" in text
    assert f"]({png.name})" in text
    evals, estimates = report.tau_curve(summary["metrics"])
    assert evals == [(409600, 1.5), (819200, 2.25)]
    # An fp32 parity run (experiments/zlab_parity.py's zlab_parity, which the eval stage runs)
    # brings its own flashdraft tau.
    summary["evals"]["chat"]["zlab_reference"] = {"tau": 2.4, "flashdraft_tau": 2.4}
    assert "tau (fp32) | chat 1.000 |" in report.render(summary, env, "cmd")
    # and, since s36, which of its steps drafting a whole block agree (z-lab shortens the rest)
    whole = {"steps": 80, "identical": False, "tail_steps": 7, "tail_identical": False}
    summary["evals"]["chat"]["zlab_reference"]["whole_blocks"] = whole
    assert "chat 1.000 (whole-block steps NOT identical: 80) |" in report.render(summary, env, "")
    assert len(estimates) == 10 and estimates[2] == (245760, 1.3)  # the resumed step 30 wins


def test_a_pruned_run_s_report_counts_the_whole_recipe_s_time(
    report: ModuleType, tmp_path: Path
) -> None:
    """A run trained from another run's pruned export (--prune-from): its report adds that
    run's training and the prune to its own, the whole recipe's time; a marker written
    before `source_run` was recorded names the source by its export's folder."""
    out = tmp_path / "out"
    synthetic_quality_run(out)
    stages = out / "stages"
    prune = {"settings": {"width": 704}, "width": 704, "seconds": 101.0, "source_run": "wide"}
    (stages / "prune-r.json").write_text(json.dumps(prune))
    (stages / "train-wide.json").write_text(json.dumps({"finished": True, "seconds": 1031.0}))
    env = {"date": "2026-12-04", "commit": "x", "torch": "2", "transformers": "5",
           "python": "3.11", "gpu": "NVIDIA H200"}  # fmt: skip
    text = report.render(report.collect(out, "r"), env, "cmd")
    assert (
        "Started from `wide`'s export with its MLPs pruned to 704 neurons (101 s); `wide` took "
        "1031 s of `flashdraft train`: the whole recipe 1744 s (29.1 min)" in text
    )
    del prune["source_run"]
    prune["drafter"] = "/tmp/q/runs/old/export"
    (stages / "prune-r.json").write_text(json.dumps(prune))
    text = report.render(report.collect(out, "r"), env, "cmd")
    assert "`old` took 0 s of `flashdraft train` (NOT finished)" in text
    (stages / "prune-r.json").unlink()
    assert "Started from" not in report.render(report.collect(out, "r"), env, "cmd")


def test_a_report_before_anything_ran_says_so(report: ModuleType, tmp_path: Path) -> None:
    env = {"date": "2026-12-01", "commit": "x", "torch": "2", "transformers": "5",
           "python": "3.11", "cpu": "x86_64", "threads": 2}  # fmt: skip
    md, png, _ = report.write_quality_report(tmp_path / "o", "reference", tmp_path, env, "cmd")
    assert md.name == "quality_cpu_20261201.md" and png.stat().st_size > 0
    assert md.read_text().count("not measured") >= 3 and "Training: not run." in md.read_text()


def test_the_report_lists_the_passes_the_data_was_prepared_from(
    report: ModuleType, tmp_path: Path
) -> None:
    """A pass started and then dropped (`--samples 0` after a sampled pass began) has a marker
    but no part in the data: the report names only the prepared passes."""
    stages = tmp_path / "stages"
    stages.mkdir()
    greedy = {"settings": {"prompts": 4, "sampling": {"temperature": 0.0, "max_new_tokens": 8}}}
    sampled = {"settings": {"prompts": 4, "sampling": {"temperature": 0.8, "max_new_tokens": 8}}}
    (stages / "generate-greedy.json").write_text(json.dumps({**greedy, "complete": True}))
    (stages / "generate-sample1.json").write_text(json.dumps({**sampled, "complete": False}))
    assert set(report.collect(tmp_path, "reference")["generated"]) == {"greedy", "sample1"}
    prepared = {"settings": {"greedy": {**greedy, "complete": True}}, "counts": {}}
    (stages / "prepare.json").write_text(json.dumps(prepared))
    assert set(report.collect(tmp_path, "reference")["generated"]) == {"greedy"}


def test_held_out_eval_prompts_are_spread_over_sources(report: ModuleType, tmp_path: Path) -> None:
    """The eval subset takes every source's first prompt before any second one, in file
    order, and the reports learn each prompt's source."""
    lines = [
        {"id": f"{src}@{turn}", "source": src, "messages": []}
        for src, turns in (("a", 3), ("b", 1), ("c", 2))
        for turn in range(turns)
    ]
    source = tmp_path / "held_out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "eval" / "chat_4.jsonl"
    report.write_spread_subset(source, out, 4)
    picked = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert picked == ["a@0", "b@0", "c@0", "a@1"]
    report.write_spread_subset(source, out, 50)  # fewer than asked: all of them, spread
    assert len(out.read_text().splitlines()) == 6
    result = {"per_prompt": [{"id": "c@1"}, {"id": "zzz"}]}
    report.add_sources(result, source)
    assert result["per_prompt"] == [{"id": "c@1", "source": "c"}, {"id": "zzz"}]


def test_a_run_on_data_with_untrained_loops_reports_that_data(
    quality: ModuleType, tmp_path: Path
) -> None:
    """--loops untrain prepares into data-loops/ with its own stage marker (so runs of both
    settings share one output), the run trains on it, and the report reads that data."""
    out = tmp_path / "out"
    _, keep, _ = quality.parse(["report", "--output", str(out)])
    _, loops, _ = quality.parse(["report", "--output", str(out), "--loops", "untrain"])
    assert (keep.loops, loops.loops) == ("keep", "untrain")
    plain = quality.Pipeline(keep, [])
    assert (plain.data_name, plain.prepare_marker) == ("data", "prepare")
    pipeline = quality.Pipeline(loops, [])
    assert (pipeline.data_name, pipeline.prepare_marker) == ("data-loops", "prepare-loops")
    synthetic_quality_run(out)
    report = sys.modules["quality_report"]
    counts = {"samples": 9, "tokens": 900, "loss_tokens": 300, "rejected": 0, "loop_untrained": 200}
    for name, extra in (("data", {}), ("data-loops", counts)):
        (out / name).mkdir()
        manifest = {
            "counts": {"samples": 9, "tokens": 900, "loss_tokens": 500, "rejected": 0, **extra}
        }
        (out / name / "manifest.json").write_text(json.dumps(manifest))
    marker = out / "stages" / "train-r.json"
    train = json.loads(marker.read_text())
    train["settings"] = {"run": {"data": {"datasets": [str(out / "data-loops")]}}}
    marker.write_text(json.dumps(train))
    summary = report.collect(out, "r")
    assert summary["prepared"]["counts"]["loop_untrained"] == 200
    env = {
        "date": "2026-12-02",
        "commit": "x",
        "torch": "2",
        "transformers": "5",
        "python": "3",
        "gpu": "H200",
    }
    assert "0.2K loop tokens untrained, `--loops untrain`" in report.render(summary, env, "cmd")
