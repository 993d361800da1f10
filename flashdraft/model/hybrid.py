"""Hybrid targets: Gated DeltaNet linear-attention layers, packed exactly (docs/design.md §3, trap 11).

Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`) and Qwen3-Next (`qwen3_next`) interleave linear
attention (Gated DeltaNet: a 4-tap causal convolution, then the gated delta rule, a recurrent
state of dk x dv per value head) with gated full attention, 3 to 1. An attention mask keeps
packed documents apart only in the full-attention layers: transformers gives the linear
layers no mask for a 4D document mask, so their convolution and recurrent state run straight
across document boundaries and every document after the first gets features the target
never produces when it serves. Here each linear layer restarts at every document start:

* "fla" (CUDA with flash-linear-attention): the layer runs once on the batch flattened to one
  sequence [1, R*T]; projections, gated norm and out_proj as one batch, the convolution and
  the chunked delta rule as fla's varlen kernels, which restart at every `cu_seqlens` entry.
* "per-document" (anywhere: the fallback): the layer's own forward is called once per
  document, exactly as for the document alone (bitwise equal in every dtype), at the price of
  one call per document per linear layer.

Either is installed on the module instances (an instance `forward`, so HF classes, weights,
hooks and FSDP stay untouched) and acts only inside `PackedLinearAttention.packed(...)`; every
other forward (start-up checks, decoding with a cache) is the model's own. The full-attention
layers keep flashdraft's document mask. Speculative decoding cannot crop a recurrent state:
`LinearStateRollback` restores it instead.

Shape legend: R rows, T tokens per row, N = R*T, S segments (documents and padding runs),
H hidden, C conv channels (2*nk*dk + nv*dv), nk/nv key/value heads, dk/dv their dims.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashdraft.model.config import text_config

LINEAR_ATTENTION = "linear_attention"
# Layer types for which transformers keeps a convolution or recurrent state instead of (or
# beside) K/V (cache_utils.DYNAMIC_LAYER_TYPE_MAPPING), plus the SSM names of Mamba hybrids.
RECURRENT_LAYER_TYPES = frozenset(
    {LINEAR_ATTENTION, "conv", "hybrid", "hybrid_sliding", "mamba", "mamba2", "recurrent"}
)
# Chunk length of the chunked gated delta rule (transformers' torch version and fla).
DELTA_RULE_CHUNK = 64
# fla-core first runs grouped value heads (nv > nk, all Qwen3.5 / Qwen3.6) in 0.5.0.
FLA_MIN_VERSION = (0, 5)


def layer_types(config: Any) -> list[str]:
    """The target's per-layer types (`full_attention` when the config lists none)."""
    text = text_config(config)
    types = getattr(text, "layer_types", None)
    return list(types) if types else ["full_attention"] * int(text.num_hidden_layers)


def linear_layer_ids(config: Any) -> list[int]:
    return [i for i, kind in enumerate(layer_types(config)) if kind == LINEAR_ATTENTION]


def is_hybrid(config: Any) -> bool:
    """Does any layer keep a recurrent or convolution state (packing needs more than a mask)?"""
    return any(kind in RECURRENT_LAYER_TYPES for kind in layer_types(config))


def conv_window(config: Any) -> int:
    """The first tokens of a packed document that a convolution state leaked across its start
    reaches directly: kernel size - 1 (3 for Qwen3.5 / Qwen3-Next); 0 for a dense target."""
    if not linear_layer_ids(config):
        return 0
    return int(getattr(text_config(config), "linear_conv_kernel_dim", 4)) - 1


def gated_delta_nets(layers: nn.ModuleList, config: Any) -> list[nn.Module]:
    """The linear-attention modules of a hybrid target's decoder layers; ValueError for
    recurrent layers flashdraft cannot pack exactly."""
    types = layer_types(config)
    unsupported = sorted({t for t in types if t in RECURRENT_LAYER_TYPES} - {LINEAR_ATTENTION})
    if unsupported:
        raise ValueError(
            f"target layer types {unsupported} keep a recurrent state that flashdraft cannot "
            "reset at packed document boundaries; supported hybrids are Gated DeltaNet "
            "targets (qwen3_5, qwen3_5_moe, qwen3_next)"
        )
    modules = []
    for i in linear_layer_ids(config):
        module = getattr(layers[i], "linear_attn", None)
        if module is None or not type(module).__name__.endswith("GatedDeltaNet"):
            raise ValueError(
                f"target layer {i} is a linear-attention layer but not a Gated DeltaNet "
                f"({type(module).__name__}); flashdraft packs only qwen3_5, qwen3_5_moe and "
                "qwen3_next hybrids exactly"
            )
        modules.append(module)
    return modules


# ---- where the documents of a packed batch start ----


@dataclass(frozen=True, slots=True)
class Segments:
    """Runs of one document id in each row of a packed batch (padding runs too), rows laid
    end to end: the cumulative bounds of the flattened [1, N] sequence, on the device (fla's
    `cu_seqlens`) and on the host (loops, fla's `cu_seqlens_cpu`)."""

    cu_seqlens: Tensor  # [S + 1] int64 on the device
    cu_seqlens_cpu: Tensor  # [S + 1] int64
    rows: int
    length: int

    @classmethod
    def of(cls, doc_ids: Tensor) -> Segments:
        """doc_ids [R, T] (-1 = padding) -> the segments; a row start always starts one."""
        rows, length = doc_ids.shape
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        # Host sync, once per packed forward: the bounds every linear layer needs.
        first = starts.flatten().nonzero().flatten().cpu()
        cu_cpu = torch.cat([first, torch.tensor([rows * length])])
        return cls(cu_cpu.to(doc_ids.device), cu_cpu, rows, length)

    def flat(self) -> list[tuple[int, int]]:
        """(start, end) of each segment in the flattened [1, N] sequence."""
        return list(itertools.pairwise(self.cu_seqlens_cpu.tolist()))

    def spans(self) -> Iterator[tuple[int, int, int]]:
        """(row, start, end) of each segment within its row."""
        for start, end in self.flat():
            row = start // self.length
            yield row, start - row * self.length, end - row * self.length


# ---- the layer on a flattened batch, with varlen kernels (fla on CUDA, torch reference) ----

ConvFn = Callable[[Tensor, Tensor, str, Segments], Tensor]
RuleFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Segments], Tensor]


@dataclass(frozen=True, slots=True)
class VarlenKernels:
    """conv(x [1, N, C], weight [C, K], activation, segments) -> [1, N, C];
    rule(q, k [1, N, nk, dk], v [1, N, nv, dv], g, beta [1, N, nv], segments) -> [1, N, nv, dv];
    both restart at every segment start (zero convolution history, zero recurrent state)."""

    name: str
    conv: ConvFn
    rule: RuleFn


def gated_delta_net_project(m: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A Gated DeltaNet module's input projections of x [R, n, H] -> (q/k/v before the
    convolution [R, n, C], z [R, n, nv, dv], b, a [R, n, nv]), for both layouts."""
    r, n, _ = x.shape
    if hasattr(m, "in_proj_qkv"):  # qwen3_5, qwen3_5_moe: separate projections
        mixed = m.in_proj_qkv(x)
        z = m.in_proj_z(x).reshape(r, n, -1, m.head_v_dim)
        b, a = m.in_proj_b(x), m.in_proj_a(x)
    else:  # qwen3_next: fused projections, grouped by key head
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
        mixed = torch.cat([t.reshape(r, n, -1) for t in (q, k, v)], dim=-1)
        z = z.reshape(r, n, -1, m.head_v_dim)
        b, a = b.reshape(r, n, -1), a.reshape(r, n, -1)
    return mixed, z, b, a


def gated_delta_net_varlen(
    module: nn.Module, x: Tensor, segments: Segments, kernels: VarlenKernels
) -> Tensor:
    """A Gated DeltaNet layer (transformers' qwen3_5 / qwen3_5_moe / qwen3_next modules) on
    x [1, N, H] holding several sequences -> [1, N, H]; the same steps as the module's forward
    without a cache, with the convolution and the delta rule per segment."""
    m: Any = module
    n = x.shape[1]
    mixed, z, b, a = gated_delta_net_project(m, x)
    if m.conv1d.bias is not None:
        raise ValueError("a Gated DeltaNet convolution with a bias is not supported")
    mixed = kernels.conv(mixed, m.conv1d.weight.squeeze(1), m.activation, segments)
    q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = q.reshape(1, n, -1, m.head_k_dim)
    k = k.reshape(1, n, -1, m.head_k_dim)
    v = v.reshape(1, n, -1, m.head_v_dim)
    beta = b.sigmoid()
    # In fp32 as the module does (in fp16, exp(A_log) could overflow).
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
    o = kernels.rule(q, k, v, g, beta, segments)
    o = m.norm(o.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(1, n, -1)
    out: Tensor = m.out_proj(o)
    return out


def _conv_reference(x: Tensor, weight: Tensor, activation: str, segments: Segments) -> Tensor:
    """transformers' torch causal convolution (depthwise, left zero padding), per segment."""
    taps = weight.shape[-1]
    outs = []
    for start, end in segments.flat():
        part = x[:, start:end].transpose(1, 2).to(weight.dtype)  # [1, C, L]
        y = F.conv1d(part, weight.unsqueeze(1), padding=taps - 1, groups=part.shape[1])
        outs.append(y[..., : end - start])
    y = torch.cat(outs, dim=-1)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    return y.transpose(1, 2).to(x.dtype)


def _rule_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Segments
) -> Tensor:
    """transformers' torch chunked gated delta rule, per segment, from a zero state."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    # Unwrapped: transformers decorates it to call fla's kernel instead whenever `fla` was
    # importable when its module was first imported (a real install, or a test's stand-in
    # then: that bound the stand-in for the whole process, and later tests failed in an
    # order that depended on which worker imported the module first).
    torch_chunk_gated_delta_rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    groups = v.shape[2] // q.shape[2]
    # Grouped value heads: each q/k head serves `groups` consecutive value heads (5.17 repeats
    # before its kernel, 5.24 inside it; repeating here suits both).
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    outs = []
    for s, e in segments.flat():
        o, _ = torch_chunk_gated_delta_rule(
            q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
            initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        outs.append(o)
    return torch.cat(outs, dim=1)


# A CPU twin of the fla kernels (same interface, transformers' torch arithmetic), so the
# varlen layer itself is tested without a GPU.
REFERENCE_KERNELS = VarlenKernels("torch reference", _conv_reference, _rule_reference)


def fla_kernels() -> tuple[VarlenKernels | None, str]:
    """fla's varlen causal convolution and chunked gated delta rule, or (None, why not)."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        return None, f"flash-linear-attention is not installed ({e.name} missing)"
    version = tuple(int(p) for p in fla.__version__.split(".")[:2] if p.isdigit())
    if version < FLA_MIN_VERSION:
        return None, f"fla {fla.__version__} has no grouped value heads (needs fla-core >= 0.5)"
    try:  # fla-core 0.6 moved it; 0.5 has it under fla.modules.convolution
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        from fla.modules.convolution import causal_conv1d

    def conv(x: Tensor, weight: Tensor, activation: str, segments: Segments) -> Tensor:
        y, _ = causal_conv1d(
            x, weight, None, activation=activation,
            cu_seqlens=segments.cu_seqlens, cu_seqlens_cpu=segments.cu_seqlens_cpu,
        )  # fmt: skip
        out: Tensor = y
        return out

    def rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seg: Segments) -> Tensor:
        o, _ = chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=seg.cu_seqlens, cu_seqlens_cpu=seg.cu_seqlens_cpu,
        )  # fmt: skip
        out: Tensor = o
        return out

    return VarlenKernels(f"fla {fla.__version__}", conv, rule), ""


def choose_kernels(device: torch.device) -> tuple[VarlenKernels | None, str]:
    """fla's varlen kernels on CUDA when they import; otherwise None (per-document) and why."""
    if device.type != "cuda":
        return None, f"no varlen linear-attention kernels on {device.type}"
    return fla_kernels()


# ---- installing the exact packed path on a target ----


class PackedLinearAttention:
    """Makes every Gated DeltaNet layer of a hybrid target restart at each document start
    while `packed(doc_ids)` is active. `kernels` None: each document runs through the
    layer's own forward (the fallback); otherwise the flattened varlen layer."""

    def __init__(self, layers: nn.ModuleList, config: Any, kernels: VarlenKernels | None) -> None:
        self.modules = gated_delta_nets(layers, config)
        self.kernels = kernels
        self.segments: Segments | None = None
        self._wrappers: list[Callable[..., Tensor]] = []
        for module in self.modules:
            # A later Target on the same model (benchmarks build several) replaces the wrapper
            # of an earlier one; anything else that overrode forward is refused.
            current = module.__dict__.get("forward")
            if current is not None and not hasattr(current, "unwrapped"):
                raise RuntimeError(f"{type(module).__name__}.forward is already overridden")
            original = current.unwrapped if current is not None else module.forward
            wrapper = self._wrap(module, original)
            module.forward = wrapper
            self._wrappers.append(wrapper)

    @property
    def path(self) -> str:
        return self.kernels.name if self.kernels is not None else "per-document"

    @contextmanager
    def packed(self, doc_ids: Tensor) -> Iterator[None]:
        """Inside: the linear layers keep the documents of doc_ids [R, T] apart."""
        self.segments = Segments.of(doc_ids)
        try:
            yield
        finally:
            self.segments = None

    def remove(self) -> None:
        for module, wrapper in zip(self.modules, self._wrappers, strict=True):
            if module.__dict__.get("forward") is wrapper:
                del module.forward
        self.modules, self._wrappers = [], []

    def _wrap(self, module: nn.Module, original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            segments = self.segments
            if segments is None:
                return original(hidden_states, *args, **kwargs)
            if args or kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
                raise RuntimeError("a packed forward runs without a cache")
            rows, length, hidden = hidden_states.shape
            if self.kernels is not None:
                flat = hidden_states.reshape(1, rows * length, hidden)  # varlen kernels want B = 1
                out = gated_delta_net_varlen(module, flat, segments, self.kernels)
                return out.reshape(rows, length, -1)
            # The packed row's 4D mask reaches these layers as None (transformers ignores it
            # there); each document runs exactly as alone.
            kwargs.pop("attention_mask", None)
            parts = [
                original(hidden_states[r : r + 1, s:e], **kwargs) for r, s, e in segments.spans()
            ]
            return torch.cat(parts, dim=1).reshape(rows, length, -1)

        forward.unwrapped = original  # type: ignore[attr-defined]
        return forward


def attention_masks(config: Any, mask: Any) -> dict[str, Any]:
    """The per-layer-type masks a hybrid model takes instead of one mask: the document mask
    for the attention layers, none for the linear layers (they are kept apart by
    `PackedLinearAttention`; transformers would call `.ndim` on a flex BlockMask there)."""
    return {kind: None if kind == LINEAR_ATTENTION else mask for kind in set(layer_types(config))}


# ---- FLOPs ----


def delta_rule_flops_per_token(config: Any) -> float:
    """Forward FLOPs per token of the gated delta rule over all linear layers, beyond the
    parameter matmuls (counted as 2 x parameters by the caller). Per value head (q/k are
    shared across a group, g and beta are per value head), chunk C, state dk x dv:
    (1) the state: v_new = u - W S, o += (Q e^g) S, S <- e^g S + K^T v_new, three products
        of a [C, dk] or [C, dv] block with the state per chunk: 6 dk dv per token;
    (2) the intra-chunk products beta K K^T and Q K^T, lower triangles: 2 x C dk per token;
    (3) the UT transform's triangular solves applied to beta V and beta K e^g: C (dk + dv);
    (4) o_intra = A_qk v_new, lower triangle: C dv.
    Total 6 dk dv + C (3 dk + 2 dv) per value head and linear layer (Qwen3.5-27B: 6.7 MFLOP
    per linear layer, 0.32 GFLOP over its 48, 0.7% of the forward)."""
    text = text_config(config)
    ids = linear_layer_ids(config)
    if not ids:
        return 0.0
    nv, dk, dv = text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim
    per_head = 6 * dk * dv + DELTA_RULE_CHUNK * (3 * dk + 2 * dv)
    return float(len(ids) * nv * per_head)


# ---- speculative decoding: undoing a verify forward in a hybrid cache ----


def decode_cache(model: nn.Module) -> Any:
    """A cache for decoding: a plain `DynamicCache` (full K/V layers, croppable) for dense
    targets; one built from the config for hybrids, whose linear layers hold conv and
    recurrent states."""
    from transformers import DynamicCache

    config: Any = model.config
    if is_hybrid(config):
        return DynamicCache(config=config)
    return DynamicCache()


def _is_linear(layer: Any) -> bool:
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


def _token_count(layer: Any) -> Tensor | None:
    """A copy of a linear cache layer's token count (transformers >= 5.25), else None."""
    count = getattr(layer, "cumulative_length_linear", None)
    return count.clone() if isinstance(count, Tensor) else None


class LinearStateRollback:
    """Take back the last `n` tokens of a hybrid target's cache.

    K/V layers crop; a recurrent state cannot (it has absorbed every token). `save()` copies
    the linear layers' states before a verify forward; `rewind(saved, n)` puts them back and
    crops the K/V layers by the n verified tokens, so that re-feeding the accepted tokens
    continues from exactly where the target was (transformers 5.17 and 5.2x layouts). From
    transformers 5.25 a linear layer also counts its tokens (`cumulative_length_linear`,
    which the cache's `get_seq_length` reads): saved and put back with the states."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def save(self) -> list[tuple[dict[int, Tensor | None], dict[int, Tensor | None], Any]]:
        def copy(states: dict[int, Tensor | None]) -> dict[int, Tensor | None]:
            return {k: None if t is None else t.clone() for k, t in states.items()}

        return [
            (copy(layer.conv_states), copy(layer.recurrent_states), _token_count(layer))
            for layer in self.cache.layers
            if _is_linear(layer)
        ]

    def rewind(self, saved: list[Any], tokens: int) -> None:
        linear = [layer for layer in self.cache.layers if _is_linear(layer)]
        assert len(linear) == len(saved), "rewind with the states of another cache"
        for layer, (conv, recurrent, count) in zip(linear, saved, strict=True):
            if hasattr(layer, "keys"):
                raise NotImplementedError("cache layers with both K/V and a recurrent state")
            for live, old in ((layer.conv_states, conv), (layer.recurrent_states, recurrent)):
                for k, t in old.items():
                    current = live[k]
                    if current is not None and t is not None and current.shape == t.shape:
                        current.copy_(t)  # in place: cached tensors keep their address
                    else:
                        live[k] = t
            if count is not None:  # in place too: a static address for dynamo
                layer.cumulative_length_linear.copy_(count)
        for layer in self.cache.layers:
            if not _is_linear(layer):
                layer.crop(-tokens)
