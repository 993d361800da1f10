"""Where one prefill batch of the slot decoder spends its time (generation).

    python bench/prefill_profile.py            # CUDA: SmolLM2-135M-shaped random target
    python bench/prefill_profile.py --smoke    # CPU, tiny

A batch of `--prompts` right-padded prompts of `--length` tokens is prefilled into the rows
of a `--slots`-row static cache, as `SlotDecoder._prefill` does (fresh prompts, logits at
the last position): the median wall time of a call, then a torch.profiler table of one call
(top ops by device time, and CPU time: a launch-bound call shows CPU >> GPU).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, "bench")
from generate import synthetic_target

from flashdraft.model.static import StaticLM


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--prompts", type=int, default=22)
    p.add_argument("--length", type=int, default=700)
    p.add_argument("--slots", type=int, default=512)
    args = p.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.smoke:
        args.prompts, args.length, args.slots = 3, 20, 4
    model = synthetic_target(args.smoke, device)
    lm = StaticLM(model, args.slots, -(-(args.length + 200) // 128) * 128)
    n, w = args.prompts, args.length
    ids = torch.randint(0, model.config.vocab_size, (n, w), device=device)
    positions = torch.arange(w, device=device)[None].expand(n, -1)
    rows = torch.arange(n, device=device)
    last = torch.full((n,), w - 1, device=device)

    def call() -> None:
        with torch.no_grad():
            logits, _ = lm(ids, positions, rows=rows, kv_len=w, logits_at=last, fresh=True)
            logits.argmax(-1).tolist()  # the decoder's host read

    for _ in range(3):
        call()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(
        f"prefill of {n} x {w} tokens: median {times[2] * 1e3:.1f} ms "
        f"({n * w / times[2]:,.0f} tok/s)"
    )
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
    sort = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
