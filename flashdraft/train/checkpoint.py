"""Resumable training state, kept apart from serving exports (STYLE: two kinds, never mixed).

A run directory (any fsspec URL) holds

    checkpoints/step_00000100/
        drafter.safetensors     fp32 master weights, serving names (no prefixes)
        drafter_config.json     DrafterConfig.to_dict()
        optimizer.safetensors   optimizer tensors (exp_avg, exp_avg_sq, step) by parameter name
        rng.safetensors         torch CPU / CUDA generator states
        state.json              step, data cursor, scheduler, optimizer hyper-parameters, RNG
        COMPLETE                written last: a directory without it is ignored
    export/                     the serving-format drafter written at the end
    best/                       the best-by-eval-tau serving export (when eval is on)

Nothing here unpickles: tensors go through safetensors, everything else is JSON.
"""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from flashdraft import storage
from flashdraft.export import load_exported
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(run: str, step: int) -> str:
    return storage.join(run, CHECKPOINTS, f"step_{step:08d}")


def complete_checkpoints(run: str) -> list[tuple[int, str]]:
    """(step, url) of every complete checkpoint of a run, oldest first."""
    root = storage.join(run, CHECKPOINTS)
    if not storage.exists(root):
        return []
    fs, path = storage.filesystem(root)
    found = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        match = _STEP_DIR.match(name)
        if match and fs.exists(f"{entry.rstrip('/')}/{COMPLETE}"):
            found.append((int(match.group(1)), storage.join(root, name)))
    return sorted(found)


def latest_checkpoint(run: str) -> str | None:
    found = complete_checkpoints(run)
    return found[-1][1] if found else None


def save_drafter(url: str, drafter: DFlashDrafter) -> None:
    """The drafter part of a checkpoint: fp32 weights + its config."""
    _write_drafter(url, drafter.state_dict(), drafter.config)


def _write_drafter(url: str, weights: dict[str, Tensor], config: DrafterConfig) -> None:
    storage.write_tensors(storage.join(url, "drafter.safetensors"), weights)
    storage.write_json_atomic(storage.join(url, "drafter_config.json"), config.to_dict())


def is_training_checkpoint(url: str) -> bool:
    return storage.exists(storage.join(url, "drafter_config.json"))


def load_drafter(url: str, num_target_layers: int | None = None) -> DFlashDrafter:
    """A drafter from a training checkpoint, a run directory (its latest complete
    checkpoint) or an exported directory (dflash or speculators layout; ours or a published
    z-lab drafter). `num_target_layers` only completes a speculators config that lacks it."""
    if not is_training_checkpoint(url):
        # A run directory also holds a config.json (its run config): checkpoints first.
        latest = latest_checkpoint(url)
        if latest is None and storage.exists(storage.join(url, "config.json")):
            return load_exported(url, dtype=torch.float32, num_target_layers=num_target_layers)
        if latest is None:
            raise FileNotFoundError(
                f"{url} is neither a serving-format drafter (config.json), a training "
                "checkpoint (drafter_config.json) nor a run directory with a complete checkpoint"
            )
        url = latest
    config = DrafterConfig.from_dict(storage.read_json(storage.join(url, "drafter_config.json")))
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(storage.read_tensors(storage.join(url, "drafter.safetensors")))
    return drafter


def rng_state() -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Every RNG the run touches: Python, NumPy, torch CPU and CUDA (JSON + tensors)."""
    py = random.getstate()
    np_state: Any = np.random.get_state()
    meta = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    return meta, tensors


def set_rng_state(meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])


def save_checkpoint(
    run: str,
    step: int,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
    is_main: bool,
) -> str | None:
    """Write a complete resumable checkpoint; every rank must call (state gathering may need
    collectives under FSDP), rank 0 writes. Returns the checkpoint URL on rank 0.

    Written into `step_N/`, with `COMPLETE` last: a crash mid-write leaves a directory that
    `latest_checkpoint` ignores, never one that looks valid.
    """
    # No cpu_offload: with it only global rank 0 receives the state, but the writer is the
    # first drafter replica, which in the split placement is not rank 0.
    options = StateDictOptions(full_state_dict=True)
    # The DCP helpers return loosely typed nested dicts; we only store tensors and JSON.
    model_sd: dict[str, Tensor] = dict(get_model_state_dict(drafter, options=options))  # type: ignore[arg-type]
    optim_sd: Any = get_optimizer_state_dict(drafter, optimizer, options=options)
    if not is_main:
        return None
    url = step_dir(run, step)
    if storage.exists(url):  # a stale, incomplete attempt at this step
        fs, path = storage.filesystem(url)
        fs.rm(path, recursive=True)
    storage.makedirs(url)
    config = getattr(drafter, "config", None)
    assert isinstance(config, DrafterConfig)
    _write_drafter(url, model_sd, config)
    tensors = {
        f"{name}/{key}": value
        for name, entry in optim_sd["state"].items()
        for key, value in entry.items()
        if isinstance(value, Tensor)
    }
    storage.write_tensors(storage.join(url, "optimizer.safetensors"), tensors)
    rng_meta, rng_tensors = rng_state()
    storage.write_tensors(storage.join(url, "rng.safetensors"), rng_tensors)
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}
        for group in optim_sd["param_groups"]
    ]
    full_state = {**state, "step": step, "rng": rng_meta, "optimizer_param_groups": groups}
    storage.write_json_atomic(storage.join(url, "state.json"), full_state)
    storage.write_text_atomic(storage.join(url, COMPLETE), f"{step}\n")
    for _, old in complete_checkpoints(run)[: -max(keep, 1)]:
        fs, path = storage.filesystem(old)
        fs.rm(path, recursive=True)
    return url


def load_checkpoint(
    url: str, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore drafter, optimizer and RNG from a complete checkpoint (every rank reads it)."""
    if not storage.exists(storage.join(url, COMPLETE)):
        raise ValueError(f"{url} is not a complete checkpoint (no {COMPLETE} marker)")
    state = dict(storage.read_json(storage.join(url, "state.json")))
    options = StateDictOptions(full_state_dict=True)
    weights: Any = storage.read_tensors(storage.join(url, "drafter.safetensors"))
    set_model_state_dict(drafter, weights, options=options)
    flat = storage.read_tensors(storage.join(url, "optimizer.safetensors"))
    per_param: Any = {}
    for key, value in flat.items():
        name, _, field_name = key.rpartition("/")
        per_param.setdefault(name, {})[field_name] = value
    groups = [
        {k: (tuple(v) if k == "betas" else v) for k, v in group.items()}
        for group in state.pop("optimizer_param_groups")
    ]
    set_optimizer_state_dict(
        drafter,
        optimizer,
        {"state": per_param, "param_groups": groups},
        options=options,
    )
    set_rng_state(state.pop("rng"), storage.read_tensors(storage.join(url, "rng.safetensors")))
    return state
