"""The verified fast path of `template.ChatTemplate`: the same samples, far fewer renders.

Rendering every prefix costs O(turns²) template calls (a 500-message chat takes seconds
with Qwen3's template). With `turns="all"`, `FastChatTemplate` renders the full conversation
once more with private-use markers around assistant contents, which gives where the template
put each turn's content; a turn's trained text must then appear verbatim around that
position. It is taken, cheapest first,

1. from a cached rendering of a turn of the same shape with probe content (the real content
   and reasoning inserted: `_predict`),
2. from the turn rendered in a short local context (system message, a placeholder user turn,
   the tool messages since the last user turn: `_local_context`),
3. from the turn rendered in its full context, the reference's prefix rendering.

Nothing is taken on trust: each candidate must match the full text exactly, else the next
tier runs, and a template that changes the marked rendering (one that trims content) sends
the whole conversation down the reference path. Bounded caches hold the prompt renderings of
local contexts, the turn shapes, and the template's answer to "is this an empty reasoning
block". Tests check that both classes give identical samples on real chats.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from flashdraft.data.template import (
    CONTENT_CLOSE,
    CONTENT_OPEN,
    MARKERS,
    PROBE,
    REASONING_PROBE,
    ChatTemplate,
    Located,
    TemplateOptions,
    Turn,
)

_PLACEHOLDER = "Hello."
_CACHE_SIZE = 4096  # entries per cache; cleared when full


def _bounded_put(cache: dict[str, Any], key: str, value: Any) -> None:
    if len(cache) >= _CACHE_SIZE:
        cache.clear()
    cache[key] = value


def _place(turn: Turn, text: str, content_at: int) -> tuple[int, int] | None:
    """The trained text of `turn` inside `text`, aligned on the content; None if absent."""
    shift = content_at - turn.content
    start, end = turn.start + shift, turn.end + shift
    if start < 0 or text[start:end] != turn.text[turn.start : turn.end]:
        return None
    return start, end


def _local_context(messages: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """A short stand-in for the context of turn `index`.

    The system message, a placeholder user turn, then the messages between the last user
    turn and `index` (tool calls and results). The placeholder makes the prompt rendering of
    plain chats identical across turns and records, so it is cached.
    """
    start = index - 1
    while start > 0 and messages[start]["role"] != "user":
        start -= 1
    head = messages[:1] if messages[0]["role"] == "system" else []
    return [*head, {"role": "user", "content": _PLACEHOLDER}, *messages[start + 1 : index]]


class FastChatTemplate(ChatTemplate):
    """`ChatTemplate` with the three verified shortcuts of the module docstring."""

    def __init__(self, tokenizer: Any, options: TemplateOptions) -> None:
        super().__init__(tokenizer, options)
        # text before a turn's content -> whether it is an empty reasoning block
        self._empty_reasoning: dict[str, bool] = {}
        # local context -> its rendering with the generation prompt
        self._prompts: dict[str, str] = {}
        # turn shape -> trained text before and after its content (None: not predictable)
        self._shapes: dict[str, tuple[str, str] | None] = {}

    def _locator(
        self,
        messages: list[dict[str, Any]],
        text: str,
        tools: list[dict[str, Any]] | None,
    ) -> Callable[[int], Located]:
        content_at = self._content_positions(messages, text, tools)
        if content_at is None:
            return super()._locator(messages, text, tools)

        def locate(index: int) -> Located:
            message, at = messages[index], content_at[index]
            context = _local_context(messages, index)
            span = self._predict(text, at, context, message, tools)
            if span is not None:
                return span
            local = self._turn(context, message, tools, prompt=self._prompt(context, tools))
            span = _place(local, text, at)
            if span is not None:
                return span
            full = self._turn(messages[:index], message, tools)
            span = _place(full, text, at)
            return full if span is None else span

        return locate

    def _predict(
        self,
        text: str,
        content_at: int,
        context: list[dict[str, Any]],
        message: dict[str, Any],
        tools: list[dict[str, Any]] | None,
    ) -> tuple[int, int] | None:
        """The turn's trained span in `text` without rendering it again.

        A turn of the same shape (context, fields, reasoning or not) is rendered once with
        probe content and reasoning; the real ones go in verbatim, and `text` must hold
        exactly that trained text around the content's position. None otherwise (a
        template that strips or rewrites them), and the caller renders the turn itself.
        """
        reasoning = message.get("reasoning_content")
        shape_of = {**message, "content": None, "reasoning_content": reasoning is not None}
        key = json.dumps([context, shape_of, tools], sort_keys=True)
        if key not in self._shapes:
            probe = {**message, "content": PROBE}
            if reasoning is not None:
                probe["reasoning_content"] = REASONING_PROBE
            turn = self._turn(context, probe, tools, prompt=self._prompt(context, tools))
            before, found, after = turn.text[turn.start : turn.end].partition(PROBE)
            usable = found and (reasoning is None or before.count(REASONING_PROBE) == 1)
            _bounded_put(self._shapes, key, (before, after) if usable else None)
        shape = self._shapes[key]
        if shape is None:
            return None
        before, after = shape
        if reasoning is not None:
            before = before.replace(REASONING_PROBE, reasoning)
        start = content_at - len(before)
        middle = content_at + len(message["content"])
        end = middle + len(after)
        if start < 0 or text[start:content_at] != before or text[middle:end] != after:
            return None
        return start, end

    def _prompt(self, context: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        key = json.dumps([context, tools], sort_keys=True)
        prompt = self._prompts.get(key)
        if prompt is None:
            prompt = self.render(context, generation_prompt=True, tools=tools)
            _bounded_put(self._prompts, key, prompt)
        return prompt

    def _is_empty_reasoning(
        self,
        context: list[dict[str, Any]],
        message: dict[str, Any],
        prompt: str,
        body: str,
        content: int,
        tools: list[dict[str, Any]] | None,
    ) -> bool:
        # Asked once per distinct text before the content: the answer depends on that text.
        before = body[:content]
        if not before.strip():
            return False
        known = self._empty_reasoning.get(before)
        if known is None:
            known = super()._is_empty_reasoning(context, message, prompt, body, content, tools)
            _bounded_put(self._empty_reasoning, before, known)
        return known

    def _content_positions(
        self,
        messages: list[dict[str, Any]],
        text: str,
        tools: list[dict[str, Any]] | None,
    ) -> dict[int, int] | None:
        """Message index -> where that assistant turn's content starts in `text`.

        Rendered once with markers around each assistant content; None when the markers
        change the rendering (a template that trims content), which selects the reference.
        """
        indices = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        marked = [
            {**m, "content": CONTENT_OPEN + m["content"] + CONTENT_CLOSE}
            if m["role"] == "assistant"
            else m
            for m in messages
        ]
        rendered = self.render(marked, tools=tools)
        if MARKERS.sub("", rendered) != text:
            return None
        positions: dict[int, int] = {}
        removed = 0
        pieces = re.finditer(f"{CONTENT_OPEN}([^{CONTENT_CLOSE}]*){CONTENT_CLOSE}", rendered)
        for index, match in zip(indices, pieces, strict=False):
            if match.group(1) != messages[index]["content"]:
                return None
            positions[index] = match.start() - removed
            removed += 2
        if len(positions) != len(indices) or rendered.count(CONTENT_OPEN) != len(indices):
            return None
        return positions
