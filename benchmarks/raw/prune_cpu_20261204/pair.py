"""The pruned exports' CPU evals against the shipped `ref6` (s12's CPU reports, the same 24
held-out prompts per kind), paired by prompt, 90% bootstrap intervals over whole sources
(named by the s21 GPU reports of the same prompts).

    PYTHONPATH=.:bench python benchmarks/raw/prune_cpu_20261204/pair.py
"""

import json
from pathlib import Path

from quality_compare import tau_ratio_interval

HERE = Path(__file__).parent
RAW = HERE.parent
for kind in ("chat", "humaneval", "code"):
    gpu = json.loads((RAW / "quality_20261204_s21/runs/l5s2a2k/eval" / f"{kind}.json").read_text())
    sources = {p["id"]: p.get("source") for p in gpu["per_prompt"]}
    ref6 = json.loads((RAW / "quality_20261202_s12/cpu" / f"ref6_{kind}.json").read_text())
    for path in sorted(HERE.glob(f"?_{kind}.json")):
        mine = json.loads(path.read_text())
        low, high = tau_ratio_interval(mine, ref6, sources=sources) or (float("nan"),) * 2
        print(
            f"{kind} {path.stem[0]}: tau {mine['tau']:.3f} (before the loops "
            f"{mine.get('tau_before_loops', float('nan')):.3f}), ref6 {ref6['tau']:.3f}, "
            f"ratio {mine['tau'] / ref6['tau']:.3f} [{low:.2f}-{high:.2f}]"
        )
