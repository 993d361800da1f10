"""`flashdraft export CHECKPOINT --output DIR [--format dflash|speculators] [--overwrite]`."""

from __future__ import annotations

import argparse
import os

from flashdraft import config as cfg
from flashdraft import storage
from flashdraft.export import ExportConfig, check_output, save_export
from flashdraft.log import get_logger
from flashdraft.train.checkpoint import load_drafter

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, ExportConfig)


def run(args: argparse.Namespace) -> int:
    config: ExportConfig = cfg.from_args(ExportConfig, args)
    check_output(config.output, config.overwrite)  # before the drafter loads
    drafter = load_drafter(config.checkpoint)
    try:
        save_export(drafter, config.output, config.format, config.verifier, config.overwrite)
    except storage.WriteFailed as err:  # a full disk: one line; nothing left to block a retry
        if os.environ.get("FLASHDRAFT_DEBUG"):
            raise
        log.error(f"flashdraft export: error: {err}")
        return 1
    geometry = drafter.config
    log.info(
        f"wrote {config.format} drafter to {config.output}: {geometry.num_hidden_layers} layers, "
        f"B={geometry.block_size}, taps {geometry.target_layer_ids} (z-lab ids), "
        f"mask token {geometry.mask_token_id}; reload check passed (identical weights and outputs, "
        "config.json as the engines read it)"
    )
    return 0
