"""A trained DFlash drafter with its MLPs cut to fewer neurons: a smaller export to serve as it
is or to warm-start a narrow run from (`--set drafter.init_from=OUT
drafter.intermediate_size=WIDTH`; how the 25 MB shipped drafter was first made).

    python experiments/prune_mlp.py --drafter RUN/export --width 704 --output /tmp/narrow \\
        --calibration TRAIN_PROMPTS.jsonl --mix chat=6,humaneval=6,code=12

(`experiments/quality.py --prune-from RUN` does this inside its pipeline.)

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
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flashdraft.benchutil import environment, print_json
from flashdraft.export import verify_export
from flashdraft.export.dflash import WEIGHTS, load_dflash, save_dflash
from flashdraft.model.drafter import DFlashDrafter

MIX = "chat=6,humaneval=6,code=12"  # the shipped drafter's calibration (24 training prompts)
CALIBRATION_THREADS = 2  # as the shipped drafter's start was scored (on this 2-core machine)


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


def parse_mix(text: str) -> dict[str, int]:
    """`chat=6,humaneval=6,code=12` -> {"chat": 6, "humaneval": 6, "code": 12}."""
    mix: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, count = part.partition("=")
        if not kind or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--mix {text!r}: expected KIND=N,... with N >= 1, e.g. {MIX}")
        mix[kind.strip()] = int(count)
    if not mix:
        raise ValueError(f"--mix {text!r}: empty; e.g. {MIX}")
    return mix


def calibration_prompts(records: Iterable[dict[str, Any]], mix: dict[str, int]) -> list[dict]:
    """For each kind of `mix`, the first prompt of each source, in file order, until the kind
    has its count: one prompt per conversation or file, spread as far as the count goes. Kinds
    take turns in the result (order does not change the scores beyond float rounding). A kind
    with fewer sources than asked is an error naming it."""
    picked: dict[str, list[dict[str, Any]]] = {kind: [] for kind in mix}
    seen: set[tuple[str, str]] = set()
    for record in records:
        kind = record.get("kind")
        if kind not in mix or len(picked[kind]) >= mix[kind]:
            continue
        key = (kind, str(record.get("source", record.get("id"))))
        if key not in seen:
            seen.add(key)
            picked[kind].append(record)
    short = {k: len(v) for k, v in picked.items() if len(v) < mix[k]}
    if short:
        raise ValueError(f"calibration: too few sources for {short} (asked {mix})")
    return [picked[kind][i] for i in range(max(mix.values())) for kind in mix if i < mix[kind]]


def write_calibration(records: Iterable[dict[str, Any]], mix: str, path: Path) -> list[dict]:
    """`calibration_prompts` of `records` for the mix `KIND=N,...`, written to `path` (JSONL,
    what `prune_export` reads); returns them."""
    picked = calibration_prompts(records, parse_mix(mix))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in picked))
    return picked


def prune_export(
    drafter_dir: str,
    width: int,
    output: str,
    *,
    calibration: str | None = None,
    limit: int = 12,
    target: str | None = None,
    max_new_tokens: int = 128,
) -> dict[str, Any]:
    """Write `drafter_dir`'s export with `width` MLP neurons per layer to `output`, scored by
    activations over the first `limit` prompts of `calibration` (the real draft-and-verify
    loop, fp32 on the CPU with 2 threads whatever the machine, as the shipped start was made:
    float sums depend on the thread count) or, without it, by weights. The narrow export is
    checked as every export is (`verify_export`). Returns what the script prints as JSON."""
    threads = torch.get_num_threads()
    torch.set_num_threads(CALIBRATION_THREADS)
    try:
        return _prune_export(drafter_dir, width, output, calibration, limit, target, max_new_tokens)
    finally:
        torch.set_num_threads(threads)


def _prune_export(
    drafter_dir: str,
    width: int,
    output: str,
    calibration: str | None,
    limit: int,
    target: str | None,
    max_new_tokens: int,
) -> dict[str, Any]:
    started = time.perf_counter()
    drafter = load_dflash(drafter_dir, dtype=torch.float32).eval()
    if not 0 < width <= drafter.config.intermediate_size:  # before any calibration
        raise ValueError(f"--width {width}: must be in 1..{drafter.config.intermediate_size}")
    if calibration:
        from flashdraft.assets import smollm2_path
        from flashdraft.eval.evaluate import EvalConfig, load_eval_target, run_eval

        config = EvalConfig(
            target=target or str(smollm2_path()),
            drafter=drafter_dir,
            prompts=calibration,
            output="unused.json",
            max_new_tokens=max_new_tokens,
            limit=limit,
            device="cpu",
            reference=False,
        )
        loaded, tokenizer = load_eval_target(config)
        with torch.no_grad():
            scores = activation_scores(
                drafter, lambda: run_eval(config, loaded, tokenizer, drafter)
            )
    else:
        scores = weight_scores(drafter)
    keep = top_neurons(scores, width)
    kept_share = [float(s[k].sum() / s.sum()) for s, k in zip(scores, keep, strict=True)]
    narrowed = narrow(drafter, keep)
    save_dflash(narrowed, output)
    verify_export(narrowed, output)
    size = (Path(output) / WEIGHTS).stat().st_size
    print(f"{output}: MLP {drafter.config.intermediate_size} -> {width}, "
          f"{size / 1e6:.2f} MB; kept score share per layer "
          + ", ".join(f"{x:.3f}" for x in kept_share))  # fmt: skip
    return {
        "bench": "prune-mlp",
        "drafter": drafter_dir,
        "width": width,
        "scores": "activation" if calibration else "weight",
        "calibration": calibration,
        "limit": limit if calibration else None,
        "kept_score_share": kept_share,
        "bytes": size,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", required=True, help="a dflash export (config.json + weights)")
    parser.add_argument("--width", type=int, required=True, help="MLP neurons kept per layer")
    parser.add_argument("--output", required=True, help="where the narrow export goes")
    parser.add_argument(
        "--calibration", help="training prompts (JSONL) for activation scores (default: weights)"
    )
    parser.add_argument(
        "--mix",
        help=f"with --calibration: take the first prompt of each source per kind, e.g. {MIX} "
        "(the shipped drafter's); --limit is then their number",
    )
    parser.add_argument("--target", help="the target's HF directory (default: SmolLM2-135M)")
    parser.add_argument("--limit", type=int, default=12, help="calibration prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    calibration, limit = args.calibration, args.limit
    try:
        if args.mix:
            if not calibration:
                parser.error("--mix picks from --calibration: give the training prompts file")
            with open(calibration) as f:
                records = (json.loads(line) for line in f if line.strip())
                path = Path(f"{args.output}.calibration.jsonl")
                limit = len(write_calibration(records, args.mix, path))
            calibration = str(path)
        result = prune_export(
            args.drafter,
            args.width,
            args.output,
            calibration=calibration,
            limit=limit,
            target=args.target,
            max_new_tokens=args.max_new_tokens,
        )
    except ValueError as err:
        parser.error(str(err))
    print_json({**result, **environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
