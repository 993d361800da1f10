"""The benchmark scripts' CPU smoke modes: the guides show `bench/trainer.py` with
`--rows-per-forward`, and the GPU sessions (dev/gpu/checks_session.sh) run its `--first-step`,
`--set` and `--profile` options and `bench/prefill_profile.py`; a broken option should fail
here, not on the device machine."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import rows_by_part, script_modules

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    return out.stdout


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_the_trainer_bench_stacks_rows_and_takes_run_config_overrides() -> None:
    stdout = run(
        "bench/trainer.py", "--smoke", "--rows-per-forward", "2", "--skip-overlap-off",
        "--set", "target.compile_scope=stack", "--target-attention", "varlen",
    )  # fmt: skip
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["target_attention"] == "varlen_documents"  # the varlen target path
    full = [r for r in result["results"] if r["what"] == "full online step"]
    assert [r["rows"] for r in full] == [2, 2]  # both row lengths, two rows per step
    assert all(r["first_step_s"] > 0 for r in full)
    assert {r["rows"] for r in result["results"] if r["what"] != "full online step"} == {2}


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_the_trainer_bench_times_the_first_steps() -> None:
    result = json.loads(run("bench/trainer.py", "--smoke", "--first-step").strip().splitlines()[-1])
    assert result["bench"] == "trainer-first-step"
    assert result["first_step_s"] >= 0 and result["second_step_s"] > 0


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_the_trainer_bench_runs_the_target_ahead() -> None:
    """`--set target.forward_rows=4`: the target's part is one forward of 4 rows, the
    drafter's one row, a full-step call the group of 4 steps (as the reference recipe's
    step runs)."""
    stdout = run(
        "bench/trainer.py", "--smoke", "--rows", "256", "--skip-overlap-off",
        "--set", "target.forward_rows=4",
    )  # fmt: skip
    result = json.loads(stdout.strip().splitlines()[-1])
    assert rows_by_part(result) == (4, 1, 4, 4)  # target, drafter, full, back to back
    result = json.loads(
        run("bench/trainer.py", "--smoke", "--first-step", "--set", "target.forward_rows=4")
        .strip()
        .splitlines()[-1]
    )
    assert result["first_step_s"] >= 0 and result["second_step_s"] > 0
    assert result["target_forward_rows"] == 4


def test_the_drafter_bench_passes_the_residual_dtype_to_the_loss(monkeypatch) -> None:
    """`bench/drafter.py --residual-dtype float32` times the step `drafter.residual_dtype =
    "float32"` trains: the loss gets fp32 (None for auto), and each row says which it ran."""
    spec = importlib.util.spec_from_file_location("bench_drafter", ROOT / "bench" / "drafter.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen = []

    def spy(*args, residual_dtype=None, **kwargs):
        seen.append(residual_dtype)
        return real(*args, residual_dtype=residual_dtype, **kwargs)

    real = bench.draft_loss
    monkeypatch.setattr(bench, "draft_loss", spy)
    for choice, expected in (("float32", torch.float32), ("auto", None)):
        monkeypatch.setattr(sys, "argv", ["drafter.py", "--smoke", "--residual-dtype", choice])
        args = bench.parse()
        seen.clear()
        row = bench.drafter_row(args, bench.make_config(args), torch.device("cpu"), 256)
        assert seen and set(seen) == {expected}
        assert row["residual_dtype"] == choice


def _readme_peers_lines() -> list[list[str]]:
    """The arguments of every `python bench/peers.py` line of README.md and docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [
        shlex.split(line, comments=True)[2:]
        for page in pages
        for line in page.read_text().splitlines()
        if line.startswith("python bench/peers.py")
    ]


def test_the_readmes_peers_lines_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each `python bench/peers.py` line of the documents is a valid command line (the slow test
    below runs them all in smoke sizes)."""
    peers = script_modules("bench", "peers")["peers"]
    lines = _readme_peers_lines()
    assert len(lines) >= 4
    for argv in lines:
        monkeypatch.setattr(sys, "argv", ["bench/peers.py", *argv])
        args = peers.parse()
        assert args.merge or args.sizes


def _peers_run(monkeypatch: pytest.MonkeyPatch, statuses: dict, *flags: str) -> tuple:
    """bench/peers.py's `run_all` over two sizes (A = 8, then 4) of flashdraft and
    speculators, each worker stood in by `statuses[(framework, impl, A)]` ("ok" where
    absent): the workers asked for, in order, and the rows."""
    peers = script_modules("bench", "peers")["peers"]
    calls = []

    def fake_spawn(case, g, timeout):
        key = (case.framework, case.speculators_impl, case.anchors)
        calls.append(key)
        row = {"framework": case.framework, "context": case.context, "anchors": case.anchors}
        status = statuses.get(key, "ok")
        return {**row, "status": status, "stderr_tail": f"trace of {key}", "notes": ["n"]}

    monkeypatch.setattr(peers, "spawn", fake_spawn)
    argv = ["--sizes", "64:8,64:4", "--frameworks", "flashdraft,speculators", *flags]
    monkeypatch.setattr(sys, "argv", ["bench/peers.py", *argv])
    args = peers.parse()
    return calls, peers.run_all(args, peers.geometry(args))


def test_the_peers_bench_times_speculators_eager_once_its_fused_loss_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--speculators-impl auto` (the default): speculators' fused loss first; where it fails
    (on torch 2.11 it does not compile) the same case again with the eager loss, and eager
    for every later case; each such row keeps the fused failure, its traceback and a note.
    `fused` alone is never retried."""
    failed = {("speculators", "fused", 8): "failed: AssertionError: ListVariable"}
    calls, rows = _peers_run(monkeypatch, failed)
    assert calls == [
        ("flashdraft", "fused", 8),
        ("speculators", "fused", 8),
        ("speculators", "eager", 8),
        ("flashdraft", "fused", 4),
        ("speculators", "eager", 4),  # no second try of a loss that failed to compile
    ]
    for row in (rows[1], rows[3]):
        assert row["status"] == "ok" and row["fused_loss"].startswith("failed: Assertion")
        assert "(T=64 A=8)" in row["fused_loss"] and "fused loss" in row["notes"][-1]
    assert rows[1]["fused_stderr_tail"] == "trace of ('speculators', 'fused', 8)"
    assert "fused_loss" not in rows[0] and "fused_loss" not in rows[2]
    calls, rows = _peers_run(monkeypatch, failed, "--speculators-impl", "fused")
    assert ("speculators", "eager", 8) not in calls and rows[1]["status"].startswith("failed")


@pytest.mark.parametrize(
    "status",
    [
        "out of memory: CUDA out of memory",  # eager needs more memory than fused
        "out of memory (worker exited with -9)",
        "timed out after 150 s",
        "skipped: --deadline reached",
    ],
)
def test_the_peers_bench_does_not_retry_what_eager_would_not_mend(
    monkeypatch: pytest.MonkeyPatch, status: str
) -> None:
    """Out of memory, a timeout or a skip of speculators' fused loss is its row, not retried;
    a failure of another framework is never a reason to retry speculators."""
    calls, rows = _peers_run(monkeypatch, {("speculators", "fused", 8): status})
    assert ("speculators", "eager", 8) not in calls and rows[1]["status"] == status
    assert "fused_loss" not in rows[1]
    other = {("flashdraft", "fused", 8): "failed: RuntimeError: boom"}
    calls, rows = _peers_run(monkeypatch, other)
    assert all(impl == "fused" for _, impl, _ in calls) and "fused_loss" not in rows[1]


def test_a_peers_worker_stopped_by_its_timeout_says_how_far_it_got(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker killed at `--timeout` leaves on stderr the phases it marked: the row's status
    names the last one (a cold compile shows as "set up" without "first step done"), and
    `phases` keeps them all; a worker that marked none says so; a mark cut by the kill or
    mixed with other output is skipped. `timed` marks the set-up, the first step and the
    end of the warmup, in seconds since the parent spawned the worker (its `--timeout`'s
    clock, passed in the environment)."""
    modules = script_modules("bench", "peers", "peers_inputs")
    peers, inputs = modules["peers"], modules["peers_inputs"]
    tag = inputs.PHASE_TAG
    worker = (
        "import sys, time\n"
        f"print({tag + 'imported 0.4'!r}, file=sys.stderr, flush=True)\n"
        f"print({tag + 'set up 2.5'!r}, file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n"
    )
    popen = subprocess.Popen

    def stand_in(cmd: list[str], **kwargs: object) -> subprocess.Popen:
        assert cmd[2:4] == ["--worker", "speculators"]
        return popen([sys.executable, "-c", worker], **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(peers.subprocess, "Popen", stand_in)
    case = inputs.Case("speculators", 64, 8, 0, 1, 1, "ce", "eager")
    g = inputs.Geometry(64, 4, 2, 16, 128, 2, 256, 2, 4, 4, 7.0, 255)
    row = peers.spawn(case, g, timeout=4)
    assert row["status"] == "timed out after 4 s (last: set up at 2.5 s)"
    assert row["phases"] == {"imported": 0.4, "set up": 2.5}
    assert (
        peers.timeout_status(150, {}) == "timed out after 150 s (no phase marked: still starting)"
    )
    cut = f"{tag}first step done 95.1\nother output\n{tag}warmup d"
    mixed = f"{tag}set up 41.2W1205 12:00 inductor warning 7"  # another writer's text inside
    assert inputs.phases_of(cut + "\n" + mixed) == {"first step done": 95.1}

    steps = []
    monkeypatch.setenv(inputs.SPAWNED_AT, repr(time.time() - 100))  # spawned 100 s ago
    timing = inputs.timed(lambda: steps.append(1), torch.device("cpu"), replace(case, warmup=2))
    marks = inputs.phases_of(capsys.readouterr().err)
    assert list(marks) == ["set up", "first step done", "warmup done"] and len(steps) == 3
    assert all(100 <= t < 160 for t in marks.values()) and timing["median_ms"] >= 0


@pytest.mark.slow
def test_the_peers_bench_runs_its_readme_lines_in_smoke_sizes(tmp_path: Path) -> None:
    """Every `python bench/peers.py` line of the documents, in smoke sizes (`--smoke` added, a
    `--sizes` value replaced by a smoke size, `--out` files written here), then its
    `--merge` line on the two files. flashdraft's step always runs; speculators' and
    SpecForge's run where installed (their losses agree with flashdraft's on the parity
    pass) and are a row with their status where not, never a crash."""
    lines = _readme_peers_lines()
    assert len(lines) >= 4 and any("--merge" in argv for argv in lines)
    installed = {f: importlib.util.find_spec(f) is not None for f in ("speculators", "specforge")}
    smoke_sizes = iter(("512:32", "256:16"))
    outs: dict[str, Path] = {}
    results = []
    for argv in [a for a in lines if "--merge" not in a]:
        argv = [*argv, "--smoke"] if "--smoke" not in argv else list(argv)
        if "--sizes" in argv:
            argv[argv.index("--sizes") + 1] = next(smoke_sizes)
        if "--out" in argv:
            name = argv[argv.index("--out") + 1]
            outs[name] = argv[argv.index("--out") + 1] = tmp_path / name  # type: ignore[call-overload]
            argv = [str(a) for a in argv]
        if argv in [r[0] for r in results]:
            continue  # `python bench/peers.py` and `--smoke` are one command in smoke sizes
        results.append((argv, json.loads(run("bench/peers.py", *argv).strip().splitlines()[-1])))
    (merge,) = [a for a in lines if "--merge" in a]
    files = merge[merge.index("--merge") + 1 :]
    missing = [f for f in files if f not in outs]  # the guide's second one-size call
    for name in missing:
        (argv, _) = next(r for r in results if "--out" in r[0])
        argv = [str(tmp_path / name) if a == argv[argv.index("--out") + 1] else a for a in argv]
        argv[argv.index("--sizes") + 1] = next(smoke_sizes)
        results.append((argv, json.loads(run("bench/peers.py", *argv).strip().splitlines()[-1])))
        outs[name] = tmp_path / name
    for _, result in results:
        for row in result["rows"]:
            framework = row["framework"]
            if framework == "flashdraft" or installed[framework]:
                assert row["status"] == "ok", row
            else:
                assert row["status"].startswith("failed: ModuleNotFoundError"), row
        if installed["speculators"]:  # every smoke run has its parity pass (8 anchors)
            assert result["parity"]["speculators_rel_diff"] < 1e-6, result["parity"]
    merged = json.loads(
        run("bench/peers.py", "--merge", *(str(outs[f]) for f in files)).strip().splitlines()[-1]
    )
    sizes = {(r["context"], r["anchors"]) for r in merged["rows"]}
    assert sizes == {(512, 32), (256, 16)} and set(merged["ratios"]) == {"512:32", "256:16"}


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_the_prefill_profile_runs_on_cpu() -> None:
    stdout = run("bench/prefill_profile.py", "--smoke")
    assert "prefill of 3 x 20 tokens" in stdout and "aten::" in stdout
