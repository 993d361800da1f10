"""Where a drafter rank gets the target's side of each packed row.

A feature source answers two questions for the trainer: the target's output for R rows
(taps [R, T, K*H], the labels [R, A, B-1] and, with `loss.labels = "soft"`, the soft labels
[R, A, B-1, k]: `TargetOutputs`) and the target's frozen head (embedding and LM head, shared
with the drafter). Two implementations, chosen once by `open_feature_source`:

* `LocalTarget` (colocated placement): this rank holds the target and runs it on the row;
  `AheadTarget` with `target.forward_rows` > 1: it runs over the coming steps' rows at once;
* `RemoteTarget` (split placement, drafter ranks): a target rank ran it
  (`flashdraft.train.server`) and sent the result; the head came once, at start.

Shape legend: T tokens per row, A anchors, B block size, K taps, H hidden, V vocabulary,
k soft labels per position.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from flashdraft.data.inference import resolve_dtype
from flashdraft.log import get_logger
from flashdraft.model import varlen
from flashdraft.model.attention import Backend
from flashdraft.model.head import TargetHead
from flashdraft.model.target import (
    DTYPES,
    Target,
    TargetOutputs,
    decoder_layers,
    default_attention,
    load_target,
    set_precision,
)
from flashdraft.train.blocks import data_next_tokens, mix_argmax
from flashdraft.train.config import LossSection
from flashdraft.train.packing import Row
from flashdraft.train.parallel import (
    FeatureReceiver,
    compile_target,
    receive_head,
    shard_target,
    target_compile_refusal,
)
from flashdraft.train.plan import RunPlan
from flashdraft.train.step import DraftBatch

log = get_logger(__name__)

# R rows' input ids, positions, document ids ([R, T] each) and anchors ([R, A]) on the device.
RowOnDevice = tuple[Tensor, Tensor, Tensor, Tensor]


class FeatureSource(Protocol):
    @property
    def head(self) -> TargetHead:
        """The target's embedding and LM head, on this rank's device."""
        ...

    @property
    def target(self) -> Target | None:
        """The target itself when it runs on this rank (in-training eval), else None."""
        ...

    def row_outputs(self, rows: list[Row], on_device: RowOnDevice) -> TargetOutputs:
        """The taps [R, T, K*H], next tokens [R, A, B-1] and soft labels of `rows`."""
        ...


def device_put(device: torch.device) -> Callable[[Tensor], Tensor]:
    """A row tensor [T] -> [1, T] on `device`; on CUDA through pinned memory, asynchronously
    (no host sync)."""
    non_blocking = device.type == "cuda"

    def put(t: Tensor) -> Tensor:
        return (t.pin_memory() if non_blocking else t).to(device, non_blocking=non_blocking)[None]

    return put


def rows_on_device(rows: list[Row], put: Callable[[Tensor], Tensor]) -> RowOnDevice:
    """What the target's forward takes of `rows`, stacked on the device: [R, T] and [R, A]."""
    ids, positions, docs, anchors = (
        stack_put([getattr(r, name) for r in rows], put)
        for name in ("input_ids", "position_ids", "doc_ids", "anchors")
    )
    return ids, positions, docs, anchors


def stack_put(parts: list[Tensor], put: Callable[[Tensor], Tensor]) -> Tensor:
    """Per-row tensors on the device, one row after another along a new first dimension."""
    moved = [put(t) for t in parts]
    return moved[0] if len(moved) == 1 else torch.cat(moved)


def label_plan(rows: list[Row]) -> tuple[Tensor, Tensor]:
    """Where the target's labels are needed, once each: (needed [N] sorted indices into the
    rows' R*T packed tokens, index [R, A, B-1] into them). Blocks overlap: on a CPU count
    over a row like `bench/trainer.py`'s (documents of 300..3000 tokens, A = 512), its
    7,680 slots needed 4,074 distinct positions, so the label head runs on ~half the rows.
    On the CPU, from the rows: no host sync."""
    positions = torch.stack([r.label_positions for r in rows])  # [R, A, B-1]
    length = rows[0].input_ids.shape[0]
    flat = positions + torch.arange(len(rows))[:, None, None] * length
    needed, index = torch.unique(flat, return_inverse=True)
    return needed, index


def concat_outputs(outputs: list[TargetOutputs]) -> TargetOutputs:
    """Several rows' target outputs as one batch of rows (a split placement's drafter rank
    receives them row by row)."""
    if len(outputs) == 1:
        return outputs[0]

    def cat(name: str) -> Tensor | None:
        parts = [getattr(o, name) for o in outputs]
        return None if parts[0] is None else torch.cat(parts)

    features = cat("features")
    assert features is not None
    return TargetOutputs(features, cat("next_tokens"), cat("soft_ids"), cat("soft_probs"))


def rows_of(out: TargetOutputs, start: int, stop: int) -> TargetOutputs:
    """Rows [start, stop) of R rows' target outputs (views of the same tensors)."""

    def part(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[start:stop]

    return TargetOutputs(
        out.features[start:stop],
        part(out.next_tokens),
        part(out.soft_ids),
        part(out.soft_probs),
    )


def soft_label_width(loss: LossSection, vocab_size: int) -> int:
    """k, the soft labels per position the run's target sends (0 without soft labels)."""
    if loss.labels != "soft":
        return 0
    if loss.soft_top_k > vocab_size:
        raise ValueError(
            f"loss.soft_top_k = {loss.soft_top_k} exceeds the target's vocabulary of "
            f"{vocab_size} tokens; set it to at most {vocab_size}"
        )
    return loss.soft_top_k


def target_outputs(
    target: Target,
    rows: list[Row],
    on_device: RowOnDevice,
    put: Callable[[Tensor], Tensor],
    loss: LossSection,
    block: int,
) -> TargetOutputs:
    """The target's side of R rows in one forward: taps [R, T, K*H] and next tokens
    [R, A, B-1], the labels from the target's own predictions or, with `loss.labels =
    "data"`, from the rows' tokens; with `loss.labels = "soft"` also the target's top-k soft
    labels [R, A, B-1, k], `loss.argmax_mix` of their mass moved onto the argmax. Shared by
    the colocated trainer and the split placement's target ranks."""
    ids, positions, docs, anchors = on_device
    label_pos = label_index = None
    if loss.labels != "data":
        needed, index = label_plan(rows)
        label_pos, label_index = put(needed), put(index)[0]
    top_k = soft_label_width(loss, target.head.vocab_size)
    # A varlen target's document boundaries, from the rows' CPU ids (no host sync).
    segments = (
        varlen.document_segments(torch.stack([r.doc_ids for r in rows])) if target.varlen else None
    )
    out = target.packed_outputs(
        ids,
        positions,
        docs,
        label_pos,
        loss.chunk_rows,
        top_k,
        segments=segments,
        label_index=label_index,
    )
    if out.next_tokens is None:
        out.next_tokens = data_next_tokens(ids, anchors, block)
    if out.soft_ids is not None and out.soft_probs is not None:
        out.soft_probs = mix_argmax(out.soft_ids, out.soft_probs, out.next_tokens, loss.argmax_mix)
    return out


def draft_batch(
    source: FeatureSource, rows: list[Row], put: Callable[[Tensor], Tensor]
) -> DraftBatch:
    """The drafter's micro-batch of R rows: the rows on the device (`put`), stacked, with the
    target's taps and labels, soft ones included, from `source`."""
    on_device = rows_on_device(rows, put)
    out = source.row_outputs(rows, on_device)
    assert out.next_tokens is not None, "a feature source always fills the labels"
    ids, positions, docs, anchors = on_device
    return DraftBatch(
        input_ids=ids,
        position_ids=positions,
        doc_ids=docs,
        loss_mask=stack_put([r.loss_mask for r in rows], put),
        anchors=anchors,
        anchor_valid=stack_put([r.anchor_valid for r in rows], put),
        target_hidden=out.features,
        next_tokens=out.next_tokens,
        soft_ids=out.soft_ids,
        soft_probs=out.soft_probs,
    )


def load_run_target(plan: RunPlan, backend: Backend, target_model: Any = None) -> Target:
    """The run's target on this rank with its taps checked; its linear layers in
    `target.precision` (`set_precision`: fp8 converts them); its decoder layers sharded over
    every rank when `parallel.shard_target` (FSDP2); its packed forward compiled on CUDA
    unless `target.compile = false` (`compile_target`). `target_model` may be passed in
    already built (benchmarks, tests)."""
    config, device = plan.config, plan.info.device
    sharded = config.parallel.shard_target and plan.info.distributed
    if target_model is None:
        dtype = resolve_dtype(config.target.dtype, device.type)
        attn = varlen.implementation(
            config.target.attn_implementation or default_attention(config.target.path, device.type)
        )
        target_model = load_target(config.target.path, dtype, attn, "cpu" if sharded else device)
        if sharded:
            shard_target(decoder_layers(target_model))
            target_model.to(device)
    set_precision(target_model, config.target.precision)  # as loaded, or FP8 linear layers
    target = Target(target_model, plan.drafter_config.target_layer_ids, backend, sharded=sharded)
    target.verify_taps()
    if config.target.compile and device.type == "cuda":
        refusal = target_compile_refusal(target)
        if refusal is None:
            compile_target(target, scope=config.target.compile_scope)
        else:
            log.info(f"flashdraft train: the target's forward runs eagerly: {refusal}")
    return target


class LocalTarget:
    """Colocated placement: the target runs on this rank, `optim.rows_per_forward` rows at a
    time."""

    def __init__(self, target: Target, loss: LossSection, block: int, device: torch.device) -> None:
        self.target, self.head = target, target.head
        self.loss, self.block = loss, block
        self.put = device_put(device)

    def row_outputs(self, rows: list[Row], on_device: RowOnDevice) -> TargetOutputs:
        return target_outputs(self.target, rows, on_device, self.put, self.loss, self.block)


class AheadTarget:
    """Colocated placement with `target.forward_rows` = R > 1: the target runs over the rows
    of the coming steps R at a time (`run_ahead`, called by the trainer before each group of
    steps) and each row's outputs wait until the drafter's micro-batch asks for them. The
    outputs are the target's own, so the run trains as with R = 1, up to the target's
    rounding in a larger forward; the drafter's steps do not change. A group's last forward
    with fewer than R rows is padded to R with copies of its last row (their outputs
    dropped): the compiled target sees one shape, never a second compile."""

    def __init__(self, local: LocalTarget, rows: int) -> None:
        self.local, self.rows = local, rows
        self.target, self.head = local.target, local.head
        # Per row: the row, its forward's outputs, its index in them.
        self.held: deque[tuple[Row, TargetOutputs, int]] = deque()

    def run_ahead(self, rows: list[Row]) -> None:
        """The target's outputs of `rows` (the coming steps' rows, in stream order)."""
        if self.held:
            raise RuntimeError(
                f"the target ran ahead with {len(self.held)} row(s) of its last run unused"
            )
        for i in range(0, len(rows), self.rows):
            group = rows[i : i + self.rows]
            padded = group + [group[-1]] * (self.rows - len(group))
            out = self.local.row_outputs(padded, rows_on_device(padded, self.local.put))
            self.held.extend((row, out, r) for r, row in enumerate(group))

    def row_outputs(self, rows: list[Row], on_device: RowOnDevice) -> TargetOutputs:
        taken = []
        for row in rows:
            if not self.held or self.held[0][0] is not row:
                raise RuntimeError(
                    "the drafter asked for a row the target has not run ahead (the rows of a "
                    "step must come from the trainer's group, in order)"
                )
            taken.append(self.held.popleft())
        _, out, start = taken[0]
        if all(o is out and r == start + k for k, (_, o, r) in enumerate(taken)):
            return rows_of(out, start, start + len(taken))  # consecutive rows: a view, no copy
        return concat_outputs([rows_of(o, r, r + 1) for _, o, r in taken])


class RemoteTarget:
    """Split placement, drafter rank: outputs received from the feeding target rank, in row
    order (both sides walk the same positions of the same row stream)."""

    target: Target | None = None

    def __init__(self, receiver: FeatureReceiver, head: TargetHead) -> None:
        self.receiver, self.head = receiver, head

    def row_outputs(self, rows: list[Row], on_device: RowOnDevice) -> TargetOutputs:
        return concat_outputs([self.receiver.receive() for _ in rows])


# ---- the target's head, sent once from a target rank to the drafter ranks it feeds ----


def head_payload(head: TargetHead) -> list[Tensor]:
    """What goes over the wire: embedding table [V, H], LM head [V, H], embedding scale [1]."""
    embedding = getattr(head.embedding, "weight", None)
    assert isinstance(embedding, Tensor)
    scale = torch.tensor(
        [float(getattr(head.embedding, "embed_scale", 1.0))], device=head.weight.device
    )
    return [embedding, head.weight, scale.to(head.weight.dtype)]


class _ScaledEmbedding(nn.Module):
    def __init__(self, inner: nn.Embedding, scale: float) -> None:
        super().__init__()
        self.inner, self.embed_scale = inner, scale

    def forward(self, ids: Tensor) -> Tensor:
        return self.inner(ids) * self.embed_scale


def head_from_payload(payload: list[Tensor], text_config: Any) -> TargetHead:
    """The receiving end of `head_payload`: a TargetHead over the received tensors."""
    embedding_w, head_w, scale = payload
    embedding = nn.Embedding.from_pretrained(embedding_w, freeze=True)
    embed_scale = float(scale)
    module: nn.Module = (
        embedding if embed_scale == 1.0 else _ScaledEmbedding(embedding, embed_scale)
    )
    return TargetHead.from_parts(module, head_w, text_config)


def receive_target_head(plan: RunPlan, dtype: torch.dtype) -> TargetHead:
    """The target's embedding and LM head, received once from the feeding target rank (sent
    by `flashdraft.train.server.serve_target`)."""
    vocab, hidden = plan.drafter_config.vocab_size, plan.drafter_config.hidden_size
    payload = receive_head(
        [(vocab, hidden), (vocab, hidden), (1,)], dtype, plan.info.device, plan.placement.feeder
    )
    return head_from_payload(payload, plan.target_config.get_text_config())


def open_feature_source(plan: RunPlan, backend: Backend, target_model: Any = None) -> FeatureSource:
    """This drafter rank's source: its own target (colocated) or its feeding target rank
    (split). The one place that looks at the placement's role on a drafter rank."""
    config, block = plan.config, plan.drafter_config.block_size
    if plan.placement.role != "drafter":
        target = load_run_target(plan, backend, target_model)
        local = LocalTarget(target, config.loss, block, plan.info.device)
        rows = config.target.forward_rows
        return AheadTarget(local, rows) if rows > 1 else local
    dtype = DTYPES[resolve_dtype(config.target.dtype, plan.info.device.type)]
    head = receive_target_head(plan, dtype)
    taps = plan.drafter_config.num_taps * plan.drafter_config.hidden_size
    receiver = FeatureReceiver(
        plan.placement.feeder,
        (1, config.data.row_tokens, taps),
        (1, config.loss.anchors, block - 1),
        dtype,
        plan.info.device,
        config.parallel.queue_depth,
        total=plan.rows_left,
        soft_width=soft_label_width(config.loss, plan.drafter_config.vocab_size),
    )
    return RemoteTarget(receiver, head)
