"""Resumable training state, kept apart from serving exports (STYLE: two kinds, never mixed).

A run directory (any fsspec URL) holds

    run_config.json             the resolved run config (`train.config.RUN_CONFIG`)
    checkpoints/step_00000100/
        drafter.safetensors     fp32 master weights, serving names (no prefixes)
        drafter_config.json     DrafterConfig.to_dict()
        optimizer.safetensors   optimizer tensors (exp_avg, exp_avg_sq, step) by parameter name
        rng.safetensors         torch CPU / CUDA generator states
        state.json              step, data cursor, scheduler, optimizer hyper-parameters, RNG
        COMPLETE                written last: the sha256 and size of every file above
    export/                     the serving-format drafter written at the end
    best/                       the best-by-eval-tau serving export (when eval is on)

Each kind is told by its own markers, never by a shared file name: a checkpoint by
`COMPLETE` + `drafter_config.json`, a run by `checkpoints/`, a serving export by a
`config.json` that names `DFlashDraftModel` (or is a speculators config). A checkpoint is
used only once every file matches its checksum; resuming and loading a run walk back to the
newest checkpoint that does, saying which they skipped and why. Checkpoints of older
versions (a `COMPLETE` without checksums) still load, after a structural check of the files.

Nothing here unpickles: tensors go through safetensors, everything else is JSON.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import struct
from collections.abc import Iterable
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
from flashdraft.export import ARCHITECTURE, load_exported
from flashdraft.log import get_logger, trace
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter

log = get_logger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
DRAFTER_FILES = ("drafter.safetensors", "drafter_config.json")  # what loading a drafter reads
STATE_FILES = (*DRAFTER_FILES, "optimizer.safetensors", "rng.safetensors", "state.json")
UNUSABLE = "unusable_"  # prefix of a checkpoint set aside by a resume (kept, never read)
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(run: str, step: int) -> str:
    return storage.join(run, CHECKPOINTS, f"step_{step:08d}")


def complete_checkpoints(run: str) -> list[tuple[int, str]]:
    """(step, url) of every checkpoint of a run with a `COMPLETE` marker, oldest first
    (not verified: `usable_checkpoint` checks the files)."""
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


# ---- writing: every file hashed as it is written, the list of them last ----


class _CheckpointWriter:
    """Writes the files of one checkpoint directory and records their sha256 and size;
    `complete` writes the `COMPLETE` marker holding that record, last."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.files: dict[str, dict[str, Any]] = {}

    def write(self, name: str, data: bytes) -> None:
        storage.write_bytes_atomic(storage.join(self.url, name), data)
        self.files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    def drafter(self, weights: dict[str, Tensor], config: DrafterConfig) -> None:
        self.write("drafter.safetensors", storage.tensor_bytes(weights))
        self.write("drafter_config.json", storage.json_bytes(config.to_dict()))

    def complete(self, step: int | None) -> None:
        marker = {"step": step, "files": self.files}
        storage.write_bytes_atomic(storage.join(self.url, COMPLETE), storage.json_bytes(marker))
        trace("write", what="checkpoint", url=self.url, step=step)


def save_drafter(url: str, drafter: DFlashDrafter) -> None:
    """A drafter-only checkpoint (fp32 weights + config + `COMPLETE`): loadable by
    `load_drafter`, `flashdraft export` and `eval`, not resumable."""
    storage.makedirs(url)
    writer = _CheckpointWriter(url)
    writer.drafter(drafter.state_dict(), drafter.config)
    writer.complete(None)


# ---- verifying ----


_LEGACY_MARKER = re.compile(r"^(\d+|None)$")  # what COMPLETE held before checksums


def _recorded_files(url: str) -> dict[str, dict[str, Any]] | str | None:
    """The files `COMPLETE` records with their checksums; None for the marker of an older
    version (the checkpoint's step number as text), which records none; and for a marker
    that is neither, why it is damaged: such a checkpoint is unusable, never one whose
    checksums go unchecked."""
    try:
        text = storage.read_text(storage.join(url, COMPLETE))
    except (UnicodeDecodeError, OSError):
        return f"its {COMPLETE} marker is not text (damaged)"
    try:
        marker = json.loads(text)
    except ValueError:
        marker = None
    if (
        isinstance(marker, dict)
        and isinstance(marker.get("files"), dict)
        and all(
            isinstance(v, dict)
            and isinstance(v.get("sha256"), str)
            and isinstance(v.get("size"), int)
            for v in marker["files"].values()
        )
    ):
        return dict(marker["files"])
    legacy = _LEGACY_MARKER.match(text.strip())
    step = _STEP_DIR.match(url.rstrip("/").rsplit("/", 1)[-1])
    if legacy and (step is None or legacy.group(1) == str(int(step.group(1)))):
        return None
    return f"its {COMPLETE} marker does not parse (damaged: {text[:40]!r})"


def _safetensors_problem(url: str) -> str | None:
    """Whether a safetensors file is whole: its header parses and the tensors it lists end
    exactly at the end of the file (a file cut short, or empty, fails)."""
    fs, path = storage.filesystem(url)
    size = int(fs.size(path) or 0)
    with fs.open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"{size} bytes, too short for a safetensors header"
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            return "its header runs past the end of the file (cut short)"
        try:
            header = json.loads(f.read(length))
            end = max(
                (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "its header is not valid safetensors JSON"
    if 8 + length + end != size:
        return f"{size:,} bytes where its header needs {8 + length + end:,} (cut short?)"
    return None


def _structural_problem(url: str, name: str) -> str | None:
    """What a checkpoint without checksums can still be checked for: the file is there and
    parses (safetensors header and size; JSON)."""
    file_url = storage.join(url, name)
    if not storage.exists(file_url):
        return "missing"
    if name.endswith(".safetensors"):
        return _safetensors_problem(file_url)
    try:
        storage.read_json(file_url)
    except ValueError:
        return "not valid JSON"
    return None


def verify_checkpoint(url: str, needed: tuple[str, ...] = STATE_FILES) -> str | None:
    """None when the checkpoint at `url` has a `COMPLETE` marker and each of `needed` matches
    the sha256 and size the marker records; else why it must not be used."""
    if not storage.exists(storage.join(url, COMPLETE)):
        return f"no {COMPLETE} marker (it was cut mid-write)"
    recorded = _recorded_files(url)
    if isinstance(recorded, str):
        return recorded
    if recorded is None:
        log.warning(
            f"{url}: its {COMPLETE} marker has no checksums (written by an older flashdraft); "
            "only the files' structure is checked"
        )
    for name in needed:
        if recorded is None:
            problem = _structural_problem(url, name)
        elif name not in recorded:
            problem = f"not listed in {COMPLETE}"
        else:
            problem = _checksum_problem(storage.join(url, name), recorded[name])
        if problem is not None:
            return f"{name}: {problem}"
    return None


def _checksum_problem(url: str, expected: dict[str, Any]) -> str | None:
    if not storage.exists(url):
        return "missing"
    digest, size = storage.file_digest(url)
    if size != expected["size"]:
        return f"{size:,} bytes, {COMPLETE} recorded {expected['size']:,} (cut short or replaced)"
    if digest != expected["sha256"]:
        return f"its sha256 differs from the one {COMPLETE} recorded (the file was changed)"
    return None


def usable_checkpoint(
    run: str, needed: tuple[str, ...] = STATE_FILES
) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint of `run` that verifies (None if none does), and (url, why) of
    each newer one skipped on the way back, each also logged as a warning."""
    skipped: list[tuple[str, str]] = []
    for _, url in reversed(complete_checkpoints(run)):
        problem = verify_checkpoint(url, needed)
        if problem is None:
            return url, skipped
        log.warning(f"skipping checkpoint {url}: {problem}")
        skipped.append((url, problem))
    return None, skipped


def set_aside(url: str) -> str:
    """Rename an unusable checkpoint to `unusable_step_N` (kept for inspection, never read
    again, never counted among the `keep` newest); returns its new URL."""
    fs, path = storage.filesystem(url)
    parent, name = path.rstrip("/").rsplit("/", 1)
    new_name, n = f"{UNUSABLE}{name}", 1
    while fs.exists(f"{parent}/{new_name}"):
        new_name, n = f"{UNUSABLE}{name}.{n}", n + 1
    fs.mv(path, f"{parent}/{new_name}", recursive=True)
    return f"{url.rstrip('/').rsplit('/', 1)[0]}/{new_name}"


# ---- loading a drafter from any of the three kinds ----


def is_training_checkpoint(url: str) -> bool:
    """A checkpoint by its own markers: `COMPLETE` and `drafter_config.json`."""
    return storage.exists(storage.join(url, COMPLETE)) and storage.exists(
        storage.join(url, "drafter_config.json")
    )


def is_run(url: str) -> bool:
    return storage.exists(storage.join(url, CHECKPOINTS))


def is_export(url: str) -> bool:
    """A serving export: a config.json naming the DFlash architecture, or a speculators one."""
    config_url = storage.join(url, "config.json")
    if not storage.exists(config_url):
        return False
    data = storage.read_json(config_url)
    return isinstance(data, dict) and (
        ARCHITECTURE in (data.get("architectures") or []) or "speculators_model_type" in data
    )


def load_drafter(url: str, num_target_layers: int | None = None) -> DFlashDrafter:
    """A drafter from a training checkpoint, a run directory (its newest checkpoint that
    verifies) or a serving export (dflash or speculators layout; ours or a published z-lab
    drafter). `num_target_layers` only completes a speculators config that lacks it."""
    if is_training_checkpoint(url):
        problem = verify_checkpoint(url, DRAFTER_FILES)
        if problem is not None:
            raise ValueError(f"checkpoint {url} is unusable: {problem}")
        return _read_drafter(url)
    if is_run(url):
        found, skipped = usable_checkpoint(url, DRAFTER_FILES)
        if found is None:
            why = "; ".join(f"{u}: {p}" for u, p in skipped) or "none has a COMPLETE marker yet"
            raise FileNotFoundError(f"run {url} has no usable checkpoint ({why})")
        step = _STEP_DIR.match(found.rstrip("/").rsplit("/", 1)[-1])
        newer = f", not the {len(skipped)} damaged newer one(s) named above" if skipped else ""
        log.info(
            f"{url}: reading checkpoint step {int(step.group(1)) if step else '?'} ({found}){newer}"
        )
        return _read_drafter(found)
    if is_export(url):
        return load_exported(url, dtype=torch.float32, num_target_layers=num_target_layers)
    if storage.exists(storage.join(url, "config.json")):
        raise ValueError(
            f"{storage.join(url, 'config.json')} is not a DFlash drafter's (its architectures do "
            f"not name {ARCHITECTURE}); give a run directory, a checkpoint or a serving export"
        )
    if storage.exists(storage.join(url, "drafter_config.json")):
        raise ValueError(
            f"{url} is an incomplete checkpoint (no {COMPLETE} marker: it was cut mid-write); "
            "use an earlier checkpoint or the run directory"
        )
    raise FileNotFoundError(
        f"{url} is neither a serving-format drafter (config.json), a training "
        "checkpoint (COMPLETE + drafter_config.json) nor a run directory (checkpoints/)"
    )


def _read_drafter(url: str) -> DFlashDrafter:
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
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    state: dict[str, Any],
    keep: int,
    is_main: bool,
) -> str | None:
    """Write a complete resumable checkpoint; every rank must call (state gathering may need
    collectives under FSDP), rank 0 writes. Returns the checkpoint URL on rank 0.

    Written into `step_N/`, with `COMPLETE` (the checksums of the files) last: a crash
    mid-write leaves a directory that is never used, never one that looks valid.
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
    if storage.exists(url):  # a stale attempt at this step: incomplete, or set aside
        fs, path = storage.filesystem(url)
        fs.rm(path, recursive=True)
    config = getattr(drafter, "config", None)
    assert isinstance(config, DrafterConfig)
    try:
        storage.makedirs(url)
        _write_state(url, step, model_sd, config, optim_sd, state)
    except OSError as err:  # disk full, ...: no half checkpoint left to fill the disk
        fs, path = storage.filesystem(url)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        latest = latest_checkpoint(run)
        then = (
            f"run the same command with --resume (it goes on from {latest})"
            if latest
            else "run the same command again (no checkpoint of this run is complete yet)"
        )
        reason = err.error if isinstance(err, storage.WriteFailed) else err
        raise storage.WriteFailed(
            url,
            OSError(
                err.errno,
                f"{reason.strerror or reason} (the checkpoint was removed; make room, then {then})",
            ),
        ) from err
    for _, old in complete_checkpoints(run)[: -max(keep, 1)]:
        fs, path = storage.filesystem(old)
        fs.rm(path, recursive=True)
    return url


def _write_state(
    url: str,
    step: int,
    model_sd: dict[str, Tensor],
    config: DrafterConfig,
    optim_sd: Any,
    state: dict[str, Any],
) -> None:
    """The files of a resumable checkpoint, `COMPLETE` last."""
    writer = _CheckpointWriter(url)
    writer.drafter(model_sd, config)
    tensors = {
        f"{name}/{key}": value
        for name, entry in optim_sd["state"].items()
        for key, value in entry.items()
        if isinstance(value, Tensor)
    }
    writer.write("optimizer.safetensors", storage.tensor_bytes(tensors))
    rng_meta, rng_tensors = rng_state()
    writer.write("rng.safetensors", storage.tensor_bytes(rng_tensors))
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}
        for group in optim_sd["param_groups"]
    ]
    full_state = {**state, "step": step, "rng": rng_meta, "optimizer_param_groups": groups}
    writer.write("state.json", storage.json_bytes(full_state))
    writer.complete(step)


def load_checkpoint(
    url: str,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    verify: bool = True,
) -> dict[str, Any]:
    """Restore drafter, optimizer and RNG from a checkpoint (every rank reads it), after
    checking every file against `COMPLETE` (`verify=False`: the caller just did)."""
    problem = verify_checkpoint(url) if verify else None
    if problem is not None:
        raise ValueError(f"checkpoint {url} is unusable: {problem}")
    state = dict(storage.read_json(storage.join(url, "state.json")))
    options = StateDictOptions(full_state_dict=True)
    weights: Any = storage.read_tensors(storage.join(url, "drafter.safetensors"))
    set_model_state_dict(drafter, weights, options=options)
    flat = storage.read_tensors(storage.join(url, "optimizer.safetensors"))
    per_param: Any = {}
    for key, value in flat.items():
        name, _, field_name = key.rpartition("/")
        per_param.setdefault(name, {})[field_name] = value
    groups = list(state.pop("optimizer_param_groups"))
    set_optimizer_state_dict(
        drafter,
        optimizer,
        {"state": per_param, "param_groups": groups},
        options=options,
    )
    # JSON gave lists where torch's settings are tuples (betas, ns_coefficients): back to tuples.
    for one in (optimizer,) if isinstance(optimizer, torch.optim.Optimizer) else optimizer:
        for group in one.param_groups:
            for key, value in group.items():
                if key != "params" and isinstance(value, list):
                    group[key] = tuple(value)
    set_rng_state(state.pop("rng"), storage.read_tensors(storage.join(url, "rng.safetensors")))
    return state
