"""One drafter pass over a micro-batch of packed rows: blocks -> drafter -> loss.

Shape legend: R rows, T tokens per row, A anchors per row, B block size, H hidden,
K tapped layers, k soft labels per slot. Everything in a `DraftBatch` already lives on the
compute device; the target side (`flashdraft.model.target`) fills `target_hidden`,
`next_tokens` and, for soft labels, `soft_ids` / `soft_probs`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from flashdraft.model.attention import Backend, BlockLayout
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.head import TargetHead
from flashdraft.train.blocks import block_inputs, block_labels
from flashdraft.train.loss import BlockStats, block_loss, loss_normaliser


@dataclass(slots=True)
class DraftBatch:
    input_ids: Tensor  # [R, T] long
    position_ids: Tensor  # [R, T] long, restarting at 0 per document
    doc_ids: Tensor  # [R, T] long, -1 on padding
    loss_mask: Tensor  # [R, T] int8 / bool
    anchors: Tensor  # [R, A] long
    anchor_valid: Tensor  # [R, A] bool
    target_hidden: Tensor  # [R, T, K*H] concatenated taps
    next_tokens: Tensor  # [R, A, B-1] label token of each trained slot
    soft_ids: Tensor | None = None  # [R, A, B-1, k] soft labels (`loss.labels = "soft"`):
    soft_probs: Tensor | None = None  # [R, A, B-1, k] the target's top k, renormalised
    # (with `loss.argmax_mix` = m: (1 - m) of that + m on the argmax)

    def to(self, device: torch.device, non_blocking: bool = False) -> DraftBatch:
        moved: dict[str, Any] = {}
        for f in fields(self):
            t = getattr(self, f.name)
            moved[f.name] = None if t is None else t.to(device, non_blocking=non_blocking)
        return DraftBatch(**moved)

    @property
    def soft(self) -> tuple[Tensor, Tensor] | None:
        """(soft_ids, soft_probs) when the batch carries soft labels, else None."""
        if self.soft_ids is None or self.soft_probs is None:
            return None
        return self.soft_ids, self.soft_probs


def labels_and_mask(batch: DraftBatch, block_size: int) -> tuple[Tensor, Tensor]:
    return block_labels(
        batch.next_tokens,
        batch.loss_mask,
        batch.doc_ids,
        batch.anchors,
        batch.anchor_valid,
        block_size,
    )


def draft_hidden(
    drafter: DFlashDrafter,
    head: TargetHead,
    batch: DraftBatch,
    backend: Backend,
    forward: nn.Module | None = None,
    residual_dtype: torch.dtype | None = None,
) -> Tensor:
    """Final-normed drafter states of every block slot, [R, A*B, H].

    `forward` is what to call (a DDP wrapper, say); `drafter` is the plain module its
    config and masks come from. They are the same object on one device. `residual_dtype`:
    `DFlashDrafter.forward`'s (`drafter.residual_dtype`).
    """
    config = drafter.config
    ids, positions = block_inputs(
        batch.input_ids, batch.position_ids, batch.anchors, config.block_size, config.mask_token_id
    )
    layout = BlockLayout(batch.anchors, batch.anchor_valid, batch.doc_ids, config.block_size)
    masks = drafter.build_masks(layout, backend)
    embeds = head.embed(ids).to(batch.target_hidden.dtype)
    model = drafter if forward is None else forward
    out = model(batch.target_hidden, embeds, batch.position_ids, positions, masks, residual_dtype)
    assert isinstance(out, Tensor)
    return out


def batch_normaliser(batch: DraftBatch, block_size: int, slot_w: Tensor) -> Tensor:
    """sum(w_k * m) of this micro-batch: add over all micro-batches and ranks before use."""
    _, mask = labels_and_mask(batch, block_size)
    return loss_normaliser(mask, slot_w)


def draft_loss(
    drafter: DFlashDrafter,
    head: TargetHead,
    batch: DraftBatch,
    slot_w: Tensor,
    normaliser: Tensor,
    backend: Backend,
    chunk_rows: int,
    forward: nn.Module | None = None,
    *,
    dpace_alpha: float | None = None,
    residual_dtype: torch.dtype | None = None,
) -> tuple[Tensor, BlockStats]:
    """This micro-batch's share of the global loss (see `flashdraft.train.loss`) and its stats:
    weighted by D-PACE when `dpace_alpha` is given (slot_w: `loss.loss_slot_weights`), else by
    slot_w; against the batch's soft labels when it carries them. `residual_dtype`: see
    `draft_hidden`."""
    labels, mask = labels_and_mask(batch, drafter.config.block_size)
    hidden = draft_hidden(drafter, head, batch, backend, forward, residual_dtype)
    return block_loss(
        hidden,
        labels,
        mask,
        head,
        slot_w,
        normaliser,
        chunk_rows,
        dpace_alpha=dpace_alpha,
        soft=batch.soft,
    )
