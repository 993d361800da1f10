"""experiments/held_out_wide.py: the reference split's held-out chat prompts without the cap, and a
chat eval set of one prompt per held-out conversation."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from helpers import script_modules

from flashdraft.data.sources import SourcesConfig, build_prompts, is_held_out


@pytest.fixture(scope="module")
def wide() -> ModuleType:
    return script_modules("experiments", "held_out_wide")["held_out_wide"]


def conversations(count: int) -> list[dict]:
    """`count` chats of three rounds, openings long enough to count as prompts."""
    return [
        {
            "id": f"c{i}",
            "messages": [
                m
                for turn in range(3)
                for m in (
                    {"role": "user", "content": f"conversation {i}, question number {turn}?"},
                    {"role": "assistant", "content": f"answer {turn} of {i}"},
                )
            ],
        }
        for i in range(count)
    ]


def held_out_file(chats: list[dict], out: Path, **settings: int) -> list[dict]:
    """`build-prompts`' own held-out chat file for `chats` (no HumanEval, no code)."""
    config = SourcesConfig(output=str(out), **settings)
    build_prompts(config, conversations=chats, humaneval=[], code_roots=[])
    return [json.loads(line) for line in (out / "held_out" / "chat.jsonl").open()]


def test_the_cap_is_lifted_and_the_file_is_the_one_build_prompts_writes(
    wide: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chats = conversations(4000)  # ~200 held out, ~600 held-out prompts: over the cap of 500
    held = wide.wide_held_out(chats)
    expected = {c["id"] for c in chats if is_held_out(c["id"], 0, 0.05)}
    assert {p["source"] for p in held} == expected and len(held) == 3 * len(expected)
    assert len(held) > SourcesConfig(output="unused").max_held_out
    # what build-prompts writes without the cap, in its order; with it, a part of that
    assert held == held_out_file(chats, tmp_path / "whole", max_held_out=10**9)
    capped = held_out_file(chats, tmp_path / "capped")
    assert len(capped) == 500 and all(p in held for p in capped)

    monkeypatch.setattr(wide.assets, "chitchat_conversations", lambda: chats)
    argv = [
        "--out",
        str(tmp_path / "out"),
        "--capped",
        str(tmp_path / "capped/held_out/chat.jsonl"),
    ]
    assert wide.main([*argv, "-n", "5"]) == 0
    picked = [json.loads(line) for line in (tmp_path / "out" / "chat_wide_5.jsonl").open()]
    assert len({p["source"] for p in picked}) == 5  # one prompt a conversation
    written = (tmp_path / "out" / "chat_wide_all.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in written] == held
    # a file from another split (here: another seed) is refused with a one-line reason
    assert wide.main([*argv, "--seed", "1"]) == 1
