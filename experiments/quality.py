"""The reference SmolLM2-135M recipe (docs/reference-recipe.md), reproduced by one command.

    python experiments/quality.py all                          # GPU: data -> train -> eval -> report
    python experiments/quality.py all --deadline 540           # one device call; run again to go on
    python experiments/quality.py train --run layers5 --set drafter.num_layers=5   # an ablation
    python experiments/quality.py all --smoke --output /tmp/q  # CPU, tiny sizes, ~2 minutes

The first line is the shipped drafter's recipe (run `l7x6`, 7 x 352, 24.25 MB: 13,878 steps
in 907 s of `train` stages, 15.1 GPU-minutes on one H100, run with `--set eval.every=0`; the
first line adds the preset's in-training evals; benchmarks/quality_h100_20261206_s45.md).
The lines that reproduce earlier shipped drafters (`i704a2k6`; `ref6` and `p704ft2`: 5 layers
deep, so they set `drafter.*`) and ablations are in the README's reference-recipe section,
where tests/test_quality_bench.py parses and checks every one.

Stages, in order; each skips when its output is complete (a marker in OUT/stages/ records
the settings it was made with), so the pipeline can span several device calls:

  build-prompts  `flashdraft.data.sources`: chat turns, HumanEval, code mined from the
                 installed Python sources, split into train and held-out by source before
                 anything else (OUT/prompts/split.json lists every held-out source)
  generate       the target's answers to the first --prompts train prompts: one greedy pass
                 and --samples sampled ones (OUT/gen/), in chunks of --gen-chunk prompts
  prepare        the answers -> the prepared, audited dataset OUT/data
  train          the `smollm2-135m` preset (+ --set) as a `flashdraft train` process in
                 OUT/runs/RUN; under --deadline it is stopped just after a checkpoint and
                 resumed by the next call, so the schedule is the one of an unbroken run;
                 with --prune-from it starts from that run's export pruned to --prune-width
                 (experiments/prune_mlp.py, OUT/runs/RUN.init)
  eval           held-out prompts per kind (chat, humaneval, code): tau, per-position
                 acceptance, the lossless check, speedup (CUDA), and z-lab's reference loop
                 on the export when the `dflash` package is installed
  report         the table, and benchmarks/quality_<hw>_<yyyymmdd>.md with a
                 tau-vs-training-tokens plot from the in-training evals (metrics.jsonl)

Reading stages (finished runs, no GPU): `compare`, `curves`, `pairs` (`--help` says what
each prints; the README shows each). Prints the table, then one JSON line.

The modules beside it: quality_config.py (these options), quality_pipeline.py (the stages),
quality_supervise.py (training under --deadline), quality_eval.py (the eval passes),
quality_report.py (one run's report), quality_compare.py (several runs side by side),
zlab_parity.py (z-lab's loop).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from quality_compare import pairs_tables, peer_row, render_compare, run_row  # beside this script
from quality_config import SMOKE, STAGES, QualityConfig
from quality_pipeline import Pipeline
from quality_report import (
    CURVE_MEASURES,
    collect,
    curve_measure,
    estimate_windows,
    hardware_name,
    plot_curves,
    read_metrics,
    render_curves,
    write_quality_report,
)

from flashdraft import config as cfg
from flashdraft.benchutil import environment, print_json
from flashdraft.data.sources import KINDS
from flashdraft.log import get_logger

log = get_logger("bench.quality")


def parse(argv: list[str] | None = None) -> tuple[str, QualityConfig, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "stage",
        choices=(*STAGES, "all", "compare", "curves", "pairs"),
        help="one stage, or all in order; compare: finished runs (and the peer's) side by "
        "side; curves: the training tau_hat of runs, finished or not, at matched steps; "
        "pairs: recipes over a baseline, each the pool of its runs (seeds)",
    )
    cfg.add_arguments(parser, QualityConfig)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the run config (repeatable), e.g. --set drafter.num_layers=5",
    )
    args = parser.parse_args(argv)
    config: QualityConfig = cfg.from_args(QualityConfig, args)
    if config.smoke:
        config = dataclasses.replace(config, **SMOKE)  # type: ignore[arg-type]
    return args.stage, config, args.overrides


def reading_output(config: QualityConfig, stage: str) -> tuple[Path, dict[str, Any], str]:
    """Where a reading stage (compare, curves, pairs) writes, BENCH_DIR/quality_<hw>_<date>_
    <stage> without a suffix, the environment it records and the command line that ran."""
    env = environment()
    bench = Path(config.bench_dir or "benchmarks")
    bench.mkdir(parents=True, exist_ok=True)
    stem = bench / f"quality_{hardware_name(env)}_{env['date'].replace('-', '')}_{stage}"
    return stem, env, " ".join(["python", *sys.argv])


def compare(config: QualityConfig) -> dict[str, Any]:
    """The `compare` stage: OUT's runs and the peer's run as one table, printed and written to
    BENCH_DIR/quality_<hw>_<date>_compare.md."""
    out = Path(config.output)
    names = config.runs or sorted(
        p.name for p in (out / "runs").iterdir() if p.is_dir() and not p.name.startswith("peer-")
    )
    rows = [run_row(out, name) for name in names]
    peer = peer_row(Path(config.peer) if config.peer else out / "runs" / "peer-speculators")
    table = render_compare(rows, peer)
    stem, env, command = reading_output(config, "compare")
    md = Path(f"{stem}.md")
    md.write_text(
        f"# Runs side by side: held-out tau ({env['date']})\n\nCommand: `{command}`  \n"
        f"Commit `{env.get('commit')}`; every run of `{out}`, same data and eval.\n\n{table}"
    )
    log.info(table)
    log.info(f"written: {md}")
    return {"complete": True, "stage": "compare", "runs": names, "peer": peer is not None}


def curves(config: QualityConfig) -> dict[str, Any]:
    """The `curves` stage: the training estimate tau_hat of runs side by side at matched
    steps (windows of --window steps), the first run the baseline; for runs that stopped
    before their evals (a lost machine) or beside finished ones. Printed and written to
    BENCH_DIR/quality_<hw>_<date>_curves.md with a PNG. tau_hat is measured on the training
    rows, so it says which recipe learns its data faster, not what held-out tau will be.
    Peer runs (experiments/peer_recipe.py) log speculators' `eal` instead, on its own anchors:
    curves compares peer runs with each other, and refuses to mix the two measures."""
    out = Path(config.output)
    folders: dict[str, Path] = {}
    found = sorted(p.parent.name for p in (out / "runs").glob("*/metrics.jsonl"))
    for entry in config.runs or found:
        name, sep, folder = entry.partition("=")
        path = Path(folder) if sep else out / "runs" / name
        if sep and (Path(name) / "metrics.jsonl").is_file() and not path.is_dir():
            raise ValueError(
                f"curves: --runs {entry!r}: the name comes first, as in pairs: "
                f"{folder}={name} (DIR=NAME until s41)"
            )
        folders[name] = path
        if not (path / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{path / 'metrics.jsonl'}: no metrics for run {entry!r}")
    if not folders:
        raise FileNotFoundError(f"{out / 'runs'}: no run with a metrics.jsonl; pass --runs")
    metrics = {name: read_metrics(path) for name, path in folders.items()}
    # A run lost before its first record has no measure yet: it shows dashes.
    measures = {name: curve_measure(rows) for name, rows in metrics.items() if rows}
    for name, measure in measures.items():
        if measure is None:
            raise ValueError(
                f"{folders[name] / 'metrics.jsonl'}: run {name!r} logs no training estimate "
                f"({' or '.join(CURVE_MEASURES)}); curves reads flashdraft and peer runs"
            )
    key = next(iter(measures.values()), "tau_hat")
    if len(set(measures.values())) > 1:
        mixed = ", ".join(f"{n}: {CURVE_MEASURES[m]}" for n, m in measures.items())
        raise ValueError(
            f"curves: the runs log different training estimates ({mixed}), measured on "
            "different anchors: compare flashdraft runs or peer runs, not both at once"
        )
    table = render_curves(estimate_windows(metrics, config.window, key))
    stem, env, command = reading_output(config, "curves")
    Path(f"{stem}.png").write_bytes(plot_curves(metrics, key))
    Path(f"{stem}.md").write_text(
        f"# Training {key} at matched steps ({env['date']})\n\nCommand: `{command}`  \n"
        f"{CURVE_MEASURES[key]}, means over windows of {config.window} steps; the last "
        f"columns: each run over the first. ![{key}]({stem.name}.png)\n\n{table}"
    )
    log.info(table)
    log.info(f"written: {stem}.md")
    return {"complete": True, "stage": "curves", "runs": list(folders)}


def eval_folders(entry: str, paths: str) -> list[Path]:
    """The eval folders of one `pairs` recipe: each DIR (comma-separated, so a path may not
    hold a comma) is a run folder (DIR/eval) or an eval folder itself, holding at least one
    held-out report (KIND.json or KIND_t1.json); a folder given twice is refused (it would
    count as two seeds)."""
    folders: list[Path] = []
    names = [f"{k}{t}.json" for k in KINDS for t in ("", "_t1")]
    for text in filter(None, paths.split(",")):
        path = Path(text)
        folder = path / "eval" if (path / "eval").is_dir() else path
        if not any((folder / name).is_file() for name in names):
            raise ValueError(
                f"pairs: {entry!r}: {text} holds no held-out eval report ({', '.join(names)})"
            )
        if folder.resolve() in {f.resolve() for f in folders}:
            raise ValueError(f"pairs: {entry!r} names {text} twice (one run, not two seeds)")
        folders.append(folder)
    if not folders:
        raise ValueError(f"pairs: {entry!r} names no folder; give NAME=DIR[,DIR...]")
    return folders


def pairs(config: QualityConfig) -> dict[str, Any]:
    """The `pairs` stage: recipes side by side, each the pool of its runs (seeds), over a
    baseline (--peer, else the first --runs entry), per kind with paired intervals over
    whole sources; printed and written to BENCH_DIR/quality_<hw>_<date>_pairs.md."""
    recipes: dict[str, list[Path]] = {}
    for entry in config.runs:
        name, sep, paths = entry.partition("=")
        if not sep or not name:
            raise ValueError(f"pairs: --runs takes NAME=DIR[,DIR...] (got {entry!r})")
        if name in recipes or (name == "peer" and config.peer):
            raise ValueError(f"pairs: the name {name!r} is taken twice (--peer is 'peer')")
        recipes[name] = eval_folders(entry, paths)
    if not recipes:
        raise ValueError("pairs: give the recipes as --runs NAME=DIR[,DIR...] ...")
    baseline = next(iter(recipes))
    if config.peer:
        baseline = "peer"
        recipes = {"peer": eval_folders(f"--peer {config.peer}", config.peer), **recipes}
    table = pairs_tables(recipes, baseline, config.same_machine)
    stem, env, command = reading_output(config, "pairs")
    md = Path(f"{stem}.md")
    listing = "".join(
        f"* {name}: " + ", ".join(f"`{f}`" for f in folders) + "\n"
        for name, folders in recipes.items()
    )
    md.write_text(
        f"# Recipes over `{baseline}`, runs pooled ({env['date']})\n\nCommand: `{command}`  \n"
        f"Commit `{env.get('commit')}`. Each recipe pools its runs per prompt; the 90% "
        "intervals resample whole sources, so they cover the prompts, not the seeds.\n\n"
        f"{listing}{table}"
    )
    log.info(table)
    log.info(f"written: {md}")
    return {"complete": True, "stage": "pairs", "runs": list(recipes), "baseline": baseline}


def run(stage: str, config: QualityConfig, overrides: list[str]) -> dict[str, Any]:
    """The stages asked for, in order; stops early (complete = False) at the deadline."""
    if stage == "compare":
        return compare(config)
    if stage == "pairs":
        return pairs(config)
    if stage == "curves":
        return curves(config)
    pipeline = Pipeline(config, overrides)
    if pipeline.device == "cpu":
        # The smoke run shares a small machine (tests): one thread, as the test suite uses;
        # OpenMP threads spinning against other processes slow small ops down ~100x.
        threads = 1 if config.smoke else os.cpu_count() or 1
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the `flashdraft train` process too
    wanted = STAGES if stage == "all" else (stage,)
    complete = True
    for name in wanted:
        log.info(f"\n== {name} ==")
        started = time.perf_counter()
        if name == "build-prompts":
            pipeline.build_prompts()
        elif name == "generate":
            complete = pipeline.generate()
        elif name == "prepare":
            pipeline.prepare()
        elif name == "train":
            complete = pipeline.train()
        elif name == "eval":
            complete = pipeline.eval()
        else:
            env = environment()
            bench = Path(config.bench_dir or (pipeline.out if config.smoke else "benchmarks"))
            md, png, _ = write_quality_report(
                pipeline.out, config.run, bench, env, " ".join(["python", *sys.argv])
            )
            log.info(md.read_text())
            log.info(f"written: {md} {png}")
        # each stage's time, also when it had nothing to do: a device call's start-up, by part
        log.info(f"== {name}: {time.perf_counter() - started:.1f} s")
        if not complete:
            log.info(f"{name}: not complete; run the same command again to continue")
            break
    summary = collect(pipeline.out, config.run)
    evals = summary["evals"]
    return {
        "complete": complete,
        "stage": stage,
        "run": config.run,
        "tau": {k: r["tau"] for k, r in evals.items() if r is not None},
        "speedup": {k: r.get("speedup") for k, r in evals.items() if r is not None},
        "tau_t1": {k: r["tau"] for k, r in summary["sampled"].items() if r is not None},
    }


def main(argv: list[str] | None = None) -> int:
    stage, config, overrides = parse(argv)
    try:
        result = run(stage, config, overrides)
    except ValueError as err:
        log.error(f"experiments/quality.py: error: {err}")
        return 2
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
