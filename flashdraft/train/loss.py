"""The drafter's loss through the target's LM head, in chunks, and the training metrics.

Shape legend: R rows, A anchors, B block size, H hidden, V vocabulary, N = R*A*(B-1) trained
rows (slot 0 is never trained, so it never reaches the head), k soft labels per row.

Per trained slot the loss is KL(p || q), q = softmax(head(h)) the drafter's distribution and
p the label's: one-hot on the target's argmax (or the data token), where the KL is the
cross-entropy; or, with `loss.labels = "soft"`, the target's top-k distribution
renormalised, where it is the soft cross-entropy minus the entropy of p (a constant: the
same gradient, and 0 at a perfect match, so `loss` means the same thing in both cases);
with `loss.argmax_mix` = m, p = (1 - m) top-k + m one-hot(argmax) (made with the labels,
`features.target_outputs`), so the logged loss depends on m too.

Slot weights (`loss.weighting`):
* decay (DFlash paper): w_k = exp(-(k-1)/gamma); loss = sum(w_k m KL) / sum(w_k m).
* dpace (D-PACE, its "full" variant): per block, from the drafter's probability q_k of the
  hard label, s_k = (1-a) q_k + a on trained slots and 1 elsewhere, P_k = prod_{i<=k} s_i
  (a smoothed chance that slots 1..k are all accepted), W_k = sum_{j>=k} m_j P_j (the part of
  the smoothed accepted length sum_j m_j P_j that rests on slot k); W is detached, so each
  slot's gradient is its KL gradient scaled by W_k. loss = sum(W m KL) / sum(m).

Either way the normaliser is a sum over the *global* batch (all micro-batches of all ranks,
docs/design.md §8 trap 10) that the caller passes in, known before any forward from the trained-slot
masks: sum(w_k m), with w = [0, 1, ..., 1] for dpace (`loss_slot_weights`). So the gradient
of each micro-batch is already its exact share and results do not depend on the split. For
dpace this is why the normaliser is the trained-slot count and not sum(W m): W comes out of
the drafter's forward, so the global sum(W m) would be known only after the last
micro-batch's forward, too late for the first one's backward. The objective is thus sum(W m
KL) over blocks divided by a split-independent constant (its scale grows with the mean W,
between 0 and B-1, as training raises q; D-PACE's reference divides by the number of
sequences instead). The logged `loss` is sum(W m KL) / sum(W m): a weighted mean KL, on the
same scale as the decay's.

The LM head + KL run in chunks of rows: the gradient w.r.t. the hidden states is computed in
the forward pass, chunk by chunk, so neither the [N, V] logits nor their gradient ever exist
in full (a Qwen3 head at N = 7680 would be 4.7 GB of fp32 logits, twice). With dpace a
chunk holds whole blocks (a multiple of B-1 rows), since W runs along the block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flashdraft.model.head import TargetHead, scaled_logits
from flashdraft.train.blocks import slot_weights
from flashdraft.train.config import LossSection

DEFAULT_CHUNK_ROWS = 1024


@dataclass(frozen=True, slots=True)
class DPace:
    """D-PACE weighting of rows that come in blocks of `span` consecutive rows (B-1)."""

    alpha: float
    span: int


def dpace_weights(log_q: Tensor, trained: Tensor, dpace: DPace) -> Tensor:
    """W [n] of n rows (whole blocks) from log q [n], the drafter's log-probability of each
    row's hard label, and trained [n] bool (see the module docstring)."""
    q = log_q.exp().view(-1, dpace.span)
    m = trained.view(-1, dpace.span)
    s = torch.where(m, (1.0 - dpace.alpha) * q + dpace.alpha, torch.ones_like(q))
    reach = torch.cumprod(s, dim=1) * m  # m_j P_j
    return reach.flip(1).cumsum(dim=1).flip(1).reshape(-1)  # sum over j >= k


def _chunk_logits(z: Tensor, scale: float, softcap: float | None) -> Tensor:
    """z = h @ W^T -> the target's logits in fp32 (scale, then softcap), as `TargetHead`."""
    return scaled_logits(z.float(), scale, softcap)


def _chunk_grad(g: Tensor, logits: Tensor, scale: float, softcap: float | None) -> Tensor:
    """dL/dlogits -> dL/dz: back through the softcap (d/ds c tanh(s/c) = 1 - tanh^2) and
    the scale."""
    if softcap is not None:
        g = g * (1.0 - (logits / softcap) ** 2)
    if scale != 1.0:
        g = g * scale
    return g


def hard_label_chunk(
    z: Tensor, labels: Tensor, coef: Tensor, scale: float, softcap: float | None, grad: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk of the hard-label KL (the cross-entropy) from z = h @ W^T [n, V]:
    (sum_i coef_i CE_i, argmax_i == label_i, dCE/dz x coef [n, V] in z's dtype when `grad`).
    A pure function of its inputs, so that CUDA runs it compiled (`_HARD_CHUNK`): the fp32
    logits then never exist, one read of z for the reductions and one for the gradient
    (eager CUDA ran ~10 kernels over [n, V] fp32: on a 135M target most of the LM head's
    time). The CPU runs it eagerly, in place where the traced graph would not differ."""
    logits = _chunk_logits(z, scale, softcap)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, labels[:, None]).squeeze(1)
    correct = logits.argmax(dim=-1) == labels
    total = (coef * (lse - picked)).sum()
    if not grad:
        return total, correct, None
    # dCE/dlogits = softmax - onehot, times the row's coefficient, then back to z. In place
    # where that is free: compiled, the graph is the same; eagerly (the CPU) each [n, V]
    # temporary is a fresh allocation: this chunk ran in half the time, the same values
    g = (logits - lse[:, None]).exp_()
    if torch.compiler.is_compiling():  # one fused kernel: the -1 rides along the exp
        columns = torch.arange(g.shape[1], device=g.device)
        g = torch.where(columns[None, :] == labels[:, None], g - 1.0, g)
    else:  # one write per row, not three passes over [n, V]; the same values
        g[torch.arange(g.shape[0], device=g.device), labels] -= 1.0
    g.mul_(coef[:, None])
    return total, correct, _chunk_grad(g, logits, scale, softcap).to(z.dtype)


def soft_label_chunk(
    z: Tensor,
    labels: Tensor,
    coef: Tensor,
    ids: Tensor,
    p: Tensor,
    scale: float,
    softcap: float | None,
    grad: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`hard_label_chunk` with soft labels: p [n, k] the target's top-k probabilities at ids
    [n, k] (renormalised by the caller or not: sum(p) is the row's mass). KL(p || q) =
    sum_j p_j log p_j - sum_j p_j logit_j + sum(p) lse; dKL/dlogits = sum(p) softmax - p.
    `labels` (the target's argmax) only count `correct`. Compiled on CUDA as the hard chunk
    is: eagerly its ~12 kernels over [n, V] fp32 made the 3-layer SmolLM2 drafter's step
    1.9x the hard-label one (an H200)."""
    logits = _chunk_logits(z, scale, softcap)
    lse = torch.logsumexp(logits, dim=-1)
    correct = logits.argmax(dim=-1) == labels
    p = p.float()
    mass = p.sum(dim=-1)
    cross = mass * lse - (p * logits.gather(1, ids)).sum(dim=-1)
    total = (coef * (cross + torch.special.xlogy(p, p).sum(dim=-1))).sum()
    if not grad:
        return total, correct, None
    g = (logits - lse[:, None]).exp_().mul_(mass[:, None])  # in place, as the hard chunk
    g = g.scatter_add_(1, ids, -p).mul_(coef[:, None])
    return total, correct, _chunk_grad(g, logits, scale, softcap).to(z.dtype)


def hard_label_log_q(z: Tensor, labels: Tensor, scale: float, softcap: float | None) -> Tensor:
    """log q [n] of each row's hard label from z = h @ W^T [n, V], in fp32: D-PACE's input,
    before the chunk's loss (its coefficients need it). A pure function, compiled on CUDA
    (`_LOG_Q`) as the chunks are: eagerly a bf16 chunk's fp32 logits are written out whole
    and read again by each of logsumexp's kernels, 18.3 ms of the preset's step on an H100
    against 1.97 ms compiled."""
    logits = _chunk_logits(z, scale, softcap)
    return logits.gather(1, labels[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


# Compiled once at module scope (STYLE); one graph per chunk shape (a run has two: the chunk
# and the last one).
_HARD_CHUNK = torch.compile(hard_label_chunk, dynamic=False)
_SOFT_CHUNK = torch.compile(soft_label_chunk, dynamic=False)
_LOG_Q = torch.compile(hard_label_log_q, dynamic=False)


class _ChunkedHeadCE(torch.autograd.Function):
    """sum_i coef_i W_i KL(p_i || softmax(head(h_i))) with dL/dh computed in forward, chunk by
    chunk; W_i = 1 unless `dpace`, p_i one-hot on labels_i unless soft ids / probs."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        coef: Tensor,
        head: TargetHead,
        chunk_rows: int,
        dpace: DPace | None,
        soft_ids: Tensor | None,
        soft_probs: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(n, dtype=torch.bool, device=hidden.device)
        row_w = torch.empty(n if dpace else 0, dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if hidden.requires_grad else None
        w = weight.to(hidden.dtype)
        if dpace is not None:  # whole blocks per chunk: W runs along the block
            chunk_rows = max(dpace.span, chunk_rows // dpace.span * dpace.span)
        soft = soft_ids is not None and soft_probs is not None
        chunk = _HARD_CHUNK if hidden.is_cuda else hard_label_chunk
        soft_chunk = _SOFT_CHUNK if hidden.is_cuda else soft_label_chunk
        log_q_of = _LOG_Q if hidden.is_cuda else hard_label_log_q
        scale, softcap = head.logit_scale, head.softcap
        for start in range(0, n, chunk_rows):
            rows = slice(start, start + chunk_rows)
            y, c = labels[rows], coef[rows]
            z = hidden[rows] @ w.T
            if dpace is not None:  # W from the drafter's log q of the hard label, a constant
                row_w[rows] = dpace_weights(log_q_of(z, y, scale, softcap), c > 0, dpace)
                c = c * row_w[rows]
            if soft:  # one fused pass per chunk (see `hard_label_chunk`)
                assert soft_ids is not None and soft_probs is not None
                part, correct[rows], g_z = soft_chunk(
                    z, y, c, soft_ids[rows], soft_probs[rows], scale, softcap, grad is not None
                )
            else:
                part, correct[rows], g_z = chunk(z, y, c, scale, softcap, grad is not None)
            total += part
            if grad is not None and g_z is not None:
                grad[rows] = g_z @ w
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0))
        ctx.mark_non_differentiable(correct, row_w)
        return total, correct, row_w

    @staticmethod
    def backward(
        ctx: Any, grad_total: Tensor, _grad_correct: Tensor, _grad_w: Tensor
    ) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), *(None,) * 8


def head_cross_entropy(
    hidden: Tensor,
    head: TargetHead,
    labels: Tensor,
    coef: Tensor,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    *,
    dpace: DPace | None = None,
    soft: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(sum_i coef_i W_i KL_i, argmax_i == label_i, W [N] or None) for hidden [N, H],
    labels [N], coef [N]; `soft` = (ids [N, k], probs [N, k]) replaces the one-hot labels
    in the KL (the labels still give `correct` and D-PACE's q); `dpace` weights rows by W
    (rows with coef 0 count as untrained), else W = 1 (None is returned)."""
    soft_ids, soft_probs = soft if soft is not None else (None, None)
    loss, correct, row_w = _ChunkedHeadCE.apply(
        hidden, head.weight, labels, coef, head, chunk_rows, dpace, soft_ids, soft_probs
    )
    return loss, correct, (row_w if dpace is not None else None)


@dataclass(slots=True)
class BlockStats:
    """Sums on the device (no host sync) that add across micro-batches and ranks.

    weighted_ce / weight: the loss, a weighted mean KL to the labels (the cross-entropy for
    hard labels): sum(w m KL) / sum(w m), with W for D-PACE; correct / trained per slot:
    acc_k against the hard labels; accepted / blocks: tau_hat - 1 (prefix-correct, per block).
    """

    weighted_ce: Tensor
    weight: Tensor
    correct: Tensor  # [B]
    trained: Tensor  # [B]
    accepted: Tensor
    blocks: Tensor

    def add(self, other: BlockStats) -> BlockStats:
        return BlockStats(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[Tensor, ...]:
        return (
            self.weighted_ce,
            self.weight,
            self.correct,
            self.trained,
            self.accepted,
            self.blocks,
        )

    def flat(self) -> Tensor:
        """One fp64 vector, for a single all-reduce."""
        return torch.cat([t.double().reshape(-1) for t in self.as_tuple()])

    @classmethod
    def from_flat(cls, flat: Tensor, block_size: int) -> BlockStats:
        b = block_size
        parts = torch.split(flat, [1, 1, b, b, 1, 1])
        return cls(parts[0][0], parts[1][0], parts[2], parts[3], parts[4][0], parts[5][0])

    def summary(self) -> dict[str, Any]:
        """Host-side metrics (one device->host sync)."""
        acc = (self.correct / self.trained.clamp(min=1)).tolist()
        blocks = float(self.blocks)
        return {
            "loss": float(self.weighted_ce / self.weight.clamp(min=1e-12)),
            "tau_hat": 1.0 + float(self.accepted) / blocks if blocks else 1.0,
            "acc": [round(a, 4) for a in acc[1:]],  # slots 1..B-1; slot 0 is never trained
            "blocks": int(blocks),
            "trained_tokens": int(self.trained.sum()),
        }


def decay_gamma(loss: LossSection, block_size: int) -> float:
    """The decay weighting's gamma: `loss.gamma`, or when unset 7 for B = 16 (DFlash paper),
    scaled by B / 16."""
    return loss.gamma if loss.gamma is not None else 7.0 * block_size / 16


def loss_slot_weights(loss: LossSection, block_size: int) -> Tensor:
    """[B] the run's slot weights w_k: the decay's exp(-(k-1)/gamma) (gamma None: 7 for
    B = 16, scaled by B / 16), or for D-PACE [0, 1, ..., 1], whose W comes per block from the
    drafter, so that the normaliser sum(w m) is the trained-slot count (module docstring)."""
    if loss.weighting == "dpace":
        weights = torch.ones(block_size)
        weights[0] = 0.0  # the anchor slot is never trained
        return weights
    return slot_weights(block_size, decay_gamma(loss, block_size))


def dpace_alpha_of(loss: LossSection) -> float | None:
    """D-PACE's smoothing when the run weights slots by D-PACE, else None (decay)."""
    return loss.dpace_alpha if loss.weighting == "dpace" else None


EMPTY_STEP_FLOOR = 1e-6  # see block_loss


def loss_normaliser(mask: Tensor, slot_w: Tensor) -> Tensor:
    """sum(w_k * m) of one micro-batch's trained-slot mask [R, A, B]; add over the global batch."""
    return (mask * slot_w.to(mask.device)).sum()


def block_loss(
    hidden: Tensor,
    labels: Tensor,
    mask: Tensor,
    head: TargetHead,
    slot_w: Tensor,
    normaliser: Tensor,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    *,
    dpace_alpha: float | None = None,
    soft: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, BlockStats]:
    """Loss share of one micro-batch and its metric sums.

    hidden [R, A*B, H] final-normed drafter states; labels / mask [R, A, B];
    normaliser: the global sum(w_k * m) (see module docstring). `dpace_alpha`: weight slots
    by D-PACE (then slot_w should be `loss_slot_weights`'s [0, 1, ..., 1]); `soft`: soft
    labels of slots 1..B-1, (ids [R, A, B-1, k], probs [R, A, B-1, k]). Returns the scalar
    to backpropagate (already divided by the normaliser) and the stats.
    """
    rows, num, block = labels.shape
    h = hidden.view(rows, num, block, -1)[:, :, 1:].reshape(-1, hidden.shape[-1])
    w = slot_w.to(mask.device)[1:] * mask[:, :, 1:]  # [R, A, B-1]
    # A step with nothing to train (e.g. 8,192-token rows cut from one long prompt, whose
    # answer is in a later row) has a global normaliser of 0: its loss and gradients are 0,
    # not 0 / 0 (a non-empty one is >= 1, slot 1 of a valid anchor, so the floor never bites),
    # and the trainer skips its optimizer step (`FiniteGuard`).
    coef = (w / normaliser.clamp_min(EMPTY_STEP_FLOOR)).reshape(-1)
    dpace = DPace(dpace_alpha, block - 1) if dpace_alpha is not None else None
    flat_soft = None
    if soft is not None:
        ids, probs = soft
        flat_soft = (ids.reshape(-1, ids.shape[-1]), probs.reshape(-1, probs.shape[-1]))
    loss, correct, row_w = head_cross_entropy(
        h, head, labels[:, :, 1:].reshape(-1), coef, chunk_rows, dpace=dpace, soft=flat_soft
    )
    weight = w.sum() if row_w is None else (w.reshape(-1) * row_w).sum()
    trained = mask[:, :, 1:] > 0
    hit = correct.view(rows, num, block - 1) & trained
    zero = torch.zeros(1, device=mask.device)
    per_slot_correct = torch.cat([zero, hit.float().sum(dim=(0, 1))])
    per_slot_trained = torch.cat([zero, trained.float().sum(dim=(0, 1))])
    valid_block = trained[:, :, 0]  # slot 1 is trained for every valid anchor
    accepted = torch.cumprod(hit.float(), dim=2).sum(dim=2)
    stats = BlockStats(
        weighted_ce=(loss * normaliser).detach(),
        weight=weight.detach(),
        correct=per_slot_correct,
        trained=per_slot_trained,
        accepted=(accepted * valid_block).sum(),
        blocks=valid_block.float().sum(),
    )
    return loss, stats
