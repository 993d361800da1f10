import json, statistics as st
R="/work/main/benchmarks/raw/"
def load(p): return {r["step"]: r for r in (json.loads(l) for l in open(R+p) if l.strip())}
def cmp(a, b, label, marks):
    common = sorted(set(a) & set(b))
    d = [(s, a[s]["tau_hat"]-b[s]["tau_hat"], a[s]["loss"]-b[s]["loss"]) for s in common]
    mx = max(d, key=lambda x: abs(x[1])); ml = max(d, key=lambda x: abs(x[2]))
    print(f"== {label}: {len(common)} common logged steps ({common[0]}..{common[-1]})")
    print(f"  tau_hat diff: max |d| {abs(mx[1]):.3f} at step {mx[0]}, mean |d| {st.mean(abs(x[1]) for x in d):.3f}, mean d {st.mean(x[1] for x in d):+.3f}")
    print(f"  loss diff: max |d| {abs(ml[2]):.3f} at step {ml[0]}, mean |d| {st.mean(abs(x[2]) for x in d):.4f}, mean d {st.mean(x[2] for x in d):+.4f}")
    # smoothed: mean over 1000-step bins
    bins = {}
    for s, dt, dl in d: bins.setdefault((s-1)//1000, []).append((dt, dl, a[s]["tau_hat"], b[s]["tau_hat"], a[s]["loss"], b[s]["loss"]))
    print("  1000-step bin means (tau_hat a/b, loss a/b):", "; ".join(f"{(k+1)*1000}: {st.mean(x[2] for x in v):.2f}/{st.mean(x[3] for x in v):.2f}, {st.mean(x[4] for x in v):.3f}/{st.mean(x[5] for x in v):.3f}" for k, v in sorted(bins.items())))
    for s in marks:
        if s in a and s in b: print(f"  step {s}: tau_hat {a[s]['tau_hat']:.3f} vs {b[s]['tau_hat']:.3f}; loss {a[s]['loss']:.4f} vs {b[s]['loss']:.4f}; step_s {a[s]['step_s']} vs {b[s]['step_s']}")
        else: print(f"  step {s}: a {s in a} b {s in b}")
ra, rb = load("quality_20261204_s23/runs/ref6/metrics.jsonl"), load("quality_20261202_s12/ref6/metrics.jsonl")
cmp(ra, rb, "ref6 s23 vs s12", [20, 40, 1000, 5000, 10000, 13860])
# last-1000-step means
for n, m in (("s23", ra), ("s12", rb)):
    last = [r for s, r in m.items() if s > 12878]
    print(f"  {n} last 1000 steps mean tau_hat {st.mean(r['tau_hat'] for r in last):.3f}, loss {st.mean(r['loss'] for r in last):.4f} ({len(last)} rows)")
pa, pb = load("quality_20261204_s23/runs/p704ft2/metrics.jsonl"), load("quality_20261204_s22/runs/p704ft2/metrics.jsonl")
cmp(pa, pb, "p704ft2 s23 vs s22", [20, 40, 60, 100, 1000, 2000, 3000, 3500])
for n, m in (("s23", pa), ("s22", pb)):
    for lo, hi in ((0, 1000), (1000, 2000), (2000, 3000), (3000, 3500), (2500, 3500), (3500, 4626)):
        w = [r for s, r in m.items() if lo < s <= hi]
        if w: print(f"  {n} steps {lo+1}-{hi}: mean tau_hat {st.mean(r['tau_hat'] for r in w):.3f}, loss {st.mean(r['loss'] for r in w):.4f}, median step_s {st.median(r['step_s'] for r in w):.4f}, target_s {st.median(r['target_s'] for r in w):.4f}, drafter_s {st.median(r['drafter_s'] for r in w):.4f}")
# time to step 3500
for n, m in (("s23", pa), ("s22", pb)):
    t = 0; prev = 0; t35 = None
    for s in sorted(m):
        t += m[s]["step_s"]*(s-prev); prev = s
        if s == 3500: t35 = t
    print(f"  {n} pure step time to 3500: {t35:.1f} s; total {t:.1f} s to {prev}")
