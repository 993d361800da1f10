"""One DFlash drafter training step (fwd + bwd [+ AdamW]) at Qwen3-8B width.

Default geometry: 5 layers, hidden 4096, 32 heads / 8 KV heads, head_dim 128,
intermediate 12288, vocab 151936, K = 5 taps, B = 16, A = 512 anchors over an 8192-token
row of random target features. Also times a plain 5-layer HF Qwen3 stack fwd+bwd over 8192
tokens (the reference the drafter is compared with, per query token), and the drafter step
at a doubled context (16384) to show memory is bounded by the anchor budget.

    python bench/drafter.py            # on a GPU
    python bench/drafter.py --smoke    # tiny sizes, CPU, checks the script runs

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys

import torch

from flashdraft.benchutil import environment, matmul_peak, measure, print_json, print_table
from flashdraft.log import get_logger
from flashdraft.model.attention import default_backend
from flashdraft.model.config import DrafterConfig, default_target_layer_ids
from flashdraft.model.drafter import DFlashDrafter, param_count
from flashdraft.model.head import TargetHead
from flashdraft.model.target import DTYPES
from flashdraft.train.blocks import sample_anchors, slot_weights
from flashdraft.train.parallel import compile_drafter
from flashdraft.train.step import DraftBatch, batch_normaliser, draft_loss

log = get_logger("bench.drafter")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--taps", type=int, default=5)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--contexts", default="8192,16384")
    p.add_argument("--docs", type=int, default=4, help="documents packed in the row")
    p.add_argument("--chunk-rows", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--residual-dtype",
        choices=["auto", "float32"],
        default="auto",
        help="drafter.residual_dtype: float32 sums the residual stream in fp32 under autocast",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the HF stack reference")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.heads, args.kv_heads, args.head_dim = 64, 4, 2, 16
        args.intermediate, args.vocab, args.layers, args.anchors = 128, 1000, 2, 16
        args.contexts, args.warmup, args.iters, args.chunk_rows = "256,512", 1, 2, 64
        args.no_compile = True
    return args


def make_config(args: argparse.Namespace) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab,
        block_size=args.block,
        num_target_layers=36,
        target_layer_ids=default_target_layer_ids(36, args.taps),  # Qwen3-8B depth
        mask_token_id=args.vocab - 1,
    )


def make_batch(
    config: DrafterConfig, context: int, anchors: int, docs: int, device: torch.device
) -> DraftBatch:
    gen = torch.Generator().manual_seed(context)
    bounds = torch.linspace(0, context, docs + 1).long()
    doc_ids = torch.zeros(context, dtype=torch.long)
    positions = torch.zeros(context, dtype=torch.long)
    for d in range(docs):
        lo, hi = int(bounds[d]), int(bounds[d + 1])
        doc_ids[lo:hi] = d
        positions[lo:hi] = torch.arange(hi - lo)
    loss_mask = (torch.rand(context, generator=gen) < 0.8).to(torch.int8)
    picked, valid = sample_anchors(loss_mask, doc_ids, anchors, gen)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = torch.randn(1, context, config.num_taps * config.hidden_size, generator=gen)
    return DraftBatch(
        input_ids=torch.randint(0, config.vocab_size, (1, context), generator=gen),
        position_ids=positions[None],
        doc_ids=doc_ids[None],
        loss_mask=loss_mask[None],
        anchors=picked[None],
        anchor_valid=valid[None],
        target_hidden=hidden.to(dtype),
        next_tokens=torch.randint(
            0, config.vocab_size, (1, anchors, config.block_size - 1), generator=gen
        ),
    ).to(device)


def drafter_row(args, config, device, context: int) -> dict:
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).to(device)
    if not args.no_compile:
        compile_drafter(drafter)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embedding = torch.nn.Embedding(config.vocab_size, config.hidden_size).to(device, dtype)
    head = TargetHead(embedding=embedding, weight=torch.randn_like(embedding.weight) * 0.02)
    batch = make_batch(config, context, args.anchors, args.docs, device)
    input_gb = batch.target_hidden.numel() * batch.target_hidden.element_size() / 2**30
    slot_w = slot_weights(config.block_size, 7.0).to(device)
    norm = batch_normaliser(batch, config.block_size, slot_w)
    backend = default_backend(device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-5, fused=device.type == "cuda")

    def fwd_bwd() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = draft_loss(
                drafter,
                head,
                batch,
                slot_w,
                norm,
                backend,
                args.chunk_rows,
                residual_dtype=DTYPES.get(args.residual_dtype),  # "auto": None
            )
        loss.backward()

    def full_step() -> None:
        fwd_bwd()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timing = measure(fwd_bwd, device, args.warmup, args.iters)
    drafter.zero_grad(set_to_none=True)
    step = measure(full_step, device, 2, max(3, args.iters // 2))
    queries = args.anchors * config.block_size
    # FLOPs: drafter layers fwd x3 (fwd + bwd); LM head fwd + grad w.r.t. h only (x2), on the
    # (B-1)/B trained slots.
    layer_flops = 3 * drafter.num_flops_per_query_token(context, queries) * queries
    head_flops = (
        2 * 2 * config.hidden_size * config.vocab_size * args.anchors * (config.block_size - 1)
    )
    flops = layer_flops + head_flops
    return {
        "what": "drafter fwd+bwd",
        "context": context,
        "anchors": args.anchors,
        "query_tokens": queries,
        "ms": round(timing.median_s * 1e3, 2),
        "step_ms_with_adamw": round(step.median_s * 1e3, 2),
        "query_tok_per_s": round(queries / timing.median_s),
        "tflops": round(flops / timing.median_s / 1e12, 1),
        "peak_gb": round(timing.peak_mem_gb, 2),
        "peak_minus_inputs_gb": round(timing.peak_mem_gb - input_gb, 2),
        "params_m": round(param_count(drafter) / 1e6, 1),
        "residual_dtype": args.residual_dtype,
    }


def reference_row(args, device, tokens: int) -> dict:
    """A plain HF Qwen3 decoder stack of the same width and depth, fwd + bwd, causal SDPA."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = Qwen3Config(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab_size=128,
        max_position_embeddings=max(tokens, 40960),
        attn_implementation="sdpa",
    )
    model = Qwen3Model(cfg).to(device, dtype)
    x = torch.randn(1, tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)

    def fwd_bwd() -> None:
        out = model(inputs_embeds=x, use_cache=False).last_hidden_state
        out.float().square().mean().backward()

    timing = measure(fwd_bwd, device, args.warmup, args.iters)
    per_layer = (
        2
        * (
            args.hidden * args.heads * args.head_dim * 2
            + 2 * args.hidden * args.kv_heads * args.head_dim
            + 3 * args.hidden * args.intermediate
        )
        + 2 * args.heads * args.head_dim * tokens
    )  # causal attention: half of 4*d*T
    flops = 3 * args.layers * per_layer * tokens
    return {
        "what": "HF Qwen3 stack fwd+bwd",
        "context": tokens,
        "query_tokens": tokens,
        "ms": round(timing.median_s * 1e3, 2),
        "query_tok_per_s": round(tokens / timing.median_s),
        "tflops": round(flops / timing.median_s / 1e12, 1),
        "peak_gb": round(timing.peak_mem_gb, 2),
    }


def main() -> int:
    args = parse()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = make_config(args)
    peak = matmul_peak(device)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for context in contexts:
        rows.append(drafter_row(args, config, device, context))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.no_reference:
        rows.append(reference_row(args, device, contexts[0]))
    for row in rows:
        row["mfu"] = round(row["tflops"] * 1e12 / peak, 3)
    log.info(f"measured matmul peak: {peak / 1e12:.0f} TFLOP/s on {device}")
    print_table(
        rows,
        [
            "what",
            "context",
            "query_tokens",
            "ms",
            "step_ms_with_adamw",
            "query_tok_per_s",
            "tflops",
            "mfu",
            "peak_gb",
            "peak_minus_inputs_gb",
        ],
    )
    result = {
        "bench": "drafter",
        "peak_tflops": round(peak / 1e12, 1),
        "rows": rows,
        **environment(),
    }
    if not args.no_reference:
        ref = rows[-1]["query_tok_per_s"]
        result["per_query_token_ratio_vs_hf_stack"] = round(ref / rows[0]["query_tok_per_s"], 3)
        log.info(
            f"drafter time per query token / HF stack time per token: "
            f"{result['per_query_token_ratio_vs_hf_stack']}"
        )
    if len(contexts) > 1:
        grow = rows[1]["peak_minus_inputs_gb"] - rows[0]["peak_minus_inputs_gb"]
        result["peak_growth_gb_when_context_doubles"] = round(grow, 3)
        log.info(
            f"peak memory growth (excluding input features) {contexts[0]} -> {contexts[1]}: {grow:.2f} GB"
        )
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
