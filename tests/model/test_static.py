"""The static-cache forward against HF's own: greedy decoding, rewinds, taps, rows at other
positions, fused projections, fresh prefills, refusals, and a decode step captured as a CUDA
graph (CPU, fp32, tiny random targets of each supported layout). The attention kernels and
compiled graphs are in test_static_kernels.py."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import tiny_llama, tiny_target

from flashdraft.model.graphs import capture
from flashdraft.model.static import StaticLM, unsupported_reason

PROMPT = [5, 17, 3, 42, 8, 11, 29, 2, 60]


KINDS = ["llama", "qwen3", "qwen3-sliding", "mistral"]


@pytest.fixture(scope="module", params=KINDS)
def target(request) -> torch.nn.Module:
    return tiny_target(request.param)


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def test_one_token_steps_equal_hf_generate_and_taps_equal_hidden_states(target) -> None:
    if "sliding" in str(getattr(target.config, "layer_types", "")):
        assert target.config.layer_types[-1] == "sliding_attention"
    reference = hf_greedy(target, PROMPT, 24)  # 33 positions: windows of 5 and 6 are crossed
    lm = StaticLM(target, 1, 64, [0, 2, 3])
    lm.verify()
    logits, taps = lm(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])
    out = [int(logits[0, -1].argmax())]
    while len(out) < 24:
        position = len(PROMPT) + len(out) - 1
        logits, _ = lm(torch.tensor([[out[-1]]]), torch.tensor([[position]]))
        out.append(int(logits[0, -1].argmax()))
    assert out == reference
    hidden = target(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    assert taps is not None and taps.shape == (1, len(PROMPT), 3 * 64)
    assert relative_error(taps[..., :64], hidden[1]) < 1e-5  # id i = output of layer i
    assert relative_error(taps[..., 64:128], hidden[3]) < 1e-5
    assert relative_error(lm.norm(taps[..., 128:]), hidden[4]) < 1e-5  # last: HF norms it


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def test_verify_blocks_with_rejections_rewind_by_position(target) -> None:
    """Speculative-style steps: B tokens per call, noisy drafts; the next call simply starts
    at the first rejected position (nothing is cropped) and the output stays greedy."""
    block, new = 5, 40
    reference = hf_greedy(target, PROMPT, new + block)
    rng = random.Random(0)
    lm = StaticLM(target, 1, 128)
    logits, _ = lm(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])
    out, accepted_counts = [int(logits[0, -1].argmax())], []
    while len(out) < new:
        start = len(PROMPT) + len(out) - 1
        k = len(out)
        drafts = [reference[k + j] if rng.random() < 0.7 else rng.randrange(64) for j in range(4)]
        logits, _ = lm(torch.tensor([[out[-1], *drafts]]), torch.arange(start, start + block)[None])
        choice = logits[0].argmax(-1).tolist()
        accepted = 0
        while accepted < block - 1 and drafts[accepted] == choice[accepted]:
            accepted += 1
        accepted_counts.append(accepted)
        out += [*drafts[:accepted], choice[accepted]]
    assert out[:new] == reference[:new]
    assert 0 in accepted_counts and max(accepted_counts) >= 2  # rejections and acceptance


@torch.no_grad()
def test_rows_at_different_positions_and_subset_prefill() -> None:
    """Two rows, prefilled one at a time into their own cache rows, then decoded together at
    different positions: each equals its prompt decoded alone."""
    target = tiny_target("qwen3")
    prompts = [PROMPT, PROMPT[:4]]
    references = [hf_greedy(target, p, 6) for p in prompts]
    lm = StaticLM(target, 2, 32)
    tokens = []
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        logits, _ = lm(
            torch.tensor([prompt]),
            torch.arange(n)[None],
            rows=torch.tensor([row]),
            kv_len=n,
            logits_at=torch.tensor([n - 1]),
        )
        assert logits.shape[:2] == (1, 1)
        tokens.append([int(logits[0, 0].argmax())])
    for _ in range(5):
        ids = torch.tensor([[t[-1]] for t in tokens])
        positions = torch.tensor(
            [[len(p) + len(t) - 1] for p, t in zip(prompts, tokens, strict=True)]
        )
        logits, _ = lm(ids, positions, kv_len=16)
        for t, row in zip(tokens, logits[:, 0].argmax(-1).tolist(), strict=True):
            t.append(row)
    assert tokens == references


def tiny_qwen2() -> torch.nn.Module:
    """Qwen2: biases on q/k/v (fused with the weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval().requires_grad_(False)


@torch.no_grad()
@pytest.mark.parametrize("kind", [*KINDS, "qwen2"])
def test_fused_projections_give_the_unfused_logits_taps_and_cache(kind) -> None:
    """`fuse_projections`: q/k/v and gate/up as one GEMM each, eagerly and through the
    compiled parts, give the separate projections' prefill and decode steps; the model's
    own parameters are untouched; too large a copy or an unknown layout is refused."""
    from torch._dynamo.testing import CompileCounter

    target = tiny_qwen2() if kind == "qwen2" else tiny_target(kind)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    plain, fused, compiled = (StaticLM(target, 2, 64, [1]) for _ in range(3))
    assert fused.fuse_projections() and compiled.fuse_projections()
    if kind == "qwen2":
        assert fused._fused[0] is not None and fused._fused[0][1] is not None  # the biases
    torch._dynamo.reset()
    compiled.compile_layers(CompileCounter(), prefill=True)
    prompt = torch.tensor([PROMPT, PROMPT[::-1]])
    n = prompt.shape[1]
    lms = (plain, fused, compiled)
    outs = [lm(prompt, torch.arange(n)[None].expand(2, -1), fresh=True, kv_len=n) for lm in lms]
    tokens, positions = outs[0][0][:, -1:].argmax(-1), torch.full((2, 1), n)
    for step in range(6):
        steps = [lm(tokens, positions + step, kv_len=32) for lm in lms]
        outs += steps
        tokens = steps[0][0].argmax(-1)
    for i in range(0, len(outs), 3):
        (a, ta), *others = outs[i : i + 3]
        for b, tb in others:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(tb, ta, rtol=1e-5, atol=1e-5)
    for x, y in zip(plain.keys + plain.values, fused.keys + fused.values, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    after = target.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    torch._dynamo.reset()
    assert not StaticLM(target, 1, 64).fuse_projections(max_bytes=1000)
    target.model.layers[0].mlp.up_proj = torch.nn.Identity()  # not a Linear: no fusing
    assert not StaticLM(target, 1, 64).fuse_projections()


@torch.no_grad()
def test_a_fresh_prefill_attends_within_the_call_and_fills_the_same_cache(target) -> None:
    """`fresh=True` (prompts from position 0, right-padded: the slot decoder's prefill) runs
    causal attention on the call's own K/V (flash kernels on CUDA) instead of a dense mask
    over the cache: same logits and taps at every real position, the same cache, so the
    decode steps after it are the same too; sliding layers with a window shorter than the
    prompt keep their mask (the sliding kinds' windows of 5 and 6)."""
    rng = random.Random(3)
    lengths = [9, 14, 4]
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.tensor([rng.randrange(60) for _ in range(n)])
    positions = torch.arange(width)[None].expand(3, -1)
    rows = torch.tensor([2, 0, 1])
    lms = [StaticLM(target, 3, 64, [0, 2]) for _ in range(2)]
    outs = [
        lm(ids, positions, rows=rows, kv_len=width, fresh=fresh)
        for lm, fresh in zip(lms, (False, True), strict=True)
    ]
    for r, n in enumerate(lengths):
        torch.testing.assert_close(outs[1][0][r, :n], outs[0][0][r, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[1][1][r, :n], outs[0][1][r, :n], rtol=1e-5, atol=1e-5)
    for a, b in zip(lms[0].keys + lms[0].values, lms[1].keys + lms[1].values, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # The rows continue from their own lengths: the same next logits.
    last = torch.tensor([lengths[1], lengths[2], lengths[0]])[:, None]  # rows 0, 1, 2
    tokens = torch.tensor([[7], [8], [9]])
    steps = [lm(tokens, last, kv_len=32) for lm in lms]
    torch.testing.assert_close(steps[1][0], steps[0][0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_one_token_fresh_prompt_of_every_row_runs_as_a_decode_step(target) -> None:
    """rows None, one token, `fresh`: the decode part writes the K/V itself, and the
    within-call attention reads them back from slot 0: the same logits, taps and cache as
    the same call without `fresh`, compiled parts included."""
    from torch._dynamo.testing import CompileCounter

    ids, positions = torch.tensor([[5], [9]]), torch.zeros(2, 1, dtype=torch.long)
    lms = [StaticLM(target, 2, 64, [1]) for _ in range(3)]
    torch._dynamo.reset()
    lms[2].compile_layers(CompileCounter())
    (a, ta), *others = (
        lm(ids, positions, kv_len=16, fresh=fresh)
        for lm, fresh in zip(lms, (False, True, True), strict=True)
    )
    for b, tb in others:
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tb, ta, rtol=1e-5, atol=1e-5)
    for lm in lms[1:]:
        for x, y in zip(lms[0].keys + lms[0].values, lm.keys + lm.values, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_unsupported_targets_are_refused_with_the_reason() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "gpt2" in (unsupported_reason(gpt2) or "")
    with pytest.raises(ValueError, match="static decoding does not support this target"):
        StaticLM(gpt2, 1, 8)
    dynamic = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    assert "dynamic" in (unsupported_reason(LlamaForCausalLM(dynamic)) or "")
    assert unsupported_reason(tiny_llama()) is None


def test_verify_catches_a_forward_that_differs_from_hf() -> None:
    lm = StaticLM(tiny_target("llama"), 1, 16)
    lm.verify()
    lm.scale *= 2  # as if the attention scaling had been read wrong
    with pytest.raises(ValueError, match="differs from the HF forward"):
        lm.verify()


# ---- captured as a CUDA graph ----


@pytest.mark.gpu
def test_a_captured_decode_step_equals_the_eager_one() -> None:
    target = tiny_target("qwen3-sliding").cuda()
    reference = hf_greedy(target, PROMPT, 20)
    lm = StaticLM(target, 1, 64)
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    position = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    out_buffer = torch.zeros(1, dtype=torch.long, device="cuda")

    def step() -> None:
        logits, _ = lm(token, position)
        out_buffer.copy_(logits[0, -1].argmax().view(1))

    with torch.no_grad():
        graph = capture(step)
        logits, _ = lm(torch.tensor([PROMPT], device="cuda"), torch.arange(9, device="cuda")[None])
        out = [int(logits[0, -1].argmax())]
        while len(out) < 20:
            token.fill_(out[-1])
            position.fill_(len(PROMPT) + len(out) - 1)
            graph.replay()
            out.append(int(out_buffer))
    assert out == reference
