"""Evaluation prompts: the accepted record shapes, rendered as `flashdraft generate` renders them."""

from __future__ import annotations

import json

import pytest

from flashdraft.data.formats import RecordError
from flashdraft.eval.prompts import EvalPrompt, as_prompt, load_prompts, prompt_ids


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_prompt_shapes_render_with_the_generation_prompt(smol_tokenizer) -> None:
    tok = smol_tokenizer
    chat = [{"role": "user", "content": "Hi there"}]
    expected = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = prompt_ids({"messages": chat}, tok)
    assert tok.decode(ids) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    # A training conversation: its final answer is dropped, the model is asked for it.
    answered = [*chat, {"role": "assistant", "content": "Hello!"}]
    assert prompt_ids({"messages": answered}, tok) == ids
    sharegpt = {"conversations": [{"from": "human", "value": "Hi there"}]}
    assert prompt_ids(sharegpt, tok) == ids
    assert prompt_ids({"prompt": "def add(a, b):"}, tok) == tok("def add(a, b):").input_ids


def test_a_generate_output_record_gives_its_prompt(smol_tokenizer) -> None:
    """What `flashdraft generate` writes (prompt messages + completion) evaluates on its
    prompt, so its output file serves as the fit check's trained prompts (docs/training.md)."""
    tok = smol_tokenizer
    chat = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    written = {"id": "a", "prompt": chat, "completion": "Fine, thanks.", "finish_reason": "stop"}
    assert prompt_ids(written, tok) == prompt_ids({"messages": chat}, tok)
    assert tok.decode(prompt_ids(written, tok)).endswith(
        "How are you?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_records_that_are_not_prompts_are_refused_with_the_reason(smol_tokenizer) -> None:
    with pytest.raises(RecordError, match="JSON list, not an object"):
        prompt_ids([1, 2], smol_tokenizer)  # type: ignore[arg-type]
    with pytest.raises(RecordError):
        prompt_ids({"completion": "x"}, smol_tokenizer)


def test_load_prompts_names_the_bad_line(tmp_path, smol_tokenizer) -> None:
    path = tmp_path / "prompts.jsonl"
    good = json.dumps({"id": "a", "prompt": "Once upon a time"})
    path.write_text(good + "\n\n" + json.dumps({"completion": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:3"):
        load_prompts(str(path), smol_tokenizer)
    prompts = load_prompts(str(path), smol_tokenizer, limit=1)
    assert prompts[0].id == "a" and prompts[0].input_ids


def test_load_prompts_ids_default_to_the_line_and_an_empty_file_is_an_error(
    tmp_path, smol_tokenizer
) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    (prompt,) = load_prompts(str(path), smol_tokenizer)
    assert prompt.id == f"{path}:1"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(str(empty), smol_tokenizer)


def test_as_prompt_takes_prompts_token_ids_and_records(smol_tokenizer) -> None:
    given = EvalPrompt("x", [1, 2])
    assert as_prompt(given, 0, None) is given
    assert as_prompt((4, 5, 6), 3, None) == EvalPrompt("3", [4, 5, 6])
    record = {"id": "r", "prompt": "Hello"}
    assert as_prompt(record, 7, smol_tokenizer) == EvalPrompt(
        "r", prompt_ids(record, smol_tokenizer)
    )
    assert as_prompt({"prompt": "Hello"}, 7, smol_tokenizer).id == "7"
    with pytest.raises(ValueError, match="need a tokenizer"):
        as_prompt(record, 0, None)
