"""The fast path gives exactly the reference's samples (real templates, real chats), with far
fewer renders; templates that defeat its shortcuts fall back to the reference."""

from __future__ import annotations

from typing import Any

import pytest

from flashdraft.assets import chitchat_conversations
from flashdraft.data.formats import RecordError, parse_record, record_tools
from flashdraft.data.template import ChatTemplate, RenderedSample, TemplateOptions
from flashdraft.data.template_fast import FastChatTemplate

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def records() -> list[dict[str, Any]]:
    """Plain chats, chats with reasoning (inline and as a field), tool calls, repeated and
    empty-looking contents, and reasoning that Qwen3 reformats."""
    chats = [r for r in chitchat_conversations(seed=2) if len(r["messages"]) <= 16][:12]
    reasoning = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "add again"},
        ]
    }
    tools = {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "\nneed tool\n\n",  # Qwen3 strips these newlines
                "tool_calls": [CALL],
            },
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 C.", "reasoning_content": "answer"},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": "It is 21 C."},  # repeats an earlier content
        ],
    }
    return [*chats, reasoning, tools]


def samples_or_error(template: ChatTemplate, record: dict[str, Any]) -> Any:
    try:
        return template.samples(parse_record(record), record_tools(record))
    except RecordError as err:
        return str(err)


@pytest.mark.parametrize("name", ["qwen3_tokenizer", "smollm2_tokenizer"])
@pytest.mark.parametrize("thinking", ["keep", "strip", "off"])
def test_fast_path_gives_the_reference_samples(
    name: str, thinking: str, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(name)
    for turns in ("all", "last"):
        options = TemplateOptions(thinking=thinking, turns=turns)
        reference, fast = ChatTemplate(tokenizer, options), FastChatTemplate(tokenizer, options)
        for record in records():
            expected = samples_or_error(reference, record)
            assert samples_or_error(fast, record) == expected
            # Twice: what the caches hold gives the same answer.
            assert samples_or_error(fast, record) == expected


class _Counting(FastChatTemplate):
    renders = 0

    def render(self, *args: Any, **kwargs: Any) -> str:
        self.renders += 1
        return super().render(*args, **kwargs)


class _CountingReference(ChatTemplate):
    renders = 0

    def render(self, *args: Any, **kwargs: Any) -> str:
        self.renders += 1
        return super().render(*args, **kwargs)


def test_renders_grow_linearly_not_quadratically(qwen3_tokenizer: Any) -> None:
    turns = [
        m
        for i in range(40)
        for m in (
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}, with some words."},
        )
    ]
    record = {"messages": turns}
    fast, reference = (
        _Counting(qwen3_tokenizer, TemplateOptions()),
        _CountingReference(qwen3_tokenizer, TemplateOptions()),
    )
    assert fast.samples(parse_record(record)) == reference.samples(parse_record(record))
    # The reference renders every turn in full context (a few renders per turn); the fast
    # path renders the chat twice and every turn's shape once (the same for all 40 here).
    assert reference.renders >= 2 * 40
    assert fast.renders <= 10


def test_template_that_trims_content_falls_back_to_prefix_rendering(smollm2_tokenizer: Any) -> None:
    # Content markers cannot survive `trim`, so every turn goes through full prefix rendering.
    template_text = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    record = {
        "messages": [
            {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello! \n"},
            {"role": "user", "content": "More"},
            {"role": "assistant", "content": "\tSure."},
        ]
    }
    original = smollm2_tokenizer.chat_template
    smollm2_tokenizer.chat_template = template_text
    try:
        for template in (
            FastChatTemplate(smollm2_tokenizer, TemplateOptions()),
            ChatTemplate(smollm2_tokenizer, TemplateOptions()),
        ):
            (sample,) = template.samples(parse_record(record))
            assert [sample.text[a:b] for a, b in sample.spans] == [
                "Hello!<|im_end|>",
                "Sure.<|im_end|>",
            ]
    finally:
        smollm2_tokenizer.chat_template = original


def test_reasoning_the_template_reformats_is_still_found(qwen3_tokenizer: Any) -> None:
    # Qwen3 strips newlines around reasoning: the cached turn shape (reasoning inserted
    # verbatim) does not match, so the turn is rendered; the result must not change.
    record = records()[-1]
    record["messages"] = record["messages"][:4]
    template = FastChatTemplate(qwen3_tokenizer, TemplateOptions(thinking="keep"))
    (sample,) = template.samples(parse_record(record), TOOLS)
    assert isinstance(sample, RenderedSample)
    assert sample.text[sample.spans[0][0] :].startswith("<think>\nneed tool\n</think>\n\nLet me")
    assert (
        sample
        == ChatTemplate(qwen3_tokenizer, TemplateOptions(thinking="keep")).samples(
            parse_record(record), TOOLS
        )[0]
    )


def test_the_fast_path_passes_the_template_check(
    qwen3_tokenizer: Any, smollm2_tokenizer: Any
) -> None:
    for tokenizer in (qwen3_tokenizer, smollm2_tokenizer):
        FastChatTemplate(tokenizer, TemplateOptions()).check()
