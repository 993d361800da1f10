"""Speculative decoding on SmolLM2-135M-Instruct with a flashdraft drafter: tau and speedup.

    python bench/eval.py --drafter RUN_OR_EXPORT      # GPU: a drafter trained by flashdraft
    python bench/eval.py --fit-steps 2000             # GPU, no drafter yet: fit one here first
    python bench/eval.py --smoke                      # CPU, tiny sizes: checks the script runs
    python bench/eval.py --speed                      # GPU: the decode loops' speed
    python bench/eval.py --speed --smoke              # CPU, tiny random target: runs in seconds

Evaluates on held-out prompts of two kinds (HumanEval code prompts, multi-turn chitchat
conversations) with `flashdraft.eval.evaluate.evaluate_drafter`: the real draft-and-verify loop
against the live target, and the same loop with B = 1 (the target alone) on the same prompts
for the lossless check (T = 0) and the speedup (decode time per output token, prefill
excluded; CUDA only). Also times one loop step's parts in isolation (target forward over 1
and over B tokens, drafter block + draft logits, drafter context update), so the measured
speedup can be read against tau.

`--fit-steps N` (when no `--drafter` is given) trains a drafter first with flashdraft's own
training step (`flashdraft.train.step.draft_loss`) on SmolLM2's greedy answers to chitchat prompts
that the evaluation does not use: a stand-in for `flashdraft train`, not a tuned recipe.

The prompts and the target come from the offline asset packages by default. On a machine
without them: `--write-prompts DIR` (here) writes humaneval.jsonl, chitchat.jsonl and fit.jsonl,
`--prompts-dir DIR` (there) reads them, and `--target PATH` names a SmolLM2 HF directory.

`--speed` measures how fast the loops run rather than what a drafter accepts, on a random
target with SmolLM2-135M's exact shape (speed does not depend on the weights; `--target`
takes a real one) and a random 3-layer drafter with B = 16, on one prompt of
`--speed-prompt` tokens, `--speed-tokens` new tokens, no eos: the target's decode time per
token at batch 1 in the HF loop (eager, DynamicCache) and in the static loop (static KV cache;
eager kernels, CUDA graphs, graphs of compiled kernels); then the speculative step of the
fastest static loop against its parts: time per step (host sync included) / (the target's
verify of B tokens + the drafter's block, each replayed alone), the loop overhead ratio (its
code: eval_speed.py beside this script).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from flashdraft.assets import chitchat_conversations, humaneval_prompts, smollm2_path
from flashdraft.benchutil import environment, measure, print_json, print_table
from flashdraft.eval.evaluate import evaluate_drafter
from flashdraft.eval.prompts import prompt_ids
from flashdraft.eval.report import plot_acceptance
from flashdraft.eval.speculative import cache_argument, eos_token_ids
from flashdraft.export import save_export
from flashdraft.log import get_logger
from flashdraft.model.attention import default_backend
from flashdraft.model.config import DrafterConfig, choose_mask_token_id
from flashdraft.model.drafter import DFlashDrafter, DraftCache, init_seeded, param_count
from flashdraft.model.head import TargetHead
from flashdraft.model.hybrid import is_hybrid
from flashdraft.model.target import LayerTaps, Target, decoder_layers, load_target
from flashdraft.storage import join, makedirs, write_bytes_atomic, write_json_atomic
from flashdraft.train.blocks import label_positions, sample_anchors, slot_weights
from flashdraft.train.checkpoint import load_drafter
from flashdraft.train.step import DraftBatch, batch_normaliser, draft_loss

log = get_logger("bench.eval")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--drafter", default=None, help="run dir, checkpoint or export of a drafter")
    p.add_argument("--target", default=None, help="SmolLM2 HF directory (default: the asset)")
    p.add_argument("--prompts-dir", default=None, help="read {humaneval,chitchat,fit}.jsonl here")
    p.add_argument("--write-prompts", default=None, help="write those files here, then exit")
    p.add_argument("--num-prompts", type=int, default=16, help="per prompt kind")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--report-dir", default=None, help="write the eval reports + plots here")
    # Fitting a drafter when none is given.
    p.add_argument("--fit-steps", type=int, default=0)
    p.add_argument("--layers", type=int, default=3, help="draft layers (fitted; --speed's random)")
    p.add_argument("--block", type=int, default=16, help="block size of a fitted drafter")
    p.add_argument("--fit-prompts", type=int, default=2048)
    p.add_argument("--fit-answer-tokens", type=int, default=256)
    p.add_argument("--row-tokens", type=int, default=4096)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--gen-batch", type=int, default=128)
    p.add_argument("--save-drafter", default=None, help="export the fitted drafter here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    p.add_argument("--speed", action="store_true", help="the decode loops' speed (see above)")
    p.add_argument("--speed-prompt", type=int, default=512, help="prompt tokens (--speed)")
    p.add_argument("--speed-tokens", type=int, default=256, help="new tokens (--speed)")
    p.add_argument("--no-compile", action="store_true", help="--speed: skip the compiled loop")
    args = p.parse_args()
    if args.speed:
        if args.smoke:
            args.speed_prompt, args.speed_tokens, args.block = 12, 12, 4
        return args
    if args.smoke:
        args.num_prompts, args.max_new_tokens, args.dtype = 1, 16, "float32"
        args.fit_steps = args.fit_steps or 3
        args.layers, args.block, args.fit_prompts, args.fit_answer_tokens = 1, 8, 2, 16
        args.row_tokens, args.anchors, args.lr, args.gen_batch = 256, 8, 2e-3, 2
    if args.drafter is None and args.fit_steps <= 0 and not args.write_prompts:
        p.error("give --drafter, or --fit-steps N to fit one first")
    return args


# ---- prompts ----


KINDS = ("humaneval", "chitchat")


def asset_prompts(n: int, fit_prompts: int) -> dict[str, list[dict[str, Any]]]:
    """Evaluation prompts by kind, and "fit": first user turns of other chats (disjoint)."""
    chats = chitchat_conversations(seed=0)
    if n + fit_prompts > len(chats):
        raise ValueError(f"only {len(chats)} chitchat conversations for {n} + {fit_prompts}")
    fit = [{"id": c["id"], "messages": c["messages"][:1]} for c in chats[:fit_prompts]]
    return {"humaneval": humaneval_prompts(n), "chitchat": chats[len(chats) - n :], "fit": fit}


def read_prompts(directory: str, n: int, fit_prompts: int) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for kind in (*KINDS, "fit"):
        with open(os.path.join(directory, f"{kind}.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        out[kind] = records[: fit_prompts if kind == "fit" else n]
    return out


def write_prompts(directory: str, prompts: dict[str, list[dict[str, Any]]]) -> None:
    os.makedirs(directory, exist_ok=True)
    for kind, records in prompts.items():
        with open(os.path.join(directory, f"{kind}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


# ---- fitting a stand-in drafter ----


@torch.inference_mode()
def generate_answers(target, tokenizer, records, args, device) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy answer ids) for each fit record."""
    prompts = [prompt_ids(r, tokenizer) for r in records]
    eos = sorted(eos_token_ids(target, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    pairs = []
    for start in range(0, len(prompts), args.gen_batch):
        chunk = prompts[start : start + args.gen_batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        out = target.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=args.fit_answer_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for prompt, row in zip(chunk, out[:, width:].tolist(), strict=True):
            end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            pairs.append((prompt, row[:end]))
    return pairs


def pack_rows(pairs, row_tokens: int) -> list[dict[str, torch.Tensor]]:
    """Whole conversations packed into rows of exactly `row_tokens` (padding doc -1)."""
    rows, current = [], []
    for prompt, answer in pairs:
        seq = (prompt + answer)[:row_tokens]
        if sum(len(s) for s, _ in current) + len(seq) > row_tokens:
            rows.append(current)
            current = []
        current.append((seq, len(prompt)))
    if current:
        rows.append(current)
    packed = []
    for docs in rows:
        ids, pos, doc, mask = [], [], [], []
        for d, (seq, prompt_len) in enumerate(docs):
            ids += seq
            pos += list(range(len(seq)))
            doc += [d] * len(seq)
            mask += [0] * prompt_len + [1] * (len(seq) - prompt_len)
        pad = row_tokens - len(ids)
        ids, pos, doc, mask = ids + [0] * pad, pos + [0] * pad, doc + [-1] * pad, mask + [0] * pad
        packed.append(
            {
                "input_ids": torch.tensor([ids]),
                "position_ids": torch.tensor([pos]),
                "doc_ids": torch.tensor([doc]),
                "loss_mask": torch.tensor([mask], dtype=torch.int8),
            }
        )
    return packed


def fit_drafter(target, tokenizer, records, args, device) -> tuple[DFlashDrafter, dict[str, Any]]:
    t0 = time.perf_counter()
    pairs = generate_answers(target, tokenizer, records, args, device)
    gen_s = time.perf_counter() - t0
    rows = pack_rows(pairs, args.row_tokens)
    mask_id, _ = choose_mask_token_id(target.config, tokenizer)
    config = DrafterConfig.from_target_config(
        target.config, mask_token_id=mask_id, num_layers=args.layers, block_size=args.block
    )
    drafter = init_seeded(config, args.seed).to(device)  # fp32 master weights
    backend = default_backend(device)
    # The target takes a dense document mask (it runs with SDPA); the drafter uses flex on CUDA.
    wrapped = Target(target, config.target_layer_ids, "sdpa")
    wrapped.verify_taps()
    slot_w = slot_weights(config.block_size, 7.0).to(device)
    opt = torch.optim.AdamW(
        drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda"
    )
    warmup = max(1, args.fit_steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.fit_steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed)
    autocast = device.type == "cuda"
    t1 = time.perf_counter()
    for step in range(args.fit_steps):
        row = rows[step % len(rows)]
        anchors, valid = sample_anchors(row["loss_mask"][0], row["doc_ids"][0], args.anchors, gen)
        row_dev = {k: v.to(device) for k, v in row.items()}
        anchors, valid = anchors[None].to(device), valid[None].to(device)
        out = wrapped.packed_outputs(
            row_dev["input_ids"],
            row_dev["position_ids"],
            row_dev["doc_ids"],
            label_positions(anchors, config.block_size, args.row_tokens),
        )
        features, labels = out.features, out.next_tokens
        assert labels is not None
        batch = DraftBatch(
            input_ids=row_dev["input_ids"],
            position_ids=row_dev["position_ids"],
            doc_ids=row_dev["doc_ids"],
            loss_mask=row_dev["loss_mask"],
            anchors=anchors,
            anchor_valid=valid,
            target_hidden=features,
            next_tokens=labels,
        )
        norm = batch_normaliser(batch, config.block_size, slot_w)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, stats = draft_loss(drafter, wrapped.head, batch, slot_w, norm, backend, 2048)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.fit_steps - 1:
            summary = stats.summary()  # host sync, only when logging
            log.info(
                f"fit step {step}: loss {summary['loss']:.3f} tau_hat {summary['tau_hat']:.2f}"
            )
    wrapped.taps.remove()
    info = {
        "fit_steps": args.fit_steps,
        "fit_conversations": len(pairs),
        "fit_rows": len(rows),
        "fit_answer_tokens": sum(len(a) for _, a in pairs),
        "fit_generate_s": round(gen_s, 1),
        "fit_train_s": round(time.perf_counter() - t1, 1),
        "fit_last_tau_hat": round(stats.summary()["tau_hat"], 3),
    }
    return drafter, info


# ---- one step's parts, in isolation ----


@torch.inference_mode()
def step_costs(target, drafter: DFlashDrafter, block: int, device, context: int = 512):
    """Median ms of: target forward over 1 and over B tokens (KV cache of `context`), the
    drafter block + draft logits, and the drafter's context update for B tokens."""
    from transformers import DynamicCache

    if is_hybrid(target.config):  # a recurrent state cannot be cropped back after a forward
        raise SystemExit("bench/eval.py: step costs are measured on dense targets only")
    head = TargetHead.from_model(target)
    taps = LayerTaps(target, drafter.config.target_layer_ids)
    cache_arg = cache_argument(target)
    cache = DynamicCache()
    ids = torch.randint(0, head.vocab_size, (1, context + block), device=device)
    target(input_ids=ids[:, :context], use_cache=True, **{cache_arg: cache})
    features = taps.features()
    dtype = next(drafter.parameters()).dtype
    draft_cache = DraftCache()
    drafter.extend_cache(
        draft_cache, features.to(dtype), torch.arange(context, device=device)[None]
    )

    def target_forward(n: int):
        def fn() -> None:
            target(input_ids=ids[:, context : context + n], use_cache=True, **{cache_arg: cache})
            cache.crop(-n)

        return fn

    embeds = head.embed(ids[:, context : context + block]).to(dtype)

    def draft() -> None:
        hidden = drafter.draft_block(draft_cache, embeds, context)
        head.logits(hidden[0, 1:]).argmax(dim=-1)

    new_features = features[:, -block:].to(dtype)
    new_positions = torch.arange(context, context + block, device=device)[None]

    def extend() -> None:
        drafter.extend_cache(draft_cache, new_features, new_positions)
        draft_cache.crop(context)

    iters = 30 if device.type == "cuda" else 3
    out = {
        "target_1_ms": measure(target_forward(1), device, 3, iters).median_s * 1e3,
        "target_B_ms": measure(target_forward(block), device, 3, iters).median_s * 1e3,
        "draft_block_ms": measure(draft, device, 3, iters).median_s * 1e3,
        "draft_extend_ms": measure(extend, device, 3, iters).median_s * 1e3,
    }
    taps.remove()
    return {k: round(v, 3) for k, v in out.items()}


def evaluate_kinds(
    target, tokenizer, drafter: DFlashDrafter, prompts, block: int, args
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """(one table row per prompt kind, the eval report per kind); writes the reports and
    their plots to --report-dir when given."""
    rows, reports = [], {}
    for kind in KINDS:
        report = evaluate_drafter(
            target,
            tokenizer,
            drafter,
            prompts[kind],
            max_new_tokens=args.max_new_tokens,
            block_size=block,
            temperature=args.temperature,
            seed=args.seed,
            progress=True,
        )
        reports[kind] = report
        timing = report["timing"]
        rows.append(
            {
                "prompts": kind,
                "n": report["num_prompts"],
                "tau": round(report["tau"], 3) if report["tau"] is not None else None,
                "steps": report["total_steps"],
                "out_tokens": report["output_tokens"],
                "lossless": f"{report.get('lossless_prompts', '-')}/{report['num_prompts']}",
                "ms/token B=1": timing.get("baseline_time_per_output_token_ms"),
                f"ms/token B={block}": timing["time_per_output_token_ms"],
                "speedup": report.get("speedup"),
            }
        )
        if args.report_dir:
            makedirs(args.report_dir)
            write_json_atomic(join(args.report_dir, f"{kind}.json"), report)
            write_bytes_atomic(join(args.report_dir, f"{kind}.png"), plot_acceptance(report))
    return rows, reports


def overall_speedup(reports: Sequence[dict[str, Any]]) -> float | None:
    """Decode time per output token, B = 1 over B, over all prompts of every kind (None
    unless every report measured a speedup: CUDA only)."""
    if not all("speedup" in r for r in reports):
        return None
    timings = [r["timing"] for r in reports]
    base = sum(t["baseline_decode_s"] for t in timings) / sum(
        t["baseline_decode_tokens"] for t in timings
    )
    spec = sum(t["decode_s"] for t in timings) / sum(t["decode_tokens"] for t in timings)
    return round(base / spec, 4)


def load_or_fit(target, tokenizer, prompts, args, device) -> tuple[DFlashDrafter, dict[str, Any]]:
    """The drafter of --drafter, or one fitted here (then exported to --save-drafter)."""
    if args.drafter is not None:
        drafter = load_drafter(args.drafter, num_target_layers=len(decoder_layers(target)))
        return drafter, {"drafter": args.drafter}
    drafter, info = fit_drafter(target, tokenizer, prompts["fit"], args, device)
    if args.save_drafter:
        save_export(drafter, args.save_drafter, overwrite=True)
    return drafter, {"drafter": "fitted by bench/eval.py", **info}


def main() -> int:
    args = parse()
    if args.speed:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
        if device.type == "cpu":
            torch.set_num_threads(1)
        from eval_speed import speed  # beside this script

        return speed(args, device)
    if args.prompts_dir:
        prompts = read_prompts(args.prompts_dir, args.num_prompts, args.fit_prompts)
    else:
        prompts = asset_prompts(args.num_prompts, args.fit_prompts)
    if args.write_prompts:
        write_prompts(args.write_prompts, prompts)
        log.info(f"wrote {', '.join(f'{k}.jsonl' for k in prompts)} to {args.write_prompts}")
        return 0
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # small ops on a shared CPU: more threads only contend
    from transformers import AutoTokenizer

    path = args.target or str(smollm2_path())
    target = load_target(path, args.dtype, "sdpa", device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    result: dict[str, Any] = {"bench": "eval", "target": path}
    drafter, info = load_or_fit(target, tokenizer, prompts, args, device)
    result.update(info)
    # Evaluated as served: in the target's dtype.
    drafter = drafter.to(device=device, dtype=target.dtype).eval()
    config = drafter.config
    block = args.block_size or config.block_size
    result.update(
        drafter_layers=config.num_hidden_layers,
        drafter_params_m=round(param_count(drafter) / 1e6, 2),
        block_size=block,
        dtype=args.dtype,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    rows, reports = evaluate_kinds(target, tokenizer, drafter, prompts, block, args)

    costs = step_costs(target, drafter, block, device)
    all_steps = sum(r["total_steps"] for r in reports.values())
    tau = sum(r["decode_tokens"] for r in reports.values()) / all_steps if all_steps else None
    # Per output token: B=1 pays one 1-token forward; the loop pays (verify + draft + extend)
    # per step, i.e. divided by tau. Their ratio bounds what the loop can gain.
    step_ms = costs["target_B_ms"] + costs["draft_block_ms"] + costs["draft_extend_ms"]
    modelled = tau * costs["target_1_ms"] / step_ms if tau else None

    print_table(rows, list(rows[0]))
    log.info(
        f"one step's parts (ms, context 512): target 1 tok {costs['target_1_ms']}, "
        f"target {block} tok {costs['target_B_ms']}, drafter block+logits "
        f"{costs['draft_block_ms']}, drafter context update {costs['draft_extend_ms']}; "
        f"tau x t1 / (tB + draft + update) = {modelled and round(modelled, 2)}"
    )
    result.update(
        tau=tau and round(tau, 4),
        rows=rows,
        step_costs_ms=costs,
        modelled_speedup=modelled and round(modelled, 3),
        per_position_acceptance={k: r["per_position_acceptance"] for k, r in reports.items()},
        **environment(),
    )
    speedup = overall_speedup(list(reports.values()))
    if speedup is not None:
        result["speedup"] = speedup
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
