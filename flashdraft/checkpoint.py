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

import os
import re
import tempfile
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from flashdraft import storage
from flashdraft.config import DrafterConfig
from flashdraft.drafter import DFlashDrafter

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


def save_tensors(url: str, tensors: dict[str, Tensor]) -> None:
    """safetensors to any URL (written locally first: safetensors needs a real file)."""
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "t.safetensors")
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, local)
        with open(local, "rb") as f:
            storage.write_bytes_atomic(url, f.read())


def load_tensors(url: str) -> dict[str, Tensor]:
    if storage.is_local(url):
        return load_file(storage.filesystem(url)[1])
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "t.safetensors")
        with storage.open_url(url, "rb") as src, open(local, "wb") as dst:
            dst.write(src.read())
        return load_file(local)


def save_drafter(url: str, drafter: DFlashDrafter) -> None:
    """The drafter part of a checkpoint: fp32 weights + its config."""
    save_tensors(storage.join(url, "drafter.safetensors"), drafter.state_dict())
    storage.write_json_atomic(storage.join(url, "drafter_config.json"), drafter.config.to_dict())


def is_training_checkpoint(url: str) -> bool:
    return storage.exists(storage.join(url, "drafter_config.json"))


def load_drafter(url: str, num_target_layers: int | None = None) -> DFlashDrafter:
    """A drafter from a training checkpoint, a run directory (its latest complete
    checkpoint) or an exported directory (dflash or speculators layout; ours or a published
    z-lab drafter). `num_target_layers` only completes a speculators config that lacks it."""
    from flashdraft.export import load_exported

    if storage.exists(storage.join(url, "config.json")):
        return load_exported(url, dtype=torch.float32, num_target_layers=num_target_layers)
    if not is_training_checkpoint(url):
        latest = latest_checkpoint(url)
        if latest is None:
            raise FileNotFoundError(
                f"{url} is neither a serving-format drafter (config.json), a training "
                "checkpoint (drafter_config.json) nor a run directory with a complete checkpoint"
            )
        url = latest
    config = DrafterConfig.from_dict(storage.read_json(storage.join(url, "drafter_config.json")))
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(load_tensors(storage.join(url, "drafter.safetensors")))
    return drafter


def rng_state() -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Every RNG the run touches: Python, NumPy, torch CPU and CUDA (JSON + tensors)."""
    import random

    import numpy as np

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
    import random

    import numpy as np

    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
