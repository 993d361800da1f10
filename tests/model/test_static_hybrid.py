"""Static decoding of hybrid targets (Qwen3.5, its MoE, Qwen3-Next): the delta rule over a
block against transformers' token-by-token recurrence, the state after any prefix, greedy
decoding against HF's, and the speculative loop's rollback after rejected drafts."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import drafter_config_for
from tiny_models import tiny_hybrid_model
from torch import Tensor

from flashdraft.data.fast_inference import SlotDecoder
from flashdraft.eval.fast import StaticDecoder
from flashdraft.model import static_hybrid
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.head import TargetHead
from flashdraft.model.static import StaticLM, unsupported_reason

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
VOCAB = 300
PROMPT = [5, 17, 3, 42, 8, 11, 29, 64, 2, 250]


@pytest.fixture(scope="module", params=KINDS)
def hybrid(request):
    return tiny_hybrid_model(request.param, vocab_size=VOCAB).eval()


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
        min_new_tokens=new, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_the_delta_rule_over_a_block_equals_the_recurrence_and_keeps_every_prefix() -> None:
    """o and the state after each prefix j from one `delta_block` equal transformers' own
    token-by-token recurrence (its reference kernel) from the same state."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    recurrence = inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)
    gen = torch.Generator().manual_seed(0)
    r, nv, n, dk, dv = 2, 3, 7, 8, 5

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen)

    q, k, v = randn(r, n, nv, dk), randn(r, n, nv, dk), randn(r, n, nv, dv)
    g, beta = -torch.rand(r, n, nv, generator=gen), torch.rand(r, n, nv, generator=gen)
    s0 = randn(r, nv, dk, dv)
    qn = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    kn = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    heads = [t.transpose(1, 2) for t in (qn, kn, v, g, beta)]
    o, u, big_g, ratio = static_hybrid.delta_block(*heads, s0)
    ref_o, _ = recurrence(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)  # fmt: skip
    torch.testing.assert_close(o.transpose(1, 2), ref_o, rtol=1e-4, atol=1e-5)
    for j in range(n):
        _, ref_state = recurrence(q[:, : j + 1], k[:, : j + 1], v[:, : j + 1], g[:, : j + 1],
                                  beta[:, : j + 1], initial_state=s0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)  # fmt: skip
        at = torch.full((r,), j)
        state = static_hybrid.state_after(s0, heads[1], u, big_g, ratio, at)
        torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-5)
    # rows at different prefixes in one call
    mixed = static_hybrid.state_after(s0, heads[1], u, big_g, ratio, torch.tensor([1, 5]))
    one = static_hybrid.state_after(s0, heads[1], u, big_g, ratio, torch.tensor([1, 1]))
    five = static_hybrid.state_after(s0, heads[1], u, big_g, ratio, torch.tensor([5, 5]))
    assert torch.equal(mixed[0], one[0]) and torch.equal(mixed[1], five[1])


def test_static_forward_equals_hf_and_a_verify_rolls_back_exactly(hybrid) -> None:
    """Prefill, decode steps and a verify block give HF's logits; after `commit(j)` every
    linear layer's states equal those of the accepted prefix fed alone, for each row's j."""
    assert unsupported_reason(hybrid) is None
    seq = torch.randint(0, VOCAB, (1, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hybrid(input_ids=seq, use_cache=False).logits[0]
        lm = StaticLM(hybrid, 2, 128, [1, 3])
        lm.verify()
        both = seq.expand(2, -1)
        logits, _ = lm(both[:, :70], torch.arange(70)[None].expand(2, -1), kv_len=70, fresh=True)
        torch.testing.assert_close(logits[1], ref[:70], rtol=0, atol=1e-4)
        for t in range(70, 74):
            logits, _ = lm(both[:, t : t + 1], torch.full((2, 1), t))
            torch.testing.assert_close(logits[0, 0], ref[t], rtol=0, atol=1e-4)
        lm.prepare_verify(8)
        block = torch.arange(74, 82)[None].expand(2, -1)
        logits, _ = lm(both[:, 74:82], block, keep=True)
        torch.testing.assert_close(logits[0], ref[74:82], rtol=0, atol=1e-4)
        lm.commit(torch.tensor([2, 6]))  # row 0 keeps tokens 74..76, row 1 74..80
        for row, end in ((0, 77), (1, 81)):
            alone = StaticLM(hybrid, 1, 128)
            alone(seq[:, :end], torch.arange(end)[None], kv_len=end, fresh=True)
            for ours, theirs in zip(lm.conv + lm.state, alone.conv + alone.state, strict=True):
                torch.testing.assert_close(ours[row], theirs[0], rtol=1e-4, atol=1e-5)
        # and decoding on from the kept states gives HF's next logits
        logits, _ = lm(torch.stack([seq[0, 77:78], seq[0, 81:82]]), torch.tensor([[77], [81]]))
        torch.testing.assert_close(logits[0, 0], ref[77], rtol=0, atol=1e-4)
        torch.testing.assert_close(logits[1, 0], ref[81], rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_the_graph_safe_moe_equals_the_modules_own_forward(kind) -> None:
    """Both graph-safe forms of a sparse MoE block (experts gathered per token: 1 token x 2 of
    4 experts; every expert weighted: 6 tokens) give the module's own output."""
    model = tiny_hybrid_model(kind, vocab_size=VOCAB)
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    for tokens in (1, 6):
        h = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            torch.testing.assert_close(static_hybrid.mlp(block, h), block(h), rtol=1e-5, atol=1e-6)


class RiggedDrafts(StaticDecoder):
    """The drafter's proposals replaced by the greedy continuation, right for a set number of
    leading slots per step (0 .. B-1, cycled): partial acceptance and rollback every step."""

    def __init__(self, *args, reference: list[int], correct: list[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reference = torch.tensor(reference + [0] * 64)
        self.correct = torch.tensor(correct * 64)
        self.steps = torch.zeros((), dtype=torch.long)

    def _draft(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        _, logits = super()._draft(positions)
        truth = self.reference[positions[0, 1:]]
        wrong = (truth + 1) % VOCAB
        slot = torch.arange(self.block - 1)
        self.steps += 1
        return torch.where(slot < self.correct[self.steps - 1], truth, wrong), logits


def test_static_loops_decode_the_targets_greedy_tokens(hybrid) -> None:
    """B = 1 and the speculative loop with rigged partial acceptance give HF's greedy decode;
    the acceptance lengths are the rigged ones (the rollback kept every state exact)."""
    reference = hf_greedy(hybrid, PROMPT, 30)
    drafter = DFlashDrafter(drafter_config_for(hybrid, block_size=4, target_layer_ids=[1, 5]))
    drafter.reset_parameters(3)
    base = StaticDecoder(hybrid, max_len=64)
    assert base.decode(PROMPT, 30).output_ids == reference
    correct = [2, 0, 3, 1]
    spec = RiggedDrafts(
        hybrid, max_len=64, drafter=drafter.eval(), head=TargetHead.from_model(hybrid),
        block_size=4, reference=PROMPT + reference, correct=correct,
    )  # fmt: skip
    result = spec.decode(PROMPT, 30)
    assert result.output_ids == reference
    steps = len(result.acceptance_lengths)
    assert result.acceptance_lengths[:-1] == [(correct * 10)[i] + 1 for i in range(steps - 1)]
    assert spec.info["linear_states"] == "static, exact rollback"


def test_slot_generation_equals_greedy_per_prompt(hybrid) -> None:
    """Continuous batching over 2 slots (prompts of different lengths, right-padded prefill,
    slots reused) gives each prompt HF's greedy answer."""
    prompts = [PROMPT, PROMPT[:3], PROMPT[2:9], [7]]
    decoder = SlotDecoder(hybrid, 2, 64, max_new_tokens=12, sync_every=4)
    outputs = decoder.generate(prompts, seeds=[0] * len(prompts))
    assert outputs == [hf_greedy(hybrid, p, 12) for p in prompts]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_graphed_compiled_hybrid_loops_equal_the_eager_ones_on_cuda(kind) -> None:
    model = tiny_hybrid_model(kind, vocab_size=VOCAB).cuda().eval()
    drafter = DFlashDrafter(drafter_config_for(model, block_size=4, target_layer_ids=[1, 5]))
    drafter.reset_parameters(3)
    drafter = drafter.cuda().eval()
    head = TargetHead.from_model(model)
    outputs = {}
    for graphs in (False, True):
        kw = dict(max_len=96, graphs=graphs, compile_backend="inductor" if graphs else None)
        spec = StaticDecoder(model, drafter=drafter, head=head, block_size=4, **kw)
        base = StaticDecoder(model, **kw)
        s, b = spec.decode(PROMPT, 40), base.decode(PROMPT, 40)
        outputs[graphs] = (s.output_ids, s.acceptance_lengths, b.output_ids)
    assert outputs[True][0] == outputs[False][0] == outputs[True][2]
    assert outputs[True][1] == outputs[False][1]


@pytest.mark.gpu
def test_the_fused_delta_step_kernel_equals_the_torch_step_on_cuda() -> None:
    from flashdraft.model import delta_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    r, nv, dk, dv = 3, 4, 128, 64
    q, k = (torch.randn(r, nv, 1, dk, device="cuda", generator=gen) for _ in range(2))
    q, k = (t / t.norm(dim=-1, keepdim=True) for t in (q, k))
    v = torch.randn(r, nv, 1, dv, device="cuda", generator=gen)
    g = -torch.rand(r, nv, 1, device="cuda", generator=gen)
    beta = torch.rand(r, nv, 1, device="cuda", generator=gen)
    state = torch.randn(r, nv, dk, dv, device="cuda", generator=gen)
    assert delta_kernel.available(state)
    ours, theirs = state.clone(), state.clone()
    o = static_hybrid.recurrent_step(q, k, v, g, beta, ours)
    static_hybrid.FUSED_STEP = False
    try:
        ref = static_hybrid.recurrent_step(q, k, v, g, beta, theirs)
    finally:
        static_hybrid.FUSED_STEP = True
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_hybrid_decode_bench_runs_in_smoke_sizes() -> None:
    """`bench/hybrid_decode.py --smoke` (the 27B-shaped hybrid's decode bench, a tiny hybrid on
    the CPU): every loop it times runs and reports, the speculative one with the rollback."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "bench/hybrid_decode.py", "--smoke"], cwd=root, capture_output=True,
        text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    result = json.loads(out.strip().splitlines()[-1])
    loops = {(row["loop"], row["B"]) for row in result["decode"]}
    assert ("HF eager, DynamicCache", 1) in loops and ("static, eager", 4) in loops
    spec = next(row for row in result["decode"] if row["B"] == 4)
    assert spec["linear states"] == "static, exact rollback" and spec["step / decode step"] > 0
    assert [row["backend"] for row in result["generate"]] == ["HF generate", "static slots"]
