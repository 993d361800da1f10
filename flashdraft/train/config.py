"""The run config of `flashdraft train`: a TOML (or JSON) file plus dotted `--set` overrides.

Every field is declared once, with its type and allowed range (`flashdraft.config.option`);
a bad value is one line naming the key, the value and what is allowed. Fields tagged
`resume_safe` may change when a run is resumed (where logs go, how often to evaluate,
checkpoint and log, how far to train); any other change alters what is trained or the order
of the data, and `--resume` refuses it unless asked to allow it (`--allow-config-change`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from flashdraft import config as cfg
from flashdraft.config import option

SAFE = ("resume_safe",)


@dataclass(kw_only=True, slots=True)
class TargetSection:
    path: str = option(help="the target: a local HF model directory")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = option(
        "auto", help="auto: bfloat16 on CUDA, float32 on CPU"
    )
    attn_implementation: str | None = option(
        None, help="None: flex_attention on CUDA (packed rows at flash speed), sdpa on CPU"
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

    def __post_init__(self) -> None:
        cfg.validate(self)
        if not self.datasets:
            raise cfg.ConfigError("datasets", self.datasets, "name at least one prepared dataset")


@dataclass(kw_only=True, slots=True)
class DrafterSection:
    num_layers: int = option(5, ge=1, help="draft layers")
    block_size: int = option(16, ge=2, help="B: the anchor plus B-1 drafted tokens")
    target_layer_ids: list[int] | None = option(
        None, ge=0, help="tapped target layers (z-lab ids); None: the SPEC default rule"
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

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class LossSection:
    anchors: int = option(512, ge=1, help="A, anchors per packed row")
    gamma: float | None = option(
        None, gt=0, help="slot weight decay; None: 7 for B = 16 (DFlash paper), scaled by B / 16"
    )
    labels: Literal["target", "data"] = option(
        "target",
        help="target: the target's argmax (distillation); data: the data tokens",
    )
    chunk_rows: int = option(2048, ge=1, help="rows per LM-head chunk")

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class OptimSection:
    lr: float = option(6e-4, gt=0, help="peak learning rate")
    betas: list[float] = option(
        factory=lambda: [0.9, 0.95], ge=0, lt=1, help="AdamW betas, two numbers in [0, 1)"
    )
    eps: float = option(1e-8, gt=0, help="AdamW epsilon")
    weight_decay: float = option(0.0, ge=0, help="AdamW weight decay")
    schedule: Literal["cosine", "wsd", "constant"] = option(
        "cosine", help="cosine | wsd (warmup-stable-decay) | constant"
    )
    warmup_steps: int = option(100, ge=0, help="linear warmup steps")
    min_lr_ratio: float = option(0.1, ge=0, le=1, help="floor of the decay, as a share of lr")
    decay_ratio: float = option(0.2, ge=0, le=1, help="wsd: share of steps spent decaying")
    grad_clip: float = option(
        1.0, gt=0, help="max global gradient norm (0 would zero every gradient)"
    )
    grad_accum: int = option(1, ge=1, help="packed rows per rank per optimizer step")
    epochs: int = option(1, ge=1, help="passes over the data")
    max_steps: int | None = option(None, ge=1, help="stop early (None: all epochs)", tags=SAFE)

    def __post_init__(self) -> None:
        cfg.validate(self)
        if len(self.betas) != 2:
            raise cfg.ConfigError("betas", self.betas, "expected two numbers [beta1, beta2]")


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
    placement: Literal["colocated", "split"] = option(
        "colocated",
        help="colocated: target + drafter on every rank; split: target ranks feed drafter ranks",
    )
    target_ranks: int = option(0, ge=0, help="split: how many ranks run only the target")
    drafter_sharding: Literal["ddp", "fsdp"] = option("ddp", help="ddp | fsdp (FSDP2)")
    shard_target: bool = option(False, help="colocated: shard the target with FSDP2")
    overlap: bool = option(True, help="build the next rows ahead of the current step", tags=SAFE)
    queue_depth: int = option(
        2, ge=1, help="split: batches in flight between target and drafter ranks", tags=SAFE
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(kw_only=True, slots=True)
class RunConfig:
    output: str = option(help="run directory (any fsspec URL)")
    target: TargetSection
    data: DataSection
    seed: int = option(0, help="seeds the initial drafter, the data order and the anchors")
    device: Literal["auto", "cpu", "cuda"] = option("auto", help="auto | cpu | cuda")
    compile: bool = option(True, help="compile the drafter layers (CUDA only)")
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

    def to_dict(self) -> dict[str, Any]:
        return cfg.to_dict(self)


def load_run_config(path: str | None, overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from a TOML (or JSON) file plus dotted overrides."""
    config: RunConfig = cfg.build(RunConfig, cfg.load_file(path, overrides))
    return config
