"""CUDA-graph helpers and graph-safe sampling (`flashdraft.model.graphs`): the counter-based
uniforms are uniform, deterministic and keyed; Gumbel-max samples the softmax; the top-k /
top-p filter matches HF's warpers; `preserved` restores state. (A captured decode step
against the eager one: `tests/model/test_static.py`, GPU.)"""

from __future__ import annotations

import torch

from flashdraft.model.graphs import counter_uniform, filter_logits, gumbel, preserved


def test_counter_uniforms_are_uniform_deterministic_and_keyed() -> None:
    seed, counter = torch.tensor([7, 7, 8]), torch.tensor([3, 4, 3])
    u = counter_uniform(seed, counter, 0, 50_000)
    assert torch.equal(u, counter_uniform(seed, counter, 0, 50_000))  # a pure function
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u[0], bins=20, min=0, max=1)
    expected = u.shape[1] / 20
    assert float(((counts - expected) ** 2 / expected).sum()) < 50  # chi-square, 19 dof
    # another counter, seed or stream: unrelated numbers
    other = [u[1], u[2], counter_uniform(seed, counter, 1, 50_000)[0]]
    for v in other:
        assert abs(float(torch.corrcoef(torch.stack([u[0], v]))[0, 1])) < 0.02
        assert float((u[0] == v).float().mean()) < 1e-3


def test_gumbel_max_samples_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    draws = 20_000
    counters = torch.arange(draws)
    noise = gumbel(torch.full((draws,), 3), counters, 0, 5)
    picks = (logits + noise).argmax(-1)
    freq = torch.bincount(picks, minlength=5).float() / draws
    torch.testing.assert_close(freq, logits.softmax(-1)[0], atol=0.012, rtol=0)


def test_filter_logits_matches_hf_top_k_and_top_p() -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for top_k, top_p in [(5, 1.0), (0, 0.7), (10, 0.5), (0, 1.0)]:
        expected = scores.clone()
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        assert torch.equal(filter_logits(scores, top_k, top_p).isinf(), expected.isinf())


def test_preserved_restores_state() -> None:
    state = torch.arange(4)
    with preserved([state]):
        state.add_(10)
    assert state.tolist() == [0, 1, 2, 3]
