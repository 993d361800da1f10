"""experiments/quality_supervise.py: `flashdraft train` under a deadline, stopped just after a
checkpoint and resumed from one after a crash (fake training scripts stand in for it)."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest
from helpers import script_modules


@pytest.fixture(scope="module")
def supervise_module() -> ModuleType:
    return script_modules("experiments", "quality_supervise")["quality_supervise"]


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
    supervise_module: ModuleType, tmp_path: Path
) -> None:
    script = tmp_path / "fake_train.py"
    script.write_text(textwrap.dedent(FAKE_TRAIN))
    run = tmp_path / "run"

    def supervise(steps: int, budget: float | None, code: int = 0) -> bool:
        command = [sys.executable, str(script), str(run), str(steps), str(code)]
        finished: bool = supervise_module.supervise(
            command, tmp_path / "log", run, budget, margin=0.5
        )
        return finished

    started = time.monotonic()
    assert supervise(100, budget=4.0) is False
    assert time.monotonic() - started < 5.0
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert 3 <= len(steps) <= 9 and not (run / "export").exists()
    # (that no step is lost at the stop: `test_a_run_stopped_at_the_deadline_loses_no_step`;
    # here every step is a checkpoint, so nothing could be)
    assert supervise(2, budget=None) is True  # the rest of the run, to its export
    with pytest.raises(RuntimeError, match="exited 3"):
        supervise(0, budget=None, code=3)
    # 143: the run stopped for a SIGTERM from elsewhere after its checkpoint
    # (flashdraft/train/stopping.py): a stop for the next call, not a crash to resume from
    assert supervise(1, budget=None, code=143) is False
    # the same under torchrun, which exits 1 once its workers exited 143: their line says it
    torchrun = tmp_path / "torchrun_stopped.py"
    torchrun.write_text(
        "import sys\nprint('[rank 1] flashdraft train: stopped by SIGTERM after step 3 of 9; "
        "checkpoint run/checkpoints/step_00000003 written: run the same command with --resume "
        "to go on')\nsys.exit(1)\n"
    )
    command = [sys.executable, str(torchrun)]
    assert supervise_module.supervise(command, tmp_path / "log2", run, None) is False


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
    supervise_module: ModuleType, tmp_path: Path
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
        finished: bool = supervise_module.supervise_resuming(
            command, run / "log", run, lambda: left
        )
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


@pytest.mark.slow  # the experiments' tests stay under a minute together
def test_the_last_checkpoint_is_not_a_stop_the_export_follows(
    supervise_module: ModuleType, tmp_path: Path
) -> None:
    """A step takes 2 s and ~1.4 s are left after the last one's checkpoint: another
    checkpoint would not fit, but there is none to come, only the export (m6, 2026-12-02,
    stopped 26 s before its deadline with its export unwritten)."""
    script = tmp_path / "final_train.py"
    script.write_text(textwrap.dedent(FINAL_TRAIN))
    run = tmp_path / "run"
    run.mkdir()
    command = [sys.executable, str(script), str(run)]
    assert supervise_module.supervise(command, tmp_path / "log", run, 5.5, margin=0.2) is True
    assert (run / "export" / "config.json").exists()


def test_the_time_per_step_ignores_windows_with_an_eval_or_a_restart(
    supervise_module: ModuleType, tmp_path: Path
) -> None:
    """The deadline's step time: a window that held an in-training eval (1.4 s "per step",
    as a resumed run logged at its eval step on 2026-12-02) or a restart's compilation must
    not make the next checkpoint look 20x further off than it is."""
    run = tmp_path / "run"
    run.mkdir()
    assert supervise_module._seconds_per_step(run) is None
    records = [{"step": 20 * i, "step_s": 0.05} for i in range(1, 12)]
    records[0]["step_s"] = 0.4  # the window after a restart: compilation
    records.append({"step": 240, "step_s": 1.4352, "eval_tau": 2.8})
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + "{not json\n"
    )
    assert supervise_module._seconds_per_step(run) == pytest.approx(0.05)


def test_a_run_stops_at_a_checkpoint_when_the_next_would_fall_in_the_margin(
    supervise_module: ModuleType,
) -> None:
    """After a checkpoint the run goes on only if the next one is written before the stop
    `margin` seconds before the end: e.g. with 40 s left, a 30 s interval and a 15 s margin
    the old rule went on and the margin's stop threw away the steps since the checkpoint
    (s42's call 2 logged the margin's stop)."""
    stop = supervise_module.no_time_for_another
    assert stop(interval=30.0, left=40.0, margin=15.0)  # 36 s needed before the margin
    assert not stop(interval=30.0, left=52.0, margin=15.0)  # 36 + 15 <= 52: it fits
    assert stop(interval=30.0, left=50.0, margin=15.0)  # 20% spare on the interval
    assert stop(interval=30.0, left=30.0, margin=0.0) and not stop(30.0, 37.0, 0.0)


SPACED_TRAIN = """
import json, pathlib, sys, time
run, total, every, step_s = pathlib.Path(sys.argv[1]), *map(float, sys.argv[2:5])
run.mkdir(exist_ok=True)
for step in range(1, int(total) + 1):
    time.sleep(step_s)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "step_s": step_s}) + "\\n")
    if step % int(every) == 0 or step == total:
        done = run / "checkpoints" / f"step_{step:08d}"
        done.mkdir(parents=True, exist_ok=True)
        state = {"step": step, "total_steps": int(total)}
        (done / "state.json").write_text(json.dumps(state))
        (done / "COMPLETE").write_text("")
(run / "export").mkdir(exist_ok=True)
(run / "export" / "config.json").write_text("{}")
"""


def spaced_run(
    supervise_module: ModuleType, tmp_path: Path, args: list[str], budget: float, margin: float
) -> tuple[bool, Path]:
    """A fake training (steps, checkpoint every N steps, seconds a step) under `budget`."""
    script = tmp_path / "spaced_train.py"
    script.write_text(textwrap.dedent(SPACED_TRAIN))
    run = tmp_path / "run"
    command = [sys.executable, str(script), str(run), *args]
    finished = supervise_module.supervise(
        command, tmp_path / "log", run, budget, margin=margin, finish_s=0.1
    )
    return finished, run


@pytest.mark.slow  # the experiments' tests stay under a minute together
def test_a_run_stopped_at_the_deadline_loses_no_step(
    supervise_module: ModuleType, tmp_path: Path
) -> None:
    """Checkpoints every 5 steps of 0.3 s (1.5 s apart) and a 1 s margin; at the third, at
    ~4.6 s, ~2.3 s are left: the next one (1.8 s with its spare) would land inside the
    margin, so the run stops there. The old rule went on and the margin stopped it ~1.3 s
    later, four logged steps after its checkpoint."""
    finished, run = spaced_run(supervise_module, tmp_path, ["100", "5", "0.3"], 6.9, 1.0)
    assert finished is False
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    saved = supervise_module._latest_step(run)
    assert saved >= 10 and logged[-1] - saved <= 1  # one step may end while the stop is sent


@pytest.mark.slow  # the experiments' tests stay under a minute together
def test_a_short_last_stretch_is_run_to_the_end(
    supervise_module: ModuleType, tmp_path: Path
) -> None:
    """9 steps of 0.5 s, checkpoints at 4 and 8: after step 8 one step and the export are
    left (~0.6 s), not a whole 2 s interval; with ~2 s left and a 0.5 s margin the run
    finishes in this call instead of stopping at step 8."""
    finished, run = spaced_run(supervise_module, tmp_path, ["9", "4", "0.5"], 6.4, 0.5)
    assert finished is True and (run / "export" / "config.json").exists()
