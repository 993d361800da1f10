"""s25's paired ratios beside `compare`: the shipped drafter (i704a2k6, 6 epochs = 3x the
peer's steps: not the goal's same-steps comparison) over the same-shape peer, and each
report's lossless count. Run from the repo root: python benchmarks/raw/quality_20261204_s25/scripts/pairs25.py"""

import json
import sys
from pathlib import Path

sys.path.insert(0, "bench")
from quality_report import before_loops, tau_ratio_interval  # noqa: E402

RAW = Path("benchmarks/raw")
RUNS = {
    "l5s2i704a2k (s21, 2 epochs)": RAW / "quality_20261204_s21/runs/l5s2i704a2k/eval",
    "i704a2k6 (s24, shipped, 6 epochs)": RAW / "quality_20261204_s24/runs/i704a2k6/eval",
}
PEER = RAW / "quality_20261204_s25/peer-speculators/eval"

for name, folder in RUNS.items():
    for kind in ("chat", "humaneval", "code", "chat_t1"):
        mine = json.loads((folder / f"{kind}.json").read_text())
        peer = json.loads((PEER / f"{kind}.json").read_text())
        low, high = tau_ratio_interval(mine, peer)
        line = f"{name} {kind}: {mine['tau']:.3f} / {peer['tau']:.3f} = "
        line += f"{mine['tau'] / peer['tau']:.3f} [{low:.2f}-{high:.2f}]"
        a, b = before_loops(mine), before_loops(peer)
        if a and b and kind != "chat_t1":
            lo2, hi2 = tau_ratio_interval(a, b)
            line += f"; before loops {a['tau']:.3f} / {b['tau']:.3f} = {a['tau'] / b['tau']:.3f}"
            line += f" [{lo2:.2f}-{hi2:.2f}]"
        print(line)
for kind in ("chat", "humaneval", "code"):
    peer = json.loads((PEER / f"{kind}.json").read_text())
    print(
        f"peer {kind}: lossless {peer['lossless_prompts']}/{peer['num_prompts']}, near ties "
        f"{peer['near_tie_prompts']}, unexplained {peer['unexplained_mismatch_prompts']}"
    )
