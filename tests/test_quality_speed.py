"""bench/quality_speed.py through `bench/quality.py pairs`: each recipe's decode time per
output token over the baseline's, given only where the two evals' times compare."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from helpers import bench_modules

LOOP = {"decoder": "static", "graphs": True, "compiled": True, "batch_size": 1}


def write(
    folder: Path,
    times: dict[str, tuple[float, int]],
    *,
    kind: str = "chat",
    device_name: str | None = "NVIDIA H100 80GB HBM3",
    loop: dict[str, object] | None = None,
    speedup: float = 3.0,
) -> None:
    """One eval report: prompt id -> (decode seconds, output tokens); the prompts of a
    conversation share its source (the first letter of the id)."""
    prompts = [
        {
            "id": pid,
            "source": f"conv-{pid[0]}",
            "acceptance_lengths": [1] * (tokens - 1),
            "output_ids": list(range(tokens)),
            "decode_s": seconds,
        }
        for pid, (seconds, tokens) in times.items()
    ]
    settings: dict[str, object] = {"device": "cuda:0", "block_size": 16, "max_new_tokens": 256}
    if device_name is not None:
        settings["device_name"] = device_name
    report = {
        "tau": 1.0,
        "per_prompt": prompts,
        "speedup": speedup,
        "loops": {"speculative": loop or LOOP},
        "settings": settings,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{kind}.json").write_text(json.dumps(report))


def speed_table(quality: ModuleType, tmp_path: Path, *argv: str) -> list[str]:
    """The rows of the speed table `pairs ARGV` ends with ([] where there is none)."""
    bench = tmp_path / "bench"
    _, config, _ = quality.parse(["pairs", *argv, "--bench-dir", str(bench)])
    quality.run("pairs", config, [])
    md = next(bench.glob("quality_*_pairs.md")).read_text()
    if "Decode time per output token" not in md:
        return []
    table = md.split("Decode time per output token")[1].split("\n\n")[1]
    return table.splitlines()[2:]


# the baseline decodes 20 tokens a prompt in 0.01 s (0.5 ms a token); the other recipe in 0.02
BASE = {"a1": (0.01, 21), "a2": (0.01, 21), "b1": (0.01, 21), "c1": (0.01, 21)}
SLOW = {pid: (2 * s, n) for pid, (s, n) in BASE.items()}


def test_the_time_ratio_pools_runs_and_resamples_whole_sources(
    quality: ModuleType, tmp_path: Path
) -> None:
    """Speed over the baseline = its ms per token / the recipe's: 0.5 where the recipe takes
    twice the time everywhere (an interval of one point); two runs of a recipe pool their
    times and tokens; the speedups over the target alone are averaged."""
    write(tmp_path / "base", BASE, speedup=4.0)
    write(tmp_path / "slow", SLOW, speedup=2.0)
    write(tmp_path / "slow2", SLOW, speedup=3.0)
    rows = speed_table(
        quality, tmp_path, "--runs", f"base={tmp_path / 'base'}",
        f"slow={tmp_path / 'slow'},{tmp_path / 'slow2'}",
    )  # fmt: skip
    assert rows == [
        "| base | 0.5000 (4.00x) (1) | — |",
        "| slow | 1.0000 (2.50x) (2) | 0.500 [0.50-0.50] |",
    ]
    # unequal times: the interval resamples the three conversations, not the four prompts
    uneven = {**SLOW, "a1": (0.04, 21), "c1": (0.01, 21)}
    write(tmp_path / "uneven", uneven)
    speed = bench_modules("quality_speed")["quality_speed"]
    point, low, high = speed.speed_ratio(
        [json.loads((tmp_path / "uneven" / "chat.json").read_text())],
        [json.loads((tmp_path / "base" / "chat.json").read_text())],
    )
    assert point == pytest.approx(0.04 / 0.09)  # 4 x 0.01 s / (0.04 + 0.02 + 0.02 + 0.01) s
    assert low < point < high
    sums = speed.per_source([json.loads((tmp_path / "uneven" / "chat.json").read_text())])
    assert sorted(sums) == ["conv-a", "conv-b", "conv-c"]
    assert sums["conv-a"] == pytest.approx([0.06, 40])  # a1 and a2: one conversation


def test_times_that_do_not_compare_get_a_dash_with_the_reason(
    quality: ModuleType, tmp_path: Path
) -> None:
    """Other prompts, another kind of loop or device, or reports without the device's name
    (written before s50) unless --same-machine vouches for them: a dash that says why, not a
    ratio of two machines; one recipe with timings alone: no table."""
    write(tmp_path / "base", BASE)
    write(tmp_path / "other", {**SLOW, "d1": (0.01, 21)})
    write(tmp_path / "eager", SLOW, loop={**LOOP, "compiled": False})
    write(tmp_path / "h200", SLOW, device_name="NVIDIA H200")
    base = f"base={tmp_path / 'base'}"
    for name, why in (
        ("other", "other prompts"),
        ("eager", "other loop or device"),
        ("h200", "other loop or device"),
    ):
        rows = speed_table(quality, tmp_path / name / "q", "--runs", base, f"x={tmp_path / name}")
        assert rows[1].startswith("| x | ") and rows[1].endswith(f"| — ({why}) |"), name
    write(tmp_path / "old_base", BASE, device_name=None)
    write(tmp_path / "old", SLOW, device_name=None)
    old = ["--runs", f"base={tmp_path / 'old_base'}", f"x={tmp_path / 'old'}"]
    rows = speed_table(quality, tmp_path / "old" / "q", *old)
    assert rows[1].endswith("| — (machine not recorded: --same-machine) |")
    rows = speed_table(quality, tmp_path / "old" / "q2", *old, "--same-machine")
    assert rows[1] == "| x | 1.0000 (3.00x) (1) | 0.500 [0.50-0.50] |"
    # a report without per-prompt times (a CPU eval of before s50, say) makes no table alone
    untimed = json.loads((tmp_path / "old" / "chat.json").read_text())
    for prompt in untimed["per_prompt"]:
        del prompt["decode_s"]
    (tmp_path / "untimed").mkdir()
    (tmp_path / "untimed" / "chat.json").write_text(json.dumps(untimed))
    assert speed_table(quality, tmp_path / "u", "--runs", base, f"x={tmp_path / 'untimed'}") == []
