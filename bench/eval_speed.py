"""`python bench/eval.py --speed`: how fast the decode loops run, not what a drafter accepts.

On a random target with SmolLM2-135M's exact shape (speed does not depend on the weights;
`--target` takes a real one) and a random drafter of `--layers` layers (3) with B = 16: the
target's decode time per token at batch 1 in the HF loop and in the static loops, then the
speculative step of each static loop against its parts replayed alone (the loop overhead ratio).
bench/eval.py's docstring describes the options; this is its `--speed` mode.
"""

from __future__ import annotations

from typing import Any

import torch
from generate import synthetic_target  # beside this script

from flashdraft.benchutil import environment, measure, print_json, print_table
from flashdraft.eval.fast import StaticDecoder, cache_slots
from flashdraft.eval.speculative import Decoder, decode
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import init_seeded
from flashdraft.model.graphs import capture
from flashdraft.model.head import TargetHead
from flashdraft.model.static import StaticLM
from flashdraft.model.target import load_target


def speed_target(args, device):
    """A random target with SmolLM2-135M's shape (or the --target model), bf16 on CUDA."""
    if args.target:
        return load_target(
            args.target, "bfloat16" if device.type == "cuda" else "float32", "sdpa", device
        )
    return synthetic_target(args.smoke, str(device), args.seed)


def replay_ms(fn, device, iters: int) -> float:
    """Median ms of `fn`, replayed as a CUDA graph on CUDA (as the loop runs it)."""
    run = capture(fn).replay if device.type == "cuda" else fn
    return measure(run, device, 2, iters).median_s * 1e3


def static_variants(device, no_compile: bool) -> list[tuple[str, bool, str | None, bool]]:
    """(name, graphs, compile backend, compile the drafter too) of the static loops to time
    on this device."""
    variants = [("static, eager kernels", False, None, False)]
    if device.type == "cuda":
        variants.append(("static, CUDA graphs", True, None, False))
        if not no_compile:
            variants += [
                ("static, compiled verify + CUDA graphs", True, "inductor", False),
                ("static, compiled verify and drafter + CUDA graphs", True, "inductor", True),
            ]
    return variants


@torch.no_grad()
def speed(args, device) -> int:
    target = speed_target(args, device)
    text = target.config
    config = DrafterConfig.from_target_config(
        text, mask_token_id=text.vocab_size - 1, num_layers=args.layers, block_size=args.block
    )
    drafter = init_seeded(config, args.seed).to(device=device, dtype=target.dtype).eval()
    head = TargetHead.from_model(target)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, text.vocab_size, (args.speed_prompt,), generator=gen).tolist()
    new, block = args.speed_tokens, config.block_size
    iters = 50 if device.type == "cuda" else 3
    rows: list[dict[str, Any]] = []

    def record(loop: str, b: int, result, extra: dict[str, Any] | None = None) -> None:
        tokens = len(result.output_ids) - 1
        rows.append({"loop": loop, "B": b, "ms/token": round(1e3 * result.decode_s / tokens, 3),
                     "ms/step": round(1e3 * result.decode_s / max(1, result.num_steps), 3),
                     "tau": round(result.tau or 0.0, 3), **(extra or {})})  # fmt: skip

    hf = Decoder(target)
    decode(hf, prompt, 8)  # warm-up
    record("HF eager, DynamicCache", 1, decode(hf, prompt, new))
    length = cache_slots(len(prompt), new, block)
    lm = StaticLM(target, 1, length, config.target_layer_ids)
    lm.verify()
    fastest = None
    for name, graphs, backend, whole in static_variants(device, args.no_compile):
        base, spec = (
            StaticDecoder(target, max_len=length, graphs=graphs, compile_backend=backend, lm=lm,
                          compile_drafter=whole, drafter=d, head=h, block_size=b)
            for d, h, b in ((None, None, 1), (drafter, head, block))
        )  # fmt: skip
        for loop in (base, spec):
            loop.decode(prompt, 2 * block)  # warm-up: compile, capture
        record(name, 1, base.decode(prompt, new))
        result = spec.decode(prompt, new)
        parts = {k: replay_ms(fn, device, iters) for k, fn in spec.parts().items()}
        step = 1e3 * result.decode_s / max(1, result.num_steps)
        ratio = step / (parts["verify"] + parts["draft"])
        record(name, block, result, {"verify ms": round(parts["verify"], 3),
               "draft ms": round(parts["draft"], 3), "overhead": round(ratio, 3)})  # fmt: skip
        fastest = rows[-1]
    baseline = {r["loop"]: r["ms/token"] for r in rows if r["B"] == 1}
    print_table(
        rows, ["loop", "B", "ms/token", "ms/step", "tau", "verify ms", "draft ms", "overhead"]
    )
    assert fastest is not None
    print_json(
        {
            "bench": "eval-speed",
            "target": args.target
            or ("tiny random" if args.smoke else "random, SmolLM2-135M shape"),
            "dtype": str(target.dtype).removeprefix("torch."),
            "prompt_tokens": len(prompt),
            "new_tokens": new,
            "block_size": block,
            "drafter_layers": config.num_hidden_layers,
            "baseline_ms_per_token": baseline,
            "speculative_loop": fastest["loop"],
            "overhead_ratio": fastest["overhead"],
            "rows": rows,
            **environment(),
        }
    )
    return 0
