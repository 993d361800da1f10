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
