"""Generated tokens/s of `flashdraft generate` (on-policy data) on real chat prompts.

    python bench/generate.py                  # CUDA: SmolLM2-135M bf16, 512 chitchat prompts
    python bench/generate.py --smoke          # CPU: 8 short prompts, 16 new tokens
    python bench/generate.py --synthetic      # CUDA: HF vs static backend, batch 256
    python bench/generate.py --synthetic --smoke   # CPU, tiny random target: runs in seconds

Prompts are chitchat conversations whose last assistant turn is regenerated (the real
`generate` path: records -> chat template -> sorted, left-padded batches -> append-only
output). Prints a table, then one JSON line. The clock covers the generation loop only
(model loading and a short warm-up are excluded), as `generate`'s own summary does.

`--synthetic` times the backends themselves on token ids (no tokenizer, no files): a random
target with SmolLM2-135M's shape (speed does not depend on the weights; `--target` takes a
real one), `--prompts` prompts of 32..512 random tokens (seeded), `--max-new-tokens` each
with no stop token (so every request runs to the limit), `--batch-size` rows or slots; for each
of `--backends` (default hf,static) the generated tokens/s, end to end (prefill included).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from flashdraft.assets import chitchat_conversations, smollm2_path
from flashdraft.data.generate import GenerateConfig, load_chat_tokenizer, run_generation
from flashdraft.data.inference import (
    Sampling,
    default_device,
    load_backend,
    resolve_dtype,
    stop_token_ids,
)
from flashdraft.model.target import load_target


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU-sized run")
    parser.add_argument("--target", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=None, help="default 512 (smoke: 8)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 256 (smoke 16)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 128 (smoke: 4)")
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument(
        "--short-prompts",
        action="store_true",
        help="first user turn only, instead of the whole conversation (the smoke default)",
    )
    parser.add_argument("--backend", choices=("hf", "static"), default="hf")
    parser.add_argument("--synthetic", action="store_true", help="backends on random prompts")
    parser.add_argument("--backends", default="hf,static", help="--synthetic: backends to time")
    parser.add_argument(
        "--prompt-lengths", default=None, help="--synthetic: MIN,MAX prompt tokens (32,512)"
    )
    parser.add_argument(
        "--buckets",
        choices=("pow2", "ladder", "fine"),
        default="fine",
        help="--synthetic: the static step's attention lengths: 128 x 2^i (pow2), two per "
        "octave (ladder: + 384, 768, ...), four (fine: multiples of 128 up to 512, ...)",
    )
    parser.add_argument(
        "--no-fuse",
        action="store_true",
        help="--synthetic: the static steps' q/k/v and gate/up projections as separate GEMMs",
    )
    parser.add_argument(
        "--attention",
        choices=("sdpa", "flex", "varlen"),
        default="varlen",
        help="--synthetic: the static step's attention (flex: each slot reads its own blocks; "
        "varlen: the flash kernel over each slot's own positions, one graph for all lengths)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="--synthetic: compile the static decode steps' dense layer parts (inductor)",
    )
    parser.add_argument(
        "--compile-prefill",
        action="store_true",
        help="--synthetic, with --compile: the prefill batches' dense parts too",
    )
    parser.add_argument(
        "--min-admit",
        type=int,
        default=1,
        help="--synthetic, static: new prompts wait until this many slots are free",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="--synthetic, CUDA: the top kernels by GPU time of the timed run",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def chat_records(count: int, short: bool) -> list[dict[str, Any]]:
    records = chitchat_conversations(limit=count, seed=0)
    if short:
        records = [{**r, "messages": r["messages"][:1]} for r in records]
    return records


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def peak_memory_gib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    # ru_maxrss is KiB on Linux: the whole process (model, tokenizer, Python).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def synthetic_target(smoke: bool, device: str, seed: int = 0) -> Any:
    """A random Llama with SmolLM2-135M's shape (tiny with --smoke), bf16 on CUDA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256 if smoke else 49152,
        hidden_size=64 if smoke else 576,
        intermediate_size=128 if smoke else 1536,
        num_hidden_layers=6 if smoke else 30,  # 6: enough for a 3-layer drafter's default taps
        num_attention_heads=4 if smoke else 9,
        num_key_value_heads=2 if smoke else 3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16 if device.startswith("cuda") else torch.float32)
    return model.eval().requires_grad_(False)


def _profiler(enabled: bool) -> Any:
    """torch.profiler over CPU and CUDA when enabled, else a no-op context."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def synthetic(args: argparse.Namespace, device: str) -> int:
    """Generated tokens/s of each backend on the same random prompts."""
    from flashdraft.data.inference import HFBackend, StaticBackend

    smoke = args.smoke
    count = args.prompts or (6 if smoke else 512)
    new = args.max_new_tokens or (8 if smoke else 128)
    batch = args.batch_size or (4 if smoke else 256)
    if args.target:
        model = load_target(args.target, resolve_dtype(args.dtype, device), "sdpa", device)
    else:
        model = synthetic_target(smoke, device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    low, high = (4, 12) if smoke else (32, 512)
    if args.prompt_lengths:
        low, high = (int(x) for x in args.prompt_lengths.split(","))
    lengths = torch.randint(low, high + 1, (count,), generator=gen)
    from flashdraft.data.fast_inference import PhaseTimes, SlotDecoder

    SlotDecoder.ladder_steps = {"pow2": 1, "ladder": 2, "fine": 4}[args.buckets]
    SlotDecoder.fuse = not args.no_fuse
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    sampling = Sampling(max_new_tokens=new)
    never = [vocab + 1]  # a stop id no token can be: every request runs to max_new_tokens
    rows = []
    for name in args.backends.split(","):
        if name == "hf":
            backend: Any = HFBackend(model, sampling, never, pad_id=0)
            batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        elif name == "static":
            backend = StaticBackend(
                model,
                sampling,
                never,
                slots=batch,
                attention=args.attention,
                compile_backend="inductor" if args.compile else None,
                compile_prefill=args.compile_prefill,
                min_admit=args.min_admit,
            )
            batches = [prompts]
        else:
            raise ValueError(f"--backends: {name!r} (hf, static)")
        # Warm-up (kernels, graphs, allocations), in two calls of other prompt widths: with
        # --compile-prefill the second prefill width is the one that compiles the symbolic
        # graph: outside the timed run, so no compilation is counted as generation.
        for chunk in batches[:1]:
            warm = max(2, batch // 8)
            for part in (chunk[:warm], sorted(chunk, key=len)[:warm]):
                backend.generate(part, args.seed, lambda n: None)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if name == "static" and backend.decoder is not None:
            backend.decoder.times = PhaseTimes()  # the timed run's own split
        profiler = _profiler(args.profile and device.startswith("cuda"))
        start = time.perf_counter()
        with profiler:
            tokens = sum(
                g.num_generated
                for chunk in batches
                for g in backend.generate(chunk, args.seed, lambda n: None)
            )
        seconds = time.perf_counter() - start
        if args.profile and device.startswith("cuda"):
            print(f"== {name}: top kernels by GPU time")
            table = profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=18)
            print(table)
        if name == "static" and backend.decoder is not None:
            print(f"== static phases: {json.dumps(backend.decoder.times.as_dict())}")
        rows.append(
            {
                "backend": name,
                "prompts": count,
                "batch/slots": batch,
                "buckets": args.buckets if name == "static" else "-",
                "fused": not args.no_fuse if name == "static" else "-",
                "attention": args.attention if name == "static" else "-",
                "compiled": args.compile if name == "static" else "-",
                "prefill compiled": args.compile and args.compile_prefill
                if name == "static"
                else "-",
                "new tokens": new,
                "generated": tokens,
                "s": round(seconds, 2),
                "tok/s": round(tokens / seconds, 1),
                "peak GiB": round(peak_memory_gib(device), 2),
            }
        )
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in columns))
    result = {
        "bench": "generate-synthetic",
        "target": args.target or ("tiny random" if smoke else "random, SmolLM2-135M shape"),
        "device": device,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "prompt_tokens_mean": round(float(lengths.float().mean()), 1),
        "rows": rows,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "commit": _commit(),
    }
    print(json.dumps(result))
    return 0


def main() -> int:
    args = parse_args()
    device = default_device(args.device)
    if args.synthetic:
        if args.smoke:
            device = "cpu"
            torch.set_num_threads(1)
        return synthetic(args, device)
    smoke = args.smoke
    count = args.prompts or (8 if smoke else 512)
    max_new_tokens = args.max_new_tokens or (16 if smoke else 256)
    batch_size = args.batch_size or (4 if smoke else 128)
    target = args.target or str(smollm2_path())
    dtype = resolve_dtype(args.dtype, device)

    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    records = chat_records(count, short=smoke or args.short_prompts)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))

    sampling = Sampling(max_new_tokens=max_new_tokens)
    tokenizer = load_chat_tokenizer(target, thinking=False)
    stop_ids = stop_token_ids(target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    backend = load_backend(
        args.backend,
        target,
        sampling,
        stop_ids,
        pad,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        max_batch_tokens=args.max_batch_tokens,
    )

    def config(output: Path, limit: int | None) -> GenerateConfig:
        return GenerateConfig(
            target=target,
            prompts=[str(prompts)],
            output=str(output),
            sampling=sampling,
            backend=args.backend,
            batch_size=batch_size,
            max_batch_tokens=args.max_batch_tokens,
            limit=limit,
            seed=args.seed,
            device=device,
            dtype=dtype,
            progress=False,
        )

    # Warm-up (CUDA context, kernel selection) on two prompts, into a throw-away output.
    run_generation(config(work / "warmup.jsonl", 2), backend, tokenizer)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    summary = run_generation(config(work / "out.jsonl", None), backend, tokenizer)

    model = getattr(backend, "model", None)
    # Decode FLOPs per generated token ≈ 2 × parameters (one multiply-add per weight; the
    # embedding lookup and attention over the context are left out), a lower bound.
    params = sum(p.numel() for p in model.parameters()) if model is not None else 0
    tflops = 2 * params * summary.tokens_per_s / 1e12
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
    else:
        name = f"{platform.machine()}, {torch.get_num_threads()} threads"
    done = summary.written + sum(summary.rejected.values())
    result = {
        "bench": "generate",
        "target": Path(target).name,
        "backend": backend.name,
        "device": f"{device} ({name})",
        "dtype": dtype,
        "prompts": count,
        "prompt_tokens_mean": round(summary.prompt_tokens / max(1, done), 1),
        "batch_size": batch_size,
        "max_batch_tokens": args.max_batch_tokens,
        "max_new_tokens": max_new_tokens,
        "written": summary.written,
        "rejected": dict(summary.rejected),
        "generated_tokens": summary.generated_tokens,
        "seconds": round(summary.seconds, 2),
        "tokens_per_s": round(summary.tokens_per_s, 1),
        "model_tflops": round(tflops, 3),
        "peak_memory_gib": round(peak_memory_gib(device), 2),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "commit": _commit(),
    }
    rows = [
        ("target", f"{result['target']} ({dtype}, {backend.name})"),
        ("device", result["device"]),
        ("prompts (generated; mean tokens)", f"{count} ({done}; {result['prompt_tokens_mean']})"),
        ("batch size / token budget", f"{batch_size} / {args.max_batch_tokens or '-'}"),
        ("max new tokens", max_new_tokens),
        ("written / rejected", f"{summary.written} / {dict(summary.rejected) or 0}"),
        ("generated tokens", summary.generated_tokens),
        ("wall time (s)", f"{summary.seconds:.2f}"),
        ("generated tokens/s", f"{summary.tokens_per_s:,.1f}"),
        ("model TFLOP/s (2·params/token)", f"{tflops:.3f}"),
        ("peak memory (GiB)", f"{result['peak_memory_gib']:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
