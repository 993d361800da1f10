"""The learning-rate schedules, the stopwatch and the line that says where the time went."""

from __future__ import annotations

import time

import pytest
import torch

from flashdraft.train.config import OptimSection
from flashdraft.train.schedule import Stopwatch, lr_at, time_spent


def test_lr_schedules() -> None:
    cosine = OptimSection(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, cosine) == pytest.approx(0.1)
    assert lr_at(9, 100, cosine) == pytest.approx(1.0)
    assert lr_at(100, 100, cosine) == pytest.approx(0.1)
    assert lr_at(55, 100, cosine) == pytest.approx(0.55)
    wsd = OptimSection(lr=1.0, warmup_steps=10, schedule="wsd", decay_ratio=0.2, min_lr_ratio=0.0)
    assert lr_at(50, 100, wsd) == 1.0 and lr_at(90, 100, wsd) == pytest.approx(0.5)


def test_linear_schedule_goes_straight_down_to_its_floor() -> None:
    linear = OptimSection(lr=1.0, warmup_steps=10, schedule="linear", min_lr_ratio=0.0)
    assert lr_at(9, 110, linear) == pytest.approx(1.0)
    assert lr_at(10, 110, linear) == pytest.approx(1.0)
    assert lr_at(60, 110, linear) == pytest.approx(0.5)
    assert lr_at(110, 110, linear) == 0.0 and lr_at(500, 110, linear) == 0.0
    floored = OptimSection(lr=2.0, warmup_steps=0, schedule="linear", min_lr_ratio=0.25)
    assert lr_at(50, 100, floored) == pytest.approx(2.0 * (1 - 0.75 * 0.5))


def test_constant_schedule_and_the_floor_past_the_end() -> None:
    constant = OptimSection(lr=0.5, warmup_steps=4, schedule="constant")
    assert [lr_at(s, 10, constant) for s in (0, 3, 4, 9, 50)] == [0.125, 0.5, 0.5, 0.5, 0.5]
    cosine = OptimSection(lr=1.0, warmup_steps=0, min_lr_ratio=0.2)
    assert lr_at(0, 10, cosine) == pytest.approx(1.0)
    assert lr_at(500, 10, cosine) == pytest.approx(0.2)  # past the end: stays at the floor
    values = [lr_at(s, 10, cosine) for s in range(11)]
    assert values == sorted(values, reverse=True)  # cosine never rises after warmup


def test_stopwatch_sums_the_spans_of_a_phase_and_resets() -> None:
    watch = Stopwatch(torch.device("cpu"))
    for _ in range(2):
        start = watch.mark()
        time.sleep(0.01)
        watch.add("target", start, watch.mark())
    peeked = watch.seconds("target", keep=True)  # the first step's report: still counted
    assert 0.02 <= peeked < 0.5
    assert watch.seconds("target") == peeked
    assert watch.seconds("target") == 0.0  # read once: the next interval starts empty
    assert watch.seconds("never") == 0.0


def test_the_time_line_adds_up_from_set_up_to_export() -> None:
    """The loop's time less its first step and its checkpoints is the other steps'; the
    total is set-up + loop + export; a run resumed at its last step ran no step."""
    line = time_spent(
        setup=4.25, looped=30.0, steps=11, first=5.0, saved=2, checkpoints=3.0, export=1.5
    )
    assert line == (
        "flashdraft train: 35.8 s from set-up to export: set up 4.2 s, first step 5.0 s, "
        "10 more steps 22.0 s, 2 checkpoint(s) 3.0 s, export 1.5 s"
    )
    # checkpoints that waited at a barrier can exceed the loop's remainder: never negative
    assert "0 more steps 0.0 s" in time_spent(
        setup=0.0, looped=2.0, steps=1, first=1.5, saved=1, checkpoints=1.0, export=0.0
    )
    resumed_at_the_end = time_spent(
        setup=1.0, looped=0.0, steps=0, first=0.0, saved=0, checkpoints=0.0, export=2.0
    )
    assert "set up 1.0 s, no step left to run, 0 checkpoint(s)" in resumed_at_the_end
