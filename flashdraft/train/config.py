"""The run config of `flashdraft train`: a TOML (or JSON) file plus dotted `--set` overrides.

Every field is declared once, with its type and allowed range (`flashdraft.config.option`);
a bad value is one line naming the key, the value and what is allowed. Fields tagged
`resume_safe` may change when a run is resumed (where logs go, how often to evaluate,
checkpoint and log, how far to train, how the work is laid out over devices); any other
change alters what is trained or the order of the data, and `--resume` refuses it unless
asked to allow it (`--allow-config-change`): `resume_changes`. The global batch (rows per
step, drafter replicas x `optim.grad_accum`) must stay the same, so a run may resume on
another world size with grad_accum adjusted.

The resolved config is written to `RUN/run_config.json` (`RUN_CONFIG`), a name no serving
engine reads; runs of earlier versions wrote it to `RUN/config.json` (`LEGACY_RUN_CONFIG`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from flashdraft import config as cfg
from flashdraft.config import option

SAFE = ("resume_safe",)
RUN_CONFIG = "run_config.json"
LEGACY_RUN_CONFIG = "config.json"  # older runs' name for it: also the name engines read


@dataclass(kw_only=True, slots=True)
class TargetSection:
    path: str = option(help="the target: a local HF model directory")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = option(
        "auto", help="auto: bfloat16 on CUDA, float32 on CPU"
    )
    precision: Literal["bf16", "fp8"] = option(
        "bf16",
        help="the decoder layers' linear layers: bf16, in target.dtype as loaded; fp8, "
        "float8 weights (per-channel scales) and activations (per-token scales), as FP8 "
        "servers run the target: taps and labels come from that forward (CUDA sm_89+; the "
        "CPU emulates it); docs/speed.md",
    )
    attn_implementation: str | None = option(
        None,
        help="None: on CUDA 'varlen' for full-attention targets the flash kernel serves, else "
        "flex_attention (the document mask as a BlockMask) or sdpa; sdpa on CPU; 'varlen': "
        "flash attention over the documents' boundaries, no mask; or any transformers name",
        tags=SAFE,
    )
    compile: bool = option(
        True,
        help="CUDA: compile the target's packed forward (one graph per row shape; ~30-60 s "
        "once, cold); hybrid and sharded targets always run eagerly",
        tags=SAFE,
    )
    compile_scope: Literal["layers", "stack"] = option(
        "layers",
        help="what one compiled graph covers: a decoder layer (one graph serves all of them: "
        "the cold compile does not grow with depth) or the whole stack (30 SmolLM2 layers: "
        "its cold compile did not finish in 270 s on 8 H200-host cores; per layer 52 s)",
        tags=SAFE,
    )
    forward_rows: int = option(
        1,
        ge=1,
        help="colocated: rows of the coming steps the frozen target runs in one forward, ahead "
        "of the drafter, which then steps through them as before (for a small target, whose "
        "one-row forward is launch-bound); 1, or a multiple of optim.grad_accum; a group ends "
        "at each checkpoint and eval, its last forward padded to R rows (one compiled shape); "
        "with parallel.overlap the loader builds at least R rows ahead",
        tags=SAFE,
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class DataSection:
    datasets: list[str] = option(
        help="directories written by `flashdraft prepare` (any fsspec URL)"
    )
    row_tokens: int = option(8192, ge=16, help="token budget of one packed row")
    overlong: Literal["split", "truncate", "drop"] = option(
        "split",
        help="documents longer than a row: split into row-sized pieces (positions continue), "
        "truncate to the first row_tokens, or drop; counted either way",
    )
    shuffle: bool = option(True, help="shuffle documents per epoch (seeded by the run seed)")
    prefetch: int = option(4, ge=0, help="rows built ahead by the loader thread", tags=SAFE)
    content_sha256: list[str] | None = option(
        None,
        help="what each dataset holds (its manifest's content_sha256), recorded by `train`; "
        "when set, data that holds other samples is refused (none: not checked)",
    )

    def __post_init__(self) -> None:
        cfg.validate(self)
        if not self.datasets:
            raise cfg.ConfigError("datasets", self.datasets, "name at least one prepared dataset")


@dataclass(kw_only=True, slots=True)
class DrafterSection:
    num_layers: int = option(5, ge=1, help="draft layers")
    block_size: int = option(16, ge=2, help="B: the anchor plus B-1 drafted tokens")
    target_layer_ids: list[int] | None = option(
        None,
        ge=0,
        help="tapped target layers (z-lab ids); None: the default rule (docs/design.md §3)",
    )
    mask_token_id: int | None = option(
        None, ge=0, help="None: chosen from the tokenizer (choose_mask_token_id)"
    )
    sliding_window: int | None = option(None, ge=1, help="window of the sliding layers")
    sliding_layers: list[int] = option(
        factory=list, ge=0, help="draft layers (0-based) with sliding attention"
    )
    intermediate_size: int | None = option(None, ge=1, help="None: the target's")
    init_from: str | None = option(
        None, help="warm start from a serving-format drafter (e.g. one of z-lab's)"
    )
    init_seed: int | None = option(None, help="seed of the initial weights; None: the run seed")
    residual_dtype: Literal["auto", "float32"] = option(
        "auto",
        help="the training forward's residual stream: auto, the target's dtype (bf16 on CUDA); "
        "float32 sums the layers' outputs in fp32, as speculators trains (exports run bf16 "
        "either way)",
    )
    activation_checkpointing: bool = option(
        False,
        help="recompute each draft layer's activations in backward instead of keeping them: "
        "less memory in the drafter step, about one more forward of the layers in time; the "
        "same loss and gradients (parallel.placement = 'auto' may turn it on)",
        tags=SAFE,
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class LossSection:
    anchors: int = option(512, ge=1, help="A, anchors per packed row")
    weighting: Literal["decay", "dpace"] = option(
        "decay",
        help="per-slot loss weights: decay: exp(-(k-1)/gamma) (DFlash paper); dpace: D-PACE's "
        "position weights from the drafter's own confidence (acceptance surrogate, per block)",
    )
    gamma: float | None = option(
        None,
        gt=0,
        help="decay weighting: slot weight decay; None: 7 for B = 16 (DFlash paper), scaled "
        "by B / 16 (unused with dpace)",
    )
    dpace_alpha: float = option(
        0.5,
        ge=0,
        le=1,
        help="dpace weighting: smoothing of the drafter's label probability q, s = (1-a)q + a "
        "(1: weights count the trained slots left in the block, ignoring q)",
    )
    labels: Literal["target", "data", "soft"] = option(
        "target",
        help="target: the target's argmax (distillation); data: the data tokens; soft: the "
        "target's top-k distribution (renormalised) at the block positions, KL to it",
    )
    soft_top_k: int = option(
        32, ge=1, help="soft labels: target probabilities kept per position (top k)"
    )
    argmax_mix: float = option(
        0.0,
        ge=0,
        le=1,
        help="soft labels: share m of the target's argmax mixed in, p = (1-m) top-k + m "
        "one-hot(argmax); 0: the top-k distribution, 1: the hard labels' loss",
    )
    chunk_rows: int = option(2048, ge=1, help="rows per LM-head chunk", tags=SAFE)

    def __post_init__(self) -> None:
        cfg.validate(self)
        if self.argmax_mix and self.labels != "soft":
            raise cfg.ConfigError(
                "argmax_mix",
                self.argmax_mix,
                f"only with labels = 'soft' (labels = {self.labels!r} are one-hot already); "
                "set loss.labels = 'soft', or loss.argmax_mix = 0 (a preset may set it)",
            )


@dataclass(kw_only=True, slots=True)
class OptimSection:
    optimizer: Literal["adamw", "muon"] = option(
        "adamw",
        help="adamw | muon: Muon (Newton-Schulz orthogonalised momentum, its update scaled to "
        "AdamW's RMS so that lr means the same; flashdraft's batched one, the same update as "
        "torch.optim.Muon) on the drafter's 2-D weight matrices and AdamW on the rest (norms); "
        "speculators' DFlash default",
    )
    muon_momentum: float = option(0.95, ge=0, lt=1, help="muon: Nesterov momentum")
    muon_weight_decay: float = option(0.1, ge=0, help="muon: decoupled weight decay")
    lr: float = option(6e-4, gt=0, help="peak learning rate")
    betas: list[float] = option(
        factory=lambda: [0.9, 0.95], ge=0, lt=1, help="AdamW betas, two numbers in [0, 1)"
    )
    eps: float = option(1e-8, gt=0, help="AdamW epsilon")
    weight_decay: float = option(0.0, ge=0, help="AdamW weight decay")
    schedule: Literal["cosine", "linear", "wsd", "constant"] = option(
        "cosine",
        help="cosine | linear (straight down to min_lr_ratio) | wsd (warmup-stable-decay) | "
        "constant",
    )
    warmup_steps: int = option(100, ge=0, help="linear warmup steps")
    min_lr_ratio: float = option(0.1, ge=0, le=1, help="floor of the decay, as a share of lr")
    decay_ratio: float = option(0.2, ge=0, le=1, help="wsd: share of steps spent decaying")
    grad_clip: float = option(
        1.0, gt=0, help="max global gradient norm (0 would zero every gradient)"
    )
    grad_accum: int = option(1, ge=1, help="packed rows per rank per optimizer step")
    rows_per_forward: int = option(
        1,
        ge=1,
        help="of those, rows stacked into one target forward and one drafter forward (a small "
        "target's step is launch-bound: R rows cost little more than one); divides grad_accum; "
        "the gradient is the same",
        tags=SAFE,
    )
    epochs: int = option(1, ge=1, help="passes over the data")
    max_steps: int | None = option(None, ge=1, help="stop early (None: all epochs)", tags=SAFE)

    def __post_init__(self) -> None:
        cfg.validate(self)
        if len(self.betas) != 2:
            raise cfg.ConfigError("betas", self.betas, "expected two numbers [beta1, beta2]")
        if self.grad_accum % self.rows_per_forward:
            raise cfg.ConfigError(
                "rows_per_forward",
                self.rows_per_forward,
                f"must divide optim.grad_accum ({self.grad_accum}): the step's rows go through "
                "the forward in equal groups",
            )


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    every: int = option(
        500, ge=0, help="steps between resumable checkpoints (0: only at the end)", tags=SAFE
    )
    keep: int = option(
        3, ge=1, help="complete checkpoints kept (older ones are deleted)", tags=SAFE
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class LogSection:
    every: int = option(10, ge=1, help="steps between metrics lines", tags=SAFE)
    tensorboard: bool = option(True, help="write TensorBoard events", tags=SAFE)
    wandb: bool = option(False, help="log to Weights & Biases", tags=SAFE)
    wandb_project: str = option("flashdraft", help="W&B project", tags=SAFE)
    progress: bool = option(True, help="progress bar", tags=SAFE)

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class EvalSection:
    every: int = option(
        0,
        ge=0,
        help="steps between in-training evals with the real decode loop (0: off)",
        tags=SAFE,
    )
    prompts: str | None = option(
        None, help="held-out prompts (JSONL: messages or prompt)", tags=SAFE
    )
    num_prompts: int = option(8, ge=1, help="prompts per in-training eval", tags=SAFE)
    max_new_tokens: int = option(128, ge=1, help="tokens generated per prompt", tags=SAFE)

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class ParallelSection:
    placement: Literal["colocated", "split", "auto"] = option(
        "colocated",
        help="colocated: target + drafter on every rank; split: target ranks feed drafter ranks; "
        "auto: the fastest layout that fits these GPUs (`flashdraft train --plan` lists them; "
        "it may also shard, checkpoint the drafter, shorten rows or LM-head chunks)",
        tags=SAFE,
    )
    target_ranks: int = option(0, ge=0, help="split: how many ranks run only the target", tags=SAFE)
    drafter_sharding: Literal["ddp", "fsdp"] = option("ddp", help="ddp | fsdp (FSDP2)", tags=SAFE)
    shard_target: bool = option(False, help="colocated: shard the target with FSDP2", tags=SAFE)
    overlap: bool = option(True, help="build the next rows ahead of the current step", tags=SAFE)
    queue_depth: int = option(
        2, ge=1, help="split: batches in flight between target and drafter ranks", tags=SAFE
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class RunConfig:
    output: str = option(help="run directory (any fsspec URL)", tags=SAFE)
    target: TargetSection
    data: DataSection
    seed: int = option(0, help="seeds the initial drafter, the data order and the anchors")
    device: Literal["auto", "cpu", "cuda"] = option("auto", help="auto | cpu | cuda", tags=SAFE)
    compile: bool = option(True, help="compile the drafter layers (CUDA only)", tags=SAFE)
    preflight: bool = option(
        True, help="refuse runs whose memory estimate exceeds the free GPU memory", tags=SAFE
    )
    drafter: DrafterSection = field(default_factory=DrafterSection)
    loss: LossSection = field(default_factory=LossSection)
    optim: OptimSection = field(default_factory=OptimSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    eval: EvalSection = field(default_factory=EvalSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)

    def __post_init__(self) -> None:
        cfg.validate(self)
        rows, accum = self.target.forward_rows, self.optim.grad_accum
        if rows > 1 and self.parallel.placement == "split":
            raise cfg.ConfigError(
                "target.forward_rows",
                rows,
                "applies to the colocated placement (split: the target ranks already run "
                "ahead, parallel.queue_depth rows); set it to 1",
            )
        if rows > 1 and rows % accum:
            raise cfg.ConfigError(
                "target.forward_rows",
                rows,
                f"must be a multiple of optim.grad_accum ({accum}): the target runs ahead over "
                "whole steps",
            )
        if self.target.precision == "fp8" and self.parallel.shard_target:
            raise cfg.ConfigError(
                "target.precision",
                "fp8",
                "not with parallel.shard_target (FSDP2 gathers the target's weights in its "
                "dtype, not float8): set parallel.shard_target = false or target.precision = "
                "'bf16'",
            )
        if self.optim.optimizer == "muon" and self.parallel.drafter_sharding == "fsdp":
            # Newton-Schulz needs each whole matrix; on FSDP2's shards it would need
            # collectives inside the optimizer that flashdraft's Muon does not have.
            raise cfg.ConfigError(
                "optim.optimizer",
                "muon",
                "not with parallel.drafter_sharding = 'fsdp' (Muon orthogonalises whole "
                "weight matrices): use 'ddp' or optim.optimizer = 'adamw'",
            )

    @property
    def target_rows(self) -> int:
        """Rows in one forward of the target: `target.forward_rows` when it runs ahead, else
        the drafter's `optim.rows_per_forward` (which it then shares)."""
        return max(self.optim.rows_per_forward, self.target.forward_rows)

    def to_dict(self) -> dict[str, Any]:
        return cfg.to_dict(self)


def load_run_config(path: str | None, overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from a TOML (or JSON) file plus dotted overrides."""
    config: RunConfig = cfg.build(RunConfig, cfg.load_file(path, overrides))
    return config


# ---- resuming: what may change ----------------------------------------------------------


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as {dotted.key: leaf value} (lists are leaves)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def resume_safe_keys(cls: type = RunConfig, prefix: str = "") -> set[str]:
    """Dotted keys of the run config fields tagged `resume_safe` (by path: the two `every`
    fields are told apart)."""
    hints = typing.get_type_hints(cls)
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= resume_safe_keys(hints[f.name], f"{prefix}{f.name}.")
        elif "resume_safe" in f.metadata.get("tags", ()):
            keys.add(prefix + f.name)
    return keys


def as_recorded_now(previous: dict[str, Any]) -> dict[str, Any]:
    """A run config a run recorded, as this version would record it: ints given for floats
    made floats, keys added since filled with their defaults (a new key's default is the
    behaviour before it); as recorded when it cannot be built (written by a version with
    other keys)."""
    try:
        return cfg.to_dict(cfg.build(RunConfig, previous))
    except ValueError:
        return previous


def resume_changes(
    previous: dict[str, Any],
    config: RunConfig,
    *,
    rows_per_step: tuple[int | None, int],
    allow: bool,
) -> tuple[dict[str, list[Any]], list[str]]:
    """What differs between a run's recorded config and the config it is resumed with:
    ({dotted key: [before, now]}, the keys among them that only `allow` lets through).
    Changes of `resume_safe` keys are allowed; a change of `optim.grad_accum` is allowed when
    the global batch, `rows_per_step` (before, now; before is None when not recorded), stays
    the same; any other change is refused with a ValueError listing them all, unless `allow`
    (`--allow-config-change`)."""
    before = flatten(as_recorded_now(previous))
    now = flatten(config.to_dict())
    missing = object()
    changes = {
        key: [before.get(key), now.get(key)]
        for key in sorted(set(before) | set(now))
        if before.get(key, missing) != now.get(key, missing)
    }
    safe = resume_safe_keys()
    old_rows, new_rows = rows_per_step
    if old_rows is not None and old_rows != new_rows:
        changes["rows per step (drafter replicas x optim.grad_accum)"] = [old_rows, new_rows]
    elif "optim.grad_accum" in changes:
        safe.add("optim.grad_accum")  # another world size, the same global batch
    refused = [key for key in changes if key not in safe]
    if refused and not allow:
        listed = ", ".join(f"{k} {changes[k][0]!r} -> {changes[k][1]!r}" for k in refused)
        raise ValueError(
            f"--resume: {config.output} was trained with other settings that change what is "
            f"trained or the order of the data: {listed}. Resume with the run's own settings "
            f"({RUN_CONFIG} in the run), choose a new output, or pass --allow-config-change "
            "to continue with the new ones anyway"
        )
    return changes, refused
