"""The `flashdraft` console script: one small, stable set of subcommands.

Each subcommand lives in its own module, which defines `add_arguments(parser)` and
`run(args) -> int`. The module is imported only when its command runs, so `flashdraft audit`
does not pay for importing the training stack.

A user mistake (`USER_ERRORS`) is one line on standard error, `flashdraft NAME: error: ...`,
and exit status 2; a run that fails on its own terms (`RUN_FAILURES`: a non-finite training
loss, reported with its step) is one such line and exit status 1. A training run that SIGTERM
stopped after a checkpoint (`train`, or `demo`'s training) says so in one line and exits 143
(`train/stopping.py`). Anything else is a bug and keeps its traceback. `FLASHDRAFT_DEBUG=1`
re-raises every error, traceback included.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from flashdraft import __version__
from flashdraft.log import get_logger
from flashdraft.train.stopping import EXIT_CODE, TrainingStopped

log = get_logger(__name__)

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": (
        "flashdraft.commands.prepare",
        "turn conversations/completions into a trainable Arrow dataset",
    ),
    "audit": (
        "flashdraft.commands.audit",
        "check a prepared dataset for degenerate or broken samples",
    ),
    "generate": (
        "flashdraft.commands.generate",
        "regenerate responses with the target (on-policy data)",
    ),
    "train": ("flashdraft.commands.train", "train a drafter online against a frozen target"),
    "eval": (
        "flashdraft.commands.eval",
        "measure real acceptance (tau) with the draft-and-verify loop",
    ),
    "export": (
        "flashdraft.commands.export",
        "write a checkpoint in a serving format (dflash, speculators)",
    ),
    "bench": ("flashdraft.commands.bench", "time target, drafter and full step for a run config"),
    "demo": ("flashdraft.commands.demo", "the whole pipeline on SmolLM2-135M, end to end"),
}

# User mistakes surface as these (exit 2); anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError, FileExistsError)
# A run that stopped itself (exit 1): the trainer's non-finite loss at step N.
RUN_FAILURES: tuple[type[Exception], ...] = (FloatingPointError,)


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"usage: flashdraft COMMAND [options]   (flashdraft {__version__})", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`flashdraft COMMAND --help` describes one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        log.info(_usage())
        return 0
    if argv[0] == "--version":
        log.info(__version__)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        log.error(f"flashdraft: unknown command {name!r}\n\n{_usage()}")
        return 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"flashdraft {name}", description=help_)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except TrainingStopped as stopped:  # not an error: resumable from its checkpoint
        log.warning(f"flashdraft {name}: {stopped}: {stopped.go_on}")
        return EXIT_CODE
    except (*USER_ERRORS, *RUN_FAILURES) as err:
        if os.environ.get("FLASHDRAFT_DEBUG"):
            raise
        log.error(f"flashdraft {name}: error: {err}")
        return 1 if isinstance(err, RUN_FAILURES) else 2


if __name__ == "__main__":
    sys.exit(main())
