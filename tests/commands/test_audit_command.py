"""`flashdraft audit`'s command line is derived from `AuditConfig`; its output and exit code."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import config_flags

from flashdraft import cli
from flashdraft import config as cfg
from flashdraft.commands import audit as audit_command
from flashdraft.data.audit import AuditConfig, Thresholds
from flashdraft.data.dataset import write_dataset
from flashdraft.data.preview import PreviewOptions

FLAGS = [
    "--preview", "--json", "--seed", "--tokenizer", "--color", "--max-repeated-share",
    "--min-median-loss-tokens", "--max-empty-share", "--max-all-ones-share",
    "--max-truncated-share",
]  # fmt: skip


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft audit")
    audit_command.add_arguments(parser)
    return parser


def test_every_field_has_its_flag_in_the_help() -> None:
    text = parser().format_help()
    flags = config_flags(AuditConfig)
    assert flags["json_output"] == "--json"
    assert "DIR [DIR ...]" in text
    for name, flag in flags.items():
        assert name == "datasets" or flag in text, name
    assert sorted(flag for flag in flags.values() if flag.startswith("--")) == sorted(FLAGS)


def test_defaults_and_flags_reach_the_config() -> None:
    assert cfg.from_args(AuditConfig, parser().parse_args(["d"])) == AuditConfig(datasets=["d"])
    argv = ["d1", "d2", "--json", "--preview", "3", "--seed", "2", "--color", "always"]
    config = cfg.from_args(AuditConfig, parser().parse_args([*argv, "--max-empty-share", "0.2"]))
    assert config == AuditConfig(
        datasets=["d1", "d2"],
        json_output=True,
        preview=3,
        preview_options=PreviewOptions(seed=2, color="always"),
        thresholds=Thresholds(max_empty_share=0.2),
    )


def test_a_bad_value_names_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["audit", "d", "--min-median-loss-tokens", "-3"]) == 2
    err = capsys.readouterr().err
    assert "flashdraft audit: error: --min-median-loss-tokens -3.0 is not allowed" in err
    assert cli.main(["audit", "d", "--preview", "-1"]) == 2
    assert "--preview -1 is not allowed: must be >= 0" in capsys.readouterr().err


def test_exit_code_and_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Token-id data without a tokenizer: the audit still runs, and says so.
    rows = []
    for i in range(20):
        ids = np.arange(i, i + 30, dtype=np.int32)
        rows.append((ids, (np.arange(30) >= 10).astype(np.int8), f"x:{i + 1}"))
    url = str(tmp_path / "ds")
    write_dataset(url, rows)
    assert cli.main(["audit", url]) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: the manifest names no tokenizer") and "all checks passed" in out
    assert cli.main(["audit", url, "--json", "--min-median-loss-tokens", "50"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 20 and len(report["problems"]) == 1


def test_a_dataset_whose_prepare_failed_fails_the_audit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its samples may pass every check at the audit's thresholds (here they do); the
    trainer still refuses it, so the audit must not say "all checks passed"."""
    rows = [
        (np.arange(i, i + 30, dtype=np.int32), np.ones(30, np.int8), f"x:{i}") for i in range(20)
    ]
    for row in rows:
        row[1][:10] = 0
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    write_dataset(good, rows)
    why = "30 of 50 records (60.0%) were rejected, more than --max-reject-rate 0.01."
    others = [(ids + 1000, mask, f"y:{i}") for i, (ids, mask, _) in enumerate(rows)]
    write_dataset(bad, others, manifest={"status": "failed", "problems": [why]})
    assert cli.main(["audit", good, "--preview", "0"]) == 0
    assert "all checks passed" in capsys.readouterr().out
    assert cli.main(["audit", good, bad, "--preview", "0"]) == 1
    out = capsys.readouterr().out
    assert "all checks passed" not in out and "DEGENERATE" not in out
    (line,) = [x for x in out.splitlines() if "PREPARE FAILED" in x]
    assert line.startswith(f"PREPARE FAILED: {bad} has status 'failed'") and why in line
    assert cli.main(["audit", bad, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["problems"][0].startswith("PREPARE FAILED")
