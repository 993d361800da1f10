"""A trained DFlash drafter with its MLPs cut to fewer neurons: a smaller export to serve as it
is or to warm-start a narrow run from (`--set drafter.init_from=OUT
drafter.intermediate_size=WIDTH`; issue 18's 25 MB drafter).

    python bench/prune_mlp.py --drafter benchmarks/artifacts/smollm2-135m-dflash --width 704 \\
        --output /tmp/ref6-704 --calibration TRAIN_PROMPTS.jsonl --limit 12

Each layer keeps the WIDTH neurons of the largest score, in their order: the neuron's output
column norm ||down[:, j]|| times, with `--calibration`, the root mean square of its activation
silu(gate_j . x) * (up_j . x) over the draft blocks of the real draft-and-verify loop (the
target SmolLM2-135M-Instruct, fp32 on the CPU, `--limit` prompts, T = 0), or without it the
norms of its gate and up rows. Calibrate on training prompts only: held-out prompts would
leak into what the export is then measured on. Everything but the MLPs is copied as it is.
Prints one JSON line (the kept share of each layer's score, the export's size).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from flashdraft.benchutil import environment, print_json
from flashdraft.export.dflash import WEIGHTS, load_dflash, save_dflash
from flashdraft.model.drafter import DFlashDrafter


def weight_scores(drafter: DFlashDrafter) -> list[Tensor]:
    """Per layer, per neuron: ||gate_j|| * ||up_j|| * ||down[:, j]|| (no data needed)."""
    return [
        layer.mlp.gate_proj.weight.norm(dim=1)
        * layer.mlp.up_proj.weight.norm(dim=1)
        * layer.mlp.down_proj.weight.norm(dim=0)
        for layer in drafter.layers
    ]


def activation_scores(drafter: DFlashDrafter, run: Callable[[], object]) -> list[Tensor]:
    """Per layer, per neuron: RMS of the activation entering down_proj while `run()` drafts,
    times ||down[:, j]||: the size of what the neuron adds to the residual stream."""
    sums = [torch.zeros(layer.mlp.down_proj.in_features) for layer in drafter.layers]
    counts = [0] * len(sums)
    handles = []
    for i, layer in enumerate(drafter.layers):

        def record(_module: object, args: tuple[Tensor, ...], i: int = i) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[i] += (x * x).sum(dim=0).cpu()
            counts[i] += x.shape[0]

        handles.append(layer.mlp.down_proj.register_forward_pre_hook(record))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    if not all(counts):
        raise RuntimeError("the calibration run drafted nothing: no activations recorded")
    return [
        (s / n).sqrt() * layer.mlp.down_proj.weight.detach().float().norm(dim=0).cpu()
        for s, n, layer in zip(sums, counts, drafter.layers, strict=True)
    ]


def narrow(drafter: DFlashDrafter, keep: list[Tensor]) -> DFlashDrafter:
    """A copy of `drafter` whose layer l keeps only the MLP neurons `keep[l]` (sorted indices,
    the same count in every layer); every other weight is copied unchanged."""
    widths = {len(k) for k in keep}
    if len(widths) != 1:
        raise ValueError(f"every layer must keep as many neurons, got {sorted(widths)}")
    width = widths.pop()
    config = dataclasses.replace(drafter.config, intermediate_size=width)
    out = DFlashDrafter(config).to(next(drafter.parameters()).dtype)
    state = drafter.state_dict()
    for i, k in enumerate(keep):
        prefix = f"layers.{i}.mlp."
        state[prefix + "gate_proj.weight"] = state[prefix + "gate_proj.weight"][k]
        state[prefix + "up_proj.weight"] = state[prefix + "up_proj.weight"][k]
        state[prefix + "down_proj.weight"] = state[prefix + "down_proj.weight"][:, k]
    out.load_state_dict(state)
    return out


def top_neurons(scores: list[Tensor], width: int) -> list[Tensor]:
    """Per layer, the indices of the `width` largest scores, in increasing order."""
    if not 0 < width <= min(len(s) for s in scores):
        raise ValueError(f"--width {width}: must be in 1..{min(len(s) for s in scores)}")
    return [s.topk(width).indices.sort().values for s in scores]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", required=True, help="a dflash export (config.json + weights)")
    parser.add_argument("--width", type=int, required=True, help="MLP neurons kept per layer")
    parser.add_argument("--output", required=True, help="where the narrow export goes")
    parser.add_argument(
        "--calibration", help="training prompts (JSONL) for activation scores (default: weights)"
    )
    parser.add_argument("--target", help="the target's HF directory (default: SmolLM2-135M)")
    parser.add_argument("--limit", type=int, default=12, help="calibration prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    started = time.perf_counter()
    drafter = load_dflash(args.drafter, dtype=torch.float32).eval()
    if not 0 < args.width <= drafter.config.intermediate_size:  # before any calibration
        parser.error(f"--width {args.width}: must be in 1..{drafter.config.intermediate_size}")
    if args.calibration:
        from flashdraft.assets import smollm2_path
        from flashdraft.eval.evaluate import EvalConfig, load_eval_target, run_eval

        config = EvalConfig(
            target=args.target or str(smollm2_path()),
            drafter=args.drafter,
            prompts=args.calibration,
            output="unused.json",
            max_new_tokens=args.max_new_tokens,
            limit=args.limit,
            device="cpu",
            reference=False,
        )
        target, tokenizer = load_eval_target(config)
        with torch.no_grad():
            scores = activation_scores(
                drafter, lambda: run_eval(config, target, tokenizer, drafter)
            )
    else:
        scores = weight_scores(drafter)
    keep = top_neurons(scores, args.width)
    kept_share = [float(s[k].sum() / s.sum()) for s, k in zip(scores, keep, strict=True)]
    save_dflash(narrow(drafter, keep), args.output)
    size = (Path(args.output) / WEIGHTS).stat().st_size
    print(f"{args.output}: MLP {drafter.config.intermediate_size} -> {args.width}, "
          f"{size / 1e6:.2f} MB; kept score share per layer "
          + ", ".join(f"{x:.3f}" for x in kept_share))  # fmt: skip
    print_json(
        {
            "bench": "prune-mlp",
            "drafter": args.drafter,
            "width": args.width,
            "scores": "activation" if args.calibration else "weight",
            "calibration": args.calibration,
            "limit": args.limit if args.calibration else None,
            "kept_score_share": kept_share,
            "bytes": size,
            "seconds": round(time.perf_counter() - started, 1),
            **environment(),
        }
    )
    return 0


if __name__ == "__main__":
    torch.set_num_threads(2)
    sys.exit(main())
