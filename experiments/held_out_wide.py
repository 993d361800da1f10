"""The reference split's held-out chat prompts without the 500-prompt cap, and N of them spread
over their conversations: a chat eval set of N independent conversations.

`build-prompts` holds out ~5% of the chitchat conversations (201 of 4,017 at seed 0), but its
cap of 500 held-out prompts a kind keeps the turns of only the first 30 of them (29 whole, 13
of the 30th's 21): the eval stage's 24 chat prompts are 24 conversations, and a wider
selection from that file takes further turns of the same 30. Here the same split (the same conversations held out:
`is_held_out` depends only on the conversation's id and the seed) is taken whole, ordered
as `build_prompts` orders a held-out file, and the eval stage's selection
(`write_spread_subset`: one prompt a conversation, in file order) picks N. Nothing here was
trained on: every turn of a held-out conversation stays out of the train side, capped or
not.

    python experiments/held_out_wide.py --out /tmp/ev -n 96 \
        --capped /tmp/ev/.qrun/prompts/held_out/chat.jsonl   # the committed run's file, checked
    flashdraft eval ... --prompts /tmp/ev/chat_wide_96.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from quality_report import write_spread_subset  # beside this script

from flashdraft import assets
from flashdraft.data.sources import SourcesConfig, file_order, split_chat


def wide_held_out(conversations: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Every held-out chat prompt of the split at `seed` (`SourcesConfig`'s defaults, as the
    reference run's `split.json` records them, but the cap), in the order `build_prompts`
    writes a held-out file."""
    config = SourcesConfig(output="unused", seed=seed, max_held_out=10**9)
    return file_order(split_chat(conversations, config).held_out, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the two files")
    parser.add_argument("-n", type=int, default=96, help="conversations in the eval set")
    parser.add_argument("--seed", type=int, default=0, help="the split's seed (build-prompts')")
    parser.add_argument(
        "--capped", type=Path, help="a run's held-out chat.jsonl: checked to be inside the list"
    )
    args = parser.parse_args(argv)
    held = wide_held_out(assets.chitchat_conversations(), args.seed)
    if args.capped is not None:
        capped = [json.loads(line) for line in args.capped.open() if line.strip()]
        outside = [p["id"] for p in capped if p not in held]
        if outside:
            print(
                f"held_out_wide: {len(outside)} prompt(s) of {args.capped} are not in this "
                f"split (first: {outside[0]}); is --seed the run's?",
                file=sys.stderr,
            )
            return 1
    args.out.mkdir(parents=True, exist_ok=True)
    whole = args.out / "chat_wide_all.jsonl"
    whole.write_text("".join(json.dumps(p) + "\n" for p in held))
    write_spread_subset(whole, args.out / f"chat_wide_{args.n}.jsonl", args.n)
    sources = len({p["source"] for p in held})
    print(f"{len(held):,} held-out chat prompts from {sources} conversations -> {whole}")
    if args.n > sources:  # the selection then takes second turns: not one a conversation
        print(
            f"held_out_wide: -n {args.n} is more than the {sources} held-out conversations; "
            f"chat_wide_{args.n}.jsonl takes further turns of them (lower -n for one each)",
            file=sys.stderr,
        )
    else:
        print(f"{args.n} conversations, one prompt each -> chat_wide_{args.n}.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
