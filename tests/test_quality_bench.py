"""bench/quality.py: the report writer, the staged training supervisor, and (slow) the whole
pipeline in its CPU smoke size."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest
from helpers import bench_modules

from flashdraft.export.dflash import load_dflash

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quality() -> ModuleType:
    """bench/quality.py as a module; it imports bench/quality_report.py as a script does."""
    return bench_modules("quality")["quality"]


@pytest.fixture(scope="module")
def report(quality: ModuleType) -> ModuleType:
    return sys.modules["quality_report"]


def _eval_report(tau: float, acc: list[float], **extra: object) -> dict:
    return {
        "tau": tau,
        "num_prompts": 8,
        "per_position_acceptance": acc,
        "lossless_prompts": 7,
        "near_tie_prompts": 1,
        "unexplained_mismatch_prompts": 0,
        **extra,
    }


def _synthetic_run(out: Path) -> None:
    """A finished run: metrics of 10 logged intervals (evals at steps 50 and 100), two
    held-out reports, the split and the stage markers."""
    run = out / "runs" / "r"
    (run / "eval").mkdir(parents=True)
    lines = []
    for step in range(10, 101, 10):
        record = {"step": step, "loss": 5.0 - step / 50, "tau_hat": 1 + step / 100, "tokens": 81920}
        if step in (50, 100):
            record["eval_tau"] = 1.5 if step == 50 else 2.25
        lines.append(json.dumps(record))
    # Step 30 logged before a crash, then again by the resumed run: the later line counts.
    lines.insert(2, json.dumps({"step": 30, "loss": 9.0, "tau_hat": 9.0, "tokens": 1}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    zlab = {"tau": 2.4, "steps": 10}
    (run / "eval" / "chat.json").write_text(
        json.dumps(_eval_report(2.5, [0.6, 0.4, 0.2], speedup=1.8, zlab_reference=zlab))
    )
    looped = {**_eval_report(3.75, [0.8] * 15), "loop_prompts": 3, "tau_before_loops": 2.9}
    (run / "eval" / "humaneval.json").write_text(json.dumps(looped))
    (run / "eval" / "chat_t1.json").write_text(json.dumps(_eval_report(1.4, [0.3, 0.1])))
    (run / "eval" / "chat_trained.json").write_text(json.dumps(_eval_report(4.6, [0.7, 0.5])))
    (out / "stages").mkdir()
    (out / "stages" / "train-r.json").write_text(json.dumps({"finished": True, "seconds": 612.0}))
    sampling = {"temperature": 0.0, "max_new_tokens": 256}
    (out / "stages" / "generate-greedy.json").write_text(
        json.dumps({"settings": {"prompts": 1000, "sampling": sampling, "seed": 0}, "seconds": 9})
    )
    (out / "prompts").mkdir()
    counts = {"sources": 10, "held_out_sources": 2, "train_prompts": 30, "held_out_prompts": 6}
    (out / "prompts" / "split.json").write_text(
        json.dumps({"settings": {"seed": 3}, "counts": {"chat": counts}})
    )


def test_the_report_holds_the_measured_table_and_the_curve(
    report: ModuleType, tmp_path: Path
) -> None:
    _synthetic_run(tmp_path / "out")
    env = {"date": "2026-12-01", "commit": "abc1234", "torch": "2", "transformers": "5",
           "python": "3.11", "gpu": "NVIDIA H200"}  # fmt: skip
    md, png, summary = report.write_quality_report(
        tmp_path / "out", "r", tmp_path / "bench", env, "python bench/quality.py all"
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
    summary["trained"]["code"] = _eval_report(4.4, [0.7])
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
    # An fp32 parity run (bench/quality.py's zlab_parity) brings its own flashdraft tau.
    summary["evals"]["chat"]["zlab_reference"] = {"tau": 2.4, "flashdraft_tau": 2.4}
    assert "tau (fp32) | chat 1.000 |" in report.render(summary, env, "cmd")
    assert len(estimates) == 10 and estimates[2] == (245760, 1.3)  # the resumed step 30 wins


def test_a_pruned_run_s_report_counts_the_whole_recipe_s_time(
    report: ModuleType, tmp_path: Path
) -> None:
    """A run trained from another run's pruned export (--prune-from): its report adds that
    run's training and the prune to its own, the whole recipe's time; a marker written
    before `source_run` was recorded names the source by its export's folder."""
    out = tmp_path / "out"
    _synthetic_run(out)
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


def test_prompt_subsets_carry_their_pass_in_the_id(quality: ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "train.jsonl"
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": str(i)}]} for i in range(5)]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    quality.write_prompt_subset(source, tmp_path / "s.jsonl", 3, "~sample1")
    subset = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["id"] for r in subset] == ["p0~sample1", "p1~sample1", "p2~sample1"]
    chat, code = tmp_path / "chat.jsonl", tmp_path / "code.jsonl"
    chat.write_text("c1\nc2\nc3\n")
    code.write_text("h1\nh2\n")
    quality.write_mixed_eval(chat, code, tmp_path / "mixed.jsonl")
    assert (tmp_path / "mixed.jsonl").read_text() == "c1\nh1\nc2\nh2\n"


def test_smoke_sizes_and_repeated_overrides(quality: ModuleType) -> None:
    stage, config, overrides = quality.parse(
        ["train", "--smoke", "--run", "layers3", "--set", "drafter.num_layers=3", "--set", "seed=1"]
    )  # the README's ablation line, smoke-sized
    assert (stage, config.run, config.device, config.steps) == ("train", "layers3", "cpu", 6)
    assert overrides == ["drafter.num_layers=3", "seed=1"]
    with pytest.raises(SystemExit):
        quality.parse(["nope"])


FAKE_TRAIN = """
import json, pathlib, sys, time
run = pathlib.Path(sys.argv[1])
run.mkdir(exist_ok=True)
time.sleep(1.5)  # start-up: not a step
for step in range(1, int(sys.argv[2]) + 1):
    time.sleep(0.4)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "step_s": 0.4}) + "\\n")
    done = run / "checkpoints" / f"step_{step:08d}"
    done.mkdir(parents=True, exist_ok=True)
    (done / "COMPLETE").write_text("")
(run / "export").mkdir(exist_ok=True)
(run / "export" / "config.json").write_text("{}")
sys.exit(int(sys.argv[3]))
"""


def test_training_stops_just_after_a_checkpoint_at_the_deadline(
    quality: ModuleType, tmp_path: Path
) -> None:
    script = tmp_path / "fake_train.py"
    script.write_text(textwrap.dedent(FAKE_TRAIN))
    run = tmp_path / "run"

    def supervise(steps: int, budget: float | None, code: int = 0) -> bool:
        command = [sys.executable, str(script), str(run), str(steps), str(code)]
        finished: bool = quality.supervise(command, tmp_path / "log", run, budget, margin=0.5)
        return finished

    started = time.monotonic()
    assert supervise(100, budget=4.0) is False
    assert time.monotonic() - started < 5.0
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert 3 <= len(steps) <= 9 and not (run / "export").exists()
    # It stopped right after a checkpoint: no step was lost.
    assert time.time() - (run / "checkpoints" / steps[-1]).stat().st_mtime < 1.5
    assert supervise(2, budget=None) is True  # the rest of the run, to its export
    with pytest.raises(RuntimeError, match="exited 3"):
        supervise(0, budget=None, code=3)


CRASHING_TRAIN = """
import pathlib, sys
run, crashes, then = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with open(run / "calls.txt", "a") as f:
    f.write(" ".join(sys.argv[4:]) + "\\n")
calls = len((run / "calls.txt").read_text().splitlines())
if calls <= crashes:  # save one more checkpoint, then die
    done = run / "checkpoints" / f"step_{calls:08d}"
    done.mkdir(parents=True, exist_ok=True)
    (done / "COMPLETE").write_text("")
    print("RuntimeError: CUDA driver error: unspecified launch failure")
    sys.exit(1)
if then == "die":  # dies before its next checkpoint
    sys.exit(1)
(run / "export").mkdir(exist_ok=True)
(run / "export" / "config.json").write_text("{}")
"""


def test_a_training_that_dies_after_a_checkpoint_resumes_from_it_at_once(
    quality: ModuleType, tmp_path: Path
) -> None:
    """s28: `pe`'s training died of a CUDA fault (Xid 43) after its step-4,000 checkpoint and
    waited for the next device call; the same steps then ran through. A death after a new
    checkpoint now resumes from it in the same call (with `--resume`); a death before any
    new checkpoint, first time or after a resume, raises with the log's tail; with too
    little time left it stops (False) for the next call."""
    script = tmp_path / "crashing_train.py"
    script.write_text(textwrap.dedent(CRASHING_TRAIN))

    def run_with(
        crashes: int, then: str = "finish", left: float | None = None
    ) -> tuple[bool, list[str]]:
        run = tmp_path / f"run{crashes}{then}{left}"
        run.mkdir()
        command = [sys.executable, str(script), str(run), str(crashes), then, "train"]
        finished: bool = quality.supervise_resuming(command, run / "log", run, lambda: left)
        return finished, (run / "calls.txt").read_text().splitlines()

    assert run_with(0) == (True, ["train"])
    assert run_with(2) == (True, ["train", "train --resume", "train --resume"])
    assert run_with(1, left=30.0) == (False, ["train"])  # under 90 s left: the next call
    for crashes in (0, 1):  # no checkpoint saved before it died: not a passing fault
        with pytest.raises(RuntimeError, match="exited 1"):
            run_with(crashes, "die")
    assert (tmp_path / "run1dieNone" / "calls.txt").read_text().split("\n")[:2] == [
        "train",
        "train --resume",
    ]


FINAL_TRAIN = """
import json, pathlib, sys, time
run = pathlib.Path(sys.argv[1])
for step in (1, 2):
    time.sleep(2.0)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "step_s": 2.0}) + "\\n")
    done = run / "checkpoints" / f"step_{step:08d}"
    done.mkdir(parents=True, exist_ok=True)
    (done / "state.json").write_text(json.dumps({"step": step, "total_steps": 2}))
    (done / "COMPLETE").write_text("")
time.sleep(0.3)  # the export
(run / "export").mkdir(exist_ok=True)
(run / "export" / "config.json").write_text("{}")
"""


def test_the_last_checkpoint_is_not_a_stop_the_export_follows(
    quality: ModuleType, tmp_path: Path
) -> None:
    """A step takes 2 s and ~1.4 s are left after the last one's checkpoint: another
    checkpoint would not fit, but there is none to come, only the export (m6, 2026-12-02,
    stopped 26 s before its deadline with its export unwritten)."""
    script = tmp_path / "final_train.py"
    script.write_text(textwrap.dedent(FINAL_TRAIN))
    run = tmp_path / "run"
    run.mkdir()
    command = [sys.executable, str(script), str(run)]
    assert quality.supervise(command, tmp_path / "log", run, 5.5, margin=0.2) is True
    assert (run / "export" / "config.json").exists()


def test_the_time_per_step_ignores_windows_with_an_eval_or_a_restart(
    quality: ModuleType, tmp_path: Path
) -> None:
    """The deadline's step time: a window that held an in-training eval (1.4 s "per step",
    as a resumed run logged at its eval step on 2026-12-02) or a restart's compilation must
    not make the next checkpoint look 20x further off than it is."""
    run = tmp_path / "run"
    run.mkdir()
    assert quality._seconds_per_step(run) is None
    records = [{"step": 20 * i, "step_s": 0.05} for i in range(1, 12)]
    records[0]["step_s"] = 0.4  # the window after a restart: compilation
    records.append({"step": 240, "step_s": 1.4352, "eval_tau": 2.8})
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + "{not json\n"
    )
    assert quality._seconds_per_step(run) == pytest.approx(0.05)


@pytest.mark.slow
def test_the_whole_pipeline_runs_in_its_smoke_size(tmp_path: Path) -> None:
    """build-prompts -> generate -> prepare -> train -> eval -> report on the real SmolLM2
    target, tiny sizes, on the CPU, as on the two-GPU machine (--gpus 2: the greedy and
    sampled passes in two processes, training under torchrun on two ranks); a second call
    finds every stage done."""
    out = tmp_path / "q"
    command = [sys.executable, str(ROOT / "bench" / "quality.py"), "all", "--smoke", "--gpus", "2"]
    command += ["--output", str(out)]
    first = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    result = json.loads(first.stdout.strip().splitlines()[-1])
    assert result["complete"] is True and set(result["tau"]) == {"chat", "humaneval", "code"}
    assert set(result["tau_t1"]) == {"chat", "humaneval"}  # the sampled evals (T = 1)
    # the fit check: every kind the greedy pass answered is evaluated on its trained prompts
    answered = {json.loads(line)["kind"] for line in (out / "gen/greedy.prompts.jsonl").open()}
    fitted = {p.name for p in (out / "runs/reference/eval").glob("*_trained.json")}
    assert answered and fitted == {f"{kind}_trained.json" for kind in answered}
    assert all(tau >= 1.0 for tau in result["tau"].values())
    (md,) = out.glob("quality_cpu_*.md")
    assert "| tau, chat |" in md.read_text() and "Training (finished)" in md.read_text()
    assert {p.name for p in (out / "gen").glob("*.log")} == {"greedy.log", "sample1.log"}
    metrics = [json.loads(line) for line in (out / "runs/reference/metrics.jsonl").open()]
    assert json.loads((out / "runs/reference/run_config.json").read_text())  # one run dir
    assert "2 drafter replica(s)" in (out / "runs/reference.log").read_text()
    assert [r["step"] for r in metrics if "eval_tau" in r] == [3, 6]
    split = json.loads((out / "prompts" / "split.json").read_text())
    assert split["counts"]["chat"]["train_prompts"] == 40
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode == 0 and "eval chat" not in again.stdout  # nothing redone
    assert json.loads(again.stdout.strip().splitlines()[-1])["tau"] == result["tau"]
    # the shipped drafter's second run: the first one's export pruned, then trained on
    narrow = [*command[:2], "train", "--smoke", "--output", str(out), "--run", "narrow"]
    narrow += ["--prune-from", "reference", "--prune-width", "16", "--prune-mix", "chat=1,code=1"]
    done = subprocess.run(narrow, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert load_dflash(str(out / "runs/narrow.init")).config.intermediate_size == 16
    assert load_dflash(str(out / "runs/narrow/export")).config.intermediate_size == 16
    assert json.loads((out / "stages/prune-narrow.json").read_text())["scores"] == "activation"


def test_prepare_trains_the_turns_asked_for(
    quality: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--turns last` reaches `prepare` (only the regenerated assistant turn is trained) and
    its marker, so a change prepares the data again; the default leaves older markers valid."""
    seen = []

    class Prepared:
        ok, manifest = True, {"counts": {}}

    monkeypatch.setattr(quality, "prepare", lambda config: seen.append(config) or Prepared())
    for turns in ("all", "last"):
        argv = ["prepare", "--output", str(tmp_path), "--target", "t", "--turns", turns]
        _, config, overrides = quality.parse(argv)
        pipeline = quality.Pipeline(config, overrides, argv)
        for name, _, _ in pipeline.passes():
            pipeline.save_marker(f"generate-{name}", {}, complete=True)
        pipeline.prepare()
        assert seen[-1].template.turns == turns
        settings = json.loads((tmp_path / "stages" / "prepare.json").read_text())["settings"]
        assert settings.get("turns", "all") == turns
    assert len(seen) == 2


def test_prepare_refuses_answers_not_all_generated(
    quality: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generate stage stopped by its deadline leaves part of the answers: `prepare` run on
    its own then refuses, instead of preparing the part as the whole data."""
    monkeypatch.setattr(quality, "prepare", lambda config: pytest.fail("prepared"))
    argv = ["prepare", "--output", str(tmp_path), "--target", "t"]
    _, config, overrides = quality.parse(argv)
    pipeline = quality.Pipeline(config, overrides, argv)
    names = [name for name, _, _ in pipeline.passes()]
    with pytest.raises(RuntimeError, match="not all generated"):
        pipeline.prepare()  # nothing generated
    for name in names:
        pipeline.save_marker(f"generate-{name}", {}, complete=True)
    pipeline.save_marker(f"generate-{names[-1]}", {}, complete=False)
    with pytest.raises(RuntimeError, match=f"answers of {names[-1]} are not all generated"):
        pipeline.prepare()


def test_compare_sets_runs_beside_each_other_and_the_peer(
    quality: ModuleType, tmp_path: Path
) -> None:
    """`bench/quality.py compare`: one row per run with the recipe keys that differ, the
    median step time and each kind's tau; the peer's row, and each run's tau over the peer's."""
    out = tmp_path / "q"
    recipes = {"base": "decay", "dpace": "dpace"}
    taus = {"base": (3.0, 2.0, 2.5), "dpace": (4.0, 2.2, 3.0)}
    for name, weighting in recipes.items():
        run = out / "runs" / name
        (run / "eval").mkdir(parents=True)
        for kind, tau in zip(("chat", "humaneval", "code"), taus[name], strict=True):
            report = _eval_report(tau, [0.5], speedup=tau * 0.7)
            (run / "eval" / f"{kind}.json").write_text(json.dumps(report))
        lines = [json.dumps({"step": s, "step_s": 0.03 + s * 1e-4}) for s in (20, 40, 60)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        loss = {"weighting": weighting, "anchors": 512}
        if name == "dpace":  # recorded by a version with a key the other run's had not yet
            loss["argmax_mix"] = 0.0
        required = {"target": {"path": "t"}, "data": {"datasets": ["d"]}}
        settings = {"run": {"output": str(run), **required, "loss": loss}}
        (out / "stages").mkdir(exist_ok=True)
        (out / "stages" / f"train-{name}.json").write_text(json.dumps({"settings": settings}))
    # a run stopped before its train marker: listed, and no reason to call every key different
    (out / "runs" / "started").mkdir()
    (out / "runs" / "started" / "metrics.jsonl").write_text(json.dumps({"step": 20}) + "\n")
    peer = out / "runs" / "peer-speculators"
    (peer / "eval").mkdir(parents=True)
    for kind, tau in zip(("chat", "humaneval", "code"), (5.0, 2.0, 3.0), strict=True):
        (peer / "eval" / f"{kind}.json").write_text(json.dumps(_eval_report(tau, [0.5])))
    (peer / "report.json").write_text(
        json.dumps({"steps": 60, "train_s": 4.5, "peer_version": "0.9.0"})
    )
    bench = tmp_path / "bench"
    _, config, _ = quality.parse(["compare", "--output", str(out), "--bench-dir", str(bench)])
    result = quality.run("compare", config, [])
    assert result["runs"] == ["base", "dpace", "started"] and result["peer"] is True
    (md,) = bench.glob("quality_*_compare.md")
    table = md.read_text()
    base = next(line for line in table.splitlines() if line.startswith("| base"))
    assert "loss.weighting=decay" in base and "anchors" not in base  # only what differs
    assert "argmax_mix" not in table  # a key added since: its default, the same in both
    assert "| 60 | 34.0 |" in base  # last step, median step time in ms
    assert "3.000 (2.10x)" in base and "| 0.60 | 1.00 | 0.83 |" in base  # tau / peer's
    started = next(line for line in table.splitlines() if line.startswith("| started"))
    assert "(no train record) | 20 |" in started
    peer_line = next(line for line in table.splitlines() if line.startswith("| peer"))
    assert "speculators 0.9.0" in peer_line and "| 75.0 |" in peer_line


def test_compare_shows_no_ratio_over_other_prompts(quality: ModuleType) -> None:
    """A peer evaluated on other prompts than the run (the held-out file's first 24 instead of
    the eval stage's spread over sources, as `quality_session.sh peer` did before s25) gets
    no ratio: one over two prompt sets would read as a measurement. Reports without
    per-prompt results (older ones) keep their plain ratio."""
    report = sys.modules["quality_report"]

    def ev(tau: float, ids: list[str] | None) -> dict:
        prompts = None if ids is None else [{"id": i, "acceptance_lengths": [2]} for i in ids]
        return {**_eval_report(tau, [0.5]), **({"per_prompt": prompts} if prompts else {})}

    def row(name: str, evals: dict) -> dict:
        return {
            "name": name,
            "recipe": {"recipe": "r"},
            "steps": 10,
            "step_ms": 1.0,
            "evals": evals,
        }

    mine = row(
        "mine",
        {"chat": ev(3.0, ["a", "b"]), "humaneval": ev(2.0, ["h1", "h2"]), "code": ev(2.0, None)},
    )
    peer = row(
        "peer",
        {"chat": ev(2.0, ["a", "c"]), "humaneval": ev(2.0, ["h1", "h2"]), "code": ev(1.0, ["x"])},
    )
    line = report.compare_table([mine], peer).splitlines()[2]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[-3:] == ["— (other prompts)", "1.00 [1.00-1.00]", "2.00"]


def test_the_peers_step_time_is_its_logged_median(quality: ModuleType, tmp_path: Path) -> None:
    """The peer's ms/step in `compare` is the median of its logged intervals, as the runs'
    median step_s, not train_s / steps, which also counts its start-up and compilation; a
    resumed run's clock restarting is skipped; without a log, train_s / steps."""
    report = sys.modules["quality_report"]
    folder = tmp_path / "peer"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps({"steps": 80, "train_s": 80.0}))
    assert report.peer_row(folder)["step_ms"] == 1000.0
    log = [(20, 70.0), (40, 72.0), (60, 74.2), (80, 5.0), (100, 7.0)]  # compiled, then resumed
    lines = [json.dumps({"step": s, "elapsed_s": e}) for s, e in log]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert report.peer_row(folder)["step_ms"] == pytest.approx(100.0)  # of 100, 110, 100 ms


def test_tau_ratio_interval_is_paired_over_prompts(quality: ModuleType) -> None:
    """The compare table's interval: resampling prompts, both runs' results on a prompt stay
    together. Equal runs give exactly 1; one prompt that decides the ratio widens it to cover
    both the ratio with and without that prompt."""
    report = sys.modules["quality_report"]

    def ev(*lengths: list[int]) -> dict:
        return {"per_prompt": [{"acceptance_lengths": x} for x in lengths]}

    same = ev([3, 3, 2], [1, 1], [5, 4])
    assert report.tau_ratio_interval(same, same) == (1.0, 1.0)
    # prompt 3: 40 tokens in 10 steps vs 40 tokens in 4 steps; the others are equal
    mine = ev([2, 2, 2], [3, 3], [4] * 10)
    theirs = ev([2, 2, 2], [3, 3], [10] * 4)
    low, high = report.tau_ratio_interval(mine, theirs)
    assert low < 46 / 15 / (46 / 9) < high <= 1.0  # the point ratio, inside; never above 1
    assert low < 0.7 and high == 1.0  # resamples without prompt 3 give exactly 1
    assert report.tau_ratio_interval(mine, ev([1])) is None  # not the same prompts
    renamed = {"per_prompt": [dict(x, id=f"other{i}") for i, x in enumerate(theirs["per_prompt"])]}
    assert report.tau_ratio_interval(mine, renamed) is None  # as many, but other prompts


def test_the_interval_draws_whole_sources(quality: ModuleType) -> None:
    """Prompts from one conversation move together: ten turns of one conversation that all
    favour `mine` count as one draw, so the interval widens against ten independent ones."""
    report = sys.modules["quality_report"]

    def ev(lengths: list[list[int]], sources: list[str] | None) -> dict:
        return {
            "per_prompt": [
                {
                    "id": str(i),
                    "acceptance_lengths": x,
                    **({"source": sources[i]} if sources else {}),
                }
                for i, x in enumerate(lengths)
            ]
        }

    mine = [[4, 4]] * 10 + [[2, 2]] * 10
    theirs = [[2, 2]] * 10 + [[2, 2]] * 10
    independent = report.tau_ratio_interval(ev(mine, None), ev(theirs, None))
    one_conversation = ["a"] * 10 + [f"b{i}" for i in range(10)]
    clustered = report.tau_ratio_interval(ev(mine, one_conversation), ev(theirs, None))
    assert independent is not None and clustered is not None
    assert clustered[1] - clustered[0] > independent[1] - independent[0]
    assert clustered[0] == 1.0  # a resample without conversation "a" is level
    by_id = dict(enumerate(one_conversation))  # the same sources, named by prompt id
    named = report.tau_ratio_interval(
        ev(mine, None), ev(theirs, None), sources={str(i): s for i, s in by_id.items()}
    )
    assert named == clustered


def test_held_out_eval_prompts_are_spread_over_sources(quality: ModuleType, tmp_path: Path) -> None:
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
    quality.write_spread_subset(source, out, 4)
    picked = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert picked == ["a@0", "b@0", "c@0", "a@1"]
    quality.write_spread_subset(source, out, 50)  # fewer than asked: all of them, spread
    assert len(out.read_text().splitlines()) == 6
    report = {"per_prompt": [{"id": "c@1"}, {"id": "zzz"}]}
    quality.add_sources(report, source)
    assert report["per_prompt"] == [{"id": "c@1", "source": "c"}, {"id": "zzz"}]


def test_pooled_seeds_are_one_recipe_paired_over_sources(quality: ModuleType) -> None:
    """Two seeds of a recipe, pooled: each prompt keeps both runs' verify steps, tau is the
    recipe's over all of them (not the mean of the two taus), and the interval against
    another recipe resamples sources with every run's results on them. A list on either side
    of `paired_ratio_text` is pooled, before the loops too; runs of other prompts refuse."""
    report = sys.modules["quality_report"]

    def run(*lengths: list[int], loop: int = 0) -> dict:
        """Each output: its answer, then with `loop` a loop the drafter takes 15 at a time."""
        lengths = tuple(x + [15] * loop for x in lengths)
        prompts = [
            {
                "id": f"p{i}",
                "source": f"s{i // 2}",
                "acceptance_lengths": x,
                "output_ids": list(range(100, 101 + sum(x) - 15 * loop)) + [7] * (15 * loop),
            }
            for i, x in enumerate(lengths)
        ]
        steps = sum(len(x) for x in lengths)
        return {"tau": sum(map(sum, lengths)) / steps, "per_prompt": prompts}

    seed0 = run([4, 4], [2], [3, 3, 3], [1])
    seed1 = run([6], [2, 2], [3], [1, 1, 1, 1])
    both = report.pooled([seed0, seed1])
    assert both["tau"] == pytest.approx((8 + 2 + 9 + 1 + 6 + 4 + 3 + 4) / 15)
    assert both["tau"] != pytest.approx((seed0["tau"] + seed1["tau"]) / 2)
    assert [p["acceptance_lengths"] for p in both["per_prompt"]] == [
        [4, 4, 6],
        [2, 2, 2],
        [3, 3, 3, 3],
        [1, 1, 1, 1, 1],
    ]
    assert [p["source"] for p in both["per_prompt"]] == ["s0", "s0", "s1", "s1"]
    assert report.tau_ratio_interval(both, both) == (1.0, 1.0)
    # two sources: a resample holds s0 twice, s1 twice or one of each
    peer = run([2, 2, 2], [2], [2, 2], [2])
    low, high = report.tau_ratio_interval(both, peer)
    on_s0, on_s1 = (8 + 2 + 6 + 4) / 6 / 2.0, (9 + 1 + 3 + 4) / 9 / 2.0
    assert (low, high) == pytest.approx((min(on_s0, on_s1), max(on_s0, on_s1)))
    line = report.paired_ratio_text([seed0, seed1], peer)
    assert line.startswith(f"{both['tau']:.3f} / 2.000 = {both['tau'] / 2:.3f} [")
    assert "; before loops" in line
    assert report.paired_ratio_text([seed0], peer) == report.paired_ratio_text(seed0, peer)
    # the same outputs, each then in a loop of 135 tokens (LOOP_TAIL is 128): before the
    # loops, the pooled tau of the loop-free seeds again; over everything, the loops lift it
    looped = [
        run(*(p["acceptance_lengths"] for p in r["per_prompt"]), loop=9) for r in (seed0, seed1)
    ]
    whole, cut = report.paired_ratio_text(looped, peer).split("; before loops ")
    assert whole.startswith(f"{report.pooled(looped)['tau']:.3f} / 2.000 = ")
    assert cut.startswith(f"{both['tau']:.3f} / 2.000 = ")
    assert report.pooled(looped)["tau"] > 5.0
    with pytest.raises(ValueError, match="other prompts"):
        report.pooled([seed0, run([1], [1], [1])])
    renamed = {
        **seed1,
        "per_prompt": [dict(p, id=f"q{i}") for i, p in enumerate(seed1["per_prompt"])],
    }
    with pytest.raises(ValueError, match="other prompts"):
        report.pooled([seed0, renamed])
    with pytest.raises(ValueError, match="per-prompt"):
        report.pooled([seed0, {"tau": 2.0}])
    anonymous = [{k: v for k, v in p.items() if k != "id"} for p in seed1["per_prompt"]]
    with pytest.raises(ValueError, match="no id"):  # unmatched prompts are never pooled
        report.pooled([{**seed0, "per_prompt": anonymous}, {**seed1, "per_prompt": anonymous}])
    unnamed = [{k: v for k, v in p.items() if k != "source"} for p in seed0["per_prompt"]]
    named_later = report.pooled([{**seed0, "per_prompt": unnamed}, seed1])
    assert [p["source"] for p in named_later["per_prompt"]] == ["s0", "s0", "s1", "s1"]


def test_the_pairs_stage_pools_each_recipes_runs_over_a_baseline(
    quality: ModuleType, tmp_path: Path
) -> None:
    """`bench/quality.py pairs --runs NAME=DIR[,DIR...] --peer DIR[,DIR...]`: each recipe's
    runs (run folders or eval folders) pooled per kind over the pooled baseline, with the
    paired interval; T = 1 where both ran it; a kind a run lacks pools the runs that have
    it; a bad entry or an empty folder is a one-line error naming it."""

    def write(folder: Path, kind: str, lengths: list[list[int]]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        prompts = [
            {"id": f"{kind}{i}", "source": f"s{i}", "acceptance_lengths": x,
             "output_ids": list(range(100, 101 + sum(x)))}
            for i, x in enumerate(lengths)
        ]  # fmt: skip
        steps = sum(map(len, lengths))
        report = {"tau": sum(map(sum, lengths)) / steps, "per_prompt": prompts}
        (folder / f"{kind}.json").write_text(json.dumps(report))

    a0, a1, p0, p1 = (tmp_path / n for n in ("a0", "a1", "p0", "p1"))
    write(a0 / "eval", "chat", [[4, 4], [2]])  # a run folder: its eval/ is read
    write(a0 / "eval", "chat_t1", [[2], [2]])
    write(a1 / "eval", "chat", [[6], [2, 2, 2]])
    write(a1 / "eval", "code", [[3, 3]])  # only a1 ran code
    write(p0, "chat", [[2, 2], [2]])  # eval folders given directly
    write(p0, "chat_t1", [[1], [1]])
    write(p1, "chat", [[2], [2, 2]])
    write(p1, "code", [[2, 2]])
    bench = tmp_path / "bench"
    argv = ["pairs", "--runs", f"a={a0},{a1}", "--peer", f"{p0},{p1}", "--bench-dir", str(bench)]
    _, config, _ = quality.parse(argv)
    result = quality.run("pairs", config, [])
    assert result["runs"] == ["peer", "a"] and result["baseline"] == "peer"
    md = next(bench.glob("quality_*_pairs.md")).read_text()
    # chat: a pools 8 + 2 + 6 + 6 = 22 in 7 steps (a0 alone: 3.333), the peer 12 in 6
    assert "| a | 3.143 (2) | 1.571 [" in md
    assert "| peer | 2.000 (2) | — |" in md
    # code: a1 alone (6 in 2 steps) over p1 alone (4 in 2)
    assert "3.000 (1) | 1.500 [1.50-1.50] |" in md
    t1 = md.split("At T = 1")[1]
    assert "| a | 2.000 (1) | 2.000 [2.00-2.00] |" in t1
    assert "Over the text before" in md and str(a0 / "eval") in md

    trained_only = tmp_path / "trained_only"
    trained_only.mkdir()
    (trained_only / "train.json").write_text("{}")  # no eval/ yet: no held-out report
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "chat.json").write_text("{")
    old = tmp_path / "old"
    old.mkdir()
    (old / "chat.json").write_text(json.dumps({"tau": 2.0}))  # written before per_prompt
    for bad, message in (
        (["--runs", "a"], "NAME=DIR"),
        (["--runs", f"a={trained_only}"], "holds no held-out eval report"),
        (["--runs", "a="], "names no folder"),
        (["--runs", f"a={a0},{a0 / 'eval'}"], "twice"),  # one run is not two seeds
        (["--runs", f"a={a0}", f"a={a1}"], "taken twice"),
        (["--runs", f"peer={a0}", "--peer", str(p0)], "taken twice"),
        (["--runs", f"a={tmp_path / 'broken'}"], "broken/chat.json: not an eval report"),
        (["--runs", f"a={a0},{old}", "--peer", str(p0)], r"pairs: a \(.*old\), chat: pooled"),
    ):
        _, config, _ = quality.parse(["pairs", *bad, "--bench-dir", str(bench)])
        with pytest.raises(ValueError, match=message):
            quality.run("pairs", config, [])
    # without --peer the first recipe is the baseline
    _, config, _ = quality.parse(
        ["pairs", "--runs", f"p={p0}", f"a={a0}", "--bench-dir", str(bench)]
    )
    assert quality.run("pairs", config, [])["baseline"] == "p"


def test_compare_repeats_its_table_over_the_text_before_the_loops(quality: ModuleType) -> None:
    """A target's repetition loop ("no no no ...") is accepted whole by any drafter: when an
    output falls into one, `compare` adds the table again over each prompt's verify steps
    that end before the loop, with the ratio to the peer on those steps."""
    report = sys.modules["quality_report"]

    def prompt(pid: str, answer: int, lengths: list[int]) -> dict:
        ids = list(range(100, 100 + answer)) + [7] * (1 + sum(lengths) - answer)
        return {"id": pid, "output_ids": ids, "acceptance_lengths": lengths}

    # 10 answer tokens, then a loop from index 10: steps 3 + 3 + 3 end at index 9, the rest loop
    looping = prompt("a", 10, [3, 3, 3] + [15] * 10)
    plain = {"id": "b", "output_ids": list(range(9)), "acceptance_lengths": [2, 2, 2, 2]}
    mine = {"tau": 9.0, "per_prompt": [looping, plain]}
    view = report.before_loops(mine)
    assert view["loop_prompts"] == 1
    assert [p["acceptance_lengths"] for p in view["per_prompt"]] == [[3, 3, 3], [2, 2, 2, 2]]
    assert view["tau"] == pytest.approx(17 / 7)
    assert report.before_loops({"tau": 2.0, "per_prompt": [{"acceptance_lengths": [2]}]}) is None
    theirs = {
        "tau": 8.0,
        "per_prompt": [prompt("a", 10, [1] * 9 + [15] * 10), dict(plain, acceptance_lengths=[8])],
    }
    assert report.before_loops(theirs)["tau"] == pytest.approx(17 / 10)
    # the sessions' pairs files: the same two ratios on one line, each with its interval
    line = report.paired_ratio_text(mine, theirs)
    assert (
        line.startswith("9.000 / 8.000 = 1.125 [")
        and "; before loops 2.429 / 1.700 = 1.429 [" in line
    )
    assert report.paired_ratio_text(mine, theirs, before_loops_too=False) == line.split(";")[0]
    other = {"tau": 2.0, "per_prompt": [dict(plain, id="c")]}  # other prompts: no pairing
    unpaired = (
        "2.000 / 8.000 = 0.250 [no interval]; before loops 2.000 / 1.700 = 1.176 [no interval]"
    )
    assert report.paired_ratio_text(other, theirs) == unpaired

    def row(name: str, evals: dict) -> dict:
        return {"name": name, "recipe": {"x": name}, "steps": 5, "step_ms": 1.0, "evals": evals}

    peer = row("peer", {"chat": theirs})
    peer["recipe"] = {"recipe": "theirs"}
    table = report.render_compare([row("mine", {"chat": mine})], peer)
    first, second = table.split("Over the text before")
    assert "| 9.000 | — | — | 1.12" in first  # 9 / 8 over everything
    assert "| 2.429 | — | — | 1.43" in second  # (17/7) / (17/10) before the loops
    without = report.render_compare([row("mine", {"chat": {"tau": 2.0}})], None)
    assert "Over the text before" not in without  # nothing loops: one table
    assert "T = 1" not in table + without  # no sampled evals: no T = 1 table
    sampled = row("mine", {"chat": {"tau": 2.0}})
    sampled["sampled"] = {"chat": {"tau": 1.5}}
    peer["sampled"] = {"chat": {"tau": 1.2}}
    table = report.render_compare([sampled], peer)
    assert "At T = 1" in table and "| 1.500 | — | — | 1.25" in table.split("At T = 1")[1]


def test_compare_shows_where_the_acceptance_differs_by_position(quality: ModuleType) -> None:
    """The per-position table: each run's conditional acceptance c1..c8, and "mix", the tau
    of the run's c1 chained with the peer's later positions (1 + sum of running products)."""
    report = sys.modules["quality_report"]

    def row(name: str, cond: list[float] | None) -> dict:
        evals = {"chat": None if cond is None else {"tau": 2.0, "conditional_acceptance": cond}}
        return {"name": name, "recipe": {"recipe": name}, "steps": 5, "step_ms": 1.0,
                "evals": evals, "sampled": {}}  # fmt: skip

    mine, theirs = row("mine", [0.8, 0.5, 0.5]), row("peer", [0.6, 0.9, 0.5])
    table = report.render_compare([mine], theirs)
    section = table.split("Conditional acceptance by draft position")[1]
    mix = 1 + 0.8 + 0.8 * 0.9 + 0.8 * 0.9 * 0.5  # mine's c1, the peer's c2 and c3
    assert f"| chat | mine | 0.800 | 0.500 | 0.500 |  |  |  |  |  | {mix:.3f} |" in section
    assert "| chat | peer | 0.600 | 0.900 | 0.500 |  |  |  |  |  | — |" in section
    # evaluated on other prompts than the peer: no mix (as no ratio in the tables above)
    mine["evals"]["chat"]["per_prompt"] = [{"id": "a", "acceptance_lengths": [2]}]
    theirs["evals"]["chat"]["per_prompt"] = [{"id": "b", "acceptance_lengths": [2]}]
    section = report.render_compare([mine], theirs).split("by draft position")[1]
    assert "| chat | mine | 0.800 | 0.500 | 0.500 |  |  |  |  |  | — |" in section
    # a kind the peer was not evaluated on: the run's row, no mix
    mine["evals"]["humaneval"] = {"tau": 2.0, "conditional_acceptance": [0.5]}
    section = report.render_compare([mine], theirs).split("by draft position")[1]
    assert "| code: HumanEval | mine | 0.500 |" in section
    assert report._chained_tau([0.5, 0.5]) == pytest.approx(1.75)
    # no per-position data (older eval reports): no table
    assert "Conditional acceptance" not in report.render_compare([row("old", None)], None)


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
    _synthetic_run(out)
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


def test_the_committed_reference_data_is_what_its_readme_records() -> None:
    """benchmarks/data/smollm2_reference_*/: every file has the sha256 its README lists, the
    prompts archive holds the held-out split but no training prompts (those travel inside
    the answers' archive), and the split's held-out files are the ones the evals read."""
    import hashlib
    import re
    import tarfile

    folders = sorted((ROOT / "benchmarks" / "data").glob("smollm2_reference_*"))
    assert folders
    for folder in folders:
        readme = (folder / "README.md").read_text()
        found = re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, flags=re.M)
        listed = {name: digest for digest, name in found}
        on_disk = {p.name for p in folder.iterdir() if p.name != "README.md"}
        assert set(listed) == on_disk
        for name, digest in listed.items():
            assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
        with tarfile.open(folder / "qrun.tar.xz") as archive:
            names = set(archive.getnames())
            split = json.load(archive.extractfile(".qrun/prompts/split.json"))  # type: ignore[arg-type]
        assert ".qrun/prompts/train.jsonl" not in names
        for kind in ("chat", "humaneval", "code"):
            assert f".qrun/prompts/held_out/{kind}.jsonl" in names
            assert split["counts"][kind]["held_out_sources"] > 0


def test_the_shipped_drafter_is_what_its_card_records() -> None:
    """benchmarks/artifacts/smollm2-135m-dflash/: each file has the size and sha256 its
    README lists (a new drafter shipped without a new card fails here), the card's shape is
    the config's, and the export stays under the issue's 25 MB."""
    import hashlib
    import re

    folder = ROOT / "benchmarks" / "artifacts" / "smollm2-135m-dflash"
    card = (folder / "README.md").read_text()
    rows = re.findall(r"^\| `(\S+)` \| (\d+) \| `([0-9a-f]{64})` \|$", card, flags=re.M)
    assert {name for name, _, _ in rows} == {p.name for p in folder.iterdir()} - {"README.md"}
    for name, size, digest in rows:
        data = (folder / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (int(size), digest), name
    config = json.loads((folder / "config.json").read_text())
    shape = (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"])
    assert f"{shape[0]} draft layers, hidden {shape[1]}, MLP {shape[2]}" in card
    assert (folder / "model.safetensors").stat().st_size <= 25_000_000


def test_curves_set_runs_training_estimates_side_by_side_at_matched_steps(
    quality: ModuleType, tmp_path: Path
) -> None:
    """`bench/quality.py curves`: tau_hat averaged per window of steps for runs finished or
    not (one stopped early shows — past its end), a run folder elsewhere by DIR=NAME, each
    run over the first; a named run without metrics is a one-line error."""
    out = tmp_path / "q"
    for name, taus in {"base": [2.0, 4.0, 5.0, 7.0], "wide": [3.0, 5.0]}.items():
        (out / "runs" / name).mkdir(parents=True)
        lines = [json.dumps({"step": 10 * (i + 1), "tau_hat": t}) for i, t in enumerate(taus)]
        (out / "runs" / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    other = tmp_path / "raw" / "old-run"
    other.mkdir(parents=True)
    (other / "metrics.jsonl").write_text(json.dumps({"step": 20, "tau_hat": 6.0}) + "\n")
    bench = tmp_path / "bench"
    argv = ["curves", "--output", str(out), "--bench-dir", str(bench), "--window", "20"]
    _, config, _ = quality.parse([*argv, "--runs", "base", "wide", f"{other}=old"])
    result = quality.run("curves", config, [])
    assert result["runs"] == ["base", "wide", "old"]
    (md,) = bench.glob("quality_*_curves.md")
    rows = [line for line in md.read_text().splitlines() if line.startswith("| ")]
    assert rows[0] == "| steps | base | wide | old | wide / base | old / base |"
    assert rows[1] == "| 20 | 3.000 | 4.000 | 6.000 | 1.333 | 2.000 |"
    assert rows[2] == "| 40 | 6.000 | — | — | — | — |"
    assert next(bench.glob("quality_*_curves.png")).read_bytes()[:4] == b"\x89PNG"
    _, config, _ = quality.parse(argv)
    assert quality.run("curves", config, [])["runs"] == ["base", "wide"]  # every run of OUT
    _, config, _ = quality.parse([*argv, "--runs", "gone"])
    with pytest.raises(FileNotFoundError, match="no metrics for run 'gone'"):
        quality.run("curves", config, [])


def test_a_pruned_start_is_made_once_and_trained_from(
    quality: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--prune-from RUN: RUN's export pruned (calibrated on the first training prompt of each
    source per kind) into OUT/runs/<run>.init, which the run config starts from at the
    pruned width; the same call again reuses it; a run without an export is a one-line
    error naming the command that makes it."""
    out = tmp_path / "q"
    argv = ["train", "--output", str(out), "--target", "/models/smol", "--run", "narrow"]
    argv += ["--prune-from", "wide", "--prune-width", "8", "--prune-mix", "chat=1,code=2"]
    _, config, overrides = quality.parse(argv)
    pipeline = quality.Pipeline(config, overrides, argv)
    with pytest.raises(ValueError, match=r"--prune-from wide: no export at .*all --run wide"):
        pipeline.prune()
    (out / "runs" / "wide" / "export").mkdir(parents=True)
    (out / "runs" / "wide" / "export" / "model.safetensors").write_bytes(b"weights")
    (out / "prompts").mkdir()
    records = [
        {"id": "c1", "kind": "chat", "source": "a"},
        {"id": "c2", "kind": "chat", "source": "a"},
        {"id": "x1", "kind": "code", "source": "f"},
        {"id": "x2", "kind": "code", "source": "g"},
    ]
    (out / "prompts" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    calls = []

    def fake_prune(source: str, width: int, output: str, **kwargs: object) -> dict:
        calls.append((source, width, output, kwargs))
        Path(output).mkdir(parents=True, exist_ok=True)
        return {"bytes": 1}

    prune_mlp = bench_modules("prune_mlp")["prune_mlp"]  # what quality.py imports at run time
    monkeypatch.setattr(prune_mlp, "prune_export", fake_prune)
    pipeline.prune()
    pipeline.prune()  # the marker matches: not again
    marker = json.loads((out / "stages" / "prune-narrow.json").read_text())
    assert marker["source_run"] == "wide"  # the report adds its training time to the run's
    ((source, width, output, kwargs),) = calls
    assert (source, width, output) == (
        str(out / "runs/wide/export"),
        8,
        str(out / "runs/narrow.init"),
    )
    calibration = Path(str(kwargs["calibration"]))
    assert [json.loads(line)["id"] for line in calibration.open()] == ["c1", "x1", "x2"]
    assert kwargs["limit"] == 3 and kwargs["target"] == "/models/smol"
    run = pipeline.run_config()
    assert run.drafter.init_from == str(out / "runs/narrow.init")
    assert run.drafter.intermediate_size == 8
    (out / "runs" / "wide" / "export" / "model.safetensors").write_bytes(b"retrained")
    pipeline.prune()  # another export to start from: pruned again
    assert len(calls) == 2
    # a resume (the run has a checkpoint) needs neither the source export nor the start
    checkpoint = out / "runs" / "narrow" / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    monkeypatch.setattr(quality, "complete_checkpoints", lambda url: [(2, str(checkpoint))])
    shutil.rmtree(out / "runs" / "wide")
    pipeline.prune()
    assert len(calls) == 2


def test_the_readmes_quality_lines_parse_and_the_shipped_recipe_is_the_first(
    quality: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every `python bench/quality.py` line of the README is a valid command; the first is the
    shipped drafter (the preset, nothing set); the two lines of the drafter shipped before it
    train `ref6` at 512 anchors and MLP 1,536 and start `p704ft2` from it pruned to 704 (the
    slow smoke test runs a pruned start for real); the `pairs` line runs on the committed
    records."""
    readme = (ROOT / "README.md").read_text()
    lines = [
        line.split("#")[0].split()[2:]
        for line in readme.splitlines()
        if line.startswith("python bench/quality.py ")
    ]
    assert len(lines) >= 7
    assert lines[0] == ["all"]
    parsed = {}
    for argv in lines:
        stage, config, overrides = quality.parse(argv)
        parsed.setdefault(config.run, (stage, config, overrides))
    stage, shipped, overrides = parsed["reference"]
    assert stage == "all" and shipped.prune_from is None and overrides == []
    stage, ref6, overrides = parsed["ref6"]
    assert stage == "all" and ref6.prune_from is None
    assert overrides == ["loss.anchors=512", "drafter.intermediate_size=1536"]
    stage, pruned, overrides = parsed["p704ft2"]
    assert stage == "all" and (pruned.prune_from, pruned.prune_width) == ("ref6", 704)
    assert pruned.prune_mix == "chat=6,humaneval=6,code=12"
    assert overrides == ["optim.epochs=2", "eval.every=0"]
    # the pairs line reads committed records: it runs here and gives the s29 record's ratios
    (argv,) = [argv for argv in lines if argv[0] == "pairs"]
    stage, config, _ = quality.parse(argv)
    config = dataclasses.replace(config, bench_dir=str(tmp_path))
    monkeypatch.chdir(ROOT)  # its paths are the repo's
    assert quality.run(stage, config, [])["runs"] == ["peer", "recipe"]
    md = next(tmp_path.glob("quality_*_pairs.md")).read_text()
    assert "| recipe | 6.869 (2) | 0.953 [0.92-0.98] | 2.922 (2) | 0.960 [0.93-0.99] |" in md
    assert "| recipe | 1.585 (2) | 1.092 [1.06-1.12] |" in md  # T = 1
    loops = md.split("Over the text before")[1].split("At T = 1")[0]
    assert "| recipe | 2.504 (2) | 0.986 [0.96-1.03] |" in loops  # before the loops, pooled
    assert "| 3.573 (2) | 0.956 [0.94-0.97] |" in loops


def test_the_defaults_make_the_shipped_drafters_data(quality: ModuleType, tmp_path: Path) -> None:
    """`bench/quality.py all` with no option builds the prompts and answers the shipped
    drafter was trained on: the build-prompts settings equal the marker committed with its
    data (benchmarks/data/smollm2_reference_20261202), the generate and prepare settings the
    markers of its run (s24), and the run `all` trains is that run's config (MLP 704, A =
    2,048, 6 epochs, the target 10 rows ahead) but for the in-training evals it had off."""
    import tarfile

    from flashdraft import config as cfg
    from flashdraft.train.config import as_recorded_now
    from flashdraft.train.presets import smollm2_135m

    _, config, overrides = quality.parse(["all", "--output", str(tmp_path), "--target", "t"])
    pipeline = quality.Pipeline(config, overrides, [])
    qrun = ROOT / "benchmarks/data/smollm2_reference_20261202/qrun.tar.xz"
    with tarfile.open(qrun) as tar:
        member = tar.extractfile(".qrun/stages/build-prompts.json")
        assert member is not None
        built = json.load(member)
    settings = {k: v for k, v in cfg.to_dict(pipeline.sources_config()).items() if k != "output"}
    assert settings == built["settings"]
    raw = ROOT / "benchmarks/raw/quality_20261204_s24"
    generated = json.loads((raw / "stages/generate-greedy.json").read_text())["settings"]
    [(name, sampling, seed)] = pipeline.passes()
    assert name == "greedy"
    assert {"prompts": config.prompts, "sampling": cfg.to_dict(sampling), "seed": seed} == generated
    # prepare: every default pass, the default turns and loops, as the marker the run used
    assert pipeline.prepare_marker == "prepare" and config.turns == "all"
    prepared = json.loads((raw / "stages/prepare.json").read_text())["settings"]
    assert set(prepared) == {name for name, _, _ in pipeline.passes()}
    # train: what `all` trains here is what the run trained, but for the device, the paths,
    # and the in-training evals it had off (eval.every=0)
    # (as this version reads it: keys added since the run, e.g. loss.argmax_mix, at their
    # defaults, which are the behaviour before them)
    run = as_recorded_now(json.loads((raw / "runs/i704a2k6.run.json").read_text()))
    here = cfg.to_dict(pipeline.run_config())
    for section in ("drafter", "loss", "optim", "checkpoint", "seed", "compile"):
        assert here[section] == run[section], section
    for section, keys in (("target", ("forward_rows", "dtype", "compile", "compile_scope")),
                          ("data", ("row_tokens", "overlong", "shuffle", "prefetch"))):  # fmt: skip
        for key in keys:
            assert here[section][key] == run[section][key], (section, key)
    assert here["target"]["forward_rows"] == 10 and here["drafter"]["intermediate_size"] == 704
    assert (here["eval"]["every"], run["eval"]["every"]) == (5000, 0)
    assert cfg.to_dict(smollm2_135m())["optim"] == run["optim"]
