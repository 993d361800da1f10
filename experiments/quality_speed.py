"""`pairs`' speed table: each recipe's decode time per output token in the draft-and-verify
loop over the baseline's, per kind, with a 90% interval over whole sources.

tau does not depend on the machine; time does. A drafter with the higher tau can still decode
slower (s50: 7 x 352 over 5 x 704 on SmolLM2-135M, its verify step 6.5-8% dearer), so the
choice of a shape needs both. A time means something only beside times of the same machine
between two of its restarts: the table pools a recipe's runs and gives a ratio only where
every report ran the same prompts in the same kind of loop with the same `settings.machine`
(host and boot) and `settings.device_name`, which evals record after s50; for older reports
`--same-machine` says they ran on one machine in one session. Elsewhere a dash says why."""

from __future__ import annotations

from typing import Any

from quality_report import KIND_NAMES, cluster_ratio_interval

Reports = list[dict[str, Any]]


def timed(report: dict[str, Any]) -> bool:
    """Whether a report carries what the table needs: per-prompt decode times and outputs."""
    prompts = report.get("per_prompt") or []
    return bool(prompts) and all("decode_s" in p and "output_ids" in p for p in prompts)


def loop_key(report: dict[str, Any]) -> tuple[Any, ...]:
    """What must match for two timings to compare: the drafter loop's kind, the machine (its
    host and boot) and device, the dtypes, the block and the token budget."""
    settings = report.get("settings", {})
    return (
        tuple(sorted((report.get("loops") or {}).get("speculative", {}).items())),
        settings.get("machine"),
        settings.get("device"),
        settings.get("device_name"),
        settings.get("target_dtype"),
        settings.get("drafter_dtype"),
        settings.get("block_size"),
        settings.get("max_new_tokens"),
    )


def recorded(report: dict[str, Any]) -> bool:
    """Whether the report says which machine ran it (evals after s50)."""
    settings = report.get("settings", {})
    return bool(settings.get("machine") and settings.get("device_name"))


def sources(reports: Reports) -> list[str]:
    """Each prompt's source (a conversation, a file) as any of the reports names it, else the
    prompt's index: the unit the interval resamples, the same on both sides."""
    keys = []
    for index, prompts in enumerate(zip(*(r["per_prompt"] for r in reports), strict=True)):
        named = next((p["source"] for p in prompts if p.get("source")), None)
        keys.append(str(named or f"#{index}"))
    return keys


def per_source(reports: Reports, keys: list[str]) -> dict[str, list[float]]:
    """Source -> [decode seconds, decoded tokens], summed over the runs: a recipe's repeats or
    seeds pool. The first output token is the prefill's, so a prompt decodes len - 1."""
    sums: dict[str, list[float]] = {key: [0.0, 0.0] for key in keys}
    for report in reports:
        for key, prompt in zip(keys, report["per_prompt"], strict=True):
            sums[key][0] += prompt["decode_s"]
            sums[key][1] += max(0, len(prompt["output_ids"]) - 1)
    return sums


def ms_per_token(sums: dict[str, list[float]]) -> float | None:
    seconds, tokens = sum(s for s, _ in sums.values()), sum(t for _, t in sums.values())
    return 1e3 * seconds / tokens if tokens and seconds else None


def speed_ratio(
    mine: Reports, theirs: Reports, *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float] | None:
    """(theirs' ms per token / mine's, and its 90% bootstrap interval over whole sources):
    above 1 where `mine` decodes faster; None where a side decoded nothing. Both sides must
    have run the same prompts, in order (ValueError otherwise)."""
    runs = mine + theirs
    if any(len(r["per_prompt"]) != len(runs[0]["per_prompt"]) for r in runs):
        raise ValueError("speed_ratio: the two sides ran other prompts")
    keys = sources(runs)
    a, b = per_source(mine, keys), per_source(theirs, keys)
    ms_a, ms_b = ms_per_token(a), ms_per_token(b)
    if ms_a is None or ms_b is None:
        return None
    # theirs' time per token over mine's, sources in a fixed order (the draws follow it)
    clusters = [(b[k][0], b[k][1], a[k][0], a[k][1]) for k in sorted(set(keys))]
    interval = cluster_ratio_interval(clusters, resamples=resamples, seed=seed)
    return None if interval is None else (ms_b / ms_a, *interval)


def _why_not(runs: Reports, same_machine: bool) -> str | None:
    """Why the times of these reports (one recipe's, or two sides') do not compare (None: they
    do)."""
    ids = [[p.get("id") for p in r["per_prompt"]] for r in runs]
    if any(i != ids[0] for i in ids[1:]):
        return "other prompts"
    if len({loop_key(r) for r in runs}) > 1:
        return "other loop, device or machine"
    if not (same_machine or all(map(recorded, runs))):
        return "machine not recorded"
    return None


def _time_cell(runs: Reports, same_machine: bool) -> str:
    """A recipe's ms per token (pooled runs), its mean speedup over the target alone and how
    many runs; a dash where its own runs' times do not pool."""
    if len(runs) > 1 and (reason := _why_not(runs, same_machine)):
        return f"— ({len(runs)} runs: {reason})"
    ms = ms_per_token(per_source(runs, sources(runs)))
    if ms is None:
        return "— (nothing decoded)"
    gains = [r["speedup"] for r in runs if r.get("speedup")]
    gain = f" ({sum(gains) / len(gains):.2f}x)" if gains else ""
    return f"{ms:.4f}{gain} ({len(runs)})"


def speed_tables(
    loaded: dict[str, dict[str, Reports]], baseline: str, same_machine: bool = False
) -> str:
    """The table `pairs` ends with, or "" where no kind has two recipes with timings. `loaded`:
    kind ("_t1" for T = 1) -> recipe -> the eval reports of its runs; `same_machine`: the
    caller says the reports without a machine ran on one machine in one session."""
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
            cells.append(_time_cell(mine, same_machine))
            if name == baseline or not theirs or not all(map(timed, theirs)):
                cells.append("—")
            elif reason := _why_not(mine + theirs, same_machine):
                cells.append(f"— ({reason})")
            elif (ratio := speed_ratio(mine, theirs)) is None:
                cells.append("— (nothing decoded)")
            else:
                cells.append(f"{ratio[0]:.3f} [{ratio[1]:.2f}-{ratio[2]:.2f}]")
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "\nDecode time per output token in the draft-and-verify loop (ms; the speedup over the "
        "target alone, averaged over the runs; how many runs), and each recipe's speed over "
        f"{baseline}'s ({baseline}'s time / its own, above 1: faster) with a 90% interval over "
        "whole sources. Times compare only between evals of one machine between two of its "
        "restarts; a dash says why a pair does not.\n\n" + "\n".join(lines) + "\n"
    )
