from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flashdraft.data.formats import Message
from flashdraft.data.generate import render_prompt
from flashdraft.data.inference import (
    DTYPE_CHOICES,
    Generated,
    HFBackend,
    Sampling,
    StaticBackend,
    auto_backend,
    default_device,
    finish,
    load_backend,
    resolve_dtype,
    stop_token_ids,
)
from flashdraft.model.target import DTYPES

SMOLLM2_EOS = 2  # <|im_end|>, from its generation_config

QUESTIONS = [
    "What is 2+2?",  # stops within 12 tokens
    "Write a long story about a dragon.",
    "Reply with one word: yes or no?",  # stops after two tokens
    "Hi Are you a person? And do you like peanut butter?",  # the longest prompt
]


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> tuple[Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return tokenizer, model


def _prompts(tokenizer: Any) -> list[list[int]]:
    return [render_prompt(tokenizer, [Message("user", q)], thinking=False) for q in QUESTIONS]


def test_greedy_batched_generation_equals_model_generate(
    smol: tuple[Any, Any], smollm2_dir: Path
) -> None:
    tokenizer, model = smol
    prompts = _prompts(tokenizer)
    assert len({len(p) for p in prompts}) == len(prompts)  # left padding is exercised
    backend = HFBackend(model, Sampling(max_new_tokens=12), [SMOLLM2_EOS], SMOLLM2_EOS)
    counted: list[int] = []
    batched = backend.generate(prompts, seed=0, on_tokens=counted.append)

    # The reference: the target's own generate(), one unpadded prompt at a time, with the
    # generation_config it ships with.
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, batched, strict=True):
        with torch.inference_mode():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        expected = out[0, len(prompt) :].tolist()
        stopped = SMOLLM2_EOS in expected
        assert got.finish_reason == ("stop" if stopped else "length")
        assert got.token_ids == (expected[: expected.index(SMOLLM2_EOS)] if stopped else expected)
    assert {g.finish_reason for g in batched} == {"stop", "length"}
    # The progress counter saw every generated token and no padding.
    assert sum(counted) == sum(g.num_generated for g in batched)


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_the_static_backend_gives_the_hf_backends_greedy_results(smol: tuple[Any, Any]) -> None:
    """Real SmolLM2 (fp32): the same token ids and finish reasons as HF's batched generate,
    through slots that are fewer than the prompts (refills) and a cache grown between calls."""
    tokenizer, model = smol
    prompts = _prompts(tokenizer)
    sampling = Sampling(max_new_tokens=12)
    reference = HFBackend(model, sampling, [SMOLLM2_EOS], SMOLLM2_EOS).generate(
        prompts, seed=0, on_tokens=lambda n: None
    )
    backend = StaticBackend(model, sampling, [SMOLLM2_EOS], slots=3, sync_every=4)
    assert backend.name == "static" and backend.schedules_batches
    counted: list[int] = []
    short = backend.generate(prompts[:1], seed=0, on_tokens=counted.append)
    assert short == reference[:1]
    assert backend.generate(prompts, seed=0, on_tokens=counted.append) == reference
    assert sum(counted) >= sum(g.num_generated for g in reference)
    # A window of longer prompts: with caches sized in steps of 128 the decoder is rebuilt
    # (and still right); with the default headroom (new caches rounded up to 512 positions)
    # the first decoder holds it.
    longer = [(prompts[0] * 8)[:300]]
    alone = HFBackend(model, sampling, [SMOLLM2_EOS], SMOLLM2_EOS).generate(
        longer, seed=0, on_tokens=lambda n: None
    )
    for grow_to, rebuilt in ((128, True), (512, False)):
        one = StaticBackend(model, sampling, [SMOLLM2_EOS], slots=3, sync_every=4)
        one.grow_to = grow_to
        one.generate(prompts[:1], seed=0, on_tokens=lambda n: None)
        first = one.decoder
        assert first is not None and first.max_len == grow_to
        assert one.generate(longer, seed=0, on_tokens=lambda n: None) == alone
        assert (one.decoder is not first) == rebuilt
    sampled = StaticBackend(
        model, Sampling(temperature=1.0, max_new_tokens=6), [SMOLLM2_EOS], slots=2
    )
    first = sampled.generate(prompts[:2], seed=7, on_tokens=lambda n: None)
    assert first == sampled.generate(prompts[:2], seed=7, on_tokens=lambda n: None)


def test_load_backend_choices(smollm2_dir: Path) -> None:
    args = (str(smollm2_dir), Sampling(max_new_tokens=4), [SMOLLM2_EOS], SMOLLM2_EOS)
    assert isinstance(load_backend("auto", *args, device="cpu"), HFBackend)  # no GPU: HF
    static = load_backend("static", *args, device="cpu", batch_size=8, max_batch_tokens=256)
    assert isinstance(static, StaticBackend) and static.slots == 8
    with pytest.raises(ValueError, match="unknown in-process backend 'tgi'"):
        load_backend("tgi", *args)


def test_seeded_sampling_is_reproducible(smol: tuple[Any, Any]) -> None:
    tokenizer, model = smol
    prompts = _prompts(tokenizer)[:2]
    sampling = Sampling(temperature=1.0, top_p=0.95, max_new_tokens=6)
    backend = HFBackend(model, sampling, [SMOLLM2_EOS], SMOLLM2_EOS)
    first = backend.generate(prompts, seed=7, on_tokens=lambda n: None)
    torch.manual_seed(123)  # whatever ran before does not matter
    again = backend.generate(prompts, seed=7, on_tokens=lambda n: None)
    other = backend.generate(prompts, seed=8, on_tokens=lambda n: None)
    assert first == again
    assert other != first


def test_checkpoint_sampling_defaults_are_ignored(smol: tuple[Any, Any]) -> None:
    # A checkpoint's generation_config (e.g. Qwen3's top_k=20) must not leak into the run.
    _, model = smol
    backend = HFBackend(model, Sampling(temperature=0.7, top_p=0.9), [SMOLLM2_EOS], SMOLLM2_EOS)
    config = backend.generation_config
    assert (config.do_sample, config.temperature, config.top_p, config.top_k) == (
        True,
        0.7,
        0.9,
        0,
    )
    assert model.generation_config.repetition_penalty is None


def test_finish_cuts_at_the_first_stop_token() -> None:
    assert finish([5, 6, 2, 7, 2], {2}) == Generated([5, 6], "stop")
    assert finish([5, 6, 7], {2}) == Generated([5, 6, 7], "length")
    assert finish([2, 2, 2], {2}) == Generated([], "stop")
    # An engine that drops the stop token from its output but reports the stop.
    assert finish([5, 6], {2}, stopped=True) == Generated([5, 6], "stop")
    assert Generated([5, 6], "stop").num_generated == 3
    assert Generated([5, 6], "length").num_generated == 2


def test_stop_ids_come_from_the_generation_config(smollm2_dir: Path, tiny_qwen3_dir: Path) -> None:
    # SmolLM2's tokenizer may call <|im_start|> its eos; its generation_config is right.
    assert stop_token_ids(str(smollm2_dir)) == [SMOLLM2_EOS]
    assert stop_token_ids(str(smollm2_dir), [7, SMOLLM2_EOS]) == [SMOLLM2_EOS, 7]
    qwen = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    ends = qwen.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert stop_token_ids(str(tiny_qwen3_dir)) == ends


def test_sampling_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Sampling(max_new_tokens=0)


def test_device_and_dtype_defaults() -> None:
    assert ("auto", *DTYPES) == DTYPE_CHOICES  # every dtype the target loader knows
    assert default_device("cpu") == "cpu"
    assert default_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("float16", "cpu") == "float16"


def test_auto_picks_static_on_a_gpu_else_hf(smollm2_dir: Path) -> None:
    """`auto` runs an in-process backend that the tests cover: static (on a GPU, for a
    supported target) or hf; a server (`--backend openai`) only when asked for."""
    backend = load_backend("auto", str(smollm2_dir), Sampling(), [SMOLLM2_EOS], SMOLLM2_EOS)
    assert isinstance(backend, HFBackend)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert auto_backend(model, "cuda") == "static"
    assert auto_backend(model, "cpu") == "hf"
    for name in ("openai", "vllm"):
        with pytest.raises(ValueError, match=f"unknown in-process backend '{name}'"):
            load_backend(name, str(smollm2_dir), Sampling(), [SMOLLM2_EOS], SMOLLM2_EOS)
