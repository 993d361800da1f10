import json, sys
sys.path.insert(0, '/work/main/bench')
from quality_report import tau_ratio_interval
src = {}
for k in ['chat', 'humaneval', 'code']:
    for l in open(f'/tmp/s12/eval/{k}_24.jsonl'):
        r = json.loads(l); src[r['id']] = r.get('source')
def load(p):
    r = json.load(open(p))
    for x in r['per_prompt']:
        x['source'] = src.get(x['id'])
    return r
for k in ['chat', 'humaneval', 'code']:
    try:
        a = load(f'/tmp/s12/cpu/ref6_{k}.json'); b = load(f'/tmp/s12/cpu/m6_{k}.json')
    except FileNotFoundError:
        continue
    iv = tau_ratio_interval(a, b)
    nsrc = len({x['source'] for x in a['per_prompt']})
    print(f"{k}: ref6 {a['tau']:.3f} ({a['total_steps']} steps, lossless {a['lossless_prompts']}/24) m6 {b['tau']:.3f} ({b['total_steps']}) ratio {a['tau']/b['tau']:.3f} [{iv[0]:.2f}-{iv[1]:.2f}] sources {nsrc}")
    import statistics
    print('   median prompt tau', round(statistics.median(x['tau'] for x in a['per_prompt']),2), round(statistics.median(x['tau'] for x in b['per_prompt']),2))
