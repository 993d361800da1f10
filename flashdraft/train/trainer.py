"""`flashdraft train`: a DFlash drafter trained online against a frozen target.

Per optimizer step, on every drafter rank: G packed rows, each through the target (taps +
argmax labels at the anchor blocks only; `features`) and then through the drafter forward and
backward; after G rows: clip, AdamW (fp32 master weights, bf16 compute on CUDA), LR schedule.
The loss normaliser of the step, the global trained-slot weight (docs/design.md §8 trap 10), is known from
the CPU rows before any forward and is all-reduced once per step. With `target.forward_rows`
= R > 1 the target runs ahead over the rows of the next R / G steps at once (`StepRows`).

`train` is the entry point of every rank: it plans the run (`plan`), then a target rank of
the split placement serves the target (`server`) and a drafter rank runs `Trainer.fit`.

    flashdraft train --config run.toml [--set optim.lr=3e-4 ...] [--resume [--allow-config-change]]
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from flashdraft import storage
from flashdraft.export import save_dflash, verify_export
from flashdraft.log import get_logger, trace
from flashdraft.model.attention import default_backend
from flashdraft.model.drafter import DFlashDrafter, param_count
from flashdraft.model.target import DTYPES, decoder_layers
from flashdraft.train import preflight
from flashdraft.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_dir,
)
from flashdraft.train.config import RunConfig
from flashdraft.train.features import (
    AheadTarget,
    RemoteTarget,
    device_put,
    draft_batch,
    open_feature_source,
)
from flashdraft.train.held_out import HeldOutEval
from flashdraft.train.layout import resolve_placement
from flashdraft.train.lock import RunLock, RunLocked, describe
from flashdraft.train.loss import BlockStats, dpace_alpha_of, loss_slot_weights
from flashdraft.train.metrics import MetricsLogger
from flashdraft.train.optim import FiniteGuard, build_optimizer, members
from flashdraft.train.packing import Row
from flashdraft.train.parallel import (
    DistInfo,
    barrier,
    compile_drafter,
    dp_all_reduce_sum,
    dp_barrier,
    gradient_sync,
    init_distributed,
    shutdown,
    vote_stop,
    wrap_drafter,
)
from flashdraft.train.plan import RunPlan, initial_drafter, plan_run
from flashdraft.train.schedule import Stopwatch, lr_at, time_spent
from flashdraft.train.server import serve_target
from flashdraft.train.step import DraftBatch, draft_loss
from flashdraft.train.step_rows import PHASES, Interval, StepRows
from flashdraft.train.stopping import (
    EXIT_CODE,
    StopRequest,
    TrainingStopped,
    is_stop_point,
)

log = get_logger(__name__)


class Trainer:
    """The drafter side of a run. Where the target's features come from (this rank's own
    target, or a target rank) is the feature source's business, not the trainer's.
    `target_model` may be passed in already built (benchmarks, tests); `sigterm`: the flag it
    reads at every log point (`train/stopping.py`; None: never stops early)."""

    def __init__(
        self,
        plan: RunPlan,
        target_model: Any = None,
        sigterm: StopRequest | None = None,
        lock: RunLock | None = None,
    ) -> None:
        started = time.perf_counter()  # the set-up's time, by part, goes into the banner
        self.lock = lock  # the run directory's lease, on the rank that holds it
        config, info = plan.config, plan.info
        self.plan, self.config, self.info = plan, config, info
        self.placement = plan.placement
        self.sigterm = sigterm
        self.stop_agreed = False  # some replica had a SIGTERM by the last log point
        self.device = info.device
        self.backend = default_backend(self.device)
        self.run_dir = config.output
        self.drafter_config = plan.drafter_config
        self.stream, self.dataset = plan.stream, plan.dataset
        self.total_steps, self.rows_per_step = plan.total_steps, plan.rows_per_step
        self.block = self.drafter_config.block_size
        self.slot_w = loss_slot_weights(config.loss, self.block).to(self.device)
        self.dpace_alpha = dpace_alpha_of(config.loss)
        self.residual_dtype = DTYPES.get(config.drafter.residual_dtype)  # "auto": None
        self.slot_w_cpu = self.slot_w.cpu().double()

        if config.preflight:  # before any weight is loaded
            with torch.device("meta"):
                drafter_params = param_count(DFlashDrafter(self.drafter_config))
            # A target model handed in already sits in GPU memory: not free, not to allocate.
            resident = sum(
                p.numel() * p.element_size()
                for p in (target_model.parameters() if target_model is not None else ())
                if p.device.type == "cuda"
            )
            estimate = preflight.check(
                config,
                self.drafter_config,
                plan.target_config,
                drafter_params,
                self.device,
                resident=float(resident),
            )
            if self.placement.is_logger and self.device.type == "cuda":
                log.info(f"flashdraft train: memory estimate per GPU\n{estimate.table()}")
        self.source = open_feature_source(plan, self.backend, target_model)
        self.target, self.head = self.source.target, self.source.head
        self.head.check_drafter(self.drafter_config)  # what the export will tell the engines
        target_ready = time.perf_counter()

        resuming = plan.resume_from is not None
        self.drafter = initial_drafter(config, self.drafter_config, resuming=resuming)
        self.drafter = self.drafter.to(self.device)
        self.drafter.set_activation_checkpointing(config.drafter.activation_checkpointing)
        if config.compile and self.device.type == "cuda":
            compile_drafter(self.drafter)
        self.model = wrap_drafter(
            self.drafter,
            info,
            config.parallel.drafter_sharding,
            self.placement.group,
            self.placement.dp_world,
        )
        self.optimizer = build_optimizer(self.drafter, config.optim, self.device)
        self.step, self.cursor = plan.start_step, plan.start_cursor
        self.empty_steps = 0  # steps of this process (not of a resumed run's earlier ones)
        # with no trained token, warned about at each log
        if plan.resume_from is not None:  # verified by plan_run
            load_checkpoint(plan.resume_from, self.drafter, self.optimizer, verify=False)
        self.guard = FiniteGuard(self.optimizer, self.device, self.step)
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
        # `held_out.on`: the same on every rank (logging is collective); the logger evaluates
        self.held_out = HeldOutEval(config, self.target, self.placement.is_logger, resuming)
        self.saved, self.checkpoint_s = 0, 0.0  # checkpoints this process wrote, their time
        done = time.perf_counter()
        self.setup_s = {
            "plan and data": plan.planned_s,
            "memory check and target": target_ready - started,
            "drafter, optimizer and eval": done - target_ready,
        }
        if self.placement.is_logger:
            log.info(self._banner())

    def _banner(self) -> str:
        c, plan, config = self.drafter_config, self.plan, self.config
        where = (
            f"{self.placement.dp_world} drafter replica(s)"
            if self.placement.kind == "colocated"
            else f"{len(self.placement.target_ranks)} target + {self.placement.dp_world} drafter rank(s)"
        )
        long_samples = int((self.stream.num_tokens > config.data.row_tokens).sum())
        # What the modules are, not what was asked for: a sharding that did not happen shows.
        if isinstance(self.drafter.layers[0], FSDPModule):
            where += " (drafter sharded, FSDP2)"
        if isinstance(self.source, AheadTarget):
            where += f"; the target runs ahead, {self.source.rows} rows a forward"
        if self.target is not None and isinstance(decoder_layers(self.target.model)[0], FSDPModule):
            where += f"; target layers sharded over {self.info.world} ranks (FSDP2)"
        lines = [
            f"flashdraft train: target {config.target.path} ({c.num_target_layers} layers), "
            f"taps {c.target_layer_ids}, mask token {c.mask_token_id} ({plan.mask_note})",
            f"  drafter {c.num_hidden_layers} layers x {c.hidden_size}, "
            f"{param_count(self.drafter) / 1e6:.1f}M params, B={c.block_size}, "
            f"A={config.loss.anchors}; {len(self.dataset)} samples -> {plan.total_rows} rows "
            f"of {config.data.row_tokens} tokens over {config.optim.epochs} epoch(s); "
            f"{self.total_steps} steps of {self.rows_per_step} rows; {self.placement.kind}: {where}",
        ]
        o = config.optim
        groups = [type(opt).__name__ for opt in members(self.optimizer)]
        lines.append(
            f"  optimizer {' + '.join(groups)}, lr {o.lr:g}, {o.schedule} schedule, "
            f"{o.warmup_steps} warmup steps; loss weighting {config.loss.weighting}"
        )
        if long_samples:
            lines.append(
                f"  {long_samples:,} sample(s) longer than a row: "
                f"{config.data.overlong} (data.overlong)"
            )
        if plan.resume_from:
            lines.append(f"  resuming from {plan.resume_from} at step {self.step}")
        # where the time before the first step goes (a device session's start-up)
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.setup_s.items())
        lines.append(f"  set up in {sum(self.setup_s.values()):.1f} s: {parts}")
        return "\n".join(lines)

    # ---- in-training eval (`held_out`): the whole drafter it evaluates ----

    def _full_drafter(self) -> DFlashDrafter:
        """The whole drafter as one module, for eval copies and exports. Sharded (FSDP2) it is
        gathered: a collective over the drafter replicas, so every drafter rank calls this."""
        if self.config.parallel.drafter_sharding != "fsdp" or self.placement.dp_world <= 1:
            return self.drafter
        options = StateDictOptions(full_state_dict=True)
        full = DFlashDrafter(self.drafter_config)
        full.load_state_dict(get_model_state_dict(self.drafter, options=options))
        return full.to(self.device)

    # ---- the step ----

    def make_batch(self, rows: list[Row]) -> DraftBatch:
        """Rows on the device, stacked, with the target's features and labels from the source."""
        return draft_batch(self.source, rows, device_put(self.device))

    def _normaliser(self, rows: list[Row]) -> Tensor:
        """The global loss normaliser of a step: known from the CPU rows, one all-reduce per
        step. The copy to the device goes through pinned memory, asynchronously: no host sync."""
        local = sum((r.normaliser_mask.double() * self.slot_w_cpu).sum() for r in rows)
        assert isinstance(local, Tensor)
        if self.device.type == "cuda":
            local = local.reshape(1).pin_memory()
        summed = dp_all_reduce_sum(local.to(self.device, non_blocking=True), self.placement)
        return summed.float().reshape(())

    def train_step(self, rows: list[Row], interval: Interval) -> Tensor:
        normaliser = self._normaliser(rows)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")
        step_loss = torch.zeros((), device=self.device)
        per = self.config.optim.rows_per_forward
        forwards = [rows[i : i + per] for i in range(0, len(rows), per)]
        for m, stacked in enumerate(forwards):
            t0 = self.stopwatch.mark()
            batch = self.make_batch(stacked)
            t1 = self.stopwatch.mark()
            last = m == len(forwards) - 1
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
                        dpace_alpha=self.dpace_alpha,
                        residual_dtype=self.residual_dtype,
                    )
                # Data parallel wrappers average gradients over ranks; the loss is already
                # this rank's share of the global sum, so undo the average.
                (loss * self.placement.dp_world).backward()
            step_loss += loss.detach()
            t2 = self.stopwatch.mark()
            self.stopwatch.add(PHASES[0], t0, t1)
            self.stopwatch.add(PHASES[1], t1, t2)
            interval.stats = stats if interval.stats is None else interval.stats.add(stats)
            interval.tokens += sum(row.tokens for row in stacked)
            interval.rows += len(stacked)
        grad_norm = nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.optim.grad_clip)
        empty = normaliser == 0  # the same on every rank: the normaliser is global
        self.guard.observe(step_loss, grad_norm, empty=empty)
        interval.empty = empty.int() if interval.empty is None else interval.empty + empty
        lr = lr_at(self.step, self.total_steps, self.config.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.guard.step()
        self.optimizer.zero_grad(set_to_none=True)
        interval.steps += 1
        return grad_norm

    def _check_finite(self) -> None:
        """Stop the run at a non-finite step (collective over the replicas; a host sync)."""
        bad = self.guard.first_bad_step(self.placement)
        if bad is None:
            return
        latest = latest_checkpoint(self.run_dir)
        where = f"the last checkpoint, {latest}," if latest else "no checkpoint was written; it"
        raise FloatingPointError(
            f"loss is not finite at step {bad}; stopping ({where} holds finite weights: lower "
            "optim.lr or check the data, then resume)"
        )

    def _log(
        self,
        interval: Interval,
        grad_norm: Tensor,
        progress: Any,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        assert interval.stats is not None
        # The stop request rides in the sum every replica makes here anyway: all of them then
        # agree on it at the same step (a SIGTERM reaches ranks at different steps).
        asked = float(self.sigterm is not None and self.sigterm.requested)
        counts = torch.tensor(
            [interval.tokens, interval.rows, asked], dtype=torch.float64, device=self.device
        )
        flat = dp_all_reduce_sum(torch.cat([interval.stats.flat(), counts]), self.placement)  # sync
        summary = BlockStats.from_flat(flat[:-3], self.block).summary()
        tokens, rows, self.stop_agreed = int(flat[-3]), int(flat[-2]), bool(flat[-1] > 0)
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
            "target_s": round(self.stopwatch.seconds(PHASES[0]) / interval.steps, 4),
            "drafter_s": round(self.stopwatch.seconds(PHASES[1]) / interval.steps, 4),
            "step_s": round(wall / interval.steps, 4),
            "rows": rows,
            "tokens": tokens,
            "trained_slots": summary["trained_tokens"],
            "blocks": summary["blocks"],
            **(extra or {}),
        }
        if not math.isfinite(record["loss"]):  # the guard sees every step; this is a backstop
            raise FloatingPointError(f"loss is {record['loss']} at step {self.step}; stopping")
        empty = int(interval.empty) if interval.empty is not None else 0  # synced above
        if empty:
            record["empty_steps"] = empty
            self.empty_steps += empty
            if self.placement.is_logger:
                log.warning(
                    f"flashdraft train: {empty} of the {interval.steps} steps to step {self.step} "
                    f"had no trained token ({self.empty_steps} since this process started; their "
                    "optimizer updates were skipped): rows of prompt text only, e.g. pieces of "
                    "samples longer than data.row_tokens; check `flashdraft audit` or raise "
                    "data.row_tokens"
                )
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
        started = time.perf_counter()
        if self.lock is not None and self.lock.lost is not None:  # noticed by its refresh
            raise RunLocked(
                f"{self.run_dir} was taken over by another run ({describe(self.lock.lost)}) "
                f"before step {self.step}'s checkpoint; stopping without writing: that run owns "
                "the directory now"
            )
        save_checkpoint(
            self.run_dir,
            self.step,
            self.drafter,
            self.optimizer,
            {
                "cursor": self.cursor,
                "total_steps": self.total_steps,
                "dp_world": self.placement.dp_world,
                "rows_per_step": self.rows_per_step,
            },
            keep=self.config.checkpoint.keep,
            is_main=self.placement.is_logger,
        )
        if self.logger is not None:
            self.logger.sync()
        dp_barrier(self.placement)
        seconds = time.perf_counter() - started
        self.saved, self.checkpoint_s = self.saved + 1, self.checkpoint_s + seconds
        if self.placement.is_logger:  # a run stopped for a deadline ends just after one
            log.info(f"flashdraft train: checkpoint step {self.step} written in {seconds:.1f} s")

    def _progress_bar(self) -> Any:
        if not (self.placement.is_logger and self.config.log.progress):
            return None
        from tqdm import tqdm

        return tqdm(
            total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True
        )

    def fit(self) -> dict[str, Any]:
        config = self.config
        fit_started, first_step, first_s = time.perf_counter(), self.step, 0.0
        progress = self._progress_bar()
        # The loader builds a whole group ahead of the target that runs ahead over it.
        prefetch = config.data.prefetch
        if config.target.forward_rows > 1:
            prefetch = max(prefetch, config.target.forward_rows)
        rows = StepRows(
            self,
            self.stream.iterate(
                self.plan.positions(self.placement.dp_rank),
                prefetch if config.parallel.overlap else 0,
            ),
        )
        interval, last_record = Interval(), {}
        # The first step compiles (drafter layers, and the target on CUDA): say so, it takes
        # ~30 s with a cold cache (an H200, 2026-12-03: 33 s for a SmolLM2-135M-shaped target
        # and a 3-layer drafter; 170-177 s before the BlockMask ordering left the compile)
        # and looks like a hang otherwise.
        compiling = self.device.type == "cuda" and (config.compile or config.target.compile)
        if compiling and self.step < self.total_steps:
            log.info(
                "flashdraft train: compiling for the first step "
                "(~30 s with a cold compile cache, seconds with a warm one)"
            )
            if progress is not None:
                progress.set_description("train (compiling)")
                progress.refresh()
        while self.step < self.total_steps:
            step_rows = rows.take()
            for row in step_rows:  # what each rank consumed (FLASHDRAFT_TRACE; tests)
                trace("row", step=self.step + 1, epoch=row.epoch, index=row.index)
            grad_norm = self.train_step(step_rows, interval)
            self.step += 1
            self.cursor += self.rows_per_step
            if progress is not None:
                progress.update(1)
                if compiling:
                    progress.set_description("train")
            if self.step == first_step + 1:
                first_s = time.perf_counter() - fit_started
            if compiling:  # what compilation cost, by side
                compiling = False
                target, drafter = (self.stopwatch.seconds(k, keep=True) for k in PHASES)
                log.info(
                    f"flashdraft train: first step {first_s:.1f} s"
                    f" with compilation (target {target:.1f} s, drafter {drafter:.1f} s)"
                )
            checkpoint_now = (
                config.checkpoint.every > 0 and self.step % config.checkpoint.every == 0
            )
            finished = self.step == self.total_steps
            eval_now = self.held_out.on and (self.step % config.eval.every == 0 or finished)
            # Log at every checkpoint too, so a resumed run logs exactly the same intervals.
            logged = self.step % config.log.every == 0 or checkpoint_now or finished or eval_now
            if logged:
                self._check_finite()  # before anything is evaluated, logged or written
                extra = {}
                if eval_now:
                    whole = self._full_drafter()  # every drafter rank: gathering is collective
                    if self.placement.is_logger:
                        extra = self.held_out.evaluate(
                            whole, self.drafter_config, self.step, self.device,
                            self.head.weight.dtype,
                        )  # fmt: skip
                last_record = self._log(interval, grad_norm, progress, extra)
                interval = Interval()
            if self.placement.control is not None and is_stop_point(
                self.step, self.total_steps, config.log.every, config.checkpoint.every
            ):  # split: the target ranks vote too (train/stopping.py)
                asked = self.sigterm is not None and self.sigterm.requested
                self.stop_agreed = vote_stop(asked, self.placement.control)
            # A stop is at a log point (checked finite, its interval logged) that ends the
            # target's run-ahead group (the same step on every rank): the resumed run then
            # forms the same groups and logs the same intervals, bit for bit.
            stop_here = self.stop_agreed and logged and not finished and not rows.upcoming
            if checkpoint_now or finished or stop_here:
                self._checkpoint()
            if stop_here:
                self._stop(progress)
        if progress is not None:
            progress.close()
        exported = time.perf_counter()
        self._export()
        if self.placement.is_logger:
            looped, export_s = exported - fit_started, time.perf_counter() - exported
            spent = time_spent(
                setup=sum(self.setup_s.values()), looped=looped, steps=self.step - first_step,
                first=first_s, saved=self.saved, checkpoints=self.checkpoint_s, export=export_s,
            )  # fmt: skip
            log.info(spent)
        return last_record

    def _stop(self, progress: Any) -> None:
        """End a run that SIGTERM stopped, its checkpoint just written (every rank)."""
        if isinstance(self.source, RemoteTarget):  # the rows its target rank sent past the stop
            self.source.receiver.drain()
            barrier(self.info)  # with the target ranks, which stop there too
        if progress is not None:
            progress.close()
        if self.logger is not None:
            self.logger.close(exit_code=EXIT_CODE)
        by = self.sigterm.by if self.sigterm is not None else "SIGTERM"
        raise TrainingStopped(self.step, self.total_steps, step_dir(self.run_dir, self.step), by)

    def _export(self) -> None:
        """The serving-format drafter of the finished run, written and checked by reloading."""
        whole = self._full_drafter()
        if self.placement.is_logger:
            export = storage.join(self.run_dir, "export")
            save_dflash(whole, export)
            trace("write", what="export", url=export)
            verify_export(whole, export)
            log.info(f"flashdraft train: done; serving-format drafter in {export}")
        if self.logger is not None:
            self.logger.close()
        barrier(self.info)


def train(
    config: RunConfig,
    resume: bool | str = False,
    target_model: Any = None,
    dataset: Any = None,
    *,
    allow_config_change: bool = False,
    take_over: bool = False,
) -> dict[str, Any]:
    """Run (or resume) a training run on this process's rank; returns the last logged metrics
    record on the logging rank (empty elsewhere), and prints it as `{"final": ...}`.
    `resume`: True continues from the newest checkpoint that verifies (refused when there is
    none), "auto" continues when there is one and starts otherwise. `allow_config_change`:
    resume even with settings that change what is trained (recorded in the run's
    `run_config_changes.jsonl`). The run holds its directory's lease while it runs
    (`train/lock.py`; rank 0 takes it); `take_over`: take it from a holder that looks alive."""
    info = init_distributed(config.device)
    record: dict[str, Any] = {}
    try:
        with RunLock(config.output, enabled=info.is_main, take_over=take_over) as lock:
            held = lock if info.is_main else None
            record = _train_rank(
                config, info, resume, target_model, dataset, allow_config_change, held
            )
    finally:
        shutdown(info)
    if record:
        # Printed, not logged: the machine-readable result, which neither a rank tag nor the
        # log level may change (as `benchutil.print_json`).
        print(json.dumps({"final": record}), flush=True)
    return record


def _train_rank(
    config: RunConfig,
    info: DistInfo,
    resume: bool | str,
    target_model: Any,
    dataset: Any,
    allow_config_change: bool,
    lock: RunLock | None,
) -> dict[str, Any]:
    """What `train` runs on this rank while the run's lease is held (`lock`, on rank 0)."""
    torch.manual_seed(config.seed + info.rank)
    target_config = target_model.config if target_model is not None else None
    if config.parallel.placement == "auto":  # the memory plan's fastest layout that fits
        config = resolve_placement(config, info, target_config)
    plan = plan_run(
        config, info, resume, target_config, dataset, allow_config_change=allow_config_change
    )
    trace(
        "role",
        role=plan.placement.role,
        world=info.world,
        local_rank=info.local_rank,
        pid=os.getpid(),  # what a test signals
    )
    # SIGTERM and SIGINT checkpoint and stop, in either placement (train/stopping.py)
    with StopRequest() as stop:
        if plan.placement.role != "target":
            return Trainer(plan, target_model, stop, lock).fit()
        stopped = serve_target(plan, target_model, stop)
        barrier(info)  # the drafter ranks have written the checkpoint by then
    if stopped is not None:
        checkpoint = step_dir(config.output, stopped)
        raise TrainingStopped(stopped, plan.total_steps, checkpoint, stop.by)
    return {}
