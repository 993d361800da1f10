"""`flashdraft eval --target T --drafter D --prompts P --output R.json`: real acceptance."""

from __future__ import annotations

import argparse

from flashdraft import config as cfg
from flashdraft.eval.evaluate import EvalConfig, load_eval_target, run_eval
from flashdraft.eval.report import format_summary, write_report
from flashdraft.log import get_logger
from flashdraft.model.target import decoder_layers
from flashdraft.train.checkpoint import load_drafter

log = get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg.add_arguments(parser, EvalConfig)


def run(args: argparse.Namespace) -> int:
    config: EvalConfig = cfg.from_args(EvalConfig, args)
    target, tokenizer = load_eval_target(config)
    drafter = load_drafter(config.drafter, num_target_layers=len(decoder_layers(target)))
    report = run_eval(config, target, tokenizer, drafter)
    plot = write_report(report, config.output)
    log.info(format_summary(report))
    log.info(f"report: {config.output}\nplot:   {plot}")
    return 0
