"""The target's linear layers in FP8 against bf16, one GEMM at a time (CUDA, sm_89+).

    python bench/fp8_gemm.py                 # Qwen3-8B's and Qwen3.6-27B's decoder-layer shapes
    python bench/fp8_gemm.py --tokens 16384

For each linear layer shape of a decoder layer (q/k/v/o, gate/up/down; the 27B hybrid's
Gated DeltaNet projections too), `--tokens` rows: the bf16 `F.linear` against
`flashdraft.model.fp8.FP8Linear` (the per-token activation quantisation included), both
eager: compiled, the target forward fuses the quantisation into the kernels before it, so the
FP8 times here are an upper bound. Median times (CUDA events),
their ratio, and the whole layer's (summed over its shapes) as the target forward's expected
gain from FP8 before attention and the delta rule. A table, then one JSON line. Cheaper than
`bench/trainer.py --precision fp8` (no model, no drafter), and a proxy for it only.
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn

from flashdraft.benchutil import environment, measure, print_json, print_table
from flashdraft.model.fp8 import FP8Linear, fp8_refusal

# (name, in features, out features) per decoder layer
SHAPES = {
    "8b": [("q", 4096, 4096), ("k", 4096, 1024), ("v", 4096, 1024), ("o", 4096, 4096),
           ("gate", 4096, 12288), ("up", 4096, 12288), ("down", 12288, 4096)],
    "27b-hybrid linear": [("in_proj_qkv", 5120, 10240), ("in_proj_z", 5120, 6144),
                          ("out_proj", 6144, 5120), ("gate", 5120, 17408), ("up", 5120, 17408),
                          ("down", 17408, 5120)],
    "27b-hybrid full": [("q (+gate)", 5120, 12288), ("k", 5120, 1024), ("v", 5120, 1024),
                        ("o", 6144, 5120), ("gate", 5120, 17408), ("up", 5120, 17408),
                        ("down", 17408, 5120)],
}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cuda")
    refusal = fp8_refusal(device)
    if refusal is not None:
        raise SystemExit(f"fp8_gemm: {refusal}")
    x_all = torch.randn(args.tokens, 17408, device=device, dtype=torch.bfloat16)
    rows, layers = [], {}
    for layer, shapes in SHAPES.items():
        bf16_total = fp8_total = 0.0
        for name, k, n in shapes:
            linear = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
            fp8 = FP8Linear.from_linear(linear)
            x = x_all[:, :k].contiguous()
            with torch.no_grad():
                t_bf16, t_fp8 = (
                    measure(functools.partial(m, x), device, 3, args.iters).median_s * 1e3
                    for m in (linear, fp8)
                )
            flops = 2 * args.tokens * k * n
            rows.append({"layer": layer, "gemm": name, "K": k, "N": n,
                         "bf16 ms": round(t_bf16, 3), "fp8 ms": round(t_fp8, 3),
                         "bf16 TFLOP/s": round(flops / t_bf16 / 1e9, 1),
                         "fp8 TFLOP/s": round(flops / t_fp8 / 1e9, 1),
                         "speedup": round(t_bf16 / t_fp8, 3)})  # fmt: skip
            bf16_total, fp8_total = bf16_total + t_bf16, fp8_total + t_fp8
        layers[layer] = round(bf16_total / fp8_total, 3)
    print_table(rows, ["layer", "gemm", "K", "N", "bf16 ms", "fp8 ms", "bf16 TFLOP/s",
                       "fp8 TFLOP/s", "speedup"])  # fmt: skip
    print_json({"bench": "fp8-gemm", "tokens": args.tokens, "layer_speedup": layers,
                "rows": rows, **environment()})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
