"""The typed-config machinery: validation, files and overrides, the derived command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from flashdraft import config as cfg
from flashdraft.config import ConfigError, option


@dataclass(kw_only=True, slots=True)
class Limits:
    max_share: float = option(0.1, ge=0, le=1, help="a share", tags=("record",))

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class Example:
    inputs: list[str] = option(positional=True, metavar="INPUT", help="files")
    output: str = option(help="where", tags=("record",))
    size: int = option(8, ge=1, help="how many", tags=("record",))
    rate: float | None = option(None, gt=0, help="optional rate")
    mode: Literal["fast", "slow"] = option("fast", help="how")
    ids: list[int] = option(factory=list, ge=0, help="some ids")
    progress: bool = option(True, help="progress bar")
    overwrite: bool = option(False, help="replace")
    hidden: str = option("x", cli=False, help="not on the command line")
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        cfg.validate(self)


def test_validation_names_the_key_the_value_and_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match=r"size = 0 is not allowed: must be >= 1"):
        Example(inputs=["a"], output="o", size=0)
    with pytest.raises(ConfigError, match=r"size = '4' is not allowed: expected an integer"):
        Example(inputs=["a"], output="o", size="4")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"size = True is not allowed: expected an integer"):
        Example(inputs=["a"], output="o", size=True)
    with pytest.raises(ConfigError, match=r"mode = 'medium'.*one of 'fast', 'slow'"):
        Example(inputs=["a"], output="o", mode="medium")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"ids = \[1, -2\].*>= 0"):
        Example(inputs=["a"], output="o", ids=[1, -2])
    with pytest.raises(ConfigError, match=r"rate = nan"):
        Example(inputs=["a"], output="o", rate=float("nan"))
    # An int where a float is wanted is converted, losslessly.
    example = Example(inputs=["a"], output="o", rate=2)
    assert example.rate == 2.0 and isinstance(example.rate, float)


def test_build_prefixes_section_keys_and_refuses_unknown_or_missing_keys() -> None:
    with pytest.raises(ConfigError, match=r"^limits\.max_share = 2"):
        cfg.build(Example, {"inputs": ["a"], "output": "o", "limits": {"max_share": 2}})
    with pytest.raises(
        ValueError,
        match=r"unknown config key\(s\) limits\.nope; valid keys under limits: max_share",
    ):
        cfg.build(Example, {"inputs": ["a"], "output": "o", "limits": {"nope": 1}})
    with pytest.raises(ValueError, match=r"missing config key\(s\) output"):
        cfg.build(Example, {"inputs": ["a"]})
    with pytest.raises(ConfigError, match=r"limits = 3 is not allowed: expected a table"):
        cfg.build(Example, {"inputs": ["a"], "output": "o", "limits": 3})


def test_overrides_are_parsed_as_toml_values() -> None:
    data = cfg.apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=[1, 2]", "d=true", "e=hello"])
    assert data == {"a": {"b": 2, "c": [1, 2]}, "d": True, "e": "hello"}
    with pytest.raises(ValueError, match=r"expected dotted\.key=value"):
        cfg.apply_overrides({}, ["novalue"])
    with pytest.raises(ValueError, match="a is not a table"):
        cfg.apply_overrides({"a": 1}, ["a.b=2"])


def test_none_sets_an_optional_key_back_to_none() -> None:
    """Where None is allowed ("(or none)" in the error), `--set key=none` (or null, any case)
    gives None, string keys too; a key that may not be unset refuses it by name; a quoted
    "none" is the string. `--key none` gives None on a number flag that may be unset, and a
    bad number still reads as argparse words it ("invalid float value")."""
    base = {"inputs": ["a"], "output": "o", "rate": 2.0}
    for word in ("none", "null", "None"):
        data = cfg.apply_overrides(base, [f"rate={word}"])
        assert cfg.build(Example, data).rate is None
    with pytest.raises(ConfigError, match=r"size = None is not allowed: expected an integer"):
        cfg.build(Example, cfg.apply_overrides(base, ["size=none"]))
    assert cfg.build(Example, cfg.apply_overrides(base, ['output="none"'])).output == "none"
    assert cfg.apply_overrides({}, ["path=none"]) == {"path": None}  # a `str | None` key
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, Example)
    args = parser.parse_args(["a", "--output", "o", "--rate", "none"])
    assert cfg.from_args(Example, args).rate is None
    args = parser.parse_args(["a", "--output", "o", "--rate", "0.5"])
    assert cfg.from_args(Example, args).rate == 0.5


def test_a_bad_number_flag_is_named_as_argparse_names_it(capsys) -> None:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, Example)
    with pytest.raises(SystemExit):
        parser.parse_args(["a", "--output", "o", "--rate", "fast"])
    assert "invalid float value: 'fast'" in capsys.readouterr().err


def test_load_file_names_the_file_of_a_syntax_error(tmp_path) -> None:
    bad = tmp_path / "run.toml"
    bad.write_text("x = [1,\n")
    with pytest.raises(ValueError, match=str(bad)):
        cfg.load_file(str(bad))
    good = tmp_path / "run.json"
    good.write_text('{"a": {"b": 1}}')
    assert cfg.load_file(str(good), ["a.b=3"]) == {"a": {"b": 3}}


def test_the_command_line_is_derived_from_the_config() -> None:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, Example)
    args = parser.parse_args(
        ["in1", "in2", "--output", "o", "--size", "3", "--mode", "slow", "--ids", "1", "2",
         "--no-progress", "--overwrite", "--max-share", "0.5"]
    )  # fmt: skip
    example = cfg.from_args(Example, args)
    assert example == Example(
        inputs=["in1", "in2"], output="o", size=3, mode="slow", ids=[1, 2], progress=False,
        overwrite=True, limits=Limits(max_share=0.5),
    )  # fmt: skip
    assert "--hidden" not in parser.format_help()
    assert "(default 8)" in parser.format_help()
    with pytest.raises(SystemExit):  # argparse refuses a choice outside the Literal
        parser.parse_args(["a", "--output", "o", "--mode", "medium"])
    # A value argparse accepts but the config refuses names the flag, not the field.
    args = parser.parse_args(["a", "--output", "o", "--max-share", "1.5"])
    with pytest.raises(
        ValueError, match=r"^--max-share 1\.5 is not allowed: must be >= 0 and <= 1"
    ):
        cfg.from_args(Example, args)
    assert (
        cfg.from_args(Example, parser.parse_args(["a", "--output", "o"]), hidden="y").hidden == "y"
    )


def test_a_percent_sign_in_a_help_text_reaches_the_help_verbatim() -> None:
    """argparse formats help strings with %: a field's plain-text "20%" crashed `--help` of
    experiments/quality.py (2026-12-02)."""

    @dataclass
    class Share:
        share: float = option(0.2, help="kept 20% of the rows: (a) or (b)")

    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, Share)
    text = parser.format_help()
    assert "kept 20% of the rows: (a) or (b) (default 0.2)" in " ".join(text.split())


def test_settings_collects_the_tagged_fields_of_nested_configs() -> None:
    example = Example(inputs=["a"], output="o")
    assert cfg.settings(example, "record") == {"output": "o", "size": 8, "max_share": 0.1}
