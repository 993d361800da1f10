"""`flashdraft export CHECKPOINT --output DIR [--format dflash|speculators]`."""

from __future__ import annotations

import argparse

from flashdraft.export import FORMATS, save_dflash, save_speculators, verify_export


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", help="training checkpoint, run directory (latest checkpoint) or export"
    )
    parser.add_argument("--output", required=True, help="directory to write (local or fsspec URL)")
    parser.add_argument("--format", default="dflash", choices=FORMATS)
    parser.add_argument(
        "--verifier",
        default=None,
        help="the target's HF id or path, written into the speculators config (required there: "
        "vLLM serves the verifier it names)",
    )


def run(args: argparse.Namespace) -> int:
    from flashdraft.train.checkpoint import load_drafter

    if args.format == "speculators" and not args.verifier:
        raise ValueError("--format speculators needs --verifier (the target's HF id or path)")
    drafter = load_drafter(args.checkpoint)
    if args.format == "dflash":
        save_dflash(drafter, args.output)
    else:
        save_speculators(drafter, args.output, args.verifier)
    verify_export(drafter, args.output)
    config = drafter.config
    print(
        f"wrote {args.format} drafter to {args.output}: {config.num_hidden_layers} layers, "
        f"B={config.block_size}, taps {config.target_layer_ids} (z-lab ids), "
        f"mask token {config.mask_token_id}; reload check passed (identical weights and outputs)"
    )
    return 0
