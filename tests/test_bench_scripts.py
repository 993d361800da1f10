"""The training benchmark scripts' CPU smoke modes: the README shows `bench/trainer.py` with
`--rows-per-forward`, and the GPU sessions (bench/checks_session.sh) run its `--first-step`,
`--set` and `--profile` options and `bench/prefill_profile.py`; a broken option should fail
here, not on the device machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    return out.stdout


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


def test_the_trainer_bench_times_the_first_steps() -> None:
    result = json.loads(run("bench/trainer.py", "--smoke", "--first-step").strip().splitlines()[-1])
    assert result["bench"] == "trainer-first-step"
    assert result["first_step_s"] >= 0 and result["second_step_s"] > 0


def test_the_prefill_profile_runs_on_cpu() -> None:
    stdout = run("bench/prefill_profile.py", "--smoke")
    assert "prefill of 3 x 20 tokens" in stdout and "aten::" in stdout


def test_the_device_session_scripts_parse_and_refuse_an_unknown_stage(tmp_path: Path) -> None:
    """A shell syntax error in a session script costs a device call: `bash -n` here, and an
    unknown stage ends with exit 2 and the list of stages, before any work."""
    scripts = sorted((ROOT / "bench").glob("*.sh"))
    assert {"quality_session.sh", "checks_session.sh"} <= {p.name for p in scripts}
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=60)
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)}
    for script, expect in (("quality_session.sh", "multi"), ("checks_session.sh", "muon")):
        done = subprocess.run(
            ["bash", str(ROOT / "bench" / script), "nope"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, (script, done.stdout, done.stderr)
        assert "unknown stage nope" in done.stdout and expect in done.stdout


def test_an_ablation_word_is_a_run_setting_or_a_quality_flag() -> None:
    """`quality_session.sh multi`/`ablate`: KEY=VALUE becomes `--set KEY=VALUE`, a word
    starting with -- (e.g. --loops=untrain, a bench/quality.py option) goes as it is."""
    script = (ROOT / "bench" / "quality_session.sh").read_text()
    start = script.index("as_args() {")
    function = script[start : script.index("\n}\n", start) + 3]
    words = "optim.epochs=2 --loops=untrain eval.every=0"
    done = subprocess.run(
        ["bash", "-c", f'{function}sets=(); for w in {words}; do as_args "$w"; done; '
         'printf "%s|" "${sets[@]}"'],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert done.stdout == "--set|optim.epochs=2|--loops=untrain|--set|eval.every=0|"
