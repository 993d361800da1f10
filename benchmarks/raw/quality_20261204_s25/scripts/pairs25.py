"""s25's paired ratios beside `compare`: the shipped drafter (i704a2k6, 6 epochs = 3x the
peer's steps: not the goal's same-steps comparison) over the same-shape peer, and each
report's lossless count. Run from the repo root: python benchmarks/raw/quality_20261204_s25/scripts/pairs25.py"""

import json
import sys
from pathlib import Path

sys.path.insert(0, "bench")
from quality_compare import paired_ratio_text  # noqa: E402

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
        print(f"{name} {kind}: {paired_ratio_text(mine, peer, kind != 'chat_t1')}")
for kind in ("chat", "humaneval", "code"):
    peer = json.loads((PEER / f"{kind}.json").read_text())
    print(
        f"peer {kind}: lossless {peer['lossless_prompts']}/{peer['num_prompts']}, near ties "
        f"{peer['near_tie_prompts']}, unexplained {peer['unexplained_mismatch_prompts']}"
    )
