"""The console script: usage, dispatch, and how errors reach the user."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from typing import Any

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


# -- every command's options, as generated from its config ------------------------------------


def _command_parsers(monkeypatch) -> list[tuple[str, argparse.ArgumentParser, type]]:
    """(name, parser, config class) of every command, the class seen as the command's
    `add_arguments` hands it to `flashdraft.config.add_arguments`."""
    import importlib

    from flashdraft import config as cfg

    seen: list[type] = []
    generate = cfg.add_arguments

    def recording(parser: argparse.ArgumentParser, cls: type) -> None:
        seen.append(cls)
        generate(parser, cls)

    monkeypatch.setattr(cfg, "add_arguments", recording)
    out = []
    for name, (module_name, _) in cli.COMMANDS.items():
        seen.clear()
        parser = argparse.ArgumentParser(prog=f"flashdraft {name}")
        importlib.import_module(module_name).add_arguments(parser)
        assert len(seen) == 1, name
        out.append((name, parser, seen[0]))
    return out


def _fields(cls: type) -> dict[str, tuple[Any, Any]]:
    """The leaf fields of a command config by name: (field, type)."""
    from flashdraft import config as cfg

    return {f.name: (f, tp) for _, f, tp in cfg._flat_fields(cls)}


def _required(parser: argparse.ArgumentParser) -> list[str]:
    """Arguments that fill every required option and positional of `parser` with "x"."""
    return [x for a in parser._actions if a.required for x in [*a.option_strings[:1], "x"]]


def test_every_no_flag_is_the_negation_of_its_field(monkeypatch) -> None:
    """A `--no-X` flag turns its field off, and its help is the negation of the field's help
    (which says what on does), never that positive text: `--no-progress`, `--no-reference`,
    `--no-static-compile` once described the opposite of what they do."""
    from flashdraft import config as cfg

    checked = 0
    for name, parser, cls in _command_parsers(monkeypatch):
        fields = _fields(cls)
        for action in parser._actions:
            flags = [s for s in action.option_strings if s.startswith("--no-")]
            if not flags:
                continue
            f, _ = fields[action.dest]
            where = f"flashdraft {name} {flags[0]}"
            assert isinstance(action, argparse._StoreFalseAction), where
            assert action.default is True and cfg._default(f) is True, where
            assert action.help == cfg.negated_help(f).replace("%", "%%"), where
            assert action.help != f.metadata["help"], where
            base = _required(parser)
            assert getattr(parser.parse_args([*base, flags[0]]), action.dest) is False, where
            assert getattr(parser.parse_args(base), action.dest) is True, where
            checked += 1
        # Every other boolean flag is off by default and turns its field on.
        for action in parser._actions:
            if isinstance(action, argparse._StoreTrueAction):
                assert action.default is False, f"flashdraft {name} {action.option_strings}"
    assert checked >= 5  # eval --no-reference / --no-compile, generate's and prepare's


def test_a_non_finite_number_is_refused_for_every_float_option(monkeypatch) -> None:
    """inf and nan are refused by name for every float flag of every command (a bound such as
    >= 0 lets inf through; nan fails every comparison silently)."""
    import typing

    from flashdraft import config as cfg

    checked = 0
    for _name, parser, cls in _command_parsers(monkeypatch):
        fields = _fields(cls)
        base = _required(parser)
        for action in parser._actions:
            if action.dest not in fields or not action.option_strings:
                continue
            _, tp = fields[action.dest]
            inner, _ = cfg._optional(tp)
            if typing.get_origin(inner) is list:
                (inner,) = typing.get_args(inner)
            if inner is not float:
                continue
            for text in ("inf", "nan", "-inf"):
                args = parser.parse_args([*base, f"{action.option_strings[0]}={text}"])
                with pytest.raises(ValueError, match=r"not allowed: must be a finite number"):
                    cfg.from_args(cls, args)
            checked += 1
    assert checked >= 3


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_non_finite_run_config_value_is_one_line_naming_the_key(tmp_path, value) -> None:
    from flashdraft.train.config import load_run_config
    from flashdraft.train.presets import RunSource

    with pytest.raises(ValueError, match=rf"^optim\.lr = {value} is not allowed: must be a finite"):
        RunSource(preset="smollm2-demo", overrides=[f"optim.lr={value}"]).load()
    source = RunSource(preset="smollm2-demo").load().to_dict()
    toml = tmp_path / "run.toml"
    toml.write_text(f'[optim]\nlr = {value}\n[target]\npath = "t"\n[data]\ndatasets = ["d"]\n')
    with pytest.raises(ValueError, match=r"^optim\.lr = .* must be a finite number"):
        load_run_config(str(toml), [f"output={source['output']!r}"])
