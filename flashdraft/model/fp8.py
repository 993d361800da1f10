"""The frozen target's linear layers in FP8 (`target.precision = "fp8"`, eval and generate
`--precision fp8`): the target as an FP8 server runs it, for taps and labels, acceptance
measured against it, and on Hopper faster than bf16.

The scheme is the "FP8 dynamic" one of served checkpoints: weights quantised once to
float8_e4m3fn with one fp32 scale per output channel (a row of W), activations quantised at
every call with one scale per token (a row of x); y = (x_q W_q^T) s_x s_w, the products of
FP8 values accumulated in fp32, the result in the compute dtype. A scale is amax / 448 (the
largest e4m3 value), so each row uses the whole FP8 range. Per token, never per tensor: a
token's quantisation then depends on that token alone, so the packed documents of a row stay
as independent as in bf16 (the hybrid packing check, `Target.verify_packing`) and a verify
forward of B tokens quantises each as decoding them one at a time would.

On CUDA with FP8 tensor cores (sm_89+) the product is one `torch._scaled_mm` with row-wise
scales; on the CPU it is emulated, exactly as defined above (the FP8 values widened to fp32,
multiplied, scaled, cast), so the CPU tests run the same quantisation.

Converted: every `nn.Linear` inside the decoder layers whose two dimensions are multiples of
16 (`_scaled_mm`'s constraint), except the hybrid layers' decay / write-strength projections
(`KEEP`). Kept in the target dtype: the embedding and the LM head (it produces the labels),
MoE routers and fused experts (not `nn.Linear`), everything outside the decoder layers.

Also here, experimental (`bench/trainer.py --drafter-fp8`): `fp8_products`, a trained
layer's forward and backward products in FP8 with fp32 master weights (the drafter's step).

Shape legend: M tokens (rows of x), K input features, N output features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from flashdraft.log import get_logger

log = get_logger(__name__)

Precision = Literal["bf16", "fp8"]
PRECISIONS: tuple[str, ...] = ("bf16", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# An all-zero row gets this amax: its scale stays positive and its values quantise to 0.
AMAX_FLOOR = 1e-12
# Hybrid targets' gate projections into the gated delta rule: the per-head decay (a) and
# write strength (b). Their outputs (one per value head) act on the recurrent state at every
# token, so their error compounds along a document, and they are a negligible share of the
# FLOPs (48 outputs of 5120 inputs in Qwen3.6-27B).
KEEP = ("in_proj_a", "in_proj_b", "in_proj_ba")


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, 1]): one scale per row, amax / 448,
    rounded to nearest (even) by the cast; row-major whatever x's strides (`_scaled_mm`)."""
    wide = x.float().contiguous()
    scale = wide.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    return (wide / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


# Eager CUDA callers (hybrid targets, the decode loops) quantise through one fused kernel:
# the ops above, run one by one, pass over x in fp32 five times, more than the FP8 GEMM saves.
# dynamic=True: one graph for every M and K. Inside an already compiled forward the plain
# function is traced into that graph instead (`_quantizer`).
_quantize_rows_fused = torch.compile(quantize_rows, dynamic=True)


def emulated_scaled_mm(
    xq: Tensor, wq: Tensor, x_scale: Tensor, w_scale: Tensor, dtype: torch.dtype
) -> Tensor:
    """What `torch._scaled_mm` computes, on any device: xq [M, K] and wq [N, K] FP8, scales
    [M, 1] and [N] fp32 -> [M, N] in `dtype`. Products of e4m3 values are exact in fp32; the
    sums are fp32 as on the tensor cores (only their order differs)."""
    return ((xq.float() @ wq.float().t()) * x_scale * w_scale).to(dtype)


def scaled_mm(
    aq: Tensor, a_scale: Tensor, bq: Tensor, b_scale: Tensor, dtype: torch.dtype
) -> Tensor:
    """aq [M, K] @ bq [N, K]^T -> [M, N] in `dtype`, both FP8 and row-major with per-row
    scales ([M, 1], [N, 1] or [N]): `torch._scaled_mm` on CUDA (bq transposed to the
    column-major operand it wants), emulated elsewhere."""
    if aq.is_cuda:
        return torch._scaled_mm(
            aq, bq.t(), scale_a=a_scale, scale_b=b_scale.reshape(1, -1), out_dtype=dtype
        )
    return emulated_scaled_mm(aq, bq, a_scale, b_scale.reshape(-1), dtype)


def _quantizer(x: Tensor) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """`quantize_rows` as traced into a compiled graph, or its one fused kernel for eager
    CUDA callers."""
    if x.is_cuda and not torch.compiler.is_compiling():
        return _quantize_rows_fused
    return quantize_rows


class FP8Linear(nn.Module):
    """An `nn.Linear` of the frozen target in FP8: weight [N, K] float8_e4m3fn, `weight_scale`
    [N] fp32 (per output channel), activations quantised per token at every call. Not a
    subclass of `nn.Linear` on purpose: code that reads a Linear's weight as a matrix in the
    compute dtype (`static_layers.fusable`, which concatenates q/k/v) must not take it for
    one. Frozen: no gradient flows through it."""

    weight_scale: Tensor  # [N] fp32, a buffer

    def __init__(self, weight: Tensor, weight_scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        assert weight.dtype == FP8 and weight_scale.shape == weight.shape[:1]
        self.out_features, self.in_features = weight.shape
        # A parameter (frozen) so that parameter counts (FLOPs) see it; the scale a buffer.
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        """The FP8 version of `linear`; its weight is read, never written."""
        weight, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale[:, 0], bias)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        xq, x_scale = _quantizer(rows)(rows)
        out = scaled_mm(xq, x_scale, self.weight, self.weight_scale, x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, float8_e4m3fn, per-channel weight scales, "
            "per-token activation scales"
        )


def concat_fp8(parts: list[FP8Linear]) -> FP8Linear:
    """One FP8Linear for several that read the same input (q/k/v, gate/up): their weights
    and per-channel scales stacked. Exact: a per-token scale depends on the input alone and
    each output channel keeps its own scale, so the output is the parts' side by side, from
    one quantisation of the input and one GEMM (what a fused static decode step wants)."""
    biases = [p.bias for p in parts]
    if len({b is None for b in biases}) != 1:
        raise ValueError("concat_fp8: biases on all parts or on none")
    return FP8Linear(
        torch.cat([p.weight.detach() for p in parts]),
        torch.cat([p.weight_scale for p in parts]),
        None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None]),
    )


def convertible(name: str, module: nn.Module) -> bool:
    """Whether a module of a decoder layer (`name` relative to the layer) runs in FP8."""
    if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] in KEEP:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def fp8_linear_names(layers: nn.ModuleList) -> list[str]:
    """The linear layers `quantize_linears` converts, named relative to the layer list."""
    return [
        f"{i}.{name}"
        for i, layer in enumerate(layers)
        for name, module in layer.named_modules()
        if convertible(name, module)
    ]


def fp8_weight_count(layers: nn.ModuleList) -> int:
    """Elements of the weights `quantize_linears` converts (memory plans: 1 byte each)."""
    total = 0
    for name in fp8_linear_names(layers):
        module = layers.get_submodule(name)
        assert isinstance(module, nn.Linear)
        total += module.weight.numel()
    return total


def quantize_linears(layers: nn.ModuleList) -> int:
    """Replace the convertible linear layers of `layers` by `FP8Linear`s, in place, one at a
    time (each bf16 weight is freed as its FP8 copy is made, when nothing else holds it).
    Returns how many were converted; already converted ones are skipped (idempotent)."""
    count = 0
    for name in fp8_linear_names(layers):
        parent_name, _, child = name.rpartition(".")
        parent = layers.get_submodule(parent_name)
        setattr(parent, child, FP8Linear.from_linear(getattr(parent, child)))
        count += 1
    return count


def fp8_refusal(device: torch.device) -> str | None:
    """Why this device cannot run the FP8 target (None: it can; the CPU emulates it)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"no FP8 path on {device.type} (CUDA sm_89+, or the CPU's emulation)"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) < (8, 9):
        return f"{name} (sm_{major}{minor}) has no FP8 tensor cores (Ada, Hopper or newer: sm_89+)"
    try:  # row-wise scales need a recent torch and cuBLASLt; a 16 x 16 product says
        probe = torch.ones(16, 16, device=device, dtype=FP8)
        rows, columns = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
        torch._scaled_mm(probe, probe.t(), scale_a=rows, scale_b=columns, out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError) as err:  # newer torch raises ValueError for some checks
        said = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"torch {torch.__version__}'s _scaled_mm refuses row-wise scales on {name}: {said}"
    return None


def apply_precision(model: nn.Module, precision: str, layers: nn.ModuleList) -> int:
    """Run the target's `layers` (its decoder layers) in `precision`: "bf16" leaves the model
    as loaded (its linear layers in its dtype); "fp8" converts them (`quantize_linears`).
    ValueError, one line, where this device or dtype cannot. Returns how many were converted."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if precision == "bf16":
        return 0
    first = next(p for p in layers.parameters() if p.dtype != FP8)
    device, dtype = first.device, first.dtype
    why = fp8_refusal(device)
    if why is None and device.type == "cuda" and dtype != torch.bfloat16:
        why = f"on CUDA the target runs FP8 with dtype bfloat16 (auto), not {dtype}"
    if why is not None:
        raise ValueError(f"precision 'fp8': {why}; use precision 'bf16' here")
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    count = quantize_linears(layers)
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    if not count and precision_of(layers) != "fp8":
        log.warning(
            "precision 'fp8': the decoder layers have no nn.Linear to convert (a checkpoint "
            "quantised already?); the target runs as loaded"
        )
    if count:
        how = "emulated on the CPU" if device.type == "cpu" else "torch._scaled_mm"
        log.info(
            f"target in FP8: {count} linear layers (e4m3, per-channel weight and per-token "
            f"activation scales, {how}); weights {before / 2**30:.2f} -> {after / 2**30:.2f} GiB"
        )
    return count


def precision_of(model: nn.Module) -> str:
    """ "fp8" when any of the model's linear layers is an `FP8Linear`, else "bf16" (the
    linear layers in the model's dtype), for reports and recorded configs."""
    return "fp8" if any(isinstance(m, FP8Linear) for m in model.modules()) else "bf16"


# ---- FP8 products of a trained layer (the drafter's; `bench/trainer.py --drafter-fp8`) ----


class _FP8Product(torch.autograd.Function):
    """x [M, K] @ weight [N, K]^T with e4m3 operands in the forward and in both products of
    the backward, each operand scaled per row along its contraction (the row-wise recipe of
    FP8 training): y = x W^T (x per token, W per output channel), grad_x = g W (g per token,
    W per input channel), grad_W = g^T x (g and x per feature, over the tokens). The
    weight stays in its own dtype (fp32 master weights) and is quantised at every call."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.dtype = dtype
        quantize = _quantizer(x)
        return scaled_mm(*quantize(x), *quantize(weight), dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        quantize = _quantizer(grad)
        grad = grad.contiguous()
        grad_x = scaled_mm(*quantize(grad), *quantize(weight.t().contiguous()), ctx.dtype)
        grad_w = scaled_mm(
            *quantize(grad.t().contiguous()), *quantize(x.t().contiguous()), ctx.dtype
        )
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


class FP8TrainedLinear(nn.Linear):
    """An `nn.Linear` whose three products run in FP8 (`_FP8Product`): the same parameters,
    names and state dict, so checkpoints and exports do not change. Made by swapping the
    class of an existing Linear (`fp8_products`). Rows (tokens) not a multiple of 16, which
    the weight gradient's product cannot take, fall back to the plain Linear. Output in
    bf16 on CUDA (as under autocast), else in the input's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] % 16:
            return super().forward(x)
        dtype = torch.bfloat16 if x.is_cuda else x.dtype
        out = _FP8Product.apply(rows, self.weight, dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)


def fp8_products(module: nn.Module) -> int:
    """Every `nn.Linear` inside `module` with both dimensions multiples of 16 runs its
    products in FP8 from now on (`FP8TrainedLinear`, its class swapped in place: parameters,
    optimizer state and hooks stay); how many. Experimental: kept only where a bench shows
    it pays and tau holds (issue 74)."""
    count = 0
    for child in module.modules():
        if (
            type(child) is nn.Linear
            and child.in_features % 16 == 0
            and child.out_features % 16 == 0
        ):
            child.__class__ = FP8TrainedLinear
            count += 1
    return count
