"""The target's forward on a static KV cache, over its own HF submodules: no hooks, no HF
`Cache`, no mask builders, so that a decode step has fixed shapes and fixed addresses and can
be compiled and captured as a CUDA graph (a small target decoding eagerly is bound by kernel
launches: SmolLM2-135M spends ~30 ms per token in HF eager, ~2.4 ms captured and compiled).

Shape legend: R rows, n tokens per call, L cache slots (`max_len`), Hq / Hkv query / key-value
heads, G = Hq / Hkv, D head dim, H hidden size, V vocabulary, K tapped layers.

The cache invariant: slot j of row r holds the K/V of position j of that row. A call writes
its tokens' K/V at their positions first, then a query at position p attends to slots
0..p (and, on a sliding layer of window W, only to p - j < W). Whatever sits above p (rejected
drafts, the previous prompt of that row, warm-up garbage) is invisible and is overwritten
before any query can see it, because positions are always written in order without gaps.
So a rewind is simply the next call at a smaller position: nothing is cropped or copied.

Only the layouts whose arithmetic is reproduced here are accepted (`unsupported_reason`):
Llama, Mistral, Qwen2 and Qwen3 style decoder layers; anything else (hybrids, Gemma-style
extra norms, logit softcaps, FSDP-sharded layers) is refused so callers keep the HF path.
`StaticLM.verify` checks the logits and taps against an HF forward once, at start-up.

The dense parts of each decoder layer (norms, projections, RoPE, MLP) and the cache write are
functions in `flashdraft.model.static_layers`. The decode loops built on it capture its steps
with `flashdraft.model.graphs`; the attention="varlen" steps' kernel plan lives in
`flashdraft.model.varlen`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flashdraft.model import static_hybrid, static_layers, varlen
from flashdraft.model.hybrid import LINEAR_ATTENTION, layer_types

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LAYER_TYPES = ("full_attention", "sliding_attention")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
FLEX_BLOCK = 128  # K/V slots per flex block; cache rows are multiples of it
# Compiled once at module scope (STYLE); the CPU runs flex eagerly (tests, correctness only).
_compiled_flex = torch.compile(flex_attention, dynamic=False)
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
FUSE_MAX_BYTES = 4 << 30  # `StaticLM.fuse_projections`: the most weight it copies


def unsupported_reason(model: Any) -> str | None:
    """Why `StaticLM` cannot run `model` (None: it can). Cheap: reads attributes only."""
    config = getattr(model, "config", None)
    if config is None:
        return f"{type(model).__name__} has no HF config"
    text = config.get_text_config()
    kind = getattr(text, "model_type", None)
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "sharded (DTensor) parameters"
    if kind in static_hybrid.HYBRID_MODEL_TYPES:
        return static_hybrid.unsupported_reason(model)
    if kind not in SUPPORTED_MODEL_TYPES:
        known = (*SUPPORTED_MODEL_TYPES, "qwen3_5", "qwen3_5_moe", "qwen3_next")
        return f"model type {kind!r} (static decoding knows {', '.join(known)})"
    layer_types = getattr(text, "layer_types", None) or []
    odd = sorted(set(layer_types) - set(LAYER_TYPES))
    if odd:
        return f"layer types {odd}"
    rope = getattr(text, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        # Their tables depend on the longest position seen: a host read every step.
        return f"rope type {rope['rope_type']!r}"
    for name in ("logit_scale", "logits_scaling", "final_logit_softcapping"):
        if getattr(text, name, None) not in (None, 1, 1.0):
            return f"{name} = {getattr(text, name)}"
    base = getattr(model, "model", None)
    parts = ("embed_tokens", "rotary_emb", "norm", "layers")
    if base is None or getattr(model, "lm_head", None) is None:
        return "no .model / .lm_head"
    if any(getattr(base, p, None) is None for p in parts):
        return f"the base model lacks one of {parts}"
    for layer in base.layers:
        attn = getattr(layer, "self_attn", None)
        if any(getattr(layer, p, None) is None for p in _LAYER_PARTS) or any(
            getattr(attn, p, None) is None for p in _ATTENTION_PARTS
        ):
            return f"a decoder layer ({type(layer).__name__}) of an unknown layout"
    return None


def _window(layer: nn.Module, text: Any) -> int | None:
    """The sliding window of one layer as HF applies it: Qwen2/Qwen3 attention modules carry
    their own (None on full layers); Mistral applies `config.sliding_window` everywhere.
    A hybrid's layers attend to everything they attend to (its linear layers: None too)."""
    attn: Any = getattr(layer, "self_attn", None)
    if attn is None or text.model_type in static_hybrid.HYBRID_MODEL_TYPES:
        return None
    if hasattr(attn, "sliding_window"):
        window = attn.sliding_window
    else:
        window = getattr(text, "sliding_window", None)
    return None if window is None else int(window)


def _visible(slot: Tensor, position: Tensor, window: int | None) -> Tensor:
    """The cache slots a query at `position` attends to: every earlier slot and its own,
    within the last `window` for sliding layers (one rule for the SDPA and flex masks)."""
    seen = slot <= position
    return seen if window is None else seen & (position - slot < window)


ATTENTIONS = ("sdpa", "flex", "varlen")


class StaticLM:
    """An HF causal LM's forward with its own K/V buffers, [R, Hkv, L, D] per layer.

    `lm(ids, positions)` writes the K/V of `ids` at `positions` and returns
    (logits [R, n, V] in the model's dtype, taps [R, n, K*H] or None). The modules are the
    model's own (referenced, not copied); nothing here is an `nn.Module`, so the model's state
    dict is untouched.
    """

    def __init__(
        self,
        model: Any,
        rows: int,
        max_len: int,
        tap_ids: Sequence[int] = (),
        *,
        dtype: torch.dtype | None = None,
        attention: str = "sdpa",
    ) -> None:
        """attention: "sdpa" (a boolean mask over the first kv_len slots of every row), or
        "flex" for one-token steps of every row (decoding): flex_attention with a block mask
        that reads only the 128-slot blocks up to each row's own position (the K/V of a
        short request is not read up to the longest one's); or "varlen" for one-token steps
        of every row: on the full-attention layers, the flash kernel over each row's own
        slots 0..position (`varlen.own_slots_attention`: no mask, nothing above a row's position
        read, one shape for every length; CUDA, half precision; elsewhere it runs sdpa);
        other calls use sdpa."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"static decoding does not support this target: {reason}")
        text = model.config.get_text_config()
        base = model.model
        self.model = model
        self.embed, self.rotary, self.norm, self.lm_head = (
            base.embed_tokens,
            base.rotary_emb,
            base.norm,
            model.lm_head,
        )
        self.layers = list(base.layers)
        bad = [i for i in tap_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"tap ids {bad}: the target has {len(self.layers)} layers")
        self.tap_ids = list(tap_ids)
        self.windows = [_window(layer, text) for layer in self.layers]
        # hybrid targets: gated attention layers, and Gated DeltaNet layers whose states live
        # in `conv` / `state` (static_hybrid)
        self.hybrid = text.model_type in static_hybrid.HYBRID_MODEL_TYPES
        kinds = layer_types(text) if self.hybrid else ["full_attention"] * len(self.layers)
        self.linear = [kind == LINEAR_ATTENTION for kind in kinds]
        attn = next(
            layer.self_attn for layer, lin in zip(self.layers, self.linear, strict=True) if not lin
        )
        self.num_heads, self.num_kv_heads = text.num_attention_heads, text.num_key_value_heads
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.hidden_size = text.hidden_size
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, dtype or parameter.dtype
        self.rows, self.max_len = rows, max_len
        shape = (rows, self.num_kv_heads, max_len, self.head_dim)
        empty = (0,)
        self.keys = [self._zeros(empty if lin else shape) for lin in self.linear]
        self.values = [self._zeros(empty if lin else shape) for lin in self.linear]
        self.conv: list[Tensor] = []  # per linear layer: [R, C, K-1], the kept conv inputs
        self.state: list[Tensor] = []  # per linear layer: [R, nv, dk, dv] fp32, the delta rule's
        for layer, lin in zip(self.layers, self.linear, strict=True):
            if lin:
                m = layer.linear_attn
                width = m.conv1d.weight.shape[-1] - 1
                self.conv.append(self._zeros((rows, m.conv_dim, width)))
                size = (rows, m.num_v_heads, m.head_k_dim, m.head_v_dim)
                self.state.append(torch.zeros(size, dtype=torch.float32, device=self.device))
        # what a verify (`keep=True`) leaves for `commit`, per linear layer (allocated for the
        # verify's length on first use)
        self._pending: list[list[Tensor]] = []
        self._slots = torch.arange(max_len, device=self.device)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention {attention!r}: one of {', '.join(ATTENTIONS)}")
        if attention == "flex" and max_len % FLEX_BLOCK:
            raise ValueError(f"flex decoding needs rows of a multiple of {FLEX_BLOCK} slots")
        self.attention = attention
        blocks = torch.arange(max_len // FLEX_BLOCK, dtype=torch.int32, device=self.device)
        self._kv_indices = blocks[None, None, None, :]  # every row reads blocks 0, 1, ...
        self._flex = _compiled_flex if self.device.type == "cuda" else flex_attention
        # decode steps (every row, one token): the project part writes the K/V itself
        self._decode_parts: tuple[Callable[..., Any], Callable[..., Any]] = (
            static_layers.project_into_cache,
            static_layers.finish,
        )
        self._prefill_parts: tuple[Callable[..., Any], Callable[..., Any]] | None = None
        # a hybrid's parts: a linear layer's step, a gated attention layer's two halves
        self._hybrid_parts: tuple[Callable[..., Any], ...] = (
            static_hybrid.linear_step,
            static_hybrid.gated_project,
            static_hybrid.gated_finish,
        )
        self._commit: Callable[..., None] = static_hybrid.commit
        self._fused: list[static_layers.Fused | None] = [None] * len(self.layers)
        # index_put_ coordinates of a call of every row (`static_layers.write_cache`)
        self._row_ids = torch.arange(rows, device=self.device)[:, None, None]
        self._head_ids = torch.arange(self.num_kv_heads, device=self.device)[None, :, None]
        half = self.dtype in (torch.float16, torch.bfloat16)
        flash = self.flash_anywhere or (self.device.type == "cuda" and half and varlen.FLASH_USED_K)
        # attention="varlen" where the flash kernel runs (elsewhere those steps run sdpa):
        # its sequences' starts, fixed for this cache (only the used lengths change per step)
        self._flash_starts = (
            varlen.sequence_starts(
                rows, self.num_kv_heads, self.num_heads // self.num_kv_heads, max_len, self.device
            )
            if attention == "varlen" and flash
            else None
        )
        # Whether a one-token step of every row reads only each row's slots 0..position on
        # every layer: its cost does not depend on `kv_len`, so decoders can run every step
        # at one length (one graph).
        self.steps_read_own_slots = self._flash_starts is not None and all(
            w is None for w in self.windows
        )

    # Whether `varlen._flash_varlen` runs here (tests set it to run their emulation on CPU).
    flash_anywhere: bool = False

    def _zeros(self, shape: tuple[int, ...]) -> Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def cache_bytes(self) -> int:
        states = [*self.keys, *self.values, *self.conv, *self.state]
        return sum(t.numel() * t.element_size() for t in states)

    # ---- a hybrid's linear-layer states (no-ops for a dense target) ----

    def reset_states(self, rows: Tensor | None = None) -> None:
        """Zero the linear layers' states of `rows` (all: None): prompts start from nothing."""
        for t in (*self.conv, *self.state):
            if rows is None:
                t.zero_()
            else:
                t[rows] = 0

    def _pending_for(self, n: int) -> list[list[Tensor]]:
        """The verify buffers for calls of n tokens (window, k, u, G, M per linear layer)."""
        if self._pending and self._pending[0][2].shape[2] == n:
            return self._pending
        self._pending = []
        for conv, state in zip(self.conv, self.state, strict=True):
            r, c, width = conv.shape
            _, nv, dk, dv = state.shape
            f32 = dict(dtype=torch.float32, device=self.device)
            self._pending.append([
                self._zeros((r, c, width + n)), torch.zeros(r, nv, n, dk, **f32),
                torch.zeros(r, nv, n, dv, **f32), torch.zeros(r, nv, n, **f32),
                torch.zeros(r, nv, n, n, **f32),
            ])  # fmt: skip
        return self._pending

    def prepare_verify(self, n: int) -> None:
        """Allocate the buffers of `keep=True` calls of n tokens now (before a graph capture)."""
        if self.hybrid:
            self._pending_for(n)

    def commit(self, accepted: Tensor) -> None:
        """After a `keep=True` call: keep every linear layer's state after token accepted[r]
        (0-based, [R]) of that call, exactly as if only those tokens had been fed."""
        for conv, state, pending in zip(self.conv, self.state, self._pending, strict=True):
            self._commit(conv, state, pending, accepted)

    def _masks(self, positions: Tensor, kv_len: int) -> dict[int | None, Tensor]:
        """Visibility [R, 1, G*n, kv_len] (True = attend), one per distinct window: slot j is
        visible from position p iff j <= p (and p - j < W)."""
        slots = self._slots[:kv_len][None, None, :]
        p = positions[:, :, None]
        r, n = positions.shape
        g = self.num_heads // self.num_kv_heads
        masks = {}
        for window in set(self.windows):
            visible = _visible(slots, p, window)
            # GQA folded into the query axis (query head h = kv * G + g, as HF's repeat_kv):
            # the fast SDPA kernels take a mask only without enable_gqa.
            masks[window] = (
                visible[:, None, None].expand(r, 1, g, n, kv_len).reshape(r, 1, g * n, kv_len)
            )
        return masks

    def _block_masks(self, positions: Tensor, kv_len: int) -> dict[int | None, BlockMask]:
        """Flex block masks for one query per row at positions [R, 1], one per distinct
        window: row r reads blocks 0 .. positions[r] // 128 (device arithmetic only, so a
        CUDA graph replays it), and within them the same rule as `_masks`."""
        rows = positions.shape[0]
        count = (positions[:, 0] // FLEX_BLOCK + 1).to(torch.int32)
        num_blocks = kv_len // FLEX_BLOCK
        indices = self._kv_indices[..., :num_blocks].expand(rows, 1, 1, num_blocks)
        at = positions[:, 0]
        masks = {}
        for window in set(self.windows):

            def visible(
                b: Tensor, h: Tensor, q: Tensor, kv: Tensor, w: int | None = window
            ) -> Tensor:
                return _visible(kv, at[b], w)

            masks[window] = BlockMask.from_kv_blocks(
                count[:, None, None],
                indices,
                BLOCK_SIZE=FLEX_BLOCK,
                mask_mod=visible,
                seq_lengths=(1, kv_len),
                compute_q_blocks=False,  # forward only: no transposed (backward) indices
            )
        return masks

    def _attention(
        self,
        i: int,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        positions: Tensor,
        mask: Tensor | BlockMask | varlen.OwnSlots | None,
        rows: Tensor | None,
        kv_len: int,
        *,
        flat: bool = False,
    ) -> Tensor:
        """q [R, Hq, n, D], k / v [R, Hkv, n, D] roped -> attention output [R, n, Hq*D]
        (flat: [1, R*n, Hq*D]); writes this call's K/V into layer i's cache first (k / v
        None: the decode part has written them, `static_layers.project_into_cache`). mask
        None: the call's own tokens from position 0, causal (`fresh`)."""
        r, _, n, d = q.shape
        hq, hkv = self.num_heads, self.num_kv_heads
        out_shape = (1, r * n, hq * d) if flat else (r, n, hq * d)
        keys, values = self.keys[i], self.values[i]
        if k is None or v is None:  # the decode part wrote them: read them back if needed
            k, v = keys[:, :, :n], values[:, :, :n]  # (a one-token fresh prompt: slot 0)
        elif rows is None:  # every row, in order: in place, so addresses stay fixed (graphs)
            static_layers.write_cache(
                keys, values, k, v, (self._row_ids, self._head_ids, positions[:, None])
            )
        else:  # a subset of rows (prefill of new prompts into their slots)
            keys[rows[:, None], :, positions] = k.transpose(1, 2).to(keys.dtype)
            values[rows[:, None], :, positions] = v.transpose(1, 2).to(values.dtype)
        if mask is None:  # fresh prompts: causal over the call's own K/V
            g = hq // hkv
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            # Not cuDNN: it builds an execution plan per new shape, and every prefill batch
            # has its own width (suspected, not yet measured: one 22 x 700 prefill takes 27 ms
            # alone on an H200, 105 ms on average inside generation; cuDNN's kernel ran).
            with sdpa_kernel(_NO_CUDNN):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.transpose(1, 2).reshape(out_shape)
        if isinstance(mask, varlen.OwnSlots):  # the whole cache: the plan bounds each row
            return varlen.own_slots_attention(q, keys, values, mask, self.scale)
        if rows is None:
            keys, values = keys[:, :, :kv_len], values[:, :, :kv_len]
        else:
            keys, values = keys[rows, :, :kv_len], values[rows, :, :kv_len]
        if isinstance(mask, BlockMask):
            flex = self._flex(
                q, keys, values, block_mask=mask, scale=self.scale, enable_gqa=hq != hkv
            )  # [R, Hq, n, D]
            assert isinstance(flex, Tensor)
            return flex.transpose(1, 2).reshape(out_shape)
        g = hq // hkv
        # Prefill batches (rows given) each have their own shape: not cuDNN (see above); the
        # decode steps have a few fixed shapes, captured once.
        with sdpa_kernel(_NO_CUDNN) if rows is not None else nullcontext():
            out = F.scaled_dot_product_attention(
                q.reshape(r, hkv, g * n, d), keys, values, attn_mask=mask, scale=self.scale
            )  # [R, Hkv, G*n, D]
        return out.reshape(r, hq, n, d).transpose(1, 2).reshape(out_shape)

    def compile_layers(
        self, backend: str | Callable[..., Any] = "inductor", *, prefill: bool = False
    ) -> None:
        """Compile the dense parts of every decoder layer for the decode steps (all rows, one
        token: `rows` None): the norms, projections, RoPE and MLP, fused by inductor; the
        cache write and attention stay as they are, so one graph per part serves every
        attention length and every layer (the modules are inputs, not constants).

        prefill: the other calls' parts too (prefill batches, verify blocks), on the call's
        tokens as one row: the first batch compiles for its token count, the second once
        more with it symbolic, and that graph serves the rest. Eager, a 22 x 700
        SmolLM2-135M prefill spent ~15 of its 25 ms of GPU time in unfused elementwise
        kernels (norms, RoPE, SiLU; `bench/prefill_profile.py` shows where it goes)."""
        if self.hybrid:  # one graph per part and kind of layer; prefill stays eager
            parts = (static_hybrid.linear_step, static_hybrid.gated_project)
            self._hybrid_parts = tuple(
                torch.compile(part, backend=backend, dynamic=False)
                for part in (*parts, static_hybrid.gated_finish)
            )
            self._commit = torch.compile(static_hybrid.commit, backend=backend, dynamic=False)
            return
        self._decode_parts = (
            torch.compile(static_layers.project_into_cache, backend=backend, dynamic=False),
            torch.compile(static_layers.finish, backend=backend, dynamic=False),
        )
        if prefill:
            self._prefill_parts = (
                torch.compile(static_layers.prefill_project, backend=backend),
                torch.compile(static_layers.prefill_finish, backend=backend),
            )

    def fuse_projections(self, max_bytes: int = FUSE_MAX_BYTES) -> bool:
        """Every layer's q/k/v weights as one matrix and its MLP's gate/up as one: copies (the
        model's own parameters stay as they are), so it costs their memory once more, and it
        is skipped (False) above `max_bytes` of copies or when a layer's layout differs
        (`static_layers.fusable`). The results equal the unfused ones up to the GEMMs'
        rounding. The copies are taken now: for a frozen target (generation); a model whose
        weights change later (a drafter's in-training eval of a target being tuned) must not
        be fused."""
        if self.hybrid or not all(static_layers.fusable(layer) for layer in self.layers):
            return False
        size = 0
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                size += m.weight.numel() * m.weight.element_size()
        if size > max_bytes:
            return False

        def cat(modules: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
            weight = torch.cat([m.weight.detach() for m in modules])
            biases = [m.bias for m in modules]
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            return weight, bias

        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = cat([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up = cat([mlp.gate_proj, mlp.up_proj])
            self._fused[i] = (*qkv, *gate_up)
        return True

    def __call__(
        self,
        ids: Tensor,
        positions: Tensor,
        *,
        rows: Tensor | None = None,
        kv_len: int | None = None,
        logits_at: Tensor | None = None,
        fresh: bool = False,
        keep: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """ids, positions [R, n] (R = rows of the cache, or len(rows) when given).

        rows: write into these cache rows only (eager prefill); kv_len: attend over the
        first kv_len slots only (every query's position must be below it); logits_at [R]:
        logits only at that index of each row, -> [R, 1, V]; fresh: every row's positions
        are 0 .. n-1 (prompts from their start, right-padded): the K/V are still written, but
        attention runs within the call, causal, on SDPA's flash kernels instead of reading
        the cache through a dense mask (sliding layers whose window is shorter than n keep
        the mask). What a padding position computes is never read (the cache invariant).

        A hybrid's linear layers continue from their kept states (`fresh`: from zero, the
        rows' states reset first). keep (every row, a verify): their states are left as they
        were, and `commit` then keeps those after the accepted tokens; otherwise a call of
        every row's next token updates them, and any other call (a prefill) keeps those after
        each row's last real token (logits_at, else the last).
        """
        kv_len = kv_len or self.max_len
        if self.hybrid:
            return static_hybrid.forward(self, ids, positions, rows, kv_len, logits_at, fresh, keep)
        r, n = ids.shape
        # The compiled prefill parts take the call's tokens as one row
        # (`static_layers.prefill_project`).
        flat = self._prefill_parts is not None and not (rows is None and n == 1)
        x = self.embed(ids.reshape(1, r * n) if flat else ids)
        # cos, sin [R, n, D] (flat: [1, R*n, D]) in x's dtype
        rope = self.rotary(x, positions.reshape(1, r * n) if flat else positions)
        masks: dict[int | None, Any]
        if fresh:
            masked = {w for w in self.windows if w is not None and w < n}
            masks = dict.fromkeys(set(self.windows) - masked)  # None: causal within the call
            if masked:
                windowed = self._masks(positions, kv_len)
                masks |= {w: windowed[w] for w in masked}
        elif self.attention == "flex" and rows is None and n == 1:
            masks = self._block_masks(positions, kv_len)
        elif self._flash_starts is not None and rows is None and n == 1:
            plan = varlen.OwnSlots(self._flash_starts, positions, self.num_kv_heads)
            sliding = any(w is not None for w in self.windows)
            masks = {**(self._masks(positions, kv_len) if sliding else {}), None: plan}
        else:
            masks = self._masks(positions, kv_len)
        wanted = set(self.tap_ids)
        taps: dict[int, Tensor] = {}
        decode = rows is None and n == 1
        parts: tuple[Callable[..., Any], Callable[..., Any]] = (
            self._decode_parts
            if decode
            else self._prefill_parts or (static_layers.project, static_layers.finish)
        )
        project, finish = parts
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        at = (self._row_ids, self._head_ids, positions[:, None])
        for i, layer in enumerate(self.layers):
            k: Tensor | None
            v: Tensor | None
            if decode:  # the part writes this step's K/V into the cache (k, v: None)
                fused = self._fused[i]
                q = project(layer, fused, x, rope, shape, self.keys[i], self.values[i], at)
                k = v = None
            else:
                q, k, v = project(layer, self._fused[i], x, rope, shape)
                if flat:  # [1, h, R*n, D] -> [R, h, n, D] (views)
                    q, k, v = (a[0].unflatten(1, (r, n)).transpose(0, 1) for a in (q, k, v))
            mask = masks[self.windows[i]]
            out = self._attention(i, q, k, v, positions, mask, rows, kv_len, flat=flat)
            if flat and out._base is not None:  # a view (one-token prompts): its base's
                out = out.clone()  # sizes would enter the compiled part's guards
            x = finish(layer, self._fused[i], x, out)
            if (
                i in wanted
            ):  # the z-lab convention: the output of decoder layer i (docs/design.md §3)
                taps[i] = x.view(r, n, -1) if flat else x
        if flat:
            x = x.view(r, n, -1)
        if logits_at is not None:
            x = x.gather(1, logits_at[:, None, None].expand(-1, 1, x.shape[-1]))
        logits = self.lm_head(self.norm(x))
        tapped = torch.cat([taps[i] for i in self.tap_ids], dim=-1) if self.tap_ids else None
        return logits, tapped

    @torch.no_grad()
    def verify(self, length: int = 12) -> None:
        """Start-up check: logits and taps equal an HF forward of the same tokens (relative
        to their scale; bf16 kernels differ in rounding only). Raises ValueError if not."""
        length = min(length, self.max_len)
        vocab = int(self.embed.weight.shape[0])
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (1, length), generator=generator).to(self.device)
        positions = torch.arange(length, device=self.device)[None]
        rows = torch.zeros(1, dtype=torch.long, device=self.device)
        logits, taps = self(ids, positions, rows=rows, kv_len=length, fresh=self.hybrid)
        ref = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        tolerance = 1e-3 if self.dtype == torch.float32 else 5e-2
        pairs = [("logits", logits, ref.logits)]
        hidden, last = self.hidden_size, len(self.layers) - 1
        for j, i in enumerate(self.tap_ids):
            assert taps is not None
            tap = taps[..., j * hidden : (j + 1) * hidden]
            # HF reports the last layer's output after the final norm (docs/design.md §3).
            pairs.append(
                (f"tap {i}", self.norm(tap) if i == last else tap, ref.hidden_states[i + 1])
            )
        for name, ours, theirs in pairs:
            error = float((ours.float() - theirs.float()).abs().max())
            scale = float(theirs.float().abs().max()) + 1e-6
            if error > tolerance * scale:
                raise ValueError(
                    f"static decoding differs from the HF forward ({name}: max error "
                    f"{error:.3g} at scale {scale:.3g}); use the HF decoder for this target"
                )
