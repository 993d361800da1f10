"""experiments/quality.py and its stages (experiments/quality_pipeline.py, the eval stage in
experiments/quality_eval.py): the command line, the stages' own files and markers, the
defaults against the shipped run's recorded settings, and (slow) the whole pipeline in its CPU
smoke size."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from helpers import script_modules

from flashdraft.export.dflash import load_dflash

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stages(quality: ModuleType) -> ModuleType:
    """experiments/quality_pipeline.py: the stages `quality.py` runs."""
    return sys.modules["quality_pipeline"]


@pytest.fixture(scope="module")
def evals(quality: ModuleType) -> ModuleType:
    """experiments/quality_eval.py: the eval stage `Pipeline.eval` runs."""
    return sys.modules["quality_eval"]


def test_prompt_subsets_carry_their_pass_in_the_id(stages: ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "train.jsonl"
    records = [{"id": f"p{i}", "messages": [{"role": "user", "content": str(i)}]} for i in range(5)]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    stages.write_prompt_subset(source, tmp_path / "s.jsonl", 3, "~sample1")
    subset = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["id"] for r in subset] == ["p0~sample1", "p1~sample1", "p2~sample1"]
    chat, code = tmp_path / "chat.jsonl", tmp_path / "code.jsonl"
    chat.write_text("c1\nc2\nc3\n")
    code.write_text("h1\nh2\n")
    stages.write_mixed_eval(chat, code, tmp_path / "mixed.jsonl")
    assert (tmp_path / "mixed.jsonl").read_text() == "c1\nh1\nc2\nh2\n"


def test_smoke_sizes_and_repeated_overrides(quality: ModuleType) -> None:
    stage, config, overrides = quality.parse(
        ["train", "--smoke", "--run", "layers3", "--set", "drafter.num_layers=3", "--set", "seed=1"]
    )  # an ablation line (docs/reference-recipe.md), smoke-sized
    assert (stage, config.run, config.device, config.steps) == ("train", "layers3", "cpu", 6)
    assert overrides == ["drafter.num_layers=3", "seed=1"]
    with pytest.raises(SystemExit):
        quality.parse(["nope"])


@pytest.mark.slow
def test_the_whole_pipeline_runs_in_its_smoke_size(tmp_path: Path) -> None:
    """build-prompts -> generate -> prepare -> train -> eval -> report on the real SmolLM2
    target, tiny sizes, on the CPU, as on the two-GPU machine (--gpus 2: the greedy and
    sampled passes in two processes, training under torchrun on two ranks); a second call
    finds every stage done."""
    out = tmp_path / "q"
    command = [
        sys.executable,
        str(ROOT / "experiments" / "quality.py"),
        "all",
        "--smoke",
        "--gpus",
        "2",
    ]
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


def test_every_stage_says_its_time_even_with_nothing_to_do(
    quality: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`== STAGE: N s` after each stage, done or skipped: where a device call's start-up
    goes (s35: 143 s before the first step, 6 s of them compiling)."""

    class Stages:  # a pipeline whose stages take known times on a clock of its own
        device, out, clock = "cuda", "unused", 100.0

        def build_prompts(self) -> None:
            self.clock += 2.0

        def generate(self) -> bool:
            return True  # nothing to do: 0 s

        def prepare(self) -> None:
            self.clock += 30.0

    pipeline = Stages()
    monkeypatch.setattr(quality, "Pipeline", lambda config, overrides: pipeline)
    monkeypatch.setattr(quality, "STAGES", ("build-prompts", "generate", "prepare"))
    monkeypatch.setattr(quality, "collect", lambda out, run: {"evals": {}, "sampled": {}})
    monkeypatch.setattr(quality, "time", SimpleNamespace(perf_counter=lambda: pipeline.clock))
    _, config, _ = quality.parse(["all", "--output", "unused"])
    assert quality.run("all", config, [])["complete"] is True
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("== ")]
    assert [line for line in lines if ": " in line] == [
        "== build-prompts: 2.0 s",
        "== generate: 0.0 s",
        "== prepare: 30.0 s",
    ]


def test_prepare_trains_the_turns_asked_for(
    quality: ModuleType, stages: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--turns last` reaches `prepare` (only the regenerated assistant turn is trained) and
    its marker, so a change prepares the data again; the default leaves older markers valid."""
    seen = []

    class Prepared:
        ok, manifest = True, {"counts": {}}

    monkeypatch.setattr(stages, "prepare", lambda config: seen.append(config) or Prepared())
    for turns in ("all", "last"):
        argv = ["prepare", "--output", str(tmp_path), "--target", "t", "--turns", turns]
        _, config, overrides = quality.parse(argv)
        pipeline = stages.Pipeline(config, overrides, argv)
        for name, _, _ in pipeline.passes():
            pipeline.save_marker(f"generate-{name}", {}, complete=True)
        pipeline.prepare()
        assert seen[-1].template.turns == turns
        settings = json.loads((tmp_path / "stages" / "prepare.json").read_text())["settings"]
        assert settings.get("turns", "all") == turns
    assert len(seen) == 2


def test_prepare_refuses_answers_not_all_generated(
    quality: ModuleType, stages: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generate stage stopped by its deadline leaves part of the answers: `prepare` run on
    its own then refuses, instead of preparing the part as the whole data."""
    monkeypatch.setattr(stages, "prepare", lambda config: pytest.fail("prepared"))
    argv = ["prepare", "--output", str(tmp_path), "--target", "t"]
    _, config, overrides = quality.parse(argv)
    pipeline = stages.Pipeline(config, overrides, argv)
    names = [name for name, _, _ in pipeline.passes()]
    with pytest.raises(RuntimeError, match="not all generated"):
        pipeline.prepare()  # nothing generated
    for name in names:
        pipeline.save_marker(f"generate-{name}", {}, complete=True)
    pipeline.save_marker(f"generate-{names[-1]}", {}, complete=False)
    with pytest.raises(RuntimeError, match=f"answers of {names[-1]} are not all generated"):
        pipeline.prepare()


def test_a_pruned_start_is_made_once_and_trained_from(
    quality: ModuleType, stages: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--prune-from RUN: RUN's export pruned (calibrated on the first training prompt of each
    source per kind) into OUT/runs/<run>.init, which the run config starts from at the
    pruned width; the same call again reuses it; a run without an export is a one-line
    error naming the command that makes it."""
    out = tmp_path / "q"
    argv = ["train", "--output", str(out), "--target", "/models/smol", "--run", "narrow"]
    argv += ["--prune-from", "wide", "--prune-width", "8", "--prune-mix", "chat=1,code=2"]
    _, config, overrides = quality.parse(argv)
    pipeline = stages.Pipeline(config, overrides, argv)
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

    prune_mlp = script_modules("experiments", "prune_mlp")[
        "prune_mlp"
    ]  # what quality.py imports at run time
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
    monkeypatch.setattr(stages, "complete_checkpoints", lambda url: [(2, str(checkpoint))])
    shutil.rmtree(out / "runs" / "wide")
    pipeline.prune()
    assert len(calls) == 2


def test_the_defaults_make_the_shipped_drafters_data(
    quality: ModuleType, stages: ModuleType, tmp_path: Path
) -> None:
    """`experiments/quality.py all` with no option builds the prompts and answers the shipped
    drafter was trained on: the build-prompts, generate and prepare settings equal the
    markers of its run (kept in benchmarks/raw/), and the run `all` trains is that run's config (7 x 352
    with the taps pinned, A = 2,048, D-PACE with half-argmax soft labels, 6 epochs, the
    target 10 rows ahead) but for the in-training evals it had off."""
    from flashdraft import config as cfg
    from flashdraft.train.config import as_recorded_now
    from flashdraft.train.presets import smollm2_135m

    _, config, overrides = quality.parse(["all", "--output", str(tmp_path), "--target", "t"])
    pipeline = stages.Pipeline(config, overrides, [])
    raw = ROOT / "benchmarks/raw/quality_20261206_s45"
    built = json.loads((raw / "calls/stages/build-prompts.json").read_text())
    settings = {k: v for k, v in cfg.to_dict(pipeline.sources_config()).items() if k != "output"}
    assert settings == built["settings"]
    generated = json.loads((raw / "calls/stages/generate-greedy.json").read_text())["settings"]
    [(name, sampling, seed)] = pipeline.passes()
    assert name == "greedy"
    assert {"prompts": config.prompts, "sampling": cfg.to_dict(sampling), "seed": seed} == generated
    # prepare: every default pass, the default turns and loops, as the marker the run used
    assert pipeline.prepare_marker == "prepare" and config.turns == "all"
    prepared = json.loads((raw / "calls/stages/prepare.json").read_text())["settings"]
    assert set(prepared) == {name for name, _, _ in pipeline.passes()}
    # train: what `all` trains here is what the run trained, but for the device, the paths,
    # and the in-training evals it had off (eval.every=0)
    # (as this version reads it: keys added since the run, e.g. loss.argmax_mix, at their
    # defaults, which are the behaviour before them)
    run = as_recorded_now(json.loads((raw / "runs/l7x6/run.json").read_text()))
    here = cfg.to_dict(pipeline.run_config())
    # (loss.gamma is the decay weighting's, unused under D-PACE: the preset leaves it unset)
    assert run["loss"]["gamma"] is None and here["loss"]["gamma"] is None
    for section in ("drafter", "loss", "optim", "checkpoint", "seed", "compile"):
        assert here[section] == run[section], section
    for section, keys in (("target", ("forward_rows", "dtype", "compile", "compile_scope")),
                          ("data", ("row_tokens", "overlong", "shuffle", "prefetch"))):  # fmt: skip
        for key in keys:
            assert here[section][key] == run[section][key], (section, key)
    assert here["target"]["forward_rows"] == 10 and here["drafter"]["intermediate_size"] == 352
    assert (here["eval"]["every"], run["eval"]["every"]) == (5000, 0)
    assert (here["loss"]["weighting"], here["loss"]["argmax_mix"]) == ("dpace", 0.5)
    preset = cfg.to_dict(smollm2_135m())
    assert preset["optim"] == run["optim"] and preset["loss"] == run["loss"]
    assert preset["drafter"] == run["drafter"]


def test_an_eval_pass_starts_when_half_again_the_longest_pass_fits(
    quality: ModuleType,
    stages: ModuleType,
    evals: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under --deadline an eval pass starts when what it may need is left: 120 s before the
    target is loaded (the load and the first compiled graphs), then half again the longest
    pass of this process (at least 30 s). s31 lost mined Python to a fixed 120 s with 88 s
    left after HumanEval's ~25 s pass. A call stopped there resumes at the next pass."""
    clock = [0.0]
    clocked = SimpleNamespace(monotonic=lambda: clock[0])
    monkeypatch.setattr(stages, "time", clocked)  # the deadline: `Pipeline.remaining`
    monkeypatch.setattr(evals, "time", clocked)  # each pass's own seconds
    seconds = {"chat": 50.0, "humaneval": 25.0, "code": 25.0, "chat_t1": 20.0}
    ran: list[str] = []

    def load_target(config: object) -> tuple[str, str]:
        clock[0] += 40.0
        return "model", "tokenizer"

    def run_eval(config: Any, model: object, tokenizer: object, drafter: object) -> dict:
        name = Path(config.output).stem
        ran.append(name)
        clock[0] += seconds[name]
        return {"tau": 2.0, "num_prompts": 24}

    def write_report(report: dict, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report))

    monkeypatch.setattr(evals, "load_eval_target", load_target)
    monkeypatch.setattr(evals, "run_eval", run_eval)
    monkeypatch.setattr(evals, "load_drafter", lambda path: None)
    monkeypatch.setattr(evals, "add_sources", lambda report, prompts: None)
    monkeypatch.setattr(evals, "write_report", write_report)
    monkeypatch.setattr(evals, "held_out_subset", lambda pipeline, kind: tmp_path / f"{kind}.jsonl")

    def pipeline(deadline: float) -> object:
        argv = ["eval", "--output", str(tmp_path / "q"), "--target", "t", "--run", "r"]
        _, config, overrides = quality.parse([*argv, "--deadline", str(deadline)])
        config = dataclasses.replace(
            config,
            eval_kinds=["chat", "humaneval", "code"],
            eval_sampled_kinds=["chat"],
            eval_trained_kinds=[],
            zlab_parity=False,
        )
        return stages.Pipeline(config, overrides, argv)

    # loaded at 40 s; chat to 90 (110 left, 75 asked), HumanEval to 115 (85 left, 75 asked),
    # mined Python to 140; 60 left < 75: the T = 1 pass waits for the next call
    assert pipeline(200.0).eval() is False
    assert ran == ["chat", "humaneval", "code"]
    assert evals.eval_seconds(False, 0.0) == 120.0 and evals.eval_seconds(True, 10.0) == 30.0
    clock[0] = 0.0
    assert pipeline(100.0).eval() is False  # a fresh process: 120 s before the load
    assert ran == ["chat", "humaneval", "code"]
    clock[0] = 0.0
    assert pipeline(130.0).eval() is True
    assert ran == ["chat", "humaneval", "code", "chat_t1"]
