"""`flashdraft demo` flags: the same flags as before DemoConfig, now derived from it."""

from __future__ import annotations

import pytest
from helpers import parse_command

from flashdraft.commands import demo as demo_command
from flashdraft.demo import DemoConfig, DemoSizes


def _parse(*argv: str) -> DemoConfig:
    config = parse_command(demo_command, DemoConfig, *argv)
    assert isinstance(config, DemoConfig)
    return config


def test_flags_fill_the_demo_config() -> None:
    assert _parse() == DemoConfig(output="./demo-run", device="auto", fresh=False)
    args = ["--output", "d", "--samples", "6", "--steps", "3", "--eval-prompts", "2"]
    args += ["--max-new-tokens", "12", "--device", "cpu", "--fresh"]
    config = _parse(*args)
    assert config == DemoConfig(
        output="d",
        samples=6,
        steps=3,
        eval_prompts=2,
        max_new_tokens=12,
        device="cpu",
        fresh=True,
    )
    with pytest.raises(ValueError, match="--steps 0 is not allowed"):
        _parse("--steps", "0")


def test_sizes_per_device_and_what_the_flags_override() -> None:
    assert DemoSizes.for_device(False, DemoConfig()) == DemoSizes(128, 6, 64, 32)
    assert DemoSizes.for_device(True, DemoConfig()) == DemoSizes(3000, 16, 128, 256)
    small = DemoSizes.for_device(False, DemoConfig(samples=6, eval_prompts=2, max_new_tokens=12))
    assert small == DemoSizes(6, 2, 12, 32)
