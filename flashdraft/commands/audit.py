"""`flashdraft audit DIR...`: statistics and degenerate-data checks of a prepared dataset."""

from __future__ import annotations

import argparse
import sys

from flashdraft import config as cfg
from flashdraft.data.audit import AuditConfig, audit
from flashdraft.log import get_logger

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, AuditConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.from_args(AuditConfig, args)
    report, output = audit(config)
    if config.json_output:
        # For programs: straight to standard output, whatever the log level.
        sys.stdout.write(output + "\n")
    else:
        log.info(output)
    return 1 if report.problems else 0
