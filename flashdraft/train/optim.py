"""The optimizer of a run: AdamW, or Muon with AdamW, from the run config, and the guard
around its step that keeps a non-finite loss or gradient from ever reaching the weights.

Shape legend: n matrices of one shape, r x c each."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn

from flashdraft.train.config import OptimSection
from flashdraft.train.parallel import Placement, dp_all_reduce_min

# torch.optim.Muon's defaults (Keller Jordan's quintic Newton-Schulz coefficients).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def orthogonalise(update: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    """[n, r, c] -> bf16 [n, r, c]: each matrix pushed towards the nearest semi-orthogonal
    one (U S' V^T with S' ~ 1) by the quintic Newton-Schulz iteration X <- aX + (bA + cA^2)X,
    A = X X^T, on the short side, in bf16, after scaling each matrix to Frobenius norm 1 (so
    its spectral norm is at most 1). torch.optim.Muon's iteration, batched over n."""
    a, b, c = coefficients
    x = update.bfloat16()
    wide = x.shape[-2] > x.shape[-1]
    if wide:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if wide else x


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weight matrices: Nesterov momentum, orthogonalised (`orthogonalise`), the
    step scaled to AdamW's update RMS (0.2 sqrt(max(r, c)), Moonshot's "match_rms_adamw") and
    decoupled weight decay: torch.optim.Muon's update (the tests hold the two together) with
    two differences that matter on a GPU. The matrices of one shape are orthogonalised as one
    batch (a 3-layer drafter's 22 matrices are 5 shapes: ~100 kernels a step instead of
    ~550). And it reads GradScaler's `found_inf` (a 0-d device flag, set by `FiniteGuard`)
    on the device, as the fused AdamW does: at 1 the step leaves weights and momenta exactly
    as they were, so a guarded step needs no host sync. (torch's Muon has neither: the
    SmolLM2 runs with it took 67 ms a step against AdamW's 32, per-matrix kernels and a host
    read of the flag every step together; the two were not measured apart.)"""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        lr: float,
        momentum: float = 0.95,
        weight_decay: float = 0.1,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = NS_STEPS,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            ns_steps=ns_steps,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices, got a {tuple(param.shape)} tensor")
        self.found_inf: Tensor | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "Muon takes no closure"
        keep = None if self.found_inf is None else 1.0 - self.found_inf  # 0-d, 0 or 1
        for group in self.param_groups:
            by_shape: dict[tuple[int, ...], list[Tensor]] = {}
            for param in group["params"]:
                if param.grad is not None:
                    by_shape.setdefault(tuple(param.shape), []).append(param)
            for params in by_shape.values():
                self._step_shape(group, params, keep)

    def _step_shape(self, group: dict[str, Any], params: list[Tensor], keep: Tensor | None) -> None:
        bufs = []
        for param in params:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            bufs.append(state["momentum_buffer"])
        grad = torch.stack([cast(Tensor, p.grad) for p in params])  # [n, r, c]; all have one
        buf = torch.stack(bufs)
        if keep is not None:
            # A skipped step moves the momentum towards itself (exactly no change) and keeps
            # every later value finite, so multiplying the weights' change by keep = 0 below
            # is exact (a non-finite gradient times 0 would not be).
            grad = torch.where(keep > 0, grad, buf)
        momentum = group["momentum"]
        buf.lerp_(grad, 1.0 - momentum)
        torch._foreach_copy_(bufs, list(buf.unbind(0)))
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        ortho = orthogonalise(update, group["ns_coefficients"], group["ns_steps"])
        lr, decay = group["lr"], group["weight_decay"]
        rows, cols = params[0].shape
        scale = -lr * 0.2 * math.sqrt(max(rows, cols))  # match_rms_adamw
        step = ortho.float()
        if keep is None:
            torch._foreach_mul_(params, 1.0 - lr * decay)
            step.mul_(scale)
        else:
            torch._foreach_mul_(params, 1.0 - keep * (lr * decay))
            step.mul_(keep * scale)
        torch._foreach_add_(params, list(step.unbind(0)))


def members(optimizer: torch.optim.Optimizer | Optimizers) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind `optimizer`: itself, or an `Optimizers`' members."""
    return list(optimizer) if isinstance(optimizer, Optimizers) else [optimizer]


def reads_found_inf(optimizer: torch.optim.Optimizer | Optimizers) -> bool:
    """Whether the optimizer skips a step by GradScaler's `found_inf` flag on the device: the
    fused Adam(W) kernels and flashdraft's Muon do; `Optimizers` when all its members do."""
    return all(
        isinstance(one, Muon) or bool(one.defaults.get("fused")) for one in members(optimizer)
    )


class Optimizers:
    """Several torch optimizers over disjoint parameters, stepped as one: what the trainer,
    the guard and the checkpoint see when `optim.optimizer = "muon"`. Iterating gives the
    optimizers (torch.distributed.checkpoint's state-dict helpers take an iterable of them);
    `param_groups` are the optimizers' own group dicts, so setting a group's lr sets it."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

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
    `optim.optimizer = "muon"`, flashdraft's `Muon` on the weight matrices (lr scaled to
    match AdamW's update RMS) and AdamW on the rest, as one `Optimizers`."""
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
    muon = Muon(
        matrices, lr=optim.lr, momentum=optim.muon_momentum, weight_decay=optim.muon_weight_decay
    )
    return Optimizers([muon, *([torch.optim.AdamW(rest, **adamw)] if rest else [])])


class FiniteGuard:
    """A non-finite loss or gradient norm, caught on the device, with no host sync per step.

    `observe` folds each step into a sticky device flag. The fused AdamW (CUDA) and
    flashdraft's `Muon` read that flag as their `found_inf`, the mechanism
    `torch.amp.GradScaler` uses: while it is 1 they leave weights and moments alone (AdamW
    takes back its step count), so from the first bad step on nothing changes. The foreach
    AdamW (CPU) has no such input; there reading the flag on the host costs nothing, and the
    step is skipped in Python. The loop reads the flag
    (`first_bad_step`) only where it syncs anyway: at every log point, which precedes every
    eval, checkpoint and export, so none of them ever holds non-finite weights.

    A step with nothing to train (`empty`: its global loss normaliser is 0) is skipped the
    same way, for that step only and without tripping the flag: its gradient is 0, and an
    optimizer step would still move the weights along the momentum.
    """

    NEVER = 2**62

    def __init__(
        self, optimizer: torch.optim.Optimizer | Optimizers, device: torch.device, start: int
    ) -> None:
        self.optimizer, self.start = optimizer, start
        self.tripped = torch.zeros((), dtype=torch.float32, device=device)  # 1.0 once bad
        self.skip = torch.zeros((), dtype=torch.float32, device=device)  # this step: 1.0 = skip
        self.clean_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.fused = reads_found_inf(optimizer)
        if self.fused:
            for member in members(optimizer):
                member.found_inf = self.skip  # type: ignore[attr-defined]

    def observe(self, loss: Tensor, grad_norm: Tensor, empty: Tensor | None = None) -> None:
        """Fold this step in: `loss` and `grad_norm` finite or not, `empty` (0-d bool) whether
        the step had nothing to train."""
        bad = torch.logical_not(torch.isfinite(loss) & torch.isfinite(grad_norm))
        torch.maximum(self.tripped, bad.float(), out=self.tripped)
        self.clean_steps += self.tripped == 0
        if empty is None:
            self.skip.copy_(self.tripped)
        else:
            torch.maximum(self.tripped, empty.float(), out=self.skip)

    def step(self) -> None:
        """The optimizer step, skipped once the flag is up or when the step was empty."""
        # Unfused, the flag is read on the host: the foreach path runs on the CPU (no sync).
        if self.fused or not bool(self.skip):
            self.optimizer.step()

    def first_bad_step(self, placement: Placement) -> int | None:
        """The first step with a non-finite loss or gradient on any drafter replica, or None.
        A collective over the replicas, and a host sync."""
        first = torch.where(self.tripped > 0, self.clean_steps + self.start + 1, self.NEVER)
        step = int(dp_all_reduce_min(first.reshape(1), placement))  # sync
        return None if step == self.NEVER else step
