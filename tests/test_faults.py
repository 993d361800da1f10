"""Fault injection: nothing lost, nothing silently wrong.

Each test does to a command what happens to real runs, and asserts either the one-line
error a user can act on or the exact recovery:

* killed (SIGKILL, no clean-up) at a seeded random point, `train`, `prepare` and `generate`
  run again give what an uninterrupted run gives;
* a damaged newest checkpoint (cut short, emptied) is skipped by `--resume`, named, and the
  run ends where the uninterrupted one does;
* a resume with settings that change the training is refused with the keys listed; safe
  changes are allowed and recorded; `--allow-config-change` is recorded;
* the bad inputs of the issue (wrongly typed or out-of-range config values, a data file cut
  short, JSON that is not JSON, an empty input) are one line naming the key or file, exit
  status 2, no traceback.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, train_settings

from flashdraft import cli
from flashdraft.assets import chitchat_conversations
from flashdraft.train.checkpoint import load_drafter

REPO = Path(__file__).resolve().parents[1]
SEED = 15  # the number: the kill points below are drawn from it
TRAIN = {"optim.max_steps": 12, "checkpoint.every": 4, "log.every": 2}


def _signal_when(
    command: list[str],
    ready: Callable[[], bool],
    delay: float,
    log: Path,
    sig: int = signal.SIGKILL,
    **env: str,
) -> int:
    """Run `flashdraft COMMAND` in a subprocess (`env` added to its environment), send it
    `sig` `delay` seconds after `ready()` first holds, and return its exit status; it must
    still have been running when `ready()` held. Nothing is left running."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env}
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "flashdraft.cli", *command],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 240
        while not ready():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the signal point was never reached"
            time.sleep(0.01)
        time.sleep(delay)
        process.send_signal(sig)
        return process.wait(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _kill_when(command: list[str], ready: Callable[[], bool], delay: float, log: Path) -> None:
    """`_signal_when` with SIGKILL: no clean-up runs."""
    code = _signal_when(command, ready, delay, log)
    assert code == -signal.SIGKILL, "finished before the kill: move the point"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith(f"flashdraft {command}: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- train ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_qwen3_dir, qwen_data) -> Path:
    """The uninterrupted run every train fault is compared with (12 steps, checkpoints at
    4, 8, 12)."""
    run = tmp_path_factory.mktemp("faults") / "reference"
    assert cli.main(["train", *train_settings(run, tiny_qwen3_dir, qwen_data, **TRAIN)]) == 0
    return run


def _same_run(run: Path, reference: Path) -> None:
    """The same metrics at every logged step and the same final weights, bit for bit."""
    got, want = read_metrics(run), read_metrics(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "tau_hat", "acc", "lr", "grad_norm", "trained_slots", "tokens"):
            assert a[key] == b[key], (a["step"], key)
    final, expected = load_drafter(str(run)), load_drafter(str(reference))
    for (name, x), y in zip(
        final.state_dict().items(), expected.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name


def test_train_killed_at_a_random_point_resumes_to_the_uninterrupted_run(
    tmp_path, tiny_qwen3_dir, qwen_data, reference_run
) -> None:
    rng = random.Random(SEED)
    step, delay = rng.choice([2, 4, 6, 8]), rng.uniform(0.0, 0.5)
    run = tmp_path / "killed"
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **TRAIN)

    def logged() -> bool:  # the metrics line of `step` is written
        metrics = run / "metrics.jsonl"
        return metrics.exists() and f'"step": {step},' in metrics.read_text()

    _kill_when(["train", *settings], logged, delay, tmp_path / "stderr.txt")
    assert not (run / "export").exists()
    # =auto: the kill may come before the first checkpoint is complete (then the run starts)
    assert cli.main(["train", *settings, "--resume=auto"]) == 0
    _same_run(run, reference_run)


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_sigterm_checkpoints_at_the_end_of_a_run_ahead_group_and_resumes_bit_for_bit(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    """One process, the target running ahead over 3 steps (groups [0, 3), [3, 6), ...; log
    lines every 2 steps; no periodic checkpoint before the end). A SIGTERM in the first step
    is agreed at the step-2 log point (at step 4 on a slow machine), inside a group; the
    run stops at the first log point that ends a group, step 6, not at step 3 (a group's end
    between two log lines: unlogged, unchecked) nor inside a group (the resumed run would
    form other groups): its checkpoint, exit 143, and resumed, bit for bit the run in one
    go, metrics included."""
    ahead = {**TRAIN, "target.forward_rows": 3, "checkpoint.every": 12}
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert cli.main(["train", *train_settings(whole, tiny_qwen3_dir, qwen_data, **ahead)]) == 0
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **ahead)
    trace, log = tmp_path / "trace" / "trace-rank0.jsonl", tmp_path / "stderr.txt"

    def began() -> bool:  # step 1
        return trace.exists() and '"event": "row"' in trace.read_text()

    code = _signal_when(
        ["train", *settings], began, 0.0, log, signal.SIGTERM, FLASHDRAFT_TRACE=str(trace.parent)
    )
    err = log.read_text()
    assert code == 143, err[-3000:]
    assert (
        f"flashdraft train: stopped by SIGTERM after step 6 of 12; checkpoint {run}/checkpoints/"
        "step_00000006 written: run the same command with --resume to go on"
    ) in err
    assert "Traceback" not in err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000006"]
    assert not (run / "export").exists()
    assert cli.main(["train", *settings, "--resume"]) == 0
    _same_run(run, whole)


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_a_muon_run_stopped_at_a_checkpoint_resumes_to_the_uninterrupted_run(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys
) -> None:
    """optim.optimizer = "muon" (two torch optimizers) with the linear schedule: a run
    stopped after its step-3 checkpoint and resumed ends bit for bit as the run in one go
    (Muon's momentum, AdamW's moments and both groups' settings come back), and its loss
    falls."""
    muon = {
        **TRAIN,
        "optim.max_steps": 6,
        "checkpoint.every": 3,
        "optim.optimizer": '"muon"',
        "optim.schedule": '"linear"',
    }
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert cli.main(["train", *train_settings(whole, tiny_qwen3_dir, qwen_data, **muon)]) == 0
    assert "optimizer Muon + AdamW, lr 0.01, linear schedule" in capsys.readouterr().out
    first = train_settings(parts, tiny_qwen3_dir, qwen_data, **{**muon, "optim.max_steps": 3})
    assert cli.main(["train", *first]) == 0
    rest = train_settings(parts, tiny_qwen3_dir, qwen_data, **muon)
    assert cli.main(["train", *rest, "--resume"]) == 0
    _same_run(parts, whole)
    losses = [r["loss"] for r in read_metrics(whole)]
    assert losses[-1] < losses[0]


def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_ends_the_same(
    tmp_path, tiny_qwen3_dir, qwen_data, reference_run, capsys
) -> None:
    """The two newest checkpoints are damaged (one cut short, one emptied): `--resume`
    names both, goes back to step 4, and trains to the same end."""
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    newest = run / "checkpoints" / "step_00000012" / "drafter.safetensors"
    newest.write_bytes(newest.read_bytes()[:-100])
    (run / "checkpoints" / "step_00000008" / "optimizer.safetensors").write_bytes(b"")
    shutil.rmtree(run / "export")
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **TRAIN)
    capsys.readouterr()
    assert cli.main(["train", *settings, "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"skipping checkpoint {run}/checkpoints/step_00000012: drafter.safetensors: " in err
    assert f"skipping checkpoint {run}/checkpoints/step_00000008: optimizer.safetensors: " in err
    assert (run / "checkpoints" / "unusable_step_00000012").is_dir()  # kept, not deleted
    _same_run(run, reference_run)


def test_a_resume_refuses_a_changed_training_and_records_what_it_allows(
    tmp_path, tiny_qwen3_dir, qwen_data, reference_run, capsys
) -> None:
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    before = _files(run)
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **TRAIN)
    changed = ["--set", "drafter.block_size=4", "--set", "seed=1", "--set", "data.row_tokens=128"]
    assert cli.main(["train", *settings, *changed, "--resume"]) == 2
    line = _one_line_error(capsys, "train")
    for change in ("drafter.block_size 8 -> 4", "seed 0 -> 1", "data.row_tokens 256 -> 128"):
        assert change in line
    assert _files(run) == before  # nothing written
    assert cli.main(["train", *settings, *changed]) == 2  # without --resume: other refusal
    assert "already holds checkpoints" in _one_line_error(capsys, "train")

    # Safe: train further, log more often. Then a deliberate change, allowed and recorded.
    safe = ["--set", "optim.max_steps=14", "--set", "log.every=1"]
    assert cli.main(["train", *settings, *safe, "--resume"]) == 0
    assert [r["step"] for r in read_metrics(run)][-3:] == [12, 13, 14]
    forced = [*safe, "--set", "optim.lr=1e-3", "--allow-config-change"]
    assert cli.main(["train", *settings, *forced, "--resume"]) == 0
    history = [json.loads(x) for x in (run / "run_config_changes.jsonl").read_text().splitlines()]
    moved = [str(reference_run), str(run)]  # the run was copied: its output changed, safely
    assert history == [
        {
            "step": 12,
            "changes": {"log.every": [2, 1], "optim.max_steps": [12, 14], "output": moved},
            "forced": [],
        },
        {"step": 14, "changes": {"optim.lr": [0.01, 0.001]}, "forced": ["optim.lr"]},
    ]
    assert json.loads((run / "run_config.json").read_text())["optim"]["lr"] == 0.001


# ---- prepare and generate -------------------------------------------------------------------


def _chats(path: Path, count: int, first_exchange: bool = False) -> Path:
    records = chitchat_conversations(count, seed=SEED)
    if first_exchange:
        records = [{**r, "messages": r["messages"][:2]} for r in records]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_prepare_killed_at_a_random_point_finishes_identical(tmp_path, tiny_qwen3_dir) -> None:
    source = _chats(tmp_path / "chats.jsonl", 56)

    def command(out: Path) -> list[str]:
        return ["prepare", str(source), "--tokenizer", str(tiny_qwen3_dir), "--output", str(out),
                "--shard-size", "8", "--workers", "1", "--no-progress", "--preview", "0"]  # fmt: skip

    assert cli.main(command(tmp_path / "reference")) == 0
    rng = random.Random(SEED)
    shard, delay = rng.randrange(1, 6), rng.uniform(0.0, 0.05)
    out = tmp_path / "killed"
    marker = out / ".work" / f"shard-{shard:05d}.json"
    _kill_when(command(out), marker.exists, delay, tmp_path / "stderr.txt")
    assert not (out / "manifest.json").exists()
    assert cli.main(command(out)) == 0
    assert _files(out) == _files(tmp_path / "reference")


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_generate_killed_at_a_random_point_finishes_identical(tmp_path, tiny_qwen3_dir) -> None:
    prompts = _chats(tmp_path / "chats.jsonl", 32, first_exchange=True)

    def command(out: Path) -> list[str]:
        # Sampled (seeded per batch), one prompt per batch: a resumed run draws the same.
        return ["generate", "--target", str(tiny_qwen3_dir), "--prompts", str(prompts),
                "--output", str(out), "--max-new-tokens", "6", "--temperature", "2",
                "--thinking", "off", "--batch-size", "1", "--device", "cpu", "--no-progress"]  # fmt: skip

    def outputs(out: Path) -> list[Path]:  # kept answers, and cut or empty ones beside them
        return [p for p in (out, out.with_name(out.stem + ".rejected.jsonl")) if p.exists()]

    def records(out: Path) -> dict[str, dict]:
        found = {}
        for path in outputs(out):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                assert record["id"] not in found  # never twice
                found[record["id"]] = record
        return found

    assert cli.main(command(tmp_path / "reference.jsonl")) == 0
    rng = random.Random(SEED)
    written, delay = rng.randrange(2, 12), rng.uniform(0.0, 0.1)
    out = tmp_path / "killed.jsonl"

    def enough() -> bool:  # whole lines written (the last one may be cut while we look)
        return sum(p.read_bytes().count(b"\n") for p in outputs(out)) >= written

    _kill_when(command(out), enough, delay, tmp_path / "stderr.txt")
    assert 0 < len(records(out)) < 32
    assert cli.main(command(out)) == 0
    assert records(out) == records(tmp_path / "reference.jsonl")


# ---- bad inputs: one line, exit 2, no traceback ---------------------------------------------


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ('optim.lr="fast"', "optim.lr = 'fast' is not allowed: expected a number"),
        ('optim.max_steps="4"', "optim.max_steps = '4' is not allowed: expected an integer"),
        ("optim.betas=[0.9]", "optim.betas = [0.9] is not allowed: expected two numbers"),
        ("log.every=0", "log.every = 0 is not allowed: must be >= 1"),
        ("optim.max_steps=0", "optim.max_steps = 0 is not allowed: must be >= 1"),
        ("optim.warmup_steps=-1", "optim.warmup_steps = -1 is not allowed: must be >= 0"),
        ("optim.grad_clip=0", "optim.grad_clip = 0 is not allowed: must be > 0"),
        ("optim.grad_clip=-1", "optim.grad_clip = -1 is not allowed: must be > 0"),
    ],
)
def test_bad_run_config_values_are_one_line_naming_the_key(
    tmp_path, setting, expected, capsys
) -> None:
    settings = train_settings(tmp_path / "run", tmp_path / "target", tmp_path / "data")
    assert cli.main(["train", *settings, "--set", setting]) == 2
    assert expected in _one_line_error(capsys, "train")
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_damaged_dataset_files_are_one_line_naming_the_file(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys
) -> None:
    data = tmp_path / "data"
    shutil.copytree(qwen_data, data)
    arrow = next(data.glob("data-*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    assert cli.main(["audit", str(data)]) == 2
    assert f"{arrow} is damaged or cut short" in _one_line_error(capsys, "audit")
    settings = train_settings(tmp_path / "run", tiny_qwen3_dir, data)
    assert cli.main(["train", *settings]) == 2
    assert f"{arrow} is damaged or cut short" in _one_line_error(capsys, "train")
    for name in ("state.json", "manifest.json"):
        shutil.rmtree(data)
        shutil.copytree(qwen_data, data)
        (data / name).write_text('{"format": "flashdraft-prepared-dataset",')
        assert cli.main(["audit", str(data)]) == 2
        assert f"{data / name} is not valid JSON" in _one_line_error(capsys, "audit")


def test_an_empty_input_is_one_line_and_leaves_nothing(tmp_path, tiny_qwen3_dir, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    out = tmp_path / "out"
    argv = ["prepare", str(empty), "--tokenizer", str(tiny_qwen3_dir), "--output", str(out)]
    assert cli.main([*argv, "--workers", "1", "--no-progress"]) == 2
    assert f"no records in {empty}" in _one_line_error(capsys, "prepare")
    assert not out.exists()


def test_ctrl_c_checkpoints_at_the_next_log_point_without_a_traceback(
    tmp_path, tiny_qwen3_dir, qwen_data, capfd, monkeypatch
) -> None:
    """SIGINT (Ctrl-C) in the first step, as SIGTERM: the run stops at the step-2 log point
    with its checkpoint and exit status 143, no KeyboardInterrupt, and resumes."""
    from flashdraft.train import trainer

    sent = []

    def interrupt_once(event: str, **fields: object) -> None:
        if event == "row" and not sent:
            sent.append(fields)
            os.kill(os.getpid(), signal.SIGINT)

    run = tmp_path / "run"
    fast = {**TRAIN, "optim.max_steps": 4, "drafter.mask_token_id": 151669}  # no tokenizer load
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **fast)
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "trace", interrupt_once)
        try:
            code = cli.main(["train", *settings])
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C raised KeyboardInterrupt instead of stopping at a checkpoint")
    err = capfd.readouterr().err  # the notice is written raw, to file descriptor 2
    assert code == 143, err
    assert "Ctrl-C: stopping at the next log point" in err
    assert (
        f"flashdraft train: stopped by SIGINT after step 2 of 4; checkpoint {run}/checkpoints/"
        "step_00000002 written: run the same command with --resume to go on"
    ) in err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000002"]
    assert cli.main(["train", *settings, "--resume"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [2, 4]
