"""An export in either format: the command's options, save_export with its reload check and
the output-directory rule."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_drafter

from flashdraft.export.artifact import FORMATS, ExportConfig, export_format, save_export


def test_export_config() -> None:
    config = ExportConfig(checkpoint="run", output="out")
    assert config.format == "dflash" and config.verifier is None
    assert FORMATS == ("dflash", "speculators")
    with pytest.raises(ValueError, match=r"^verifier = None is not allowed: the speculators"):
        ExportConfig(checkpoint="run", output="out", format="speculators")
    with pytest.raises(ValueError, match=r"^format = 'onnx'"):
        ExportConfig(checkpoint="run", output="out", format="onnx")  # type: ignore[arg-type]
    ExportConfig(checkpoint="run", output="out", format="speculators", verifier="Qwen/Qwen3-8B")


def test_save_export_writes_either_format_and_checks_the_reload(tmp_path) -> None:
    drafter = tiny_drafter()
    save_export(drafter, str(tmp_path / "dflash"))
    assert export_format(str(tmp_path / "dflash")) == "dflash"
    save_export(drafter, str(tmp_path / "spec"), "speculators", verifier="Qwen/Qwen3-8B")
    assert export_format(str(tmp_path / "spec")) == "speculators"
    with pytest.raises(ValueError, match="needs a verifier"):
        save_export(drafter, str(tmp_path / "none"), "speculators")
    assert not (tmp_path / "none").exists()


def test_save_export_refuses_a_non_empty_directory_unless_overwrite(tmp_path) -> None:
    drafter = tiny_drafter()
    save_export(drafter, str(tmp_path / "out"))
    with pytest.raises(ValueError, match="not empty; pass --overwrite"):
        save_export(drafter, str(tmp_path / "out"))
    # A sharded export left there would be read before our single file: it goes.
    index = {"weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "out" / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "out" / "model-00001-of-00002.safetensors").write_text("stale")
    save_export(tiny_drafter(seed=4), str(tmp_path / "out"), overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    with pytest.raises(ValueError, match="is a file"):
        save_export(drafter, str(tmp_path / "out" / "config.json"), overwrite=True)
