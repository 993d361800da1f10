"""Building a training example from one packed row (docs/design.md §4), as pure functions.

Shape legend: R rows, T tokens per packed row, A anchors per row, B block size.

For anchor a (a packed index), the block is `[x_a, MASK x (B-1)]` at positions
`pos_a + 0..B-1`; slot k >= 1 predicts token x_{a+k}, whose label is the target's argmax
at position a + k - 1. Slot 0 is the anchor itself and is never trained. A slot is trained
iff the anchor is valid, a + k lies in the anchor's document and loss_mask[a + k] == 1.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def anchor_candidates(loss_mask: Tensor, doc_ids: Tensor) -> Tensor:
    """[..., T] bool: a is a candidate iff loss_mask[a+1] == 1 within a's document.

    The first predicted token must be a trained token; later slots that run past the
    document's end just get weight 0, so anchors near the end stay usable.
    """
    cand = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    same_doc = (doc_ids[..., 1:] == doc_ids[..., :-1]) & (doc_ids[..., :-1] >= 0)
    cand[..., :-1] = (loss_mask[..., 1:] != 0) & same_doc
    return cand


def allocate_anchors(counts: list[int], budget: int) -> list[int]:
    """Anchors per document: every candidate if they fit, else a fair floor plus a share.

    Half the budget is offered equally to all documents (so a short answer packed next to a
    long one is not starved); the rest goes proportionally to the candidates each document
    still has (largest-remainder rounding, so the total is exactly `budget`).
    """
    if sum(counts) <= budget:
        return list(counts)
    docs = sum(1 for c in counts if c > 0)
    floor = budget // (2 * docs)
    take = [min(c, floor) for c in counts]
    left = budget - sum(take)
    rest = [c - t for c, t in zip(counts, take, strict=True)]
    total_rest = sum(rest)
    quotas = [left * r / total_rest for r in rest]
    extra = [math.floor(q) for q in quotas]
    shortfall = left - sum(extra)
    by_fraction = sorted(range(len(counts)), key=lambda i: (-(quotas[i] - extra[i]), i))
    for i in by_fraction[:shortfall]:
        extra[i] += 1
    return [t + e for t, e in zip(take, extra, strict=True)]


def sample_anchors(
    loss_mask: Tensor,
    doc_ids: Tensor,
    num_anchors: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Up to A distinct, sorted anchors of one row [T], spread over its documents.

    Returns (anchors [A] long, valid [A] bool); padding anchors point at index 0 with
    valid False so that every row has the same static shape.
    """
    cand = anchor_candidates(loss_mask, doc_ids).nonzero().flatten()
    cand_docs = doc_ids[cand]
    docs = torch.unique(cand_docs).tolist()
    per_doc = [cand[cand_docs == d] for d in docs]
    quota = allocate_anchors([len(p) for p in per_doc], num_anchors)
    chosen = [
        p[torch.randperm(len(p), generator=generator)[:n]]
        for p, n in zip(per_doc, quota, strict=True)
        if n > 0
    ]
    picked = torch.sort(torch.cat(chosen)).values if chosen else cand[:0]
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    valid = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[: len(picked)] = picked
    valid[: len(picked)] = True
    return anchors, valid


def block_inputs(
    input_ids: Tensor,
    position_ids: Tensor,
    anchors: Tensor,
    block_size: int,
    mask_token_id: int,
) -> tuple[Tensor, Tensor]:
    """Block tokens and positions, [R, A*B] each: `[x_a, MASK...]` at `pos_a + 0..B-1`."""
    rows, num = anchors.shape
    ids = torch.full(
        (rows, num, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    ids[:, :, 0] = input_ids.gather(1, anchors)
    offsets = torch.arange(block_size, device=anchors.device)
    positions = position_ids.gather(1, anchors)[:, :, None] + offsets
    return ids.view(rows, -1), positions.view(rows, -1)


def label_positions(anchors: Tensor, block_size: int, context_len: int) -> Tensor:
    """[R, A, B-1] packed indices a + k - 1 (k = 1..B-1) whose next-token prediction labels slot k.

    Clamped into the row; clamped slots get weight 0 in `block_labels`.
    """
    offsets = torch.arange(block_size - 1, device=anchors.device)
    return torch.clamp(anchors[:, :, None] + offsets, max=context_len - 1)


def block_labels(
    next_tokens: Tensor,
    loss_mask: Tensor,
    doc_ids: Tensor,
    anchors: Tensor,
    anchor_valid: Tensor,
    block_size: int,
) -> tuple[Tensor, Tensor]:
    """Labels [R, A, B] long and trained-slot mask [R, A, B] float.

    next_tokens [R, A, B-1]: the target's argmax at `label_positions` (hard-label
    distillation), or the data tokens x_{a+k} for the data-label option.
    """
    rows, num = anchors.shape
    context_len = loss_mask.shape[1]
    offsets = torch.arange(block_size, device=anchors.device)
    idx = anchors[:, :, None] + offsets  # a + k
    inside = idx < context_len
    idx = torch.clamp(idx, max=context_len - 1).view(rows, -1)
    anchor_doc = doc_ids.gather(1, anchors)[:, :, None]
    same_doc = doc_ids.gather(1, idx).view(rows, num, block_size) == anchor_doc
    trained = loss_mask.gather(1, idx).view(rows, num, block_size) != 0
    mask = inside & same_doc & trained & anchor_valid[:, :, None]
    mask[:, :, 0] = False  # the anchor slot is never trained
    labels = torch.zeros(rows, num, block_size, dtype=torch.long, device=anchors.device)
    labels[:, :, 1:] = next_tokens
    return labels, mask.float()


def mix_argmax(ids: Tensor, probs: Tensor, argmax: Tensor, share: float) -> Tensor:
    """Soft labels with the target's argmax mixed in: (1 - share) probs + share one-hot(argmax),
    over the top-k ids [..., k] (probs [..., k]; argmax [...]). The argmax is among the top k
    (its largest logit); at a tie of more than k logits it may not be, and that row keeps
    mass 1 - share (the soft loss takes any mass)."""
    if not share:
        return probs
    hit = (ids == argmax[..., None]).to(probs.dtype)  # one id at most: topk ids are distinct
    return (1.0 - share) * probs + share * hit


def data_next_tokens(input_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """[R, A, B-1] the data tokens x_{a+k} (k = 1..B-1): labels for the data-label option."""
    context_len = input_ids.shape[1]
    idx = torch.clamp(label_positions(anchors, block_size, context_len) + 1, max=context_len - 1)
    return input_ids.gather(1, idx.flatten(1)).view(idx.shape)


def slot_weights(block_size: int, gamma: float) -> Tensor:
    """[B]: w_0 = 0 (anchor), w_k = exp(-(k-1)/gamma) (DFlash paper; gamma 7 for B = 16)."""
    if gamma <= 0:
        raise ValueError(f"loss decay gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights
