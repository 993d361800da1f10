"""s29's pooled ratios. Each recipe that ran twice is pooled over its runs
(bench/quality_report.py's `pooled`: every prompt keeps both runs' verify steps), and the
90% interval resamples whole sources with both runs on them: it covers the prompts, not
the seeds (two runs give a mean, not a spread). Recipes, all at the shipped shape on the
same rows for 4,626 steps and the same 24 held-out prompts per kind:
  recipe   flashdraft's soft-label preset: l5s2i704a2k (s21, seed 0) and s1 (s28, seed 1)
  pe       the peer's settings inside flashdraft, s28's run alone
  pe-runs  the same settings, one seed (0) under two numerics and machines: pe (s28, H200)
           and pe32 (s29, H100, plus drafter.residual_dtype=float32, which moved nothing
           beyond noise: see pairs28.txt); not seed evidence
  peer     speculators 0.9.0's own recipe: s25's run (seed 42, H200) and peer-seed1 (s29,
           seed 1, H100)
  dpm      D-PACE + soft labels + argmax_mix 0.5 (s28, chat only; one run)
A later session's runs join a recipe as RECIPE:RUN=EVAL_FOLDER arguments (e.g.
dpm:dpm0=DIR/runs/dpm0/eval), each read against the pooled peer; a recipe pools, for each
kind, the runs that evaluated it.
Run from the repo root: python benchmarks/raw/quality_20261205_s29/scripts/pairs29.py [...]"""

import json
import sys
from pathlib import Path

sys.path.insert(0, "bench")
from quality_compare import paired_ratio_text

RAW = Path("benchmarks/raw")
EVALS = {
    "l5s2i704a2k": RAW / "quality_20261204_s21/runs/l5s2i704a2k/eval",
    "s1": RAW / "quality_20261205_s28/runs/s1/eval",
    "pe": RAW / "quality_20261205_s28/runs/pe/eval",
    "dpm": RAW / "quality_20261205_s28/runs/dpm/eval",
    "pe32": RAW / "quality_20261205_s29/runs/pe32/eval",
    "peer": RAW / "quality_20261204_s25/peer-speculators/eval",
    "peer-seed1": RAW / "quality_20261205_s29/runs/peer-seed1/eval",
}
RECIPES = {
    "recipe": ["l5s2i704a2k", "s1"],
    "pe": ["pe"],
    "pe-runs": ["pe", "pe32"],
    "peer": ["peer", "peer-seed1"],
    "dpm": ["dpm"],
}
PAIRS = [
    ("recipe", "peer"),
    ("pe", "peer"),
    ("pe-runs", "peer"),
    ("dpm", "peer"),
    ("pe-runs", "recipe"),
]


for extra in sys.argv[1:]:  # RECIPE:RUN=EVAL_FOLDER
    recipe_run, _, folder = extra.partition("=")
    recipe, _, run = recipe_run.partition(":")
    EVALS[run] = Path(folder)
    RECIPES.setdefault(recipe, []).append(run)
    if (recipe, "peer") not in PAIRS:
        PAIRS.append((recipe, "peer"))


def read(run: str, kind: str) -> dict | None:
    path = EVALS[run] / f"{kind}.json"
    return json.loads(path.read_text()) if path.exists() else None


for a, b in PAIRS:
    for kind in ("chat", "humaneval", "code", "chat_t1"):
        mine = [r for r in (read(run, kind) for run in RECIPES[a]) if r is not None]
        theirs = [r for r in (read(run, kind) for run in RECIPES[b]) if r is not None]
        if not mine or not theirs:
            continue
        ratio = paired_ratio_text(mine, theirs, kind != "chat_t1")
        print(f"{a} ({len(mine)}) / {b} ({len(theirs)}) {kind}: {ratio}")
