"""The optimizer of a run: AdamW from the run config, and the guard around its step that
keeps a non-finite loss or gradient from ever reaching the weights."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flashdraft.train.config import OptimSection
from flashdraft.train.parallel import Placement, dp_all_reduce_min


def build_optimizer(
    drafter: nn.Module, optim: OptimSection, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW over the drafter's fp32 master weights; the fused kernel on CUDA."""
    return torch.optim.AdamW(
        drafter.parameters(),
        lr=optim.lr,
        betas=(optim.betas[0], optim.betas[1]),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=device.type == "cuda",
    )


class FiniteGuard:
    """A non-finite loss or gradient norm, caught on the device, with no host sync per step.

    `observe` folds each step into a sticky device flag. The fused AdamW (CUDA) reads that
    flag as its `found_inf`, the mechanism `torch.amp.GradScaler` uses: while it is 1 the
    kernel leaves weights and moments alone and takes back its step count, so from the first
    bad step on nothing changes. The foreach AdamW (CPU) has no such input; there reading the
    flag on the host costs nothing, and the step is skipped in Python. The loop reads the flag
    (`first_bad_step`) only where it syncs anyway: at every log point, which precedes every
    eval, checkpoint and export, so none of them ever holds non-finite weights.
    """

    NEVER = 2**62

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, start: int) -> None:
        self.optimizer, self.start = optimizer, start
        self.tripped = torch.zeros((), dtype=torch.float32, device=device)  # 1.0 once bad
        self.clean_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.fused = bool(optimizer.defaults.get("fused"))
        if self.fused:
            optimizer.found_inf = self.tripped  # type: ignore[attr-defined]

    def observe(self, loss: Tensor, grad_norm: Tensor) -> None:
        bad = torch.logical_not(torch.isfinite(loss) & torch.isfinite(grad_norm))
        torch.maximum(self.tripped, bad.float(), out=self.tripped)
        self.clean_steps += self.tripped == 0

    def step(self) -> None:
        """The optimizer step, skipped once the flag is up."""
        # Unfused, the flag is read on the host: the foreach path runs on the CPU (no sync).
        if self.fused or not bool(self.tripped):
            self.optimizer.step()

    def first_bad_step(self, placement: Placement) -> int | None:
        """The first step with a non-finite loss or gradient on any drafter replica, or None.
        A collective over the replicas, and a host sync."""
        first = torch.where(self.tripped > 0, self.clean_steps + self.start + 1, self.NEVER)
        step = int(dp_all_reduce_min(first.reshape(1), placement))  # sync
        return None if step == self.NEVER else step
