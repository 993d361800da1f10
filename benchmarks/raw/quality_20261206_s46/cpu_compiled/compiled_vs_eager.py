"""CPU check (s46): the static decode loop with the drafter's parts compiled by inductor
decodes as the same loop eager, with real weights (the SmolLM2-135M target, a shipped
export), fp32, no CUDA graphs, at T = 0 and T = 1. (s47 review: the target now comes from
`assets.smollm2_path()` and the stop ids from `eos_token_ids`, not a hard-coded path and
[2]; rerun with them, the same output: compiled_vs_eager_s47.txt.)

python compiled_vs_eager.py DRAFTER PROMPTS.jsonl N_PROMPTS NEW_TOKENS
"""

import sys
import time

import torch
from transformers import AutoTokenizer

from flashdraft.assets import smollm2_path
from flashdraft.eval.fast import StaticDecoder, StaticLM, cache_slots
from flashdraft.eval.prompts import load_prompts
from flashdraft.eval.speculative import eos_token_ids
from flashdraft.model.head import TargetHead
from flashdraft.model.target import load_target
from flashdraft.train.checkpoint import load_drafter


def main(drafter_path: str, prompts_path: str, limit: int, new: int) -> None:
    torch.manual_seed(0)
    target_dir = str(smollm2_path())
    target = load_target(target_dir, "float32", "sdpa", torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    drafter = load_drafter(drafter_path).float().eval()
    prompts = load_prompts(prompts_path, tokenizer, limit)
    head = TargetHead.from_model(target)
    block = drafter.config.block_size
    slots = cache_slots(max(len(p.input_ids) for p in prompts), new, block)
    taps = list(drafter.config.target_layer_ids)
    eos = sorted(eos_token_ids(target, tokenizer))  # SmolLM2: [2], its end of turn
    for temperature in (0.0, 1.0):
        results = {}
        for backend in (None, "inductor"):
            decoder = StaticDecoder(
                target,
                max_len=slots,
                drafter=drafter,
                head=head,
                block_size=block,
                temperature=temperature,
                eos_ids=eos,
                graphs=False,
                compile_backend=backend,
                lm=StaticLM(target, 1, slots, taps),
            )
            began = time.time()
            out = [decoder.decode(p.input_ids, new, seed=i) for i, p in enumerate(prompts)]
            results[backend] = out
            steps = sum(r.num_steps for r in out)
            emitted = sum(sum(r.acceptance_lengths) for r in out)  # tau: per verify step
            print(
                f"T={temperature} backend={backend} info={decoder.info} steps={steps} "
                f"tau={emitted / steps:.3f} {time.time() - began:.1f}s",
                flush=True,
            )
        same = [
            x.output_ids == y.output_ids and x.acceptance_lengths == y.acceptance_lengths
            for x, y in zip(results[None], results["inductor"], strict=True)
        ]
        print(f"T={temperature}: identical prompts {sum(same)}/{len(same)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
