"""Logging: every message of flashdraft goes through the `flashdraft` logger tree.

`get_logger(__name__)` in each module. Messages at INFO go to standard output, warnings and
errors to standard error, both looked up when a message is written (so a test that captures
the streams sees them). Under torchrun (WORLD_SIZE > 1) each line is tagged with the rank
that wrote it, `[rank 3] ...`, so interleaved logs of many processes stay readable.
`FLASHDRAFT_LOG=debug` (or warning, ...) sets the level.

`trace(event, **fields)` records structured events (rows consumed, files written) as JSON
lines when `FLASHDRAFT_TRACE` names a directory, one file per process: what multi-process
tests check ("every row once", "one writer per checkpoint") and what a user can inspect.

User mistakes are not logged here: commands raise ValueError and the console script prints
one line and exits 2 (`flashdraft.cli`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

ROOT = "flashdraft"


class _Streams(logging.Handler):
    """INFO and below to the current sys.stdout, WARNING and above to the current sys.stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # a closed stream must not crash the run
            self.handleError(record)


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            tag = f"[rank {os.environ.get('RANK', '?')}] "
            text = "\n".join(tag + line for line in text.splitlines())
        return text


def _configure() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _Streams) for h in root.handlers):
        handler = _Streams()
        handler.setFormatter(_RankFormatter("%(message)s"))
        root.addHandler(handler)
        root.propagate = False
    level = os.environ.get("FLASHDRAFT_LOG", "info").upper()
    root.setLevel(getattr(logging, level, logging.INFO))
    return root


_configure()


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (e.g. `flashdraft.train.trainer`), under the root."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


TRACE_ENV = "FLASHDRAFT_TRACE"


def trace(event: str, **fields: Any) -> None:
    """Append `{"event": ..., "rank": ..., **fields}` to `$FLASHDRAFT_TRACE/trace-rank<R>.jsonl`
    (R = the global rank torchrun set, 0 otherwise); nothing when the variable is unset."""
    directory = os.environ.get(TRACE_ENV)
    if not directory:
        return
    rank = int(os.environ.get("RANK", "0"))
    record = {"event": event, "rank": rank, "node": os.environ.get("GROUP_RANK"), **fields}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"trace-rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
