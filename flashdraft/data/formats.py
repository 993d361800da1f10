"""Input records -> one canonical conversation form, or a reason to reject the record.

Accepted record shapes (one JSON object per line):

* OpenAI `messages`: `{"messages": [{"role": "system|user|assistant|tool", "content": ...,
  "reasoning_content": ...}, ...]}`; assistant thinking either in `reasoning_content`
  (or `reasoning`) or inline as `<think>...</think>` at the start of `content`.
* ShareGPT `conversations`: `{"conversations": [{"from": "human|gpt|system|tool", "value": ...}]}`.
* prompt/completion: `{"prompt": str | messages, "completion" | "response": str | messages,
  "reasoning": str?, "system": str?}`, e.g. a target's regenerated completions (a list
  completion is TRL's conversational form: the assistant and tool turns that follow). Only
  the completion is trained: assistant turns inside the prompt are context
  (`Message.trained`).

A record may also carry `tools` (function schemas) for the chat template: `record_tools`,
and its own `id` (`record_id`), which must be unique within a dataset.
Empty reasoning (`""`, `<think>\n\n</think>`) is no reasoning: it is never trained.

`parse_record` reads a conversation to train on (it has an assistant turn); `parse_prompt`
reads one to answer, which may end in a user or tool turn (`flashdraft generate`, `eval`).
`read_conversations` yields `(source, conversation_or_error)` for every line, so a bad line is
counted and reported (file:line and reason), never fatal and never silently dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from flashdraft.storage import iter_lines

ROLES = ("system", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    "ipython": "tool",
}
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


class RecordError(ValueError):
    """A record that cannot become a training conversation; the message is the reason."""


@dataclass(slots=True)
class Message:
    role: str
    content: str
    reasoning: str | None = None
    # Extra fields a chat template may read (tool_calls, name, tool_call_id, ...), kept as-is.
    extra: dict[str, Any] = field(default_factory=dict)
    # False for an assistant turn that is context, not a target to learn: the turns inside a
    # prompt/completion record's prompt (what `generate` writes: only the completion is the
    # target's own text).
    trained: bool = True

    def to_openai(self, *, with_reasoning: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content, **self.extra}
        if with_reasoning and self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        return out


Conversation = list[Message]


def _text(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    # OpenAI content parts: [{"type": "text", "text": ...}, ...]
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        texts = [p.get("text") for p in value if p.get("type", "text") == "text"]
        if len(texts) != len(value) or not all(isinstance(t, str) for t in texts):
            raise RecordError(f"{where}: only text content parts are supported")
        return "".join(t for t in texts if isinstance(t, str))
    raise RecordError(f"{where}: content must be a string, got {type(value).__name__}")


def _split_think(content: str) -> tuple[str | None, str]:
    """Inline `<think>...</think>` at the start of an assistant turn -> (reasoning, answer)."""
    match = _THINK.match(content)
    if match is None:
        return None, content
    return match.group(1).strip("\n"), content[match.end() :]


def _message(raw: Any, index: int) -> Message:
    if not isinstance(raw, dict):
        raise RecordError(f"message {index} is not an object")
    role = raw.get("role")
    if role not in ROLES:
        raise RecordError(f"message {index} has unknown or missing role {role!r}")
    content = _text(raw.get("content"), f"message {index}")
    extra = {k: v for k, v in raw.items() if k not in ("role", "content", *REASONING_KEYS)}
    # The first non-null of the names in use (OpenAI-style dumps carry explicit nulls).
    reasoning = next((raw[k] for k in REASONING_KEYS if raw.get(k) is not None), None)
    if reasoning is not None and not isinstance(reasoning, str):
        raise RecordError(f"message {index}: reasoning must be a string")
    if role == "assistant" and not (reasoning or "").strip():
        inline, content = _split_think(content)
        reasoning = reasoning if inline is None else inline
    if role != "assistant" or (reasoning is not None and not reasoning.strip()):
        reasoning = None
    return Message(role, content, reasoning, extra)


def _sharegpt(turns: Any) -> Conversation:
    if not isinstance(turns, list):
        raise RecordError("'conversations' must be a list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError(f"turn {i} is not an object")
        speaker = turn.get("from")
        role = SHAREGPT_ROLES.get(str(speaker).lower()) if speaker is not None else None
        if role is None:
            raise RecordError(f"turn {i} has unknown or missing speaker {speaker!r}")
        messages.append(_message({"role": role, "content": turn.get("value")}, i))
    return messages


def _prompt_messages(record: dict[str, Any]) -> Conversation:
    prompt = record["prompt"]
    if isinstance(prompt, str):
        messages = [Message("user", prompt)]
    elif isinstance(prompt, list):
        messages = [_message(m, i) for i, m in enumerate(prompt)]
    else:
        raise RecordError("'prompt' must be a string or a list of messages")
    system = record.get("system")
    if isinstance(system, str) and not (messages and messages[0].role == "system"):
        messages.insert(0, Message("system", system))
    return messages


def _prompt_completion(record: dict[str, Any]) -> Conversation:
    completion = record.get("completion", record.get("response"))
    if completion is None:
        raise RecordError("prompt record has no 'completion' or 'response'")
    messages = _prompt_messages(record)
    for message in messages:  # the prompt is context: its assistant turns are never trained
        message.trained = message.role != "assistant"
    if isinstance(completion, list):
        return [*messages, *(_message(m, len(messages) + i) for i, m in enumerate(completion))]
    # The record's reasoning, under any of its names, by the same first-non-null rule.
    reasoning = {k: record[k] for k in REASONING_KEYS if k in record}
    answer = _message({"role": "assistant", "content": completion, **reasoning}, len(messages))
    return [*messages, answer]


def validate(messages: Conversation, *, open_turn: bool = False) -> Conversation:
    """Structural checks every trainer needs; raises RecordError with the reason.

    `open_turn`: the conversation is a prompt, followed by an assistant turn still to be
    generated; it must admit that turn, and needs no assistant turn of its own.
    """
    if not messages:
        raise RecordError("conversation is empty")
    for i, m in enumerate(messages):
        if m.role == "system" and i != 0:
            raise RecordError(f"system message at position {i} (only the first may be system)")
    body = messages[1:] if messages[0].role == "system" else messages
    if not body or body[0].role != "user":
        raise RecordError("conversation must start with a user turn (after an optional system)")
    previous = "system"
    for i, m in enumerate(body):
        if m.role == "user" and previous == "user":
            raise RecordError(f"two user turns in a row at turn {i} (turns must alternate)")
        if m.role == "assistant" and previous == "assistant" and "tool_calls" not in m.extra:
            raise RecordError(f"two assistant turns in a row at turn {i} (turns must alternate)")
        if m.role == "tool" and previous not in ("assistant", "tool"):
            raise RecordError(f"tool turn {i} does not follow an assistant turn")
        empty = not m.content.strip() and not (m.reasoning or "").strip()
        if m.role == "assistant" and empty and "tool_calls" not in m.extra:
            raise RecordError(f"assistant turn {i} is empty")
        previous = m.role
    if open_turn:
        if previous == "assistant":
            raise RecordError(
                f"two assistant turns in a row at turn {len(body)} (turns must alternate)"
            )
    elif not any(m.role == "assistant" for m in messages):
        raise RecordError("conversation has no assistant turn to learn from")
    return messages


def _listed_messages(record: dict[str, Any]) -> Conversation:
    """The turns of a `messages` or `conversations` record (the former wins)."""
    if "messages" in record:
        raw = record["messages"]
        if not isinstance(raw, list):
            raise RecordError("'messages' must be a list")
        return [_message(m, i) for i, m in enumerate(raw)]
    return _sharegpt(record["conversations"])


def _check_object(record: Any) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise RecordError(f"record is a JSON {type(record).__name__}, not an object")
    return record


def parse_record(record: Any) -> Conversation:
    """One JSON value -> a validated conversation to train on (raises RecordError)."""
    record = _check_object(record)
    if "messages" in record or "conversations" in record:
        messages = _listed_messages(record)
    elif "prompt" in record:
        messages = _prompt_completion(record)
    else:
        raise RecordError("record has none of 'messages', 'conversations' or 'prompt'")
    return validate(messages)


def parse_prompt(record: Any) -> Conversation:
    """One JSON value -> a validated conversation to answer (raises RecordError).

    Read as `parse_record` reads it (same shapes, same precedence), except that it may end
    in a user or tool turn, which asks for the next assistant turn: a chat whose last turn
    is not the assistant's, or a prompt record without a completion. A conversation that
    ends in an assistant turn is returned whole (its assistant turns may be regenerated).
    """
    record = _check_object(record)
    if "messages" in record or "conversations" in record:
        messages = _listed_messages(record)
        open_turn = bool(messages) and messages[-1].role != "assistant"
    elif "prompt" in record and "completion" not in record and "response" not in record:
        messages, open_turn = _prompt_messages(record), True
    else:
        return parse_record(record)
    return validate(messages, open_turn=open_turn)


def record_tools(record: Any) -> list[dict[str, Any]] | None:
    """The function schemas a record offers the assistant (`tools`), for the chat template."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is None:
        return None
    if isinstance(tools, str):  # some exports store the schema list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise RecordError("'tools' is a string that is not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError("'tools' must be a list of function schemas")
    return tools or None


def record_id(record: Any) -> str | None:
    """A record's own `id` (a non-empty string or an integer), as text; None without one."""
    own = record.get("id") if isinstance(record, dict) else None
    if isinstance(own, str | int) and not isinstance(own, bool) and str(own):
        return str(own)
    return None


def parse_line(raw: bytes) -> Any:
    """Raw JSONL bytes -> JSON value; RecordError for bad UTF-8 or bad JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RecordError(f"invalid UTF-8 at byte {err.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise RecordError(f"malformed JSON: {err.msg} at column {err.colno}") from None
    except RecursionError:
        raise RecordError("JSON nested too deeply") from None


def read_records(url: str) -> Iterator[tuple[str, Any]]:
    """(source "url:line", JSON value or RecordError) for every non-blank line of a JSONL file."""
    for number, raw in iter_lines(url):
        if not raw.strip():
            continue
        source = f"{url}:{number}"
        try:
            yield source, parse_line(raw)
        except RecordError as err:
            yield source, err


def read_conversations(url: str) -> Iterator[tuple[str, Conversation | RecordError]]:
    for source, value in read_records(url):
        if isinstance(value, RecordError):
            yield source, value
            continue
        try:
            yield source, parse_record(value)
        except RecordError as err:
            yield source, err
