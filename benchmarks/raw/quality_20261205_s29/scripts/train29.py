"""Training-time accepted length at equal steps for s29's runs and the ones they are read
against (same rows): flashdraft's `tau_hat` and the peer's `eal` (1 + a block's correct
prefix of draft slots on the training rows; s26's tauhat26.py explains how the two count),
averaged over windows of steps (lo, hi]. Run from the repo root:
python benchmarks/raw/quality_20261205_s29/scripts/train29.py"""

import json
from pathlib import Path

RAW = Path("benchmarks/raw")
RUNS = {  # name: (metrics, key)
    "pe": (RAW / "quality_20261205_s28/runs/pe/metrics.jsonl", "tau_hat"),
    "pe32": (RAW / "quality_20261205_s29/runs/pe32/metrics.jsonl", "tau_hat"),
    "peer": (RAW / "quality_20261204_s25/peer-speculators/metrics.jsonl", "eal"),
    "peer-seed1": (RAW / "quality_20261205_s29/runs/peer-seed1/metrics.jsonl", "eal"),
}
WINDOWS = [(400, 600), (1000, 1200), (2000, 2200), (3000, 3200), (4400, 4626)]
RATIOS = [("pe32", "pe"), ("peer-seed1", "peer"), ("pe", "peer-seed1"), ("pe32", "peer-seed1")]


def mean_of(path: Path, key: str, lo: int, hi: int) -> float:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    values = [r[key] for r in rows if key in r and lo < r["step"] <= hi]
    return sum(values) / len(values)


print("| steps | " + " | ".join(RUNS) + " | " + " | ".join(f"{a} / {b}" for a, b in RATIOS) + " |")
print("|---" * (1 + len(RUNS) + len(RATIOS)) + "|")
for lo, hi in WINDOWS:
    means = {name: mean_of(path, key, lo, hi) for name, (path, key) in RUNS.items()}
    cells = [f"{means[n]:.3f}" for n in RUNS] + [f"{means[a] / means[b]:.3f}" for a, b in RATIOS]
    print(f"| {lo + 1}-{hi} | " + " | ".join(cells) + " |")
