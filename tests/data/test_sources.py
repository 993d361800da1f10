"""The reference recipe's prompts: held-out split by source, nothing held out trained on."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from flashdraft import assets
from flashdraft.data.formats import parse_prompt
from flashdraft.data.sources import (
    SourcesConfig,
    build_prompts,
    find_source_files,
    is_held_out,
    mine_functions,
    split_chat,
    split_code,
    split_humaneval,
)

FUNCTION = '''
def {name}(values, scale=2):
    """Scale every value of `values` by `scale` and return them as a new list."""
    out = [v * scale for v in values]
    return out + [{k}]
'''


def _config(tmp_path: Path, **overrides: object) -> SourcesConfig:
    return SourcesConfig(output=str(tmp_path / "out"), **overrides)  # type: ignore[arg-type]


def _chat(n: int) -> list[dict]:
    """n conversations of 3 rounds; the first user turn repeats every 10 conversations."""
    out = []
    for i in range(n):
        messages = []
        for r in range(3):
            first = f"Opening question number {i % 10} about the weather?"
            messages.append({"role": "user", "content": first if r == 0 else f"u{i}.{r} ok"})
            messages.append({"role": "assistant", "content": f"answer {i}.{r} " + "x" * 40})
        out.append({"id": f"conv/{i}", "messages": messages})
    return out


def _held_out_keys(records: list[dict]) -> set[str]:
    return {json.dumps(r["messages"]).lower() for r in records}


def test_the_split_is_a_fixed_function_of_seed_and_source() -> None:
    ids = [f"source/{i}" for i in range(20000)]
    held = {i for i in ids if is_held_out(i, 0, 0.05)}
    assert 0.04 < len(held) / len(ids) < 0.06
    assert held == {i for i in ids if is_held_out(i, 0, 0.05)}  # deterministic
    assert held != {i for i in ids if is_held_out(i, 1, 0.05)}  # the seed decides
    assert held <= {i for i in ids if is_held_out(i, 0, 0.10)}  # a larger share only adds
    assert not any(is_held_out(i, 0, 0.0) for i in ids)
    assert all(is_held_out(i, 0, 1.0) for i in ids)


def test_no_held_out_conversation_or_its_duplicate_is_trained_on(tmp_path: Path) -> None:
    conversations = _chat(200)
    split = split_chat(conversations, _config(tmp_path, held_out_chat=0.3))
    held = set(split.held_out_sources)
    assert 30 < len(held) < 90 and split.sources == 200
    assert not held & {r["source"] for r in split.train}
    assert {r["source"] for r in split.held_out} <= held
    # The repeated opening turns: those of held-out conversations are never trained on.
    assert not _held_out_keys(split.train) & _held_out_keys(split.held_out)
    assert split.skipped["duplicate prompt"] > 0
    # Also when the held-out side is capped: its conversations still keep their prompts out.
    capped = split_chat(conversations, _config(tmp_path, held_out_chat=0.3, max_held_out=0))
    assert capped.held_out == [] and capped.held_out_sources == split.held_out_sources
    assert not _held_out_keys(capped.train) & _held_out_keys(split.held_out)
    # Every user turn is a prompt or counted as skipped, exactly once.
    user_turns = 200 * 3
    assert len(split.train) + len(split.held_out) + sum(split.skipped.values()) == user_turns


def test_chat_prompts_end_in_a_user_turn_with_their_context(tmp_path: Path) -> None:
    config = _config(tmp_path, max_context_chars=120, min_opening_chars=20, min_turn_chars=3)
    conversation = {
        "id": "c",
        "messages": [
            {"role": "user", "content": "Hi!"},  # an opening too short to answer
            {"role": "assistant", "content": "Hello, how can I help you today?"},
            {"role": "user", "content": "ok"},  # too short
            {"role": "assistant", "content": "Alright."},
            {"role": "user", "content": "Tell me about the long history of tea in China."},
            {"role": "assistant", "content": "y" * 100},
            {"role": "user", "content": "And in Japan?"},
        ],
    }
    split = split_chat([conversation], config)
    prompts = split.train + split.held_out
    assert [p["id"] for p in sorted(prompts, key=lambda p: p["id"])] == ["c@4", "c@6"]
    assert split.skipped == {"opening turn too short": 1, "turn too short": 1}
    for prompt in prompts:
        parsed = parse_prompt(prompt)  # what `flashdraft generate` reads
        assert parsed[0].role == "user" and parsed[-1].role == "user"
        assert sum(len(m["content"]) for m in prompt["messages"]) <= 120
    by_id = {p["id"]: p["messages"] for p in prompts}
    assert len(by_id["c@4"]) == 5  # the whole conversation before it fits
    assert by_id["c@6"] == [conversation["messages"][6]]  # earlier rounds cut to fit


def test_humaneval_tasks_are_split_whole(tmp_path: Path) -> None:
    tasks = assets.humaneval_prompts()
    split = split_humaneval(tasks, _config(tmp_path, held_out_humaneval=0.2))
    assert split.sources == 164 == len(split.train) + len(split.held_out)
    assert {r["id"] for r in split.held_out} == set(split.held_out_sources)
    assert not {r["id"] for r in split.train} & set(split.held_out_sources)
    assert 15 < len(split.held_out) < 50


def _write(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


MODULE = '''
import functools


class Box:
    def area(self, width, height):
        """Return the area of a width x height rectangle, in square units."""
        result = width * height
        return result

    def only_docstring(self):
        """A function with nothing but this docstring is skipped."""


@functools.cache
async def fetch(url, retries=3):
    """Fetch `url`, retrying up to `retries` times on a connection error."""
    for _ in range(retries):
        return url


def undocumented(x):
    return x + 1
'''


def test_mined_functions_are_well_formed_prompts(tmp_path: Path) -> None:
    config = _config(tmp_path)
    functions = {f.id.split("::")[1]: f for f in mine_functions(MODULE, "r/m.py", config)}
    assert set(functions) == {"Box.area", "fetch"}  # docstring + body only
    assert functions["fetch"].header.startswith("@functools.cache\nasync def fetch(")
    for function in functions.values():
        ast.parse(function.header)  # signature + docstring is valid Python on its own
        ast.parse(function.code)
        assert function.code.startswith(function.header)
    root = tmp_path / "root"
    _write(root, "pkg/m.py", MODULE)
    config = _config(tmp_path, held_out_code=0.0)
    split = split_code(find_source_files([("r", root)]), config)
    assert {p["id"].rsplit(":", 1)[1] for p in split.train} <= {"complete", "explain", "test"}
    for prompt in split.train:
        (message,) = parse_prompt(prompt)
        assert message.role == "user"
        task, fenced = message.content.split("\n\n", 1)
        assert (
            task.split()[0]
            == {"complete": "Complete", "explain": "Explain", "test": "Write"}[
                prompt["id"].rsplit(":", 1)[1]
            ]
        )
        assert fenced.startswith("```python\n") and fenced.endswith("```")
        code = fenced.removeprefix("```python\n").removesuffix("```")
        ast.parse(code)
        explain = prompt["id"].endswith(":explain")
        assert ("return" in code) == explain  # the body only where the task is to explain it


def test_code_files_are_deduplicated_and_split_whole(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for i in range(40):
        _write(root, f"pkg/mod{i}.py", FUNCTION.format(name=f"f{i}", k=i))
    _write(root, "pkg/_vendor/mod0.py", FUNCTION.format(name="f0", k=0))  # a vendored copy
    _write(root, "pkg/broken.py", 'def f(:\n    """Broken on purpose, and long enough."""\n')
    _write(root, "pkg/huge.py", FUNCTION.format(name="h", k=0) + "#" * 5000)
    config = _config(tmp_path, held_out_code=0.3, max_file_bytes=4000)
    split = split_code(find_source_files([("r", root)]), config)
    held = set(split.held_out_sources)
    assert not held & {r["source"] for r in split.train}
    assert {r["source"] for r in split.held_out} <= held
    assert ("r/pkg/mod0.py" in held) == ("r/pkg/_vendor/mod0.py" in held)  # copies go together
    assert split.skipped["file with the content of another (vendored copy)"] == 1
    assert split.skipped["file over max_file_bytes"] == 1
    assert split.skipped["file does not parse"] == 1
    assert len(split.train) + len(split.held_out) == 40  # one function per distinct module


def test_a_copy_of_a_held_out_file_is_held_out_too(tmp_path: Path) -> None:
    """Held out wins: a train file whose content equals a held-out file's is held out."""
    root = tmp_path / "root"
    j = next(
        j
        for j in range(1000)
        if is_held_out(f"r/x/copy{j}.py", 0, 0.3) and not is_held_out(f"r/a/orig{j}.py", 0, 0.3)
    )
    text = FUNCTION.format(name="f", k=0)
    _write(root, f"a/orig{j}.py", text)  # sorts first: the group's representative
    _write(root, f"x/copy{j}.py", text)
    split = split_code(find_source_files([("r", root)]), _config(tmp_path, held_out_code=0.3))
    assert split.train == [] and len(split.held_out) == 1
    assert split.held_out_sources == [f"r/a/orig{j}.py", f"r/x/copy{j}.py"]


def test_a_function_of_a_held_out_file_is_not_trained_on_from_another_file(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    names = [f"m{i}.py" for i in range(200)]
    held = next(n for n in names if is_held_out(f"r/{n}", 0, 0.5))
    train = next(n for n in names if not is_held_out(f"r/{n}", 0, 0.5))
    shared = FUNCTION.format(name="shared", k=7)
    _write(root, held, shared)
    _write(root, train, shared + FUNCTION.format(name="other", k=8))  # not a copy of the file
    files = find_source_files([("r", root)])
    for cap in (500, 0):  # whether or not the held-out file makes a prompt
        split = split_code(files, _config(tmp_path, held_out_code=0.5, max_held_out=cap))
        assert [p["id"].split("::")[1].rsplit(":", 1)[0] for p in split.train] == ["other"]
        assert split.skipped["function equal to a held-out one"] == 1


def test_the_split_is_stable_when_sources_are_added(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for i in range(30):
        _write(root, f"a/mod{i}.py", FUNCTION.format(name=f"f{i}", k=i))
    config = _config(tmp_path, held_out_code=0.3)
    before = split_code(find_source_files([("r", root)]), config)
    for i in range(30, 90):
        _write(root, f"b/mod{i}.py", FUNCTION.format(name=f"f{i}", k=i))
    after = split_code(find_source_files([("r", root)]), config)
    old = {f"r/a/mod{i}.py" for i in range(30)}
    assert set(before.held_out_sources) == set(after.held_out_sources) & old
    assert {p["id"] for p in before.held_out} <= {p["id"] for p in after.held_out}
    chats = _chat(50)
    grown = split_chat([*chats, *_chat(120)[50:]], config)
    assert set(split_chat(chats, config).held_out_sources) <= set(grown.held_out_sources)


def _build_config(out: Path) -> SourcesConfig:
    return SourcesConfig(output=str(out), held_out_chat=0.2, held_out_code=0.3, max_held_out=50)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("sources")
    root = tmp / "root"
    for i in range(20):
        _write(root, f"pkg/mod{i}.py", FUNCTION.format(name=f"f{i}", k=i))
    manifest = build_prompts(
        _build_config(tmp / "out"),
        conversations=assets.chitchat_conversations(limit=60),
        code_roots=[("r", root)],
    )
    return tmp / "out", manifest


def test_build_writes_the_prompt_files_and_records_the_split(built: tuple[Path, dict]) -> None:
    out, manifest = built
    recorded = json.loads((out / "split.json").read_text())
    assert recorded == manifest and recorded["settings"]["seed"] == 0
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert recorded["files"]["train.jsonl"]["records"] == len(train)
    ids = [r["id"] for r in train]
    for kind, counts in recorded["counts"].items():
        held_file = out / "held_out" / f"{kind}.jsonl"
        held = [json.loads(line) for line in held_file.read_text().splitlines()]
        kind_train = [r for r in train if r["kind"] == kind]
        assert counts["train_prompts"] == len(kind_train) > 0
        assert counts["held_out_prompts"] == len(held) > 0
        held_sources = set(recorded["held_out_sources"][kind])
        assert counts["held_out_sources"] == len(held_sources)
        assert not held_sources & {r["source"] for r in kind_train}
        assert {r["source"] for r in held} <= held_sources
        for record in [*kind_train, *held]:
            assert parse_prompt(record)[-1].role == "user"
        ids += [r["id"] for r in held]
    assert len(ids) == len(set(ids))  # ids are unique across every file


def test_building_again_gives_the_same_files(built: tuple[Path, dict], tmp_path: Path) -> None:
    _, manifest = built
    config = _build_config(tmp_path / "again")
    root = Path(manifest["code_roots"][0]["path"])
    again = build_prompts(
        config, conversations=assets.chitchat_conversations(limit=60), code_roots=[("r", root)]
    )
    assert again["files"] == manifest["files"]  # same records, same bytes (sha256)
    with pytest.raises(ValueError, match="not a directory"):
        build_prompts(config, code_roots=[("r", tmp_path / "missing")])
