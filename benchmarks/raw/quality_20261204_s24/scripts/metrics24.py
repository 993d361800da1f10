"""s24: i704a2k6's training pace from its metrics.jsonl (windows of 20 steps; step_s is the
window's wall time a step, target_s / drafter_s its parts: with target.forward_rows = 10 a
group's whole target forward falls in the window where the group starts)."""
import json, statistics as st
R = "/work/main/benchmarks/raw/"
rows = [json.loads(l) for l in open(R + "quality_20261204_s24/runs/i704a2k6/metrics.jsonl") if l.strip()]
prev, pure = 0, 0.0
for r in rows:
    pure += r["step_s"] * (r["step"] - prev); prev = r["step"]
med = lambda k: round(st.median(r[k] for r in rows[1:]) * 1000, 1)
print(f"windows {len(rows)}, last step {rows[-1]['step']}, steps' wall time (sum of step_s x window) {pure:.1f} s")
print(f"median step {med('step_s')} ms (target {med('target_s')}, drafter {med('drafter_s')}); "
      f"first half {round(st.median(r['step_s'] for r in rows[1:len(rows)//2])*1000,1)} ms, "
      f"second half {round(st.median(r['step_s'] for r in rows[len(rows)//2:])*1000,1)} ms")
print("last window: loss", rows[-1]["loss"], "tau_hat", rows[-1]["tau_hat"],
      "; mean tau_hat of the last 10 windows", round(st.mean(r["tau_hat"] for r in rows[-10:]), 3))
print("empty steps:", sum(r.get("empty_steps", 0) for r in rows))
for s in (1000, 3000, 6000, 9000, 12000, 13860):
    near = min(rows, key=lambda r: abs(r["step"] - s))
    print(f"  step {near['step']}: tau_hat {near['tau_hat']}, loss {near['loss']}")

# What an in-training eval costs (the preset's eval.every = 5000; i704a2k6 ran without):
# the eval windows' wall time over the median window, in s12's `ref6` (same data, one H200).
ref6 = [json.loads(l) for l in open(R + "quality_20261202_s12/ref6/metrics.jsonl") if l.strip()]
median = st.median(r["step_s"] for r in ref6 if "eval_tau" not in r)
prev = 0
for r in ref6:
    if "eval_tau" in r:
        print(f"ref6 (s12) in-training eval at step {r['step']}: "
              f"{(r['step_s'] - median) * (r['step'] - prev):.1f} s over its window's median")
    prev = r["step"]
