"""`flashdraft eval --target T --drafter D --prompts P --output R.json`: real acceptance."""

from __future__ import annotations

import argparse

import torch

from flashdraft import storage
from flashdraft.eval.evaluate import (
    evaluate_drafter,
    format_summary,
    load_prompts,
    plot_acceptance,
    plot_path,
)
from flashdraft.model.target import decoder_layers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="HF model directory or hub id")
    parser.add_argument(
        "--drafter",
        required=True,
        help="training checkpoint, run directory, or exported folder (dflash / speculators / z-lab)",
    )
    parser.add_argument("--prompts", required=True, help="JSONL: messages / conversations / prompt")
    parser.add_argument("--output", required=True, help="REPORT.json (the plot goes beside it)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N prompts")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (T > 0)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="target and drafter dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--attn-implementation", default="sdpa")
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the target-alone run (no lossless check, no speedup)",
    )


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from flashdraft.data.inference import resolve_dtype
    from flashdraft.model.target import DTYPES, load_target
    from flashdraft.train.checkpoint import load_drafter

    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    if args.block_size is not None and args.block_size < 1:
        raise ValueError("--block-size must be >= 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device.type)
    target = load_target(args.target, dtype, args.attn_implementation, device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafter = load_drafter(args.drafter, num_target_layers=len(decoder_layers(target)))
    drafter = drafter.to(device=device, dtype=DTYPES[dtype]).eval()
    prompts = load_prompts(args.prompts, tokenizer, args.limit)
    report = evaluate_drafter(
        target,
        tokenizer,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        temperature=args.temperature,
        seed=args.seed,
        reference=False if args.no_reference else None,
        progress=True,
    )
    report["settings"].update(target=args.target, drafter=args.drafter, prompts=args.prompts)
    storage.write_json_atomic(args.output, report)
    plot = plot_path(args.output)
    storage.write_bytes_atomic(plot, plot_acceptance(report))
    print(format_summary(report))
    print(f"report: {args.output}\nplot:   {plot}")
    return 0
