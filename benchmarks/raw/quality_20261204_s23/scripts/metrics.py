import json, statistics as st, sys
R="/work/main/benchmarks/raw/"
def load(p): return [json.loads(l) for l in open(R+p) if l.strip()]
def windows(rows):
    out=[]; prev=0
    for r in rows:
        out.append((r, r["step"]-prev if r["step"]>prev else None)); prev=r["step"]
    return out
for name,p in [("ref6 s23","quality_20261204_s23/runs/ref6/metrics.jsonl"),("ref6 s12","quality_20261202_s12/ref6/metrics.jsonl"),("p704ft2 s23","quality_20261204_s23/runs/p704ft2/metrics.jsonl"),("p704ft2 s22","quality_20261204_s22/runs/p704ft2/metrics.jsonl")]:
    rows=load(p); steps=[r["step"] for r in rows]
    nonmono=[(a,b) for a,b in zip(steps,steps[1:]) if b<=a]
    gaps=sorted({b-a for a,b in zip(steps,steps[1:])})
    ev=[r for r in rows if "eval_tau" in r]
    plain=[r for r in rows if "eval_tau" not in r]
    pure=0.0; prev=0
    for r in rows:
        pure+=r["step_s"]*(r["step"]-prev); prev=r["step"]
    pure_noeval=0.0; prev=0
    for r in rows:
        if "eval_tau" not in r: pure_noeval+=r["step_s"]*(r["step"]-prev)
        else: pure_noeval+=st.median(x["step_s"] for x in plain)*(r["step"]-prev)
        prev=r["step"]
    f=lambda k,rs: (round(st.median(r[k] for r in rs),4), round(st.mean(r[k] for r in rs),4))
    print(f"== {name}: rows {len(rows)}, last step {steps[-1]}, nonmono {nonmono[:5]}, gaps {gaps}, eval rows {len(ev)} at {[r['step'] for r in ev]}")
    print("  last loss/tau_hat", rows[-1]["loss"], rows[-1]["tau_hat"], " mean of last 10 rows tau_hat", round(st.mean(r['tau_hat'] for r in rows[-10:]),3), "loss", round(st.mean(r['loss'] for r in rows[-10:]),4))
    print("  step_s med/mean (all)", f("step_s",rows), "(no-eval, excl first row)", f("step_s",plain[1:]), "target_s", f("target_s",plain[1:]), "drafter_s", f("drafter_s",plain[1:]))
    print("  sum step_s*window =", round(pure,1), "s; with eval windows replaced by median:", round(pure_noeval,1), "; tokens", sum(r['tokens'] for r in rows))
    big=[(r['step'],r['step_s']) for r in rows if r['step_s']>0.15]
    print("  windows with step_s>0.15:", big)
