"""s28's paired ratios: the pairs below among the four flashdraft runs at the shipped shape
and the peer (same rows, 4,626 steps, the same 24 held-out prompts per kind), with 90%
paired bootstrap intervals over whole sources (bench/quality_report.py's paired_ratio_text),
and each report's lossless count. s1 / l5s2i704a2k is one recipe under two seeds: the seed
noise. The next session's runs come in as NAME=EVAL_FOLDER arguments (pe32, peer-seed1),
adding their pairs after these. Run from the repo root:
python benchmarks/raw/quality_20261205_s28/scripts/pairs28.py [pe32=DIR/runs/pe32/eval ...]"""

import json
import sys
from pathlib import Path

sys.path.insert(0, "bench")
from quality_compare import paired_ratio_text  # noqa: E402

RAW = Path("benchmarks/raw")
HERE = RAW / "quality_20261205_s28/runs"
EVALS = {
    "l5s2i704a2k": RAW / "quality_20261204_s21/runs/l5s2i704a2k/eval",
    "s1": HERE / "s1/eval",
    "pe": HERE / "pe/eval",
    "dpm": HERE / "dpm/eval",
    "peer": RAW / "quality_20261204_s25/peer-speculators/eval",
}
PAIRS = [
    ("s1", "l5s2i704a2k"),
    ("pe", "l5s2i704a2k"),
    ("pe", "s1"),
    ("dpm", "l5s2i704a2k"),
    ("dpm", "s1"),
    ("pe", "peer"),
    ("dpm", "peer"),
    ("s1", "peer"),
]


for extra in sys.argv[1:]:  # NAME=EVAL_FOLDER
    name, _, folder = extra.partition("=")
    EVALS[name] = Path(folder)
for a, b in [("pe32", "pe"), ("pe32", "peer"), ("peer-seed1", "peer"), ("pe", "peer-seed1")]:
    if a in EVALS and b in EVALS:
        PAIRS.append((a, b))


def read(run: str, kind: str) -> dict | None:
    path = EVALS[run] / f"{kind}.json"
    return json.loads(path.read_text()) if path.exists() else None


for a, b in PAIRS:
    for kind in ("chat", "humaneval", "code", "chat_t1"):
        mine, theirs = read(a, kind), read(b, kind)
        if mine is None or theirs is None:
            continue
        print(f"{a} / {b} {kind}: {paired_ratio_text(mine, theirs, kind != 'chat_t1')}")
for run in ("s1", "pe", "dpm", *(name for name in EVALS if name in ("pe32", "peer-seed1"))):
    for kind in ("chat", "humaneval", "code"):
        report = read(run, kind)
        if report is None:
            continue
        print(
            f"{run} {kind}: lossless {report['lossless_prompts']}/{report['num_prompts']}, near "
            f"ties {report['near_tie_prompts']}, unexplained {report['unexplained_mismatch_prompts']}"
        )
