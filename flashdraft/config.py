"""Typed configs: one dataclass per command is the single source of its options.

A config is a `@dataclass(kw_only=True, slots=True)` whose fields are declared with `option`
(help, allowed range or choices, how it appears on the command line, whether it is recorded).
From that one declaration this module derives everything that used to be written out by hand:

* validation (`validate`, called from `__post_init__`): the value's type from the annotation
  and its range or choices; a bad value is one `ConfigError` line naming the key, the value
  and what is allowed;
* the command line (`add_arguments` / `from_args`): one flag per field, nested configs
  flattened, booleans as `--flag` (off by default) or `--no-flag` (on by default; its help is
  generated as the negation of the field's, which always says what *on* does);
* files and overrides (`build`, `apply_overrides`, `load_file`): a nested dict (TOML or
  JSON, plus dotted `--set a.b=v`) to the nested config, unknown keys refused by name;
* the settings a command writes into its outputs (`settings`): the fields carrying a tag.

Nothing here knows about any particular command; it imports only the standard library and
`flashdraft.storage`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import tomllib
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, Literal

from flashdraft import storage

_MISSING: Any = dataclasses.MISSING


class ConfigError(ValueError):
    """A config value that is not allowed. `key` is the field's dotted name, filled in by
    the caller that knows where the config sits (`build` prefixes section names)."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(self._text())

    def _text(self) -> str:
        return f"{self.key} = {self.value!r} is not allowed: {self.allowed}"

    def within(self, prefix: str) -> ConfigError:
        """The same error with the key under `prefix` (e.g. "optim.")."""
        return ConfigError(prefix + self.key, self.value, self.allowed)


def option(
    default: Any = _MISSING,
    *,
    help: str,
    factory: Callable[[], Any] | None = None,
    choices: tuple[Any, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    flag: str | None = None,
    positional: bool = False,
    metavar: str | None = None,
    cli: bool = True,
    tags: tuple[str, ...] = (),
    off_help: str | None = None,
) -> Any:
    """A config field: its default (or `factory`), its help, what values are allowed
    (`choices`, or bounds `ge` / `gt` / `le` / `lt`), how it is spelled on the command line
    (`flag`, default `--name-with-dashes`; `positional`; `cli=False` keeps it off the command
    line) and the `tags` under which `settings` records it.

    A boolean's `help` says what it does when on. One that is on by default appears as
    `--no-name`, whose help is `off_help` (what turning it off does) or, without one, the
    negation generated from `help` (`negated_help`). Float fields refuse inf and nan."""
    metadata = {
        "help": help,
        "off_help": off_help,
        "choices": choices,
        "bounds": {
            k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None
        },
        "flag": flag,
        "positional": positional,
        "metavar": metavar,
        "cli": cli,
        "tags": tags,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# ---- types ------------------------------------------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _optional(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _describe(tp: Any) -> str:
    inner, nullable = _optional(tp)
    origin = typing.get_origin(inner)
    if origin is Literal:
        text = "one of " + ", ".join(repr(a) for a in typing.get_args(inner))
    elif origin is list:
        (item,) = typing.get_args(inner) or (Any,)
        text = f"a list of {_describe(item).removeprefix('an ').removeprefix('a ')}s"
    elif origin is dict or inner is dict:
        text = "a table (JSON object)"
    elif inner is bool:
        text = "true or false"
    elif inner is int:
        text = "an integer"
    elif inner is float:
        text = "a number"
    elif inner is str:
        text = "a string"
    elif inner is Any:
        text = "any value"
    else:
        text = getattr(inner, "__name__", str(inner))
    return text + (" (or none)" if nullable else "")


NONE_WORDS = ("none", "null")  # unquoted, what `--set key=none` or `--key none` means: None


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, value converted where lossless: an int where a float is wanted)."""
    inner, nullable = _optional(tp)
    if value is None:
        return nullable or inner is Any, None
    origin = typing.get_origin(inner)
    if inner is Any:
        return True, value
    if origin is Literal:
        return value in typing.get_args(inner), value
    if inner is bool:
        return isinstance(value, bool), value
    if inner is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if inner is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if inner is str:
        return isinstance(value, str), value
    if origin is list:
        if not isinstance(value, list | tuple):
            return False, value
        (item,) = typing.get_args(inner) or (Any,)
        out = []
        for element in value:
            ok, element = _coerce(element, item)
            if not ok:
                return False, value
            out.append(element)
        return True, out
    if origin is dict or inner is dict:
        return isinstance(value, dict), value
    if _is_config(inner):
        return isinstance(value, inner), value
    return True, value


def _bounds_text(bounds: dict[str, float]) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return " and ".join(f"{words[k]} {v:g}" for k, v in bounds.items())


def _finite(value: Any) -> bool:
    """False for an inf or nan float (or a list holding one): no option means "unbounded" by
    inf, and a nan compares false with every bound."""
    items = value if isinstance(value, list) else [value]
    return all(math.isfinite(x) for x in items if isinstance(x, float))


def _check_bounds(value: Any, bounds: dict[str, float]) -> bool:
    items = value if isinstance(value, list) else [value]
    for x in items:
        if isinstance(x, float) and math.isnan(x):
            return False
        if not all(
            (k == "ge" and x >= b)
            or (k == "gt" and x > b)
            or (k == "le" and x <= b)
            or (k == "lt" and x < b)
            for k, b in bounds.items()
        ):
            return False
    return True


def validate(config: Any) -> None:
    """Check every field of `config` against its annotation, choices and bounds (and convert
    ints given for floats). Call from `__post_init__`; raises ConfigError for the first bad
    field. Nested configs validated themselves when they were built."""
    cls: type = type(config)
    hints = _hints(cls)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        tp = hints[f.name]
        ok, converted = _coerce(value, tp)
        if not ok:
            raise ConfigError(f.name, value, f"expected {_describe(tp)}")
        if not _finite(converted):
            raise ConfigError(f.name, value, "must be a finite number (not inf or nan)")
        if converted is not value:
            object.__setattr__(config, f.name, converted)
        if converted is None:
            continue
        choices = f.metadata.get("choices")
        if choices is not None:
            items = converted if isinstance(converted, list) else [converted]
            if any(x not in choices for x in items):
                raise ConfigError(f.name, value, "one of " + ", ".join(map(repr, choices)))
        bounds = f.metadata.get("bounds")
        numeric = isinstance(converted, int | float | list) and not isinstance(converted, bool)
        if bounds and numeric and not _check_bounds(converted, bounds):
            raise ConfigError(f.name, value, f"must be {_bounds_text(bounds)}")


# ---- files and overrides ---------------------------------------------------------------


def build(cls: type, data: Any, where: str = "") -> Any:
    """A (nested) config from a dict, with errors naming the bad key: unknown keys with the
    valid ones, wrong values with what is allowed, missing required keys."""
    if not isinstance(data, dict):
        raise ConfigError(where.rstrip(".") or "config", data, "expected a table")
    hints = _hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(f'{where}{k}' for k in unknown)}; "
            f"valid keys{' under ' + where.rstrip('.') if where else ''}: {', '.join(sorted(known))}"
        )
    missing = [
        n
        for n, f in known.items()
        if n not in data and f.default is _MISSING and f.default_factory is _MISSING
    ]
    if missing:
        raise ValueError(
            f"missing config key(s) {', '.join(where + n for n in missing)} (required)"
        )
    kwargs = {}
    for name, value in data.items():
        inner, _ = _optional(hints[name])
        kwargs[name] = build(inner, value, f"{where}{name}.") if _is_config(inner) else value
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.within(where) from None


def _parse_value(text: str) -> Any:
    """A --set value as TOML (numbers, booleans, arrays, quoted strings), an unquoted none or
    null as None (TOML has no null; a key that may be unset takes it, any other key refuses
    it by name), else a bare string."""
    if text.lower() in NONE_WORDS:
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`a.b=c` overrides onto a nested dict (a new dict; the input is not modified)."""
    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected dotted.key=value")
        node = out
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part} is not a table")
        node[leaf] = _parse_value(value.strip())
    return out


def load_file(url: str | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A TOML (or .json) file as a dict, plus dotted overrides; errors name the file."""
    data: dict[str, Any] = {}
    if url is not None:
        text = storage.read_text(url)
        try:
            data = json.loads(text) if url.endswith(".json") else tomllib.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{url}: {err}") from None
    return apply_overrides(data, overrides or [])


def to_dict(config: Any) -> dict[str, Any]:
    result: dict[str, Any] = dataclasses.asdict(config)
    return result


def settings(config: Any, tag: str) -> dict[str, Any]:
    """The fields of `config` tagged `tag`, nested configs flattened into the same dict (the
    settings a command records in its outputs and compares on resume)."""
    out: dict[str, Any] = {}
    for f, value in _leaves(config):
        if tag in f.metadata.get("tags", ()):
            out[f.name] = copy.deepcopy(value)
    return out


def _leaves(config: Any) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _leaves(value)
        else:
            yield f, value


# ---- the command line -------------------------------------------------------------------


def _flat_fields(cls: type) -> Iterator[tuple[tuple[str, ...], dataclasses.Field[Any], Any]]:
    """(path of nested field names, field, type) of every leaf field, nested configs
    flattened (their field names must not clash with the parent's)."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        inner, _ = _optional(hints[f.name])
        if _is_config(inner):
            for path, leaf, tp in _flat_fields(inner):
                yield (f.name, *path), leaf, tp
        else:
            yield (f.name,), f, hints[f.name]


def flag_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not _MISSING:
        return f.default
    factory: Any = f.default_factory
    return _MISSING if factory is _MISSING else factory()


def negated_help(f: dataclasses.Field[Any]) -> str:
    """The help of a boolean's `--no-` flag: its `off_help`, else generated from the help
    that says what the option does when on, so the two can never contradict each other."""
    meta = f.metadata
    return meta.get("off_help") or f"turn off (on by default): {meta.get('help', '')}"


def _scalar_parser(tp: Any) -> Callable[[str], Any] | None:
    inner, nullable = _optional(tp)
    if typing.get_origin(inner) is Literal:
        args = typing.get_args(inner)
        return type(args[0]) if args else str
    if inner in (int, float) and nullable:
        number = typing.cast(Callable[[str], Any], inner)

        def number_or_none(text: str) -> Any:
            return None if text.lower() in NONE_WORDS else number(text)

        number_or_none.__name__ = number.__name__  # argparse names it: "invalid int value"
        return number_or_none
    if inner in (int, float, str):
        return typing.cast(Callable[[str], Any], inner)
    if typing.get_origin(inner) is dict or inner is dict:
        return json.loads
    return None


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One command-line argument per leaf field of `cls` (dest = the field's name)."""
    for _, f, tp in _flat_fields(cls):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        default = _default(f)
        inner, _ = _optional(tp)
        choices = meta.get("choices")
        if choices is None and typing.get_origin(inner) is Literal:
            choices = typing.get_args(inner)
        help_ = meta.get("help", "").replace("%", "%%")  # argparse formats help with %
        kwargs: dict[str, Any] = {"help": help_, "dest": f.name}
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if inner is bool:
            flag = meta.get("flag") or ("--no-" if default is True else "--") + f.name.replace(
                "_", "-"
            )
            action = "store_false" if default is True else "store_true"
            if default is True:
                kwargs["help"] = negated_help(f).replace("%", "%%")
            parser.add_argument(flag, action=action, default=default, **kwargs)
            continue
        if typing.get_origin(inner) is list:
            (item,) = typing.get_args(inner) or (str,)
            kwargs["nargs"] = "+"
            kwargs["type"] = _scalar_parser(item) or str
        else:
            kwargs["type"] = _scalar_parser(tp) or str
        if choices is not None:
            kwargs["choices"] = choices
        if meta.get("positional"):
            kwargs.pop("dest")
            if default is not _MISSING:
                kwargs["nargs"] = "?" if "nargs" not in kwargs else "*"
                kwargs["default"] = default
            parser.add_argument(f.name, **kwargs)
            continue
        if default is _MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
            if default not in (None, [], {}):
                kwargs["help"] = f"{help_} (default %(default)s)"
        parser.add_argument(flag_name(f), **kwargs)


def from_args(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """The config of `cls` from parsed arguments (`add_arguments(parser, cls)`); `fixed`
    fills fields kept off the command line. Errors name the flag, not the field."""
    flags = {f.name: flag_name(f) for _, f, _ in _flat_fields(cls)}
    try:
        return _from_namespace(cls, vars(args), fixed)
    except ConfigError as err:
        leaf = err.key.rsplit(".", 1)[-1]
        raise ValueError(
            f"{flags.get(leaf, err.key)} {err.value!r} is not allowed: {err.allowed}"
        ) from None


def _from_namespace(cls: type, values: dict[str, Any], fixed: dict[str, Any]) -> Any:
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        inner, _ = _optional(hints[f.name])
        if _is_config(inner):
            kwargs[f.name] = _from_namespace(inner, values, fixed)
        elif f.name in fixed:
            kwargs[f.name] = fixed[f.name]
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)
