"""Pinned expert routing for the hybrid packing check (flashdraft.model.routing): a route that
flips between a packed row and a document alone fails the check unless the routing is pinned,
and a pinned check still refuses a leak."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import tiny_hybrid
from torch import nn

from flashdraft.model import routing
from flashdraft.model.target import Target

MOE_KINDS = ["qwen3_5_moe", "qwen3_next"]


def shape_dependent_routes(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """What bf16 does to a router, exaggerated: its input gets noise that depends on how many
    tokens the forward has, so a packed row and a document alone route many tokens to
    different experts (the experts themselves still see the true hidden states)."""

    def noisy(module: nn.Module, args: tuple) -> tuple:
        (x,) = args
        gen = torch.Generator().manual_seed(x.shape[0])
        return (x + x.std() * torch.randn(x.shape, generator=gen),)

    routers = routing.PinnedRouting(model).routers
    assert routers, "the MoE kinds route through TopKRouter modules"
    return [r.register_forward_pre_hook(noisy) for r in routers]


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_flipped_routes_fail_the_packing_check_unless_pinned(kind, monkeypatch) -> None:
    model = tiny_hybrid(kind)
    handles = shape_dependent_routes(model)
    target = Target(model, [0, 3], "sdpa", linear_kernels="per-document")
    try:
        target.verify_taps()  # pinned: the documents take the packed row's routes
        with monkeypatch.context() as m:
            m.setattr(routing.PinnedRouting, "replay", lambda self, a, b: contextlib.nullcontext())
            with pytest.raises(ValueError, match="differs from document"):
                target.verify_taps()
        # Pinning hides no leak: without the linear layers' restart the check still refuses.
        assert target.linear is not None
        monkeypatch.setattr(target.linear, "packed", lambda doc_ids: contextlib.nullcontext())
        with pytest.raises(ValueError, match="leak into each other through the linear-attention"):
            target.verify_taps()
    finally:
        for handle in handles:
            handle.remove()
        target.taps.remove()
        if target.linear is not None:
            target.linear.remove()


def test_a_dense_target_has_nothing_to_pin() -> None:
    pins = routing.PinnedRouting(tiny_hybrid("qwen3_5"))
    assert pins.routers == []
    with pins.record(), pins.replay(0, 3):
        pass


class BatchFirstTopKRouter(nn.Module):
    """A router of another layout ([R, T, E]): replay must refuse it, not slice it wrongly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.softmax(-1)


def test_a_router_of_another_layout_is_refused_in_one_line() -> None:
    model = nn.Sequential(BatchFirstTopKRouter())
    pins = routing.PinnedRouting(model)
    with pins.record():
        model(torch.randn(1, 10, 4))
    with pytest.raises(ValueError, match="not one row per token"), pins.replay(2, 5):
        model(torch.randn(1, 3, 4))


class SkipsSecondRouter(nn.Module):
    """A model whose forward can go around its second router (as a fused MoE kernel would)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = BatchFirstTopKRouter(), BatchFirstTopKRouter()
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        return x if self.skip else self.second(x)


def test_a_router_the_pinned_forward_went_around_is_refused() -> None:
    model = SkipsSecondRouter()
    pins = routing.PinnedRouting(model)
    tokens = torch.randn(6, 4)  # one row per token: the layout replay slices
    with pins.record():
        model(tokens)
    with pins.replay(1, 4):
        model(tokens[1:4])  # both routers ran: pinned
    model.skip = True
    with pytest.raises(RuntimeError, match="1 of 2 routers did not run"), pins.replay(1, 4):
        model(tokens[1:4])
