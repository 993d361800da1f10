"""The paired ratios of this record's CPU evals, ref6 / m6, with 90% bootstrap intervals over
whole sources (the GPU reports of the same prompts carry each prompt's source).

    PYTHONPATH=.:bench python benchmarks/raw/quality_20261202_s12/cpu/pair.py
"""

import json
from pathlib import Path

from quality_compare import tau_ratio_interval

HERE = Path(__file__).parent
for kind in ("chat", "humaneval", "code"):
    gpu = json.loads((HERE.parent / "ref6" / "eval" / f"{kind}.json").read_text())
    sources = {p["id"]: p.get("source") for p in gpu["per_prompt"]}
    mine, theirs = (json.loads((HERE / f"{run}_{kind}.json").read_text()) for run in ("ref6", "m6"))
    for report in (mine, theirs):
        for p in report["per_prompt"]:
            p["source"] = sources[p["id"]]
    low, high = tau_ratio_interval(mine, theirs) or (float("nan"), float("nan"))
    print(f"{kind}: ref6 {mine['tau']:.3f} m6 {theirs['tau']:.3f} ratio "
          f"{mine['tau'] / theirs['tau']:.3f} [{low:.2f}-{high:.2f}]")
