"""The shipped reference drafter in z-lab's own decode loop and in `flashdraft eval`, in fp32.

    python experiments/zlab_parity.py --prompts quality-run/prompts/held_out/chat.jsonl --limit 4

Both loops run on the same target (SmolLM2-135M-Instruct, fp32 on the CPU), the same
export (`flashdraft/artifacts/smollm2-135m-dflash`) and the same held-out prompts, T = 0;
prints both taus and step counts, then one JSON line. In fp32 the two must agree exactly on
every step that drafts a whole block (the bf16 GPU run of `experiments/quality.py` differs at the
target's near-ties: its continuations leave each other and the taus are measured on
different text). Once fewer than B tokens are left of --max-new-tokens, z-lab's loop drafts
a shorter block (fewer mask slots, which the block's other slots attend to), while
flashdraft's drafts the whole block as trained and as docs/design.md §5 says and drops what
passes the limit: there the drafts may differ, so the last steps before the limit are
compared apart (`whole_blocks`). `zlab_parity` is also what
`experiments/quality.py`'s eval stage runs beside each held-out T = 0 eval.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from flashdraft.assets import smollm2_path
from flashdraft.benchutil import environment, free_memory, print_json
from flashdraft.eval.evaluate import EvalConfig, load_eval_target, run_eval
from flashdraft.eval.prompts import load_prompts
from flashdraft.eval.speculative import eos_token_ids
from flashdraft.train.checkpoint import load_drafter

ARTIFACT = Path(__file__).resolve().parents[1] / "flashdraft/artifacts/smollm2-135m-dflash"


def zlab_parity(config: EvalConfig) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """`flashdraft eval` (its HF loop) and z-lab's loop on the same export and prompts, both
    in fp32, where the two must agree (in bf16 a near-tie of the target's top logits flips
    between the two loops' forwards and the taus are measured on different text,
    recorded in git at f6a3b98, benchmarks/zlab_parity_cpu_20261201.md): (our report, z-lab's tau and steps with
    `whole_blocks`, the steps compared by `whole_block_agreement`), or None without the
    `dflash` package."""
    if importlib.util.find_spec("dflash") is None:
        return None
    fp32 = dataclasses.replace(config, dtype="float32", decoder="hf")
    model, tokenizer = load_eval_target(fp32)
    drafter = load_drafter(config.drafter)
    ours = run_eval(fp32, model, tokenizer, drafter)
    theirs = zlab_reference(model, tokenizer, fp32)
    del model
    free_memory()
    if theirs is None:
        return None
    mine = [p["acceptance_lengths"] for p in ours["per_prompt"]]
    block = drafter.config.block_size
    theirs["whole_blocks"] = whole_block_agreement(
        mine, theirs.pop("per_prompt"), config.max_new_tokens, block
    )
    return ours, theirs


def whole_block_steps(lengths: list[int], max_new_tokens: int, block: int) -> int:
    """How many leading verify steps of one output (their acceptance lengths) z-lab's loop
    runs with a whole block: its block is cut to the tokens left of `max_new_tokens`
    (counting the bonus), min(B, max_new_tokens - produced + 1), after `produced` output
    tokens (the prefill's included)."""
    produced = 1
    for i, n in enumerate(lengths):
        if max_new_tokens - produced + 1 < block:
            return i
        produced += n
    return len(lengths)


def whole_block_agreement(
    ours: list[list[int]], theirs: list[list[int]], max_new_tokens: int, block: int
) -> dict[str, Any]:
    """Both loops' acceptance lengths, per prompt, compared over the steps z-lab drafts a
    whole block in (each prompt's count from flashdraft's steps; equal prefixes give equal
    counts): `steps` compared, `identical` whether every one agrees, `tail_steps` and
    `tail_identical` for the rest (z-lab's shortened blocks)."""
    steps = tail = 0
    identical = tail_identical = True
    for mine, other in zip(ours, theirs, strict=True):
        k = whole_block_steps(mine, max_new_tokens, block)
        steps += k
        identical &= mine[:k] == other[:k]
        tail += len(mine) - k
        tail_identical &= mine[k:] == other[k:]
    return {"steps": steps, "identical": identical, "tail_steps": tail,
            "tail_identical": tail_identical}  # fmt: skip


def zlab_reference(model: Any, tokenizer: Any, config: EvalConfig) -> dict[str, Any] | None:
    """tau of z-lab's own draft-and-verify loop (`dflash.model.dflash_generate`) on the same
    export and prompts, when the `dflash` package is installed; else None."""
    if importlib.util.find_spec("dflash") is None:
        return None
    from unittest import mock

    from dflash import model as zlab  # optional: z-lab's reference implementation

    parameter = next(model.parameters())
    draft = zlab.DFlashDraftModel.from_pretrained(config.drafter, dtype=parameter.dtype)
    draft = draft.to(parameter.device).eval()
    stop = sorted(eos_token_ids(model, tokenizer))
    per_prompt: list[list[int]] = []
    # Its stats timer synchronises CUDA unconditionally; on the CPU a plain clock does.
    timer = zlab._cuda_time if parameter.device.type == "cuda" else time.perf_counter
    with mock.patch.object(zlab, "_cuda_time", timer):
        for prompt in load_prompts(config.prompts, tokenizer, config.limit):
            ids = torch.tensor([prompt.input_ids], device=parameter.device)
            stats = zlab.dflash_generate(
                draft, model, ids, config.max_new_tokens, stop, return_stats=True
            )
            per_prompt.append([int(n) for n in stats.acceptance_lengths])
    lengths = [n for one in per_prompt for n in one]
    return {
        "tau": sum(lengths) / len(lengths) if lengths else None,
        "steps": len(lengths),
        "per_prompt": per_prompt,
    }


# ---- the command ----


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", required=True, help="held-out prompts (JSONL)")
    parser.add_argument("--drafter", default=str(ARTIFACT))
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    config = EvalConfig(
        target=str(smollm2_path()),
        drafter=args.drafter,
        prompts=args.prompts,
        output=str(Path(tempfile.mkdtemp()) / "report.json"),
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        device="cpu",
    )
    started = time.perf_counter()
    parity = zlab_parity(config)
    if parity is None:
        print("the dflash package (z-lab's reference) is not installed", file=sys.stderr)
        return 2
    report, reference = parity
    print(f"flashdraft eval: tau {report['tau']:.4f} over {report['total_steps']} steps")
    print(f"z-lab dflash_generate: tau {reference['tau']:.4f} over {reference['steps']} steps")
    whole = reference["whole_blocks"]
    print(
        f"steps drafting a whole block: {whole['steps']}, "
        f"{'identical' if whole['identical'] else 'NOT identical'}; the last steps before "
        f"--max-new-tokens (z-lab drafts a shorter block there): {whole['tail_steps']}, "
        f"{'identical' if whole['tail_identical'] else 'different'}"
    )
    print_json(
        {
            "bench": "zlab-parity",
            "prompts": args.prompts,
            "limit": args.limit,
            "max_new_tokens": args.max_new_tokens,
            "dtype": "float32",
            "flashdraft": {"tau": report["tau"], "steps": report["total_steps"]},
            "zlab": reference,
            "lossless": report["lossless"],
            "seconds": round(time.perf_counter() - started, 1),
            **environment(),
        }
    )
    return 0


if __name__ == "__main__":
    torch.set_num_threads(2)
    sys.exit(main())
