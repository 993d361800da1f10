"""The report of `experiments/quality.py`: the table of the reference recipe's held-out results and
benchmarks/quality_<hw>_<yyyymmdd>.md with its tau-vs-training-tokens PNG.

Everything is read back from the pipeline's output directory (`collect`): the split manifest,
the stage markers, the prepared dataset's manifest, the run's metrics.jsonl (in-training
evals: `eval.every`) and the held-out eval reports; what is missing shows as not measured.
"""

from __future__ import annotations

import io
import json
import random
import statistics
from pathlib import Path
from typing import Any

from flashdraft import storage
from flashdraft.data.sources import KINDS

# `experiments/quality.py --loops`: where each setting's prepared data and its stage marker live
PREPARED = {"keep": ("data", "prepare"), "untrain": ("data-loops", "prepare-loops")}
KIND_NAMES = {"chat": "chat", "humaneval": "code: HumanEval", "code": "code: mined Python"}


def cluster_ratio_interval(
    clusters: list[tuple[float, float, float, float]], *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """A 90% bootstrap interval of (sum a / sum b) / (sum c / sum d) over `clusters` of (a, b,
    c, d), e.g. a conversation's accepted tokens and verify steps on two sides: each resample
    draws as many clusters as there are, with replacement (so the interval covers whole
    sources); a draw where b, c or d sums to 0 is left out; None when none is left. The
    paired tau intervals of `pairs` and its speed table both read it."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        draw = [clusters[rng.randrange(len(clusters))] for _ in clusters]
        a, b = sum(g[0] for g in draw), sum(g[1] for g in draw)
        c, d = sum(g[2] for g in draw), sum(g[3] for g in draw)
        if b and c and d:
            ratios.append((a / b) / (c / d))
    if not ratios:
        return None
    ratios.sort()
    return ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios)) - 1]


GOALS = {"chat": "≥ 3.0", "humaneval": "≥ 3.5", "code": "—"}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl by step (a resumed run's repeated steps: the last line wins)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def tau_curve(
    metrics: list[dict[str, Any]],
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """([(training tokens, in-training eval tau)], [(training tokens, tau_hat)]): tokens are
    the packed-row tokens of every step up to that record."""
    evals, estimates, tokens = [], [], 0
    for record in metrics:
        tokens += int(record.get("tokens", 0))
        if "eval_tau" in record:
            evals.append((tokens, float(record["eval_tau"])))
        if "tau_hat" in record:
            estimates.append((tokens, float(record["tau_hat"])))
    return evals, estimates


def collect(out: Path, run: str) -> dict[str, Any]:
    """Everything the report shows, read from the output directory (missing parts: None)."""
    run_dir = out / "runs" / run

    def read(path: Path) -> Any:
        return json.loads(path.read_text()) if path.exists() else None

    stages = out / "stages"
    train = read(stages / f"train-{run}.json")
    # the data the run trained on: data/ or, prepared with --loops untrain, data-loops/
    datasets = ((train or {}).get("settings", {}).get("run", {}).get("data", {})).get("datasets")
    data = Path(datasets[0]).name if datasets else PREPARED["keep"][0]
    marker = dict(PREPARED.values()).get(data, PREPARED["keep"][1])
    prepared_from = read(stages / f"{marker}.json")
    if prepared_from is not None:  # the passes the data was prepared from, not every marker
        generated = {k: v for k, v in prepared_from["settings"].items() if isinstance(v, dict)}
    else:
        generated = {
            p.stem.removeprefix("generate-"): read(p)
            for p in sorted(stages.glob("generate-*.json"))
        }
    # A run started from another run's pruned export (--prune-from): that run's training
    # is part of the recipe's time.
    prune = read(stages / f"prune-{run}.json")
    source = None
    if prune is not None:
        source = prune.get("source_run") or Path(str(prune.get("drafter", ""))).parent.name
    return {
        "prune": prune,
        "source": source,
        "source_train": read(stages / f"train-{source}.json") if source else None,
        "split": read(out / "prompts" / "split.json"),
        "generated": generated,
        "prepared": read(out / data / "manifest.json"),
        "train": train,
        "metrics": read_metrics(run_dir),
        "evals": {k: read(run_dir / "eval" / f"{k}.json") for k in KINDS},
        "sampled": {k: read(run_dir / "eval" / f"{k}_t1.json") for k in KINDS},
        "trained": {k: read(run_dir / "eval" / f"{k}_trained.json") for k in KINDS},
        "run": run,
    }


def _tau(report: dict[str, Any] | None) -> str:
    if report is None or report.get("tau") is None:
        return "not measured"
    text = f"{report['tau']:.3f} ({report['num_prompts']} prompts"
    if report.get("loop_prompts"):  # the target's own repetition loops lift tau
        before = report.get("tau_before_loops")
        text += f"; {report['loop_prompts']} end in a loop: " + (
            f"{before:.3f} before the loops" if before is not None else "no steps before them"
        )
    return text + ")"


def _tokens(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _per_kind(evals: dict[str, Any], fmt: Any) -> str:
    parts = [f"{k} {fmt(r)}" for k, r in evals.items() if r is not None]
    return ", ".join(parts) if parts else "not measured"


def _whole_blocks(parity: dict[str, Any]) -> str:
    """What experiments/zlab_parity.py found on the steps that draft a whole block (z-lab's loop
    shortens the last blocks before the length limit), where a run recorded it."""
    whole = parity.get("whole_blocks")
    if whole is None:
        return ""
    verdict = "identical" if whole["identical"] else "NOT identical"
    return f" (whole-block steps {verdict}: {whole['steps']})"


def render(summary: dict[str, Any], env: dict[str, Any], command: str) -> str:
    """The markdown of benchmarks/quality_<hw>_<date>.md."""
    evals = {k: r for k, r in summary["evals"].items() if r is not None}
    speed = _per_kind(
        evals, lambda r: f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "n/a (CPU)"
    )
    # fp32 parity runs carry their own flashdraft tau; older reports compared the bf16 eval's
    parity = {
        k: {"eval_tau": r["tau"], **r["zlab_reference"]}
        for k, r in evals.items()
        if r.get("zlab_reference", {}).get("tau")
    }
    zlab = _per_kind(
        parity,
        lambda z: f"{z['tau'] / z.get('flashdraft_tau', z['eval_tau']):.3f}{_whole_blocks(z)}",
    )
    numerics = "fp32" if all("flashdraft_tau" in z for z in parity.values()) else "bf16 eval"
    sampled = _per_kind(
        {k: r for k, r in summary["sampled"].items() if r is not None},
        lambda r: f"{r['tau']:.3f}",
    )
    hardware = env.get("gpu") or f"CPU ({env.get('cpu', '?')}, {env.get('threads', '?')} threads)"
    lines = [
        f"# Reference recipe, SmolLM2-135M drafter: held-out quality ({hardware}, {env['date']})",
        "",
        f"Command: `{command}`  ",
        f"Commit `{env['commit']}`, torch {env['torch']}, transformers {env['transformers']}, "
        f"Python {env['python']}; run `runs/{summary['run']}`.",
        "",
        "| held-out, T=0, B=16, SmolLM2-135M target | flashdraft | goal |",
        "|---|---|---|",
        *(f"| tau, {KIND_NAMES[k]} | {_tau(summary['evals'][k])} | {GOALS[k]} |" for k in KINDS),
        f"| speedup vs the target alone | {speed} | ≥ 2.0x |",
        f"| z-lab's reference loop tau / `flashdraft eval` tau ({numerics}) | {zlab} | within 2% |",
        "| flashdraft tau / peer recipe tau, same data and steps | not run | ≥ 1.05 |",
        f"| T = 1, rejection sampling: tau | {sampled} | reported |",
        "",
    ]
    trained = {k: r for k, r in summary["trained"].items() if r is not None}
    if trained:
        # A kind evaluated on trained prompts only (its held-out eval not run): no ratio.
        fit = ", ".join(
            f"{k} {r['tau']:.2f} / "
            + (f"{evals[k]['tau']:.2f}" if k in evals else "held-out not measured")
            for k, r in trained.items()
        )
        lines += [
            f"Fit check, tau on prompts the drafter trained on / held-out (T = 0): {fit}. Far "
            "above held-out: the data is too narrow (more and more varied prompts); near or "
            "below it: the drafter underfits (more steps, a deeper drafter).",
            "",
        ]
    if evals:
        lines += ["Per-position acceptance (draft 1..8) and the lossless check (T = 0):", ""]
        lines += ["| kind | " + " | ".join(str(i) for i in range(1, 9)) + " | lossless |"]
        lines += ["|---" * 10 + "|"]
        for kind, r in evals.items():
            acc = [f"{x:.2f}" for x in r["per_position_acceptance"][:8]]
            acc += [""] * (8 - len(acc))
            lossless = f"{r.get('lossless_prompts', '?')}/{r['num_prompts']}"
            if r.get("near_tie_prompts"):
                lossless += f" +{r['near_tie_prompts']} ties"
            if r.get("unexplained_mismatch_prompts"):
                lossless += f", {r['unexplained_mismatch_prompts']} UNEXPLAINED"
            lines.append(f"| {KIND_NAMES[kind]} | " + " | ".join(acc) + f" | {lossless} |")
        lines.append("")
    lines += _training_lines(summary) + _data_lines(summary)
    return "\n".join(lines) + "\n"


def _recipe_lines(summary: dict[str, Any]) -> list[str]:
    """For a run started from another run's pruned export: that run's and the prune's time,
    and the whole recipe's."""
    prune, source = summary.get("prune"), summary.get("source")
    if not prune or not source:
        return []
    own = float((summary["train"] or {}).get("seconds", 0.0))
    before = summary.get("source_train") or {}
    earlier = float(before.get("seconds", 0.0))
    cut = float(prune.get("seconds", 0.0))
    total = own + earlier + cut
    status = "" if before.get("finished") else " (NOT finished)"
    return [
        f"Started from `{source}`'s export with its MLPs pruned to {prune.get('width')} "
        f"neurons ({cut:.0f} s); `{source}` took {earlier:.0f} s of `flashdraft train`"
        f"{status}: the whole recipe {total:.0f} s ({total / 60:.1f} min) of training and "
        "pruning.  "
    ]


def _training_lines(summary: dict[str, Any]) -> list[str]:
    metrics, train = summary["metrics"], summary["train"] or {}
    if not metrics:
        return ["Training: not run.", ""]
    last = metrics[-1]
    tokens = sum(int(r.get("tokens", 0)) for r in metrics)
    evals, _ = tau_curve(metrics)
    curve = ", ".join(f"{_tokens(t)}: {tau:.2f}" for t, tau in evals) or "none"
    status = "finished" if train.get("finished") else "NOT finished"
    return [
        f"Training ({status}): {last['step']} steps, {_tokens(tokens)} packed-row tokens, "
        f"{train.get('seconds', 0.0):.0f} s of `flashdraft train` over all calls (start-up and "
        f"compilation included); last logged loss {last['loss']:.3f}, tau_hat "
        f"{last['tau_hat']:.2f}.  ",
        *_recipe_lines(summary),
        f"In-training eval tau (held-out chat and HumanEval prompts, alternating) by training "
        f"tokens: {curve}.",
        "",
        "![tau vs training tokens](PLOT)",
        "",
    ]


def _data_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    split = summary["split"]
    if split is not None:
        seed = split["settings"]["seed"]
        parts = [
            f"{k} {c['train_prompts']:,} / {c['held_out_prompts']:,} "
            f"({c['held_out_sources']:,} of {c['sources']:,} sources held out)"
            for k, c in split["counts"].items()
        ]
        lines.append(
            f"Prompts, train / held-out, split by source (seed {seed}): " + "; ".join(parts) + ".  "
        )
    for name, marker in summary["generated"].items():
        s = marker["settings"]
        lines.append(
            f"Generated `{name}`: {s['prompts']:,} prompts, T = {s['sampling']['temperature']}, "
            f"up to {s['sampling']['max_new_tokens']} new tokens, {marker.get('seconds', 0):.0f} s.  "
        )
    prepared = summary["prepared"]
    if prepared is not None:
        c = prepared["counts"]
        lines.append(
            f"Prepared: {c['samples']:,} samples, {_tokens(c['tokens'])} tokens, "
            f"{_tokens(c['loss_tokens'])} trained ({c['rejected']:,} rejected"
            + (
                f"; {_tokens(c['loop_untrained'])} loop tokens untrained, `--loops untrain`"
                if c.get("loop_untrained")
                else ""
            )
            + ")."
        )
    return lines


def plot(summary: dict[str, Any]) -> bytes:
    """PNG: in-training eval tau and the training estimate tau_hat vs training tokens, and
    the final held-out tau per kind at the end."""
    ax = _axes()
    evals, estimates = tau_curve(summary["metrics"])
    if estimates:
        x, y = zip(*estimates, strict=True)
        ax.plot([t / 1e6 for t in x], y, "--", color="#999999", label="tau_hat (training rows)")
    if evals:
        x, y = zip(*evals, strict=True)
        ax.plot([t / 1e6 for t in x], y, "o-", label="eval tau (held-out, in training)")
    end = (estimates or evals or [(0, 0.0)])[-1][0] / 1e6
    for (kind, report), marker in zip(summary["evals"].items(), "s^D", strict=False):
        if report is not None and report.get("tau") is not None:
            ax.plot([end], [report["tau"]], marker, label=f"final: {KIND_NAMES[kind]}")
    ax.set_xlabel("training tokens (millions, packed rows)")
    ax.set_ylabel("tau (accepted + 1 per step)")
    ax.set_title(f"SmolLM2-135M reference drafter ({summary['run']})")
    return _png(ax)


def _axes() -> Any:
    """One matplotlib Axes on its own figure (no pyplot: no global backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=120)
    FigureCanvasAgg(fig)
    return fig.add_subplot(1, 1, 1)


def _png(ax: Any) -> bytes:
    """The Axes' figure as PNG bytes, with a grid and a legend when something is labelled."""
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig = ax.get_figure()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


# The training estimate of tau a metrics.jsonl logs: flashdraft's `tau_hat`, or `eal`
# (speculators' expected acceptance length at its own anchors) for a peer run.
CURVE_MEASURES = {"tau_hat": "flashdraft's tau_hat", "eal": "speculators' eal"}


def curve_measure(rows: list[dict[str, Any]]) -> str | None:
    """The key of the training estimate these metrics records log (CURVE_MEASURES), or None."""
    return next((key for key in CURVE_MEASURES if any(key in r for r in rows)), None)


def estimate_windows(
    metrics: dict[str, list[dict[str, Any]]], every: int, key: str = "tau_hat"
) -> list[tuple[int, dict[str, float | None]]]:
    """[(window end, {run: mean KEY of its records in (end - every, end]})]: the training
    estimate of runs at matched steps, whether they finished or not (`curves`)."""
    last = max((int(r["step"]) for rows in metrics.values() for r in rows), default=0)
    windows = []
    for end in range(every, last + every, every):
        means: dict[str, float | None] = {}
        for run, rows in metrics.items():
            taus = [float(r[key]) for r in rows
                    if key in r and end - every < int(r["step"]) <= end]  # fmt: skip
            means[run] = statistics.fmean(taus) if taus else None
        windows.append((end, means))
    return windows


def render_curves(windows: list[tuple[int, dict[str, float | None]]]) -> str:
    """The tau_hat windows as a table, each run also over the first run (the baseline)."""
    runs = list(windows[0][1]) if windows else []
    head = ["steps", *runs, *(f"{r} / {runs[0]}" for r in runs[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for end, means in windows:
        base = means[runs[0]]
        cells = [f"{means[r]:.3f}" if means[r] is not None else "—" for r in runs]
        for r in runs[1:]:
            value = means[r]
            cells.append(f"{value / base:.3f}" if value is not None and base else "—")
        lines.append(f"| {end} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(metrics: dict[str, list[dict[str, Any]]], key: str = "tau_hat") -> bytes:
    """PNG: the training estimate KEY vs steps, one line per run."""
    ax = _axes()
    for run, rows in metrics.items():
        points = [(int(r["step"]), float(r[key])) for r in rows if key in r]
        if points:
            x, y = zip(*points, strict=True)
            ax.plot(x, y, linewidth=0.8, label=run)
    ax.set_xlabel("training steps")
    ax.set_ylabel(f"{key} (training rows)")
    return _png(ax)


def hardware_name(env: dict[str, Any]) -> str:
    """ "h200" for an NVIDIA H200, "cpu" without a GPU."""
    gpu = env.get("gpu")
    return gpu.lower().replace("nvidia", "").strip().split()[0] if gpu else "cpu"


def write_quality_report(
    out: Path, run: str, bench_dir: Path, env: dict[str, Any], command: str
) -> tuple[Path, Path, dict[str, Any]]:
    """Write benchmarks/quality_<hw>_<yyyymmdd>.md (`_<run>` added for runs other than the
    reference) and its PNG; returns both and the summary."""
    summary = collect(out, run)
    stem = f"quality_{hardware_name(env)}_{env['date'].replace('-', '')}"
    stem += "" if run == "reference" else f"_{run}"  # ablations beside the reference run
    bench_dir.mkdir(parents=True, exist_ok=True)
    md, png = bench_dir / f"{stem}.md", bench_dir / f"{stem}.png"
    png.write_bytes(plot(summary))
    md.write_text(render(summary, env, command).replace("(PLOT)", f"({png.name})"))
    return md, png, summary


# ---- the eval's prompt selection (the eval stage's and the peer recipe's) ----


def write_spread_subset(source: Path, out: Path, n: int) -> None:
    """`n` records of `source` taken round-robin over their `source` field, in file order
    within each (the first record of every source, then the second, ...), kept in that
    order; records without one count as their own source."""
    by_source: dict[str, list[str]] = {}
    with open(source) as f:
        for index, line in enumerate(f):
            if line.strip():
                key = json.loads(line).get("source") or f"#{index}"
                by_source.setdefault(key, []).append(line if line.endswith("\n") else line + "\n")
    picked: list[str] = []
    depth = 0
    while len(picked) < n and any(len(lines) > depth for lines in by_source.values()):
        picked += [lines[depth] for lines in by_source.values() if len(lines) > depth]
        depth += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    storage.write_text_atomic(str(out), "".join(picked[:n]))


def add_sources(report: dict[str, Any], prompts: Path) -> None:
    """Each per-prompt result of `report` gets its prompt record's `source` (matched by id)."""
    sources = {}
    with open(prompts) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                sources[str(record.get("id"))] = record.get("source")
    for result in report.get("per_prompt") or []:
        if sources.get(result.get("id")) is not None:
            result["source"] = sources[result["id"]]
