"""`experiments/quality.py`'s training stage under a deadline: `flashdraft train` as a child
process, stopped just after a checkpoint when the next one would not fit in the time left,
and resumed from its newest checkpoint when it dies after saving one. The run's own files
(its checkpoints' markers, metrics.jsonl) say where it is; nothing else is kept."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from flashdraft.log import get_logger
from flashdraft.train.checkpoint import complete_checkpoints, step_dir
from flashdraft.train.stopping import EXIT_CODE, STOPPED

log = get_logger("bench.quality")


def supervise(
    command: list[str],
    log_path: Path,
    run_dir: Path,
    budget: float | None,
    margin: float = 15.0,
    finish_s: float = 5.0,
) -> bool:
    """Run `flashdraft train` to the end (True), or stop it just after the last checkpoint
    that leaves no time for another within `budget` seconds (False): nothing is lost, and
    `--resume` continues with the schedule of an unbroken run. Without a checkpoint in
    sight it is stopped `margin` seconds before the budget ends. `finish_s`: what the last
    checkpoint and the export take after the last step (`dpm6`'s finishing call spent 13 s
    outside its steps, process start-up included)."""
    started = time.monotonic()
    last_step, last_time, timed = _latest_step(run_dir), started, False
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        while process.poll() is None:
            time.sleep(0.25)
            if budget is None:
                continue
            now, step = time.monotonic(), _latest_step(run_dir)
            left = budget - (now - started)
            stop, ahead = left < margin, ""
            if step != last_step:  # a checkpoint just completed
                # Time to the next one: measured between two checkpoints; for the first, the
                # logged seconds per step (the wall time since the start would count the
                # start-up and a cold compile, minutes, and stop far too early).
                per_step = None if timed else _seconds_per_step(run_dir)
                since = step - last_step
                interval = since * per_step if per_step is not None else now - last_time
                last_step, last_time, timed = step, now, True
                # The end before another checkpoint: only its steps and the export are left.
                # After the last step's checkpoint only the export is: a stop there sent a
                # finished run's export to the next call (2026-12-02, m6)
                to_go = _steps_to_go(run_dir, step)
                if to_go is not None and to_go < since:
                    interval = to_go * interval / since + finish_s
                stop = stop or (to_go != 0 and no_time_for_another(interval, left, margin))
                ahead = f"; the next save ~{interval:.0f} s away"
            if stop:
                log.info(
                    f"train: stopped at step {step} for the deadline ({left:.0f} s left{ahead})"
                )
                # the run checkpoints again at its next log point (where its run-ahead
                # group ends), then exits 143 (flashdraft/train/stopping.py): none lost
                process.send_signal(signal.SIGTERM)
                try:  # longer than torchrun's own 30 s for its workers
                    process.wait(timeout=45)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                # finished after all (its last steps came before its next log point): done
                return (run_dir / "export" / "config.json").exists()
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    # A SIGTERM from elsewhere: checkpointed, a stop and not a crash. One process exits 143;
    # torchrun exits 1 once its workers did, so their line says it.
    if process.returncode == EXIT_CODE or any(STOPPED in line for line in tail):
        log.info(f"train: stopped by SIGTERM at step {_latest_step(run_dir)} ({log_path})")
        return False
    if process.returncode != 0:
        raise RuntimeError(f"train exited {process.returncode}; {log_path}:\n" + "\n".join(tail))
    return (run_dir / "export" / "config.json").exists()


def no_time_for_another(interval: float, left: float, margin: float) -> bool:
    """Whether a run just past a checkpoint should stop there: the next checkpoint, `interval`
    seconds away (20% spare), would not be written before the stop `margin` seconds before the
    budget's end. Without the margin here a run could go on and be stopped by it with the
    steps since its checkpoint unsaved. Inferred, not logged: s42's `dpm61` logged "stopped
    at step 7500 for the deadline (15 s left)", the margin's stop, and its call spent 45.4 s
    of the train stage outside the saved steps against 29.1 s in its finishing call."""
    return interval * 1.2 > left - margin


def supervise_resuming(
    command: list[str],
    log_path: Path,
    run_dir: Path,
    remaining: Callable[[], float | None],
    min_left: float = 90.0,
) -> bool:
    """`supervise` (with `--resume` once a checkpoint exists), again from the newest
    checkpoint when the training dies after saving one: s15 and s28 each lost a run to a
    CUDA "unspecified launch failure" while several runs shared the GPU, which did not come
    back on the rerun. One that dies again before its next checkpoint raises (no progress:
    not a passing fault; a run the finite guard stops after a checkpoint so costs one
    rerun before it raises); with under `min_left` seconds left it returns False and the
    next call resumes."""
    while True:
        saved = _latest_step(run_dir)  # 0: no complete checkpoint yet
        resume = ["--resume"] if saved else []
        try:
            return supervise([*command, *resume], log_path, run_dir, remaining())
        except RuntimeError as error:
            now = _latest_step(run_dir)
            if now <= saved:
                raise
            log.info(f"train: {str(error).splitlines()[0]} after saving step {now} ({log_path})")
            left = remaining()
            if left is not None and left < min_left:
                log.info(f"train: {left:.0f} s left of --deadline; the next call resumes")
                return False
            log.info(f"train: resuming from step {now}")


def _seconds_per_step(run_dir: Path, last: int = 10) -> float | None:
    """The median `step_s` of the last `last` metrics.jsonl records without an in-training
    eval (None when there is none yet). A record's window holds any eval run in it (~30 s
    over 20 steps: 1.4 s "per step" where steps take 0.05 s), and the first window after a
    restart holds the compilation; the last record alone stopped a resumed run 415 s early
    (2026-12-02)."""
    path = run_dir / "metrics.jsonl"
    times: list[float] = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
            if "eval_tau" not in record:
                times.append(float(record["step_s"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return statistics.median(times[-last:]) if times else None


def _steps_to_go(run_dir: Path, step: int) -> int | None:
    """The steps of the run after checkpoint `step` (its state.json says; None when it
    cannot be read)."""
    try:
        state = json.loads(Path(step_dir(str(run_dir), step), "state.json").read_text())
        return max(0, int(state["total_steps"]) - int(state["step"]))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def _latest_step(run_dir: Path) -> int:
    done = complete_checkpoints(str(run_dir)) if run_dir.exists() else []
    return done[-1][0] if done else 0
