"""`PrepareConfig`: its validation and the settings recorded from it (resume, manifest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashdraft.data.prepare_config import PrepareConfig, data_settings, manifest_options
from flashdraft.data.preview import PreviewOptions
from flashdraft.data.template import TemplateOptions


def test_config_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="overlong"):
        PrepareConfig(inputs=["x"], tokenizer="t", output="o", overlong="wrap")
    with pytest.raises(ValueError, match="max_reject_rate = 3 is not allowed"):
        PrepareConfig(inputs=["x"], tokenizer="t", output="o", max_reject_rate=3)
    with pytest.raises(ValueError, match="max_length = 1 is not allowed: must be >= 2"):
        PrepareConfig(inputs=["x"], tokenizer="t", output="o", max_length=1)
    with pytest.raises(ValueError, match="inputs"):
        PrepareConfig(inputs=[], tokenizer="t", output="o")


def test_recorded_settings_of_a_default_config_are_pinned() -> None:
    """Resume compares `data_settings` with the ones stored by earlier runs, and manifests
    are read by people and tools: both must stay exactly what earlier versions wrote."""
    config = PrepareConfig(inputs=["x"], tokenizer="t", output="o")
    settings = data_settings(config, "f" * 64)
    assert list(settings.items()) == [
        ("format_version", 1),
        ("tokenizer_sha256", "f" * 64),
        ("thinking", "keep"),
        ("turns", "all"),
        ("max_length", None),
        ("overlong", "drop"),
        ("shard_size", 2048),
    ]
    options = manifest_options(config)
    assert list(options.items()) == [
        ("thinking", "keep"),
        ("turns", "all"),
        ("max_length", None),
        ("max_record_bytes", 4 << 20),
        ("max_record_tokens", 131_072),
        ("overlong", "drop"),
        ("seed", 0),
        ("shard_size", 2048),
        ("max_reject_rate", 0.01),
        ("allow_degenerate", False),
        (
            "thresholds",
            {
                "max_repeated_share": 0.1,
                "min_median_loss_tokens": 8.0,
                "max_empty_share": 0.01,
                "max_all_ones_share": 0.0,
                "max_truncated_share": 0.05,
            },
        ),
    ]
    # Every option lands where it belongs, nested ones included.
    other = PrepareConfig(
        inputs=["x"],
        tokenizer="t",
        output="o",
        template=TemplateOptions(thinking="strip", turns="last"),
        max_length=512,
        preview_options=PreviewOptions(seed=5, color="never"),
        workers=3,
    )
    assert data_settings(other, "x")["thinking"] == "strip"
    assert (manifest_options(other)["seed"], manifest_options(other)["max_length"]) == (5, 512)
    assert "workers" not in manifest_options(other) and "color" not in manifest_options(other)


def test_record_limits_decide_the_data_when_not_the_defaults() -> None:
    """A dataset prepared before the limits existed resumes under the default ones; other
    limits are other data (its shards are redone, or refused without --overwrite)."""
    config = PrepareConfig(inputs=["x"], tokenizer="t", output="o")
    assert "record_limits" not in data_settings(config, "x")
    smaller = PrepareConfig(inputs=["x"], tokenizer="t", output="o", max_record_tokens=4096)
    assert data_settings(smaller, "x")["record_limits"] == {"bytes": 4 << 20, "tokens": 4096}
    off = PrepareConfig(inputs=["x"], tokenizer="t", output="o", max_record_bytes=None)
    assert data_settings(off, "x")["record_limits"] == {"bytes": None, "tokens": 131_072}
    with pytest.raises(ValueError, match="max_record_bytes = 0 is not allowed: must be >= 1"):
        PrepareConfig(inputs=["x"], tokenizer="t", output="o", max_record_bytes=0)
