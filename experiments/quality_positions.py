"""Where a tau gap lies (`experiments/quality.py pairs`, its last tables): per draft position, the
share of verify steps whose accepted draft reaches it, on the text before each output falls
into its repetition loop and from the loop on, each recipe's runs pooled.

A small target's greedy chat answers mostly end in a loop (`flashdraft.data.loops`), and
there a drafter copies: on SmolLM2-135M four fifths of the chat tokens come from loops, so
chat's tau mostly measures how deep a drafter copies a loop, while the text before it
measures drafting proper. Splitting the two, position by position, says which of them a
recipe gains or loses (s33: flashdraft's preset led the peer before the loops; inside them
its deficit opened at position 6 and grew to 0.09 of the steps at position 15).

Inside a loop, the steps from its third period on draft text said twice already: pure
copying, where a drafter should accept the whole block. `copy_tables` counts how often each
recipe does, by the loop's period, and names the loop it misses most (s34: the preset
accepted the whole block in 0.81 of those steps, `dpm` and the peer 0.94-0.98; 54 of the
preset's 95 misses were one loop of period 23, "I'm glad to hear that you're thinking ahead and
building something that can meet all of the client's needs.", which it never copied whole).
"""

from __future__ import annotations

from typing import Any

from quality_report import KIND_NAMES  # beside this script

from flashdraft.data.loops import LOOP_PERIOD, find_loop, loop_start
from flashdraft.eval.report import steps_before, summarize
from flashdraft.eval.speculative import DecodeResult

SEGMENTS = ("before the loop", "from the loop on")
PERIODS = ((1, 4), (5, 12), (13, LOOP_PERIOD))  # the copy table's period columns, in tokens


def outputs(reports: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int]] | None:
    """Every per-prompt entry of `reports` (one recipe's runs of one kind), each with its
    run's block size; None when there are none or one lacks its output ids (a report written
    before the eval kept them): what the loop tables read."""
    prompts = [
        (p, (r.get("settings") or {}).get("block_size", 16))
        for r in reports
        for p in r.get("per_prompt") or []
    ]
    if not prompts or any("output_ids" not in p for p, _ in prompts):
        return None
    return prompts


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
    prompts = outputs(reports)
    if prompts is None:
        return None
    split: dict[str, list[int]] = {name: [] for name in SEGMENTS}
    for prompt, _ in prompts:
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


def copying_steps(prompt: dict[str, Any]) -> tuple[int, list[int]] | None:
    """(period, acceptance lengths) of the verify steps that start in the third period of
    the loop the output ends in or later (the loop said twice already: drafting it is
    copying), the output's last step left out (max_new_tokens cuts it); None without a loop."""
    found = find_loop(prompt["output_ids"])
    if found is None:
        return None
    start, period = found
    lengths = list(prompt["acceptance_lengths"])
    kept, first = [], 1  # the output index of each step's first token (the prefill emits 0)
    for n in lengths[:-1]:
        if first >= start + 2 * period:
            kept.append(n)
        first += n
    return period, kept


def copy_row(name: str, reports: list[dict[str, Any]]) -> str | None:
    """One recipe's row of the copy table: its steps inside established loops
    (`copying_steps`), the share accepting the whole block (all B - 1 drafts and the bonus),
    that share by the loop's period, and the loop with the most misses (runs pooled); None
    without such steps or without per-prompt outputs (`position_tables` names those)."""
    by_period = {bucket: [0, 0] for bucket in PERIODS}  # whole blocks, steps
    by_loop: dict[tuple[str, int], list[int]] = {}  # the same, per (prompt, period)
    for prompt, block in outputs(reports) or []:
        found = copying_steps(prompt)
        if found is None or not found[1]:
            continue
        period, lengths = found
        whole = sum(n >= block for n in lengths)
        bucket = next(b for b in PERIODS if b[0] <= period <= b[1])
        for tally in (by_period[bucket], by_loop.setdefault((str(prompt["id"]), period), [0, 0])):
            tally[0] += whole
            tally[1] += len(lengths)
    steps = sum(n for _, n in by_period.values())
    if not steps:
        return None
    whole = sum(hits for hits, _ in by_period.values())
    cells = [name, str(steps), f"{whole / steps:.2f}"]
    cells += [f"{hits}/{n}" if n else "—" for hits, n in by_period.values()]
    (loop_id, period), (hits, n) = max(by_loop.items(), key=lambda i: i[1][1] - i[1][0])
    cells.append(f"{loop_id} ({period}): {hits}/{n}" if hits < n else "—")
    return "| " + " | ".join(cells) + " |"


def copy_tables(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """`runs` as for `position_tables`. Per kind with loops, `copy_row` of each recipe."""
    out = []
    for kind, recipes in runs.items():
        rows = [row for name, reports in recipes.items() if (row := copy_row(name, reports))]
        if not rows:
            continue
        head = ["run", "steps", "whole block"]
        head += [f"period {lo}-{hi}" for lo, hi in PERIODS] + ["most misses: loop (period)"]
        title = (
            f"{KIND_NAMES[kind]}, T = 0, inside established loops (the steps from each loop's "
            "third period on, each output's last step left out): the share accepting the "
            "whole block, whole blocks / steps by the loop's period, and the loop missed most "
            "(runs pooled):"
        )
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows]
        out.append(f"\n{title}\n\n" + "\n".join(lines) + "\n")
    return "".join(out)
