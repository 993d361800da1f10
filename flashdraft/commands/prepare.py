"""`flashdraft prepare INPUT... --tokenizer T --output DIR`: conversations -> Arrow dataset."""

from __future__ import annotations

import argparse
import sys

from flashdraft.data.audit import add_threshold_arguments, thresholds_from_args
from flashdraft.data.prepare import OVERLONG, PrepareConfig, prepare
from flashdraft.data.template import THINKING, TURNS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="JSONL files, globs or directories (local or fsspec URLs; .gz/.zst)",
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer (and chat template) of the target: a path or hub name",
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="dataset directory (re-running into it resumes)",
    )
    parser.add_argument(
        "--thinking",
        choices=THINKING,
        default="keep",
        help="keep: train reasoning; strip: drop it; off: render in the template's non-thinking mode (default %(default)s)",
    )
    parser.add_argument(
        "--turns",
        choices=TURNS,
        default="all",
        help="train every assistant turn or only the last (default %(default)s)",
    )
    parser.add_argument(
        "--max-length", type=int, default=None, help="longest sample in tokens (default: no limit)"
    )
    parser.add_argument(
        "--overlong",
        choices=OVERLONG,
        default="drop",
        help="samples over --max-length: drop (counted as rejects) or truncate (counted as truncated) (default %(default)s)",
    )
    parser.add_argument(
        "--workers", type=int, default=0, help="worker processes (default: all cores)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for the samples shown by --preview (the data itself is in input order)",
    )
    parser.add_argument(
        "--shard-size",
        type=int,
        default=2048,
        help="records per output shard, the unit of parallel work and of resume (default %(default)s)",
    )
    parser.add_argument(
        "--max-reject-rate",
        type=float,
        default=0.01,
        help="fail when more than this share of records is rejected (default %(default)s)",
    )
    parser.add_argument(
        "--allow-degenerate",
        action="store_true",
        help="keep a dataset that fails the degenerate-data checks (they become warnings)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a dataset prepared in --output with other settings",
    )
    parser.add_argument(
        "--preview",
        type=int,
        default=1,
        metavar="N",
        help="show N samples with trained tokens highlighted at the end (default %(default)s)",
    )
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="preview highlighting: colour (auto: on a terminal) or [[ ]] markers",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_threshold_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config = PrepareConfig(
        inputs=args.inputs,
        tokenizer=args.tokenizer,
        output=args.output,
        thinking=args.thinking,
        turns=args.turns,
        max_length=args.max_length,
        overlong=args.overlong,
        workers=args.workers,
        seed=args.seed,
        shard_size=args.shard_size,
        max_reject_rate=args.max_reject_rate,
        allow_degenerate=args.allow_degenerate,
        overwrite=args.overwrite,
        preview=args.preview,
        color=args.color == "always" or (args.color == "auto" and sys.stdout.isatty()),
        progress=not args.no_progress and sys.stderr.isatty(),
        thresholds=thresholds_from_args(args),
    )
    result = prepare(config)
    counts = result.manifest["counts"]
    print(
        f"{counts['records']:,} records -> {counts['samples']:,} samples "
        f"({counts['rejected']:,} rejected, {counts['truncated']:,} truncated) in "
        f"{result.seconds:.1f} s ({counts['records'] / max(result.seconds, 1e-9):,.0f} records/s"
        + (f"; {result.reused_shards} shard(s) reused" if result.reused_shards else "")
        + ")"
    )
    print(result.report)
    if result.preview:
        print(result.preview)
    for warning in result.manifest.get("warnings", []):
        print(f"warning (--allow-degenerate): {warning}", file=sys.stderr)
    if not result.ok:
        print(
            f"flashdraft prepare: FAILED, {config.output} must not be trained on:", file=sys.stderr
        )
        for problem in result.manifest["problems"]:
            print(f"  - {problem}", file=sys.stderr)
        if any("--max-reject-rate" not in p for p in result.manifest["problems"]):
            print("  (pass --allow-degenerate to keep it anyway)", file=sys.stderr)
        return 1
    print(f"wrote {config.output}")
    return 0
