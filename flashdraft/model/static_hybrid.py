"""Hybrid targets (Qwen3.5 / Qwen3.6, Qwen3-Next) on `flashdraft.model.static.StaticLM`: the
gated full-attention layers over the static K/V cache, and the Gated DeltaNet layers over
static state buffers, with an exact rollback of the recurrent state for speculative verify.

A Gated DeltaNet layer keeps, per row, the last K-1 inputs of its causal convolution
(`conv` [R, C, K-1]) and the delta rule's state (`state` [R, nv, dk, dv], fp32). A K/V cache
is rewound by writing over it; a recurrent state cannot be. Verifying a block of n drafted
tokens must leave the state after the accepted prefix, which is known only after the verify.

The rollback (docs/design.md §5). Within one call of n tokens, with per-token log decays g_t,
G_t = g_1 + ... + g_t, gamma_t = exp(G_t), the recurrence

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)

unrolls to S_t = gamma_t S_0 + sum_{i<=t} (gamma_t / gamma_i) k_i u_i^T, and the u_i solve the
unit lower-triangular system (I + A) U = diag(beta) V - diag(beta gamma) K S_0 with
A_ti = beta_t (gamma_t / gamma_i) k_t.k_i for i < t (substitute S_{t-1} into u_t). So one
parallel pass gives every output, o_t = gamma_t q_t S_0 + sum_{i<=t} (gamma_t/gamma_i)(q_t.k_i) u_i,
and the state after ANY prefix j is gamma_j S_0 + K^T diag(M_j) U from n vectors per head:
the verify keeps (k, u, G, M) — n x (dk + dv + n + 1) floats per value head instead of n
states of dk x dv — and `commit(j)` rebuilds S_j exactly (up to fp32 rounding) once the
accepted length is known. The convolution's rollback is a window: the call's inputs appended
to the K-1 kept ones, and the K-1 ending at token j are the state after j.

The same pass, 64 tokens at a time, is the prefill (the chunked delta rule); a right-padded
row's pad tokens get g = 0 and beta = 0, which leave the state unchanged, and its convolution
window ends at its own last token.

Shape legend: R rows, n tokens per call, C conv channels (2*nk*dk + nv*dv), K conv taps,
nk / nv key / value heads, dk / dv their dims, Hq / Hkv attention heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flashdraft.model import delta_kernel, varlen
from flashdraft.model.hybrid import LINEAR_ATTENTION, gated_delta_net_project, layer_types

# text model types whose decoder layers are reproduced here
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
PREFILL_CHUNK = 64  # tokens per pass of the chunked delta rule in a prefill
# Decode steps on CUDA through `delta_kernel` (one pass over the state); benches turn it off.
FUSED_STEP = True


def unsupported_reason(model: Any) -> str | None:
    """Why the static path cannot run this hybrid (None: it can). Attributes only."""
    text = model.config.get_text_config()
    base = getattr(model, "model", None)
    if base is None or getattr(model, "lm_head", None) is None:
        return "no .model / .lm_head"
    kinds = layer_types(text)
    odd = sorted(set(kinds) - {LINEAR_ATTENTION, "full_attention"})
    if odd:
        return f"layer types {odd}"
    for layer, kind in zip(base.layers, kinds, strict=True):
        if kind == LINEAR_ATTENTION:
            m = getattr(layer, "linear_attn", None)
            if m is None or not type(m).__name__.endswith("GatedDeltaNet"):
                return f"a linear-attention layer ({type(m).__name__}) that is not a Gated DeltaNet"
            if m.conv1d.bias is not None:
                return "a Gated DeltaNet convolution with a bias"
        else:
            attn = getattr(layer, "self_attn", None)
            parts = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
            if attn is None or any(getattr(attn, p, None) is None for p in parts):
                return f"a full-attention layer ({type(attn).__name__}) of an unknown layout"
            if attn.q_proj.out_features != 2 * text.num_attention_heads * attn.head_dim:
                return "a full-attention layer without the output gate"
        if not hasattr(layer.mlp, "experts") and getattr(layer.mlp, "down_proj", None) is None:
            return f"an MLP of an unknown layout ({type(layer.mlp).__name__})"
    return None


def is_moe(model: Any) -> bool:
    return any(hasattr(layer.mlp, "experts") for layer in model.model.layers)


def forward(
    lm: Any,
    ids: Tensor,
    positions: Tensor,
    rows: Tensor | None,
    kv_len: int,
    logits_at: Tensor | None,
    fresh: bool,
    keep: bool,
) -> tuple[Tensor, Tensor | None]:
    """`StaticLM.__call__` for a hybrid target (its docstring says what each call keeps)."""
    r, n = ids.shape
    x = lm.embed(ids)
    # cos, sin [R, n, rotated dims]; Qwen3.5's multimodal RoPE takes [3, R, n] (T/H/W, equal
    # for text; transformers 5.17 indexes it so, later versions expand [R, n] themselves)
    mrope = hasattr(lm.rotary, "mrope_section")
    rope = lm.rotary(x, positions[None].expand(3, -1, -1) if mrope else positions)
    mask: Any
    if fresh:
        mask = None  # causal within the call
        lm.reset_states(rows)
    elif lm.attention == "flex" and rows is None and n == 1:
        mask = lm._block_masks(positions, kv_len)[None]
    elif lm._flash_starts is not None and rows is None and n == 1:
        mask = varlen.OwnSlots(lm._flash_starts, positions, lm.num_kv_heads)
    else:
        mask = lm._masks(positions, kv_len)[None]
    step = rows is None and not fresh and (n == 1 or keep)  # static shapes: graph-safe
    pending = lm._pending_for(n) if keep else None
    if step:
        lengths = None
    elif logits_at is not None:
        lengths = logits_at + 1
    else:
        lengths = torch.full((r,), n, dtype=torch.long, device=ids.device)
    linear_step, project, finish = lm._hybrid_parts
    shape = (lm.num_heads, lm.num_kv_heads, lm.head_dim)
    wanted = set(lm.tap_ids)
    taps: dict[int, Tensor] = {}
    j = 0  # linear layers seen
    for i, layer in enumerate(lm.layers):
        if lm.linear[i]:
            conv, state = lm.conv[j], lm.state[j]
            if lengths is None:
                x = linear_step(layer, x, conv, state, None if pending is None else pending[j])
            else:
                c0, s0 = (conv, state) if rows is None else (conv[rows], state[rows])
                x, c1, s1 = linear_prefill(layer, x, c0, s0, lengths)
                if rows is None:
                    conv.copy_(c1)
                    state.copy_(s1)
                else:
                    conv[rows], state[rows] = c1, s1
            j += 1
        else:
            q, k, v, gate = project(layer, x, rope, shape)
            out = lm._attention(i, q, k, v, positions, mask, rows, kv_len)
            x = finish(layer, x, out, gate)
        if i in wanted:  # the output of decoder layer i (docs/design.md §3)
            taps[i] = x
    if logits_at is not None:
        x = x.gather(1, logits_at[:, None, None].expand(-1, 1, x.shape[-1]))
    logits = lm.lm_head(lm.norm(x))
    tapped = torch.cat([taps[i] for i in lm.tap_ids], dim=-1) if lm.tap_ids else None
    return logits, tapped


# ---- gated full attention (Qwen3.5 / Qwen3-Next): q with an output gate, partial RoPE ----


def _partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on the first cos.shape[-1] dims of x [R, h, n, D] (cos/sin [R, n, d_rot])."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    half = d // 2
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos[:, None] + turned * sin[:, None], rest], dim=-1)


def gated_project(
    layer: Any, x: Tensor, rope: tuple[Tensor, Tensor], shape: tuple[int, int, int]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [R, n, H] -> q [R, Hq, n, D], k / v [R, Hkv, n, D] (roped), gate [R, n, Hq*D]; the
    arithmetic of the HF gated attention before its attention call."""
    hq, hkv, d = shape
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    r, n, _ = h.shape
    q, gate = attn.q_proj(h).view(r, n, hq, 2 * d).chunk(2, dim=-1)
    q = attn.q_norm(q).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(h).view(r, n, hkv, d)).transpose(1, 2)
    v = attn.v_proj(h).view(r, n, hkv, d).transpose(1, 2)
    cos, sin = rope
    return _partial_rope(q, cos, sin), _partial_rope(k, cos, sin), v, gate.reshape(r, n, hq * d)


def gated_finish(layer: Any, x: Tensor, attended: Tensor, gate: Tensor) -> Tensor:
    """The output gate, output projection, residual and MLP after attention."""
    x = x + layer.self_attn.o_proj(attended * torch.sigmoid(gate))
    return x + mlp(layer.mlp, layer.post_attention_layernorm(x))


# Above this many tokens an MoE block runs as HF's own module (its expert loop reads the
# routing on the host): only eager prefills get there.
MOE_GRAPH_TOKENS = 1024


def mlp(block: Any, h: Tensor) -> Tensor:
    """A dense MLP as itself; a sparse MoE block without host syncs or data-dependent shapes,
    so that it compiles and captures: with T tokens, k experts each, E experts, each token's k
    experts' weights gathered when T k < E (a decode step reads those anyway), else every
    expert on every token weighted by the routing (zero where not chosen: one read of each
    expert's weights). Long prefills take HF's module."""
    if not hasattr(block, "experts"):
        out: Tensor = block(h)
        return out
    r, n, hidden = h.shape
    tokens = r * n
    if tokens > MOE_GRAPH_TOKENS:
        out = block(h)
        return out
    flat = h.reshape(-1, hidden)
    _, weights, experts = block.gate(flat)  # [T, k] routing weights and expert ids
    e = block.experts
    if tokens * experts.shape[1] < e.gate_up_proj.shape[0]:
        act = torch.einsum("tkoh,th->tko", e.gate_up_proj[experts], flat)  # [T, k, 2I]
        g, u = act.chunk(2, dim=-1)
        down = torch.einsum("tkhi,tki->tkh", e.down_proj[experts], e.act_fn(g) * u)
        routed = (down * weights[..., None].to(down.dtype)).sum(dim=1)
    else:
        dense = torch.zeros(tokens, e.gate_up_proj.shape[0], dtype=weights.dtype, device=h.device)
        dense.scatter_(1, experts, weights)  # [T, E]: the routing weight, 0 where not chosen
        act = torch.einsum("eoh,th->teo", e.gate_up_proj, flat)  # [T, E, 2I]
        g, u = act.chunk(2, dim=-1)
        down = torch.einsum("ehi,tei->teh", e.down_proj, e.act_fn(g) * u)
        routed = (down * dense[..., None].to(down.dtype)).sum(dim=1)
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        gate = torch.sigmoid(block.shared_expert_gate(flat))
        routed = routed + gate * shared(flat)
    return routed.to(h.dtype).reshape(r, n, hidden)


# ---- Gated DeltaNet: the delta rule over one block of tokens from a given state ----


def delta_block(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gated delta rule over n tokens from `state` (the module docstring's derivation).

    q, k [R, nv, n, dk] (l2-normalised; q also scaled by dk^-1/2), v [R, nv, n, dv], g, beta
    [R, nv, n], state [R, nv, dk, dv], all fp32 -> (o [R, nv, n, dv], u [R, nv, n, dv],
    G [R, nv, n] the cumulative log decays, M [R, nv, n, n] the decay ratios gamma_t / gamma_i
    for i <= t, else 0)."""
    n = q.shape[-2]
    big_g = g.cumsum(dim=-1)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    ratio = (big_g[..., :, None] - big_g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    scaled = beta[..., None]
    rhs = scaled * v - (scaled * big_g.exp()[..., None]) * (k @ state)
    if n == 1:  # a decode step: nothing earlier in the block to solve against
        u = rhs
    else:
        a = (scaled * ratio * (k @ k.transpose(-1, -2))).tril(-1)
        eye = torch.eye(n, dtype=a.dtype, device=a.device)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    o = big_g.exp()[..., None] * (q @ state) + (ratio * (q @ k.transpose(-1, -2))) @ u
    return o, u, big_g, ratio


def recurrent_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> Tensor:
    """`delta_block` for one token, updating `state` in place -> o [R, nv, 1, dv]. Written
    as broadcasts and reductions so that inductor reads the state twice and writes it once
    (a matmul form reads it three times): at 128 slots of a 27B-shaped hybrid the states
    are ~19 GB, their traffic the step's largest after the weights."""
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [R, nv, d]
    if FUSED_STEP and delta_kernel.available(state):  # the state read once, written once
        o: Tensor = delta_kernel.delta_rule_step(q, k, v, g[:, :, 0].exp(), beta[:, :, 0], state)
        return o[:, :, None]
    decay = g[:, :, 0].exp()[..., None]  # [R, nv, 1]
    # S^T k and S^T q in one pass over the state: [R, nv, dv] each
    both = (state[:, :, None] * torch.stack([k, q], dim=2)[..., None]).sum(dim=-2)
    k_s, q_s = both[:, :, 0], both[:, :, 1]
    u = beta[:, :, 0, None] * (v - decay * k_s)
    state.copy_(decay[..., None] * state + k[..., None] * u[:, :, None])
    o = decay * q_s + (q * k).sum(-1, keepdim=True) * u  # q^T S' without reading S' again
    return o[:, :, None]


def state_after(
    state: Tensor, k: Tensor, u: Tensor, big_g: Tensor, ratio: Tensor, j: Tensor
) -> Tensor:
    """The delta rule's state after token j [R] (0-based, per row) of a `delta_block` call:
    gamma_j S_0 + sum_{i<=j} (gamma_j / gamma_i) k_i u_i^T -> [R, nv, dk, dv]."""
    r, nv, n, _ = k.shape
    at = j.view(r, 1, 1, 1).expand(r, nv, 1, n)
    weights = ratio.gather(2, at)  # [R, nv, 1, n]: row j of the ratios
    decay = big_g.gather(2, j.view(r, 1, 1).expand(r, nv, 1)).exp()  # [R, nv, 1]
    return decay[..., None] * state + (k * weights.transpose(-1, -2)).transpose(-1, -2) @ u


def _rule_inputs(m: Any, mixed: Tensor, b: Tensor, a: Tensor) -> tuple[Tensor, ...]:
    """The convolved q/k/v and the b / a projections -> the delta rule's fp32 inputs, heads
    first: q, k [R, nv, n, dk] (l2-normalised, q scaled), v [R, nv, n, dv], g, beta [R, nv, n]."""
    r, n, _ = mixed.shape
    q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = q.reshape(r, n, -1, m.head_k_dim).float()
    k = k.reshape(r, n, -1, m.head_k_dim).float()
    v = v.reshape(r, n, -1, m.head_v_dim).float()
    groups = v.shape[2] // q.shape[2]  # each key head serves `groups` consecutive value heads
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    # transformers' l2norm (eps inside the root, 1e-6), then the 1/sqrt(dk) query scale
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * m.head_k_dim**-0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    beta = b.sigmoid().float()  # in the model dtype first, as the module
    # in fp32 as the module does (in fp16, exp(A_log) could overflow)
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    heads = (t.transpose(1, 2) for t in (q, k, v, g, beta))
    return tuple(heads)


def _finish_linear(m: Any, o: Tensor, z: Tensor, dtype: torch.dtype) -> Tensor:
    """o [R, nv, n, dv] fp32, z [R, n, nv, dv] -> the gated norm and out_proj, [R, n, H]."""
    r, _, n, dv = o.shape
    o = o.transpose(1, 2).to(dtype)
    out = m.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(r, n, -1)
    result: Tensor = m.out_proj(out)
    return result


def _mixer_inputs(layer: Any, x: Tensor, conv: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """A Gated DeltaNet layer's norm, projections and causal convolution over x [R, n, H]
    after the kept inputs `conv` [R, C, K-1] -> (window [R, C, K-1+n]: those inputs and this
    call's, z [R, n, nv, dv], the delta rule's inputs q, k, v, g, beta (`_rule_inputs`))."""
    m = layer.linear_attn
    mixed, z, b, a = gated_delta_net_project(m, layer.input_layernorm(x))
    window = torch.cat([conv, mixed.transpose(1, 2).to(conv.dtype)], dim=-1)
    weight = m.conv1d.weight  # [C, 1, K]
    mixed = F.silu(F.conv1d(window.to(weight.dtype), weight, groups=weight.shape[0]))
    return window, z, _rule_inputs(m, mixed.transpose(1, 2).to(x.dtype), b, a)


def _mixer_output(layer: Any, x: Tensor, o: Tensor, z: Tensor) -> Tensor:
    """The delta rule's output o [R, nv, n, dv] -> the layer's output: gated norm, out_proj,
    residual, MLP."""
    x = x + _finish_linear(layer.linear_attn, o, z, x.dtype)
    return x + mlp(layer.mlp, layer.post_attention_layernorm(x))


def _conv_after(window: Tensor, last: Tensor, taps: int) -> Tensor:
    """The K-1 convolution inputs ending at token last [R] of a call: window [R, C, K-1+n]
    holds token t at K-1+t, so they are columns last+1 .. last+K-1."""
    r, c, _ = window.shape
    at = (last.view(r, 1, 1) + 1 + torch.arange(taps, device=last.device)).expand(r, c, taps)
    return window.gather(2, at)


def linear_step(
    layer: Any, x: Tensor, conv: Tensor, state: Tensor, pending: list[Tensor] | None = None
) -> Tensor:
    """A Gated DeltaNet decoder layer over the next tokens of every row from its kept `conv`
    [R, C, K-1] and `state` [R, nv, dk, dv] (graph-safe: static shapes, no host reads).

    pending None (a decode step, one token): `conv` / `state` advance in place. pending
    [window [R, C, K-1+n], k, u, G, M] (a verify of n tokens): the kept states stay as they
    are and this call writes what `commit` needs into those buffers."""
    window, z, (q, k, v, g, beta) = _mixer_inputs(layer, x, conv)
    if pending is None:
        assert x.shape[1] == 1, "more than one token per row is a verify: pass `pending`"
        o = recurrent_step(q, k, v, g, beta, state)
        conv.copy_(window[..., 1:])
    else:
        o, u, big_g, ratio = delta_block(q, k, v, g, beta, state)
        for buffer, value in zip(pending, (window, k, u, big_g, ratio), strict=True):
            buffer.copy_(value)
    return _mixer_output(layer, x, o, z)


def commit(conv: Tensor, state: Tensor, pending: list[Tensor], j: Tensor) -> None:
    """Keep the states after token j [R] of the last verify (`linear_step` with `pending`)."""
    window, k, u, big_g, ratio = pending
    state.copy_(state_after(state, k, u, big_g, ratio, j))
    conv.copy_(_conv_after(window, j, conv.shape[-1]))


def linear_prefill(
    layer: Any, x: Tensor, conv: Tensor, state: Tensor, lengths: Tensor, chunk: int = PREFILL_CHUNK
) -> tuple[Tensor, Tensor, Tensor]:
    """A Gated DeltaNet decoder layer over right-padded prompts x [R, n, H] (row r's real
    tokens: the first lengths[r]) from `conv` [R, C, K-1] and `state` [R, nv, dk, dv] ->
    (x out, the conv and delta-rule states after each row's last real token). Eager: the
    delta rule runs `chunk` tokens at a time; pad tokens leave the state unchanged."""
    window, z, (q, k, v, g, beta) = _mixer_inputs(layer, x, conv)
    r, n, _ = x.shape
    real = (torch.arange(n, device=x.device)[None] < lengths[:, None])[:, None]  # [R, 1, n]
    g, beta = g * real, beta * real  # pads: decay 1, no update
    outs = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        o, u, big_g, ratio = delta_block(q[..., s:e, :], k[..., s:e, :], v[..., s:e, :],
                                         g[..., s:e], beta[..., s:e], state)  # fmt: skip
        last = torch.full((r,), e - s - 1, dtype=torch.long, device=x.device)
        state = state_after(state, k[..., s:e, :], u, big_g, ratio, last)
        outs.append(o)
    conv = _conv_after(window, lengths - 1, conv.shape[-1])
    return _mixer_output(layer, x, torch.cat(outs, dim=2), z), conv, state
