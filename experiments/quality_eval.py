"""`experiments/quality.py`'s eval stage: each pass of a finished run (the held-out prompts per
kind at T = 0 and T = 1, and the trained-on prompts, the fit check) as `flashdraft eval`
runs it, in one process that loads the target once. A pass is skipped when its marker
records the same settings and its report exists, and starts only when --deadline leaves
what it may need (`eval_seconds`); the prompt files it reads are written once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from quality_report import add_sources, write_spread_subset  # beside this script
from zlab_parity import zlab_parity

from flashdraft import storage
from flashdraft.eval.evaluate import EvalConfig, load_eval_target, run_eval
from flashdraft.eval.report import write_report
from flashdraft.log import get_logger
from flashdraft.train.checkpoint import load_drafter

if TYPE_CHECKING:
    from quality_pipeline import Pipeline

log = get_logger("bench.quality")


def digest(obj: Any) -> str:
    """A short digest of a JSON value, its keys sorted: how markers compare settings."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# What an eval pass needs of --deadline before it starts: with the target not loaded yet,
# the load and the first compiled graphs (EVAL_COLD_S); after a pass, half again the longest
# pass of this process (no less than EVAL_WARM_MIN_S). s31 lost mined Python to a fixed
# 120 s: 88 s were left after HumanEval's pass, which took ~25 s.
EVAL_COLD_S = 120.0
EVAL_WARM_MIN_S = 30.0


def eval_seconds(loaded: bool, longest: float) -> float:
    """The seconds of --deadline an eval pass asks for before it starts."""
    return max(EVAL_WARM_MIN_S, 1.5 * longest) if loaded else EVAL_COLD_S


class EvalPass(NamedTuple):
    """One eval of a finished run: its report name, prompt file, temperature, and whether the
    prompts are held out (else trained on: the fit check)."""

    name: str
    prompts: Path
    temperature: float
    held_out: bool


def run_evals(pipeline: Pipeline) -> bool:
    """True when every kind is evaluated; False when the deadline stopped it."""
    export = pipeline.run_dir / "export"
    train = pipeline.marker(f"train-{pipeline.config.run}")
    loaded: tuple[Any, Any] | None = None
    held_out = {
        kind: held_out_subset(pipeline, kind)
        for kind in {*pipeline.config.eval_kinds, *pipeline.config.eval_sampled_kinds}
    }
    passes = [
        EvalPass(kind, held_out[kind], 0.0, held_out=True) for kind in pipeline.config.eval_kinds
    ]
    passes += [
        EvalPass(f"{kind}_t1", held_out[kind], 1.0, held_out=True)
        for kind in pipeline.config.eval_sampled_kinds
    ]
    for kind in pipeline.config.eval_trained_kinds:
        trained = trained_prompts(pipeline, kind)
        if trained is not None:
            passes.append(EvalPass(f"{kind}_trained", trained, 0.0, held_out=False))
    longest = 0.0  # the longest pass of this process so far, seconds
    for one in passes:
        name = one.name
        report_path = pipeline.run_dir / "eval" / f"{name}.json"
        settings = {
            "prompts": pipeline.config.eval_prompts,
            "selection": "spread over sources",  # was: the file's first N (2026-12-02)
            "max_new_tokens": pipeline.config.eval_max_new_tokens,
            "train": digest(train),
        }
        marker = pipeline.marker(f"eval-{pipeline.config.run}-{name}")
        if marker is not None and marker["settings"] == settings and report_path.exists():
            continue
        if not pipeline.enough_time(f"eval {name}", eval_seconds(loaded is not None, longest)):
            return False
        config = EvalConfig(
            target=pipeline.target,
            drafter=str(export),
            prompts=str(one.prompts),
            output=str(report_path),
            max_new_tokens=pipeline.config.eval_max_new_tokens,
            temperature=one.temperature,
            limit=pipeline.config.eval_prompts,
            device=pipeline.device,
            reference=one.held_out,  # the speedup and lossless check: held-out only
        )
        if loaded is None:
            loaded = load_eval_target(config)
        model, tokenizer = loaded
        began = time.monotonic()
        report = run_eval(config, model, tokenizer, load_drafter(str(export)))
        add_sources(report, one.prompts)  # the bootstrap resamples whole sources
        # parity with z-lab's loop on the held-out T = 0 evals (at T = 1 the loops sample),
        # on 4 prompts: exact agreement needs no more, and both loops are eager there
        parity = None
        if one.held_out and one.temperature == 0 and pipeline.config.zlab_parity:
            limit = min(4, pipeline.config.eval_prompts)
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
        longest = max(longest, time.monotonic() - began)
        log.info(f"eval {name}: tau {report['tau']:.3f} on {report['num_prompts']} prompts")
        pipeline.save_marker(f"eval-{pipeline.config.run}-{name}", settings)
    return True


def held_out_subset(pipeline: Pipeline, kind: str) -> Path:
    """The --eval-prompts held-out prompts of `kind`, spread over their sources (written
    once): the held-out file lists a conversation's turns together, so its first 24
    chat prompts came from 8 conversations (of 30), 9 of them from one."""
    source = pipeline.out / "prompts" / "held_out" / f"{kind}.jsonl"
    out = pipeline.out / "prompts" / "eval" / f"{kind}_{pipeline.config.eval_prompts}.jsonl"
    if not out.exists():
        write_spread_subset(source, out, pipeline.config.eval_prompts)
    return out


def trained_prompts(pipeline: Pipeline, kind: str) -> Path | None:
    """The first --eval-prompts prompts of `kind` that the greedy pass answered (so the
    drafter trained on their answers), written once; None when there are none."""
    out = pipeline.out / "prompts" / "trained" / f"{kind}_{pipeline.config.eval_prompts}.jsonl"
    answered = pipeline.out / "gen" / "greedy.prompts.jsonl"
    if not out.exists() and answered.exists():
        picked: list[str] = []
        with open(answered) as f:
            for line in f:
                if len(picked) == pipeline.config.eval_prompts:
                    break
                if json.loads(line).get("kind") == kind:
                    picked.append(line)
        if picked:
            storage.write_text_atomic(str(out), "".join(picked))
    return out if out.exists() else None
