"""The dense parts of a target's decoder layer as `flashdraft.model.static.StaticLM` runs them,
as functions of the layer's own HF submodules: the input norm, q/k/v projections, per-head
norms and RoPE before attention (`project`); the output projection, residual and MLP after it
(`finish`); the same two for prefill calls (`prefill_project`, `prefill_finish`); the write of
a call's K/V into a layer's cache (`write_cache`) and a decode step's projection that makes
that write itself (`project_into_cache`); and whether a layer's projections can be fused
(`fusable`). `StaticLM.compile_layers` compiles these parts: one graph per part serves every
layer (the modules are inputs, not constants).

Shape legend (as in `flashdraft.model.static`): R rows, n tokens per call, L cache slots,
Hq / Hkv query / key-value heads, D head dim, H hidden size.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from flashdraft.model.drafter import apply_rope  # the drafter's RoPE, the same arithmetic

# The dense parts of a decoder layer, before and after attention. `fused` (optional): the
# layer's q/k/v weights as one matrix (and bias) and its MLP's gate/up as one
# (`StaticLM.fuse_projections`): two GEMMs where there were five, what a small target's
# decode step (a few hundred tokens per GEMM: latency-bound) pays for.
Fused = tuple[Tensor, Tensor | None, Tensor, Tensor | None]  # qkv weight, bias; gate_up, bias


def project(
    layer: Any,
    fused: Fused | None,
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    shape: tuple[int, int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    """A decoder layer's input norm, q/k/v projections, per-head norms (Qwen3) and RoPE:
    x [R, n, H] -> q [R, Hq, n, D], k / v [R, Hkv, n, D]."""
    hq, hkv, d = shape
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    r, n, _ = h.shape
    if fused is None:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    else:
        q, k, v = F.linear(h, fused[0], fused[1]).split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(r, n, hq, d), k.view(r, n, hkv, d), v.view(r, n, hkv, d)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head norms before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [R, h, n, D]
    return apply_rope(q, *rope), apply_rope(k, *rope), v


def finish(layer: Any, fused: Fused | None, x: Tensor, attended: Tensor) -> Tensor:
    """The rest of a decoder layer after attention: output projection, residual, MLP."""
    x = x + layer.self_attn.o_proj(attended)
    h = layer.post_attention_layernorm(x)
    if fused is None:
        return x + layer.mlp(h)
    gate, up = F.linear(h, fused[2], fused[3]).chunk(2, dim=-1)
    return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)


# The same parts for prefill calls, as functions of their own: dynamo keeps its compiled
# entries (and its automatic-dynamic record of which sizes changed) per code object, so the
# prefill graphs (their token count changes with every batch: dynamic after the first) and
# the decode steps' (static shapes, captured) stay apart. `StaticLM.__call__` gives them the
# batch's tokens as one row, [1, R*n, H] ("flat"): a batch of one row or of one-token prompts
# would otherwise get graphs of its own (dynamo specializes sizes of 1).
def prefill_project(
    layer: Any,
    fused: Fused | None,
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    shape: tuple[int, int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    return project(layer, fused, x, rope, shape)


def prefill_finish(layer: Any, fused: Fused | None, x: Tensor, attended: Tensor) -> Tensor:
    return finish(layer, fused, x, attended)


def write_cache(
    keys: Tensor, values: Tensor, k: Tensor, v: Tensor, at: tuple[Tensor, Tensor, Tensor]
) -> None:
    """k / v [R, Hkv, n, D] into every row's slots of keys / values [R, Hkv, L, D], in place;
    at = (row ids [R, 1, 1], head ids [1, Hkv, 1], positions [R, 1, n]). As index_put_, not
    scatter_: under torch.compile inductor writes an input's index_put_ in place, fused with
    what computes k and v, where a scatter_ into an input copies the whole cache in and out
    (seen in the CPU backend's generated code, 2026-12-03)."""
    keys.index_put_(at, k.to(keys.dtype))
    values.index_put_(at, v.to(values.dtype))


def project_into_cache(
    layer: Any,
    fused: Fused | None,
    x: Tensor,
    rope: tuple[Tensor, Tensor],
    shape: tuple[int, int, int],
    keys: Tensor,
    values: Tensor,
    at: tuple[Tensor, Tensor, Tensor],
) -> Tensor:
    """`project` for a decode step of every row, writing k / v into the layer's cache itself
    (compiled, the write is part of the RoPE kernel): -> q [R, Hq, 1, D]."""
    q, k, v = project(layer, fused, x, rope, shape)
    write_cache(keys, values, k, v, at)
    return q


def fusable(layer: Any) -> bool:
    """Whether a layer's projections can be fused: Linear q/k/v and gate/up, each set with
    biases on all or none, and an MLP computed as down(act(gate(x)) * up(x))."""
    attn, mlp = layer.self_attn, layer.mlp
    parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    gate_up = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    linear = [m for m in parts + gate_up if isinstance(m, nn.Linear)]
    if len(linear) < len(parts + gate_up):
        return False
    if getattr(mlp, "down_proj", None) is None or not callable(getattr(mlp, "act_fn", None)):
        return False
    return all(len({m.bias is None for m in group}) == 1 for group in (linear[:3], linear[3:]))
