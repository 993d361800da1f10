"""The shipped reference drafter in z-lab's own decode loop and in `flashdraft eval`, in fp32.

    python bench/zlab_parity.py --prompts quality-run/prompts/held_out/chat.jsonl --limit 4

Both loops run on the same target (SmolLM2-135M-Instruct, fp32 on the CPU), the same
export (`benchmarks/artifacts/smollm2-135m-dflash`) and the same held-out prompts, T = 0;
prints both taus and step counts, then one JSON line. In fp32 the two must agree exactly
(the bf16 GPU run of `bench/quality.py` differs at the target's near-ties: its continuations
leave each other and the taus are measured on different text).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from quality import zlab_parity  # beside this script

from flashdraft.assets import smollm2_path
from flashdraft.benchutil import environment, print_json
from flashdraft.eval.evaluate import EvalConfig

ARTIFACT = Path(__file__).resolve().parents[1] / "benchmarks/artifacts/smollm2-135m-dflash"


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
