"""This record's CPU evals (fp32, the same 24 held-out prompts per kind as the GPU evals):
`l5s2a2k` (2 epochs, A = 2048) against the shipped `ref6` (6 epochs, A = 512, s12's CPU
reports), paired by prompt, with 90% bootstrap intervals over whole sources (named by the GPU
reports of the same prompts), and each report's lossless count and tau before the loops.

    PYTHONPATH=.:bench python benchmarks/raw/quality_20261204_s21/cpu/pair.py
"""

import json
from pathlib import Path

from quality_compare import tau_ratio_interval

HERE = Path(__file__).parent
S12 = HERE.parents[1] / "quality_20261202_s12"
for kind in ("chat", "humaneval", "code"):
    gpu = json.loads((HERE.parent / "runs" / "l5s2a2k" / "eval" / f"{kind}.json").read_text())
    sources = {p["id"]: p.get("source") for p in gpu["per_prompt"]}
    mine = json.loads((HERE / f"l5s2a2k_{kind}.json").read_text())
    ref6 = json.loads((S12 / "cpu" / f"ref6_{kind}.json").read_text())
    low, high = tau_ratio_interval(mine, ref6, sources=sources) or (float("nan"),) * 2
    print(
        f"{kind}: l5s2a2k {mine['tau']:.3f} (GPU bf16 {gpu['tau']:.3f}; lossless "
        f"{mine.get('lossless_prompts')}/{mine['num_prompts']}; before the loops "
        f"{mine.get('tau_before_loops', float('nan')):.3f}) ref6 {ref6['tau']:.3f} "
        f"ratio {mine['tau'] / ref6['tau']:.3f} [{low:.2f}-{high:.2f}]"
    )
