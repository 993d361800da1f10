"""experiments/quality_speed.py through `experiments/quality.py pairs`: each recipe's decode time per
output token over the baseline's, given only where the evals' times compare."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from helpers import script_modules

LOOP = {"decoder": "static", "graphs": True, "compiled": True, "batch_size": 1}
H100 = "NVIDIA H100 80GB HBM3"
BOOT = "gpu-host 0b1c"  # one machine between two restarts


def report(
    times: dict[str, tuple[float, int]],
    *,
    device_name: str | None = H100,
    machine: str | None = BOOT,
    loop: dict[str, object] | None = None,
    speedup: float = 3.0,
    sourced: bool = True,
) -> dict[str, object]:
    """One eval report: prompt id -> (decode seconds, output tokens); the prompts of a
    conversation share its source (the first letter of the id) where `sourced`."""
    prompts = [
        {
            "id": pid,
            **({"source": f"conv-{pid[0]}"} if sourced else {}),
            "acceptance_lengths": [1] * (tokens - 1),
            "output_ids": list(range(tokens)),
            "decode_s": seconds,
        }
        for pid, (seconds, tokens) in times.items()
    ]
    settings: dict[str, object] = {"device": "cuda:0", "block_size": 16, "max_new_tokens": 256}
    if device_name is not None:
        settings["device_name"] = device_name
    if machine is not None:
        settings["machine"] = machine
    return {
        "tau": 1.0,
        "per_prompt": prompts,
        "speedup": speedup,
        "loops": {"speculative": loop or LOOP},
        "settings": settings,
    }


def write(folder: Path, times: dict[str, tuple[float, int]], **how: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "chat.json").write_text(json.dumps(report(times, **how)))  # type: ignore[arg-type]


def speed_table(quality: ModuleType, bench: Path, *argv: str) -> list[str]:
    """The rows of the speed table `pairs ARGV` ends with ([] where there is none)."""
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


@pytest.fixture(scope="module")
def speed() -> ModuleType:
    return script_modules("experiments", "quality_speed")["quality_speed"]


def test_the_time_ratio_pools_runs_and_resamples_whole_sources(
    quality: ModuleType, speed: ModuleType, tmp_path: Path
) -> None:
    """Speed over the baseline = its ms per token / the recipe's: 0.5 where the recipe takes
    twice the time everywhere; two runs of a recipe pool their times and tokens; the speedups
    over the target alone are averaged. The interval resamples sources: with every prompt in
    one conversation it is that conversation's ratio, however uneven the prompts."""
    write(tmp_path / "base", BASE, speedup=4.0)
    write(tmp_path / "slow", SLOW, speedup=2.0)
    write(tmp_path / "slow2", SLOW, speedup=3.0)
    rows = speed_table(
        quality, tmp_path / "q", "--runs", f"base={tmp_path / 'base'}",
        f"slow={tmp_path / 'slow'},{tmp_path / 'slow2'}",
    )  # fmt: skip
    assert rows == [
        "| base | 0.5000 (4.00x) (1) | — |",
        "| slow | 1.0000 (2.50x) (2) | 0.500 [0.50-0.50] |",
    ]
    uneven = report({**SLOW, "a1": (0.04, 21), "c1": (0.01, 21)})
    point, low, high = speed.speed_ratio([uneven], [report(BASE)])
    assert point == pytest.approx(0.04 / 0.09)  # 4 x 0.01 s / (0.04 + 0.02 + 0.02 + 0.01) s
    assert low < point < high
    keys = speed.sources([uneven])
    assert keys == ["conv-a", "conv-a", "conv-b", "conv-c"]
    assert speed.per_source([uneven], keys)["conv-a"] == pytest.approx([0.06, 40])
    one_conversation = {f"a{i}": (0.01 * (i + 1), 21) for i in range(6)}
    even = {pid: (0.01, 21) for pid in one_conversation}
    point, low, high = speed.speed_ratio([report(one_conversation)], [report(even)])
    assert low == high == pytest.approx(point)  # one source: every resample is all of it


def test_prompts_named_on_one_side_only_resample_by_that_name(speed: ModuleType) -> None:
    """A report without sources (`flashdraft eval`'s own) beside one with them: the prompts
    group by the name either side gives, the same groups on both sides."""
    named, bare = report(SLOW), report(BASE, sourced=False)
    assert speed.sources([named, bare]) == ["conv-a", "conv-a", "conv-b", "conv-c"]
    assert speed.speed_ratio([named], [bare])[0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="other prompts"):
        speed.speed_ratio([named], [report({"a1": (0.01, 21)})])
    assert speed.speed_ratio([report({"a1": (0.0, 1)})], [report({"a1": (0.0, 1)})]) is None


def test_times_that_do_not_compare_get_a_dash_with_the_reason(
    quality: ModuleType, tmp_path: Path
) -> None:
    """Other prompts, another kind of loop, device or machine (another boot: another
    session), or reports that do not say which machine ran them (before s50) unless
    --same-machine vouches for them: a dash that says why, not a ratio of two machines. A
    recipe whose own runs ran on two machines gets no pooled time either; one recipe with
    timings alone: no table."""
    write(tmp_path / "base", BASE)
    write(tmp_path / "other", {**SLOW, "d1": (0.01, 21)})
    write(tmp_path / "eager", SLOW, loop={**LOOP, "compiled": False})
    write(tmp_path / "h200", SLOW, device_name="NVIDIA H200")
    write(tmp_path / "rebooted", SLOW, machine="gpu-host 77aa")
    base = f"base={tmp_path / 'base'}"
    for name, why in (
        ("other", "other prompts"),
        ("eager", "other loop, device or machine"),
        ("h200", "other loop, device or machine"),
        ("rebooted", "other loop, device or machine"),
    ):
        rows = speed_table(quality, tmp_path / name / "q", "--runs", base, f"x={tmp_path / name}")
        assert rows[1].startswith("| x | ") and rows[1].endswith(f"| — ({why}) |"), name
    mixed = ["--runs", base, f"x={tmp_path / 'h200'},{tmp_path / 'rebooted'}"]
    rows = speed_table(quality, tmp_path / "mixed", *mixed)
    assert (
        rows[1]
        == "| x | — (2 runs: other loop, device or machine) | — (other loop, device or machine) |"
    )
    write(tmp_path / "old_base", BASE, device_name=None, machine=None)
    write(tmp_path / "old", SLOW, device_name=None, machine=None)
    old = ["--runs", f"base={tmp_path / 'old_base'}", f"x={tmp_path / 'old'}"]
    rows = speed_table(quality, tmp_path / "old" / "q", *old)
    assert rows[1] == "| x | 1.0000 (3.00x) (1) | — (machine not recorded) |"
    rows = speed_table(quality, tmp_path / "old" / "q2", *old, "--same-machine")
    assert rows[1] == "| x | 1.0000 (3.00x) (1) | 0.500 [0.50-0.50] |"
    # a report without per-prompt times (a CPU eval of before s50, say) makes no table alone
    untimed = json.loads((tmp_path / "old" / "chat.json").read_text())
    for prompt in untimed["per_prompt"]:
        del prompt["decode_s"]
    (tmp_path / "untimed").mkdir()
    (tmp_path / "untimed" / "chat.json").write_text(json.dumps(untimed))
    assert speed_table(quality, tmp_path / "u", "--runs", base, f"x={tmp_path / 'untimed'}") == []
