"""`flashdraft prepare`'s command line is derived from `PrepareConfig`, flag for field."""

from __future__ import annotations

import argparse
import errno
import gzip
import json
import os
from pathlib import Path

import pytest
from helpers import config_flags

from flashdraft import cli, storage
from flashdraft import config as cfg
from flashdraft.commands import prepare as prepare_command
from flashdraft.data.audit import Thresholds
from flashdraft.data.prepare_config import PrepareConfig
from flashdraft.data.preview import PreviewOptions
from flashdraft.data.template import TemplateOptions

# The flags of the command before it was derived from its config: none may go missing.
FLAGS = [
    "--tokenizer", "--output", "--thinking", "--turns", "--max-length", "--overlong",
    "--workers", "--seed", "--shard-size", "--max-reject-rate", "--allow-degenerate",
    "--overwrite", "--preview", "--color", "--no-progress", "--max-repeated-share",
    "--min-median-loss-tokens", "--max-empty-share", "--max-all-ones-share",
    "--max-truncated-share", "--loops", "--loop-keep", "--loop-min", "--max-record-bytes",
    "--max-record-tokens",
]  # fmt: skip


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft prepare")
    prepare_command.add_arguments(parser)
    return parser


def test_every_field_has_its_flag_in_the_help() -> None:
    text = parser().format_help()
    flags = config_flags(PrepareConfig)
    assert {"thinking", "turns", "seed", "color", "max_repeated_share"} <= set(flags)
    assert flags["inputs"] == "inputs" and "INPUT [INPUT ...]" in text
    for name, flag in flags.items():
        assert name == "inputs" or flag in text, name
    assert sorted(flag for flag in flags.values() if flag.startswith("--")) == sorted(FLAGS)


def test_defaults_are_the_config_defaults() -> None:
    args = parser().parse_args(["in.jsonl", "--tokenizer", "t", "--output", "o"])
    config = cfg.from_args(PrepareConfig, args)
    assert config == PrepareConfig(inputs=["in.jsonl"], tokenizer="t", output="o")


def test_flags_reach_nested_options() -> None:
    argv = ["a.jsonl", "b/", "--tokenizer", "t", "--output", "o", "--thinking", "strip"]
    argv += ["--turns", "last", "--seed", "4", "--color", "never", "--max-empty-share", "0.5"]
    argv += ["--max-length", "64", "--overlong", "truncate", "--no-progress", "--allow-degenerate"]
    config = cfg.from_args(PrepareConfig, parser().parse_args(argv))
    assert config.inputs == ["a.jsonl", "b/"]
    assert config.template == TemplateOptions(thinking="strip", turns="last")
    assert config.preview_options == PreviewOptions(seed=4, color="never")
    assert config.thresholds == Thresholds(max_empty_share=0.5)
    assert (config.max_length, config.overlong, config.progress) == (64, "truncate", False)
    assert config.allow_degenerate


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-reject-rate", "3"], "--max-reject-rate 3.0 is not allowed: must be >= 0 and <= 1"),
        (["--max-length", "1"], "--max-length 1 is not allowed: must be >= 2"),
        (["--max-all-ones-share", "-1"], "--max-all-ones-share -1.0 is not allowed"),
        (["--shard-size", "0"], "--shard-size 0 is not allowed: must be >= 1"),
    ],
)
def test_a_bad_value_names_its_flag(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["prepare", "in.jsonl", "--tokenizer", "t", "--output", str(tmp_path / "o")]
    assert cli.main([*base, *argv]) == 2
    assert f"flashdraft prepare: error: {message}" in capsys.readouterr().err


def test_argparse_refuses_choices_outside_the_config() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["in", "--tokenizer", "t", "--output", "o", "--color", "blue"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--tokenizer", "t", "--output", "o"])  # no input


def _chats(path: Path, n: int) -> Path:
    records = [
        {
            "messages": [
                {"role": "user", "content": f"Tell me about topic {i}."},
                {"role": "assistant", "content": f"Topic {i} matters because of fact {i * 3}."},
            ]
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_a_damaged_input_is_one_line(
    tmp_path: Path, smollm2_dir: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("FLASHDRAFT_DEBUG", raising=False)
    plain = _chats(tmp_path / "chats.jsonl", 40).read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(plain)[:-40])
    argv = ["prepare", str(cut), "--tokenizer", str(smollm2_dir), "--output", str(tmp_path / "o")]
    assert cli.main([*argv, "--preview", "0", "--workers", "1"]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"flashdraft prepare: error: {cut} is cut short: the gzip stream")
    assert "copy or download the file again" in line


def test_a_full_disk_is_one_line_and_the_retry_resumes(
    tmp_path: Path, smollm2_dir: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """ENOSPC while writing a shard (or the very first file): one line, nothing left that
    blocks running the same command again, which reuses the shards already written."""
    monkeypatch.delenv("FLASHDRAFT_DEBUG", raising=False)
    source = _chats(tmp_path / "chats.jsonl", 30)
    write = storage._write_local
    full: list[str] = []  # the names whose write fails

    def disk_full(path: str, data: bytes) -> None:
        if any(name in path for name in full):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(path, data)

    monkeypatch.setattr(storage, "_write_local", disk_full)
    out = tmp_path / "out"
    argv = ["prepare", str(source), "--tokenizer", str(smollm2_dir), "--output", str(out),
            "--shard-size", "10", "--workers", "1", "--preview", "0"]  # fmt: skip
    for failing in ("settings.json", "shard-00001.arrow", "manifest.json"):
        full[:] = [failing]
        assert cli.main(argv) == 1
        line = _error_line(capsys)
        assert line.startswith("flashdraft prepare: error: could not write ") and failing in line
        assert "No space left on device" in line and "run the same command again" in line
        assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    full.clear()
    assert cli.main(argv) == 0
    assert "3 shard(s) reused" in capsys.readouterr().out  # done before the manifest failed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["counts"]["samples"] == 30
