"""An export in either format: the options of `flashdraft export` (`ExportConfig`), which
format a folder holds (`export_format`), loading either (`load_exported`, for warm starts and
`flashdraft eval`), and writing (`save_export`, into an empty or `--overwrite` directory:
`check_output`). Every export is reloaded and checked before it is reported as written
(`verify_export`): identical weights and outputs, and its config.json read as the engines
read it (`check_engine_config`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

import torch

from flashdraft import config as cfg
from flashdraft import storage
from flashdraft.config import option
from flashdraft.export.dflash import (
    WEIGHTS_INDEX,
    load_dflash,
    load_weights,
    save_dflash,
    serving_state_dict,
)
from flashdraft.export.engine import check_engine_config
from flashdraft.export.speculators import from_speculators_config, save_speculators
from flashdraft.model.drafter import DFlashDrafter, DraftCache

ExportFormat = Literal["dflash", "speculators"]
FORMATS: tuple[str, ...] = typing.get_args(ExportFormat)


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    """The options of `flashdraft export`."""

    checkpoint: str = option(
        positional=True,
        help="training checkpoint, run directory (latest checkpoint) or export",
    )
    output: str = option(help="directory to write (local or fsspec URL)")
    format: ExportFormat = option(
        "dflash", help="dflash: vLLM, SGLang, z-lab's dflash; speculators: vLLM's speculators"
    )
    verifier: str | None = option(
        None,
        help="the target's HF id or path, written into the speculators config (required there: "
        "vLLM serves the verifier it names)",
    )
    overwrite: bool = option(False, help="write into a non-empty output directory")

    def __post_init__(self) -> None:
        cfg.validate(self)
        if self.format == "speculators" and not self.verifier:
            raise cfg.ConfigError(
                "verifier", self.verifier, "the speculators format needs the target's HF id or path"
            )


def export_format(url: str) -> str:
    """'dflash' or 'speculators': the layout of an exported folder."""
    config_url = storage.join(url, "config.json")
    if not storage.exists(config_url):
        raise FileNotFoundError(f"{url} has no config.json: not an exported drafter")
    return "speculators" if "speculators_model_type" in storage.read_json(config_url) else "dflash"


def load_exported(
    url: str, dtype: torch.dtype = torch.bfloat16, num_target_layers: int | None = None
) -> DFlashDrafter:
    """An exported drafter in either format (z-lab's published folders are `dflash`).

    `num_target_layers` only fills in a speculators config that does not record the depth.
    """
    if export_format(url) == "dflash":
        return load_dflash(url, dtype)
    config = from_speculators_config(
        storage.read_json(storage.join(url, "config.json")), num_target_layers
    )
    return load_weights(config, url).to(dtype)


def verify_export(drafter: DFlashDrafter, url: str, seed: int = 0) -> None:
    """Reload `url` (either format) and check it gives the same weights and outputs as
    `drafter` in bf16, and that the engines read the drafter's config from it
    (`check_engine_config`).

    Raises ValueError at the first mismatch: an export that an engine would load
    differently must never be reported as written.
    """
    reloaded = load_exported(url)
    if reloaded.config != drafter.config:
        raise ValueError("export check failed: the reloaded config differs from the drafter's")
    check_engine_config(url, drafter.config)
    expected = serving_state_dict(drafter)
    for name, tensor in reloaded.state_dict().items():
        if not torch.equal(tensor.cpu(), expected[name]):
            raise ValueError(f"export check failed: {name} differs after reload")
    reference = DFlashDrafter(drafter.config).to(torch.bfloat16)
    reference.load_state_dict(expected)
    config = drafter.config
    gen = torch.Generator().manual_seed(seed)
    ctx_len, block = 8, config.block_size
    hidden = torch.randn(1, ctx_len, config.num_taps * config.hidden_size, generator=gen)
    embeds = torch.randn(1, block, config.hidden_size, generator=gen)
    outputs = []
    for model in (reference, reloaded):
        cache = DraftCache()
        positions = torch.arange(ctx_len)[None]
        model.extend_cache(cache, hidden.to(torch.bfloat16), positions)
        outputs.append(model.draft_block(cache, embeds.to(torch.bfloat16), ctx_len))
    if not torch.equal(outputs[0], outputs[1]):
        raise ValueError("export check failed: reloaded drafter gives different outputs")


def check_output(url: str, overwrite: bool = False) -> None:
    """Refuse to write into a non-empty directory unless `overwrite`; with it, drop a stale
    sharded-weights index, which loaders would read before our single weights file."""
    fs, path = storage.filesystem(url)
    if not fs.exists(path):
        return
    if not fs.isdir(path):
        raise ValueError(f"--output {url} is a file; give a directory")
    if not overwrite and fs.ls(path):
        raise ValueError(
            f"--output {url} is not empty; pass --overwrite to write the export into it, "
            "or choose a new directory"
        )
    index = storage.join(url, WEIGHTS_INDEX)
    if storage.exists(index):
        shards = set(storage.read_json(index)["weight_map"].values())
        for name in (WEIGHTS_INDEX, *sorted(shards)):
            target = storage.filesystem(storage.join(url, name))[1]
            if fs.exists(target):
                fs.rm(target)


def save_export(
    drafter: DFlashDrafter,
    url: str,
    format: ExportFormat = "dflash",
    verifier: str | None = None,
    overwrite: bool = False,
) -> None:
    """Write `drafter` to `url` in `format` and check the reload (`verify_export`).
    The speculators format needs the `verifier` (the target's HF id or path). A non-empty
    `url` is refused unless `overwrite`."""
    if format == "speculators" and not verifier:
        raise ValueError("the speculators format needs a verifier (the target's HF id or path)")
    check_output(url, overwrite)
    fs, path = storage.filesystem(url)
    fresh = not fs.exists(path) or not fs.ls(path)  # what a failed write may remove again
    try:
        if format == "dflash":
            save_dflash(drafter, url)
        else:
            assert verifier is not None
            save_speculators(drafter, url, verifier)
    except storage.WriteFailed as err:
        if fresh and fs.exists(path):  # nothing of it left to block the retry
            fs.rm(path, recursive=True)
        left = (
            "nothing was left there; make room and run again"
            if fresh
            else "make room and run again with --overwrite"
        )
        raise storage.WriteFailed(
            url,
            OSError(err.errno, f"{err.error.strerror or err.error} ({left})"),
        ) from err
    verify_export(drafter, url)
