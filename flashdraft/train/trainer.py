"""`flashdraft train`: a DFlash drafter trained online against a frozen target.

Per optimizer step, on every rank: G packed rows, each through the target (taps + argmax
labels at the anchor blocks only) and then through the drafter forward and backward; after
G rows: clip, AdamW (fp32 master weights, bf16 compute on CUDA), LR schedule. The loss
normaliser of the step, the global trained-slot weight (SPEC trap 10), is known from the CPU
rows before any forward and is all-reduced once per step.

    flashdraft train --config run.toml [--set optim.lr=3e-4 ...] [--resume]
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from flashdraft import storage
from flashdraft.data.inference import resolve_dtype
from flashdraft.export import load_dflash, save_dflash, verify_export
from flashdraft.model.attention import Backend, default_backend
from flashdraft.model.config import DrafterConfig, choose_mask_token_id
from flashdraft.model.drafter import DFlashDrafter, init_seeded, param_count
from flashdraft.model.head import TargetHead
from flashdraft.model.target import DTYPES, Target, decoder_layers, load_target
from flashdraft.train import preflight
from flashdraft.train.blocks import data_next_tokens, slot_weights
from flashdraft.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from flashdraft.train.config import LossSection, OptimSection, RunConfig
from flashdraft.train.loss import BlockStats
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.packing import Row, RowStream
from flashdraft.train.parallel import (
    DistInfo,
    FeatureChannel,
    Placement,
    assign_placement,
    barrier,
    compile_drafter,
    dp_all_reduce_sum,
    dp_barrier,
    gradient_sync,
    init_distributed,
    receive_head,
    send_head,
    shard_target,
    shutdown,
    wrap_drafter,
)
from flashdraft.train.step import DraftBatch, draft_loss


def lr_at(step: int, total: int, optim: OptimSection) -> float:
    """Warmup, then cosine to min_lr_ratio, warmup-stable-decay (linear), or constant."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    floor = optim.min_lr_ratio
    if optim.schedule == "constant":
        return optim.lr
    if optim.schedule == "cosine":
        progress = (step - optim.warmup_steps) / max(1, total - optim.warmup_steps)
        return optim.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
    decay_start = total - int(optim.decay_ratio * total)
    if step < decay_start:
        return optim.lr
    progress = (step - decay_start) / max(1, total - decay_start)
    return optim.lr * (1 - (1 - floor) * min(progress, 1.0))


class Stopwatch:
    """Phase times without host syncs in the step: CUDA events, read only when logging."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list[Any]] = {}

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, name: str, start: Any, end: Any) -> None:
        self.spans.setdefault(name, []).append((start, end))

    def seconds(self, name: str) -> float:
        """Total seconds of a phase since the last call (syncs on CUDA)."""
        spans = self.spans.pop(name, [])
        if self.cuda:
            if spans:
                spans[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1e3
        return float(sum(b - a for a, b in spans))


@dataclass(slots=True)
class Interval:
    """What accumulates between two log lines (device tensors: no sync in the step)."""

    stats: BlockStats | None = None
    steps: int = 0
    tokens: int = 0
    rows: int = 0
    started: float = field(default_factory=time.perf_counter)


def build_drafter_config(config: RunConfig, target_config: Any) -> tuple[DrafterConfig, str]:
    """Drafter geometry from the target and the run config; returns (config, mask note)."""
    section = config.drafter
    if section.mask_token_id is not None:
        mask_id, why = section.mask_token_id, "set in the run config"
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.target.path)
        mask_id, why = choose_mask_token_id(target_config, tokenizer)
    drafter_config = DrafterConfig.from_target_config(
        target_config,
        mask_token_id=mask_id,
        num_layers=section.num_layers,
        block_size=section.block_size,
        target_layer_ids=section.target_layer_ids,
        sliding_window=section.sliding_window,
        sliding_layers=section.sliding_layers,
        intermediate_size=section.intermediate_size,
    )
    return drafter_config, why


def load_drafter_init(config: RunConfig, drafter_config: DrafterConfig) -> DFlashDrafter:
    seed = config.seed if config.drafter.init_seed is None else config.drafter.init_seed
    if config.drafter.init_from is None:
        return init_seeded(drafter_config, seed)
    warm = load_dflash(config.drafter.init_from, dtype=torch.float32)
    if warm.config.target_layer_ids != drafter_config.target_layer_ids or (
        warm.config.hidden_size != drafter_config.hidden_size
    ):
        raise ValueError(
            f"drafter.init_from {config.drafter.init_from}: its taps "
            f"{warm.config.target_layer_ids} / hidden {warm.config.hidden_size} do not match "
            f"this target ({drafter_config.target_layer_ids} / {drafter_config.hidden_size})"
        )
    return warm


@dataclass(slots=True)
class RunPlan:
    """What every rank of a run agrees on before any weight is loaded."""

    config: RunConfig
    info: DistInfo
    placement: Placement
    target_config: Any
    drafter_config: DrafterConfig
    mask_note: str
    stream: RowStream
    dataset: Any
    total_rows: int
    total_steps: int
    start_step: int
    start_cursor: int
    resume_from: str | None

    @property
    def rows_per_step(self) -> int:
        return self.placement.dp_world * self.config.optim.grad_accum

    def positions(self, dp_rank: int) -> Any:
        """Stream positions of dp replica `dp_rank`'s rows, step after step, from the cursor."""
        g = self.config.optim.grad_accum
        base = self.start_cursor
        for _ in range(self.start_step, self.total_steps):
            for m in range(g):
                yield base + dp_rank * g + m
            base += self.rows_per_step


def plan_run(
    config: RunConfig, info: DistInfo, resume: bool, target_config: Any = None, dataset: Any = None
) -> RunPlan:
    from transformers import AutoConfig

    placement = assign_placement(info, config.parallel.placement, config.parallel.target_ranks)
    existing = latest_checkpoint(config.output)
    if existing is not None and not resume:
        raise FileExistsError(
            f"{config.output} already holds checkpoints (latest {existing}); pass --resume "
            "to continue that run or choose a new output"
        )
    if info.is_main:
        storage.makedirs(config.output)
        storage.write_json_atomic(storage.join(config.output, "config.json"), config.to_dict())
    barrier(info)
    if target_config is None:
        target_config = AutoConfig.from_pretrained(config.target.path, trust_remote_code=False)
    drafter_config, mask_note = build_drafter_config(config, target_config)
    if dataset is None:
        from flashdraft.data.dataset import open_datasets

        dataset = open_datasets(config.data.datasets)
    stream = RowStream(
        dataset.num_tokens,
        dataset.sample,
        row_tokens=config.data.row_tokens,
        num_anchors=config.loss.anchors,
        block_size=drafter_config.block_size,
        seed=config.seed,
        epochs=config.optim.epochs,
        overlong=config.data.overlong,
        shuffle=config.data.shuffle,
        pad_id=int(getattr(target_config, "pad_token_id", None) or 0),
    )
    total_rows = stream.total_rows()
    rows_per_step = placement.dp_world * config.optim.grad_accum
    total_steps = total_rows // rows_per_step
    if config.optim.max_steps is not None:
        total_steps = min(total_steps, config.optim.max_steps)
    if total_steps < 1:
        raise ValueError(
            f"the data makes {total_rows} packed rows of {config.data.row_tokens} tokens, "
            f"fewer than one step needs ({placement.dp_world} drafter replica(s) x grad_accum "
            f"{config.optim.grad_accum}); lower data.row_tokens or add data"
        )
    resume_from = existing if resume else None
    step = cursor = 0
    if resume_from is not None:
        state = storage.read_json(storage.join(resume_from, "state.json"))
        step, cursor = int(state["step"]), int(state["cursor"])
    return RunPlan(
        config,
        info,
        placement,
        target_config,
        drafter_config,
        mask_note,
        stream,
        dataset,
        total_rows,
        total_steps,
        step,
        cursor,
        resume_from,
    )


def _load_target(plan: RunPlan, target_model: Any, backend: Backend) -> Target:
    config, device = plan.config, plan.info.device
    sharded = config.parallel.shard_target and plan.info.distributed
    if target_model is None:
        dtype = resolve_dtype(config.target.dtype, device.type)
        attn = config.target.attn_implementation or (
            "flex_attention" if device.type == "cuda" else "sdpa"
        )
        target_model = load_target(config.target.path, dtype, attn, "cpu" if sharded else device)
        if sharded:
            shard_target(decoder_layers(target_model))
            target_model.to(device)
    target = Target(
        target_model,
        plan.drafter_config.target_layer_ids,
        backend,
        sharded=sharded,
    )
    target.verify_taps()
    return target


def _head_tensors(head: TargetHead) -> list[Tensor]:
    embedding = getattr(head.embedding, "weight", None)
    assert isinstance(embedding, Tensor)
    scale = torch.tensor(
        [float(getattr(head.embedding, "embed_scale", 1.0))], device=head.weight.device
    )
    return [embedding, head.weight, scale.to(head.weight.dtype)]


def _remote_head(plan: RunPlan, dtype: torch.dtype) -> TargetHead:
    """The target's embedding and LM head, received once from the feeding target rank."""
    vocab, hidden = plan.drafter_config.vocab_size, plan.drafter_config.hidden_size
    embedding_w, head_w, scale = receive_head(
        [(vocab, hidden), (vocab, hidden), (1,)], dtype, plan.info.device, plan.placement.feeder
    )
    embedding = nn.Embedding.from_pretrained(embedding_w, freeze=True)
    embed_scale = float(scale)
    module: nn.Module = (
        embedding if embed_scale == 1.0 else _ScaledEmbedding(embedding, embed_scale)
    )
    return TargetHead.from_parts(module, head_w, plan.target_config.get_text_config())


class _ScaledEmbedding(nn.Module):
    def __init__(self, inner: nn.Embedding, scale: float) -> None:
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, ids: Tensor) -> Tensor:
        return self.inner(ids) * self.scale


def serve_target(plan: RunPlan, target_model: Any = None) -> None:
    """Split placement, target rank: run the target for the drafters it feeds, forever ahead
    of them by at most `parallel.queue_depth` rows each."""
    config, info = plan.config, plan.info
    backend = default_backend(info.device)
    target = _load_target(plan, target_model, backend)
    consumers = plan.placement.consumers(info.rank)
    send_head(_head_tensors(target.head), consumers)
    channels = {
        peer: FeatureChannel(
            peer, (), (), target.head.weight.dtype, info.device, config.parallel.queue_depth
        )
        for peer in consumers
    }
    streams = {
        peer: plan.stream.iterate(
            plan.positions(plan.placement.drafter_ranks.index(peer)),
            config.data.prefetch if config.parallel.overlap else 0,
        )
        for peer in consumers
    }
    block = plan.drafter_config.block_size
    for _ in range(plan.start_step, plan.total_steps):
        for peer in consumers:
            for _ in range(config.optim.grad_accum):
                row = next(streams[peer])
                put = device_put(info.device)
                on_device = (put(row.input_ids), put(row.position_ids), put(row.doc_ids))
                features, next_tokens = target_outputs(
                    target, row, (*on_device, put(row.anchors)), put, config.loss, block
                )
                channels[peer].send(features, next_tokens)
    for channel in channels.values():
        channel.flush()


def device_put(device: torch.device) -> Callable[[Tensor], Tensor]:
    """A row tensor [T] -> [1, T] on `device`; on CUDA through pinned memory, asynchronously
    (no host sync)."""
    non_blocking = device.type == "cuda"

    def put(t: Tensor) -> Tensor:
        return (t.pin_memory() if non_blocking else t).to(device, non_blocking=non_blocking)[None]

    return put


def target_outputs(
    target: Target,
    row: Row,
    on_device: tuple[Tensor, Tensor, Tensor, Tensor],
    put: Callable[[Tensor], Tensor],
    loss: LossSection,
    block: int,
) -> tuple[Tensor, Tensor]:
    """The target's side of one row: (taps [1, T, K*H], next tokens [1, A, B-1]), the labels
    from the target's own predictions or, with `loss.labels = "data"`, from the row's tokens.
    `on_device`: the row's ids, positions, document ids and anchors, already put. Shared by
    the colocated trainer and the split placement's target ranks."""
    ids, positions, docs, anchors = on_device
    label_pos = put(row.label_positions) if loss.labels == "target" else None
    features, next_tokens = target.forward_packed(ids, positions, docs, label_pos, loss.chunk_rows)
    if next_tokens is None:
        next_tokens = data_next_tokens(ids, anchors, block)
    return features, next_tokens


class Trainer:
    """The drafter side of a run: colocated (with its own target) or split (fed by a target
    rank). `target_model` and `dataset` may be passed in already built (benchmarks, tests)."""

    def __init__(self, plan: RunPlan, target_model: Any = None) -> None:
        config, info = plan.config, plan.info
        self.plan, self.config, self.info = plan, config, info
        self.placement = plan.placement
        self.device = info.device
        self.backend = default_backend(self.device)
        self.run_dir = config.output
        self.drafter_config = plan.drafter_config
        self.stream, self.dataset = plan.stream, plan.dataset
        self.total_steps, self.rows_per_step = plan.total_steps, plan.rows_per_step
        self.block = self.drafter_config.block_size
        gamma = config.loss.gamma if config.loss.gamma is not None else 7.0 * self.block / 16
        self.slot_w = slot_weights(self.block, gamma).to(self.device)
        self.slot_w_cpu = self.slot_w.cpu().double()

        if config.preflight:  # before any weight is loaded
            with torch.device("meta"):
                drafter_params = param_count(DFlashDrafter(self.drafter_config))
            estimate = preflight.check(
                config, self.drafter_config, plan.target_config, drafter_params, self.device
            )
            if self.placement.is_logger and self.device.type == "cuda":
                print(f"flashdraft train: memory estimate per GPU\n{estimate.table()}", flush=True)
        self.target: Target | None = None
        self.channel: FeatureChannel | None = None
        if self.placement.role == "drafter":
            dtype = DTYPES[resolve_dtype(config.target.dtype, self.device.type)]
            self.head = _remote_head(plan, dtype)
            self.channel = FeatureChannel(
                self.placement.feeder,
                (
                    1,
                    config.data.row_tokens,
                    self.drafter_config.num_taps * self.drafter_config.hidden_size,
                ),
                (1, config.loss.anchors, self.block - 1),
                dtype,
                self.device,
                config.parallel.queue_depth,
            )
        else:
            self.target = _load_target(plan, target_model, self.backend)
            self.head = self.target.head

        self.drafter = load_drafter_init(config, self.drafter_config).to(self.device)
        if config.compile and self.device.type == "cuda":
            compile_drafter(self.drafter)
        self.model = wrap_drafter(
            self.drafter,
            info,
            config.parallel.drafter_sharding,
            self.placement.group,
            self.placement.dp_world,
        )
        optim = config.optim
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(),
            lr=optim.lr,
            betas=(optim.betas[0], optim.betas[1]),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.step, self.cursor = plan.start_step, plan.start_cursor
        if plan.resume_from is not None:
            load_checkpoint(plan.resume_from, self.drafter, self.optimizer)
        self.logger = (
            MetricsLogger(
                self.run_dir,
                resume_step=self.step if plan.resume_from else None,
                tensorboard=config.log.tensorboard,
                wandb_project=config.log.wandb_project if config.log.wandb else None,
                config=config.to_dict(),
            )
            if self.placement.is_logger
            else None
        )
        self.stopwatch = Stopwatch(self.device)
        self._remaining = (plan.total_steps - plan.start_step) * config.optim.grad_accum
        # The same decision on every rank (logging is collective); only the logger evaluates.
        self.eval_on = config.eval.every > 0 and self.target is not None
        self.eval_prompts = self._eval_prompts()
        self.best_tau = self._best_so_far()
        if self.placement.is_logger:
            self._announce()

    def _announce(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        c, plan = self.drafter_config, self.plan
        where = (
            f"{self.placement.dp_world} drafter replica(s)"
            if self.placement.kind == "colocated"
            else f"{len(self.placement.target_ranks)} target + {self.placement.dp_world} drafter rank(s)"
        )
        long_samples = int((self.stream.num_tokens > self.config.data.row_tokens).sum())
        # What the modules are, not what was asked for: a sharding that did not happen shows.
        if isinstance(self.drafter.layers[0], FSDPModule):
            where += " (drafter sharded, FSDP2)"
        if self.target is not None and isinstance(decoder_layers(self.target.model)[0], FSDPModule):
            where += f"; target layers sharded over {self.info.world} ranks (FSDP2)"
        print(
            f"flashdraft train: target {self.config.target.path} "
            f"({c.num_target_layers} layers), taps {c.target_layer_ids}, "
            f"mask token {c.mask_token_id} ({plan.mask_note})\n"
            f"  drafter {c.num_hidden_layers} layers x {c.hidden_size}, "
            f"{param_count(self.drafter) / 1e6:.1f}M params, B={c.block_size}, "
            f"A={self.config.loss.anchors}; {len(self.dataset)} samples -> {plan.total_rows} rows "
            f"of {self.config.data.row_tokens} tokens over {self.config.optim.epochs} epoch(s); "
            f"{self.total_steps} steps of {self.rows_per_step} rows; {self.placement.kind}: {where}"
            + (
                f"\n  {long_samples:,} sample(s) longer than a row: "
                f"{self.config.data.overlong} (data.overlong)"
                if long_samples
                else ""
            )
            + (
                f"\n  resuming from {plan.resume_from} at step {self.step}"
                if plan.resume_from
                else ""
            ),
            flush=True,
        )

    # ---- in-training eval: the real decode loop on held-out prompts ----

    def _eval_prompts(self) -> list[Any]:
        section = self.config.eval
        if section.every <= 0:
            return []
        if section.prompts is None:
            raise ValueError("eval.every > 0 needs eval.prompts (a JSONL file of held-out prompts)")
        if not self.placement.is_logger:
            return []
        if self.target is None:
            print(
                "flashdraft train: in-training eval needs the target on the logging rank; with "
                "the split placement it is skipped (run `flashdraft eval` on checkpoints)",
                flush=True,
            )
            return []
        from transformers import AutoTokenizer

        from flashdraft.eval.evaluate import load_prompts

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.target.path)
        return load_prompts(section.prompts, self.tokenizer, limit=section.num_prompts)

    def _best_so_far(self) -> float:
        url = storage.join(self.run_dir, "best", "best.json")
        if self.plan.resume_from is None or not storage.exists(url):
            return float("-inf")
        return float(storage.read_json(url)["eval_tau"])

    def _full_drafter(self) -> DFlashDrafter:
        """The whole drafter as one module, for eval copies and exports. Sharded (FSDP2) it is
        gathered: a collective over the drafter replicas, so every drafter rank calls this."""
        if self.config.parallel.drafter_sharding != "fsdp" or self.placement.dp_world <= 1:
            return self.drafter
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        full = DFlashDrafter(self.drafter_config)
        full.load_state_dict(get_model_state_dict(self.drafter, options=options))
        return full.to(self.device)

    def _evaluate(self, drafter: DFlashDrafter) -> dict[str, Any]:
        """eval_* fields for this step's record; keeps the best-by-tau serving export.
        `drafter` is the whole drafter (`_full_drafter`)."""
        from flashdraft.eval.evaluate import evaluate_drafter

        assert self.target is not None
        # An eager bf16/fp32 copy: the decode context grows every step, which the compiled
        # (static-shape) training layers must not see.
        eager = DFlashDrafter(self.drafter_config)
        eager.load_state_dict(drafter.state_dict())
        eager.to(self.device, self.head.weight.dtype).eval()
        report = evaluate_drafter(
            self.target.model,
            self.tokenizer,
            eager,
            self.eval_prompts,
            max_new_tokens=self.config.eval.max_new_tokens,
            reference=False,
            taps=self.target.taps,
        )
        tau = float(report["tau"] or 1.0)
        fields = {
            "eval_tau": round(tau, 4),
            "eval_per_position_acceptance": [
                round(float(x), 4) for x in report["per_position_acceptance"]
            ],
        }
        if tau > self.best_tau:
            self.best_tau = tau
            best = storage.join(self.run_dir, "best")
            save_dflash(drafter, best)
            storage.write_json_atomic(
                storage.join(best, "best.json"), {"step": self.step, "eval_tau": tau}
            )
        return fields

    # ---- the step ----

    def _batch(self, row: Row) -> DraftBatch:
        put = device_put(self.device)
        on_device = (put(row.input_ids), put(row.position_ids), put(row.doc_ids), put(row.anchors))
        ids, positions, docs, anchors = on_device
        if self.channel is not None:
            features, next_tokens = self.channel.receive(self._remaining)
            self._remaining -= 1
        else:
            assert self.target is not None
            features, next_tokens = target_outputs(
                self.target, row, on_device, put, self.config.loss, self.block
            )
        return DraftBatch(
            input_ids=ids,
            position_ids=positions,
            doc_ids=docs,
            loss_mask=put(row.loss_mask),
            anchors=anchors,
            anchor_valid=put(row.anchor_valid),
            target_hidden=features,
            next_tokens=next_tokens,
        )

    def train_step(self, rows: list[Row], interval: Interval) -> Tensor:
        # The global loss normaliser: known from the CPU rows, one all-reduce per step. The
        # copy to the device goes through pinned memory, asynchronously: no host sync.
        local = sum((r.normaliser_mask.double() * self.slot_w_cpu).sum() for r in rows)
        assert isinstance(local, Tensor)
        if self.device.type == "cuda":
            local = local.reshape(1).pin_memory()
        normaliser = (
            dp_all_reduce_sum(local.to(self.device, non_blocking=True), self.placement)
            .float()
            .reshape(())
        )
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        for m, row in enumerate(rows):
            t0 = self.stopwatch.mark()
            batch = self._batch(row)
            t1 = self.stopwatch.mark()
            last = m == len(rows) - 1
            with gradient_sync(self.model, enabled=last):  # reduce on the last row only
                with autocast:
                    loss, stats = draft_loss(
                        self.drafter,
                        self.head,
                        batch,
                        self.slot_w,
                        normaliser,
                        self.backend,
                        self.config.loss.chunk_rows,
                        forward=self.model,
                    )
                # Data parallel wrappers average gradients over ranks; the loss is already
                # this rank's share of the global sum, so undo the average.
                (loss * self.placement.dp_world).backward()
            t2 = self.stopwatch.mark()
            self.stopwatch.add("target", t0, t1)
            self.stopwatch.add("drafter", t1, t2)
            interval.stats = stats if interval.stats is None else interval.stats.add(stats)
            interval.tokens += row.tokens
            interval.rows += 1
        grad_norm = nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.optim.grad_clip)
        lr = lr_at(self.step, self.total_steps, self.config.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        interval.steps += 1
        return grad_norm

    def _log(
        self,
        interval: Interval,
        grad_norm: Tensor,
        progress: Any,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        assert interval.stats is not None
        counts = torch.tensor(
            [interval.tokens, interval.rows], dtype=torch.float64, device=self.device
        )
        flat = dp_all_reduce_sum(torch.cat([interval.stats.flat(), counts]), self.placement)  # sync
        summary = BlockStats.from_flat(flat[:-2], self.block).summary()
        tokens, rows = int(flat[-2]), int(flat[-1])
        wall = time.perf_counter() - interval.started
        epoch, _ = self.stream.locate(min(self.cursor, self.plan.total_rows - 1))
        record = {
            "step": self.step,
            "epoch": epoch,
            "loss": round(summary["loss"], 5),
            "tau_hat": round(summary["tau_hat"], 4),
            "acc": summary["acc"],
            "lr": lr_at(self.step - 1, self.total_steps, self.config.optim),
            "grad_norm": round(float(grad_norm), 4),
            "tokens_per_s": round(tokens / wall, 1),
            "target_s": round(self.stopwatch.seconds("target") / interval.steps, 4),
            "drafter_s": round(self.stopwatch.seconds("drafter") / interval.steps, 4),
            "step_s": round(wall / interval.steps, 4),
            "rows": rows,
            "tokens": tokens,
            "trained_slots": summary["trained_tokens"],
            "blocks": summary["blocks"],
            **(extra or {}),
        }
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"loss is {record['loss']} at step {self.step}; stopping")
        if self.logger is not None:
            self.logger.log(record)
        if progress is not None:
            progress.set_postfix(
                loss=f"{record['loss']:.3f}",
                tau=f"{record['tau_hat']:.2f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
            )
        return record

    def _checkpoint(self) -> None:
        save_checkpoint(
            self.run_dir,
            self.step,
            self.drafter,
            self.optimizer,
            {
                "cursor": self.cursor,
                "total_steps": self.total_steps,
                "dp_world": self.placement.dp_world,
            },
            keep=self.config.checkpoint.keep,
            is_main=self.placement.is_logger,
        )
        if self.logger is not None:
            self.logger.sync()
        dp_barrier(self.placement)

    def fit(self) -> dict[str, Any]:
        from tqdm import tqdm

        config = self.config
        progress = (
            tqdm(
                total=self.total_steps,
                initial=self.step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
            )
            if self.placement.is_logger and config.log.progress
            else None
        )
        rows = self.stream.iterate(
            self.plan.positions(self.placement.dp_rank),
            config.data.prefetch if config.parallel.overlap else 0,
        )
        interval, last_record = Interval(), {}
        g = config.optim.grad_accum
        while self.step < self.total_steps:
            step_rows = [next(rows) for _ in range(g)]
            grad_norm = self.train_step(step_rows, interval)
            self.step += 1
            self.cursor += self.rows_per_step
            if progress is not None:
                progress.update(1)
            checkpoint_now = (
                config.checkpoint.every > 0 and self.step % config.checkpoint.every == 0
            )
            finished = self.step == self.total_steps
            eval_now = self.eval_on and (self.step % config.eval.every == 0 or finished)
            # Log at every checkpoint too, so a resumed run logs exactly the same intervals.
            if self.step % config.log.every == 0 or checkpoint_now or finished or eval_now:
                extra = {}
                if eval_now:
                    whole = self._full_drafter()  # every drafter rank: gathering is collective
                    extra = self._evaluate(whole) if self.placement.is_logger else {}
                last_record = self._log(interval, grad_norm, progress, extra)
                interval = Interval()
            if checkpoint_now or finished:
                self._checkpoint()
        if progress is not None:
            progress.close()
        whole = self._full_drafter()
        if self.placement.is_logger:
            export = storage.join(self.run_dir, "export")
            save_dflash(whole, export)
            verify_export(whole, export)
            print(f"flashdraft train: done; serving-format drafter in {export}", flush=True)
        if self.logger is not None:
            self.logger.close()
        barrier(self.info)
        return last_record


def train(
    config: RunConfig, resume: bool = False, target_model: Any = None, dataset: Any = None
) -> dict[str, Any]:
    """Run (or resume) a training run on this process's rank; returns the last logged metrics
    record on the logging rank (empty elsewhere)."""
    info = init_distributed(config.device)
    record: dict[str, Any] = {}
    try:
        torch.manual_seed(config.seed + info.rank)
        target_config = target_model.config if target_model is not None else None
        plan = plan_run(config, info, resume, target_config, dataset)
        if plan.placement.role == "target":
            serve_target(plan, target_model)
            barrier(info)
        else:
            record = Trainer(plan, target_model).fit()
    finally:
        shutdown(info)
    if record:
        print(json.dumps({"final": record}), flush=True)
    return record
