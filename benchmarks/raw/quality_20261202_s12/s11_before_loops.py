"""The eleventh session's same-size comparison with the peer (3 layers, 4,626 steps, the same
24 prompts per kind), recounted over the text before the outputs fall into a loop.

    PYTHONPATH=.:bench python benchmarks/raw/quality_20261202_s12/s11_before_loops.py
"""

import json
from pathlib import Path

from quality_compare import before_loops, tau_ratio_interval

RAW = Path(__file__).parents[1] / "quality_20261202_s11"


def load(run: str, kind: str) -> dict:
    return json.loads((RAW / run / "eval" / f"{kind}.json").read_text())


for kind in ("chat", "humaneval", "code"):
    peer = load("peer-speculators", kind)
    for run in ("muon2", "soft2", "l5m2"):
        mine = load(run, kind)
        cut_mine, cut_peer = before_loops(mine), before_loops(peer)
        assert cut_mine is not None and cut_peer is not None
        low, high = tau_ratio_interval(mine, peer) or (0.0, 0.0)
        low2, high2 = tau_ratio_interval(cut_mine, cut_peer) or (0.0, 0.0)
        print(
            f"{kind} {run}: all {mine['tau']:.3f} / {peer['tau']:.3f} = "
            f"{mine['tau'] / peer['tau']:.2f} [{low:.2f}-{high:.2f}]; before the loops "
            f"{cut_mine['tau']:.3f} / {cut_peer['tau']:.3f} = "
            f"{cut_mine['tau'] / cut_peer['tau']:.2f} [{low2:.2f}-{high2:.2f}]; loops "
            f"{cut_mine['loop_prompts']} / {cut_peer['loop_prompts']} of 24"
        )
