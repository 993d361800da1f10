"""The reference recipe side by side with a peer's: speculators' DFlash.

Trains speculators 0.9.0's `DFlashDraftModel` (vLLM project) with speculators' own loss and
its recommended optimizer, learning rate and schedule, on exactly what flashdraft's
`smollm2-135m` run trains on: the same prepared dataset, the same packed rows in the same
order (flashdraft's row stream), the same target run online through flashdraft's `Target`
hooks (the same taps), the same drafter geometry (layers, width, block size, taps, mask
token) and the same number of steps. The result is exported to the dflash format and
measured with the held-out loop `experiments/quality.py`'s eval stage runs.

    python experiments/peer_recipe.py --data OUT/data --eval-prompts OUT/prompts/held_out/*.jsonl \\
        --output OUT/runs/peer-speculators               # GPU: SmolLM2, the preset's steps
    python experiments/peer_recipe.py --smoke --target TINY --output /tmp/p  # CPU, ~1 minute

speculators' settings are not copied here: they are read from its own config schema
(`TrainConfig(speculator_type="dflash")`, the defaults of `speculators train`), and only what
must match the flashdraft run is overridden (geometry, anchors per row, row length, steps;
the report lists each override). The step is run as speculators' `Trainer.train_epoch` runs
it; where its conventions differ from flashdraft's (anchors, labels, loss weighting and
normalisation, optimizer, layer ids) speculators' are kept for the model, loss and optimizer
and flashdraft's for the data and features, and the report lists each under "caveats".

Outputs in OUTPUT: `speculators/` (speculators' own `save_pretrained` layout), `export/`
(the dflash export, written and reload-checked by flashdraft's exporter), `eval/<name>.json`
per prompt file, `metrics.jsonl`, `run_config.json` (the flashdraft side) and `report.json`.
Prints a table, then one JSON line. Needs speculators 0.9.0 importable (dev/gpu/peers_wheels.sh).
Beside it: peer_config.py (the options, speculators' settings, the caveats) and peer_state.py
(the training state saved at --deadline and every --save-every steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from peer_config import (  # beside this script
    SETTINGS,
    SMOKE_PROMPTS,
    SMOKE_RECORDS,
    SPECULATORS,
    PeerRecipeConfig,
    build_optimizers,
    build_peer_model,
    caveats,
    peer_overrides,
    run_config,
    speculators_settings,
)
from peer_state import load_progress, save_progress
from quality_report import add_sources, write_spread_subset

from flashdraft import assets, storage
from flashdraft import config as cfg
from flashdraft.benchutil import environment, free_memory, print_json, print_table
from flashdraft.data.dataset import MANIFEST
from flashdraft.data.prepare import prepare
from flashdraft.data.prepare_config import PrepareConfig
from flashdraft.eval.evaluate import EvalConfig, load_eval_target, run_eval
from flashdraft.eval.report import write_report
from flashdraft.export import load_dflash, load_exported, save_export
from flashdraft.log import get_logger
from flashdraft.model.attention import default_backend
from flashdraft.model.config import DrafterConfig
from flashdraft.model.target import LayerTaps
from flashdraft.train.checkpoint import load_drafter
from flashdraft.train.config import RunConfig
from flashdraft.train.features import device_put, load_run_target
from flashdraft.train.parallel import init_distributed
from flashdraft.train.plan import RunPlan, plan_run
from flashdraft.train.stopping import StopRequest

log = get_logger("bench.peer_recipe")

# ---- training: flashdraft's rows and taps, speculators' step -----------------------------


def write_metrics(out: Path, history: list[dict[str, Any]]) -> None:
    """OUT/metrics.jsonl: one record per logged step (`elapsed_s`: seconds in the training
    loop over all of the run's calls, the first step's compile included), rewritten whole at
    each save, a stop for --deadline included, and at the end."""
    storage.write_text_atomic(
        str(out / "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in history)
    )


def train_peer(
    plan: RunPlan,
    model: Any,
    flat: dict[str, Any],
    config: PeerRecipeConfig,
    settings: dict[str, Any],
    sigterm: StopRequest,
) -> dict[str, Any] | None:
    """`plan.total_steps` steps of speculators' DFlash on flashdraft's packed rows: the target
    runs each row through flashdraft's `Target` (its K taps, as the trainer feeds them), plus
    one hook on the last decoder layer for speculators' label source."""
    from speculators.models.dflash import DFlashDraftModel

    run, device = plan.config, plan.info.device
    optimizers, schedulers = build_optimizers(model, flat, plan.total_steps)
    resume = Path(config.output) / "resume"
    done = load_progress(resume, settings, model, optimizers, schedulers)
    target = load_run_target(plan, default_backend(device))  # taps verified, compiled on CUDA
    # speculators' `verifier_last_hidden_states`: the last decoder layer's output before the
    # final norm (vLLM's captured last layer; the model applies the verifier's norm itself).
    last_layer = LayerTaps(target.model, [target.num_layers - 1])
    autocast = device.type == "cuda"  # bf16 autocast on CUDA as every trainer runs; fp32 on CPU
    # cli.py l. 740: the model's call kwargs (loss, weighting, anchors) from the flat settings.
    train_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(**flat)
    put = device_put(device)
    # The rows after the ones trained in earlier calls (grad_accum rows per step).
    start = done["step"] if done else 0
    resumed_after = [*(done or {}).get("resumed_after", []), *([start] if start else [])]
    after = itertools.islice(plan.positions(0), start * run.optim.grad_accum, None)
    rows = plan.stream.iterate(after, run.data.prefetch)
    model.train()
    history: list[dict[str, Any]] = list(done["history"]) if done else []
    interval: dict[str, Any] = {}
    tokens = done["tokens"] if done else 0
    earlier_s = done["train_s"] if done else 0.0
    started = time.perf_counter()
    agreement = done["label_agreement"] if done else None
    for step in range(start + 1, plan.total_steps + 1):
        row = next(rows)
        ids, positions, docs = put(row.input_ids), put(row.position_ids), put(row.doc_ids)
        # flashdraft's labels only for the first row: the check of speculators' label source.
        where = put(row.label_positions) if step == 1 else None
        features = target.packed_outputs(ids, positions, docs, where, run.loss.chunk_rows)
        batch = {
            "hidden_states": features.features,  # [1, T, K*H], flashdraft's taps
            "input_ids": ids,
            "loss_mask": put(row.loss_mask),
            "verifier_last_hidden_states": last_layer.features(),  # [1, T, H]
            "document_ids": docs,
            "position_ids": positions,
        }
        if where is not None:
            agreement = label_agreement(model, batch, features.next_tokens, where, row, autocast)
        # speculators/train/trainer.py l. 539-568: autocast forward, zero_grad, backward,
        # clip 1.0, every optimizer, then every scheduler.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, loss, metrics = model(**batch, **train_kwargs)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = optimizers[0].param_groups[0]["lr"]
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
        tokens += row.tokens
        for key in ("loss", "full_acc", "eal"):
            pair = torch.stack([metrics[f"{key}_sum"].detach(), metrics[f"{key}_total"]])
            interval[key] = interval.get(key, 0) + pair.double()
        if step % config.log_every == 0 or step == plan.total_steps:
            sums = {k: v.tolist() for k, v in interval.items()}  # host sync, once per record
            record = {
                "step": step,
                "loss": sums["loss"][0] / sums["loss"][1],
                "acc": sums["full_acc"][0] / max(sums["full_acc"][1], 1.0),
                "eal": sums["eal"][0] / max(sums["eal"][1], 1.0),
                "lr": lr,
                "tokens": tokens,
                "elapsed_s": round(earlier_s + time.perf_counter() - started, 2),
            }
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"speculators' loss is {record['loss']} at step {step}")
            history.append(record)
            interval = {}
            log.info(
                f"step {step}/{plan.total_steps}: loss {record['loss']:.4f} "
                f"acc {record['acc']:.3f} eal {record['eal']:.3f} lr {lr:.2e}"
            )
            # The first log record at or after each multiple of --save-every saves too.
            due = config.save_every and step % config.save_every < config.log_every
            # SIGTERM (`timeout`, `kill`, a preemption) saves at this record as well
            asked = sigterm.requested
            stop = step < plan.total_steps and (asked or out_of_time(config, SAVE_S))
            if stop or (due and step < plan.total_steps):
                progress = {
                    "settings": settings,
                    "step": step,
                    "resumed_after": resumed_after,
                    "tokens": tokens,
                    "train_s": round(earlier_s + time.perf_counter() - started, 1),
                    "label_agreement": agreement,
                    "history": history,
                }
                save_progress(resume, progress, model, optimizers, schedulers)
                # The curve so far beside it: a run stopped for good (a lost machine) still
                # has its measured steps and step times where the results are collected.
                write_metrics(Path(config.output), history)
            if stop:
                log.info(
                    f"step {step}/{plan.total_steps}: stopped for "
                    f"{'SIGTERM' if asked else '--deadline'}, state in {resume};"
                    " run the same command again to go on"
                )
                rows.close()
                last_layer.remove()
                return None
    rows.close()  # stops the row builder thread
    last_layer.remove()
    del target
    return {
        "steps": plan.total_steps,
        "label_agreement": agreement,
        "tokens": tokens,
        "train_s": round(earlier_s + time.perf_counter() - started, 1),
        "resumed_after": resumed_after,
        "history": history,
    }


# ---- stopping and resuming (--deadline) ------------------------------------------------------

# Seconds kept back at a deadline for saving the training state / for one eval file.
SAVE_S, EVAL_S = 20.0, 75.0
STARTED = time.monotonic()  # --deadline counts from here (import time: start-up included)


def out_of_time(config: PeerRecipeConfig, keep: float) -> bool:
    """Whether --deadline leaves less than `keep` seconds."""
    return config.deadline is not None and time.monotonic() - STARTED > config.deadline - keep


def label_agreement(
    model: Any, batch: dict[str, Any], ours: Any, where: Any, row: Any, autocast: bool
) -> float:
    """Share of a row's block slots (at flashdraft's valid anchors) where speculators' label
    source, argmax(verifier_lm_head(verifier_norm(h_last))) with the tables its own loader
    read from the target's files, equals flashdraft's target argmax: 1.0 unless bf16 ties."""
    last = batch["verifier_last_hidden_states"][0, where[0].flatten()]  # [A*(B-1), H]
    device = last.device
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        theirs = model.verifier_lm_head(model.verifier_norm(last)).argmax(-1)
    same = (theirs.view(ours.shape[1:]) == ours[0])[row.anchor_valid.to(device)]
    return float(same.float().mean())  # host sync, once


# ---- export and eval -----------------------------------------------------------------------


def export(model: Any, out: Path, drafter: DrafterConfig) -> dict[str, Any]:
    """speculators' own checkpoint (`save_pretrained`), read back by flashdraft's loader and
    written as the dflash export (reload-checked by `save_export`)."""
    peer_dir, dflash_dir = out / "speculators", out / "export"
    model.save_pretrained(str(peer_dir))
    loaded = load_exported(str(peer_dir), torch.float32, drafter.num_target_layers)
    if loaded.config != drafter:
        diff = {
            f.name: (getattr(loaded.config, f.name), getattr(drafter, f.name))
            for f in dataclasses.fields(DrafterConfig)
            if getattr(loaded.config, f.name) != getattr(drafter, f.name)
        }
        raise ValueError(f"speculators' checkpoint reads back as another drafter: {diff}")
    save_export(loaded, str(dflash_dir), "dflash", overwrite=True)
    # The two layouts hold the same bf16 weights (the engines serve either).
    a, b = load_exported(str(peer_dir)).state_dict(), load_dflash(str(dflash_dir)).state_dict()
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {"speculators_dir": str(peer_dir), "dflash_dir": str(dflash_dir), "same_weights": same}


def evaluate(
    config: PeerRecipeConfig, target: str, drafter_dir: Path, device: str
) -> dict[str, dict[str, Any]] | None:
    """Each prompt file through the held-out eval of experiments/quality.py's eval stage, on the
    prompts that stage picks (`--eval-limit` of them spread over their sources, not the
    file's first ones: `compare` pairs the two runs prompt by prompt); a file an earlier call
    evaluated is read back; None when --deadline stopped it before the last."""
    out: dict[str, dict[str, Any]] = {}
    loaded: tuple[Any, Any] | None = None
    for held_out in config.eval_prompts:
        name = Path(held_out).stem
        prompts = Path(config.output) / "prompts" / f"{name}_{config.eval_limit}.jsonl"
        done = Path(config.output) / "eval" / f"{name}.json"
        if done.exists():
            out[name] = {**summary(json.loads(done.read_text())), "report": str(done)}
            continue
        if out_of_time(config, EVAL_S):
            log.info(f"eval {name}: stopped for --deadline; run the same command again")
            return None
        write_spread_subset(Path(held_out), prompts, config.eval_limit)
        eval_config = EvalConfig(
            target=target,
            drafter=str(drafter_dir),
            prompts=str(prompts),
            output=str(Path(config.output) / "eval" / f"{name}.json"),
            max_new_tokens=config.eval_max_new_tokens,
            limit=config.eval_limit,
            device=device,
        )
        if loaded is None:
            loaded = load_eval_target(eval_config)
        report = run_eval(eval_config, *loaded, load_drafter(str(drafter_dir)))
        add_sources(report, prompts)  # the paired interval draws whole sources
        write_report(report, eval_config.output)
        log.info(f"eval {name}: tau {report['tau']:.3f} on {report['num_prompts']} prompts")
        out[name] = {**summary(report), "report": eval_config.output}
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """What the result keeps of one eval report."""
    keys = ("tau", "speedup", "per_position_acceptance", "num_prompts", "lossless_prompts")
    return {k: report.get(k) for k in keys}


# ---- smoke inputs ------------------------------------------------------------------------


def smoke_inputs(out: Path, target: str) -> tuple[str, str, list[str]]:
    """(target, prepared data, eval prompt files) for `--smoke`: the given small target (the
    tests pass a tiny random Qwen3 with the real Qwen3 tokenizer), real chitchat
    conversations prepared with its tokenizer, and others as held-out prompts."""
    root = out / "smoke"
    records = assets.chitchat_conversations(SMOKE_RECORDS + SMOKE_PROMPTS, seed=1)
    lines = [json.dumps(r) + "\n" for r in records]
    source, prompts = root / "train.jsonl", root / "held_out.jsonl"
    storage.write_text_atomic(str(source), "".join(lines[:SMOKE_RECORDS]))
    storage.write_text_atomic(str(prompts), "".join(lines[SMOKE_RECORDS:]))
    data = root / "data"
    if not (data / MANIFEST).exists():
        result = prepare(
            PrepareConfig(
                inputs=[str(source)],
                tokenizer=str(target),
                output=str(data),
                workers=1,
                preview=0,
                progress=False,
                overwrite=True,
            )
        )
        if not result.ok:
            raise RuntimeError(f"--smoke: preparing {data} failed: {result.manifest}")
    return str(target), str(data), [str(prompts)]


def parse(argv: list[str] | None = None) -> PeerRecipeConfig:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cfg.add_arguments(parser, PeerRecipeConfig)
    try:
        config: PeerRecipeConfig = cfg.from_args(PeerRecipeConfig, parser.parse_args(argv))
    except ValueError as err:
        parser.error(str(err))
    if config.smoke:
        steps = config.steps or 8
        config = dataclasses.replace(
            config, device="cpu", steps=steps, log_every=1, eval_limit=2, eval_max_new_tokens=16
        )
    return dataclasses.replace(config, output=str(Path(config.output).resolve()))


def train_stage(
    config: PeerRecipeConfig, run: RunConfig, plan: RunPlan, flat: dict[str, Any]
) -> dict[str, Any] | None:
    """Train and export, or read what an earlier call with the same settings did (OUT/train.json:
    a device call that ran out of time in the eval goes on with the eval). None when
    --deadline stopped the training (OUT/resume holds its state)."""
    out = Path(config.output)
    settings = {"run": run.to_dict(), "speculators": {k: flat.get(k) for k in SETTINGS}}
    marker = out / "train.json"
    if marker.exists():
        done = json.loads(marker.read_text())
        if json.dumps(done["settings"], sort_keys=True) != json.dumps(settings, sort_keys=True):
            raise ValueError(
                f"{out} was trained with other settings or data: choose another --output"
            )
        log.info(f"{marker}: trained already ({done['steps']} steps), evaluating its export")
        return dict(done)
    model = build_peer_model(flat, plan.drafter_config, plan.info.device)
    c = plan.drafter_config
    log.info(
        f"speculators {metadata.version('speculators')}: DFlashDraftModel, {c.num_hidden_layers}"
        f" layers, taps {c.target_layer_ids}, {plan.total_steps} steps of one "
        f"{run.data.row_tokens}-token row"
    )
    with StopRequest() as sigterm:  # SIGTERM saves the state as --deadline does
        trained = train_peer(plan, model, flat, config, settings, sigterm)
    if trained is None:  # stopped for --deadline or SIGTERM: the state is in OUT/resume
        return None
    trained["export"] = export(model, out, c)
    del model
    free_memory()
    write_metrics(out, trained["history"])
    storage.write_json_atomic(str(marker), {"settings": settings, **trained})
    for left in ("resume", "resume.new", "resume.old"):  # an earlier call's state: used up
        shutil.rmtree(out / left, ignore_errors=True)
    return trained


def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    device = "cuda" if cuda else "cpu"
    if config.smoke:  # a small shared machine: one thread, as the test suite uses
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
        if config.target is None:
            raise SystemExit("--smoke needs --target: a small model directory (a few layers)")
        target, data, prompts = smoke_inputs(Path(config.output), config.target)
        config = dataclasses.replace(config, eval_prompts=config.eval_prompts or prompts)
    else:
        assert config.data is not None
        target, data = config.target or str(assets.smollm2_path()), config.data

    run = run_config(config, data, target, device)
    plan = plan_run(run, init_distributed(run.device), resume=False)  # writes run_config.json
    flat = speculators_settings()
    defaults = dict(flat)
    overrides = peer_overrides(config, run, plan.drafter_config, plan.info.device)
    flat.update(overrides)
    trained = train_stage(config, run, plan, flat)
    evals = None
    if trained is not None:
        evals = evaluate(config, target, Path(trained["export"]["dflash_dir"]), device)
    if trained is None or evals is None:
        print_json({"bench": "peer_recipe", "complete": False, "output": config.output})
        return 0

    history = trained["history"]
    result = {
        "bench": "peer_recipe",
        "complete": True,
        "peer": "speculators",
        "peer_version": metadata.version("speculators"),
        "peer_version_expected": SPECULATORS,
        "data": data,
        "target": target,
        "smoke": config.smoke,
        "steps": trained["steps"],
        "tokens": trained["tokens"],
        "train_s": trained["train_s"],
        "resumed_after": trained.get("resumed_after", []),
        "label_agreement": trained["label_agreement"],
        "loss_first": history[0]["loss"],
        "loss_last": history[-1]["loss"],
        "acc_first": history[0]["acc"],
        "acc_last": history[-1]["acc"],
        "speculators_settings": {k: flat.get(k) for k in SETTINGS},
        "speculators_defaults_overridden": {
            k: {"default": defaults.get(k), "used": v}
            for k, v in overrides.items()
            if defaults.get(k) != v
        },
        "drafter": dataclasses.asdict(plan.drafter_config),
        "export": trained["export"],
        "eval": evals,
        "caveats": caveats(flat, run),
        **environment(),
    }
    storage.write_json_atomic(
        str(Path(config.output) / "report.json"), {**result, "history": history}
    )
    table = [
        {"prompts": name, "tau": round(e["tau"] or 1.0, 3), "speedup": e["speedup"] or "-"}
        for name, e in evals.items()
    ]
    if table:
        print_table(table, ["prompts", "tau", "speedup"])
    else:
        log.info("no --eval-prompts: the export was not evaluated")
    log.info(
        f"speculators {result['peer_version']}: {result['steps']} steps, loss "
        f"{result['loss_first']:.4f} -> {result['loss_last']:.4f}, acc {result['acc_first']:.3f}"
        f" -> {result['acc_last']:.3f}, label agreement {result['label_agreement']}, "
        f"{result['train_s']} s; caveats:"
    )
    for line in result["caveats"]:
        log.info(f"  * {line}")
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
