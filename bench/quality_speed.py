"""`pairs`' speed table: each recipe's decode time per output token in the draft-and-verify
loop over the baseline's, per kind, with a 90% interval over whole sources.

tau does not depend on the machine; time does. A drafter with the higher tau can still decode
slower (s50: 7 x 352 over 5 x 704 on SmolLM2-135M, its verify step 6.5-8% dearer), so the
choice of a shape needs both. A time ratio means something only between evals of one machine
in one session: the table gives one where both sides ran the same prompts in the same kind of
loop on a device of the same name (`settings.device_name`, recorded since s50; for older
reports `--same-machine` says they shared one), and a dash with the reason elsewhere."""

from __future__ import annotations

import random
from typing import Any

from quality_report import KIND_NAMES


def timed(report: dict[str, Any]) -> bool:
    """Whether a report carries what the table needs: per-prompt decode times and outputs."""
    prompts = report.get("per_prompt") or []
    return bool(prompts) and all("decode_s" in p and "output_ids" in p for p in prompts)


def loop_key(report: dict[str, Any]) -> tuple[Any, ...]:
    """What must match for two timings to compare: the drafter loop's kind, the device and
    its name (None where the report predates it), the dtypes, the block and token budget."""
    settings = report.get("settings", {})
    return (
        tuple(sorted((report.get("loops") or {}).get("speculative", {}).items())),
        settings.get("device"),
        settings.get("device_name"),
        settings.get("target_dtype"),
        settings.get("drafter_dtype"),
        settings.get("block_size"),
        settings.get("max_new_tokens"),
    )


def per_source(reports: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Source (a conversation, a file; the prompt's index where none is named) -> [decode
    seconds, decoded tokens], summed over the runs: a recipe's repeats or seeds pool. The
    first output token is the prefill's, so a prompt decodes len(output_ids) - 1."""
    sums: dict[str, list[float]] = {}
    for report in reports:
        for index, prompt in enumerate(report["per_prompt"]):
            key = str(prompt.get("source") or f"#{index}")
            cell = sums.setdefault(key, [0.0, 0.0])
            cell[0] += prompt["decode_s"]
            cell[1] += max(0, len(prompt["output_ids"]) - 1)
    return sums


def ms_per_token(sums: dict[str, list[float]]) -> float:
    tokens = sum(t for _, t in sums.values())
    return 1e3 * sum(s for s, _ in sums.values()) / tokens if tokens else float("nan")


def speed_ratio(
    mine: list[dict[str, Any]],
    theirs: list[dict[str, Any]],
    *,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(theirs' ms per token / mine's, and its 90% bootstrap interval over whole sources): above
    1 where `mine` decodes faster. Both sides must have run the same prompts."""
    a, b = per_source(mine), per_source(theirs)
    keys = sorted(a)
    assert keys == sorted(b), "speed_ratio: the two sides ran other sources"
    point = ms_per_token(b) / ms_per_token(a)
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        draw = [keys[rng.randrange(len(keys))] for _ in keys]
        time_a, tokens_a = sum(a[k][0] for k in draw), sum(a[k][1] for k in draw)
        time_b, tokens_b = sum(b[k][0] for k in draw), sum(b[k][1] for k in draw)
        if tokens_a and tokens_b and time_a:
            ratios.append((time_b / tokens_b) / (time_a / tokens_a))
    ratios.sort()
    return point, ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios)) - 1]


def _why_not(
    mine: list[dict[str, Any]], theirs: list[dict[str, Any]], same_machine: bool
) -> str | None:
    """Why two sides' times do not compare (None: they do)."""
    ids = [[p.get("id") for p in r["per_prompt"]] for r in mine + theirs]
    if any(i != ids[0] for i in ids[1:]):
        return "other prompts"
    if len({loop_key(r) for r in mine + theirs}) > 1:
        return "other loop or device"
    named = all(r.get("settings", {}).get("device_name") for r in mine + theirs)
    if not (named or same_machine):
        return "machine not recorded: --same-machine"
    return None


def speed_tables(
    loaded: dict[str, dict[str, list[dict[str, Any]]]], baseline: str, same_machine: bool = False
) -> str:
    """The table `pairs` ends with, or "" where no kind has two recipes with timings. `loaded`:
    kind ("_t1" for T = 1) -> recipe -> the eval reports of its runs; `same_machine`: the
    caller says the reports without a device name ran on one machine in one session."""
    order = [k for k in loaded if not k.endswith("_t1")] + [k for k in loaded if k.endswith("_t1")]
    kinds = [
        k for k in order if sum(bool(r) and all(map(timed, r)) for r in loaded[k].values()) > 1
    ]
    if not kinds:
        return ""
    head = ["run"]
    for kind in kinds:
        label = KIND_NAMES[kind.removesuffix("_t1")] + (", T = 1" if kind.endswith("_t1") else "")
        head += [f"{label}: ms / token (speedup) (runs)", f"speed / {baseline}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    names: list[str] = []
    for kind in kinds:
        names += [n for n in loaded[kind] if n not in names]
    for name in names:
        cells = [name]
        for kind in kinds:
            mine, theirs = loaded[kind].get(name, []), loaded[kind].get(baseline, [])
            if not mine or not all(map(timed, mine)):
                cells += ["—", "—"]
                continue
            gains = [r["speedup"] for r in mine if r.get("speedup")]
            gain = f" ({sum(gains) / len(gains):.2f}x)" if gains else ""
            cells.append(f"{ms_per_token(per_source(mine)):.4f}{gain} ({len(mine)})")
            if name == baseline or not theirs or not all(map(timed, theirs)):
                cells.append("—")
            elif reason := _why_not(mine, theirs, same_machine):
                cells.append(f"— ({reason})")
            else:
                point, low, high = speed_ratio(mine, theirs)
                cells.append(f"{point:.3f} [{low:.2f}-{high:.2f}]")
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "\nDecode time per output token in the draft-and-verify loop (ms; the speedup over the "
        "target alone, averaged over the runs; how many runs), and each recipe's speed over "
        f"{baseline}'s ({baseline}'s time / its own, above 1: faster) with a 90% interval over "
        "whole sources. Times compare only between evals of one machine in one session; a dash "
        "says why a pair does not.\n\n" + "\n".join(lines) + "\n"
    )
