"""`flashdraft generate`'s command line is derived from `GenerateConfig`, flag for field."""

from __future__ import annotations

import argparse

import pytest
from helpers import config_flags

from flashdraft import cli
from flashdraft import config as cfg
from flashdraft.commands import generate as generate_command
from flashdraft.data.generate import GenerateConfig
from flashdraft.data.inference import Sampling

FLAGS = [
    "--target", "--prompts", "--output", "--thinking", "--turns", "--temperature", "--top-p",
    "--top-k", "--max-new-tokens", "--batch-size", "--max-batch-tokens", "--static-attention",
    "--no-static-compile", "--static-compile-prefill", "--static-min-admit", "--sort-window",
    "--limit", "--seed", "--shard", "--stop-token-ids", "--backend", "--device", "--dtype",
    "--no-progress", "--keep-truncated", "--base-url", "--model", "--api-key-env",
    "--concurrency", "--answers-per-prompt", "--request-timeout", "--max-retries",
    "--retry-backoff", "--precision",
]  # fmt: skip
REQUIRED = ["--target", "t", "--prompts", "p.jsonl", "--output", "o.jsonl"]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft generate")
    generate_command.add_arguments(parser)
    return parser


def test_every_field_has_its_flag_in_the_help() -> None:
    text = parser().format_help()
    flags = config_flags(GenerateConfig)
    assert {"temperature", "top_p", "top_k", "max_new_tokens"} <= set(flags)
    for flag in flags.values():
        assert flag in text
    assert sorted(flags.values()) == sorted(FLAGS)


def test_defaults_are_the_config_defaults() -> None:
    config = cfg.from_args(GenerateConfig, parser().parse_args(REQUIRED))
    assert config == GenerateConfig(target="t", prompts=["p.jsonl"], output="o.jsonl")


def test_flags_keep_their_spelling_and_meaning() -> None:
    argv = ["--target", "t", "--output", "o.jsonl", "--prompts", "a.jsonl", "b/"]
    argv += ["--thinking", "on", "--shard", "2/8"]
    argv += ["--backend", "openai", "--base-url", "http://h:8000/v1", "--model", "m"]
    argv += ["--concurrency", "32", "--max-retries", "2", "--stop-token-ids", "7", "9"]
    argv += ["--temperature", "0.6", "--top-k", "20", "--dtype", "bfloat16", "--no-progress"]
    config = cfg.from_args(GenerateConfig, parser().parse_args(argv))
    assert config.prompts == ["a.jsonl", "b/"]
    assert config.thinking == "on" and config.settings([2])["thinking"] is True
    assert (config.shard_index, config.num_shards) == (2, 8)
    assert (config.backend, config.server.base_url, config.server.model) == (
        "openai",
        "http://h:8000/v1",
        "m",
    )
    assert (config.server.concurrency, config.server.max_retries) == (32, 2)
    assert config.stop_token_ids == [7, 9]
    assert config.sampling == Sampling(temperature=0.6, top_k=20)
    assert (config.dtype, config.progress) == ("bfloat16", False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shard", "8/8"], "--shard '8/8' is not allowed: K/N with 0 <= K < N"),
        (["--top-p", "0"], "--top-p 0.0 is not allowed: must be > 0 and <= 1"),
        (["--temperature", "-1"], "--temperature -1.0 is not allowed: must be >= 0"),
        (["--batch-size", "0"], "--batch-size 0 is not allowed: must be >= 1"),
        (["--backend", "openai"], "--base-url None is not allowed: --backend openai needs"),
        (["--concurrency", "0"], "--concurrency 0 is not allowed: must be >= 1"),
        (["--output", "o.jsonl.gz"], "--output 'o.jsonl.gz' is not allowed: a plain .jsonl"),
    ],
)
def test_a_bad_value_names_its_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["generate", *REQUIRED, *argv]) == 2
    assert f"flashdraft generate: error: {message}" in capsys.readouterr().err


def test_argparse_refuses_what_it_can_parse() -> None:
    for bad in (["--thinking", "maybe"], ["--dtype", "int4"], ["--backend", "vllm"]):
        with pytest.raises(SystemExit):
            parser().parse_args([*REQUIRED, *bad])
