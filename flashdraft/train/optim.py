"""The optimizer of a run: AdamW, or Muon with AdamW, from the run config, and the guard
around its step that keeps a non-finite loss or gradient from ever reaching the weights."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from flashdraft.train.config import OptimSection
from flashdraft.train.parallel import Placement, dp_all_reduce_min


class Optimizers:
    """Several torch optimizers over disjoint parameters, stepped as one: what the trainer,
    the guard and the checkpoint see when `optim.optimizer = "muon"`. Iterating gives the
    optimizers (torch.distributed.checkpoint's state-dict helpers take an iterable of them);
    `param_groups` are the optimizers' own group dicts, so setting a group's lr sets it."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self.defaults: dict[str, Any] = {}  # not fused: the guard checks its flag on the host

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def muon_split(drafter: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(2-D weight matrices, the rest) of the drafter's trainable parameters. The token
    embedding and LM head are the target's, frozen, so every trainable matrix is a projection
    inside the drafter (the context projection, attention, MLP): Muon's domain. Vectors and
    degenerate [1, N] matrices go to AdamW."""
    matrices: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for param in drafter.parameters():
        if param.requires_grad:
            (matrices if param.ndim == 2 and min(param.shape) > 1 else rest).append(param)
    return matrices, rest


def build_optimizer(
    drafter: nn.Module, optim: OptimSection, device: torch.device
) -> torch.optim.Optimizer | Optimizers:
    """AdamW over the drafter's fp32 master weights (the fused kernel on CUDA); with
    `optim.optimizer = "muon"`, torch's Muon on the weight matrices (lr scaled to match
    AdamW's update RMS) and AdamW on the rest, as one `Optimizers`."""
    adamw: dict[str, Any] = dict(
        lr=optim.lr,
        betas=(optim.betas[0], optim.betas[1]),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        fused=device.type == "cuda",
    )
    if optim.optimizer == "adamw":
        return torch.optim.AdamW(drafter.parameters(), **adamw)
    matrices, rest = muon_split(drafter)
    muon = torch.optim.Muon(
        matrices,
        lr=optim.lr,
        momentum=optim.muon_momentum,
        weight_decay=optim.muon_weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    return Optimizers([muon, *([torch.optim.AdamW(rest, **adamw)] if rest else [])])


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

    def __init__(
        self, optimizer: torch.optim.Optimizer | Optimizers, device: torch.device, start: int
    ) -> None:
        self.optimizer, self.start = optimizer, start
        self.tripped = torch.zeros((), dtype=torch.float32, device=device)  # 1.0 once bad
        self.clean_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.fused = bool(optimizer.defaults.get("fused"))
        if self.fused:
            optimizer.found_inf = self.tripped  # type: ignore[union-attr]

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
