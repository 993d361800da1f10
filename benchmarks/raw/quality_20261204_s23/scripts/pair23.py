import json, sys
from pathlib import Path
sys.path[:0] = ["/work/main", "/work/main/bench"]
from quality_compare import before_loops, tau_ratio_interval
RAW = Path("/work/main/benchmarks/raw")
A = RAW/"quality_20261204_s23/runs/ref6/eval"; B = RAW/"quality_20261202_s12/ref6/eval"
def ratio(m, t, s=None):
    lo, hi = tau_ratio_interval(m, t, sources=s) or (float("nan"),)*2
    return f"{m['tau']:.3f} / {t['tau']:.3f} = {m['tau']/t['tau']:.3f} [{lo:.3f}-{hi:.3f}]"
for kind in ("chat", "chat_t1"):
    a, b = json.loads((A/f"{kind}.json").read_text()), json.loads((B/f"{kind}.json").read_text())
    pa, pb = a["per_prompt"], b["per_prompt"]
    ids_same = [p["id"] for p in pa] == [p["id"] for p in pb]
    srcs_same = [p.get("source") for p in pa] == [p.get("source") for p in pb]
    ptok_same = [p["prompt_tokens"] for p in pa] == [p["prompt_tokens"] for p in pb]
    outs_same = sum(p["output_ids"] == q["output_ids"] for p, q in zip(pa, pb))
    nsrc = len({p.get("source") for p in pa})
    print(f"== {kind}: ids same {ids_same}, sources same {srcs_same} ({nsrc} sources), prompt_tokens same {ptok_same}, identical outputs {outs_same}/24")
    print(" settings diff:", {k: (a['settings'].get(k), b['settings'].get(k)) for k in set(a['settings'])|set(b['settings']) if a['settings'].get(k)!=b['settings'].get(k)})
    print(" all:", ratio(a, b), " steps", a["total_steps"], b["total_steps"], "out tokens", a["output_tokens"], b["output_tokens"])
    ba, bb = before_loops(a), before_loops(b)
    print(" before loops:", ratio(ba, bb), "loop prompts", ba["loop_prompts"], bb["loop_prompts"], "recorded s23", a.get("tau_before_loops"))
    print(" prompt_tau_mean", a["prompt_tau_mean"], b["prompt_tau_mean"], "speedup", a.get("speedup"), b.get("speedup"), "lossless", a.get("lossless_prompts"), b.get("lossless_prompts"))
    print(" per-prompt tau ratios:", [round(p["tau"]/q["tau"],2) for p,q in zip(pa,pb)])
    print(" per_pos s23", [round(x,2) for x in a["per_position_acceptance"][:8]]); print(" per_pos s12", [round(x,2) for x in b["per_position_acceptance"][:8]])
    print(" timing s23", a["timing"]); print(" timing s12", b["timing"])
