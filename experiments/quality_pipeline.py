"""The stages of `experiments/quality.py` over one output directory (`Pipeline`): build-prompts,
generate, prepare, train, eval. Each skips when its marker in OUT/stages/ records the same
settings, and stops where the next call can go on when --deadline would be overrun; the
training process under --deadline and the eval passes are `quality_supervise` and
`quality_eval`, the report stage and the readings of several runs are `quality_report` and
`quality_compare`."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from quality_config import SMOKE_RUN, SMOKE_SOURCES, STAGES, QualityConfig  # beside this script
from quality_eval import digest, run_evals
from quality_report import PREPARED
from quality_supervise import supervise_resuming

from flashdraft import assets, storage
from flashdraft import config as cfg
from flashdraft.benchutil import free_memory
from flashdraft.data.generate import GenerateConfig, generate, open_backend
from flashdraft.data.inference import Sampling
from flashdraft.data.prepare import prepare
from flashdraft.data.prepare_config import PrepareConfig
from flashdraft.data.sources import TRAIN_FILE, SourcesConfig, build_prompts
from flashdraft.data.template import TemplateOptions
from flashdraft.log import get_logger
from flashdraft.train.checkpoint import complete_checkpoints
from flashdraft.train.config import RunConfig
from flashdraft.train.presets import smollm2_135m

log = get_logger("bench.quality")


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


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
            free_memory()
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
                script = str(Path(__file__).resolve().with_name("quality.py"))
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
                f"(python experiments/quality.py all --run {c.prune_from})"
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
        if marker is not None and digest(marker["settings"]) != digest(settings):
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
        """True when every kind is evaluated; False when the deadline stopped it
        (`quality_eval.run_evals`)."""
        return run_evals(self)


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
