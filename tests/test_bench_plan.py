"""`bench/plan.py`'s CPU smoke mode: the plan of the 27B-shaped run for N GPUs of M GB, and
(slow) the chosen layout run and measured, so a broken option fails here, not on the device
machine."""

from __future__ import annotations

import json

import pytest
from test_bench_scripts import run


@pytest.mark.slow  # a subprocess: `pytest -m slow` (tests/train/test_layout.py plans in-process)
def test_the_plan_bench_plans_the_27b_hybrid_for_four_gpus() -> None:
    out = run("bench/plan.py", "--geometry", "27b-hybrid", "--gpus", "4", "--gb", "96",
              "--plan-only", "--rows", "8192")  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "plan" and result["chosen"] == "colocated x4, drafter FSDP2"
    assert 'parallel.drafter_sharding="fsdp"' in result["overrides"]
    assert 60 < result["predicted_peak_gb"]["colocated"] < 96


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_the_plan_bench_runs_the_chosen_layout_in_smoke_sizes() -> None:
    result = json.loads(run("bench/plan.py", "--smoke").strip().splitlines()[-1])
    assert result["chosen"] == "colocated x1"
    assert result["measured_tokens_per_s"] > 0 and result["predicted_tokens_per_s"] > 0
    assert result["same_choice_with_measured_times"] is True
