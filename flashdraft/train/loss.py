"""Decayed cross-entropy through the target's LM head, in chunks, and the training metrics.

Shape legend: R rows, A anchors, B block size, H hidden, V vocabulary, N = R*A*(B-1) trained
rows (slot 0 is never trained, so it never reaches the head).

loss = sum(w_k * m * CE) / sum(w_k * m) over the *global* batch (all micro-batches of all
ranks, SPEC trap 10): the caller passes that normaliser in, so the gradient of each
micro-batch is already its exact share and results do not depend on how the batch is split.

The LM head + CE run in chunks of rows: the gradient w.r.t. the hidden states is computed in
the forward pass, chunk by chunk, so neither the [N, V] logits nor their gradient ever exist
in full (a Qwen3 head at N = 7680 would be 4.7 GB of fp32 logits, twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flashdraft.model.head import TargetHead

DEFAULT_CHUNK_ROWS = 1024


class _ChunkedHeadCE(torch.autograd.Function):
    """sum_i coef_i * CE(head(h_i), y_i) with dL/dh computed in forward, chunk by chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        coef: Tensor,
        head: TargetHead,
        chunk_rows: int,
    ) -> tuple[Tensor, Tensor]:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if hidden.requires_grad else None
        w = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start : start + chunk_rows]
            y = labels[start : start + chunk_rows]
            c = coef[start : start + chunk_rows]
            raw = (h @ w.T).float()
            logits = head.transform(raw)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, y[:, None]).squeeze(1)
            total += (c * (lse - picked)).sum()
            correct[start : start + chunk_rows] = logits.argmax(dim=-1) == y
            if grad is None:
                continue
            # dCE/dlogits = softmax - onehot, scaled by this row's coefficient ...
            g = torch.exp(logits - lse[:, None])
            g[torch.arange(len(y), device=y.device), y] -= 1.0
            g *= c[:, None]
            # ... then back through softcap (d/ds c*tanh(s/c) = 1 - tanh^2) and the scale.
            if head.softcap is not None:
                g *= 1.0 - (logits / head.softcap) ** 2
            if head.logit_scale != 1.0:
                g *= head.logit_scale
            grad[start : start + chunk_rows] = g.to(w.dtype) @ w
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0))
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, _grad_correct: Tensor) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None


def head_cross_entropy(
    hidden: Tensor,
    head: TargetHead,
    labels: Tensor,
    coef: Tensor,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[Tensor, Tensor]:
    """(sum_i coef_i * CE_i, argmax_i == label_i) for hidden [N, H], labels [N], coef [N]."""
    loss, correct = _ChunkedHeadCE.apply(hidden, head.weight, labels, coef, head, chunk_rows)
    return loss, correct


@dataclass(slots=True)
class BlockStats:
    """Sums on the device (no host sync) that add across micro-batches and ranks.

    weighted_ce / weight: the loss; correct / trained per slot: acc_k;
    accepted / blocks: tau_hat - 1 (prefix-correct, per block).
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
) -> tuple[Tensor, BlockStats]:
    """Loss share of one micro-batch and its metric sums.

    hidden [R, A*B, H] final-normed drafter states; labels / mask [R, A, B];
    normaliser: the global sum(w_k * m) (see module docstring). Returns the scalar to
    backpropagate (already divided by the normaliser) and the stats.
    """
    rows, num, block = labels.shape
    h = hidden.view(rows, num, block, -1)[:, :, 1:].reshape(-1, hidden.shape[-1])
    w = slot_w.to(mask.device)[1:] * mask[:, :, 1:]  # [R, A, B-1]
    coef = (w / normaliser).reshape(-1)
    loss, correct = head_cross_entropy(h, head, labels[:, :, 1:].reshape(-1), coef, chunk_rows)
    trained = mask[:, :, 1:] > 0
    hit = correct.view(rows, num, block - 1) & trained
    zero = torch.zeros(1, device=mask.device)
    per_slot_correct = torch.cat([zero, hit.float().sum(dim=(0, 1))])
    per_slot_trained = torch.cat([zero, trained.float().sum(dim=(0, 1))])
    valid_block = trained[:, :, 0]  # slot 1 is trained for every valid anchor
    accepted = torch.cumprod(hit.float(), dim=2).sum(dim=2)
    stats = BlockStats(
        weighted_ce=(loss * normaliser).detach(),
        weight=w.sum().detach(),
        correct=per_slot_correct,
        trained=per_slot_trained,
        accepted=(accepted * valid_block).sum(),
        blocks=valid_block.float().sum(),
    )
    return loss, stats
