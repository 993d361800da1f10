"""Decode time per output token of two runs on the same prompts (same machine, same loop):
the ratio B / A pooled over prompts, with a 90% bootstrap interval over prompts.
python ratio.py RUNS_DIR A B [KIND ...]"""
import json
import random
import sys
from pathlib import Path

runs, a, b, *kinds = sys.argv[1:]
for kind in kinds or ["chat", "humaneval", "code", "chat_t1"]:
    pa = json.loads((Path(runs) / a / "eval" / f"{kind}.json").read_text())["per_prompt"]
    pb = json.loads((Path(runs) / b / "eval" / f"{kind}.json").read_text())["per_prompt"]
    assert [p["id"] for p in pa] == [p["id"] for p in pb]

    def ms(rows, idx):
        s = sum(rows[i]["decode_s"] for i in idx)
        n = sum(len(rows[i]["output_ids"]) - 1 for i in idx)
        return 1000 * s / n

    idx = list(range(len(pa)))
    point = ms(pb, idx) / ms(pa, idx)
    rng = random.Random(0)
    boots = sorted(
        ms(pb, s) / ms(pa, s) for s in ([rng.choice(idx) for _ in idx] for _ in range(2000))
    )
    print(
        f"{kind}: {b} / {a} decode ms per output token {ms(pb, idx):.4f} / {ms(pa, idx):.4f} "
        f"= {point:.3f} [{boots[100]:.3f}-{boots[1899]:.3f}] over {len(idx)} prompts"
    )
