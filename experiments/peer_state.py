"""The peer recipe's training state on disk (`--deadline`, `--save-every`): the trainable
weights, every optimizer's tensors and every generator's state in safetensors, the rest in
JSON, nothing pickled; swapped in whole, so a call killed while saving keeps the last one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from flashdraft import storage
from flashdraft.log import get_logger
from flashdraft.train.checkpoint import rng_state, set_rng_state

log = get_logger("bench.peer_recipe")


def save_progress(
    folder: Path, progress: dict[str, Any], model: Any, optimizers: list[Any], schedulers: list[Any]
) -> None:
    """The training state after `progress["step"]` steps: the trainable weights, every
    optimizer's tensors and every generator's state in safetensors, the rest in JSON
    (nothing pickled). Written into FOLDER.new, then swapped in: a call killed while saving
    leaves the earlier state whole (`load_progress` also reads FOLDER.old, where a kill
    between the two renames leaves it)."""
    final, folder = folder, folder.with_name(folder.name + ".new")
    shutil.rmtree(folder, ignore_errors=True)
    tensors = {f"model.{k}": p.detach() for k, p in model.named_parameters() if p.requires_grad}
    meta: dict[str, Any] = {"optimizers": [], "schedulers": [s.state_dict() for s in schedulers]}
    for i, optimizer in enumerate(optimizers):
        state = optimizer.state_dict()
        plain: dict[str, dict[str, Any]] = {}
        for pid, values in state["state"].items():
            for key, value in values.items():
                if torch.is_tensor(value):
                    tensors[f"opt{i}.{pid}.{key}"] = value
                else:
                    plain.setdefault(str(pid), {})[key] = value
        meta["optimizers"].append({"param_groups": state["param_groups"], "plain": plain})
    meta["rng"], rng = rng_state()  # flashdraft's checkpoint: Python, NumPy, torch CPU + CUDA
    tensors.update({f"rng.{k}": v for k, v in rng.items()})
    storage.write_tensors(str(folder / "state.safetensors"), tensors)
    storage.write_json_atomic(str(folder / "optim.json"), meta)
    storage.write_json_atomic(str(folder / "progress.json"), progress)
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    folder.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_progress(
    folder: Path,
    settings: dict[str, Any],
    model: Any,
    optimizers: list[Any],
    schedulers: list[Any],
) -> dict[str, Any] | None:
    """Put back what `save_progress` left in `folder` (None when nothing is there); refuses a
    state saved with other settings."""
    if not folder.exists() and folder.with_name(folder.name + ".old").exists():
        folder = folder.with_name(folder.name + ".old")  # killed between save's two renames
    marker = folder / "progress.json"
    if not marker.exists():
        return None
    progress: dict[str, Any] = json.loads(marker.read_text())
    if json.dumps(progress["settings"], sort_keys=True) != json.dumps(settings, sort_keys=True):
        raise ValueError(
            f"{folder} holds a run with other settings or data: delete it or "
            "choose another --output"
        )
    tensors = storage.read_tensors(str(folder / "state.safetensors"))
    meta = json.loads((folder / "optim.json").read_text())
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[f"model.{name}"])
    for i, (optimizer, saved) in enumerate(zip(optimizers, meta["optimizers"], strict=True)):
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith(f"opt{i}."):
                pid, name = key[len(f"opt{i}.") :].split(".", 1)
                state.setdefault(int(pid), {})[name] = value
        for pid, values in saved["plain"].items():
            state.setdefault(int(pid), {}).update(values)
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
    for scheduler, saved in zip(schedulers, meta["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    set_rng_state(meta["rng"], {k[4:]: v for k, v in tensors.items() if k.startswith("rng.")})
    log.info(f"{folder}: resuming after step {progress['step']} ({progress['train_s']} s so far)")
    return progress
