"""`flashdraft audit DIR...`: statistics and degenerate-data checks of a prepared dataset."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from flashdraft.data.audit import (
    add_threshold_arguments,
    audit_dataset,
    format_preview,
    format_report,
    preview_indices,
    preview_segments,
    thresholds_from_args,
)
from flashdraft.data.dataset import PreparedDataset, open_datasets


def load_audit_tokenizer(dataset: PreparedDataset, override: str | None) -> tuple[Any, str | None]:
    """The dataset's tokenizer (from its manifest, or `override`) and a note if unavailable."""
    from flashdraft.data.template import load_tokenizer

    manifest = dataset.manifest.get("parts", [dataset.manifest])[0]
    name = override or manifest.get("tokenizer", {}).get("name")
    if not name:
        return None, "the manifest names no tokenizer (pass --tokenizer)"
    try:
        return load_tokenizer(name), None
    except (OSError, ValueError) as err:
        return None, f"cannot load the tokenizer {name!r} ({err}); pass --tokenizer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "datasets", nargs="+", metavar="DIR", help="prepared dataset(s), concatenated"
    )
    parser.add_argument(
        "--preview",
        type=int,
        default=0,
        metavar="N",
        help="show N samples with trained tokens highlighted",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON report instead of text")
    parser.add_argument("--seed", type=int, default=0, help="seed for choosing preview samples")
    parser.add_argument(
        "--tokenizer", help="tokenizer path (default: the one named in the manifest)"
    )
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="highlight with colour (auto: on a terminal) or with [[ ]] markers",
    )
    add_threshold_arguments(parser)


def run(args: argparse.Namespace) -> int:
    thresholds = thresholds_from_args(args)
    dataset = open_datasets(args.datasets, require_complete=False)
    tokenizer, note = load_audit_tokenizer(dataset, args.tokenizer)
    report = audit_dataset(dataset, tokenizer, thresholds)
    indices = preview_indices(dataset, args.preview, args.seed) if args.preview > 0 else []
    if args.json:
        out = report.to_json()
        out["note"] = note
        if tokenizer is not None:
            out["preview"] = [
                {
                    "index": i,
                    "source": dataset.source(i),
                    "segments": [[t, m] for t, m in preview_segments(dataset, i, tokenizer)[1]],
                }
                for i in indices
            ]
        print(json.dumps(out, indent=2))
    else:
        if note:
            print(f"note: {note}")
        print(format_report(report))
        if indices and tokenizer is not None:
            color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
            print(format_preview(dataset, indices, tokenizer, color=color))
    return 1 if report.problems else 0
