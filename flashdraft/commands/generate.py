"""`flashdraft generate --target T --prompts IN --output OUT.jsonl`: on-policy answers."""

from __future__ import annotations

import argparse

import torch

from flashdraft import config as cfg
from flashdraft.data.generate import GenerateConfig, Summary, generate
from flashdraft.data.openai_backend import ServerError
from flashdraft.log import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, GenerateConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.from_args(GenerateConfig, args)
    summary = Summary()
    try:
        generate(config, summary)
    except KeyboardInterrupt:
        log.info(summary.describe(config.output))
        log.warning("generate: interrupted; run the same command again to resume")
        return 130
    except ServerError as err:  # the server is unusable or went down: one line, resumable
        if summary.written or summary.failed:
            log.info(summary.describe(config.output))
        log.error(str(err))
        return 1
    except torch.OutOfMemoryError:
        log.error(
            "generate: out of memory: lower --batch-size or set --max-batch-tokens, then run "
            "again to resume (batches run longest prompts first, so this happens early)"
        )
        raise
    log.info(summary.describe(config.output))
    if summary.failed:
        log.warning(f"generate: {summary.failed} prompts failed; run the same command again")
        return 1
    return 0
