"""Training-time accepted length at equal steps, flashdraft's runs against the s25 peer (same
rows): flashdraft's `tau_hat` and the peer's `eal`, both 1 + a block's correct prefix of draft
slots (argmax against the target's argmax) on the training rows, averaged over windows of
steps (lo, hi]. The closest like-for-like training number of the two (the peer counts a
block when any slot is trained, flashdraft when slot 1 is; the anchors differ); a first read
of an ablation before its evals. Usage from the repo root:
python benchmarks/raw/peer_gap_cpu_20261204_s26/scripts/tauhat26.py [RUN_METRICS ...]"""

import json
import sys
from pathlib import Path

RAW = Path("benchmarks/raw")
PEER = RAW / "quality_20261204_s25/peer-speculators/metrics.jsonl"
RUNS = sys.argv[1:] or [str(RAW / "quality_20261204_s21/runs/l5s2i704a2k/metrics.jsonl")]
WINDOWS = [(400, 600), (1000, 1200), (2000, 2200), (3000, 3200), (4400, 4626)]


def mean_of(path: Path | str, key: str, lo: int, hi: int) -> float | None:
    values = [
        r[key]
        for r in map(json.loads, filter(str.strip, Path(path).read_text().splitlines()))
        if lo < r["step"] <= hi and key in r
    ]
    return sum(values) / len(values) if values else None


names = [Path(r).parent.name for r in RUNS]
print("| steps | " + " | ".join(names) + " | peer | " + " | ".join(f"{n} / peer" for n in names) + " |")
print("|---" * (2 + 2 * len(names)) + "|")
for lo, hi in WINDOWS:
    ours = [mean_of(r, "tau_hat", lo, hi) for r in RUNS]
    theirs = mean_of(PEER, "eal", lo, hi)
    cells = ["—" if v is None else f"{v:.3f}" for v in ours]
    ratios = ["—" if v is None or not theirs else f"{v / theirs:.3f}" for v in ours]
    print(f"| {lo + 1}-{hi} | " + " | ".join(cells) + f" | {theirs:.3f} | " + " | ".join(ratios) + " |")
