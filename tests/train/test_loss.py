import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config, tiny_head

from flashdraft.train.blocks import slot_weights
from flashdraft.train.loss import BlockStats, block_loss, head_cross_entropy, loss_normaliser


def _reference_ce(hidden, head, labels, coef):
    logits = head.logits(hidden)
    return (coef * F.cross_entropy(logits, labels, reduction="none")).sum()


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_chunked_head_ce_equals_unchunked_loss_and_gradient(softcap, chunk_rows) -> None:
    config = tiny_config()
    head = tiny_head(config, softcap=softcap)
    head.logit_scale = 1.3
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, config.hidden_size, generator=gen, dtype=torch.float64)
    head.weight = head.weight.double()
    labels = torch.randint(0, config.vocab_size, (50,), generator=gen)
    coef = torch.rand(50, generator=gen, dtype=torch.float64)
    coef[::5] = 0

    h1 = hidden.clone().requires_grad_()
    loss, correct = head_cross_entropy(h1, head, labels, coef, chunk_rows)
    (g1,) = torch.autograd.grad(loss * 2.5, h1)  # a non-unit upstream gradient

    h2 = hidden.clone().requires_grad_()
    ref = _reference_ce(h2, head, labels, coef)
    (g2,) = torch.autograd.grad(ref * 2.5, h2)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)
    assert torch.equal(correct, head.logits(hidden).argmax(-1) == labels)


def _micro_batch(seed: int, config, rows: int = 1, anchors: int = 6):
    gen = torch.Generator().manual_seed(seed)
    b = config.block_size
    hidden = torch.randn(rows, anchors * b, config.hidden_size, generator=gen)
    labels = torch.randint(0, config.vocab_size, (rows, anchors, b), generator=gen)
    mask = (torch.rand(rows, anchors, b, generator=gen) < 0.7).float()
    mask[..., 0] = 0
    mask[..., 1] = 1
    return hidden, labels, mask


def test_loss_is_independent_of_the_micro_batch_split() -> None:
    """SPEC trap 10: normalise by the global weight sum, never per micro-batch."""
    config = tiny_config()
    head = tiny_head(config)
    slot_w = slot_weights(config.block_size, 7.0)
    parts = [_micro_batch(s, config, anchors=a) for s, a in [(0, 3), (1, 9), (2, 5)]]
    # Very different masked counts per micro-batch make a per-micro-batch mean differ.
    parts[0][2][..., 2:] = 0

    def run(groups):
        total_norm = sum(loss_normaliser(m, slot_w) for _, _, m in parts)
        grads, losses = [], []
        for group in groups:
            for i in group:
                h, y, m = parts[i]
                h = h.clone().requires_grad_()
                loss, _ = block_loss(h, y, m, head, slot_w, total_norm, chunk_rows=5)
                loss.backward()
                losses.append(loss.detach())
                grads.append(h.grad)
        return sum(losses), grads

    whole, g_whole = run([[0, 1, 2]])
    split, g_split = run([[0], [1, 2]])
    torch.testing.assert_close(whole, split)
    for a, b in zip(g_whole, g_split, strict=True):
        torch.testing.assert_close(a, b)

    # And the global loss equals the weighted mean over every trained slot of the batch.
    logits_terms, weights = [], []
    for h, y, m in parts:
        h_slots = h.view(1, -1, config.block_size, config.hidden_size)
        ce = F.cross_entropy(head.logits(h_slots).flatten(0, 2), y.flatten(), reduction="none")
        w = (slot_w * m).flatten()
        logits_terms.append((w * ce).sum())
        weights.append(w.sum())
    torch.testing.assert_close(whole, sum(logits_terms) / sum(weights))


def test_tau_hat_is_prefix_correct_per_block() -> None:
    """tau_hat counts only the unbroken run of correct drafts in each block."""
    config = tiny_config(block_size=4)
    head = tiny_head(config)
    slot_w = slot_weights(4, 7.0)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 8, config.hidden_size, generator=gen)
    pred = head.logits(hidden).argmax(-1).view(1, 2, 4)
    labels = pred.clone()
    labels[0, 0, 2] = (labels[0, 0, 2] + 1) % config.vocab_size  # block 0: right, wrong, right
    labels[0, 1, 1] = (labels[0, 1, 1] + 1) % config.vocab_size  # block 1: wrong, right, right
    mask = torch.ones(1, 2, 4)
    mask[..., 0] = 0
    _, stats = block_loss(hidden, labels, mask, head, slot_w, loss_normaliser(mask, slot_w))
    summary = stats.summary()
    # Block 0 accepts 1 draft, block 1 accepts 0: tau_hat = 1 + (1 + 0) / 2.
    assert summary["tau_hat"] == pytest.approx(1.5)
    # Per-slot accuracy is marginal: slot 1 1/2, slot 2 1/2, slot 3 2/2.
    assert summary["acc"] == [0.5, 0.5, 1.0]
    # A marginal-accuracy estimate would claim 1 + .5 + .25 + .25 = 2.0: not what we report.


def test_stats_flatten_round_trip_and_add() -> None:
    config = tiny_config()
    head = tiny_head(config)
    slot_w = slot_weights(config.block_size, 7.0)
    h, y, m = _micro_batch(0, config)
    _, stats = block_loss(h, y, m, head, slot_w, loss_normaliser(m, slot_w))
    back = BlockStats.from_flat(stats.flat(), config.block_size)
    for a, b in zip(stats.as_tuple(), back.as_tuple(), strict=True):
        torch.testing.assert_close(a.double(), b)
    double = stats.add(stats).summary()
    assert double["loss"] == pytest.approx(stats.summary()["loss"])
    assert double["blocks"] == 2 * stats.summary()["blocks"]
