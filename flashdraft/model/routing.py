"""Expert routing pinned between forwards of a mixture-of-experts target (the packing check).

A packed row and a document run alone compute the same tokens with different kernel shapes.
In bf16 the rounding differs by a few units in the last place, and where a router's top-k
scores nearly tie, that is enough to send a token to other experts: its taps then differ
by far more than rounding although nothing is wrong with the packing (measured on the tiny
Qwen3.5-MoE and Qwen3-Next targets on an H200: 0.04-0.11 relative over the whole model,
while every linear-attention layer alone matched within 2e-2). Serving engines see the same
flips between batch shapes. The packing check therefore records the routing of the packed
forward and replays each document's share of it when the document runs alone, so that what
remains is the packing and the rounding, which is what the check is about.

Routers are found by class: transformers' MoE blocks route through a `...TopKRouter` module
whose outputs are tensors with one row per token of the flattened batch ([R*T, ...]);
a router of another layout is refused by `replay` with a one-line error rather than guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

ROUTER_SUFFIX = "TopKRouter"


class PinnedRouting:
    """Every router's outputs in one forward (`record`), replayed for a range of its tokens in
    later forwards (`replay`). A model without routers makes both no-ops."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = [m for m in model.modules() if type(m).__name__.endswith(ROUTER_SUFFIX)]
        self.recorded: list[tuple[Tensor, ...] | None] = [None] * len(self.routers)

    @contextmanager
    def record(self) -> Iterator[None]:
        """Keep each router's outputs of the one forward run inside the block."""
        self.recorded = [None] * len(self.routers)

        def keep(i: int) -> Callable[[nn.Module, Any, Any], None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                if self.recorded[i] is not None:
                    raise RuntimeError(f"{type(module).__name__} ran twice in one recorded forward")
                self.recorded[i] = _as_tuple(output)

            return hook

        with _hooks(self.routers, keep):
            yield

    @contextmanager
    def replay(self, start: int, stop: int) -> Iterator[None]:
        """Inside the block each router returns rows start..stop-1 of what it returned in the
        recorded forward (the tokens of one document of a packed row of batch 1)."""

        fired = [False] * len(self.routers)

        def pinned(i: int) -> Callable[[nn.Module, Any, Any], Any]:
            def hook(module: nn.Module, args: Any, output: Any) -> Any:
                fired[i] = True
                recorded = self.recorded[i]
                if recorded is None:
                    raise RuntimeError("replay without a recorded forward")
                own = _as_tuple(output)
                kept = tuple(t[start:stop] for t in recorded)
                if [t.shape for t in kept] != [t.shape for t in own]:
                    raise ValueError(
                        f"{type(module).__name__}: its outputs are not one row per token "
                        f"({[tuple(t.shape) for t in own]}), so the packing check cannot pin "
                        "its routing; please report the model class"
                    )
                return kept if isinstance(output, tuple) else kept[0]

            return hook

        with _hooks(self.routers, pinned):
            yield
        # A router the forward went around (a fused or compiled MoE path) was not pinned, and
        # the check would then compare unpinned routes: say so instead of failing vaguely.
        ran = zip(self.routers, fired, strict=True)
        missed = sorted({type(r).__name__ for r, hit in ran if not hit})
        if missed:
            raise RuntimeError(
                f"{', '.join(missed)}: {fired.count(False)} of {len(fired)} routers did not run "
                "in the pinned forward, so its routing was not replayed; please report the model"
            )


def _as_tuple(output: Any) -> tuple[Tensor, ...]:
    return tuple(output) if isinstance(output, tuple) else (output,)


@contextmanager
def _hooks(
    modules: list[nn.Module], make: Callable[[int], Callable[[nn.Module, Any, Any], Any]]
) -> Iterator[None]:
    handles = [m.register_forward_hook(make(i)) for i, m in enumerate(modules)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
