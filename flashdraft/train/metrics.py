"""Where training metrics go: metrics.jsonl in the run directory, TensorBoard, optionally W&B.

`metrics.jsonl` has one JSON object per logged step. On a local run directory each line is
appended and flushed as it is logged; on an object store (no appends) the file is rewritten
whole at every checkpoint and at the end. On resume, lines past the checkpoint's step are
dropped, so a resumed run never logs a step twice.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from flashdraft import storage
from flashdraft.log import get_logger, trace

log = get_logger(__name__)

METRICS = "metrics.jsonl"


class MetricsLogger:
    def __init__(
        self,
        run: str,
        *,
        resume_step: int | None,
        tensorboard: bool,
        wandb_project: str | None,
        config: dict[str, Any],
    ) -> None:
        self.url = storage.join(run, METRICS)
        trace("write", what="metrics", url=self.url)
        self.local = storage.is_local(run)
        self.lines: list[str] = []
        if resume_step is not None and storage.exists(self.url):
            for line in storage.read_text(self.url).splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        self.lines.append(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the crash we are resuming from
        self._rewrite()
        self._file = open(storage.filesystem(self.url)[1], "a") if self.local else None  # noqa: SIM115
        self.tb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = (
                storage.join(run, "tensorboard")
                if self.local
                else tempfile.mkdtemp(prefix="flashdraft-tb-")
            )
            self.tb_dir, self.tb_remote = (
                tb_dir,
                None if self.local else storage.join(run, "tensorboard"),
            )
            self.tb = SummaryWriter(
                log_dir=tb_dir, purge_step=resume_step + 1 if resume_step else None
            )
        self.wandb: Any = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                log.warning(
                    "flashdraft: wandb is not installed; `pip install flashdraft[wandb]` (logging on)"
                )
            else:
                self.wandb = wandb.init(project=wandb_project, config=config, resume="allow")

    def _rewrite(self) -> None:
        storage.write_text_atomic(self.url, "".join(line + "\n" for line in self.lines))

    def log(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=False)
        self.lines.append(line)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
        step = int(record["step"])
        if self.tb is not None:
            for key, value in record.items():
                if key == "step":
                    continue
                if isinstance(value, int | float):
                    self.tb.add_scalar(
                        f"train/{key}" if not key.startswith("eval") else key, value, step
                    )
                elif key == "acc" and isinstance(value, list):
                    for slot, acc in enumerate(value, start=1):
                        self.tb.add_scalar(f"acc/slot_{slot:02d}", acc, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "acc"}, step=step)

    def sync(self) -> None:
        """Make the run directory hold everything logged so far (object stores)."""
        if self.local:
            return
        self._rewrite()
        if self.tb is not None and self.tb_remote is not None:
            fs, path = storage.filesystem(self.tb_remote)
            for name in os.listdir(self.tb_dir):
                fs.put(os.path.join(self.tb_dir, name), f"{path}/{name}")

    def close(self, exit_code: int = 0) -> None:
        """`exit_code`: what W&B records for the run (`stopping.EXIT_CODE`: stopped early)."""
        self.sync()
        if self._file is not None:
            self._file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
