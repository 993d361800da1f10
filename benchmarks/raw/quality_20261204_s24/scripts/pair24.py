"""s24: i704a2k6 (one stage, 13,878 steps) against the shipped p704ft2 (s22) and ref6 (s12),
paired per prompt on the same 24 held-out prompts per kind (H200, T = 0; chat_t1 at T = 1)."""
import json, sys
from pathlib import Path
sys.path[:0] = ["/work/main", "/work/main/bench"]
from quality_compare import before_loops, tau_ratio_interval
RAW = Path("/work/main/benchmarks/raw")
NEW = RAW / "quality_20261204_s24/runs/i704a2k6/eval"
OLD = {"p704ft2 (s22)": RAW / "quality_20261204_s22/runs/p704ft2/eval",
       "ref6 (s12)": RAW / "quality_20261202_s12/ref6/eval"}

def ratio(m, t):
    lo, hi = tau_ratio_interval(m, t) or (float("nan"),) * 2
    return f"{m['tau']:.3f} / {t['tau']:.3f} = {m['tau'] / t['tau']:.3f} [{lo:.3f}-{hi:.3f}]"

for name, old in OLD.items():
    print(f"# i704a2k6 / {name}")
    for kind in ("chat", "humaneval", "code", "chat_t1"):
        if not (old / f"{kind}.json").exists():
            print(f"  {kind}: no {name} file"); continue
        a, b = (json.loads((d / f"{kind}.json").read_text()) for d in (NEW, old))
        pa, pb = a["per_prompt"], b["per_prompt"]
        assert [p["id"] for p in pa] == [p["id"] for p in pb], kind
        same = sum(p["output_ids"] == q["output_ids"] for p, q in zip(pa, pb))
        line = f"  {kind}: {ratio(a, b)}; target outputs identical {same}/{len(pa)}"
        if kind != "chat_t1":
            ba, bb = before_loops(a), before_loops(b)
            line += f"; before the loops {ratio(ba, bb)}"
        print(line)

# On the CPU (fp32, 2 cores): the export (cpu/i704a2k6_<kind>.json, `flashdraft eval` on the
# s22 prompt files cpu/*_24.jsonl) against p704ft2's (s22) and ref6's (s12) CPU reports.
CPU = RAW / "quality_20261204_s24/cpu"
OLD_CPU = {"p704ft2 (s22)": (RAW / "quality_20261204_s22/cpu", "p704ft2"),
           "ref6 (s12)": (RAW / "quality_20261202_s12/cpu", "ref6")}
for name, (folder, stem) in OLD_CPU.items():
    print(f"# CPU fp32: i704a2k6 / {name}")
    for kind in ("chat", "humaneval", "code"):
        new, old = CPU / f"i704a2k6_{kind}.json", folder / f"{stem}_{kind}.json"
        if not new.exists():
            print(f"  {kind}: not measured"); continue
        a, b = json.loads(new.read_text()), json.loads(old.read_text())
        pa, pb = a["per_prompt"], b["per_prompt"]
        assert [p["id"] for p in pa] == [p["id"] for p in pb], kind
        same = sum(p["output_ids"] == q["output_ids"] for p, q in zip(pa, pb))
        ba, bb = before_loops(a), before_loops(b)
        print(f"  {kind}: {ratio(a, b)}; lossless {a['lossless_prompts']}/{len(pa)}; outputs "
              f"identical {same}/{len(pa)}; before the loops {ratio(ba, bb)}")
