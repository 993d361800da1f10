"""Loss masks by prefix rendering, checked token by token on the real Qwen3 and SmolLM2
tokenizers (docs/design.md §7, trap 8)."""

from __future__ import annotations

from typing import Any

import pytest

from flashdraft.assets import chitchat_conversations
from flashdraft.data.formats import RecordError, parse_record
from flashdraft.data.template import (
    ChatTemplate,
    RenderedSample,
    TemplateOptions,
    encode,
    tokenizer_fingerprint,
)
from flashdraft.data.template_fast import FastChatTemplate

QWEN_SYSTEM = "<|im_start|>system\nBe brief.<|im_end|>\n"
SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"


def two_turns(*, reasoning: bool, system: bool = True) -> dict[str, Any]:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    if reasoning:
        messages[1]["reasoning_content"] = "greet back"
        messages[3]["content"] = "<think>\nadd\n</think>\n\n4"  # inline form
    if system:
        messages.insert(0, {"role": "system", "content": "Be brief."})
    return {"messages": messages}


def encoded(
    tokenizer: Any, record: dict[str, Any], **options: str
) -> list[tuple[list[int], list[int]]]:
    template = ChatTemplate(tokenizer, TemplateOptions(**options))
    samples = template.samples(parse_record(record), record.get("tools"))
    out = []
    for result in encode(tokenizer, samples):
        assert not isinstance(result, RecordError), result
        ids, mask = result
        out.append((ids.tolist(), mask.tolist()))
    return out


def expected(tokenizer: Any, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Tokens and mask built piece by piece: each piece tokenized alone, all 0 or all 1."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


def test_render_matches_apply_chat_template(qwen3_tokenizer: Any, smollm2_tokenizer: Any) -> None:
    record = two_turns(reasoning=True)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for tokenizer in (qwen3_tokenizer, smollm2_tokenizer):
        for thinking in ("keep", "off"):
            template = ChatTemplate(tokenizer, TemplateOptions(thinking=thinking))
            messages = template.messages(parse_record(record))
            extra = {"enable_thinking": False} if thinking == "off" else {}
            for prompt in (False, True):
                for schemas in (None, tools):
                    ours = template.render(messages[:3], generation_prompt=prompt, tools=schemas)
                    theirs = tokenizer.apply_chat_template(
                        messages[:3],
                        tools=schemas,
                        add_generation_prompt=prompt,
                        tokenize=False,
                        **extra,
                    )
                    assert ours == theirs


def test_encode_matches_tokenizer(qwen3_tokenizer: Any, smollm2_tokenizer: Any) -> None:
    for tokenizer in (qwen3_tokenizer, smollm2_tokenizer):
        template = ChatTemplate(tokenizer, TemplateOptions())
        samples = template.samples(parse_record(two_turns(reasoning=False)))
        ids, _ = encode(tokenizer, samples)[0]  # type: ignore[misc]
        assert ids.tolist() == tokenizer(samples[0].text, add_special_tokens=False).input_ids


def test_qwen3_keep_trains_think_blocks_and_splits_rewritten_turns(qwen3_tokenizer: Any) -> None:
    # Qwen3 drops the reasoning of turns before the last user query, so the first turn
    # gets its own sample (rendered as when it was generated) and is trained only there.
    first, second = encoded(qwen3_tokenizer, two_turns(reasoning=True), thinking="keep")
    assert first == expected(
        qwen3_tokenizer,
        [
            (QWEN_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("<think>\ngreet back\n</think>\n\nHello!<|im_end|>", 1),
        ],
    )
    assert second == expected(
        qwen3_tokenizer,
        [
            (QWEN_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Hello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
            ("<think>\nadd\n</think>\n\n4<|im_end|>", 1),
        ],
    )


@pytest.mark.parametrize("thinking", ["strip", "off"])
def test_qwen3_without_reasoning_never_trains_the_empty_think_block(
    qwen3_tokenizer: Any, thinking: str
) -> None:
    pieces = [
        (QWEN_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello!<|im_end|>", 1),
        ("\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK, 0),
        ("4<|im_end|>", 1),
    ]
    (sample,) = encoded(qwen3_tokenizer, two_turns(reasoning=True), thinking=thinking)
    assert sample == expected(qwen3_tokenizer, pieces)
    # Data without reasoning under `keep`: the template's empty block stays untrained too.
    (sample,) = encoded(qwen3_tokenizer, two_turns(reasoning=False), thinking="keep")
    assert sample == expected(qwen3_tokenizer, pieces)


def test_qwen3_thinking_off_renders_the_non_thinking_prompt(qwen3_tokenizer: Any) -> None:
    template = ChatTemplate(qwen3_tokenizer, TemplateOptions(thinking="off"))
    messages = template.messages(parse_record(two_turns(reasoning=True)))
    assert template.render(messages[:2], generation_prompt=True).endswith(
        "<|im_start|>assistant\n" + EMPTY_THINK
    )
    assert "reasoning_content" not in messages[2]


def test_qwen3_last_turn_only(qwen3_tokenizer: Any) -> None:
    (sample,) = encoded(qwen3_tokenizer, two_turns(reasoning=True), thinking="keep", turns="last")
    assert sample == expected(
        qwen3_tokenizer,
        [
            (QWEN_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!", 0),
            ("<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
            ("<think>\nadd\n</think>\n\n4<|im_end|>", 1),
        ],
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def tool_record() -> dict[str, Any]:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "need tool",
                "tool_calls": [call],
            },
            {"role": "tool", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 C.", "reasoning_content": "answer"},
        ],
    }


def test_qwen3_tool_turns(qwen3_tokenizer: Any) -> None:
    template = ChatTemplate(qwen3_tokenizer, TemplateOptions(thinking="strip"))
    header = template.render(
        [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, generation_prompt=True
    )
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    (sample,) = encoded(qwen3_tokenizer, tool_record(), thinking="strip")
    assert sample == expected(
        qwen3_tokenizer,
        [
            (header, 0),
            (call + "<|im_end|>", 1),
            ('\n<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n', 0),
            ("<|im_start|>assistant\n" + EMPTY_THINK, 0),
            ("It is 21 C.<|im_end|>", 1),
        ],
    )
    # With reasoning kept, both turns follow the last user query: Qwen3 keeps both think
    # blocks in the full rendering, so no split is needed.
    (sample,) = encoded(qwen3_tokenizer, tool_record(), thinking="keep")
    ids, mask = sample
    trained = qwen3_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == (
        f"<think>\nneed tool\n</think>\n\n{call}<|im_end|>"
        "<think>\nanswer\n</think>\n\nIt is 21 C.<|im_end|>"
    )


def test_smollm2_multi_turn_masks(smollm2_tokenizer: Any) -> None:
    pieces = [
        (SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello!<|im_end|>", 1),
        ("\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("4<|im_end|>", 1),
    ]
    (sample,) = encoded(smollm2_tokenizer, two_turns(reasoning=False, system=False))
    assert sample == expected(smollm2_tokenizer, pieces)


@pytest.mark.parametrize("cls", [ChatTemplate, FastChatTemplate])
def test_a_prompt_is_never_trained_only_its_completion(smollm2_tokenizer: Any, cls: type) -> None:
    """A prompt/completion record (what `generate` writes) whose prompt holds an assistant
    turn: that turn is context (the dataset's text, not the target's), so even with
    `turns="all"` only the completion is trained; the same turns as `messages` train both."""
    chat = two_turns(reasoning=False, system=False)["messages"]
    record = {"prompt": chat[:3], "completion": "4"}
    pieces = [
        (SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello!<|im_end|>", 0),
        ("\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("4<|im_end|>", 1),
    ]
    template = cls(smollm2_tokenizer, TemplateOptions(turns="all"))
    for data, train_first in (
        (record, 0),
        ({"messages": chat}, 1),
    ):
        (result,) = encode(smollm2_tokenizer, template.samples(parse_record(data), None))
        assert not isinstance(result, RecordError), result
        want = [
            (text, train_first if i == 1 else trained) for i, (text, trained) in enumerate(pieces)
        ]
        assert (result[0].tolist(), result[1].tolist()) == expected(smollm2_tokenizer, want)


def test_smollm2_refuses_what_its_template_drops(smollm2_tokenizer: Any) -> None:
    template = ChatTemplate(smollm2_tokenizer, TemplateOptions(thinking="keep"))
    with pytest.raises(RecordError, match="does not render the assistant's reasoning"):
        template.samples(parse_record(two_turns(reasoning=True)))
    template = ChatTemplate(smollm2_tokenizer, TemplateOptions(thinking="strip"))
    with pytest.raises(RecordError, match="does not render the tool call"):
        template.samples(parse_record(tool_record()), TOOLS)


def reference_trained(tokenizer: Any, record: dict[str, Any], thinking: str) -> list[str]:
    """Every assistant turn's trained text by plain prefix rendering of the full context."""
    template = ChatTemplate(tokenizer, TemplateOptions(thinking=thinking))
    messages = template.messages(parse_record(record))
    tools = record.get("tools")
    extra = {"enable_thinking": False} if thinking == "off" else {}
    out = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(
            messages[:i], tools=tools, add_generation_prompt=True, tokenize=False, **extra
        )
        full = tokenizer.apply_chat_template(
            messages[: i + 1], tools=tools, tokenize=False, **extra
        )
        assert full.startswith(prompt)
        turn = full[len(prompt) :].rstrip()
        out.append(turn.removeprefix(EMPTY_THINK) if "reasoning_content" not in message else turn)
    return out


@pytest.mark.parametrize("name", ["qwen3_tokenizer", "smollm2_tokenizer"])
def test_real_chats_train_what_prefix_rendering_gives(
    name: str, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(name)
    template = ChatTemplate(tokenizer, TemplateOptions())
    records = [r for r in chitchat_conversations(seed=1) if len(r["messages"]) <= 24][:30]
    for record in records:
        samples = template.samples(parse_record(record))
        assert len(samples) == 1
        (sample,) = samples
        full = tokenizer.apply_chat_template(record["messages"], tokenize=False)
        assert full.startswith(sample.text)
        assert [sample.text[a:b] for a, b in sample.spans] == reference_trained(
            tokenizer, record, "keep"
        )


@pytest.mark.parametrize(
    ("template_text", "match"),
    [
        # No roles and no generation prompt: nothing tells assistant tokens apart.
        ("{% for m in messages %}{{ m.content }}\n{% endfor %}", "no assistant marker"),
        # Roles but add_generation_prompt ignored: the mask would train the header.
        (
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
            "no assistant marker",
        ),
        # A generation prompt that the rendered turn does not start with.
        (
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<answer>{% endif %}",
            "does not start with",
        ),
    ],
)
def test_template_without_assistant_marker_is_refused(
    smollm2_tokenizer: Any, template_text: str, match: str
) -> None:
    original = smollm2_tokenizer.chat_template
    smollm2_tokenizer.chat_template = template_text
    try:
        with pytest.raises(ValueError, match=match):
            ChatTemplate(smollm2_tokenizer, TemplateOptions()).check()
    finally:
        smollm2_tokenizer.chat_template = original


def test_real_templates_pass_the_check(qwen3_tokenizer: Any, smollm2_tokenizer: Any) -> None:
    for tokenizer in (qwen3_tokenizer, smollm2_tokenizer):
        for thinking in ("keep", "strip", "off"):
            for turns in ("all", "last"):
                ChatTemplate(tokenizer, TemplateOptions(thinking=thinking, turns=turns)).check()


def test_all_ones_mask_is_refused(smollm2_tokenizer: Any) -> None:
    text = "<|im_start|>assistant\nHello<|im_end|>"
    (result,) = encode(
        smollm2_tokenizer, [RenderedSample(text=text, spans=[(0, len(text))], turn=0)]
    )
    assert isinstance(result, RecordError)
    assert "all-ones" in str(result)


def test_unusable_text_is_a_record_error(qwen3_tokenizer: Any) -> None:
    template = ChatTemplate(qwen3_tokenizer, TemplateOptions(thinking="strip"))
    injected = {
        "messages": [
            {"role": "user", "content": "hi<|im_end|>"},
            {"role": "assistant", "content": "x"},
        ]
    }
    with pytest.raises(RecordError, match="special token"):
        template.samples(parse_record(injected))
    only_reasoning = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "<think>hm</think>"},
        ]
    }
    with pytest.raises(RecordError, match="empty once its reasoning is dropped"):
        template.samples(parse_record(only_reasoning))


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="thinking"):
        TemplateOptions(thinking="maybe")
    with pytest.raises(ValueError, match="turns"):
        TemplateOptions(turns="first")


def test_fingerprint_depends_on_the_template(smollm2_tokenizer: Any) -> None:
    before = tokenizer_fingerprint(smollm2_tokenizer)
    original = smollm2_tokenizer.chat_template
    smollm2_tokenizer.chat_template = original + " "
    try:
        assert tokenizer_fingerprint(smollm2_tokenizer) != before
    finally:
        smollm2_tokenizer.chat_template = original
