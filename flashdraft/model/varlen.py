"""The target's packed forward through variable-length flash attention (`target.
attn_implementation = "varlen"`).

A packed row holds whole documents, each attending causally to itself only. flex_attention
does that with a document BlockMask; on a small target its forward ran at ~50 TFLOP/s on an
H200 (300-3,000-token documents: 38% of the step). The varlen flash kernel (`torch.nn.attention.varlen.varlen_attn`) takes the documents
as one flat sequence of tokens with their boundaries (`cu_seqlens`) and needs no mask at all.

It runs as a transformers attention implementation registered under `NAME`: the attention
layers call `varlen_attention` with their projected queries, keys and values. While a packed
forward runs (`packed(segments)`), it attends within the segments; at any other call (the
start-up tap check's single document, an HF decode loop) it is transformers' own sdpa
attention, with the mask transformers builds for sdpa. On the CPU, or in fp32, there is no
flash kernel: each segment then goes through SDPA on its own (the same result, slowly), so
the tests check the packing arithmetic on any machine and the kernel on a GPU.

Targets with sliding-window layers, logit soft-capping or attention sinks keep flex
(`refusal` says why). Hybrid targets take it in their full-attention layers (gated, but the
attention call inside is plain causal attention); their linear layers are packed by
`flashdraft.model.hybrid`. With sdpa and a dense [R, 1, T, T] mask instead, a 32K-token row
would compute every cross-document score of all 16 attention layers of a 27B-shaped hybrid.

Also here, the same kernel for the decode steps of a static KV cache
(`flashdraft.model.static`, attention="varlen"): each row attends over its own used slots
only (`own_slots_attention`).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

NAME = "varlen_documents"  # transformers dispatches on it (a name with "flash" in it would
# be taken for a flash-attn kernel request)

# A 4-D stand-in for the attention mask of a packed forward: transformers takes a 4-D mask as
# already built and passes it through, so it builds none (a dense [R, 1, T, T] mask from the
# packed position ids otherwise); `varlen_attention` ignores it while segments are active.
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


@dataclass(frozen=True, slots=True)
class Segments:
    """The documents of R packed rows as runs of the R*T flattened tokens."""

    cu_seqlens: Tensor  # [N+1] int32: each document's first flat index, then R*T
    max_len: int  # the longest document (the kernel sizes its grid with it)

    def to(self, device: torch.device) -> Segments:
        """On `device`; from the CPU to CUDA through pinned memory, asynchronously."""
        cu = self.cu_seqlens
        if cu.device != device and device.type == "cuda" and cu.device.type == "cpu":
            cu = cu.pin_memory()
        return Segments(cu.to(device, non_blocking=True), self.max_len)


def document_segments(doc_ids: Tensor) -> Segments:
    """[R, T] document ids -> their Segments: a new segment wherever the id changes along a
    row and at every row start (padding runs are segments of their own, as in the mask).
    Computed where `doc_ids` lives: give it the rows' CPU tensors to keep the host sync off the
    device (`Segments.to` then moves the boundaries asynchronously)."""
    rows, length = doc_ids.shape
    start = torch.ones(rows, length, dtype=torch.bool, device=doc_ids.device)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    firsts = start.flatten().nonzero().flatten()
    end = torch.tensor([rows * length], device=doc_ids.device)
    cu = torch.cat([firsts, end]).to(torch.int32)
    return Segments(cu, int((cu[1:] - cu[:-1]).max()))


_active: Segments | None = None


@contextmanager
def packed(segments: Segments) -> Iterator[None]:
    """While the block runs, `varlen_attention` attends within `segments`."""
    global _active
    before, _active = _active, segments
    try:
        yield
    finally:
        _active = before


@dataclass(frozen=True, slots=True)
class _Kernel:
    """torch's varlen_attn and what its release takes: torch 2.10 spells causality
    `is_causal=True` and has no `scale`; 2.11 takes `window_size=(-1, 0)` and `scale`; 2.13
    also `enable_gqa`. Every release runs the same flash kernel (`aten._flash_attention_forward`),
    which serves G query heads per K/V head natively; 2.13's wrapper only refuses unequal head
    counts unless `enable_gqa` says they are meant, and the releases before it check nothing,
    so K/V go in with their own heads everywhere (repeating them for the kernel cost two copies
    of the K/V per layer: ~5 ms of a 138 ms 8-row SmolLM2 step on an H200, profiled)."""

    fn: Any
    causal: dict[str, Any]
    takes_scale: bool
    takes_gqa: bool


def _kernel() -> _Kernel | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return _Kernel(varlen_attn, causal, "scale" in params, "enable_gqa" in params)


_KERNEL = _kernel()


def available() -> bool:
    """Whether this torch has the varlen flash kernel (torch.nn.attention.varlen)."""
    return _KERNEL is not None


def uses_kernel(query: Tensor) -> bool:
    """Whether a packed call on `query` runs the flash kernel (CUDA, half precision)."""
    return _KERNEL is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


@torch.compiler.disable  # the longest document changes every row: no graph specialises on it
def varlen_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query [R, Hq, T, D], key / value
    [R, Hkv, T, D] -> ([R, T, Hq, D], None)."""
    segments = _active
    if segments is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out: tuple[Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out
    rows, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    q, k, v = (
        t.transpose(1, 2).reshape(rows * length, t.shape[1], dim) for t in (query, key, value)
    )
    if uses_kernel(query):
        kernel = _KERNEL
        assert kernel is not None
        extra: dict[str, Any] = dict(kernel.causal)
        if groups > 1 and kernel.takes_gqa:
            extra["enable_gqa"] = True
        if scaling is not None and kernel.takes_scale:
            extra["scale"] = scaling
        elif scaling is not None:  # the kernel's own scale is 1/sqrt(D)
            q = q * (scaling * dim**0.5)
        cu = segments.cu_seqlens
        flat = kernel.fn(q, k, v, cu, cu, segments.max_len, segments.max_len, **extra)
    else:
        flat = _each_segment(q, k, v, segments, scaling, groups)
    return flat.view(rows, length, heads, dim), None


def _each_segment(
    q: Tensor, k: Tensor, v: Tensor, segments: Segments, scale: float | None, groups: int
) -> Tensor:
    """The kernel's result without it: each segment through causal SDPA on its own."""
    out = torch.empty_like(q)
    bounds = segments.cu_seqlens.tolist()
    for a, b in itertools.pairwise(bounds):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, n, D]
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[
            0
        ].transpose(0, 1)
    return out


def register() -> None:
    """Make `NAME` an attention implementation transformers can load a model with (its mask:
    sdpa's, for the calls outside a packed forward). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def implementation(name: str) -> str:
    """The transformers attention implementation for `target.attn_implementation` = `name`:
    "varlen" is flashdraft's own, registered first (`register`) and loaded as `NAME`; any
    other name is transformers' and passes through."""
    if name != "varlen":
        return name
    register()
    return NAME


def refusal(config: Any) -> str | None:
    """Why a target (its text config) cannot take the varlen path, or None."""
    # a hybrid's linear-attention layers never call the attention interface (their packing
    # is `flashdraft.model.hybrid`'s): only its full-attention layers take this path
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"]) - {"linear_attention"}
    if kinds != {"full_attention"}:
        return (
            f"its layer types are {sorted(kinds)}; the varlen path runs full causal attention only"
        )
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return f"it uses a sliding window ({config.sliding_window} tokens)"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim > 256:
        return f"its heads are {head_dim} wide (the flash kernel takes at most 256)"
    for key in ("attn_logit_softcapping", "attention_sink", "sinks"):
        if getattr(config, key, None):
            return f"it sets {key} (not in the flash kernel)"
    return None


# ---- decode steps on a static KV cache: each row over its own slots ----
#
# A decode step of R rows at their own positions, on a cache [R, Hkv, L, D] per layer: with a
# dense mask, attention reads every row up to the longest one's length (cuDNN's kernel: ~50 us
# per SmolLM2-135M layer at 256 rows, ~60 MB of K/V that memory speed reads in ~15 us;
# measured on an H200). As flash sequences with a used length each,
# a row reads only its own slots, and one shape serves every length.


# The decode steps need the flash op to take per-sequence used lengths (seqused_k); with a
# torch without it, `StaticLM` runs those steps on sdpa instead.
FLASH_USED_K = "seqused_k" in str(torch.ops.aten._flash_attention_forward.default._schema)


def _flash_varlen(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    used_k: Tensor,
    scale: float,
) -> Tensor:
    """Flash attention over packed sequences [T, H, D]: sequence s is queries cu_q[s] ..
    cu_q[s+1] and keys cu_k[s] .. cu_k[s] + used_k[s] (the rest of its span is not read),
    no mask within it. torch's FA2 varlen forward (its `seqused_k`); CUDA, half precision.
    A module-level name, so CPU tests can stand in an emulation of these semantics
    (`tests/helpers.py`)."""
    out = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_q, cu_k, max_q, max_k, 0.0, False, False,
        scale=scale, seqused_k=used_k,
    )[0]  # fmt: skip
    return out


def sequence_starts(
    rows: int, num_kv_heads: int, group: int, max_len: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """(cu_q, cu_k) int32 of the flash sequences of a static cache's decode steps: each (row,
    K/V head) one sequence of its `group` query heads over the row's `max_len` slots. Fixed
    for a cache: computed once, not in every step."""
    seqs = torch.arange(rows * num_kv_heads + 1, dtype=torch.int32, device=device)
    return seqs * group, seqs * max_len


class OwnSlots:
    """A one-token decode step's attention plan over a static cache (`flashdraft.model.
    static`, attention="varlen"), for its full-attention layers: each (row, K/V head) is one
    flash sequence (`sequence_starts`) of its G query heads over the row's own slots
    0..position."""

    def __init__(self, starts: tuple[Tensor, Tensor], positions: Tensor, num_kv_heads: int) -> None:
        self.cu_q, self.cu_k = starts
        # slots 0..position of each row, for each of its K/V heads
        self.used = (positions[:, 0] + 1).to(torch.int32).repeat_interleave(num_kv_heads)


def own_slots_attention(
    q: Tensor, keys: Tensor, values: Tensor, plan: OwnSlots, scale: float
) -> Tensor:
    """q [R, Hq, 1, D]; keys / values: a layer's whole cache [R, Hkv, L, D] -> [R, 1, Hq*D].
    Query head h = kv * G + g (as HF's repeat_kv), so the G heads of K/V head kv are the G
    query rows of sequence (r, kv), and the cache's [R, Hkv, L, D] layout is already the
    packed one ([R*Hkv*L, 1, D]): nothing is copied but q."""
    r, hq, _, d = q.shape
    _, hkv, length, _ = keys.shape
    group = hq // hkv
    out = _flash_varlen(
        q.reshape(r * hq, 1, d),
        keys.view(r * hkv * length, 1, d),
        values.view(r * hkv * length, 1, d),
        plan.cu_q,
        plan.cu_k,
        group,
        length,
        plan.used,
        scale,
    )
    return out.view(r, 1, hq * d)
