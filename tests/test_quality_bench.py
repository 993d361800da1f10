"""bench/quality.py and its stages (bench/quality_pipeline.py, the eval stage in
bench/quality_eval.py): the command line and the README's lines, the stages' own files and
markers, the committed data and drafter, and (slow) the whole pipeline in its CPU smoke size."""

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
from helpers import bench_modules

from flashdraft.export.dflash import load_dflash

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stages(quality: ModuleType) -> ModuleType:
    """bench/quality_pipeline.py: the stages `quality.py` runs."""
    return sys.modules["quality_pipeline"]


@pytest.fixture(scope="module")
def evals(quality: ModuleType) -> ModuleType:
    """bench/quality_eval.py: the eval stage `Pipeline.eval` runs."""
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
    )  # the README's ablation line, smoke-sized
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
    monkeypatch.setattr(stages, "complete_checkpoints", lambda url: [(2, str(checkpoint))])
    shutil.rmtree(out / "runs" / "wide")
    pipeline.prune()
    assert len(calls) == 2


def test_the_readmes_quality_lines_parse_and_the_shipped_recipe_is_the_first(
    quality: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every `python bench/quality.py` line of the README is a valid command; the first is the
    shipped drafter (the preset, nothing set); `i704a2k6`, shipped s24-s35, is the preset
    with the loss of before s36 at the shape of before s45 (5 x 704); the two lines of the
    one before that train `ref6` at 512 anchors and MLP 1,536 and start `p704ft2` from it
    pruned to 704 (the slow smoke test runs a pruned start for real); the `pairs` lines run
    on the committed records."""
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
    stage, before, overrides = parsed["i704a2k6"]
    assert stage == "all" and before.prune_from is None
    assert overrides == [
        "loss.weighting=decay",
        "loss.argmax_mix=0",
        "eval.every=0",
        "drafter.num_layers=5",  # the preset's shape before s45
        "drafter.intermediate_size=704",
    ]
    stage, ref6, overrides = parsed["ref6"]
    assert stage == "all" and ref6.prune_from is None
    assert overrides == [
        "loss.anchors=512",
        "drafter.intermediate_size=1536",
        "drafter.num_layers=5",
    ]
    stage, pruned, overrides = parsed["p704ft2"]
    assert stage == "all" and (pruned.prune_from, pruned.prune_width) == ("ref6", 704)
    assert pruned.prune_mix == "chat=6,humaneval=6,code=12"
    assert overrides == ["optim.epochs=2", "eval.every=0", "drafter.num_layers=5"]
    stage, deeper, overrides = parsed["l7m352"]  # s44: 7 layers, the preset's five taps pinned
    assert stage == "all" and deeper.prune_from is None
    assert overrides == [
        "optim.epochs=2",
        "drafter.num_layers=7",
        "drafter.intermediate_size=352",
        "drafter.target_layer_ids=[1,8,14,20,27]",
        "eval.every=0",
    ]
    # the pairs lines read committed records: each runs here and gives its record's ratios,
    # s29's (the peer given flashdraft's anchors), s34's (the peer at its own 512, two
    # seeds, with s33's preset rows, s34's `dpm` and s35's `dps`), s38's, s39's, s40's, s41's,
    # s42's, s43's two, s44's, s45's two, s50's three and s36's
    pairs_lines = [argv for argv in lines if argv[0] == "pairs"]
    s29, s34, s38, s39, s40, s41, s42, s43, s43p, s44, s45, s45p, s50, s50p, s50s, s36 = pairs_lines
    monkeypatch.chdir(ROOT)  # their paths are the repo's

    def pairs(argv: list[str], name: str) -> tuple[list[str], str]:
        """One README `pairs` line run into its own folder: its recipes and its report."""
        stage, config, _ = quality.parse(argv)
        config = dataclasses.replace(config, bench_dir=str(tmp_path / name))
        runs = quality.run(stage, config, [])["runs"]
        return runs, next((tmp_path / name).glob("quality_*_pairs.md")).read_text()

    runs, md = pairs(s34, "s34")
    assert runs == ["peer", "recipe", "dpm", "dps", "peer2048"]
    assert (
        "| recipe | 6.869 (2) | 0.996 [0.97-1.02] | 2.922 (2) | 1.069 [1.04-1.10] "
        "| 3.682 (2) | 1.053 [1.03-1.08] |"
    ) in md
    assert (
        "| dpm | 7.159 (2) | 1.038 [1.01-1.06] | 3.040 (2) | 1.112 [1.09-1.13] "
        "| 3.874 (2) | 1.108 [1.09-1.13] |"
    ) in md
    assert (
        "| dps | 6.883 (2) | 0.998 [0.97-1.02] | 2.990 (2) | 1.094 [1.08-1.11] "
        "| 3.834 (2) | 1.097 [1.07-1.12] |"
    ) in md
    assert "| peer2048 | 7.205 (2) | 1.045 [1.02-1.07] | 3.044 (2) | 1.114 [1.09-1.14] |" in md
    loops = md.split("Over the text before")[1].split("At T = 1")[0]
    assert "| recipe | 2.504 (2) | 1.051 [1.02-1.09] |" in loops
    assert "| dpm | 2.537 (2) | 1.065 [1.03-1.10] |" in loops
    assert "| dps | 2.430 (2) | 1.020 [0.98-1.06] |" in loops  # below the preset's 2.504
    assert "| recipe | 1.585 (2) | 1.097 [1.07-1.13] |" in md  # T = 1
    assert "| dpm | 1.554 (2) | 1.076 [1.06-1.10] |" in md
    assert "| dps | 1.585 (2) | 1.097 [1.06-1.14] |" in md  # the preset's T = 1, not `dpm`'s
    by_run = md.split("Run by run:")[1]
    assert "| recipe | 0.977-1.015 (4) | 1.048-1.091 (4) | 1.046-1.061 (2) |" in by_run
    assert "| dpm | 1.014-1.062 (4) | 1.084-1.141 (4) | 1.106-1.111 (2) |" in by_run
    chat_positions = md.split("chat, T = 0, per draft position")[1].split("\n\n")[1]
    assert "| recipe | from the loop on | 725 | 11.288 | 0.92 |" in chat_positions
    assert "| 0.58 | 0.57 | 0.55 |\n| dpm |" in chat_positions  # the preset: 0.55 at 15
    assert "| dpm | from the loop on | 676 | 12.108 | 0.93 |" in chat_positions
    assert "| 0.68 | 0.67 | 0.65 |\n| dps |" in chat_positions  # `dpm`: 0.65 at 15
    assert "| 0.64 | 0.63 | 0.61 |\n| peer2048 |" in chat_positions  # `dps`: 0.61 at 15
    assert "| peer | from the loop on | 682 | 12.001 |" in chat_positions
    # inside established loops: the preset copies the whole block in 0.81 of the steps, and
    # never in the loop of period 23 that `dpm` and the peer mostly copy
    copying = md.split("chat, T = 0, inside established loops")[1].split("\n\n")[1]
    assert "| recipe | 489 | 0.81 | 170/171 | 171/196 | 53/122 | chitchat/1f6e4e15" in copying
    assert "(23): 0/54 |" in copying and "| dpm | 451 | 0.95 |" in copying
    assert "| dps | 459 | 0.91 | 169/172 | 175/187 | 73/100 |" in copying
    assert "| peer | 454 | 0.94 |" in copying and "| peer2048 | 446 | 0.98 |" in copying
    # s38's: the argmax shares 0.75 (`dpa75`, H200), 0.25 (`dpq`, H200, s37) and 0 (`dps`)
    # over the shipped 0.5 (`dpm`): chat at T = 0 flattens above 0.5, T = 1 falls with the share
    runs, md = pairs(s38, "s38")
    assert runs == ["peer", "dpa75", "dpq", "dps"]
    assert (
        "| dpa75 | 7.195 (2) | 1.005 [0.99-1.02] | 3.084 (2) | 1.014 [1.00-1.03] "
        "| 3.904 (2) | 1.008 [0.99-1.02] |"
    ) in md
    assert (
        "| dpq | 7.058 (2) | 0.986 [0.97-1.00] | 3.016 (2) | 0.992 [0.98-1.01] "
        "| 3.820 (2) | 0.986 [0.97-1.00] |"
    ) in md
    assert "| dps | 6.883 (2) | 0.962 [0.94-0.99] | 2.990 (2) | 0.984 [0.97-1.00] |" in md
    assert "| dpa75 | 1.509 (2) | 0.971 [0.94-1.01] |" in md  # T = 1
    assert "| dpq | 1.581 (2) | 1.017 [0.98-1.05] |" in md
    assert "| dpa75 | 0.984-1.026 (4) | 0.990-1.040 (4) | 1.002-1.013 (4) |" in md
    assert "| dpq | 0.971-1.001 (4) | 0.971-1.014 (4) | 0.984-0.988 (4) |" in md
    assert "| dpa75 | 0.967-0.974 (4) |" in md.split("Run by run at T = 1")[1]
    # s39's: Muon at lr 2e-3 (`dpl2`, one seed, H200) over the shipped 1e-3 (`dpm`, two
    # seeds): up at T = 0 (HumanEval's interval excludes 1), down at T = 1 (a point estimate)
    runs, md = pairs(s39, "s39")
    assert runs == ["peer", "dpl2"]
    assert (
        "| dpl2 | 7.348 (1) | 1.026 [0.99-1.06] | 3.202 (1) | 1.053 [1.03-1.08] "
        "| 4.008 (1) | 1.034 [1.00-1.06] |"
    ) in md
    assert "| dpl2 | 2.599 (1) | 1.024 [0.95-1.08] |" in md  # before chat's loops
    assert "| dpl2 | 1.521 (1) | 0.978 [0.95-1.01] |" in md  # T = 1
    assert "| dpl2 | 1.016-1.037 (2) | 1.036-1.071 (2) | 1.032-1.036 (2) |" in md
    assert "| dpl2 | 0.975-0.982 (2) |" in md.split("Run by run at T = 1")[1]
    # s40's: the shipped `dpm6` over the peer's recipe at the same 13,878 steps (`peer6`,
    # both on an H100): ahead by more than 5% on code and at T = 1, not on chat
    runs, md = pairs(s40, "s40")
    assert runs == ["peer", "dpm6"]
    assert (
        "| dpm6 | 8.069 (1) | 1.031 [1.01-1.05] | 3.978 (1) | 1.124 [1.09-1.16] "
        "| 4.960 (1) | 1.102 [1.07-1.13] |"
    ) in md
    assert "| peer | 7.830 (1) | — | 3.539 (1) | — | 4.499 (1) | — |" in md
    assert "| dpm6 | 3.023 (1) | 1.037 [1.01-1.08] |" in md  # before chat's loops
    assert "| dpm6 | 1.624 (1) | 1.126 [1.09-1.16] |" in md  # T = 1
    copying = md.split("chat, T = 0, inside established loops")[1].split("\n\n")[1]
    assert "| peer | 220 | 0.99 |" in copying and "| dpm6 | 216 | 1.00 |" in copying
    # s41's: Muon at lr 2e-3 for 6 epochs (`dpl6`) beside the shipped `dpm6`, both over
    # `peer6`: ahead on code and T = 1, chat under `dpm6`'s 1.031
    runs, md = pairs(s41, "s41")
    assert runs == ["peer", "dpl6", "dpm6"]
    assert (
        "| dpl6 | 7.967 (1) | 1.017 [1.00-1.04] | 4.012 (1) | 1.134 [1.09-1.18] "
        "| 5.071 (1) | 1.127 [1.10-1.16] |"
    ) in md
    assert "| dpm6 | 8.069 (1) | 1.031 [1.01-1.05] |" in md
    assert "| dpl6 | 2.977 (1) | 1.022 [0.99-1.05] |" in md  # before chat's loops
    assert "| dpl6 | 1.639 (1) | 1.136 [1.08-1.19] |" in md  # T = 1
    # s42's: the preset's second seed (`dpm61`) beside `dpm6` and both pooled, over `peer6`:
    # chat level with the peer's one seed, code and T = 1 ahead by 10-12% pooled
    runs, md = pairs(s42, "s42")
    assert runs == ["peer", "dpm6", "dpm61", "dpm_both"]
    assert (
        "| dpm61 | 7.805 (1) | 0.997 [0.98-1.01] | 3.950 (1) | 1.116 [1.09-1.15] "
        "| 4.912 (1) | 1.092 [1.06-1.12] |"
    ) in md
    assert (
        "| dpm_both | 7.935 (2) | 1.013 [1.00-1.03] | 3.964 (2) | 1.120 [1.09-1.15] "
        "| 4.936 (2) | 1.097 [1.07-1.12] |"
    ) in md
    assert "| dpm_both | 2.981 (2) | 1.023 [1.00-1.05] |" in md  # before chat's loops
    assert "| dpm61 | 1.608 (1) | 1.115 [1.07-1.16] |" in md  # T = 1
    assert "| dpm_both | 1.615 (2) | 1.120 [1.08-1.15] |" in md
    # s43's: two seeds a side, the preset's alone and pooled over the peer's two pooled; chat
    # over 1 but under 1.05, code and T = 1 over 1.05; and the peer's seed 1 over its seed 42
    runs, md = pairs(s43, "s43")
    assert runs == ["peer", "dpm6", "dpm61", "dpm"]
    assert "| peer | 7.775 (2) | — | 3.529 (2) | — | 4.494 (2) | — |" in md
    assert (
        "| dpm | 7.935 (2) | 1.021 [1.01-1.03] | 3.964 (2) | 1.123 [1.09-1.15] "
        "| 4.936 (2) | 1.098 [1.08-1.12] |"
    ) in md
    assert "| dpm | 2.981 (2) | 1.041 [1.02-1.06] |" in md  # before chat's loops
    assert "| dpm | 1.615 (2) | 1.122 [1.09-1.15] |" in md  # T = 1
    assert "| dpm6 | 8.069 (1) | 1.038 [1.02-1.05] |" in md
    assert "| dpm61 | 7.805 (1) | 1.004 [0.99-1.02] |" in md
    by_run = md.split("Run by run:")[1]
    assert "| dpm | 0.997-1.045 (4) | 1.116-1.130 (4) | 1.092-1.105 (4) |" in by_run
    copying = md.split("chat, T = 0, inside established loops")[1].split("\n\n")[1]
    assert "| peer | 438 | 0.99 | 169/169 | 180/183 | 86/86 |" in copying
    assert "| dpm | 439 | 0.99 | 170/170 | 179/183 | 86/86 |" in copying
    runs, md = pairs(s43p, "s43p")
    assert runs == ["peer", "peer61"]
    assert (
        "| peer61 | 7.721 (1) | 0.986 [0.97-1.01] | 3.520 (1) | 0.995 [0.98-1.02] "
        "| 4.490 (1) | 0.998 [0.98-1.02] |"
    ) in md
    assert "| peer61 | 2.813 (1) | 0.965 [0.93-1.01] |" in md  # before chat's loops
    assert "| peer61 | 1.436 (1) | 0.995 [0.96-1.03] |" in md  # T = 1
    # s44's: depth for width at the same bytes (2 epochs, one seed a shape): 7 x 352 and 6 x
    # 512 over the peer (its 5 x 704) beside the preset's 5 x 704: chat 1.075 and 1.054
    runs, md = pairs(s44, "s44")
    assert runs == ["peer", "l7m352", "l6m512", "dpm"]
    assert (
        "| l7m352 | 7.413 (1) | 1.075 [1.02-1.13] | 3.275 (1) | 1.198 [1.15-1.24] "
        "| 4.097 (1) | 1.172 [1.13-1.21] |"
    ) in md
    assert (
        "| l6m512 | 7.273 (1) | 1.054 [1.03-1.08] | 3.100 (1) | 1.134 [1.11-1.16] "
        "| 3.984 (1) | 1.140 [1.11-1.17] |"
    ) in md
    assert "| dpm | 7.159 (2) | 1.038 [1.01-1.06] |" in md
    assert "| l7m352 | 2.708 (1) | 1.137 [1.03-1.21] |" in md  # before chat's loops
    assert "| l7m352 | 1.557 (1) | 1.078 [1.05-1.11] |" in md  # T = 1
    # s45's: the shipped 7 x 352 at 6 epochs (`l7x6`) over the 5 x 704 shipped before it
    # (two seeds), over every T = 0 kind, under at T = 1; and over the peer at the same
    # steps, chat 1.051 (the 1.05) where the 5 x 704 gave 1.021
    runs, md = pairs(s45, "s45")
    assert runs == ["peer", "l7x6"]
    assert (
        "| l7x6 | 8.175 (1) | 1.030 [1.00-1.06] | 4.180 (1) | 1.054 [1.03-1.08] "
        "| 5.181 (1) | 1.050 [1.03-1.07] |"
    ) in md
    assert "| l7x6 | 1.580 (1) | 0.978 [0.94-1.01] |" in md  # T = 1
    assert "| l7x6 | 1.013-1.047 (2) | 1.051-1.058 (2) | 1.045-1.055 (2) |" in md
    runs, md = pairs(s45p, "s45p")
    assert runs == ["peer", "l7x6", "dpm"]
    assert (
        "| l7x6 | 8.175 (1) | 1.051 [1.02-1.08] | 4.180 (1) | 1.184 [1.15-1.22] "
        "| 5.181 (1) | 1.153 [1.12-1.19] |"
    ) in md
    assert "| dpm | 7.935 (2) | 1.021 [1.01-1.03] |" in md
    assert "| l7x6 | 3.108 (1) | 1.086 [1.03-1.13] |" in md  # before chat's loops
    assert "| l7x6 | 1.580 (1) | 1.098 [1.06-1.13] |" in md  # T = 1
    assert "| l7x6 | 1.044-1.059 (2) | 1.181-1.188 (2) | 1.151-1.154 (2) |" in md
    # s50's: at one shape (7 x 352, 2 epochs, one seed a side) flashdraft's recipe over the
    # peer's by >= 1.08 on every kind; the peer at 7 x 352 level with itself at 5 x 704
    runs, md = pairs(s50, "s50")
    assert runs == ["peer", "l7m352"]
    assert "| peer | 6.772 (1) | — | 2.762 (1) | — | 3.604 (1) | — |" in md
    assert (
        "| l7m352 | 7.413 (1) | 1.095 [1.04-1.15] | 3.275 (1) | 1.186 [1.15-1.22] "
        "| 4.097 (1) | 1.137 [1.09-1.18] |"
    ) in md
    assert "| l7m352 | 2.708 (1) | 1.141 [1.05-1.21] |" in md  # before chat's loops
    assert "| l7m352 | 1.557 (1) | 1.082 [1.04-1.12] |" in md  # T = 1
    copying = md.split("chat, T = 0, inside established loops")[1].split("\n\n")[1]
    assert "| peer | 237 | 0.86 |" in copying and "| l7m352 | 220 | 0.98 |" in copying
    runs, md = pairs(s50p, "s50p")
    assert runs == ["peer", "peer7x2"]
    assert (
        "| peer7x2 | 6.772 (1) | 0.982 [0.95-1.01] | 2.762 (1) | 1.010 [1.00-1.03] "
        "| 3.604 (1) | 1.031 [1.00-1.07] |"
    ) in md
    assert "| peer7x2 | 1.439 (1) | 0.996 [0.97-1.02] |" in md  # T = 1
    # s50's speed: the shipped 7 x 352 beside the 5 x 704 in one loop on one H100, two evals
    # each: tau higher at T = 0, yet slower on chat, mined Python and at T = 1
    runs, md = pairs(s50s, "s50s")
    assert runs == ["dpm6", "l7x6"]
    assert "| l7x6 | 8.188 (2) | 1.016 [" in md and "| l7x6 | 1.592 (2) | 0.980 [" in md
    speed = md.split("Decode time per output token")[1]
    assert (
        "| l7x6 | 0.3693 (5.85x) (2) | 0.952 [0.92-0.99] | 0.5915 (2.94x) (2) | 0.981 [0.95-1.01] "
        "| 0.5847 (3.73x) (2) | 0.973 [0.96-0.99] | 2.1737 (1.10x) (2) | 0.927 [0.88-0.97] |"
    ) in speed
    assert "| dpm6 | 0.3517 (6.16x) (2) | — | 0.5803 (2.99x) (2) |" in speed
    # the `curves` lines: `dpl6`'s training tau_hat over `dpm6`'s (same batches), ahead early
    # and level by step 4,000, as the s41 record says; the peer's two seeds by its eal (s43)
    curves, peer_curves = [argv for argv in lines if argv[0] == "curves"]
    stage, config, _ = quality.parse(curves)
    config = dataclasses.replace(config, bench_dir=str(tmp_path / "c41"))
    assert quality.run(stage, config, [])["runs"] == ["dpm6", "dpl6"]
    md = next((tmp_path / "c41").glob("quality_*_curves.md")).read_text()
    assert "| 1000 | 2.983 | 3.171 | 1.063 |" in md and "| 4000 | 7.077 | 7.101 | 1.003 |" in md
    assert "| 14000 | 9.241 | 9.187 | 0.994 |" in md
    stage, config, _ = quality.parse(peer_curves)
    config = dataclasses.replace(config, bench_dir=str(tmp_path / "c43"))
    assert quality.run(stage, config, [])["runs"] == ["peer6", "peer61"]
    md = next((tmp_path / "c43").glob("quality_*_curves.md")).read_text()
    assert md.startswith("# Training eal at matched steps")
    assert "| 2000 | 5.202 | 5.084 | 0.977 |" in md and "| 3000 | 6.335 | 6.124 | 0.967 |" in md
    assert "| 14000 | 8.962 | 8.902 | 0.993 |" in md
    # s36's: the shipped `dpm6` over `i704a2k6` on the CPU's 96 conversations and 96 files
    runs, md = pairs(s36, "s36")
    assert runs == ["peer", "dpm6"]
    assert "| dpm6 | 8.117 (1) | 1.014 [1.00-1.03] | 4.816 (1) | 1.094 [1.07-1.11] |" in md
    runs, md = pairs(s29, "s29")
    assert runs == ["peer", "recipe"]
    assert "| recipe | 6.869 (2) | 0.953 [0.92-0.98] | 2.922 (2) | 0.960 [0.93-0.99] |" in md
    assert "| recipe | 1.585 (2) | 1.092 [1.06-1.12] |" in md  # T = 1
    loops = md.split("Over the text before")[1].split("At T = 1")[0]
    assert "| recipe | 2.504 (2) | 0.986 [0.96-1.03] |" in loops  # before the loops, pooled
    assert "| 3.573 (2) | 0.956 [0.94-0.97] |" in loops
    by_run = md.split("Run by run:")[1]  # each run over each peer run (the seeds' spread)
    assert "| recipe | 0.928-0.979 (4) | 0.934-0.987 (4) | 0.940-0.971 (4) |" in by_run
    assert "| recipe | 1.055-1.127 (4) |" in md.split("Run by run at T = 1")[1]


def test_the_defaults_make_the_shipped_drafters_data(
    quality: ModuleType, stages: ModuleType, tmp_path: Path
) -> None:
    """`bench/quality.py all` with no option builds the prompts and answers the shipped
    drafter was trained on: the build-prompts settings equal the marker committed with its
    data (benchmarks/data/smollm2_reference_20261202), the generate and prepare settings the
    markers of its run (`l7x6`, s45), and the run `all` trains is that run's config (7 x 352
    with the taps pinned, A = 2,048, D-PACE with half-argmax soft labels, 6 epochs, the
    target 10 rows ahead) but for the in-training evals it had off."""
    import tarfile

    from flashdraft import config as cfg
    from flashdraft.train.config import as_recorded_now
    from flashdraft.train.presets import smollm2_135m

    _, config, overrides = quality.parse(["all", "--output", str(tmp_path), "--target", "t"])
    pipeline = stages.Pipeline(config, overrides, [])
    qrun = ROOT / "benchmarks/data/smollm2_reference_20261202/qrun.tar.xz"
    with tarfile.open(qrun) as tar:
        member = tar.extractfile(".qrun/stages/build-prompts.json")
        assert member is not None
        built = json.load(member)
    settings = {k: v for k, v in cfg.to_dict(pipeline.sources_config()).items() if k != "output"}
    assert settings == built["settings"]
    raw = ROOT / "benchmarks/raw/quality_20261206_s45"
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
