"""The optimizer and its finite guard: a non-finite step never reaches the weights, and the
run learns which step it was without a host sync per step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flashdraft.train.config import OptimSection
from flashdraft.train.optim import FiniteGuard, Muon, Optimizers, build_optimizer
from flashdraft.train.parallel import Placement

ALONE = Placement("colocated", "colocated", 0, 1, (0,), (0,))


def _step(model: nn.Module, guard: FiniteGuard, scale: float) -> None:
    loss = model(torch.ones(1, 4)).sum() * scale
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    guard.observe(loss.detach(), grad_norm)
    guard.step()
    guard.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("fused", [False, True])
def test_a_non_finite_step_and_every_one_after_it_leave_the_weights_alone(fused) -> None:
    """fused: the kernel reads the guard's flag as `found_inf` (GradScaler's mechanism, the
    CUDA path; PyTorch has the fused kernel on the CPU too, so it is checked here); unfused:
    the step is skipped on the host."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    guard = FiniteGuard(optimizer, torch.device("cpu"), start=10)
    assert guard.fused == fused
    for _ in range(2):
        _step(model, guard, 1.0)
    assert guard.first_bad_step(ALONE) is None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    _step(model, guard, float("nan"))  # step 13 of the run (it started at 10)
    _step(model, guard, 1.0)  # finite again, but the run is already lost: still skipped
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    for name, value in optimizer.state[model.weight].items():
        assert torch.equal(value, moments[name]), name  # step count and moments included
    assert guard.first_bad_step(ALONE) == 13


@pytest.mark.parametrize("name", ["adamw", "adamw-fused", "muon"])
def test_an_empty_step_leaves_weights_and_moments_alone_and_does_not_trip(name) -> None:
    """A step with nothing to train (the trainer passes `empty` = its normaliser is 0) is
    skipped for that step only: weights and optimizer state unchanged, the run not stopped,
    and the next step updates as usual (host path, fused AdamW's found_inf, Muon's)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4, bias=False)
    if name == "muon":
        optimizer: torch.optim.Optimizer = Muon(model.parameters(), lr=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=name == "adamw-fused")
    guard = FiniteGuard(optimizer, torch.device("cpu"), start=0)

    def step(empty: bool) -> None:
        loss = model(torch.ones(1, 4)).sum() * (0.0 if empty else 1.0)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        guard.observe(loss.detach(), grad_norm, empty=torch.tensor(empty))
        guard.step()
        optimizer.zero_grad(set_to_none=True)

    step(False)
    before = model.weight.detach().clone()
    state = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    step(True)
    assert torch.equal(model.weight, before)
    for key, value in optimizer.state[model.weight].items():
        assert torch.equal(value, state[key]), key
    step(False)
    assert not torch.equal(model.weight, before)
    assert guard.first_bad_step(ALONE) is None


def test_an_infinite_loss_trips_the_guard_even_when_the_gradient_is_finite() -> None:
    model = nn.Linear(4, 3)
    guard = FiniteGuard(torch.optim.AdamW(model.parameters()), torch.device("cpu"), start=0)
    guard.observe(torch.tensor(float("inf")), torch.tensor(1.0))
    assert guard.first_bad_step(ALONE) == 1


def test_adamw_follows_the_optim_section_and_is_fused_on_cuda_only() -> None:
    section = OptimSection(lr=3e-4, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.1)
    optimizer = build_optimizer(nn.Linear(2, 2), section, torch.device("cpu"))
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert (group["lr"], group["betas"], group["eps"]) == (3e-4, (0.8, 0.9), 1e-6)
    assert group["weight_decay"] == 0.1 and not group["fused"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_on_cuda_the_guard_keeps_the_fused_step_free_of_host_syncs(name) -> None:
    """The CUDA path as the trainer runs it: clip, observe, fused AdamW (and flashdraft's
    Muon) with the flag as its `found_inf`; no host sync anywhere (sync debug mode turns one
    into an error), an empty step (loss 0: nothing to train) leaves the weights and moments
    alone for that step only, and a NaN step leaves them alone for good."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)).to(device)
    optimizer = build_optimizer(model, OptimSection(optimizer=name, lr=0.1), device)
    guard = FiniteGuard(optimizer, device, start=0)
    assert guard.fused

    def step(scale: float) -> None:
        loss = model(torch.ones(4, 64, device=device)).sum() * scale
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        guard.observe(loss.detach(), grad_norm, empty=loss.detach() == 0)  # as the trainer
        guard.step()
        optimizer.zero_grad(set_to_none=True)

    def checked(*scales: float) -> dict[str, torch.Tensor]:
        torch.cuda.synchronize()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        torch.cuda.set_sync_debug_mode("error")
        try:
            for scale in scales:
                step(scale)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return before

    step(1.0)  # the optimizer's state is created outside the checked region
    weight = model[0].weight
    (state,) = [
        o.state[weight] for o in getattr(optimizer, "optimizers", [optimizer]) if weight in o.state
    ]
    moments = {k: v.clone() for k, v in state.items()}
    before = checked(0.0)  # step 2: empty, skipped
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    for key, value in state.items():
        assert torch.equal(value, moments[key]), key
    before = checked(1.0)  # step 3 trains again (the momentum moves the weights)
    assert not torch.equal(weight, before["0.weight"])
    before = checked(float("nan"), 1.0)  # steps 4 and 5: the run is lost at 4
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert guard.first_bad_step(ALONE) == 4


def test_muon_takes_the_weight_matrices_and_adamw_the_rest() -> None:
    """optim.optimizer = "muon": flashdraft's Muon (its update scaled to AdamW's RMS) on every
    trainable 2-D matrix with both sides > 1, AdamW on the rest; frozen parameters in
    neither; one lr setting reaches both."""
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    frozen = nn.Linear(8, 8)
    frozen.requires_grad_(False)
    model.append(frozen)
    section = OptimSection(optimizer="muon", lr=2e-3, weight_decay=0.01, muon_weight_decay=0.2)
    optimizers = build_optimizer(model, section, torch.device("cpu"))
    muon, adamw = list(optimizers)
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    assert [p.shape for p in muon.param_groups[0]["params"]] == [torch.Size([8, 4])]
    assert {tuple(p.shape) for p in adamw.param_groups[0]["params"]} == {(8,), (1, 8), (1,)}
    assert (muon.param_groups[0]["weight_decay"], adamw.param_groups[0]["weight_decay"]) == (
        0.2,
        0.01,
    )
    for group in optimizers.param_groups:
        group["lr"] = 5e-4
    assert muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"] == 5e-4


def _twin_steps(
    ours: list[nn.Parameter],
    mine: torch.optim.Optimizer,
    theirs: list[nn.Parameter],
    other: torch.optim.Optimizer,
    steps: int,
) -> None:
    """`steps` steps of both optimizers on the same random gradients."""
    for _ in range(steps):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        mine.step()
        other.step()


def test_muon_is_torch_muon_batched_by_shape() -> None:
    """flashdraft's Muon against torch.optim.Muon (match_rms_adamw, Nesterov) over four steps
    on matrices of three shapes, two of one shape (one batch), tall and wide: the same
    weights and momenta up to bf16 rounding of the Newton-Schulz matmuls (batched here, one
    by one there)."""
    torch.manual_seed(0)
    shapes = [(8, 4), (8, 4), (4, 8), (6, 6)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    kwargs = dict(lr=0.02, momentum=0.9, weight_decay=0.1)
    mine = Muon(ours, **kwargs)
    reference = torch.optim.Muon(theirs, adjust_lr_fn="match_rms_adamw", **kwargs)
    _twin_steps(ours, mine, theirs, reference, 4)
    for a, b in zip(ours, theirs, strict=True):
        assert not torch.equal(a, torch.zeros_like(a))
        torch.testing.assert_close(a, b, rtol=0, atol=2e-4)
        torch.testing.assert_close(
            mine.state[a]["momentum_buffer"], reference.state[b]["momentum_buffer"]
        )
    with pytest.raises(ValueError, match="2-D matrices"):
        Muon([nn.Parameter(torch.zeros(3))], lr=0.1)


def test_muon_reads_found_inf_and_a_flagged_step_changes_nothing() -> None:
    """found_inf = 0: the step of no flag (to fp32 rounding of 1 - lr * decay on the device);
    found_inf = 1 with non-finite gradients: weights and momenta bit for bit as before."""
    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(5, 3))]
    twins = [nn.Parameter(w.detach().clone()) for w in weights]
    flagged, plain = Muon(weights, lr=0.05), Muon(twins, lr=0.05)
    flagged.found_inf = torch.zeros(())
    _twin_steps(weights, flagged, twins, plain, 2)
    for a, b in zip(weights, twins, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    before = [w.detach().clone() for w in weights]
    momenta = [flagged.state[w]["momentum_buffer"].clone() for w in weights]
    flagged.found_inf = torch.ones(())
    for w in weights:
        w.grad = torch.full_like(w, float("nan"))
    flagged.step()
    for w, old, buf in zip(weights, before, momenta, strict=True):
        assert torch.equal(w, old) and torch.equal(flagged.state[w]["momentum_buffer"], buf)


def test_the_guard_keeps_a_non_finite_step_from_muon_too() -> None:
    """On the CPU the AdamW beside Muon is the foreach one, which has no flag input: the
    guard skips both on the host. With a fused AdamW (the CUDA build; PyTorch has the fused
    kernel on the CPU too) both read the flag on the device, and the NaN step and every one
    after it still change nothing, momenta included."""
    for fused in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
        optimizers = build_optimizer(model, OptimSection(optimizer="muon"), torch.device("cpu"))
        if fused:
            muon, adamw = list(optimizers)
            rest = [p for group in adamw.param_groups for p in group["params"]]
            optimizers = Optimizers([muon, torch.optim.AdamW(rest, fused=True)])
        guard = FiniteGuard(optimizers, torch.device("cpu"), start=0)
        assert guard.fused == fused
        _step(model, guard, 1.0)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        momentum = optimizers.optimizers[0].state[model[0].weight]["momentum_buffer"].clone()
        _step(model, guard, float("nan"))
        _step(model, guard, 1.0)
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), name
        assert torch.equal(
            optimizers.optimizers[0].state[model[0].weight]["momentum_buffer"], momentum
        )
        assert guard.first_bad_step(ALONE) == 2
