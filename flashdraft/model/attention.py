"""DFlash block attention (docs/design.md §4): one `mask_mod`, two backends, and a decode path.

Shape legend:
  R  rows in a batch (packed sequences)      T  context tokens per row (the packed row)
  A  anchors per row                        B  block size
  Q  query tokens per row = A * B            S  keys per row = T + Q  (context first, then blocks)
  Hq query heads   Hkv key/value heads   D head dim

A query in slot s of block j (anchor a_j, so at position p = a_j + s) may see
  * context key c  iff  c < a_j, doc[c] == doc[a_j] and anchor j is valid;
  * block key k    iff  k lies in block j;
  * and, in sliding layers, only keys in its window: k <= p and p - k < W (`in_window`).
The window is per query, W keys including the query itself, and moves with the slot, as
z-lab's `dflash` (`q - k < W`), vLLM (window (W - 1, 0)) and SGLang (`window_left = W - 1`)
compute it: slot s sees context a_j + s - W + 1 .. a_j - 1 and block slots s - W + 1 .. s.
(The same document is required, so packed-index differences equal position differences.)
Every query sees at least itself, so no row of the mask is empty.

CUDA uses compiled flex_attention with a sparse BlockMask built from the `mask_mod`; the CPU
has no flex backward, so it materialises the very same `mask_mod` with `create_mask` and runs
SDPA. `tests/test_attention.py` checks the two agree.

The BlockMask is built in two parts (`block_mask`): a compiled reduction of the `mask_mod` to
per-tile counts, then the ordering of the tiles eagerly. torch 2.11 compiles
`create_block_mask`'s own ordering (an argsort) into one Triton kernel that took 141 s of a
170 s cold first step on an H200 (2026-12-03); eager, it is a few small sorts per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

Backend = Literal["flex", "sdpa"]
# (batch, head, query index, key index) -> visible; all 0-d tensors under flex's vmap.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

FLEX_TILE = 128  # query and key rows per BlockMask tile (flex's default)


def tile_maps(
    mask_mod: MaskMod, rows: int, q_len: int, kv_len: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """[R, 1, ceil(Q/128), ceil(S/128)] bool maps of the tiles the mask_mod partly and fully
    opens. Compiled, the [R, 1, Q, S] mask is never materialised (one fused reduction)."""
    mask = create_mask(mask_mod, rows, None, q_len, kv_len, device=device)
    pad_q, pad_kv = -q_len % FLEX_TILE, -kv_len % FLEX_TILE
    mask = F.pad(mask, (0, pad_kv, 0, pad_q))  # padding is masked: no tile there is full
    q_tiles, kv_tiles = (q_len + pad_q) // FLEX_TILE, (kv_len + pad_kv) // FLEX_TILE
    tiles = mask.view(rows, 1, q_tiles, FLEX_TILE, kv_tiles, FLEX_TILE)
    opened = tiles.sum(dim=(3, 5), dtype=torch.int32)
    full = opened == FLEX_TILE * FLEX_TILE
    return (opened > 0) & ~full, full


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """A [..., rows, cols] tile map -> (open tiles per row, their column indices first), the
    BlockMask layout; argsort on the map (stable, so open columns keep ascending order)."""
    flags = tiles.to(torch.int32)
    counts = flags.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(flags, dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, indices


# Compiled once at module scope (STYLE): compiling per call would recompile every step.
_flex_attention = torch.compile(flex_attention, dynamic=False)
_tile_maps = torch.compile(tile_maps, dynamic=False)


def block_mask(
    mask_mod: MaskMod, rows: int, q_len: int, kv_len: int, device: torch.device
) -> BlockMask:
    """What `create_block_mask(mask_mod, rows, None, q_len, kv_len)` builds (its default
    separate full tiles included), with only the tile counting compiled (module docstring).
    The CPU counts eagerly (it has no flex backward to train with anyway)."""
    count = _tile_maps if device.type == "cuda" else tile_maps
    partial, full = count(mask_mod, rows, q_len, kv_len, device)
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=FLEX_TILE,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


def default_backend(device: torch.device) -> Backend:
    return "flex" if device.type == "cuda" else "sdpa"


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Where the blocks of each row sit in its packed context.

    anchors:      [R, A] long  packed index of each block's anchor (any index when invalid)
    anchor_valid: [R, A] bool  False for padding anchors (fixed A keeps shapes static)
    doc_ids:      [R, T] long  document of each context token, -1 for padding; a document
                               is one run of equal ids (packing lays documents out so)
    """

    anchors: Tensor
    anchor_valid: Tensor
    doc_ids: Tensor
    block_size: int

    @property
    def num_rows(self) -> int:
        return int(self.anchors.shape[0])

    @property
    def context_len(self) -> int:
        return int(self.doc_ids.shape[1])

    @property
    def num_queries(self) -> int:
        return int(self.anchors.shape[1]) * self.block_size


def in_window(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """The sliding-window rule of every engine: position p sees k iff k <= p and p - k < W."""
    return (k_pos <= q_pos) & (q_pos - k_pos < window)


def document_starts(doc_ids: Tensor) -> Tensor:
    """[R, T] -> [R, T]: where the document of each token starts (a document is a run of
    equal ids, as packing lays them out)."""
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(first, index, 0).cummax(dim=1).values


def dflash_mask_mod(layout: BlockLayout, sliding_window: int | None = None) -> MaskMod:
    """The docs/design.md §4 visibility rule as a flex_attention `mask_mod`.

    Block j's context is the range [start of its anchor's document, anchor): the rule reads
    per-query values only (anchor, validity, the document start at the anchor) and no key's
    document, which the flex kernels would load for every partly open tile. The anchors are
    read when the mask is evaluated (the eval loop moves its anchor in place between
    replays of a CUDA graph); the document starts are computed here, once.
    """
    anchors, valid, block = layout.anchors, layout.anchor_valid, layout.block_size
    ctx_len = layout.context_len
    starts = document_starts(layout.doc_ids)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        j, slot = q_idx // block, q_idx % block
        anchor = anchors[b, j]
        # kv_idx < anchor < T: a context key
        sees_ctx = valid[b, j] & (kv_idx < anchor) & (kv_idx >= starts[b, anchor])
        k = kv_idx - ctx_len
        sees_block = (kv_idx >= ctx_len) & (k // block == j)
        if sliding_window is not None:
            # Packed indices: the query sits at anchor + slot, block key k at anchor + k % B.
            sees_ctx = sees_ctx & in_window(anchor + slot, kv_idx, sliding_window)
            sees_block = sees_block & in_window(slot, k % block, sliding_window)
        return sees_ctx | sees_block

    return mask_mod


# A mask for one attention call: a sparse BlockMask (flex) or a dense [R, 1, Q, S] bool (sdpa).
Mask = BlockMask | Tensor


def build_mask(layout: BlockLayout, backend: Backend, sliding_window: int | None = None) -> Mask:
    mask_mod = dflash_mask_mod(layout, sliding_window)
    rows, q_len = layout.num_rows, layout.num_queries
    kv_len = layout.context_len + q_len
    device = layout.anchors.device
    if backend == "flex":
        return block_mask(mask_mod, rows, q_len, kv_len, device)
    return create_mask(mask_mod, rows, None, q_len, kv_len, device=device)


# flex_attention's `kernel_options` for the drafter's attention (tile sizes, warps, stages);
# empty: torch's defaults. Benchmarks set it (`bench/trainer.py --flex-options`) to tune.
FLEX_OPTIONS: dict[str, int | bool] = {}


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, scale: float) -> Tensor:
    """q [R, Hq, Q, D], k/v [R, Hkv, S, D] -> [R, Hq, Q, D] under `mask` (None: all visible)."""
    if isinstance(mask, BlockMask):
        options: Any = dict(FLEX_OPTIONS) or None  # torch's TypedDict of the same keys
        out = _flex_attention(
            q, k, v, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=options
        )
        assert isinstance(out, Tensor)
        return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def decode_mask(
    context_len: int,
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
    context_start: int = 0,
) -> Tensor | None:
    """[1, 1, B, C + B] mask of one block (anchor at position `context_len`) over its keys:
    the context positions `context_start .. context_len - 1` (a decode cache may hold only
    the last ones), then the block's B positions.

    The same rule as `dflash_mask_mod` for a single anchor whose context is everything
    before it: None (all visible) for full layers.
    """
    if sliding_window is None:
        return None
    q_pos = torch.arange(context_len, context_len + block_size, device=device)[:, None]
    k_pos = torch.arange(context_start, context_len + block_size, device=device)[None, :]
    return in_window(q_pos, k_pos, sliding_window)[None, None]


def document_causal_mask_mod(doc_ids: Tensor) -> MaskMod:
    """Causal attention within each packed document (the target's mask for a packed row).

    Padding (doc -1) attends only to itself, so no row is empty and no real token sees it.
    """

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same_doc = (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (doc_ids[b, q_idx] >= 0)
        return (same_doc & (kv_idx <= q_idx)) | (q_idx == kv_idx)

    return mask_mod


def build_document_mask(doc_ids: Tensor, backend: Backend) -> Mask:
    """[R, T] document ids -> the target's packed-row mask (BlockMask or dense [R, 1, T, T])."""
    rows, length = doc_ids.shape
    mask_mod = document_causal_mask_mod(doc_ids)
    if backend == "flex":
        return block_mask(mask_mod, rows, length, length, doc_ids.device)
    return create_mask(mask_mod, rows, None, length, length, device=doc_ids.device)
