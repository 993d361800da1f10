"""Everything that makes single-device model code run fast and on many devices, applied from
outside the model in one fixed order: compile, then distribution (STYLE).

Processes are started by `torchrun` (any number of processes and nodes); torch.distributed
does every collective (NCCL on GPUs, gloo on CPU). Nothing here is a hand-made all-reduce.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from flashdraft.log import trace
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.target import Target, TargetOutputs, decoder_layers


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def resolve_device(preference: str, local_rank: int = 0) -> torch.device:
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else "cpu"
    if preference == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device = 'cuda' but no CUDA device is visible; use device = 'cpu'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if preference != "cpu":
        raise ValueError(f"device {preference!r}: use auto, cpu or cuda")
    return torch.device("cpu")


def init_distributed(preference: str) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK), if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(preference, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=timedelta(minutes=30),
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(rank, world, local_rank, device)


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()


def compile_drafter(drafter: DFlashDrafter) -> DFlashDrafter:
    """Compile each decoder layer in place (`Module.compile`), so parameter names, state
    dicts and checkpoints are untouched (no `_orig_mod.` prefixes anywhere)."""
    for layer in drafter.layers:
        layer.compile(dynamic=False)
    drafter.hidden_norm.compile(dynamic=False)
    return drafter


def target_compile_refusal(target: Target) -> str | None:
    """Why `compile_target` should not compile this target (None: it may)."""
    kinds = set(getattr(target.config, "layer_types", None) or [])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(kinds)} (hybrid targets keep their eager packed path)"
    if any(type(p).__name__ == "DTensor" for p in target.base.parameters()):
        return "sharded (FSDP2) layers"
    return None


class _CompiledLayers(nn.Module):
    """`base` whose decoder layers run compiled forwards while (and only while) it is called:
    `Module.__call__` looks `forward` up on the instance first, and runs the layer's hooks
    (the taps) around it, eagerly. Outside the call the layers are as they were (the HF
    eval loop's shapes vary every step: compiled, they would recompile until dynamo gives up).
    """

    def __init__(self, base: nn.Module, layers: nn.ModuleList, backend: str) -> None:
        super().__init__()
        self.inner = base
        self._layers = list(layers)  # a plain list: already registered under `inner`
        self._compiled = [
            torch.compile(layer.forward, backend=backend, dynamic=False) for layer in layers
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        saved = [layer.__dict__.get("forward") for layer in self._layers]
        for layer, compiled in zip(self._layers, self._compiled, strict=True):
            layer.forward = compiled
        try:
            return self.inner(*args, **kwargs)
        finally:
            for layer, previous in zip(self._layers, saved, strict=True):
                if previous is None:
                    del layer.forward
                else:
                    layer.forward = previous


def compile_target(target: Target, backend: str = "inductor", scope: str = "layers") -> Target:
    """Compile the target's decoder stack for the packed training forward, in place.

    A small target's eager forward is bound by Python and kernel launches (SmolLM2-135M: ~46
    ms per 8192-token row eager, a few ms of compute). Only what `packed_outputs` calls is
    compiled (parameters shared); the HF model itself stays eager for the start-up check and
    the HF eval loop, whose shapes vary. One graph per row shape (`dynamic=False`): rows are
    padded to the token budget, and every BlockMask comes from the one
    `document_causal_mask_mod` factory, which dynamo guards by its code object, so a new
    row's mask does not recompile.

    scope "stack": `target.base` as one graph, the taps' forward hooks traced into it (dynamo
    guards on their capture dict being empty at each call, which `LayerTaps.features()`
    ensures after every row; tests/train/test_parallel.py counts graphs). Cold, its compile
    time grows with the depth (30 layers of SmolLM2: ~70 s on an H200).
    scope "layers": each decoder layer's `forward` compiled, the hooks left outside it: one
    graph serves every layer (the layers' modules are graph inputs), so the cold compile is
    one layer's, whatever the depth; the embedding, RoPE tables and final norm stay eager.
    The compiled forwards are installed only for the duration of `target.base`'s call
    (`_CompiledLayers`), so the HF model stays eager for everyone else.
    """
    if scope == "layers":
        target.base = _CompiledLayers(target.base, decoder_layers(target.model), backend)
        return target
    if scope != "stack":
        raise ValueError(f"compile scope {scope!r}: layers or stack")
    compiled = torch.compile(target.base, backend=backend, dynamic=False)
    assert isinstance(compiled, nn.Module)  # an OptimizedModule wrapping the base
    target.base = compiled
    return target


def wrap_drafter(
    drafter: DFlashDrafter, info: DistInfo, sharding: str, group: Any = None, replicas: int = 1
) -> nn.Module:
    """Data parallelism for the drafter over `group` (None: all ranks): DDP (replicas), or
    FSDP2 (sharded, for large drafters).

    Returns the module to call for the forward; the drafter itself stays the object to read
    config from and to checkpoint (FSDP2 shards it in place, DDP wraps it).
    """
    if replicas <= 1:
        return drafter
    if sharding == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        mesh = DeviceMesh.from_group(pg, info.device.type)
        for layer in drafter.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(drafter, mesh=mesh)
        return drafter
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(drafter, device_ids=device_ids, process_group=group)


def gradient_sync(model: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
    """Context for one micro-batch's backward: reduce gradients across replicas or not (the
    last micro-batch of a step reduces, the others only accumulate). DDP wraps (`no_sync`),
    FSDP2 shards in place (`set_requires_gradient_sync`); a single replica has nothing to do."""
    if enabled:
        return nullcontext()
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return _fsdp_no_sync(model)
    return nullcontext()


@contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---- placement: which rank runs what ----


@dataclass(frozen=True, slots=True)
class Placement:
    """The role of this rank and the data-parallel group of drafter replicas.

    colocated: every rank runs the target and a drafter replica (dp rank = rank).
    split: ranks [0, target_ranks) run only the target and send features and labels to the
    drafter ranks [target_ranks, world); drafter j (dp rank j) is fed by target rank
    j % target_ranks, so one target rank may feed several drafters.
    """

    kind: str  # colocated | split
    role: str  # colocated | target | drafter
    dp_rank: int  # this rank's index among drafter replicas (-1 on target-only ranks)
    dp_world: int  # number of drafter replicas
    target_ranks: tuple[int, ...]
    drafter_ranks: tuple[int, ...]
    group: Any = None  # process group of the drafter replicas (None: the default group)
    control: Any = None  # split: every rank over gloo (CPU), for the stop vote (train/stopping.py)

    @property
    def feeder(self) -> int:
        """The target rank that feeds this drafter rank (split)."""
        return self.target_ranks[self.dp_rank % len(self.target_ranks)]

    def consumers(self, rank: int) -> list[int]:
        """Drafter ranks fed by target rank `rank` (split), in dp order."""
        t = self.target_ranks.index(rank)
        return [d for j, d in enumerate(self.drafter_ranks) if j % len(self.target_ranks) == t]

    @property
    def is_logger(self) -> bool:
        """The rank that logs, checkpoints and exports: the first drafter replica."""
        return self.dp_rank == 0


def assign_placement(info: DistInfo, kind: str, target_ranks: int) -> Placement:
    ranks = tuple(range(info.world))
    if kind == "colocated":
        return Placement("colocated", "colocated", info.rank, info.world, ranks, ranks)
    if kind == "auto":  # `train` resolves it first (train/layout.py: resolve_placement)
        raise ValueError(
            "parallel.placement = 'auto' is chosen by `flashdraft train` at start-up; here set "
            "'colocated' or 'split' (`flashdraft train --plan` says which fits)"
        )
    if not 1 <= target_ranks < info.world:
        raise ValueError(
            f"split placement needs 1 <= parallel.target_ranks < world size; got "
            f"target_ranks={target_ranks} with {info.world} process(es) (e.g. torchrun "
            "--nproc-per-node 2 with target_ranks = 1)"
        )
    targets, drafters = ranks[:target_ranks], ranks[target_ranks:]
    if len(targets) > len(drafters):
        raise ValueError(
            f"split placement with {len(targets)} target ranks and {len(drafters)} drafter "
            "ranks would leave target ranks idle; use at most as many target ranks as drafters"
        )
    # Every rank must take part in creating the group, drafters or not.
    group = dist.new_group(list(drafters)) if len(drafters) > 1 else None
    control = dist.new_group(backend="gloo")
    if info.rank in targets:
        return Placement("split", "target", -1, len(drafters), targets, drafters, group, control)
    dp_rank = drafters.index(info.rank)
    return Placement("split", "drafter", dp_rank, len(drafters), targets, drafters, group, control)


def dp_all_reduce_sum(tensor: Tensor, placement: Placement) -> Tensor:
    """Sum over the drafter replicas only."""
    if placement.dp_world > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=placement.group)
    return tensor


def dp_all_reduce_min(tensor: Tensor, placement: Placement) -> Tensor:
    """Minimum over the drafter replicas only."""
    if placement.dp_world > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=placement.group)
    return tensor


def vote_stop(asked: bool, group: Any) -> bool:
    """Whether any rank of `group` (the split placement's `control`) was asked to stop: a CPU
    all-reduce, a host sync at a stop point only (train/stopping.py)."""
    flag = torch.tensor([float(asked)])
    dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=group)
    return bool(flag.item() > 0)


def dp_barrier(placement: Placement) -> None:
    if placement.dp_world > 1:
        dist.barrier(group=placement.group)


def _payload(outputs: TargetOutputs) -> list[Tensor]:
    """The tensors of one row's target outputs on the wire, in a fixed order: features,
    next tokens, then the soft labels' ids and probabilities when there are any."""
    assert outputs.next_tokens is not None, "the target side always fills the labels"
    tensors = [outputs.features, outputs.next_tokens]
    if outputs.soft_ids is not None and outputs.soft_probs is not None:
        tensors += [outputs.soft_ids, outputs.soft_probs]
    return [t.contiguous() for t in tensors]


class FeatureSender:
    """Target rank -> one drafter rank: one row's `TargetOutputs` (features [1, T, K*H],
    next tokens [1, A, B-1], soft labels [1, A, B-1, k] when the run has them) per row, point
    to point, with at most `depth` transfers in flight. The sender never waits for a drafter
    step unless `depth` transfers are already queued."""

    def __init__(self, peer: int, depth: int) -> None:
        self.peer, self.depth = peer, max(1, depth)
        self._pending: list[tuple[list[Any], list[Tensor]]] = []

    def send(self, outputs: TargetOutputs) -> None:
        while len(self._pending) >= self.depth:
            works, _ = self._pending.pop(0)
            for work in works:
                work.wait()
        payload = _payload(outputs)
        works = [dist.isend(t, self.peer) for t in payload]
        trace("send", peer=self.peer, bytes=sum(t.numel() * t.element_size() for t in payload))
        self._pending.append((works, payload))  # keep buffers alive until sent

    def flush(self) -> None:
        for works, _ in self._pending:
            for work in works:
                work.wait()
        self._pending.clear()


class FeatureReceiver:
    """Drafter rank <- its target rank: the other end of `FeatureSender`.

    Shapes are static (rows are padded to the token budget, A is fixed, k is the run's
    `soft_width`, 0 without soft labels), so the receiver preallocates, and posts the next
    receives before it computes on the current one. It is told how many transfers the
    sender will make in all: a receive posted past the last one would never complete.
    """

    def __init__(
        self,
        peer: int,
        feature_shape: tuple[int, ...],
        label_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        depth: int,
        total: int,
        soft_width: int = 0,
    ) -> None:
        self.peer, self.depth = peer, max(1, depth)
        self.feature_shape, self.label_shape = feature_shape, label_shape
        self.dtype, self.device = dtype, device
        self.soft_width = soft_width
        self.remaining = total  # transfers not yet posted
        self._pending: list[tuple[list[Any], TargetOutputs]] = []

    def _post(self) -> None:
        def empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
            return torch.empty(shape, dtype=dtype, device=self.device)

        outputs = TargetOutputs(
            empty(self.feature_shape, self.dtype), empty(self.label_shape, torch.long)
        )
        if self.soft_width:
            soft_shape = (*self.label_shape, self.soft_width)
            outputs.soft_ids = empty(soft_shape, torch.long)
            outputs.soft_probs = empty(soft_shape, torch.float32)
        works = [dist.irecv(t, self.peer) for t in _payload(outputs)]
        self._pending.append((works, outputs))
        self.remaining -= 1

    def drain(self) -> int:
        """Receive and drop the transfers already posted, posting no more; returns how many.
        After the receive of row j, rows j+1 .. j+depth-1 are posted: a stopping target rank
        sends exactly those (train/stopping.py)."""
        self.remaining = 0
        for works, _ in self._pending:
            for work in works:
                work.wait()
        count = len(self._pending)
        self._pending.clear()
        return count

    def receive(self) -> TargetOutputs:
        """The next transfer, keeping up to `depth` receives posted ahead."""
        while len(self._pending) < self.depth and self.remaining > 0:
            self._post()
        if not self._pending:
            raise RuntimeError(f"rank {self.peer} has sent every transfer it was to send")
        works, outputs = self._pending.pop(0)
        for work in works:
            work.wait()
        return outputs


def send_head(head_weights: list[Tensor], peers: list[int]) -> None:
    """Target rank -> drafter ranks, once: the embedding and LM-head weights."""
    for peer in peers:
        for tensor in head_weights:
            dist.send(tensor.contiguous(), peer)


def receive_head(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, peer: int
) -> list[Tensor]:
    out = []
    for shape in shapes:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, peer)
        out.append(tensor)
    return out


def shard_target(layers: nn.ModuleList) -> None:
    """FSDP2 over the target's decoder layers (no optimizer state): each rank keeps 1/world
    of their weights and all-gathers a layer just before it runs. The embedding, final norm
    and LM head stay whole on every rank: the drafter uses them directly."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, reshard_after_forward=True)
