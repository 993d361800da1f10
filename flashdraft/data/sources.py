"""Prompts at scale from what is on the machine, split into train and held-out by source.

The reference recipe (`experiments/quality.py`) regenerates answers to three kinds of prompts:

* `chat`: every user turn of every chitchat conversation, with the conversation before it
  as context (cut from the front, at turn boundaries, to `max_context_chars`);
* `humaneval`: the 164 HumanEval tasks;
* `code`: prompts mined from the Python sources installed here (the standard library and
  the site-packages of the running interpreter): every function with a docstring and a
  body becomes one of three tasks, "complete" (signature + docstring), "explain" (the
  whole function) or "test" (signature + docstring), picked per function by a seeded hash.

The held-out split is decided first, per *source* (a conversation, a HumanEval task, a
source file), by a seeded hash of the source's id alone: a source is held out when
sha256(seed, id) falls in the first `held_out_<kind>` share of the hash space. Adding
sources therefore never moves an existing one across the split. Nothing of a held-out
source is trained on, and duplicates cannot leak it back: a train prompt equal to a
held-out one is dropped, files with identical content form one group that is held out when
any of its files is, and a train function whose text equals a held-out function's is
dropped. Every skip is counted by reason.

Outputs in `output` (records `{"id", "source", "kind", "messages"}` ending in a user turn,
which `flashdraft generate` and `flashdraft eval` read):

    train.jsonl            every train prompt of every kind, in a seeded shuffle (any
                           prefix is a proportional sample: `generate --limit N`)
    held_out/<kind>.jsonl  the held-out prompts of one kind, in a seeded shuffle
    split.json             the settings, counts, skips and every held-out source id,
                           written last: its presence means the build is complete
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import site
import sysconfig
import textwrap
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashdraft import assets, storage
from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.log import get_logger

log = get_logger(__name__)

KINDS = ("chat", "humaneval", "code")
SPLIT_MANIFEST = "split.json"
TRAIN_FILE = "train.jsonl"
CODE_TASKS = ("complete", "explain", "test")
# The "complete" wording is HumanEval's (`assets.humaneval_prompts`), so mined completions
# look like the held-out code prompts the drafter is measured on.
_TASK_TEXT = {
    "complete": "Complete the following Python function. Reply with the code only.",
    "explain": "Explain what the following Python function does.",
    "test": "Write pytest unit tests for the following Python function. Reply with the code only.",
}
# Directories never mined: caches, and other interpreters' package trees nested in a root
# (a system Python keeps site-packages inside its standard library).
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}


@dataclass(kw_only=True, slots=True)
class SourcesConfig:
    """How the reference recipe's prompts are built (`build_prompts`)."""

    output: str = option(metavar="DIR", help="where train.jsonl, held_out/ and split.json go")
    seed: int = option(0, help="seeds the held-out split and the order of the prompts")
    held_out_chat: float = option(0.05, ge=0, le=1, help="share of chitchat conversations held out")
    held_out_humaneval: float = option(0.2, ge=0, le=1, help="share of HumanEval tasks held out")
    held_out_code: float = option(0.05, ge=0, le=1, help="share of Python source files held out")
    max_chat: int | None = option(
        None, ge=0, help="train chat prompts at most (whole conversations; None: all)"
    )
    max_code: int = option(20000, ge=0, help="train prompts mined from Python sources at most")
    max_held_out: int = option(500, ge=0, help="held-out prompts per kind at most")
    min_opening_chars: int = option(
        20,
        ge=0,
        help="shortest first turn of a conversation (a bare 'Hello!' gets the same answer "
        "every time)",
    )
    min_turn_chars: int = option(2, ge=0, help="shortest later user turn")
    max_context_chars: int = option(
        3000, ge=1, help="longest chat prompt; earlier turns are dropped to fit"
    )
    code_roots: list[str] | None = option(
        None, help="directories to mine (None: the standard library and site-packages)"
    )
    code_tasks: list[str] = option(
        factory=lambda: list(CODE_TASKS), choices=CODE_TASKS, help="tasks made of functions"
    )
    max_file_bytes: int = option(300_000, ge=1, help="larger source files are skipped")
    max_function_chars: int = option(3000, ge=1, help="longer functions are skipped")
    min_docstring_chars: int = option(20, ge=0, help="shorter docstrings are skipped")
    max_functions_per_file: int = option(8, ge=1, help="functions taken from one file at most")

    def __post_init__(self) -> None:
        cfg.validate(self)
        if not self.code_tasks:
            raise cfg.ConfigError("code_tasks", self.code_tasks, f"some of {CODE_TASKS}")

    def share(self, kind: str) -> float:
        return {
            "chat": self.held_out_chat,
            "humaneval": self.held_out_humaneval,
            "code": self.held_out_code,
        }[kind]


# ---- the split ----


def _hash64(*parts: object) -> int:
    text = "\0".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def is_held_out(source: str, seed: int, share: float) -> bool:
    """Whether `source` is held out: a fixed function of (seed, id), so the split of a source
    never depends on which other sources exist."""
    return _hash64("split", seed, source) < share * 2**64


def order_key(item_id: str, seed: int) -> int:
    """A seeded shuffle position, independent of the split's hash."""
    return _hash64("order", seed, item_id)


def file_order(records: Iterable[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Prompt records in the order `build_prompts` writes them: shuffled by id (`order_key`)."""
    return sorted(records, key=lambda r: order_key(r["id"], seed))


@dataclass(slots=True)
class KindSplit:
    """The prompts of one kind on both sides of the split, and what was left out."""

    train: list[dict[str, Any]] = field(default_factory=list)
    held_out: list[dict[str, Any]] = field(default_factory=list)
    sources: int = 0
    held_out_sources: list[str] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)

    def counts(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "held_out_sources": len(self.held_out_sources),
            "train_prompts": len(self.train),
            "held_out_prompts": len(self.held_out),
            "skipped": dict(sorted(self.skipped.items())),
        }


def _record(item_id: str, source: str, kind: str, messages: list[dict[str, str]]) -> dict:
    return {"id": item_id, "source": source, "kind": kind, "messages": messages}


def _normalised(messages: list[dict[str, str]]) -> str:
    """What counts as the same prompt: case and whitespace ignored."""
    return json.dumps([(m["role"], " ".join(m["content"].lower().split())) for m in messages])


# ---- chat ----


def _chat_prompts(conversation: dict[str, Any], config: SourcesConfig, split: KindSplit) -> list:
    """(prompt id, messages) for each answerable user turn of one conversation: the turn and
    the longest tail of the conversation before it that starts with a user turn and fits
    `max_context_chars` (earlier rounds are dropped whole)."""
    out = []
    messages = [{"role": m["role"], "content": m["content"]} for m in conversation["messages"]]
    chars = [0]  # chars[i]: characters of messages[:i]
    for m in messages:
        chars.append(chars[-1] + len(m["content"]))
    start = 0  # never moves back: a later turn needs at least as much cut from the front
    for i, message in enumerate(messages):
        if message["role"] != "user":
            continue
        text = message["content"].strip()
        if i == 0 and len(text) < config.min_opening_chars:
            split.skipped["opening turn too short"] += 1
            continue
        if len(text) < config.min_turn_chars:
            split.skipped["turn too short"] += 1
            continue
        while chars[i + 1] - chars[start] > config.max_context_chars and start < i:
            start += 2  # one (user, assistant) round: the tail still starts with a user turn
        if chars[i + 1] - chars[start] > config.max_context_chars:
            split.skipped["turn longer than max_context_chars"] += 1
            continue
        out.append((f"{conversation['id']}@{i}", messages[start : i + 1]))
    return out


def split_chat(conversations: Iterable[dict[str, Any]], config: SourcesConfig) -> KindSplit:
    """Every user turn of every conversation (`{"id", "messages"}`, user first) as a prompt."""
    split = KindSplit()
    convs = sorted(conversations, key=lambda c: order_key(c["id"], config.seed))
    held = [c for c in convs if is_held_out(c["id"], config.seed, config.held_out_chat)]
    held_ids = {c["id"] for c in held}
    split.sources = len(convs)
    split.held_out_sources = sorted(held_ids)
    seen: set[str] = set()
    # Held-out first: its prompts are the ones a duplicate must never leak into train.
    for side, group, cap in (
        (split.held_out, held, config.max_held_out),
        (split.train, [c for c in convs if c["id"] not in held_ids], config.max_chat),
    ):
        for conversation in group:
            for prompt_id, messages in _chat_prompts(conversation, config, split):
                key = _normalised(messages)
                if key in seen:
                    split.skipped["duplicate prompt"] += 1
                    continue
                seen.add(key)  # also past the cap: no held-out prompt is ever trained on
                if cap is not None and len(side) >= cap:
                    split.skipped["over the prompt cap"] += 1
                    continue
                side.append(_record(prompt_id, conversation["id"], "chat", messages))
    return split


# ---- HumanEval ----


def split_humaneval(tasks: Iterable[dict[str, Any]], config: SourcesConfig) -> KindSplit:
    """HumanEval tasks (`{"id", "messages"}`), one prompt each, split by task id."""
    split = KindSplit()
    for task in sorted(tasks, key=lambda t: order_key(t["id"], config.seed)):
        split.sources += 1
        record = _record(task["id"], task["id"], "humaneval", task["messages"])
        if is_held_out(task["id"], config.seed, config.held_out_humaneval):
            split.held_out_sources.append(task["id"])
            if len(split.held_out) >= config.max_held_out:
                split.skipped["over the prompt cap"] += 1
                continue
            split.held_out.append(record)
        else:
            split.train.append(record)
    split.held_out_sources.sort()
    return split


# ---- code mined from Python sources ----


def default_code_roots() -> list[tuple[str, Path]]:
    """(name, directory): the standard library and the site-packages of this interpreter."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    for directory in [paths["purelib"], paths["platlib"], *site.getsitepackages()]:
        path = Path(directory)
        if path.is_dir() and all(path.resolve() != p.resolve() for _, p in roots):
            roots.append(("site", path))
    return roots


@dataclass(frozen=True, slots=True)
class SourceFile:
    id: str  # "<root name>/<path inside the root>": stable across machines and versions
    path: Path


def find_source_files(roots: list[tuple[str, Path]]) -> list[SourceFile]:
    """Every .py file under the roots, by id; an id found under two roots is kept once."""
    files: dict[str, SourceFile] = {}
    for name, root in roots:
        for directory, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
            for filename in sorted(names):
                if filename.endswith(".py"):
                    path = Path(directory, filename)
                    source = f"{name}/{path.relative_to(root).as_posix()}"
                    files.setdefault(source, SourceFile(source, path))
    return sorted(files.values(), key=lambda f: f.id)


@dataclass(frozen=True, slots=True)
class Function:
    id: str  # "<file id>::<qualified name>"
    header: str  # decorators, signature and docstring, dedented
    code: str  # the whole function, dedented
    fingerprint: str  # of the code with whitespace ignored: the same function anywhere


def _functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def mine_functions(text: str, file_id: str, config: SourcesConfig) -> list[Function]:
    """Functions with a docstring and a body, within the size limits (raises SyntaxError /
    ValueError for a file that does not parse)."""
    tree = ast.parse(text)
    lines = text.splitlines()
    found: list[Function] = []
    names: Counter[str] = Counter()
    for qualname, node in _functions(tree):
        doc = ast.get_docstring(node)
        end = node.end_lineno
        if doc is None or len(doc.strip()) < config.min_docstring_chars or end is None:
            continue
        if len(node.body) < 2:  # nothing to complete or explain beyond the docstring
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        doc_end = node.body[0].end_lineno or node.lineno
        code = textwrap.dedent("\n".join(lines[start - 1 : end])) + "\n"
        if len(code) > config.max_function_chars:
            continue
        header = textwrap.dedent("\n".join(lines[start - 1 : doc_end])) + "\n"
        names[qualname] += 1  # a name defined twice (if/else branches) stays unique
        suffix = f"#{names[qualname]}" if names[qualname] > 1 else ""
        fingerprint = hashlib.sha256("".join(code.split()).encode()).hexdigest()
        found.append(Function(f"{file_id}::{qualname}{suffix}", header, code, fingerprint))
    return found


def code_prompt(function: Function, task: str) -> list[dict[str, str]]:
    body = function.code if task == "explain" else function.header
    return [{"role": "user", "content": f"{_TASK_TEXT[task]}\n\n```python\n{body}```"}]


def _file_groups(
    files: list[SourceFile], config: SourcesConfig, split: KindSplit
) -> list[tuple[SourceFile, str, bool]]:
    """(representative file, its text, held out) per group of files with equal content.

    A group is held out when any of its files is; its representative is its first file id.
    """
    groups: dict[str, list[tuple[SourceFile, str]]] = {}
    for file in files:
        try:
            if file.path.stat().st_size > config.max_file_bytes:
                split.skipped["file over max_file_bytes"] += 1
                continue
            raw = file.path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            split.skipped["file unreadable or not UTF-8"] += 1
            continue
        groups.setdefault(hashlib.sha256(raw).hexdigest(), []).append((file, text))
    out = []
    for members in groups.values():
        split.skipped["file with the content of another (vendored copy)"] += len(members) - 1
        held = any(is_held_out(f.id, config.seed, config.held_out_code) for f, _ in members)
        if held:  # every copy of held-out content is held out
            split.held_out_sources.extend(f.id for f, _ in members)
        out.append((members[0][0], members[0][1], held))
    split.held_out_sources.sort()
    return sorted(out, key=lambda g: order_key(g[0].id, config.seed))


def _file_functions(
    file: SourceFile, text: str, config: SourcesConfig, split: KindSplit
) -> list[Function]:
    """The mineable functions of one file, in a seeded order ([] when it does not parse)."""
    if '"""' not in text and "'''" not in text:  # no docstrings: not worth a parse
        return []
    try:
        functions = mine_functions(text, file.id, config)
    except (SyntaxError, ValueError, RecursionError):
        split.skipped["file does not parse"] += 1
        return []
    return sorted(functions, key=lambda f: order_key(f.id, config.seed))


def split_code(files: list[SourceFile], config: SourcesConfig) -> KindSplit:
    """Prompts mined from `files`, each side in a seeded order of files until its cap.

    Every held-out file is read first, prompts or not, so that no function of one (under
    any other file name) is trained on.
    """
    split = KindSplit(sources=len(files))
    groups = _file_groups(files, config, split)
    held_fingerprints: set[str] = set()
    seen: set[str] = set()
    for held_side, side, cap in (
        (True, split.held_out, config.max_held_out),
        (False, split.train, config.max_code),
    ):
        for file, text, held in groups:
            if held != held_side:
                continue
            if not held_side and len(side) >= cap:
                break
            functions = _file_functions(file, text, config, split)
            if held_side:
                held_fingerprints.update(f.fingerprint for f in functions)
            taken = 0
            for function in functions:
                if taken == config.max_functions_per_file or len(side) >= cap:
                    break
                if not held_side and function.fingerprint in held_fingerprints:
                    split.skipped["function equal to a held-out one"] += 1
                    continue
                if function.fingerprint in seen:
                    split.skipped["duplicate function"] += 1
                    continue
                seen.add(function.fingerprint)
                tasks = config.code_tasks
                task = tasks[order_key(function.id, config.seed) % len(tasks)]
                prompt_id = f"{function.id}:{task}"
                side.append(_record(prompt_id, file.id, "code", code_prompt(function, task)))
                taken += 1
    return split


# ---- the build ----


def _write_jsonl(url: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    storage.write_bytes_atomic(url, data)
    return {"records": len(records), "sha256": hashlib.sha256(data).hexdigest()}


def build_prompts(
    config: SourcesConfig,
    *,
    conversations: list[dict[str, Any]] | None = None,
    humaneval: list[dict[str, Any]] | None = None,
    code_roots: list[tuple[str, Path]] | None = None,
) -> dict[str, Any]:
    """Build and write every prompt file and the split manifest; returns the manifest.

    The inputs default to the offline assets (`chitchat_conversations`, `humaneval_prompts`)
    and to `config.code_roots` (else `default_code_roots()`); tests pass their own.
    """
    if code_roots is None:
        code_roots = (
            [(Path(r).name, Path(r)) for r in config.code_roots]
            if config.code_roots is not None
            else default_code_roots()
        )
    missing = [str(p) for _, p in code_roots if not p.is_dir()]
    if missing:
        raise ValueError(f"code_roots: {', '.join(missing)} is not a directory")
    splits = {
        "chat": split_chat(
            conversations if conversations is not None else assets.chitchat_conversations(),
            config,
        ),
        "humaneval": split_humaneval(
            humaneval if humaneval is not None else assets.humaneval_prompts(), config
        ),
        "code": split_code(find_source_files(code_roots), config),
    }
    storage.makedirs(storage.join(config.output, "held_out"))
    train = file_order((r for s in splits.values() for r in s.train), config.seed)
    files = {TRAIN_FILE: _write_jsonl(storage.join(config.output, TRAIN_FILE), train)}
    for kind, split in splits.items():
        held = file_order(split.held_out, config.seed)
        name = f"held_out/{kind}.jsonl"
        files[name] = _write_jsonl(storage.join(config.output, name), held)
    manifest = {
        "settings": split_settings(config),
        "rule": "a source is held out iff sha256('split', seed, id)[:8] / 2**64 < held_out_<kind>",
        "code_roots": [{"name": n, "path": str(p)} for n, p in code_roots],
        "python": platform.python_version(),
        "counts": {kind: s.counts() for kind, s in splits.items()},
        "files": files,
        "held_out_sources": {kind: s.held_out_sources for kind, s in splits.items()},
    }
    storage.write_json_atomic(storage.join(config.output, SPLIT_MANIFEST), manifest)
    for kind, split in splits.items():
        c = split.counts()
        log.info(
            f"sources: {kind}: {c['sources']:,} sources ({c['held_out_sources']:,} held out) -> "
            f"{c['train_prompts']:,} train / {c['held_out_prompts']:,} held-out prompts; "
            f"skipped {sum(split.skipped.values()):,}"
        )
    return manifest


def split_settings(config: SourcesConfig) -> dict[str, Any]:
    """What decides the prompts: every setting but where they are written."""
    settings = cfg.to_dict(config)
    settings.pop("output")
    return settings
