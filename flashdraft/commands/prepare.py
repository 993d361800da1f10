"""`flashdraft prepare INPUT... --tokenizer T --output DIR`: conversations -> Arrow dataset."""

from __future__ import annotations

import argparse
import os
import sys

from flashdraft import config as cfg
from flashdraft import storage
from flashdraft.data.prepare import prepare
from flashdraft.data.prepare_config import PrepareConfig
from flashdraft.log import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, PrepareConfig)


def run(args: argparse.Namespace) -> int:
    # A progress bar only where someone watches it (not in a log file).
    config = cfg.from_args(PrepareConfig, args, progress=args.progress and sys.stderr.isatty())
    try:
        result = prepare(config)
    except storage.WriteFailed as err:  # a full disk: one line; what is done stays done
        if os.environ.get("FLASHDRAFT_DEBUG"):
            raise
        log.error(
            f"flashdraft prepare: error: {err}; the shards finished so far are kept: free some "
            "space and run the same command again to resume"
        )
        return 1
    counts = result.manifest["counts"]
    rate = counts["records"] / max(result.seconds, 1e-9)
    reused = f"; {result.reused_shards} shard(s) reused" if result.reused_shards else ""
    loops = counts.get("loop_untrained", 0)
    loops_note = f", {loops:,} loop tokens untrained" if loops else ""
    log.info(
        f"{counts['records']:,} records -> {counts['samples']:,} samples "
        f"({counts['rejected']:,} rejected, {counts['truncated']:,} truncated{loops_note}) in "
        f"{result.seconds:.1f} s ({rate:,.0f} records/s{reused})"
    )
    reasons = list(result.manifest["rejected_by_reason"].items())
    if reasons:
        common = "; ".join(f"{n:,} x {kind}" for kind, n in reasons[:3])
        log.info(f"rejected: {common} (each in {storage.join(config.output, 'rejects.jsonl')})")
    log.info(result.report)
    if result.preview:
        log.info(result.preview)
    for warning in result.manifest.get("warnings", []):
        log.warning(f"warning (--allow-degenerate): {warning}")
    if not result.ok:
        lines = [f"flashdraft prepare: FAILED, {config.output} must not be trained on:"]
        lines += [f"  - {problem}" for problem in result.manifest["problems"]]
        if result.degenerate:
            lines.append("  (pass --allow-degenerate to keep it anyway)")
        log.error("\n".join(lines))
        return 1
    log.info(f"wrote {config.output}")
    return 0
