"""Decoding speed of a hybrid target (Qwen3.6-27B-shaped, random weights) in `eval`'s and
`generate`'s loops: HF's eager loop against the static ones.

    python bench/hybrid_decode.py                 # CUDA: the 27B-shaped hybrid, bf16
    python bench/hybrid_decode.py --smoke         # CPU: a tiny hybrid, checks it runs

Measured, batch 1 (eval's loops): ms per token of HF's eager loop (DynamicCache) and of the
static loop (per-part compiled, one CUDA graph per step), the speculative step (a random
`--layers`-layer drafter, B = `--block`: draft + verify of B tokens + the linear layers' state
rollback) over the B = 1 step, and the verify and draft parts replayed alone. Then
`generate`'s slot decoder: `--slots` slots, `--prompts` random prompts of `--prompt-len` tokens,
`--new` new tokens each (no stop token), generated tokens/s end to end, beside HF `generate`
on `--hf-rows` rows for `--hf-new` tokens. Speed does not depend on the weights. A table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from eval_speed import replay_ms  # beside this script
from trainer import GEOMETRIES, SHAPE, smoke_geometry, target_model

from flashdraft.benchutil import environment, print_json, print_table, sync
from flashdraft.data.fast_inference import PhaseTimes, SlotDecoder, cache_length
from flashdraft.eval.fast import StaticDecoder, cache_slots
from flashdraft.eval.speculative import Decoder, decode
from flashdraft.model import static_hybrid
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import init_seeded
from flashdraft.model.head import TargetHead
from flashdraft.model.static import StaticLM


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny hybrid on the CPU")
    p.add_argument("--layers", type=int, default=5, help="drafter layers")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--prompt", type=int, default=512, help="eval prompt tokens")
    p.add_argument("--tokens", type=int, default=128, help="tokens per timed decode")
    p.add_argument("--hf-tokens", type=int, default=16, help="tokens of HF's timed decode")
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--hf-rows", type=int, default=32)
    p.add_argument("--hf-new", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="no HF baselines")
    p.add_argument(
        "--compare-step",
        action="store_true",
        help="also time generate with the delta rule's decode step as torch ops (not the "
        "fused Triton kernel)",
    )
    p.add_argument("--memory-fraction", type=float, default=None, help="cap the GPU's memory")
    args = p.parse_args()
    args.geometry = "27b-hybrid"
    args.target_attention = None
    args.linear_key_heads, args.linear_value_heads, args.linear_head_dim = 16, 48, 128
    for name, value in zip(SHAPE, GEOMETRIES["27b-hybrid"], strict=True):
        setattr(args, name, value)
    if args.smoke:
        smoke_geometry(args)
        args.prompt, args.tokens, args.hf_tokens, args.slots, args.prompts = 24, 12, 6, 4, 6
        args.prompt_len, args.new, args.hf_rows, args.hf_new, args.block = 16, 8, 2, 4, 4
    return args


@torch.no_grad()
def decode_speed(args: argparse.Namespace, target: Any, device: torch.device) -> list[dict]:
    text = target.config
    config = DrafterConfig.from_target_config(
        text, mask_token_id=text.vocab_size - 1, num_layers=args.layers, block_size=args.block
    )
    drafter = init_seeded(config, 0).to(device=device, dtype=target.dtype).eval()
    head = TargetHead.from_model(target)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, text.vocab_size, (args.prompt,), generator=gen).tolist()
    rows: list[dict] = []

    def record(loop: str, b: int, result: Any, **extra: Any) -> None:
        tokens = len(result.output_ids) - 1
        ms = 1e3 * result.decode_s
        rows.append({"loop": loop, "B": b, "ms/token": round(ms / tokens, 3),
                     "ms/step": round(ms / max(1, result.num_steps), 3), **extra})  # fmt: skip

    if not args.skip_hf:
        hf = Decoder(target)
        decode(hf, prompt, 2)  # warm-up
        record("HF eager, DynamicCache", 1, decode(hf, prompt, args.hf_tokens))
    length = cache_slots(len(prompt), args.tokens, args.block)
    lm = StaticLM(target, 1, length, config.target_layer_ids)
    lm.verify()
    graphs = device.type == "cuda"
    backend = "inductor" if graphs else None
    base, spec = (
        StaticDecoder(target, max_len=length, graphs=graphs, compile_backend=backend, lm=lm,
                      drafter=d, head=h, block_size=b)
        for d, h, b in ((None, None, 1), (drafter, head, args.block))
    )  # fmt: skip
    name = "static, compiled parts + CUDA graphs" if graphs else "static, eager"
    for loop in (base, spec):
        loop.decode(prompt, 2 * args.block)  # warm-up: compile, capture
    result = base.decode(prompt, args.tokens)
    record(name, 1, result)
    step_ms = rows[-1]["ms/step"]
    result = spec.decode(prompt, args.tokens)
    iters = 20 if graphs else 2
    parts = {k: replay_ms(fn, device, iters) for k, fn in spec.parts().items()}
    record(name, args.block, result, **{"verify ms": round(parts["verify"], 3),
           "draft ms": round(parts["draft"], 3)})  # fmt: skip
    rows[-1]["step / decode step"] = round(rows[-1]["ms/step"] / step_ms, 3)
    rows[-1]["linear states"] = spec.info.get("linear_states")
    return rows


@torch.no_grad()
def generate_speed(args: argparse.Namespace, target: Any, device: torch.device) -> list[dict]:
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
    rows: list[dict] = []
    if not args.skip_hf:
        ids = torch.tensor(prompts[: args.hf_rows], device=device)
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        target.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.hf_new,
                        min_new_tokens=args.hf_new, **kw)  # fmt: skip
        sync(device)
        seconds = time.perf_counter() - t0
        rows.append({"backend": "HF generate", "rows": args.hf_rows, "new": args.hf_new,
                     "tok/s": round(args.hf_rows * args.hf_new / seconds, 1)})  # fmt: skip
    sync_every = 8
    length = cache_length(args.prompt_len, args.new, sync_every)
    cuda = device.type == "cuda"
    decoder = SlotDecoder(
        target, args.slots, length, max_new_tokens=args.new, sync_every=sync_every,
        attention="varlen", compile_backend="inductor" if cuda else None,
    )  # fmt: skip
    decoder.generate(prompts[: args.slots], seeds=[0] * args.slots)  # warm-up: compile, capture
    decoder.times = PhaseTimes()
    sync(device)
    t0 = time.perf_counter()
    outputs = decoder.generate(prompts, seeds=list(range(len(prompts))))
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o) for o in outputs)
    times = decoder.times.as_dict()
    rows.append({"backend": "static slots", "rows": args.slots, "new": args.new,
                 "tok/s": round(tokens / seconds, 1), "prefill s": round(times["prefill_s"], 2),
                 "ms/step": round(1e3 * times["decode_s"] / max(1, decoder.times.steps), 2),
                 "cache GB": round(decoder.lm.cache_bytes / 1e9, 2)})  # fmt: skip
    return rows


def main() -> int:
    args = parse()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.memory_fraction and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    target = target_model(args, device)
    decode_rows = decode_speed(args, target, device)
    print_table(decode_rows, ["loop", "B", "ms/token", "ms/step", "verify ms", "draft ms",
                              "step / decode step"])  # fmt: skip
    generate_rows = generate_speed(args, target, device)
    if args.compare_step:
        static_hybrid.FUSED_STEP = False
        args.skip_hf = True
        torch_step = generate_speed(args, target, device)[-1]
        torch_step["backend"] += ", torch-op delta step"
        generate_rows.append(torch_step)
    print_table(
        generate_rows, ["backend", "rows", "new", "tok/s", "prefill s", "ms/step", "cache GB"]
    )
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
    print_json({
        "bench": "hybrid-decode",
        "target": "tiny hybrid" if args.smoke else "random, Qwen3.6-27B shape (48 linear + 16 full)",
        "dtype": str(target.dtype).removeprefix("torch."),
        "prompt_tokens": args.prompt, "block_size": args.block, "drafter_layers": args.layers,
        "decode": decode_rows, "generate": generate_rows, "peak_gb": peak, **environment(),
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
