"""Bench helpers: timing statistics on the CPU, the result formats, the environment record."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

from flashdraft.benchutil import (
    Timing,
    cpu_model,
    device_name,
    environment,
    format_table,
    machine_id,
    matmul_peak,
    measure,
    print_json,
    print_table,
)

CPU = torch.device("cpu")


def test_measure_calls_warmup_plus_iters_times_and_reports_the_median() -> None:
    delays = iter([0.0] * 2 + [0.004, 0.001, 0.002, 0.003, 0.020])  # 2 warm-up calls first
    calls = []

    def fn() -> None:
        calls.append(1)
        time.sleep(next(delays))

    timing = measure(fn, CPU, warmup=2, iters=5)
    assert len(calls) == 7
    # sleep() only ever overshoots: the median call is the 3 ms one, the p90 the 20 ms one
    assert 0.003 <= timing.median_s < 0.020
    assert timing.p10_s <= timing.median_s <= timing.p90_s
    assert timing.p90_s >= 0.004
    assert timing.peak_mem_gb == 0.0  # no CUDA allocator on a CPU
    single = measure(lambda: None, CPU, warmup=0, iters=1)
    assert single.p10_s == single.median_s == single.p90_s


def test_timing_as_dict_is_in_milliseconds() -> None:
    timing = Timing(median_s=0.0012345, p10_s=0.001, p90_s=0.002, peak_mem_gb=1.23456)
    assert timing.as_dict() == {
        "median_ms": 1.234,
        "p10_ms": 1.0,
        "p90_ms": 2.0,
        "peak_mem_gb": 1.235,
    }


def test_matmul_peak_is_a_positive_flop_rate() -> None:
    assert matmul_peak(CPU, iters=2) > 0


def test_table_format(capsys) -> None:
    rows = [{"name": "drafter", "ms": 1.5}, {"name": "target", "ms": 12.25, "extra": "x"}]
    table = format_table(rows, ["name", "ms"])
    assert table.splitlines() == [
        "name     ms   ",
        "drafter  1.5  ",
        "target   12.25",
    ]
    assert format_table([{"a": 1}], ["a", "missing"]).splitlines() == [
        "a  missing",
        "1  " + " " * 7,
    ]
    assert format_table([], ["a"]) == "a"
    print_table(rows, ["name", "ms"])
    assert capsys.readouterr().out == table + "\n"


def test_json_is_one_sorted_line_on_stdout(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # no rank tag: the line must parse as it is
    print_json({"b": 1, "a": [1.5, None], "c": {"y": 2, "x": 1}})
    out = capsys.readouterr().out
    assert out == '{"a": [1.5, null], "b": 1, "c": {"x": 1, "y": 2}}\n'
    assert json.loads(out) == {"a": [1.5, None], "b": 1, "c": {"x": 1, "y": 2}}


def test_environment_records_versions_and_hardware(monkeypatch) -> None:
    monkeypatch.setenv("FLASHDRAFT_COMMIT", "abc1234")
    info = environment()
    assert {"date", "commit", "python", "torch", "transformers"} <= set(info)
    assert info["commit"] == "abc1234" and info["torch"] == torch.__version__
    if torch.cuda.is_available():
        assert {"gpu", "gpus", "cuda"} <= set(info)
    else:
        assert {"cpu", "threads"} <= set(info)
    json.dumps(info)  # it goes into the JSON line as it is


def test_the_machine_and_device_names_say_what_ran_a_timing() -> None:
    """The CPU's model from /proc/cpuinfo (not `x86_64`) with torch's threads; the machine as
    a stable 16-hex hash of host and boot that holds no host name."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        model = next(ln for ln in info.read_text().splitlines() if "model name" in ln)
        assert cpu_model() == model.split(":", 1)[1].strip()
    assert device_name(torch.device("cpu")) == f"{cpu_model()}, {torch.get_num_threads()} threads"
    assert machine_id() == machine_id() and len(machine_id()) == 16
    int(machine_id(), 16)  # hex
    assert socket.gethostname() not in machine_id()


@pytest.mark.parametrize("iters", [2, 10])
def test_measure_quantiles_are_ordered(iters: int) -> None:
    timing = measure(lambda: sum(range(1000)), CPU, warmup=1, iters=iters)
    assert 0 < timing.p10_s <= timing.median_s <= timing.p90_s
