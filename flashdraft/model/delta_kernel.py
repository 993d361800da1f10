"""One decode step of the gated delta rule as one Triton kernel (CUDA), for the static decoder
of hybrid targets (`flashdraft.model.static_hybrid.recurrent_step`).

At 128 slots of a Qwen3.6-27B-shaped hybrid the 48 linear layers keep ~19 GB of fp32 states,
which every decode step must read and write: after the weights (~54 GB) the step's largest
traffic. Written with torch ops the step needs the state twice (S^T k before the update, then
the update itself); here each program holds one value-column block of one head's state in
registers, so the state is read once and written once:

    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q

The value columns of the delta rule are independent (every operation above acts on each
column of S alone), so the grid is (rows x value heads, dv / BLOCK_V).

Registered as a torch custom op (`torch.library.triton_op`), so it compiles inside the
static decoder's compiled parts and is captured in its CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU machine: the torch path runs
    triton = None

BLOCK_V = 32  # value columns per program: a [dk, 32] fp32 tile (16 KB at dk = 128)


def available(state: Tensor) -> bool:
    """Whether the kernel can run on this state (CUDA, Triton importable, fp32, dk a power
    of two as Triton's `arange` needs, dv a multiple of BLOCK_V)."""
    dk, dv = state.shape[-2:]
    return (
        triton is not None
        and state.is_cuda
        and state.dtype == torch.float32
        and dk & (dk - 1) == 0
        and dv % BLOCK_V == 0
    )


if triton is not None:

    @triton.jit
    def _delta_step(
        state_ptr, q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, o_ptr,
        DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    ):  # fmt: skip
        head = tl.program_id(0)  # row * nv + value head
        block = tl.program_id(1)
        dk = tl.arange(0, DK)
        dv = block * BV + tl.arange(0, BV)
        tile = state_ptr + head * DK * DV + dk[:, None] * DV + dv[None, :]
        s = tl.load(tile)  # [DK, BV]
        q = tl.load(q_ptr + head * DK + dk)
        k = tl.load(k_ptr + head * DK + dk)
        v = tl.load(v_ptr + head * DV + dv)
        s = s * tl.load(decay_ptr + head)
        u = tl.load(beta_ptr + head) * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * u[None, :]
        tl.store(tile, s)
        tl.store(o_ptr + head * DV + dv, tl.sum(s * q[:, None], axis=0))

    @torch.library.triton_op("flashdraft::delta_rule_step", mutates_args={"state"})
    def delta_rule_step(
        q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor, state: Tensor
    ) -> Tensor:
        """q, k [R, nv, dk] (normalised; q scaled), v [R, nv, dv], decay (exp g), beta
        [R, nv], state [R, nv, dk, dv]; all fp32 -> o [R, nv, dv]; `state` updated in place."""
        r, nv, dk, dv = state.shape
        o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        grid = (r * nv, dv // BLOCK_V)
        torch.library.wrap_triton(_delta_step)[grid](
            state, q.contiguous(), k.contiguous(), v.contiguous(), decay.contiguous(),
            beta.contiguous(), o, DK=dk, DV=dv, BV=BLOCK_V,
        )  # fmt: skip
        return o
