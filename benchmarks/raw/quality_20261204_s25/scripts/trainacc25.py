"""Training accuracy at equal steps, flashdraft's run against the peer's (same rows): the
peer logs `acc`, its mean over trained block slots of argmax(drafter) == the target's argmax
(speculators' dflash/metrics.py full_acc); flashdraft logs that per slot (`acc`, slots 1-15),
averaged here over the slots. Windows of 200 steps. Usage from the repo root:
python benchmarks/raw/quality_20261204_s25/scripts/trainacc25.py [RUN_METRICS ...]"""

import json
import sys
from pathlib import Path

RAW = Path("benchmarks/raw")
PEER = RAW / "quality_20261204_s25/peer-speculators/metrics.jsonl"
RUNS = sys.argv[1:] or [str(RAW / "quality_20261204_s21/runs/l5s2i704a2k/metrics.jsonl")]


def records(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def mean_acc(rows: list[dict]) -> float | None:
    """The mean over rows of each record's slot-mean accuracy (a float as the peer logs it)."""
    values = [
        sum(r["acc"]) / len(r["acc"]) if isinstance(r["acc"], list) else r["acc"]
        for r in rows
        if "acc" in r
    ]
    return sum(values) / len(values) if values else None


peer = records(str(PEER))
windows = [(lo, lo + 200) for lo in (400, 1000, 2000, 3000, 4400)]
print("steps | " + " | ".join(Path(r).parent.name for r in RUNS) + " | peer | run - peer")
for lo, hi in windows:
    cells, first = [], None
    for run in RUNS:
        acc = mean_acc([r for r in records(run) if lo < r["step"] <= hi])
        first = acc if first is None else first
        cells.append("—" if acc is None else f"{acc:.3f}")
    theirs = mean_acc([r for r in peer if lo < r["step"] <= hi])
    diff = "—" if first is None or theirs is None else f"{first - theirs:+.3f}"
    print(f"{lo + 1}-{hi} | " + " | ".join(cells) + f" | {theirs:.3f} | {diff}")
