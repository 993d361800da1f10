"""The memory plan: which layouts of a run fit N GPUs of M GB, and which is fastest.

A layout is where the target and the drafter go (colocated with DDP or FSDP2 replicas, the
target sharded or not; split with any target/drafter rank ratio), whether the draft layers
are checkpointed, the row length and the LM head's chunk. For each, `train/preflight.py`
predicts the peak memory of every kind of GPU it uses, and `throughput` the tokens/s from two
times of one row: the target's forward and the drafter's step (`Timings`, measured by
`measure` through `train/bench.py`, or estimated from FLOPs), plus what the layout adds:

(1) colocated: every rank runs both, one after the other: N rows per t_target + t_drafter;
(2) DDP: one all-reduce of the fp32 gradients per optimizer step, 2 (N-1)/N of their bytes at
    `BUS_BYTES_PER_S`, not hidden (2 x H200, 8B-shaped: one GPU's 918 ms a step becomes
    936 predicted, 933-939 measured; benchmarks/parallel_h200x2_202611.md);
(3) FSDP2 (the drafter's, or the target's layers): the gathers and the reduce-scatter run
    beside the compute, prefetched: each part takes the longer of its compute and its traffic,
    plus one layer's share of the traffic, which nothing hides;
(4) split: a pipeline, target ranks feeding drafter ranks: rows/s = min(T / t_target,
    D / t_drafter) (the same record, split 1 + 1: 582 ms a step predicted, 538-557
    measured; tests/train/test_layout.py holds both);
(5) checkpointing: the drafter step plus one more forward of its layers, a third of their
    share of the step's FLOPs;
(6) rows shorter by f: loss.anchors / f and optim.grad_accum x f, so the anchors per token and
    the tokens per step stay the same, and so does the work per token (attention runs within
    documents): the same tokens/s, chosen only to fit. So is a smaller LM-head chunk, and
    so is an FP8 target (`target.precision`; its speed-up is not counted: the plan takes
    it only to fit, and says so, since the taps and labels then come from the FP8 forward).

`parallel.placement = "auto"` takes the fastest layout that fits at train start
(`resolve_auto`; from FLOP estimates, so every rank decides the same without running
anything), and `flashdraft train --plan` prints the table (docs/multi-node.md).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flashdraft.log import get_logger
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.hybrid import linear_layer_ids
from flashdraft.train import preflight
from flashdraft.train.config import RunConfig
from flashdraft.train.plan import build_drafter_config, load_target_config
from flashdraft.train.preflight import GB, MemoryEstimate, Sizes

log = get_logger(__name__)

BUS_BYTES_PER_S = 230e9  # NCCL all-reduce / all-gather bus bandwidth within a host (NVLink)
P2P_BYTES_PER_S = 100e9  # a split placement's point-to-point rows
# FLOP estimates when nothing was measured: the bf16 matmul peak of an H100/H200 as the
# benches measure it, and the model FLOP utilisation of each part in the records (27B hybrid
# target eager 57%, dense targets compiled ~75%, the drafter step 65-75%).
PEAK_FLOPS = 750e12
TARGET_MFU = {"hybrid": 0.57, "dense": 0.75}
DRAFTER_MFU = 0.65
ROW_DIVISORS = (1, 2, 4)
CHUNK_ROWS = (1024, 512)  # smaller LM-head chunks tried (if below the configured one)


@dataclass(frozen=True, slots=True)
class Layout:
    placement: str  # colocated | split
    target_ranks: int = 0  # split
    drafter_sharding: str = "ddp"
    shard_target: bool = False
    checkpointing: bool = False
    row_divisor: int = 1
    chunk_rows: int | None = None  # None: the configured one
    target_fp8: bool = False  # the target's linear layers in FP8 (`target.precision`)

    def describe(self, gpus: int) -> str:
        if self.placement == "split":
            where = f"split {self.target_ranks} target + {gpus - self.target_ranks} drafter"
        else:
            where = f"colocated x{gpus}" + (" target FSDP2" if self.shard_target else "")
        drafters = gpus - self.target_ranks if self.placement == "split" else gpus
        if drafters > 1:
            where += f", drafter {self.drafter_sharding.upper().replace('FSDP', 'FSDP2')}"
        if self.checkpointing:
            where += ", checkpointed"
        if self.row_divisor > 1:
            where += f", rows / {self.row_divisor}"
        if self.chunk_rows is not None:
            where += f", chunk {self.chunk_rows}"
        if self.target_fp8:
            where += ", target FP8"
        return where

    def changes_training(self, config: RunConfig) -> bool:
        """Whether the run would train on other features or rows: shorter rows (documents
        split at other places), or the target's forward in FP8 (its taps and labels)."""
        return self.row_divisor > 1 or (self.target_fp8 and config.target.precision != "fp8")

    def overrides(self, config: RunConfig) -> list[str]:
        """The `--set` overrides that make `config` run this layout."""
        p = config.parallel
        out = [f'parallel.placement="{self.placement}"']
        if self.target_ranks != p.target_ranks:
            out.append(f"parallel.target_ranks={self.target_ranks}")
        if self.placement == "split" and config.target.forward_rows != 1:
            out.append("target.forward_rows=1")
        if self.drafter_sharding != p.drafter_sharding:
            out.append(f'parallel.drafter_sharding="{self.drafter_sharding}"')
        if self.shard_target != p.shard_target:
            out.append(f"parallel.shard_target={str(self.shard_target).lower()}")
        if self.checkpointing != config.drafter.activation_checkpointing:
            out.append(f"drafter.activation_checkpointing={str(self.checkpointing).lower()}")
        if self.row_divisor > 1:
            f = self.row_divisor
            out += [
                f"data.row_tokens={config.data.row_tokens // f}",
                f"loss.anchors={max(1, config.loss.anchors // f)}",
                f"optim.grad_accum={config.optim.grad_accum * f}",
            ]
            if config.target.forward_rows > 1 and self.placement != "split":
                out.append(f"target.forward_rows={config.target.forward_rows * f}")
        if self.chunk_rows is not None:
            out.append(f"loss.chunk_rows={self.chunk_rows}")
        if self.target_fp8 and config.target.precision != "fp8":
            out.append('target.precision="fp8"')
        return out

    def apply(self, config: RunConfig) -> RunConfig:
        """A copy of `config` that runs this layout."""
        out = copy.deepcopy(config)
        out.parallel.placement = self.placement  # type: ignore[assignment]
        out.parallel.target_ranks = self.target_ranks
        out.parallel.drafter_sharding = self.drafter_sharding  # type: ignore[assignment]
        out.parallel.shard_target = self.shard_target
        out.drafter.activation_checkpointing = self.checkpointing
        if self.placement == "split":
            out.target.forward_rows = 1
        f = self.row_divisor
        if f > 1:
            out.data.row_tokens = config.data.row_tokens // f
            out.loss.anchors = max(1, config.loss.anchors // f)
            out.optim.grad_accum = config.optim.grad_accum * f
            if out.target.forward_rows > 1:
                out.target.forward_rows *= f
        if self.chunk_rows is not None:
            out.loss.chunk_rows = self.chunk_rows
        if self.target_fp8:
            out.target.precision = "fp8"
        return out


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds of one row at the run's row length: the target's forward (taps and labels)
    and the drafter's step (forward, backward, optimizer), and where they come from."""

    target_s: float
    drafter_s: float
    source: str  # "measured on <device>" | "estimated from FLOPs"


@dataclass(slots=True)
class Candidate:
    layout: Layout
    memory: dict[str, MemoryEstimate]  # role -> estimate of that kind of GPU
    tokens_per_s: float
    fits: bool

    @property
    def peak(self) -> float:
        """The largest predicted peak over the GPUs it uses."""
        return max(m.peak for m in self.memory.values())


@dataclass(slots=True)
class Plan:
    gpus: int
    capacity: float  # bytes per GPU
    timings: Timings
    candidates: list[Candidate]  # fastest first; those that fit before those that do not

    changing: list[Candidate] = field(default_factory=list)  # those that change training

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None

    def table(self, limit: int = 12) -> str:
        fitting = [c for c in self.candidates if c.fits]
        # One line per placement: its fastest variant that fits, the least changed at a tie.
        shown: dict[tuple[str, int, str, bool], Candidate] = {}
        for c in fitting:
            lay = c.layout
            shown.setdefault(
                (lay.placement, lay.target_ranks, lay.drafter_sharding, lay.shard_target), c
            )
        lines = [
            f"memory plan: {self.gpus} GPU(s) of {self.capacity / GB:.1f} GB; times of one row "
            f"{self.timings.source}: target forward {self.timings.target_s * 1e3:.1f} ms, "
            f"drafter step {self.timings.drafter_s * 1e3:.1f} ms",
            f"  {'layout':<62} {'peak GB/GPU':>12} {'tok/s':>9}",
        ]
        for c in list(shown.values())[:limit]:
            peaks = " / ".join(f"{m.peak / GB:.1f}" for m in c.memory.values())
            name = c.layout.describe(self.gpus) + (" *" if c in self.changing else "")
            lines.append(f"  {name:<62} {peaks:>12} {c.tokens_per_s:>9,.0f}")
        if any(c in self.changing for c in list(shown.values())[:limit]):
            lines.append("  * trains on other rows, or on the FP8 target's taps and labels")
        lines.append(
            f"  ({len(fitting)} of {len(self.candidates)} variants fit: checkpointing, shorter "
            "rows, LM-head chunks; each line is its placement's fastest)"
        )
        if self.best is None:
            smallest = min(self.candidates, key=lambda c: c.peak)
            lines.append(
                f"  nothing fits: the smallest, {smallest.layout.describe(self.gpus)}, peaks at "
                f"{smallest.peak / GB:.1f} GB"
            )
        return "\n".join(lines)

    def report(self, config: RunConfig) -> str:
        """The table, the chosen layout's memory term by term on each kind of GPU, and the
        overrides that run it (`flashdraft train --plan`)."""
        lines = [self.table()]
        best = self.best
        if best is not None:
            for role, estimate in best.memory.items():
                lines.append(f"{best.layout.describe(self.gpus)}: a {role} GPU\n{estimate.table()}")
            lines.append("chosen: --set " + " --set ".join(best.layout.overrides(config)))
        return "\n".join(lines)


def layouts(config: RunConfig, gpus: int) -> list[Layout]:
    """Every layout of the run on `gpus` GPUs that its config allows."""
    fsdp_ok = config.optim.optimizer != "muon"  # Muon needs whole matrices (config.py)
    fp8 = config.target.precision == "fp8"
    shardings = ["ddp", "fsdp"] if fsdp_ok else ["ddp"]
    places: list[tuple[str, int, str, bool]] = []
    for sharding in shardings if gpus > 1 else ["ddp"]:
        for shard_target in (False, True) if gpus > 1 else (False,):
            places.append(("colocated", 0, sharding, shard_target))
    for target_ranks in range(1, gpus // 2 + 1):
        for sharding in shardings if gpus - target_ranks > 1 else ["ddp"]:
            places.append(("split", target_ranks, sharding, False))
    chunks: list[int | None] = [None]
    chunks += [c for c in CHUNK_ROWS if c < config.loss.chunk_rows]
    # An FP8 target is offered where the config keeps bf16 weights (FSDP2 gathers in the
    # weights' dtype: not with a sharded target).
    precisions = [fp8] if fp8 or config.target.dtype == "float32" else [False, True]
    out = []
    for placement, target_ranks, sharding, shard_target in places:
        for checkpointing in (False, True):
            for f in ROW_DIVISORS:
                if config.data.row_tokens // f < 16 or config.loss.anchors // f < 1:
                    continue
                for chunk in chunks:
                    for target_fp8 in precisions:
                        if target_fp8 and shard_target:
                            continue
                        out.append(
                            Layout(
                                placement,
                                target_ranks,
                                sharding,
                                shard_target,
                                checkpointing,
                                f,
                                chunk,
                                target_fp8,
                            )
                        )
    return out


def memory(
    layout: Layout,
    config: RunConfig,
    drafter: DrafterConfig,
    target_config: Any,
    gpus: int,
    counts: Sizes,
) -> dict[str, MemoryEstimate]:
    """The predicted memory of each kind of GPU the layout uses."""
    run = layout.apply(config)
    if layout.placement == "colocated":
        shards = gpus if layout.shard_target else 1
        est = preflight.estimate(
            run, drafter, target_config, shards=shards, replicas=gpus, counts=counts
        )
        return {"colocated": est}
    drafters = gpus - layout.target_ranks
    consumers = math.ceil(drafters / layout.target_ranks)
    return {
        "target": preflight.estimate(
            run, drafter, target_config, role="target", consumers=consumers, counts=counts
        ),
        "drafter": preflight.estimate(
            run, drafter, target_config, role="drafter", replicas=drafters, counts=counts
        ),
    }


def _drafter_flops(drafter: DrafterConfig, row: int, anchors: int) -> tuple[float, float]:
    """(layers, whole step) FLOPs of one row's drafter step: the layers' forward + backward
    (x3), and the LM head's forward and gradient w.r.t. the hidden state (x2; frozen)."""
    queries = anchors * drafter.block_size
    # The method reads only the config: no module (and no RoPE tables) built for it.
    per_query = DFlashDrafter.num_flops_per_query_token(_ConfigOnly(drafter), row, queries)  # type: ignore[arg-type]
    layers = 3 * per_query * queries
    head = 2 * 2 * drafter.hidden_size * drafter.vocab_size * anchors * (drafter.block_size - 1)
    return layers, layers + head


@dataclass(frozen=True, slots=True)
class _ConfigOnly:
    config: DrafterConfig


def checkpoint_factor(drafter: DrafterConfig, row: int, anchors: int) -> float:
    """The drafter step's time with its layers checkpointed over without (5)."""
    layers, step = _drafter_flops(drafter, row, anchors)
    return 1 + layers / step / 3


def estimate_timings(
    config: RunConfig, drafter: DrafterConfig, target_config: Any, counts: Sizes
) -> Timings:
    """Times of one row from FLOPs at the records' utilisation (`TARGET_MFU`, `DRAFTER_MFU`):
    what `auto` decides with (the same on every rank, nothing run)."""
    text = target_config.get_text_config()
    row = config.data.row_tokens
    # (1) 2 FLOPs per weight of the decoder layers per token; (2) causal attention over the
    # row's documents, about half the row's keys, ~1/4 of them per token in packed rows of
    # shorter documents; (3) the labels' LM head at ~half the row's positions.
    heads = text.num_attention_heads * getattr(
        text, "head_dim", text.hidden_size // text.num_attention_heads
    )
    full = text.num_hidden_layers - len(linear_layer_ids(target_config))
    target = 2 * counts.target_layers * row  # (1)
    target += 4 * heads * full * row * row / 4  # (2)
    target += 2 * text.hidden_size * text.vocab_size * row / 2  # (3)
    kind = "hybrid" if linear_layer_ids(target_config) else "dense"
    _, step = _drafter_flops(drafter, row, config.loss.anchors)
    return Timings(
        target / (PEAK_FLOPS * TARGET_MFU[kind]),
        step / (PEAK_FLOPS * DRAFTER_MFU),
        "estimated from FLOPs",
    )


def throughput(
    layout: Layout,
    config: RunConfig,
    drafter: DrafterConfig,
    counts: Sizes,
    timings: Timings,
    gpus: int,
) -> float:
    """Predicted tokens/s of the layout (the module docstring's numbered terms)."""
    dtype_bytes = 4 if config.target.dtype == "float32" else 2
    row = config.data.row_tokens
    t_target, t_drafter = timings.target_s, timings.drafter_s  # (6): per token as they are
    if layout.checkpointing:
        t_drafter *= checkpoint_factor(drafter, row, config.loss.anchors)  # (5)
    drafters = gpus - layout.target_ranks if layout.placement == "split" else gpus
    rows_per_step = config.optim.grad_accum
    if drafters > 1:
        grad_bytes = counts.drafter * 4
        if layout.drafter_sharding == "fsdp":  # (3) gather fwd + bwd, reduce-scatter
            traffic = 3 * grad_bytes * (drafters - 1) / drafters / BUS_BYTES_PER_S
            t_drafter = max(t_drafter, traffic) + traffic / drafter.num_hidden_layers
        else:  # (2) per optimizer step, spread over its rows
            t_drafter += (
                2 * grad_bytes * (drafters - 1) / drafters / BUS_BYTES_PER_S / rows_per_step
            )
    if layout.placement == "colocated":
        if layout.shard_target:  # (3) the layers gathered for every forward
            gather = counts.target_layers * dtype_bytes * (gpus - 1) / gpus / BUS_BYTES_PER_S
            layers = max(1, counts.target_layers // max(1, counts.target_layer_max))
            t_target = max(t_target, gather) + gather / layers
        rows_per_s = gpus / (t_target + t_drafter)  # (1)
    else:  # (4)
        send = row * drafter.hidden_size * drafter.num_taps * dtype_bytes / P2P_BYTES_PER_S
        rows_per_s = min(layout.target_ranks / (t_target + send), drafters / max(t_drafter, send))
    return rows_per_s * row


def plan_layouts(
    config: RunConfig,
    drafter: DrafterConfig,
    target_config: Any,
    gpus: int,
    capacity: float,
    timings: Timings | None = None,
    counts: Sizes | None = None,
) -> Plan:
    """Every layout on `gpus` GPUs of `capacity` bytes, with its predicted memory and
    tokens/s; fastest first, those that fit before those that do not. A layout fits when
    every GPU's `MemoryEstimate.total` (peak and allocator slack) is within `capacity`."""
    if gpus < 1:
        raise ValueError(f"a plan needs at least one GPU, got {gpus}")
    counts = counts or preflight.sizes(target_config, drafter)
    timings = timings or estimate_timings(config, drafter, target_config, counts)
    candidates = []
    for layout in layouts(config, gpus):
        mem = memory(layout, config, drafter, target_config, gpus, counts)
        fits = all(m.total <= capacity for m in mem.values())
        speed = throughput(layout, config, drafter, counts, timings, gpus)
        candidates.append(Candidate(layout, mem, speed, fits))
    # Those that fit first, and of them those that train what the config trains (its rows,
    # its target's precision); then the fastest; at equal speed the layout that changes
    # least (no checkpointing, whole rows, the configured chunk), then the one with the most
    # memory to spare.
    candidates.sort(
        key=lambda c: (
            not c.fits,
            c.layout.changes_training(config),
            -round(c.tokens_per_s, 6),
            c.layout.checkpointing,
            c.layout.row_divisor,
            c.layout.chunk_rows is not None,
            c.layout.target_fp8 and config.target.precision != "fp8",
            c.peak,
        )
    )
    changing = [c for c in candidates if c.layout.changes_training(config)]
    return Plan(gpus, capacity, timings, candidates, changing)


def device_capacity(device: torch.device) -> float:
    """Bytes the run may use on this GPU: what is free, within the process's cap
    (`torch.cuda.set_per_process_memory_fraction`); unbounded on the CPU."""
    if device.type != "cuda":
        return math.inf
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    return float(min(free, fraction * total))


def resolve_auto(
    config: RunConfig, target_config: Any, drafter: DrafterConfig, world: int, capacity: float
) -> tuple[RunConfig, Plan]:
    """`parallel.placement = "auto"`: the config with the fastest layout that fits this
    machine's `world` GPUs applied, and the plan it came from. Raises ValueError, with the
    smallest layout's numbers, when none fits."""
    plan = plan_layouts(config, drafter, target_config, world, capacity)
    best = plan.best
    if best is None:
        raise ValueError(
            f"parallel.placement = 'auto': no layout of this run fits {world} GPU(s):\n"
            f"{plan.table()}\nto fit: more GPUs, a smaller drafter (drafter.num_layers, "
            "drafter.intermediate_size) or fewer anchors (loss.anchors)"
        )
    return best.layout.apply(config), plan


def resolve_placement(config: RunConfig, info: Any, target_config: Any = None) -> RunConfig:
    """`train`'s step for `parallel.placement = "auto"` on this rank (`info`: its DistInfo):
    the config of the plan's choice for this machine, logged by the main rank. Every rank
    plans with the smallest capacity of any rank, so all choose the same layout."""
    if target_config is None:
        target_config = load_target_config(config.target.path)
    drafter, _ = build_drafter_config(config, target_config)
    capacity = device_capacity(info.device)
    if info.distributed:
        least = torch.tensor([min(capacity, 2.0**62)], dtype=torch.float64, device=info.device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        capacity = float(least.item())  # sync: once, at start-up
    resolved, plan = resolve_auto(config, target_config, drafter, info.world, capacity)
    if info.is_main:
        best = plan.best
        assert best is not None
        log.info(
            f"flashdraft train: parallel.placement = 'auto' chose "
            f"{best.layout.describe(info.world)}: {' '.join(best.layout.overrides(config))}\n"
            f"{plan.table()}"
        )
    return resolved


def run_geometry(config: RunConfig) -> tuple[Any, DrafterConfig]:
    """The run's target config (no weights read) and drafter config."""
    target_config = load_target_config(config.target.path)
    drafter, _ = build_drafter_config(config, target_config)
    return target_config, drafter


def plan_for_run(
    config: RunConfig,
    gpus: int | None = None,
    gb: float | None = None,
    timings: Timings | None = None,
    geometry: tuple[Any, DrafterConfig] | None = None,
) -> Plan:
    """The plan of this run for `gpus` GPUs (None: this machine's) of `gb` GB each (None:
    this GPU's free memory; on a machine without one, 80), from `timings` (None: estimated
    from FLOPs; `train/measure.py` measures them). `geometry`: `run_geometry(config)`, if
    already read."""
    target_config, drafter = geometry or run_geometry(config)
    if gpus is None:
        gpus = max(1, torch.cuda.device_count())
    if gb is not None:
        capacity = gb * GB
    elif torch.cuda.is_available():
        capacity = device_capacity(torch.device("cuda", 0))
    else:
        capacity = 80.0 * GB
    return plan_layouts(config, drafter, target_config, gpus, capacity, timings)
