"""The draft-and-verify loop (docs/design.md §5) with throwaway models whose acceptance we rig.

The oracle drafter knows the target's greedy continuation and drafts a chosen number of
correct tokens per step, so the expected acceptance of every step is known in advance:
never (tau = 1), always (tau = B but for the last step) and sometimes. In every regime the
output must be the target's own greedy decoding, token for token.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from helpers import drafter_config_for, tiny_hybrid, tiny_llama
from torch import Tensor

from flashdraft.eval.speculative import Decoder, DecodeResult, Sampler, decode
from flashdraft.model import hybrid
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter, DraftCache
from flashdraft.model.head import TargetHead
from flashdraft.model.target import LayerTaps

PROMPT = [5, 17, 3, 42, 8, 11, 29]
Policy = Callable[[int], int]  # block start position -> number of correct leading drafts


@pytest.fixture(scope="module")
def target():
    return tiny_llama(initializer_range=0.3)  # varied greedy paths, not one repeated token


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None):
    """The reference: transformers' own greedy decoding (generated tokens only)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


class OracleDrafter(DFlashDrafter):
    """Drafts the target's greedy tokens for the first `policy(start)` slots, wrong ones after.

    Its hidden states are one-hot rows read through an identity head (`oracle_head`), so the
    draft argmax is exactly the token it picks. It also checks what the loop feeds it: the
    bonus token at slot 0 and a context cache of exactly `start` positions.
    """

    def __init__(self, config: DrafterConfig, reference: list[int], policy: Policy) -> None:
        super().__init__(config)
        self.reference = reference
        self.policy = policy
        self.embedding: torch.nn.Module | None = None
        self.last_cache: tuple[int, Tensor] | None = None

    def draft_block(self, cache: DraftCache, block_embeds: Tensor, start: int) -> Tensor:
        assert cache.length == start
        assert self.embedding is not None
        bonus = self.embedding(torch.tensor([self.reference[start]]))
        torch.testing.assert_close(block_embeds[0, 0], bonus[0].to(block_embeds.dtype))
        self.last_cache = (start, cache.keys[0].clone())
        b, vocab = block_embeds.shape[1], self.config.vocab_size
        correct = self.policy(start)
        hidden = torch.zeros(1, b, self.config.hidden_size)
        for k in range(1, b):
            token = self.reference[start + k]
            if k > correct:
                token = (token + 1) % vocab  # never the target's argmax
            hidden[0, k, token] = 10.0
        return hidden


def oracle_setup(target, block_size: int, policy: Policy, horizon: int = 80):
    reference = PROMPT + hf_greedy(target, PROMPT, horizon)
    config = drafter_config_for(target, block_size=block_size)
    drafter = OracleDrafter(config, reference, policy)
    drafter.embedding = target.get_input_embeddings()
    # Identity head (V == H): the drafter's one-hot hidden state is its logits.
    head = TargetHead(embedding=target.get_input_embeddings(), weight=torch.eye(config.vocab_size))
    taps = LayerTaps(target, config.target_layer_ids)
    decoder = Decoder(target, drafter, head, taps, block_size=block_size)
    return decoder, drafter, reference


def expected_lengths(
    reference: list[int], block_size: int, policy: Policy, max_new: int, eos: set[int]
) -> list[int]:
    """Acceptance lengths the loop must report, simulated independently of it."""
    p = len(PROMPT)
    produced, lengths, start = 1, [], p
    if reference[p] in eos:
        return []
    while produced < max_new:
        run = min(policy(start), block_size - 1) + 1
        tokens = reference[start + 1 : start + 1 + run][: max_new - produced]
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        lengths.append(cut)
        produced += cut
        if cut < len(tokens) or tokens[cut - 1] in eos:
            break
        start += run
    return lengths


def check_accounting(result: DecodeResult, block_size: int) -> None:
    assert sum(result.acceptance_lengths) + 1 == len(result.output_ids)
    assert all(1 <= n <= block_size for n in result.acceptance_lengths)
    if result.acceptance_lengths:
        assert result.tau == pytest.approx(
            sum(result.acceptance_lengths) / len(result.acceptance_lengths)
        )


POLICIES: dict[str, Policy] = {
    "never": lambda start: 0,
    "always": lambda start: 99,
    "sometimes": lambda start: (5 * start + 3) % 7,
}


@pytest.mark.parametrize("regime", sorted(POLICIES))
@pytest.mark.parametrize(("block_size", "max_new"), [(4, 30), (8, 37)])
def test_never_always_sometimes_accept(target, regime: str, block_size: int, max_new: int):
    policy = POLICIES[regime]
    decoder, _, reference = oracle_setup(target, block_size, policy)
    try:
        result = decode(decoder, PROMPT, max_new)
    finally:
        assert decoder.taps is not None
        decoder.taps.remove()
    assert result.output_ids == hf_greedy(target, PROMPT, max_new)
    expected = expected_lengths(reference, block_size, policy, max_new, set())
    assert result.acceptance_lengths == expected
    check_accounting(result, block_size)
    if regime == "never":
        assert result.tau == 1.0 and result.num_steps == max_new - 1
    if regime == "always":
        assert all(n == block_size for n in result.acceptance_lengths[:-1])
        assert result.acceptance_lengths[-1] == ((max_new - 1) % block_size or block_size)
    if regime == "sometimes":
        assert len(set(result.acceptance_lengths)) > 2


def test_plain_decoding_equals_hf_generate(target):
    """B = 1 without a drafter is the target's greedy decoding: the lossless reference."""
    result = decode(Decoder(target), PROMPT, 25)
    assert result.output_ids == hf_greedy(target, PROMPT, 25)
    assert result.acceptance_lengths == [1] * 24
    eos = result.output_ids[10]
    stop = result.output_ids.index(eos)
    stopped = decode(Decoder(target, eos_ids=frozenset([eos])), PROMPT, 25)
    assert stopped.output_ids == result.output_ids[: stop + 1]
    assert stopped.output_ids == hf_greedy(target, PROMPT, 25, eos=[eos])
    assert stopped.stopped_at_eos


def test_eos_inside_an_accepted_run_stops_exactly_like_greedy(target):
    decoder, _, reference = oracle_setup(target, 8, POLICIES["always"])
    greedy = reference[len(PROMPT) :]
    # The first generated token that is new after the third: it ends the output in the
    # middle of the first fully accepted block.
    j = next(i for i in range(3, 20) if greedy[i] not in greedy[:i])
    eos = greedy[j]
    decoder.eos_ids = frozenset([eos])
    try:
        result = decode(decoder, PROMPT, 40)
    finally:
        assert decoder.taps is not None
        decoder.taps.remove()
    assert result.output_ids == greedy[: j + 1] == hf_greedy(target, PROMPT, 40, eos=[eos])
    assert result.stopped_at_eos
    assert result.acceptance_lengths == expected_lengths(
        reference, 8, POLICIES["always"], 40, {eos}
    )
    check_accounting(result, 8)


def test_first_token_eos_gives_no_steps(target):
    first = hf_greedy(target, PROMPT, 1)[0]
    decoder, _, _ = oracle_setup(target, 4, POLICIES["always"])
    decoder.eos_ids = frozenset([first])
    try:
        result = decode(decoder, PROMPT, 10)
    finally:
        assert decoder.taps is not None
        decoder.taps.remove()
    assert result.output_ids == [first] and result.acceptance_lengths == []
    assert result.tau is None and result.stopped_at_eos


def test_drafter_cache_holds_exactly_the_verified_context(target):
    """Rejected drafts never enter the drafter's context; accepted ones do, with their own
    taps from the verify forward (equal to a fresh forward over the final sequence)."""
    decoder, drafter, reference = oracle_setup(target, 4, POLICIES["sometimes"])
    assert decoder.taps is not None
    try:
        decode(decoder, PROMPT, 30)
        assert drafter.last_cache is not None
        start, keys = drafter.last_cache
        with torch.inference_mode():
            target(input_ids=torch.tensor([reference[:start]]), use_cache=False)
            features = decoder.taps.features()
        fresh = DraftCache()
        drafter.extend_cache(fresh, features, torch.arange(start)[None])
    finally:
        decoder.taps.remove()
    torch.testing.assert_close(keys, fresh.keys[0], rtol=1e-4, atol=1e-5)


def test_real_drafter_is_lossless_at_any_block_size(target):
    """A random-init DFlashDrafter through the whole loop: output == greedy decoding."""
    config = drafter_config_for(target, block_size=6, num_hidden_layers=2)
    drafter = DFlashDrafter(config)
    drafter.reset_parameters(seed=3)
    taps = LayerTaps(target, config.target_layer_ids)
    head = TargetHead.from_model(target)
    try:
        for block_size in (2, 6, 9):
            decoder = Decoder(target, drafter, head, taps, block_size=block_size)
            result = decode(decoder, PROMPT, 33)
            assert result.output_ids == hf_greedy(target, PROMPT, 33), block_size
            check_accounting(result, block_size)
    finally:
        taps.remove()


# ---- T > 0: speculative rejection sampling keeps the target's distribution ----


class ResampleFromTarget(Sampler):
    """A classic bug: after a rejection, sample from p instead of norm(max(0, p - q))."""

    def verify(self, drafts: Tensor, draft_logits: Tensor, target_logits: Tensor):
        n = drafts.shape[0]
        p = torch.softmax(target_logits.float() / self.temperature, dim=-1)
        q = torch.softmax(draft_logits.float() / self.temperature, dim=-1)
        rows = torch.arange(n)
        u = torch.rand(n, generator=self.generator)
        accepted = (u * q[rows, drafts] < p[rows, drafts]).long().cumprod(dim=0).sum()
        return accepted, torch.multinomial(p[accepted], 1, generator=self.generator)[0]


def chi_square_p_value(counts: Tensor, probs: Tensor) -> float:
    """Pearson chi-square goodness of fit, cells with expected count < 5 pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((len(obs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def test_sampling_matches_the_targets_distribution_and_a_wrong_rule_does_not():
    """4-token vocabulary, 4 new tokens, B = 3: the first token comes from the prefill, the
    next three from drafts kept, resampled residuals, or the bonus after a full accept. The
    joint law of the 4 tokens (256 outcomes, exact from the target) must be matched."""
    vocab, block, new, prompt = 4, 3, 4, [0, 1, 2, 1, 3]
    target = tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=3, initializer_range=0.3)
    outcomes = torch.tensor(list(itertools.product(range(vocab), repeat=new)))
    ids = torch.cat([torch.tensor(prompt).expand(len(outcomes), -1), outcomes], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(target(input_ids=ids).logits.float(), dim=-1)
    steps = logp[:, len(prompt) - 1 : len(prompt) - 1 + new]
    exact = steps.gather(2, outcomes[..., None]).squeeze(-1).sum(dim=1).exp()

    config = drafter_config_for(target, block_size=block)
    drafter = DFlashDrafter(config)
    drafter.reset_parameters(seed=0)
    taps = LayerTaps(target, config.target_layer_ids)
    decoder = Decoder(target, drafter, TargetHead.from_model(target), taps, block_size=block)
    p_values, lengths = {}, []
    try:
        for rule in (Sampler, ResampleFromTarget):
            sampler = rule(temperature=1.0, generator=torch.Generator().manual_seed(0))
            counts = torch.zeros(len(outcomes))
            for _ in range(800):
                result = decode(decoder, prompt, new, sampler)
                lengths += result.acceptance_lengths
                index = sum(t * vocab ** (new - 1 - i) for i, t in enumerate(result.output_ids))
                counts[index] += 1
            p_values[rule.__name__] = chi_square_p_value(counts, exact)
    finally:
        taps.remove()
    assert set(lengths) == {1, 2, 3}  # rejections, partial and full acceptance all occur
    assert p_values["Sampler"] > 1e-3, p_values
    assert p_values["ResampleFromTarget"] < 1e-6, p_values


# ---- hybrid targets: linear-attention states are restored and re-fed, never cropped ----


@pytest.fixture(scope="module")
def hybrid_target():
    return tiny_hybrid("qwen3_5")


@pytest.mark.parametrize(
    ("kind", "regime"), [*(("qwen3_5", r) for r in sorted(POLICIES)), ("qwen3_next", "sometimes")]
)
def test_a_hybrid_target_decodes_exactly_its_greedy_output(hybrid_target, kind, regime):
    hybrid_target = hybrid_target if kind == "qwen3_5" else tiny_hybrid(kind)
    policy = POLICIES[regime]
    decoder, drafter, reference = oracle_setup(hybrid_target, 4, policy)
    assert decoder.taps is not None
    try:
        result = decode(decoder, PROMPT, 30)
        # The drafter's context after the last step: the verified tokens' taps, as a fresh
        # forward over the final sequence gives them.
        assert drafter.last_cache is not None
        start, keys = drafter.last_cache
        with torch.inference_mode():
            hybrid_target(input_ids=torch.tensor([reference[:start]]), use_cache=False)
            features = decoder.taps.features()
    finally:
        decoder.taps.remove()
    assert result.output_ids == hf_greedy(hybrid_target, PROMPT, 30)
    assert result.acceptance_lengths == expected_lengths(reference, 4, policy, 30, set())
    check_accounting(result, 4)
    fresh = DraftCache()
    drafter.extend_cache(fresh, features, torch.arange(start)[None])
    torch.testing.assert_close(keys, fresh.keys[0], rtol=1e-4, atol=1e-4)


def test_without_the_rollback_a_hybrid_target_leaves_its_greedy_output(hybrid_target, monkeypatch):
    """Cropping only the K/V layers leaves the rejected drafts in the recurrent states (the
    linear layers' token counts, transformers >= 5.25, are put back: positions stay right)."""

    def crop_kv_only(self, saved, tokens: int) -> None:
        linear = [layer for layer in self.cache.layers if hasattr(layer, "recurrent_states")]
        for layer, (_, _, count) in zip(linear, saved, strict=True):
            if count is not None:
                layer.cumulative_length_linear.copy_(count)
        for layer in self.cache.layers:
            if not hasattr(layer, "recurrent_states"):
                layer.crop(-tokens)

    config = drafter_config_for(hybrid_target, block_size=4)
    drafter = DFlashDrafter(config)
    drafter.reset_parameters(seed=3)
    taps = LayerTaps(hybrid_target, config.target_layer_ids)
    decoder = Decoder(hybrid_target, drafter, TargetHead.from_model(hybrid_target), taps, 4)
    try:
        exact = decode(decoder, PROMPT, 30).output_ids
        monkeypatch.setattr(hybrid.LinearStateRollback, "rewind", crop_kv_only)
        broken = decode(decoder, PROMPT, 30).output_ids
    finally:
        taps.remove()
    assert exact == hf_greedy(hybrid_target, PROMPT, 30)
    assert broken != exact
