"""bench/held_out_wide.py: the reference split's held-out chat prompts without the cap, and a
chat eval set of one prompt per held-out conversation."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from helpers import bench_modules

from flashdraft.data.sources import SourcesConfig, is_held_out, order_key, split_chat


@pytest.fixture(scope="module")
def wide() -> ModuleType:
    return bench_modules("held_out_wide")["held_out_wide"]


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


def test_every_held_out_conversation_is_taken_and_the_capped_file_is_inside(
    wide: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chats = conversations(400)
    held = wide.wide_held_out(chats)
    expected = {c["id"] for c in chats if is_held_out(c["id"], 0, 0.05)}
    assert len(expected) > 6  # the cap below keeps fewer conversations than are held out
    assert {p["source"] for p in held} == expected and len(held) == 3 * len(expected)
    assert held == sorted(held, key=lambda r: order_key(r["id"], 0))  # as a held-out file
    capped = split_chat(chats, SourcesConfig(output="unused", max_held_out=6)).held_out
    assert len({p["source"] for p in capped}) == 2 and all(p in held for p in capped)

    monkeypatch.setattr(wide.assets, "chitchat_conversations", lambda: chats)
    (tmp_path / "capped.jsonl").write_text("".join(json.dumps(p) + "\n" for p in capped))
    argv = ["--out", str(tmp_path / "out"), "-n", "5", "--capped", str(tmp_path / "capped.jsonl")]
    assert wide.main(argv) == 0
    picked = [json.loads(line) for line in (tmp_path / "out" / "chat_wide_5.jsonl").open()]
    assert len({p["source"] for p in picked}) == 5  # one prompt a conversation
    written = (tmp_path / "out" / "chat_wide_all.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in written] == held
    # a file from another split (here: another seed) is refused with a one-line reason
    assert wide.main([*argv, "--seed", "1"]) == 1
