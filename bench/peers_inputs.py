"""The inputs `bench/peers.py`'s workers rebuild identically, whichever framework they run:
the geometry and the case (`Geometry`, `Case`), one packed row of seeded target features and
labels (`make_row`), the drafter's seeded weights by serving-format name (`seeded_weights`,
`load_drafter_weights`), and the timing of a step (`timed`), which marks its phases on stderr
(`phase`) so that a worker stopped by its timeout still says how far it got. Only flashdraft
and torch are imported here; each framework's step is in `peers_steps.py`."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

SEED = 1234
PHASE_TAG = "PEERS_PHASE "  # stderr lines "PEERS_PHASE <name> <seconds since spawned>"
PHASES = ("imported", "set up", "first step done", "warmup done")
SPAWNED_AT = "PEERS_SPAWNED_AT"  # the parent's time.time() as it started the worker (env)
_IMPORTED = time.time()  # a worker run by hand: its clock starts here


def phase(name: str) -> None:
    """Say on stderr that the worker reached `name` (read by the parent, even after a kill),
    in seconds since the parent spawned it: the clock of its `--timeout`. One write, so no
    other output (the compile workers share the stream) lands inside the line."""
    assert name in PHASES, name
    began = float(os.environ.get(SPAWNED_AT, _IMPORTED))
    sys.stderr.write(f"{PHASE_TAG}{name} {time.time() - began:.1f}\n")
    sys.stderr.flush()


def phases_of(stderr: str) -> dict[str, float]:
    """The phases a worker marked, in order: name -> seconds since it was spawned (lines
    that are not a whole mark of a known phase, e.g. cut by the kill, are skipped)."""
    out: dict[str, float] = {}
    for line in stderr.splitlines():
        name, _, seconds = line.removeprefix(PHASE_TAG).rpartition(" ")
        if line.startswith(PHASE_TAG) and name in PHASES:
            try:
                out[name] = float(seconds)
            except ValueError:
                continue
    return out


# ---------------------------------------------------------------------------------------------
# Geometry and the shared, seeded inputs (rebuilt identically inside every worker)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Geometry:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    taps: int
    target_layers: int
    block: int
    gamma: float
    mask_token: int

    @property
    def layer_ids(self) -> list[int]:
        """docs/design.md §3 default ids (Qwen3-8B, 5 taps -> [1, 9, 17, 25, 33]); SpecForge's rule agrees."""
        from flashdraft.model.config import default_target_layer_ids

        return default_target_layer_ids(self.target_layers, self.taps)


@dataclass(frozen=True, slots=True)
class Case:
    framework: str
    context: int  # T, tokens in the row
    anchors: int  # A
    parity_anchors: int  # 0: no parity pass; else a pass at T = parity_anchors + B
    warmup: int
    iters: int
    speculators_loss: str
    speculators_impl: str = "fused"


def compute_setup(device: torch.device) -> tuple[torch.dtype, bool]:
    """(input / frozen-table dtype, autocast on): bf16 on CUDA as every trainer runs; fp32 on CPU."""
    cuda = device.type == "cuda"
    return (torch.bfloat16 if cuda else torch.float32), cuda


@dataclass(slots=True)
class Row:
    """One packed row of target features and labels, identical for all three frameworks.

    input_ids[p + 1] is the target's greedy token after p by construction: last_hidden[p] is
    the head row of input_ids[p + 1] (scaled), so argmax(head(norm(last_hidden[p]))) equals it
    with a margin of ~80 logits. So the three label sources coincide: flashdraft's target
    argmax at a + k - 1, speculators' argmax of the verifier logits at a + k - 1, and
    SpecForge's data token x[a + k].
    """

    input_ids: Tensor  # [1, T] long
    loss_mask: Tensor  # [1, T] bool: 1 on [0, T - B], so every framework has T - B candidates
    doc_ids: Tensor  # [1, T] long, one document
    position_ids: Tensor  # [1, T] long
    taps: Tensor  # [1, T, K*H] concatenated target features
    last_hidden: Tensor  # [1, T, H] the target's last-layer state (speculators' label source)


def make_tables(g: Geometry, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The target's input embedding and LM head, [V, H] each (seeded, on device)."""
    gen = torch.Generator(device).manual_seed(SEED)
    embed = torch.randn(g.vocab, g.hidden, generator=gen, device=device) * 0.02
    head = torch.randn(g.vocab, g.hidden, generator=gen, device=device) * 0.02
    return embed.to(dtype), head.to(dtype)


def make_row(g: Geometry, context: int, head: Tensor, device: torch.device) -> Row:
    gen = torch.Generator(device).manual_seed(SEED + context)
    ids = torch.randint(0, g.vocab, (1, context), generator=gen, device=device)
    greedy = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # the token after p (last: any)
    loss_mask = torch.zeros(1, context, dtype=torch.bool, device=device)
    loss_mask[:, : context - g.block + 1] = True
    taps = torch.randn(1, context, g.taps * g.hidden, generator=gen, device=device)
    return Row(
        input_ids=ids,
        loss_mask=loss_mask,
        doc_ids=torch.zeros(1, context, dtype=torch.long, device=device),
        position_ids=torch.arange(context, device=device)[None],
        taps=taps.to(head.dtype),
        last_hidden=(head[greedy] / 0.02).to(head.dtype),
    )


def drafter_config(g: Geometry) -> Any:
    from flashdraft.model.config import DrafterConfig

    return DrafterConfig(
        hidden_size=g.hidden,
        intermediate_size=g.intermediate,
        num_hidden_layers=g.layers,
        num_attention_heads=g.heads,
        num_key_value_heads=g.kv_heads,
        head_dim=g.head_dim,
        vocab_size=g.vocab,
        block_size=g.block,
        num_target_layers=g.target_layers,
        target_layer_ids=g.layer_ids,
        mask_token_id=g.mask_token,
    )


def seeded_weights(g: Geometry, device: torch.device) -> dict[str, Tensor]:
    """Drafter weights by serving-format name (docs/design.md §6), fp32, identical in every worker.

    All three frameworks name the drafter's parameters alike (`layers.{i}.self_attn.q_proj.
    weight`, `fc.weight`, ...); each worker loads this dict and checks every name and shape
    exists in its model, which is also a check that the three architectures agree.
    """
    from flashdraft.model.drafter import DFlashDrafter

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in DFlashDrafter(drafter_config(g)).named_parameters()}
    gen = torch.Generator(device).manual_seed(SEED + 1)
    out = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shapes[name], device=device)
        else:
            out[name] = torch.randn(shapes[name], generator=gen, device=device) * 0.02
    return out


def load_drafter_weights(module: nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy `weights` into `module`; its trainable parameters must be exactly these.

    Same names, same shapes, nothing trainable besides: the three drafters are one
    architecture, so the step does the same work in each (frozen tables may differ).
    """
    params = dict(module.named_parameters())
    extra = sorted(n for n, p in params.items() if p.requires_grad and n not in weights)
    if extra:
        raise ValueError(f"{type(module).__name__} trains parameters flashdraft lacks: {extra}")
    with torch.no_grad():
        for name, value in weights.items():
            target = params.get(name)
            if target is None or target.shape != value.shape:
                raise ValueError(
                    f"{type(module).__name__} has no parameter {name} of shape "
                    f"{tuple(value.shape)}: its architecture differs from the flashdraft drafter"
                )
            target.copy_(value)


def timed(step: Callable[[], None], device: torch.device, case: Case) -> dict[str, Any]:
    """`measure` of `step`, the phases marked: set up (the step about to run), its first call
    done (with a cold compile, most of a worker's time on a GPU), the warmup done (with one
    warmup call, the first call is all of it: only "first step done"; with none, only "set
    up")."""
    from flashdraft.benchutil import measure, sync

    calls = 0

    def marked() -> None:
        nonlocal calls
        step()
        calls += 1
        if calls == 1 or calls == case.warmup:  # untimed calls: the sync costs nothing timed
            sync(device)
            phase("first step done" if calls == 1 else "warmup done")

    phase("set up")
    timing = measure(marked if case.warmup else step, device, case.warmup, case.iters)
    out: dict[str, Any] = timing.as_dict()
    if device.type == "cuda":
        out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
    else:
        out["peak_mem_gb"] = None  # the caching allocator's peak exists on CUDA only
    return out
