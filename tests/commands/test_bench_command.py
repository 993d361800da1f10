"""`flashdraft bench` flags: one typed config, errors naming the flag."""

from __future__ import annotations

import pytest
from helpers import parse_command

from flashdraft.commands import bench as bench_command
from flashdraft.train.bench import BenchConfig


def _parse(*argv: str) -> BenchConfig:
    config = parse_command(bench_command, BenchConfig, *argv)
    assert isinstance(config, BenchConfig)
    return config


def test_flags_fill_the_bench_config() -> None:
    assert _parse() == BenchConfig()
    config = _parse("--preset", "qwen3-8b", "--set", "a=1", "--set", "b=2", "--iters", "4")
    assert (config.run.preset, config.run.overrides, config.iters, config.warmup) == (
        "qwen3-8b",
        ["a=1", "b=2"],
        4,
        3,
    )


def test_a_bad_value_names_its_flag() -> None:
    with pytest.raises(ValueError, match="--iters 0 is not allowed"):
        _parse("--iters", "0")
