"""metrics.jsonl: one line per logged step, and a resumed run never logs a step twice."""

from __future__ import annotations

import json

from flashdraft.train.metrics import MetricsLogger


def _logger(run, resume_step=None) -> MetricsLogger:
    return MetricsLogger(
        str(run), resume_step=resume_step, tensorboard=False, wandb_project=None, config={}
    )


def _steps(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_lines_are_written_as_logged_and_a_resume_drops_those_past_its_checkpoint(
    tmp_path,
) -> None:
    logger = _logger(tmp_path)
    for step in (2, 4, 6):
        logger.log({"step": step, "loss": 1.0 / step, "acc": [0.5]})
        assert _steps(tmp_path)[-1] == step  # flushed at once: a crash loses nothing logged
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "lo')  # the line a crash cut

    resumed = _logger(tmp_path, resume_step=4)
    assert _steps(tmp_path) == [2, 4]
    resumed.log({"step": 6, "loss": 0.1})
    resumed.close()
    assert _steps(tmp_path) == [2, 4, 6]


def test_a_fresh_run_starts_an_empty_file(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    _logger(tmp_path).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
