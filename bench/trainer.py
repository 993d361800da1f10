"""The online step on one GPU: target forward alone, drafter step alone, and the full step.

A random-weight Qwen3-8B-shaped target (36 layers, width 4096, 32/8 heads, intermediate
12288, vocab 151936; no weights needed), a 5-layer drafter, B = 16, A = 512, packed rows of
8192 tokens (documents of 300..3000 tokens, 80% of each trained). Everything runs through
the real trainer (`flashdraft.train.Trainer`): the same row stream, target forward, drafter
step and optimizer as `flashdraft train`.

Reports tokens/s, system MFU ((target forward + drafter fwd/bwd FLOPs) / time / measured
peak) and the overhead ratio full / (target + drafter); then the full step at 16384-token
rows (must not OOM) and with the row prefetch thread off (the effect of overlap).

    python bench/trainer.py            # on a GPU
    python bench/trainer.py --smoke    # tiny, CPU, checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile

import numpy as np
import torch

from flashdraft.benchutil import environment, matmul_peak, print_json, print_table
from flashdraft.log import get_logger
from flashdraft.train.bench import COLUMNS, summarise, time_trainer
from flashdraft.train.config import load_run_config
from flashdraft.train.parallel import init_distributed
from flashdraft.train.plan import plan_run
from flashdraft.train.trainer import Trainer

log = get_logger("bench.trainer")


class SyntheticDataset:
    """The PreparedDataset interface over random documents (no files)."""

    def __init__(self, docs: int, lo: int, hi: int, vocab: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.num_tokens = rng.integers(lo, hi, docs)
        self._tokens = [rng.integers(0, vocab - 1, n).astype(np.int32) for n in self.num_tokens]

    def __len__(self) -> int:
        return len(self.num_tokens)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = self._tokens[index]
        mask = np.zeros(len(tokens), dtype=np.int8)
        mask[len(tokens) // 5 :] = 1
        return tokens, mask


def target_model(args: argparse.Namespace, device: torch.device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.target_layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        attn_implementation="flex_attention" if device.type == "cuda" else "sdpa",
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def make_trainer(args, device, model, row_tokens: int, overlap: bool) -> Trainer:
    overrides = [
        f"output={tempfile.mkdtemp(prefix='flashdraft-bench-')}",
        "target.path=unused",
        'data.datasets=["synthetic"]',
        f"data.row_tokens={row_tokens}",
        f"drafter.num_layers={args.layers}",
        f"drafter.mask_token_id={args.vocab - 1}",
        f"loss.anchors={args.anchors}",
        f"loss.chunk_rows={args.chunk_rows}",
        "log.tensorboard=false",
        "log.progress=false",
        f"parallel.overlap={str(overlap).lower()}",
        f"compile={str(not args.no_compile).lower()}",
    ]
    config = load_run_config(None, overrides)
    dataset = SyntheticDataset(args.docs, args.doc_min, args.doc_max, args.vocab)
    info = init_distributed("cuda" if device.type == "cuda" else "cpu")
    plan = plan_run(config, info, resume=False, target_config=model.config, dataset=dataset)
    return Trainer(plan, target_model=model)


def bench_row_length(args, device, model, row_tokens: int, first: bool) -> list[dict]:
    trainer = make_trainer(args, device, model, row_tokens, overlap=True)
    return time_trainer(
        trainer,
        parts=first,
        warmup=args.warmup,
        iters=args.iters,
        without_overlap=first and not args.skip_overlap_off,
    )


def add_geometry_arguments(p: argparse.ArgumentParser) -> None:
    """The Qwen3-8B-shaped target, the drafter and the synthetic documents (shared with
    bench/parallel.py)."""
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--target-layers", type=int, default=36)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--docs", type=int, default=2000)
    p.add_argument("--doc-min", type=int, default=300)
    p.add_argument("--doc-max", type=int, default=3000)


def smoke_geometry(args: argparse.Namespace) -> None:
    args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim = 64, 128, 4, 2, 16
    args.target_layers, args.vocab, args.layers, args.anchors = 6, 1000, 2, 16
    args.docs, args.doc_min, args.doc_max = 200, 20, 200


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_geometry_arguments(p)
    p.add_argument("--rows", default="8192,16384")
    p.add_argument("--chunk-rows", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--skip-overlap-off", action="store_true")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        smoke_geometry(args)
        args.rows, args.warmup, args.iters, args.chunk_rows, args.no_compile = (
            "256,512",
            1,
            3,
            64,
            True,
        )
    return args


def main() -> int:
    args = parse()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    peak = matmul_peak(device)
    model = target_model(args, device)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for i, row in enumerate(rows):
        results += bench_row_length(args, device, model, row, first=i == 0)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = summarise(
        [r for r in results if r["row"] == rows[0] and "no overlap" not in r["what"]], peak
    )
    summarise(results, peak)
    by = {(r["what"], r["row"]): r for r in results}
    if ("full online step (no overlap)", rows[0]) in by:
        summary["overlap_speedup"] = round(
            by[("full online step (no overlap)", rows[0])]["s"]
            / by[("full online step", rows[0])]["s"],
            3,
        )
    log.info(f"measured matmul peak: {peak / 1e12:.0f} TFLOP/s on {device}")
    print_table(results, COLUMNS)
    log.info("  ".join(f"{k}={v}" for k, v in summary.items()))
    for r in results:
        r.pop("s")
    print_json(
        {
            "bench": "trainer",
            "peak_tflops": round(peak / 1e12, 1),
            **summary,
            "results": results,
            **environment(),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
