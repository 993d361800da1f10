"""s28's paired ratios: every pair of the four flashdraft runs at the shipped shape and the
peer (same rows, 4,626 steps, the same 24 held-out prompts per kind), with 90% paired
bootstrap intervals over whole sources (bench/quality_report.py's paired_ratio_text), and
each report's lossless count. s1 / l5s2i704a2k is one recipe under two seeds: the seed noise.
Run from the repo root: python benchmarks/raw/quality_20261205_s28/scripts/pairs28.py"""

import json
import sys
from pathlib import Path

sys.path.insert(0, "bench")
from quality_report import paired_ratio_text  # noqa: E402

RAW = Path("benchmarks/raw")
HERE = RAW / "quality_20261205_s28/runs"
EVALS = {
    "l5s2i704a2k": RAW / "quality_20261204_s21/runs/l5s2i704a2k/eval",
    "s1": HERE / "s1/eval",
    "pe": HERE / "pe/eval",
    "dpm": HERE / "dpm/eval",
    "peer": RAW / "quality_20261204_s25/peer-speculators/eval",
}
PAIRS = [
    ("s1", "l5s2i704a2k"),
    ("pe", "l5s2i704a2k"),
    ("pe", "s1"),
    ("dpm", "l5s2i704a2k"),
    ("dpm", "s1"),
    ("pe", "peer"),
    ("dpm", "peer"),
    ("s1", "peer"),
]


def read(run: str, kind: str) -> dict | None:
    path = EVALS[run] / f"{kind}.json"
    return json.loads(path.read_text()) if path.exists() else None


for a, b in PAIRS:
    for kind in ("chat", "humaneval", "code", "chat_t1"):
        mine, theirs = read(a, kind), read(b, kind)
        if mine is None or theirs is None:
            continue
        print(f"{a} / {b} {kind}: {paired_ratio_text(mine, theirs, kind != 'chat_t1')}")
for run in ("s1", "pe", "dpm"):
    for kind in ("chat", "humaneval", "code"):
        report = read(run, kind)
        if report is None:
            continue
        print(
            f"{run} {kind}: lossless {report['lossless_prompts']}/{report['num_prompts']}, near "
            f"ties {report['near_tie_prompts']}, unexplained {report['unexplained_mismatch_prompts']}"
        )
