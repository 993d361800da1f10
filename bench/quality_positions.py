"""Where a tau gap lies (`bench/quality.py pairs`, its last tables): per draft position, the
share of verify steps whose accepted draft reaches it, on the text before each output falls
into its repetition loop and from the loop on, each recipe's runs pooled.

A small target's greedy chat answers mostly end in a loop (`flashdraft.data.loops`), and
there a drafter copies: on SmolLM2-135M four fifths of the chat tokens come from loops, so
chat's tau mostly measures how deep a drafter copies a loop, while the text before it
measures drafting proper. Splitting the two, position by position, says which of them a
recipe gains or loses (s33: flashdraft's preset led the peer before the loops; inside them
its deficit opened at position 6 and grew to 0.09 of the steps at position 15).
"""

from __future__ import annotations

from typing import Any

from quality_report import KIND_NAMES  # beside this script

from flashdraft.data.loops import loop_start
from flashdraft.eval.report import steps_before, summarize
from flashdraft.eval.speculative import DecodeResult

SEGMENTS = ("before the loop", "from the loop on")


def split_at_loop(prompt: dict[str, Any]) -> tuple[list[int], list[int]]:
    """One prompt's acceptance lengths: the verify steps whose tokens all come before the
    loop its output ends in, and the rest, the step across the loop's start included (empty
    when it ends in none)."""
    lengths = list(prompt["acceptance_lengths"])
    result = DecodeResult(prompt["output_ids"], lengths, 0, 0.0, 0.0, False)
    before = steps_before(result, loop_start(prompt["output_ids"]))
    return before, lengths[len(before) :]


def segments(reports: list[dict[str, Any]]) -> dict[str, list[int]] | None:
    """Every run's steps of one recipe and kind, pooled, split at the loops; None when a
    report has no per-prompt outputs (written before outputs were kept)."""
    prompts = [p for r in reports for p in r.get("per_prompt") or []]
    if not prompts or any("output_ids" not in p for p in prompts):
        return None
    split: dict[str, list[int]] = {name: [] for name in SEGMENTS}
    for prompt in prompts:
        before, rest = split_at_loop(prompt)
        split[SEGMENTS[0]] += before
        split[SEGMENTS[1]] += rest
    return split


def position_tables(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """`runs`: kind -> recipe -> its runs' T = 0 eval reports. One table per kind in which
    some output ends in a loop: a row per recipe and segment with its verify steps, its
    tau and the share of steps reaching each draft position."""
    out = []
    for kind, recipes in runs.items():
        every = {name: segments(reports) for name, reports in recipes.items() if reports}
        split = {name: s for name, s in every.items() if s is not None}
        if not any(s[SEGMENTS[1]] for s in split.values()):
            continue
        missing = [name for name, s in every.items() if s is None]
        block = max(
            (r.get("settings") or {}).get("block_size", 16) for name in split for r in recipes[name]
        )
        head = ["run", "text", "steps", "tau", *(str(k) for k in range(1, block))]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, parts in split.items():
            for segment, lengths in parts.items():
                if not lengths:
                    continue
                # the eval's own statistics of these steps: tau and per_position_acceptance
                stats = summarize([DecodeResult([], lengths, 0, 0.0, 0.0, False)], block)
                shares = [f"{x:.2f}" for x in stats["per_position_acceptance"]]
                cells = [name, segment, str(len(lengths)), f"{stats['tau']:.3f}", *shares]
                lines.append("| " + " | ".join(cells) + " |")
        title = (
            f"{KIND_NAMES[kind]}, T = 0, per draft position: the share of verify steps whose "
            "draft reaches it, before each output's repetition loop and from it on (runs pooled):"
        )
        if missing:  # reports written before the eval kept each prompt's output ids
            lines.append(f"\n(left out, no per-prompt outputs: {', '.join(missing)})")
        out.append(f"\n{title}\n\n" + "\n".join(lines) + "\n")
    return "".join(out)
