"""Input records -> conversations, and every kind of bad record as a counted RecordError."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import zstandard

from flashdraft.data.formats import (
    Message,
    RecordError,
    parse_line,
    parse_prompt,
    parse_record,
    read_conversations,
    read_records,
    record_id,
    record_tools,
)


def test_openai_messages_with_reasoning_field_and_inline_think() -> None:
    conversation = parse_record(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            ]
        }
    )
    assert [m.role for m in conversation] == ["system", "user", "assistant", "user", "assistant"]
    assert conversation[1].content == "Hi"
    assert (conversation[2].reasoning, conversation[2].content) == ("greet", "Hello")
    assert (conversation[4].reasoning, conversation[4].content) == ("add", "4")


def test_empty_reasoning_is_no_reasoning() -> None:
    for assistant in (
        {"role": "assistant", "content": "<think>\n\n</think>\n\nOK."},
        {"role": "assistant", "content": "OK.", "reasoning_content": "  "},
        # OpenAI-style dumps carry explicit nulls; the next name in use still counts.
        {"role": "assistant", "content": "OK.", "reasoning_content": None, "reasoning": ""},
    ):
        (_, answer) = parse_record({"messages": [{"role": "user", "content": "hi"}, assistant]})
        assert (answer.reasoning, answer.content) == (None, "OK.")


@pytest.mark.parametrize(
    "reasoning",
    [
        {"reasoning": None, "reasoning_content": "plan"},  # an explicit null does not hide it
        {"thinking": "plan"},
        {"reasoning_content": "plan"},
    ],
)
def test_prompt_completion_reasoning_under_any_of_its_names(reasoning: dict) -> None:
    (_, answer) = parse_record({"prompt": "hi", "completion": "hello", **reasoning})
    assert (answer.reasoning, answer.content) == ("plan", "hello")


def test_sharegpt_and_prompt_completion_forms() -> None:
    sharegpt = parse_record(
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    )
    assert sharegpt == [Message("user", "hi"), Message("assistant", "hello")]
    completion = parse_record(
        {"prompt": "hi", "response": "hello", "reasoning": "think", "system": "sys"}
    )
    assert completion == [
        Message("system", "sys"),
        Message("user", "hi"),
        Message("assistant", "hello", "think"),
    ]
    # TRL's conversational form: prompt and completion are both message lists.
    trl = parse_record(
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "completion": [{"role": "assistant", "content": "hello"}],
        }
    )
    assert trl == [Message("user", "hi"), Message("assistant", "hello")]


def test_tools_are_read_from_the_record() -> None:
    schema = {"type": "function", "function": {"name": "f"}}
    assert record_tools({"tools": [schema]}) == [schema]
    assert record_tools({"tools": json.dumps([schema])}) == [schema]
    assert record_tools({"messages": []}) is None
    with pytest.raises(RecordError, match="tools"):
        record_tools({"tools": "not json"})


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ([1, 2], "not an object"),
        ({"text": "hi"}, "none of 'messages'"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "unknown or missing role"),
        ({"messages": [{"content": "x"}]}, "unknown or missing role"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown or missing speaker"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "must start with a user turn"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
            "two user turns in a row",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]},
            "assistant turn 1 is empty",
        ),
        ({"messages": [{"role": "user", "content": "a"}]}, "no assistant turn"),
        ({"prompt": "a"}, "no 'completion' or 'response'"),
        ({"messages": [{"role": "user", "content": {"x": 1}}]}, "content must be a string"),
    ],
)
def test_bad_records_name_their_reason(record: Any, reason: str) -> None:
    with pytest.raises(RecordError, match=reason):
        parse_record(record)


def test_prompts_may_end_in_a_user_or_tool_turn() -> None:
    user = {"role": "user", "content": "Hi"}
    hello = {"role": "assistant", "content": "Hello"}
    (only,) = parse_prompt({"messages": [user]})
    assert (only.role, only.content) == ("user", "Hi")
    assert [m.role for m in parse_prompt({"messages": [user, hello, user]})] == [
        "user",
        "assistant",
        "user",
    ]
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}
    tool = {"role": "tool", "content": "42"}
    assert [m.role for m in parse_prompt({"messages": [user, call, tool]})][-1] == "tool"
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
        ]
    }
    assert [m.role for m in parse_prompt(sharegpt)] == ["system", "user"]
    # A prompt record without a completion, in either prompt form.
    assert parse_prompt({"prompt": "Hi", "system": "Be brief."}) == [
        Message("system", "Be brief."),
        Message("user", "Hi"),
    ]
    assert parse_prompt({"prompt": [user]}) == [Message("user", "Hi")]
    # Whole conversations are read as parse_record reads them.
    whole = {"messages": [user, hello]}
    assert parse_prompt(whole) == parse_record(whole)
    done = {"prompt": "Hi", "completion": "Hello"}
    assert parse_prompt(done) == parse_record(done)


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ([1], "not an object"),
        ({"text": "hi"}, "none of 'messages'"),
        ({"messages": []}, "conversation is empty"),
        ({"messages": [{"role": "system", "content": "s"}]}, "must start with a user turn"),
        # Nothing to answer after an assistant turn of the prompt itself.
        ({"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
         "two assistant turns in a row at turn 2"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
         "two user turns in a row"),
        ({"prompt": "a", "completion": None}, "no 'completion' or 'response'"),
    ],
)  # fmt: skip
def test_bad_prompts_name_their_reason(record: Any, reason: str) -> None:
    with pytest.raises(RecordError, match=reason):
        parse_prompt(record)


def test_bad_lines() -> None:
    with pytest.raises(RecordError, match="invalid UTF-8"):
        parse_line(b'{"a": "\xff"}')
    with pytest.raises(RecordError, match="malformed JSON"):
        parse_line(b'{"a": ')
    with pytest.raises(RecordError, match="nested too deeply"):
        parse_line(b"[" * 100_000 + b"]" * 100_000)


def _lines() -> list[bytes]:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    return [json.dumps(good).encode(), b"", b"{oops", json.dumps(good).encode()]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_read_conversations_every_line_accounted(tmp_path: Path, suffix: str) -> None:
    data = b"\n".join(_lines()) + b"\n"
    if suffix.endswith(".gz"):
        data = gzip.compress(data)
    elif suffix.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"data{suffix}"
    path.write_bytes(data)
    results = list(read_conversations(str(path)))
    # The blank line 2 is not a record; line 3 is reported, not dropped.
    assert [source for source, _ in results] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert isinstance(results[1][1], RecordError)
    assert [len(r) for _, r in results if not isinstance(r, RecordError)] == [2, 2]
    assert len(list(read_records(str(path)))) == 3


def test_a_records_own_id() -> None:
    assert record_id({"id": "a#1", "prompt": "x"}) == "a#1"
    assert record_id({"id": 7}) == "7"
    for no_id in ({"id": ""}, {"id": True}, {"id": None}, {"id": [1]}, {}, ["id"]):
        assert record_id(no_id) is None, no_id


def test_a_byte_order_mark_does_not_reject_the_first_record(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "q", "completion": "a"}).encode())
    ((source, conversation),) = read_conversations(str(path))
    assert source == f"{path}:1" and not isinstance(conversation, RecordError)
