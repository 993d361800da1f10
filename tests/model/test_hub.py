"""A target path that is neither a model folder nor a hub id: one line in every command."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flashdraft import cli
from flashdraft.data.dataset import write_dataset
from flashdraft.model.hub import check_model_path, model_errors


def _bad_targets(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    return {
        str(tmp_path / "no-such-model"): "does not exist",
        "./no-such-model": "does not exist",
        "no/such/model": "does not exist",  # neither a path that exists nor an id
        str(tmp_path / "empty"): "is not a model folder (no config.json)",
        str(tmp_path / "weights.bin"): "is a file, not a model folder",
    }


def test_check_model_path(tmp_path: Path, smollm2_dir: Path) -> None:
    for path, why in _bad_targets(tmp_path).items():
        with pytest.raises(FileNotFoundError) as err:
            check_model_path(path, "--target")
        assert str(err.value).startswith(f"--target {path!r} {why}; give the folder")
    check_model_path(str(smollm2_dir), "--target")  # a model folder
    check_model_path("HuggingFaceTB/SmolLM2-135M")  # an id: the hub's to answer


def test_an_error_from_loading_is_one_line_naming_the_key() -> None:
    with pytest.raises(FileNotFoundError) as err, model_errors("Org/no-model", "target.path"):
        raise OSError("Org/no-model is not a valid model identifier\nmore text")
    assert str(err.value).startswith(
        "target.path 'Org/no-model' could not be loaded as a hub id (Org/no-model is not a valid"
    )
    assert "\n" not in str(err.value)


def _one_line(capsys: pytest.CaptureFixture[str], status: int, name: str, why: str) -> None:
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flashdraft {name}: error: ") and why in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_eval_and_generate_name_a_bad_target(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("FLASHDRAFT_DEBUG", raising=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    for path, why in _bad_targets(tmp_path).items():
        status = cli.main(
            ["eval", "--target", path, "--drafter", str(tmp_path / "d"), "--prompts",
             str(prompts), "--output", str(tmp_path / "eval")]
        )  # fmt: skip
        _one_line(capsys, status, "eval", f"--target {path!r} {why}")
        status = cli.main(
            ["generate", "--target", path, "--prompts", str(prompts), "--output",
             str(tmp_path / "gen.jsonl")]
        )  # fmt: skip
        _one_line(capsys, status, "generate", f"--target {path!r} {why}")


def test_train_names_a_bad_target(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("FLASHDRAFT_DEBUG", raising=False)
    ids = np.arange(40, dtype=np.int32)
    write_dataset(str(tmp_path / "data"), [(ids, np.ones(40, np.int8), "a.jsonl:1")])
    status = cli.main(
        ["train", "--preset", "smollm2-demo", "--set", "target.path=no/such/model",
         "--set", f"data.datasets=['{tmp_path / 'data'}']", "--set", f"output='{tmp_path / 'run'}'"]
    )  # fmt: skip
    _one_line(capsys, status, "train", "target.path 'no/such/model' does not exist")
