"""The console script: usage, dispatch, and how errors reach the user."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types

import pytest

from flashdraft import __version__, cli


def _fake_command(monkeypatch, error: BaseException | None) -> None:
    """`flashdraft boom [--n N]`: a command whose run raises `error` (or returns 0)."""
    module = types.ModuleType("flashdraft_test_boom")

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--n", type=int, default=0)

    def run(args: argparse.Namespace) -> int:
        if error is not None:
            raise error
        return 0

    module.add_arguments = add_arguments  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, "boom", (module.__name__, "a test command"))


def test_usage_lists_every_command(capsys) -> None:
    for argv in ([], ["-h"], ["--help"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: flashdraft COMMAND [options]   (flashdraft {__version__})")
        for name, (_, help_) in cli.COMMANDS.items():
            assert f"  {name}" in out and help_ in out


def test_version(capsys) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"{__version__}\n"


def test_an_unknown_command_is_exit_2_with_the_usage(capsys) -> None:
    assert cli.main(["nope"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("flashdraft: unknown command 'nope'\n\nusage: flashdraft")


def test_a_command_runs_with_its_parsed_arguments(monkeypatch) -> None:
    _fake_command(monkeypatch, None)
    assert cli.main(["boom", "--n", "3"]) == 0
    with pytest.raises(SystemExit) as exit_:  # argparse refuses a bad flag itself
        cli.main(["boom", "--n", "x"])
    assert exit_.value.code == 2


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ValueError("--n must be >= 1"), 2),
        (FileNotFoundError("runs/x has no checkpoint"), 2),
        (FileExistsError("out exists; pass --overwrite"), 2),
        (FloatingPointError("loss is nan at step 7"), 1),
    ],
)
def test_a_user_error_is_one_line_without_a_traceback(monkeypatch, capsys, error, status) -> None:
    _fake_command(monkeypatch, error)
    monkeypatch.delenv("FLASHDRAFT_DEBUG", raising=False)
    assert cli.main(["boom"]) == status
    captured = capsys.readouterr()
    assert captured.err == f"flashdraft boom: error: {error}\n"
    assert captured.out == ""


def test_flashdraft_debug_re_raises(monkeypatch) -> None:
    _fake_command(monkeypatch, ValueError("bad value"))
    monkeypatch.setenv("FLASHDRAFT_DEBUG", "1")
    with pytest.raises(ValueError, match="bad value"):
        cli.main(["boom"])


def test_a_bug_keeps_its_traceback(monkeypatch) -> None:
    _fake_command(monkeypatch, RuntimeError("a bug"))
    monkeypatch.delenv("FLASHDRAFT_DEBUG", raising=False)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["boom"])


def test_under_torchrun_the_error_line_carries_the_rank(monkeypatch, capsys) -> None:
    _fake_command(monkeypatch, ValueError("bad value"))
    monkeypatch.delenv("FLASHDRAFT_DEBUG", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["boom"]) == 2
    assert capsys.readouterr().err == "[rank 1] flashdraft boom: error: bad value\n"


def test_the_console_script_prints_one_line_and_exits_2(tmp_path) -> None:
    """A real process: a real command's user error, no traceback."""
    missing = str(tmp_path / "missing")
    done = subprocess.run(
        [sys.executable, "-m", "flashdraft.cli", "export", missing, "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "FLASHDRAFT_DEBUG"},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"flashdraft export: error: {missing} is neither")
