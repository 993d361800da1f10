"""This record's paired comparisons (the same 24 held-out prompts per kind, T = 0, B = 16):
on the H200 (bf16 evals of `bench/quality.py`), `p704ft2` (the pruned `ref6` fine-tuned 2
epochs at A = 2048, 24.35 MB) against `ref6` (s12) and `l5s2u` (loops untrained) against
`l5s2a2k` (s21); on the CPU (fp32 `flashdraft eval` reports in cpu/, when present),
`p704ft2` against `ref6`'s CPU reports of s12. Each ratio has a 90% paired bootstrap interval
over whole sources, over all steps and over the steps before the target's own loops.

    PYTHONPATH=.:bench python benchmarks/raw/quality_20261204_s22/pair.py
"""

import json
from pathlib import Path

from quality_compare import before_loops, tau_ratio_interval

HERE = Path(__file__).parent
RAW = HERE.parent
GPU = {
    "ref6": RAW / "quality_20261202_s12" / "ref6" / "eval",
    "l5s2a2k": RAW / "quality_20261204_s21" / "runs" / "l5s2a2k" / "eval",
    "p704ft2": HERE / "runs" / "p704ft2" / "eval",
    "l5s2u": HERE / "runs" / "l5s2u" / "eval",
}
CPU = {
    "ref6": lambda kind: RAW / "quality_20261202_s12" / "cpu" / f"ref6_{kind}.json",
    "p704ft2": lambda kind: HERE / "cpu" / f"p704ft2_{kind}.json",
}


def ratio(mine: dict, theirs: dict, sources: dict) -> str:
    low, high = tau_ratio_interval(mine, theirs, sources=sources) or (float("nan"),) * 2
    return f"{mine['tau']:.3f} / {theirs['tau']:.3f} = {mine['tau'] / theirs['tau']:.3f} [{low:.2f}-{high:.2f}]"


def line(where: str, mine_name: str, mine: dict, theirs_name: str, theirs: dict, sources: dict) -> None:
    text = f"{where} {mine_name} / {theirs_name}: all {ratio(mine, theirs, sources)}"
    a, b = before_loops(mine), before_loops(theirs)
    if a and b and (a["loop_prompts"] or b["loop_prompts"]):
        text += f"; before the loops {ratio(a, b, sources)}"
    if mine.get("lossless_prompts") is not None:
        text += f"; lossless {mine['lossless_prompts']}/{mine['num_prompts']}"
    print(text)


for kind in ("chat", "humaneval", "code"):
    gpu = {name: json.loads((folder / f"{kind}.json").read_text()) for name, folder in GPU.items()}
    sources = {p["id"]: p.get("source") for p in gpu["p704ft2"]["per_prompt"]}
    print(f"== {kind}")
    line("H200", "p704ft2", gpu["p704ft2"], "ref6", gpu["ref6"], sources)
    line("H200", "l5s2u", gpu["l5s2u"], "l5s2a2k", gpu["l5s2a2k"], sources)
    if CPU["p704ft2"](kind).exists():
        cpu = {name: json.loads(path(kind).read_text()) for name, path in CPU.items()}
        line("CPU ", "p704ft2", cpu["p704ft2"], "ref6", cpu["ref6"], sources)
