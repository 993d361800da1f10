"""`flashdraft generate --target T --prompts IN --output OUT.jsonl`: on-policy answers."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from flashdraft import storage
from flashdraft.data.generate import (
    BACKENDS,
    GenerateConfig,
    OutputLog,
    Summary,
    format_summary,
    run_generation,
)
from flashdraft.data.inference import DTYPES, Sampling


def _shard(value: str) -> tuple[int, int]:
    index, slash, count = value.partition("/")
    if not slash or not index.isdigit() or not count.isdigit():
        raise argparse.ArgumentTypeError(f"expected K/N, e.g. 0/8, got {value!r}")
    return int(index), int(count)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="HF model directory (or hub name)")
    parser.add_argument(
        "--prompts", nargs="+", required=True, metavar="INPUT", help="files, globs, dirs, URLs"
    )
    parser.add_argument("--output", required=True, metavar="OUT.jsonl")
    parser.add_argument("--thinking", choices=("on", "off"), default="off")
    parser.add_argument(
        "--turns",
        choices=("last", "all"),
        default="last",
        help="regenerate the last assistant turn of each conversation, or each one",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per batch at most")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="token budget per batch: rows × (longest prompt + max new tokens)",
    )
    parser.add_argument("--sort-window", type=int, default=4096, help="prompts sorted at once")
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard", type=_shard, default=(0, 1), metavar="K/N")
    parser.add_argument(
        "--stop-token-ids", type=int, nargs="+", default=[], help="stop on these ids too"
    )
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument(
        "--vllm-kwargs", type=json.loads, default={}, help="JSON object for vllm.LLM(...)"
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--keep-truncated",
        action="store_true",
        help="keep answers cut at --max-new-tokens in the main output (counted; the chat "
        "template closes them with its end-of-turn token); default: side file",
    )


def config_from_args(args: argparse.Namespace) -> GenerateConfig:
    return GenerateConfig(
        target=args.target,
        prompts=args.prompts,
        output=args.output,
        sampling=Sampling(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_new_tokens,
        ),
        thinking=args.thinking == "on",
        turns=args.turns,
        backend=args.backend,
        batch_size=args.batch_size,
        max_batch_tokens=args.max_batch_tokens,
        sort_window=args.sort_window,
        limit=args.limit,
        seed=args.seed,
        shard_index=args.shard[0],
        num_shards=args.shard[1],
        stop_token_ids=args.stop_token_ids,
        device=args.device,
        dtype=args.dtype,
        vllm_kwargs=args.vllm_kwargs,
        progress=not args.no_progress,
        keep_truncated=args.keep_truncated,
    )


def load_tokenizer(target: str, thinking: bool) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    template = tokenizer.chat_template or ""
    if not template:
        raise ValueError(f"the tokenizer of {target} has no chat template")
    if thinking and "enable_thinking" not in template:
        print(
            "generate: the chat template has no enable_thinking switch; "
            "the target thinks (or not) as its template decides",
            file=sys.stderr,
        )
    return tokenizer


def run(args: argparse.Namespace) -> int:
    import torch

    from flashdraft.data.inference import load_backend, stop_token_ids

    cfg = config_from_args(args)
    storage.expand_inputs(cfg.prompts)  # fail fast on a typo, before loading the target
    tokenizer = load_tokenizer(cfg.target, cfg.thinking)
    stop_ids = stop_token_ids(cfg.target, cfg.stop_token_ids)
    log = OutputLog(cfg.output)
    log.check_settings(cfg.settings(stop_ids))  # before loading the target, too
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    backend = load_backend(
        cfg.backend,
        cfg.target,
        cfg.sampling,
        stop_ids,
        pad_id,
        device=cfg.device,
        dtype=cfg.dtype,
        vllm_kwargs=cfg.vllm_kwargs,
    )
    summary = Summary()
    try:
        run_generation(cfg, backend, tokenizer, log=log, summary=summary)
    except KeyboardInterrupt:
        print(format_summary(summary, cfg, backend.name))
        print("generate: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except torch.OutOfMemoryError:
        print(
            "generate: out of memory: lower --batch-size or set --max-batch-tokens, then run "
            "again to resume (batches run longest prompts first, so this happens early)",
            file=sys.stderr,
        )
        raise
    print(format_summary(summary, cfg, backend.name))
    return 0
