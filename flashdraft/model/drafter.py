"""The DFlash draft model (docs/design.md §2). Single-device model code: no training imports.

Shape legend:
  R rows   T context tokens   Q = A * B block (query) tokens   S = T + Q keys
  H hidden size   K tapped target layers   Hq / Hkv query / key-value heads   D head dim

The drafter has no embedding and no LM head of its own: block tokens are embedded with the
target's frozen table and logits come from the target's frozen head (`TargetHead` in
`flashdraft.model.head`), both passed in, so neither is in this module's state dict. Its parameter
names are exactly the serving format's (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, ...).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from flashdraft.model.attention import Backend, BlockLayout, Mask, attend, build_mask, decode_mask
from flashdraft.model.config import DrafterConfig


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, applied in the input's dtype, as HF Qwen3 (and the engines) do.

    The weight is cast to the input dtype first, so fp32 master weights under bf16 autocast
    give exactly what the exported bf16 model gives, and the output stays bf16 (flex
    attention needs q, k, v in one dtype).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE tables from transformers' own initialisers, so every rope type matches the target."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        hf = Qwen3Config(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters=dict(config.rope_parameters),
        )
        self.inner = Qwen3RotaryEmbedding(hf)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [R, N] -> cos, sin [R, N, D] in `dtype`."""
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        cos, sin = self.inner(probe, positions)
        return cos, sin


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [R, heads, N, D]; cos/sin [R, N, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """KV-injection attention: queries from the block, keys/values from [context ; block]."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.scale = d**-0.5

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [R, N, H] at positions given by cos/sin -> k, v [R, Hkv, N, D] (k normed and roped)."""
        r, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(r, n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(r, n, self.num_kv_heads, self.head_dim)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        ctx_kv: tuple[Tensor, Tensor],
        rope_q: tuple[Tensor, Tensor],
        mask: Mask | None,
    ) -> Tensor:
        """x [R, Q, H] normed block states; ctx_kv [R, Hkv, T, D] each -> [R, Q, H]."""
        r, q_len, _ = x.shape
        cos, sin = rope_q
        q = self.q_norm(self.q_proj(x).view(r, q_len, self.num_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        k = torch.cat([ctx_kv[0], k_blk], dim=2)
        v = torch.cat([ctx_kv[1], v_blk], dim=2)
        out = attend(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(r, q_len, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Activation checkpointing (`drafter.activation_checkpointing`): keep only the layer's
        # inputs for backward and run its forward again there. Not a parameter: the state dict
        # is the same either way.
        self.checkpointed = False

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        rope_ctx: tuple[Tensor, Tensor],
        rope_q: tuple[Tensor, Tensor],
        mask: Mask | None,
    ) -> Tensor:
        """Training: ctx [R, T, H] fused context states, projected to K/V here, inside the
        layer's forward: FSDP2 gathers a layer's weights only for its forward, and the compiled
        layer is one graph with its K/V projection.

        Checkpointed, the recomputation sits inside this forward (non-reentrant
        `torch.utils.checkpoint`), so a compiled layer traces it into its graph and FSDP2's
        hooks around the module call gather the weights once for the forward and once for
        the backward, as without it (torchtitan's order: checkpoint, then compile, then shard).
        """
        if self.checkpointed and torch.is_grad_enabled():
            out = checkpoint(self._forward, x, ctx, rope_ctx, rope_q, mask, use_reentrant=False)
            assert isinstance(out, Tensor)
            return out
        return self._forward(x, ctx, rope_ctx, rope_q, mask)

    def _forward(
        self,
        x: Tensor,
        ctx: Tensor,
        rope_ctx: tuple[Tensor, Tensor],
        rope_q: tuple[Tensor, Tensor],
        mask: Mask | None,
    ) -> Tensor:
        return self.decode(x, self.self_attn.project_kv(ctx, *rope_ctx), rope_q, mask)

    def decode(
        self,
        x: Tensor,
        ctx_kv: tuple[Tensor, Tensor],
        rope_q: tuple[Tensor, Tensor],
        mask: Mask | None,
    ) -> Tensor:
        """Decoding: this layer's projected context K/V [1, Hkv, C, D] from the cache. Only
        ever called on an unsharded, uncompiled drafter (the eval copy)."""
        x = x + self.self_attn(self.input_layernorm(x), ctx_kv, rope_q, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftCache:
    """Projected context K/V per layer for decoding, in preallocated buffers.

    Layer i attends to the K/V of its last `held` context positions, [1, Hkv, held, D]
    (`layer(i)`): every position for a full-attention layer; at most W - 1 for a sliding
    layer of window W, since slot 0 of a block anchored at a sees context a - W + 1 .. a - 1
    and later slots see less. Only verified tokens enter (`append`); block K/V are never kept.
    A buffer that fills up is reallocated with the rows its layer still needs plus room to
    grow (doubling for full layers, W more rows for sliding ones): amortised O(1) copying per
    token, and a sliding layer's memory stays O(W) however long the decode runs.
    """

    def __init__(self) -> None:
        self.length = 0  # context positions appended so far: the next anchor's position
        self._keys: list[Tensor] = []  # [1, Hkv, capacity, D] per layer
        self._values: list[Tensor] = []
        self._fill: list[int] = []  # rows in use (the front of the buffer), oldest first
        self._keep: list[int | None] = []  # rows a layer needs at most (None: all)

    def _held(self, i: int) -> int:
        keep = self._keep[i]
        return self._fill[i] if keep is None else min(self._fill[i], keep)

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """K, V [1, Hkv, held, D] of layer i: its last `held` context positions."""
        fill, held = self._fill[i], self._held(i)
        return self._keys[i][:, :, fill - held : fill], self._values[i][:, :, fill - held : fill]

    @property
    def capacity(self) -> list[int]:
        """Rows allocated per layer (held rows plus room to grow)."""
        return [int(k.shape[2]) for k in self._keys]

    @property
    def keys(self) -> list[Tensor]:
        return [self.layer(i)[0] for i in range(len(self._keys))]

    @property
    def values(self) -> list[Tensor]:
        return [self.layer(i)[1] for i in range(len(self._values))]

    def append(self, kv: list[tuple[Tensor, Tensor]], keep: list[int | None]) -> None:
        """Add N new positions: kv holds each layer's K, V [1, Hkv, N, D]; keep is each
        layer's need (None: all positions; W - 1 for a sliding layer)."""
        if not self._keys:
            self._keys = [k.new_empty((*k.shape[:2], 0, k.shape[3])) for k, _ in kv]
            self._values = [v.new_empty((*v.shape[:2], 0, v.shape[3])) for _, v in kv]
            self._fill, self._keep = [0] * len(kv), list(keep)
        for i, (k, v) in enumerate(kv):
            n = k.shape[2]
            if self._fill[i] + n > self._keys[i].shape[2]:
                self._reallocate(i, n)
            fill = self._fill[i]
            self._keys[i][:, :, fill : fill + n] = k
            self._values[i][:, :, fill : fill + n] = v
            self._fill[i] = fill + n
        self.length += kv[0][0].shape[2]

    def _reallocate(self, i: int, incoming: int) -> None:
        """A buffer for layer i with room for `incoming` more rows, keeping what it needs."""
        keep, fill = self._keep[i], self._fill[i]
        retain = self._held(i)
        slack = retain + incoming if keep is None else keep
        capacity = retain + incoming + max(slack, 64)
        for buffers in (self._keys, self._values):
            old = buffers[i]
            new = old.new_empty((*old.shape[:2], capacity, old.shape[3]))
            new[:, :, :retain] = old[:, :, fill - retain : fill]
            buffers[i] = new
        self._fill[i] = retain

    def crop(self, length: int) -> None:
        """Forget the positions from `length` on (after an `append` that is to be undone)."""
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        for i, keep in enumerate(self._keep):
            need = length if keep is None else min(keep, length)
            if self._fill[i] - drop < need:
                raise ValueError(
                    f"cannot crop to {length}: layer {i} no longer holds the window it needs"
                )
            self._fill[i] -= drop
        self.length = length


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.reset_parameters()

    def reset_parameters(self, seed: int | None = None) -> None:
        """Standard init: normal(0, initializer_range) for linears, ones for norms (docs/design.md §2)."""
        generator = None
        if seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                weight = torch.empty(module.weight.shape, dtype=torch.float32)
                weight.normal_(0.0, self.config.initializer_range, generator=generator)
                with torch.no_grad():
                    module.weight.copy_(weight)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each layer's activations in backward instead of keeping them
        (`drafter.activation_checkpointing`): the same loss and gradients, about one more
        forward of the layers in time, and of the layers' saved activations only their
        inputs kept (`train/preflight.py` counts both)."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.checkpointed = enabled

    def fuse_context(self, target_hidden: Tensor) -> Tensor:
        """[R, T, K*H] concatenated taps -> [R, T, H]: hidden_norm(fc(.)), once, not per layer."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        target_hidden: Tensor,
        block_embeds: Tensor,
        context_positions: Tensor,
        block_positions: Tensor,
        masks: dict[str, Mask | None],
        residual_dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Training path: all blocks of each row in one pass.

        target_hidden [R, T, K*H]; block_embeds [R, Q, H]; context_positions [R, T];
        block_positions [R, Q]; masks keyed by layer type. Returns final-normed [R, Q, H].
        `residual_dtype` (e.g. fp32 under bf16 autocast): the dtype the residual stream is
        summed in, and so the norms' outputs; the projections (q, k, v among them) still
        compute in the autocast dtype, the rope tables and the returned states are in
        block_embeds' dtype (the LM head casts to it anyway). None: block_embeds' own.
        """
        ctx = self.fuse_context(target_hidden)
        dtype = block_embeds.dtype
        rope_ctx = self.rotary(context_positions, dtype)
        rope_q = self.rotary(block_positions, dtype)
        x = block_embeds if residual_dtype is None else block_embeds.to(residual_dtype)
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            x = layer(x, ctx, rope_ctx, rope_q, masks[layer.layer_type])
        return self.norm(x).to(dtype)

    def build_masks(self, layout: BlockLayout, backend: Backend) -> dict[str, Mask | None]:
        """One mask per layer type present (a sliding mask only if some layer slides)."""
        masks: dict[str, Mask | None] = {"full_attention": build_mask(layout, backend)}
        if "sliding_attention" in self.config.layer_types:
            masks["sliding_attention"] = build_mask(layout, backend, self.config.sliding_window)
        return masks

    # ---- decoding: a cache of projected context K/V, one block at a time ----

    def cache_keep(self) -> list[int | None]:
        """Context rows each layer's decode cache needs: all (None) for full layers, W - 1
        for sliding ones (the most a block's slot 0 sees)."""
        window = self.config.sliding_window
        return [
            window - 1 if kind == "sliding_attention" and window is not None else None
            for kind in self.config.layer_types
        ]

    @torch.no_grad()
    def extend_cache(self, cache: DraftCache, target_hidden: Tensor, positions: Tensor) -> None:
        """Append newly verified tokens: target_hidden [1, N, K*H] at positions [1, N]."""
        ctx = self.fuse_context(target_hidden)
        cos, sin = self.rotary(positions, ctx.dtype)
        kv = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            kv.append(layer.self_attn.project_kv(ctx, cos, sin))
        cache.append(kv, self.cache_keep())

    @torch.no_grad()
    def draft_block(self, cache: DraftCache, block_embeds: Tensor, start: int) -> Tensor:
        """One block [1, B, H] whose anchor sits at position `start` == cache length.

        Returns final-normed hidden states [1, B, H]; the same values the training path
        gives for that block (tests/model/test_drafter.py checks it).
        """
        b, device = block_embeds.shape[1], block_embeds.device
        assert cache.length == start, (cache.length, start)
        positions = torch.arange(start, start + b, device=device)[None]
        rope_q = self.rotary(positions, block_embeds.dtype)
        window = self.config.sliding_window
        masks: dict[int, Tensor | None] = {}  # sliding masks by first cached position
        x = block_embeds
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            kv = cache.layer(i)
            mask = None
            if layer.layer_type == "sliding_attention":
                first = start - kv[0].shape[2]
                if first not in masks:
                    masks[first] = decode_mask(start, b, window, device, context_start=first)
                mask = masks[first]
            x = layer.decode(x, kv, rope_q, mask)
        return self.norm(x)

    def num_flops_per_query_token(self, context_len: int, num_queries: int) -> float:
        """Forward FLOPs per query token of the training path (x3 for fwd+bwd).

        (1) linear layers on the Q block tokens: 2 * params of q,k,v,o + MLP per layer;
        (2) fc on the T context tokens and k,v projections of those tokens, spread over Q;
        (3) attention scores + weighted sum: 4 * D * Hq * (visible keys) per query, counting
            on average half the context before an anchor plus the block.
        """
        c = self.config
        h, d = c.hidden_size, c.head_dim
        q_dim, kv_dim = c.num_attention_heads * d, c.num_key_value_heads * d
        per_layer_block = 2 * (h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * c.intermediate_size)
        ctx_flops = 2 * c.num_taps * h * h + c.num_hidden_layers * 2 * (2 * h * kv_dim)  # (2)
        visible = context_len / 2 + c.block_size
        attn = 4 * q_dim * visible  # (3)
        return c.num_hidden_layers * (per_layer_block + attn) + ctx_flops * context_len / max(
            num_queries, 1
        )


def init_seeded(config: DrafterConfig, seed: int) -> DFlashDrafter:
    """A drafter whose initial weights depend only on `seed` (not on global RNG state)."""
    drafter = DFlashDrafter(config)
    drafter.reset_parameters(seed)
    return drafter


def param_count(module: nn.Module) -> int:
    return sum(math.prod(p.shape) for p in module.parameters())
