"""Several runs side by side (`experiments/quality.py compare` and `pairs`): each run's row (its
held-out evals, steps, step time and recipe), the peer's, the tau ratios with paired
intervals that resample whole sources, seeds pooled into one recipe, and the tables: per
kind, over the text before the target's loops, at T = 1 and per draft position."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from quality_positions import copy_tables, outputs, position_tables, split_at_loop
from quality_report import KIND_NAMES, cluster_ratio_interval, collect, read_metrics
from quality_speed import speed_tables

from flashdraft.data.sources import KINDS
from flashdraft.train.config import as_recorded_now, flatten

# Run-config keys that say where and how often, not what is trained: left out of the diff.
_NOT_RECIPE = ("output", "target.", "data.datasets", "device", "log.", "checkpoint.", "eval.")


def run_row(out: Path, run: str) -> dict[str, Any]:
    """One flashdraft run of OUT: its held-out T = 0 evals, steps, median step time and its
    recipe (the run config, flattened)."""
    summary = collect(out, run)
    metrics = summary["metrics"]
    train = summary["train"] or {}
    # keys added since an older run: their defaults, so they do not show as differences
    recorded = as_recorded_now(train.get("settings", {}).get("run", {}))
    recipe = {k: v for k, v in flatten(recorded).items() if not k.startswith(_NOT_RECIPE)}
    times = [r["step_s"] for r in metrics if isinstance(r.get("step_s"), float)]
    step_s = statistics.median(times) if times else None
    return {
        "name": run,
        "evals": summary["evals"],
        "sampled": summary["sampled"],
        "steps": metrics[-1]["step"] if metrics else None,
        "step_ms": None if step_s is None else step_s * 1e3,
        "recipe": recipe,
    }


def peer_step_ms(folder: Path) -> float | None:
    """The peer's median step time from its log (`elapsed_s` between consecutive records over
    the steps between them; a resumed run's clock restarts, so a pair going back is skipped),
    as the runs' median `step_s`; its train_s / steps would also count the start-up and
    compilation before the first record (s25: 120.5 ms against a median of 104.0). None
    without two timed records."""
    times = [
        (b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"])
        for a, b in itertools.pairwise(read_metrics(folder))
        if "elapsed_s" in a and "elapsed_s" in b and b["elapsed_s"] >= a["elapsed_s"]
    ]
    return statistics.median(times) * 1e3 if times else None


def peer_row(folder: Path) -> dict[str, Any] | None:
    """experiments/peer_recipe.py's run in `folder` (its report.json and eval/), or None."""
    report_path = folder / "report.json"
    if not report_path.exists():
        return None
    report = json.loads(report_path.read_text())

    def read(name: str) -> dict[str, Any] | None:
        path = folder / "eval" / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    steps = report.get("steps")
    step_ms = peer_step_ms(folder)
    if step_ms is None and steps and report.get("train_s"):  # no log: the whole time
        step_ms = report["train_s"] / steps * 1e3
    return {
        "name": f"peer: speculators {report.get('peer_version', '?')}",
        "evals": {kind: read(kind) for kind in KINDS},
        "sampled": {kind: read(f"{kind}_t1") for kind in KINDS},
        "steps": steps,
        "step_ms": step_ms,
        "recipe": {"recipe": "speculators' own (Muon, D-PACE, linear schedule)"},
    }


def same_prompts(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Whether two eval reports ran the same prompts (ids, in order), or cannot tell (a report
    written before reports listed their prompts). A peer evaluated on another selection of
    the held-out file (its first N instead of the eval stage's spread over sources) is not
    comparable: `compare` shows no ratio for it rather than a number of two prompt sets."""
    a, b = mine.get("per_prompt"), theirs.get("per_prompt")
    if not a or not b:
        return True
    return [x.get("id") for x in a] == [y.get("id") for y in b]


def tau_ratio_interval(
    mine: dict[str, Any],
    theirs: dict[str, Any],
    *,
    resamples: int = 2000,
    seed: int = 0,
    sources: dict[str, str] | None = None,
) -> tuple[float, float] | None:
    """A 90% paired bootstrap interval of tau(mine) / tau(theirs) over the eval's prompts
    (each resample draws prompts and keeps both runs' results on them); None unless both
    reports carry per-prompt results for the same prompts (ids, in order). On 8
    prompts one long repetitive answer can move a kind's tau by 20%: the interval says so.
    Prompts that name their `source` (a conversation's turns, a file's functions) are drawn
    by whole source: turns of one conversation are not independent draws. `sources` (prompt
    id -> source) names them for reports that do not (`flashdraft eval`'s own)."""
    a, b = mine.get("per_prompt") or [], theirs.get("per_prompt") or []
    if not a or not b or not same_prompts(mine, theirs):
        return None
    clusters: dict[str, list[float]] = {}
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        named = x.get("source") or y.get("source") or (sources or {}).get(x.get("id"))
        key = str(named or f"#{index}")
        sums = clusters.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        sums[0] += sum(x["acceptance_lengths"])
        sums[1] += len(x["acceptance_lengths"])
        sums[2] += sum(y["acceptance_lengths"])
        sums[3] += len(y["acceptance_lengths"])
    groups = [(g[0], g[1], g[2], g[3]) for g in clusters.values()]
    return cluster_ratio_interval(groups, resamples=resamples, seed=seed)


def before_loops(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """`report` as if every output stopped where it falls into a repetition loop: each
    prompt keeps the verify steps that end before its loop starts (`loop_start`, read from
    the output ids, so reports written before loops were counted work too) and tau is taken
    over those; None when nothing is left or the report has no per-prompt outputs."""
    found = outputs([report] if report else [])
    if found is None:
        return None
    prompts = [p for p, _ in found]
    splits = [split_at_loop(p) for p in prompts]
    kept = [
        {**p, "acceptance_lengths": before} for p, (before, _) in zip(prompts, splits, strict=True)
    ]
    steps = sum(len(p["acceptance_lengths"]) for p in kept)
    if not steps:
        return None
    tau = sum(sum(p["acceptance_lengths"]) for p in kept) / steps
    loops = sum(bool(rest) for _, rest in splits)  # a loop's 128+ tokens take steps
    return {"tau": tau, "per_prompt": kept, "loop_prompts": loops}


def pooled(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one recipe (its seeds) on the same prompts, as one eval report: each
    prompt's verify steps are all the runs' steps on it, so tau is the recipe's over every
    run (a mean weighted by each run's verify steps) and `tau_ratio_interval` resamples
    sources with all the runs' results on each. The interval then covers the prompts, not
    the seeds: two seeds give a mean, not a spread.
    The pooled prompts carry no output ids (pool `before_loops` of each run instead).
    Raises ValueError when the runs ran other prompts, or carry no per-prompt results or
    prompt ids."""
    if not reports or any(not r.get("per_prompt") for r in reports):
        raise ValueError("pooled: every report needs per-prompt results")
    if any(p.get("id") is None for r in reports for p in r["per_prompt"]):
        raise ValueError("pooled: a prompt has no id, so its runs cannot be matched; re-run eval")
    if not all(same_prompts(reports[0], r) for r in reports[1:]):  # the same ids, in order
        raise ValueError("pooled: the runs ran other prompts; pool only evals of the same prompts")
    prompts = []
    for runs in zip(*(r["per_prompt"] for r in reports), strict=True):
        lengths = [n for run in runs for n in run["acceptance_lengths"]]
        source = next((run["source"] for run in runs if run.get("source")), None)
        prompts.append({"id": runs[0]["id"], "source": source, "acceptance_lengths": lengths})
    steps = sum(len(p["acceptance_lengths"]) for p in prompts)
    tau = sum(sum(p["acceptance_lengths"]) for p in prompts) / steps if steps else 0.0
    return {"tau": tau, "per_prompt": prompts, "runs": len(reports)}


Reports = dict[str, Any] | list[dict[str, Any]]


def pooled_view(side: Reports, loops: bool = False) -> dict[str, Any] | None:
    """One report for one side of a ratio: the report itself, or a list of one recipe's
    runs `pooled`; with `loops`, over the text before the repetition loops (each run's
    `before_loops`, then pooled), None where a run has no per-prompt outputs."""
    runs = side if isinstance(side, list) else [side]
    if loops:
        cut = [before_loops(r) for r in runs]
        if any(r is None for r in cut):
            return None
        runs = [r for r in cut if r is not None]
    return runs[0] if len(runs) == 1 else pooled(runs)


def ratio_cell(
    mine: dict[str, Any], theirs: dict[str, Any], digits: int = 3, unpaired: str = "[no interval]"
) -> str:
    """tau(mine) / tau(theirs) with its 90% paired interval, or `unpaired` when there is
    none (the two ran other prompts, or a report predates per-prompt results)."""
    if not theirs["tau"]:
        return "—"
    interval = tau_ratio_interval(mine, theirs)
    bounds = unpaired if interval is None else f"[{interval[0]:.2f}-{interval[1]:.2f}]"
    return f"{mine['tau'] / theirs['tau']:.{digits}f} {bounds}".rstrip()


def paired_ratio_text(mine: Reports, theirs: Reports, before_loops_too: bool = True) -> str:
    """One line of the sessions' pairs files: tau / tau = ratio of two eval reports with its
    90% paired interval over whole sources ("[no interval]" when they ran other prompts),
    and with `before_loops_too` the same over the text before the repetition loops where
    both reports allow it. A list on either side is one recipe's seeds, `pooled`."""

    def ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
        return f"{a['tau']:.3f} / {b['tau']:.3f} = {ratio_cell(a, b)}"

    whole_mine, whole_theirs = pooled_view(mine), pooled_view(theirs)
    assert whole_mine is not None and whole_theirs is not None  # None only with loops
    text = ratio(whole_mine, whole_theirs)
    a, b = (
        (pooled_view(mine, True), pooled_view(theirs, True)) if before_loops_too else (None, None)
    )
    if a and b:
        text += f"; before loops {ratio(a, b)}"
    return text


def pairs_tables(recipes: dict[str, list[Path]], baseline: str, same_machine: bool = False) -> str:
    """`experiments/quality.py pairs`: each recipe's held-out tau over the baseline's, per kind, a
    recipe's runs (its seeds) `pooled` (the intervals then cover the prompts, not the
    seeds); at T = 0, again over the text before the loops, and at T = 1 where both ran it.
    `recipes`: name -> eval folders (KIND.json, KIND_t1.json); a recipe pools, per kind,
    the runs that evaluated it ("(n)": how many). Where a side has several runs, a last
    table gives each run over each baseline run, lowest and highest: the seeds' own spread,
    which the pooled intervals do not cover; then, per kind with loops, each recipe's reach
    per draft position before the loops and in them (`quality_positions`), and last each
    recipe's decode time per token over the baseline's where the evals allow it
    (`quality_speed`; `same_machine`: the caller vouches for reports without a device name)."""

    def read(path: Path) -> dict[str, Any]:
        try:
            report: dict[str, Any] = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"pairs: {path}: not an eval report ({err})") from None
        return report

    kinds_read = [k + suffix for k in KINDS for suffix in ("", "_t1")]
    loaded = {  # (recipe, kind) -> the reports of the runs that evaluated it, each read once
        (name, kind): [read(f / f"{kind}.json") for f in folders if (f / f"{kind}.json").is_file()]
        for name, folders in recipes.items()
        for kind in kinds_read
    }

    def view(name: str, kind: str, loops: bool) -> dict[str, Any] | None:
        runs = loaded[name, kind]
        try:
            return pooled_view(runs, loops) if runs else None
        except ValueError as err:
            folders = ", ".join(str(f) for f in recipes[name])
            raise ValueError(f"pairs: {name} ({folders}), {kind}: {err}") from None

    def table(title: str, suffix: str, loops: bool) -> str:
        kinds = [k for k in KINDS if any(loaded[n, k + suffix] for n in recipes)]
        if not kinds:
            return ""
        head = ["run"]
        for kind in kinds:
            head += [KIND_NAMES[kind], f"/ {baseline}"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in recipes:
            cells = [name]
            for kind in kinds:
                a, b = view(name, kind + suffix, loops), view(baseline, kind + suffix, loops)
                runs = len(loaded[name, kind + suffix])
                cells.append("—" if a is None else f"{a['tau']:.3f} ({runs})")
                if a is None or b is None or name == baseline:
                    cells.append("—")
                elif not same_prompts(a, b):  # as `compare`: no ratio of two prompt sets
                    cells.append("— (other prompts)")
                else:
                    cells.append(ratio_cell(a, b))
            lines.append("| " + " | ".join(cells) + " |")
        return f"\n{title}\n\n" + "\n".join(lines) + "\n"

    def run_by_run(suffix: str) -> str:
        """Each run of a recipe over each run of the baseline (its taus over the whole text):
        the lowest and highest of those ratios, what the seeds alone move on both sides."""
        kinds = [k for k in KINDS if any(len(loaded[n, k + suffix]) > 1 for n in recipes)]
        if not kinds:
            return ""
        head = ["run", *(f"{KIND_NAMES[k]}: lowest-highest" for k in kinds)]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in recipes:
            if name == baseline:
                continue
            cells = [name]
            for kind in kinds:
                mine, theirs = loaded[name, kind + suffix], loaded[baseline, kind + suffix]
                ratios = [  # only runs of the same prompts, as the tables above
                    a["tau"] / b["tau"]
                    for a in mine
                    for b in theirs
                    if b["tau"] and same_prompts(a, b)
                ]
                cells.append(
                    f"{min(ratios):.3f}-{max(ratios):.3f} ({len(ratios)})" if ratios else "—"
                )
            lines.append("| " + " | ".join(cells) + " |")
        title = f"Run by run{' at T = 1' if suffix else ''}: each run over each {baseline} run"
        return f"\n{title} (how many pairs of runs):\n\n" + "\n".join(lines) + "\n"

    return (
        table("Held-out tau, T = 0:", "", False)
        + table("Over the text before the outputs fall into a repetition loop:", "", True)
        + table("At T = 1 (rejection sampling):", "_t1", False)
        + run_by_run("")
        + run_by_run("_t1")
        + position_tables({k: {n: loaded[n, k] for n in recipes} for k in KINDS})
        + copy_tables({k: {n: loaded[n, k] for n in recipes} for k in KINDS})
        + speed_tables(
            {k: {n: loaded[n, k] for n in recipes} for k in kinds_read}, baseline, same_machine
        )
    )


def render_compare(rows: list[dict[str, Any]], peer: dict[str, Any] | None) -> str:
    """`compare_table` of the runs and the peer; when any output ends in a repetition loop
    (the target's own: easy to draft, it lifts tau), the same table again over the text
    before the loops (`before_loops`); and when any ran at T = 1 (rejection sampling,
    `KIND_t1.json`), the table of those evals."""
    return (
        _before_loops_tables(rows, peer) + _sampled_table(rows, peer) + position_table(rows, peer)
    )


POSITIONS = 8  # draft positions shown in `position_table`


def _chained_tau(conditional: list[float]) -> float:
    """tau from per-position conditional acceptance: 1 + sum over k of prod_{j <= k} c_j."""
    tau, reach = 1.0, 1.0
    for c in conditional:
        reach *= c
        tau += reach
    return tau


def position_table(rows: list[dict[str, Any]], peer: dict[str, Any] | None) -> str:
    """Where the acceptance differs, T = 0: per kind, each run's conditional acceptance at
    draft positions 1..8 (P(draft k accepted | drafts 1..k-1 were); a loss weighting that
    favours early positions shows as a higher first one and lower later ones), and with the
    peer, "mix": the tau of this run's first position chained with the peer's later ones
    (from the eval's `conditional_acceptance`): what the run would reach if its later
    positions matched the peer's."""
    table_rows = []
    for kind in KINDS:
        peer_eval = None if peer is None else peer["evals"].get(kind)
        theirs = (peer_eval or {}).get("conditional_acceptance")
        for row in [*rows, *([peer] if peer is not None else [])]:
            cond = (row["evals"].get(kind) or {}).get("conditional_acceptance")
            if not cond:
                continue
            mix = "—"
            if theirs and row is not peer and same_prompts(row["evals"][kind], peer_eval):
                mix = f"{_chained_tau(cond[:1] + theirs[1:]):.3f}"
            cells = [f"{c:.3f}" for c in cond[:POSITIONS]]
            cells += [""] * (POSITIONS - len(cells))
            table_rows.append([KIND_NAMES[kind], row["name"], *cells, mix])
    if not table_rows:
        return ""
    head = ["kind", "run", *(f"c{k}" for k in range(1, POSITIONS + 1)), "mix"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows]
    return (
        "\nConditional acceptance by draft position, T = 0 (c_k = P(draft k accepted | the"
        " ones before it were); mix: tau with this run's c1 and the peer's c2..):\n\n"
        + "\n".join(lines)
        + "\n"
    )


def _sampled_table(rows: list[dict[str, Any]], peer: dict[str, Any] | None) -> str:
    def sampled(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "evals": row.get("sampled") or {}}

    runs = [sampled(r) for r in rows]
    theirs = None if peer is None else sampled(peer)
    if not any(e for r in [*runs, theirs] if r for e in r["evals"].values()):
        return ""
    return "\nAt T = 1 (rejection sampling):\n\n" + compare_table(runs, theirs)


def _before_loops_tables(rows: list[dict[str, Any]], peer: dict[str, Any] | None) -> str:
    table = compare_table(rows, peer)

    def cut(row: dict[str, Any]) -> dict[str, Any]:
        views = {kind: before_loops(e) for kind, e in row["evals"].items()}
        return {
            **row,
            "evals": {k: None if v is None else {**v, "speedup": None} for k, v in views.items()},
        }

    cut_rows, cut_peer = [cut(r) for r in rows], None if peer is None else cut(peer)
    views = [e for r in [*cut_rows, cut_peer] if r for e in r["evals"].values() if e]
    if not any(e["loop_prompts"] for e in views):
        return table
    return (
        f"{table}\nOver the text before the outputs fall into a repetition loop (each prompt's"
        " verify steps that end before its loop starts; the loops are the target's own and"
        " any drafter accepts them whole):\n\n" + compare_table(cut_rows, cut_peer)
    )


def compare_table(rows: list[dict[str, Any]], peer: dict[str, Any] | None) -> str:
    """A markdown table of the runs (the keys where their recipes differ) and, when the peer
    ran, each run's tau over the peer's per kind (the goal: >= 1.05) with its 90%
    paired bootstrap interval over the prompts."""
    recipes = [r["recipe"] for r in rows if r["recipe"]]  # a run not started has none
    keys = sorted({k for rec in recipes for k in rec})
    differ = [k for k in keys if len({json.dumps(rec.get(k)) for rec in recipes}) > 1]
    head = ["run", "differs", "steps", "ms/step", *(KIND_NAMES[k] for k in KINDS)]
    if peer is not None:
        head += [f"/ peer, {KIND_NAMES[k]}" for k in KINDS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cells(row: dict[str, Any], is_peer: bool) -> list[str]:
        what = "; ".join(f"{k}={row['recipe'].get(k)}" for k in differ) or "—"
        if not row["recipe"]:
            what = "(no train record)"
        if is_peer:
            what = row["recipe"]["recipe"]
        ms = "—" if row["step_ms"] is None else f"{row['step_ms']:.1f}"
        out = [row["name"], what, str(row["steps"] or "—"), ms]
        for kind in KINDS:
            e = row["evals"].get(kind)
            if e is None or e.get("tau") is None:
                out.append("—")
            else:
                speedup = f" ({e['speedup']:.2f}x)" if e.get("speedup") else ""
                out.append(f"{e['tau']:.3f}{speedup}")
        if peer is not None:
            for kind in KINDS:
                mine, theirs = row["evals"].get(kind), peer["evals"].get(kind)
                if is_peer or not mine or not theirs or not theirs.get("tau"):
                    out.append("—")
                elif not same_prompts(mine, theirs):
                    out.append("— (other prompts)")  # a ratio of two prompt sets means nothing
                else:
                    out.append(ratio_cell(mine, theirs, 2, unpaired=""))
        return out

    for row in rows:
        lines.append("| " + " | ".join(cells(row, False)) + " |")
    if peer is not None:
        lines.append("| " + " | ".join(cells(peer, True)) + " |")
    return "\n".join(lines) + "\n"
