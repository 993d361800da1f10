import pytest
import torch
import torch.nn.functional as F
from helpers import speculators_oracle, tiny_config, tiny_head

from flashdraft.train.blocks import slot_weights
from flashdraft.train.config import LossSection
from flashdraft.train.loss import (
    BlockStats,
    DPace,
    block_loss,
    dpace_weights,
    hard_label_chunk,
    hard_label_log_q,
    head_cross_entropy,
    loss_normaliser,
    loss_slot_weights,
    soft_label_chunk,
)


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
    loss, correct, row_w = head_cross_entropy(h1, head, labels, coef, chunk_rows)
    assert row_w is None  # no D-PACE: every row weighs its coefficient
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (1.3, 3.0)])
def test_the_compiled_hard_label_chunk_is_the_eager_one(device, scale, softcap) -> None:
    """CUDA runs `hard_label_chunk` compiled (inductor); it traces in one graph (no break)
    and gives the eager loss, argmax and gradient (the CPU checks the trace with aot_eager,
    exactly: the traced branch (a where over [n, V]) and the eager one (one write per row)
    give the same values; the GPU the real kernels, in bf16 as the trainer calls it)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(3)
    z = (4 * torch.randn(37, 500, generator=gen)).to(device, dtype)
    labels = torch.randint(0, 500, (37,), generator=gen).to(device)
    coef = torch.rand(37, generator=gen).to(device)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(hard_label_chunk, backend=backend, fullgraph=True, dynamic=False)
    want = hard_label_chunk(z, labels, coef, scale, softcap, True)
    got = compiled(z, labels, coef, scale, softcap, True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[1], want[1])
    assert got[2] is not None and want[2] is not None
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2e-2, atol=1e-3)
    if device == "cpu":  # aot_eager runs the traced branch's ops: the eager one's values
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert compiled(z, labels, coef, scale, softcap, False)[2] is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (1.3, 3.0)])
def test_the_compiled_soft_label_chunk_is_the_eager_one(device, scale, softcap) -> None:
    """The same for `soft_label_chunk` (loss.labels = "soft"): one graph, the eager loss,
    argmax and gradient."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(4)
    z = (4 * torch.randn(37, 500, generator=gen)).to(device, dtype)
    ids, probs = _soft(gen, 37, 500, 8, dtype=torch.float32)
    labels, ids, probs = ids[:, 0].to(device), ids.to(device), probs.to(device, dtype)
    coef = torch.rand(37, generator=gen).to(device)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(soft_label_chunk, backend=backend, fullgraph=True, dynamic=False)
    want = soft_label_chunk(z, labels, coef, ids, probs, scale, softcap, True)
    got = compiled(z, labels, coef, ids, probs, scale, softcap, True)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[1], want[1])
    assert got[2] is not None and want[2] is not None
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2e-2, atol=1e-3)
    if device == "cpu":  # in place eagerly, out of place traced: the same values
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert compiled(z, labels, coef, ids, probs, scale, softcap, False)[2] is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("scale", "softcap"), [(1.0, None), (1.3, 3.0)])
def test_the_compiled_log_q_is_the_eager_one(device, scale, softcap) -> None:
    """D-PACE's log q of the hard label, compiled on CUDA (`_LOG_Q`): one graph, the eager
    values (exactly under aot_eager; to fp32 reduction order with inductor's kernels), each
    row's log-softmax at its label."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(5)
    z = (4 * torch.randn(37, 500, generator=gen)).to(device, dtype)
    labels = torch.randint(0, 500, (37,), generator=gen).to(device)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(hard_label_log_q, backend=backend, fullgraph=True, dynamic=False)
    want = hard_label_log_q(z, labels, scale, softcap)
    got = compiled(z, labels, scale, softcap)
    assert want.dtype == got.dtype == torch.float32 and want.shape == (37,)
    logits = z.float() * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ref = logits.log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    torch.testing.assert_close(want, ref, rtol=1e-5, atol=1e-5)
    if device == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_loss_is_independent_of_the_micro_batch_split() -> None:
    """docs/design.md §8 trap 10: normalise by the global weight sum, never per micro-batch."""
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


@pytest.mark.parametrize("dpace", [False, True])
def test_a_step_with_nothing_to_train_is_a_zero_loss_not_a_nan(dpace) -> None:
    """A row cut from a long prompt can hold no trained token: when no row of the step has
    one, the global normaliser is 0 and the loss and its gradient are 0 (not 0 / 0, which
    stopped the run as "not finite"); a step with one trained slot is unchanged."""
    config = tiny_config()
    head = tiny_head(config)
    h, y, m = _micro_batch(0, config, anchors=4)
    alpha = 0.5 if dpace else None
    weights = loss_slot_weights(
        LossSection(weighting="dpace" if dpace else "decay"), config.block_size
    )
    empty = torch.zeros_like(m)
    hidden = h.clone().requires_grad_()
    normaliser = loss_normaliser(empty, weights)
    assert float(normaliser) == 0
    loss, stats = block_loss(hidden, y, empty, head, weights, normaliser, 5, dpace_alpha=alpha)
    loss.backward()
    assert float(loss) == 0 and torch.count_nonzero(hidden.grad) == 0
    assert stats.summary()["loss"] == 0 and stats.summary()["blocks"] == 0
    one = torch.zeros_like(m)
    one[..., 0, 1] = 1  # slot 1 of the first anchor: the smallest non-empty normaliser
    norm_one = loss_normaliser(one, weights)
    assert float(norm_one) >= 1
    loss_one, _ = block_loss(h, y, one, head, weights, norm_one, 5, dpace_alpha=alpha)
    assert torch.isfinite(loss_one) and float(loss_one) > 0
    if not dpace:  # the decay's w_1 = 1: the loss is that slot's cross-entropy
        slot = h.view(1, -1, config.block_size, config.hidden_size)[0, 0, 1]
        want = F.cross_entropy(head.logits(slot[None]), y[0, 0, 1:2])
        torch.testing.assert_close(loss_one, want)


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


# ---- soft labels: KL to the target's top-k distribution ----


def _reference_kl(hidden, head, soft_ids, soft_probs, coef):
    """sum_i coef_i KL(p_i || softmax(logits_i)), p_i scattered densely over the vocabulary."""
    logits = head.logits(hidden)
    p = torch.zeros_like(logits).scatter(1, soft_ids, soft_probs.to(logits.dtype))
    log_q = torch.log_softmax(logits, dim=-1)
    kl = (torch.special.xlogy(p, p) - p * log_q).sum(dim=-1)
    return (coef * kl).sum()


def _soft(gen, rows: int, vocab: int, k: int, dtype=torch.float64):
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(rows)])
    probs = torch.softmax(3 * torch.randn(rows, k, generator=gen, dtype=dtype), dim=-1)
    probs[0, 1:] = 0  # a one-hot row (0 log 0 = 0) ...
    probs[0, 0] = 1
    return ids, probs


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_soft_labels_give_the_dense_kl_and_its_gradient(softcap, chunk_rows) -> None:
    config = tiny_config()
    head = tiny_head(config, softcap=softcap)
    head.logit_scale = 1.3
    head.weight = head.weight.double()
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, config.hidden_size, generator=gen, dtype=torch.float64)
    soft_ids, soft_probs = _soft(gen, 40, config.vocab_size, 5)
    labels = soft_ids[:, 0]
    coef = torch.rand(40, generator=gen, dtype=torch.float64)
    coef[::6] = 0

    h1 = hidden.clone().requires_grad_()
    loss, correct, _ = head_cross_entropy(
        h1, head, labels, coef, chunk_rows, soft=(soft_ids, soft_probs)
    )
    (g1,) = torch.autograd.grad(loss * 2.5, h1)
    h2 = hidden.clone().requires_grad_()
    ref = _reference_kl(h2, head, soft_ids, soft_probs, coef)
    (g2,) = torch.autograd.grad(ref * 2.5, h2)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)
    assert torch.equal(correct, head.logits(hidden).argmax(-1) == labels)  # vs the hard label
    # A one-hot soft label is the hard label: the KL is that row's cross-entropy.
    one, _, _ = head_cross_entropy(hidden[:1], head, labels[:1], torch.ones(1).double())
    alone, _, _ = head_cross_entropy(
        hidden[:1], head, labels[:1], torch.ones(1).double(), soft=(soft_ids[:1], soft_probs[:1])
    )
    torch.testing.assert_close(alone.double(), one.double())


def test_soft_labels_over_the_whole_vocabulary_are_the_full_distribution() -> None:
    """top_k = V: the target's full distribution, so the loss is the full KL (and, plus the
    target's entropy, the full soft cross-entropy) with its gradient."""
    config = tiny_config()
    head = tiny_head(config)
    teacher = tiny_head(config, seed=5)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 12, config.hidden_size, generator=gen)
    teacher_hidden = torch.randn(1, 12, config.hidden_size, generator=gen)
    positions = torch.arange(12)[None]
    argmax, ids, probs = teacher.labels_at(teacher_hidden, positions, 5, top_k=config.vocab_size)
    assert ids is not None and probs is not None
    p_full = teacher.logits(teacher_hidden[0]).softmax(-1)
    coef = torch.full((12,), 1 / 12)

    h1 = hidden[0].clone().requires_grad_()
    loss, _, _ = head_cross_entropy(h1, head, argmax[0], coef, 5, soft=(ids[0], probs[0]))
    loss.backward()
    h2 = hidden[0].clone().requires_grad_()
    log_q = torch.log_softmax(head.logits(h2), dim=-1)
    cross = -(p_full * log_q).sum(-1).mean()  # soft cross-entropy against the full softmax
    entropy = -(p_full * p_full.log()).sum(-1).mean()
    (cross - entropy).backward()
    torch.testing.assert_close(loss, cross - entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(
        F.kl_div(log_q, p_full, reduction="batchmean"), loss, rtol=1e-5, atol=1e-6
    )


# ---- D-PACE position weights ----


def _dense_dpace(hidden, labels, mask, head, alpha, normaliser):
    """D-PACE ("full") written out slot by slot: loss = sum(m W CE) / normaliser with W
    detached, and sum(m W)."""
    rows, num, block = labels.shape
    logits = head.logits(hidden.view(rows, num, block, -1))
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
    ce = ce.view(rows, num, block)
    q = torch.exp(-ce.detach())
    weights = torch.zeros(rows, num, block, dtype=ce.dtype)
    for r in range(rows):
        for a in range(num):
            prefix = []  # P_k = prod over trained slots i <= k of (1 - alpha) q_i + alpha
            running = 1.0
            for k in range(1, block):
                if mask[r, a, k] > 0:
                    running *= float((1 - alpha) * q[r, a, k] + alpha)
                prefix.append(running)
            for k in range(1, block):
                weights[r, a, k] = sum(prefix[j - 1] for j in range(k, block) if mask[r, a, j] > 0)
    loss = (mask * weights * ce).sum() / normaliser
    return loss, (mask * weights).sum()


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk_rows", [1, 5, 64])
def test_dpace_equals_its_dense_definition(alpha, chunk_rows) -> None:
    """Chunks of any size (rounded down to whole blocks), a mask with holes inside blocks
    (untrained slots are no-ops in the product), the gradient with W held fixed."""
    config = tiny_config()
    head = tiny_head(config)
    h, y, m = _micro_batch(3, config, rows=2, anchors=5)
    # Make the drafter right on some labels, so q spans (0, 1).
    y.view(-1)[::3] = head.logits(h).argmax(-1).view(-1)[::3]
    slot_w = loss_slot_weights(LossSection(weighting="dpace"), config.block_size)
    assert slot_w.tolist() == [0.0] + [1.0] * (config.block_size - 1)
    norm = loss_normaliser(m, slot_w) + 3.0  # a global count: other micro-batches' slots too

    h1 = h.clone().requires_grad_()
    loss, stats = block_loss(h1, y, m, head, slot_w, norm, chunk_rows, dpace_alpha=alpha)
    loss.backward()
    h2 = h.clone().requires_grad_()
    ref, ref_weight = _dense_dpace(h2, y, m, head, alpha, norm)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats.weight, ref_weight)
    assert stats.summary()["loss"] == pytest.approx(float(ref * norm / ref_weight), rel=1e-5)
    if alpha == 1.0:  # s = 1: W_k counts the trained slots from k to the block's end
        trained = m[..., 1:]
        left = trained.flip(-1).cumsum(-1).flip(-1)
        torch.testing.assert_close(stats.weight, (trained * left).sum())


@pytest.mark.parametrize("chunk_rows", [3, 7, 64])
def test_dpace_with_soft_labels_is_the_weighted_dense_kl(chunk_rows) -> None:
    """D-PACE weights (from log q of the hard label, held fixed) on the soft-label KL: the
    same fused chunk as without D-PACE, fed coef x W."""
    config = tiny_config()
    head = tiny_head(config)
    head.weight = head.weight.double()
    gen = torch.Generator().manual_seed(6)
    span, blocks = 3, 5
    hidden = torch.randn(span * blocks, config.hidden_size, generator=gen, dtype=torch.float64)
    soft_ids, soft_probs = _soft(gen, span * blocks, config.vocab_size, 4)
    labels = soft_ids[:, 0]
    coef = torch.rand(span * blocks, generator=gen, dtype=torch.float64)
    coef[4] = 0  # an untrained slot inside a block
    dpace = DPace(0.5, span)

    h1 = hidden.clone().requires_grad_()
    loss, _, w = head_cross_entropy(
        h1, head, labels, coef, chunk_rows, dpace=dpace, soft=(soft_ids, soft_probs)
    )
    (g1,) = torch.autograd.grad(loss, h1)
    log_q = torch.log_softmax(head.logits(hidden).float(), -1).gather(1, labels[:, None])[:, 0]
    want_w = dpace_weights(log_q, coef > 0, dpace)
    assert w is not None
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
    h2 = hidden.clone().requires_grad_()
    ref = _reference_kl(h2, head, soft_ids, soft_probs, coef * want_w.double())
    (g2,) = torch.autograd.grad(ref, h2)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-7)


def test_dpace_weights_follow_the_drafters_confidence() -> None:
    """A block the drafter gets right early puts weight on later slots: W_k grows with the
    probability of the slots before k."""
    config = tiny_config()
    head = tiny_head(config)
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(2 * 3, config.hidden_size, generator=gen)
    pred = head.logits(hidden).argmax(-1)
    labels = pred.clone()
    labels[:3] = (pred[:3] + 1) % config.vocab_size  # block 0 wrong everywhere, block 1 right
    coef = torch.ones(6)
    _, _, w = head_cross_entropy(hidden, head, labels, coef, dpace=DPace(0.0, 3))
    assert w is not None
    w = w.view(2, 3)
    assert (w[1, 1:] > w[0, 1:]).all()  # confident prefixes lift the later slots
    assert (w[:, :-1] >= w[:, 1:]).all()  # a suffix sum never grows along the block


def test_dpace_weights_are_speculators_own() -> None:
    """The oracle (speculators, which `make test` installs):
    `dpace_weights` over slots 1..B-1 equals speculators' `dpace_loss_decay` over whole
    blocks (slot 0 untrained there), for any confidence, trained mask and smoothing; the
    peer comparisons rest on the two being one formula."""
    utils = speculators_oracle("speculators.losses.utils")
    gen = torch.Generator().manual_seed(8)
    blocks, size = 64, 16
    for alpha in (0.0, 0.5, 0.9):
        ce = torch.rand(blocks, size, generator=gen) * 4  # -log q, q from 1 down to e^-4
        mask = torch.rand(blocks, size, generator=gen) > 0.2
        mask[:, 0] = False  # the anchor slot, never trained
        theirs = utils.dpace_loss_decay(
            None, mask.reshape(1, -1).float(), size, alpha, ce.reshape(1, -1)
        ).view(blocks, size)
        trained = mask[:, 1:].reshape(-1)
        ours = dpace_weights(-ce[:, 1:].reshape(-1), trained, DPace(alpha, size - 1)) * trained
        # (an untrained slot's W is 0 there; here its loss coefficient is, so W x coef agree)
        torch.testing.assert_close(ours.view(blocks, size - 1), theirs[:, 1:], rtol=1e-6, atol=0)
        assert (theirs[:, 0] == 0).all()


def test_dpace_loss_is_independent_of_the_micro_batch_and_rank_split() -> None:
    """docs/design.md §8 trap 10 for D-PACE: W is per block and the normaliser is the global trained-slot
    count, so any split of the blocks over micro-batches (or ranks, whose gradients are
    summed) gives the same loss and gradients, equal to the global dense definition."""
    config = tiny_config()
    head = tiny_head(config)
    slot_w = loss_slot_weights(LossSection(weighting="dpace"), config.block_size)
    parts = [_micro_batch(s, config, anchors=a) for s, a in [(0, 3), (1, 9), (2, 5)]]
    parts[0][2][..., 2:] = 0  # very different trained counts per micro-batch
    total_norm = sum(loss_normaliser(m, slot_w) for _, _, m in parts)

    def run(groups):
        grads, losses = [], []
        for group in groups:  # a rank, or a step's micro-batches
            for i in group:
                h, y, m = parts[i]
                h = h.clone().requires_grad_()
                loss, _ = block_loss(h, y, m, head, slot_w, total_norm, 4, dpace_alpha=0.5)
                loss.backward()
                losses.append(loss.detach())
                grads.append(h.grad)
        return sum(losses), grads

    whole, g_whole = run([[0, 1, 2]])
    for groups in ([[0], [1, 2]], [[2], [0], [1]]):
        split, g_split = run(groups)
        torch.testing.assert_close(whole, split)
        order = [i for g in groups for i in g]
        for i, grad in zip(order, g_split, strict=True):
            torch.testing.assert_close(g_whole[i], grad)
    reference = sum(_dense_dpace(h, y, m, head, 0.5, total_norm)[0] for h, y, m in parts)
    torch.testing.assert_close(whole, reference, rtol=1e-5, atol=1e-6)
    # A per-micro-batch normaliser would differ: the test can fail.
    per_part = sum(
        block_loss(h, y, m, head, slot_w, loss_normaliser(m, slot_w), dpace_alpha=0.5)[0]
        for h, y, m in parts
    ) / len(parts)
    assert not torch.isclose(whole, per_part)


def test_the_decay_slot_weights_are_the_runs_gamma() -> None:
    torch.testing.assert_close(loss_slot_weights(LossSection(), 16), slot_weights(16, 7.0))
    torch.testing.assert_close(loss_slot_weights(LossSection(), 8), slot_weights(8, 3.5))
    torch.testing.assert_close(loss_slot_weights(LossSection(gamma=2.0), 8), slot_weights(8, 2.0))
