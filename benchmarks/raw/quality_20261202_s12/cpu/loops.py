import json, sys
def looping(p, tail=128, max_period=32):
    """the answer ends in a cycle: its last `tail` tokens repeat with a period <= max_period"""
    ids = p['output_ids'][-tail:]
    return len(ids) == tail and any(all(ids[j] == ids[j - per] for j in range(per, tail)) for per in range(1, max_period + 1))
def tau(ps):
    return sum(sum(p['acceptance_lengths']) for p in ps) / max(1, sum(len(p['acceptance_lengths']) for p in ps))
for k in ['chat', 'humaneval', 'code']:
    a = json.load(open(f'/tmp/s12/cpu/ref6_{k}.json'))['per_prompt']; b = json.load(open(f'/tmp/s12/cpu/m6_{k}.json'))['per_prompt']
    loops = [looping(p) for p in a]
    A = [p for p, l in zip(a, loops) if not l]; B = [p for p, l in zip(b, loops) if not l]
    L = [p for p, l in zip(a, loops) if l]
    print(f"{k}: {sum(loops)}/24 end in a loop; the rest: ref6 {tau(A):.3f} m6 {tau(B):.3f} ({len(A)} prompts); loops only: ref6 {tau(L):.3f}")
