"""The in-training eval (`eval.every`): the real draft-and-verify loop on held-out prompts,
on the logging rank, with the best drafter by tau kept as a serving export in RUN/best
(`best.json` beside it says its step and tau). The trainer decides when it runs and gathers
the whole drafter (a collective); this decides what is measured and what is kept.
"""

from __future__ import annotations

from typing import Any

import torch

from flashdraft import storage
from flashdraft.eval.evaluate import evaluate_drafter, load_prompts
from flashdraft.export import save_dflash
from flashdraft.log import get_logger
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.train.config import RunConfig

log = get_logger(__name__)


class HeldOutEval:
    """`on`: the same decision on every rank (logging is collective); only the logging rank
    loads the prompts and evaluates. A resumed run starts from the best tau it had kept."""

    def __init__(self, config: RunConfig, target: Any, is_logger: bool, resuming: bool) -> None:
        section = config.eval
        self.config, self.target = config, target
        self.on = section.every > 0 and target is not None
        self.tokenizer: Any = None
        self.prompts = self._prompts(is_logger)
        self.best_tau = self._best_so_far(resuming)

    def _prompts(self, is_logger: bool) -> list[Any]:
        section = self.config.eval
        if section.every <= 0:
            return []
        if section.prompts is None:
            raise ValueError("eval.every > 0 needs eval.prompts (a JSONL file of held-out prompts)")
        if not is_logger:
            return []
        if self.target is None:
            log.warning(
                "flashdraft train: in-training eval needs the target on the logging rank; with "
                "the split placement it is skipped (run `flashdraft eval` on checkpoints)"
            )
            return []
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.target.path)
        return load_prompts(section.prompts, self.tokenizer, limit=section.num_prompts)

    def _best_so_far(self, resuming: bool) -> float:
        url = storage.join(self.config.output, "best", "best.json")
        if not resuming or not storage.exists(url):
            return float("-inf")
        return float(storage.read_json(url)["eval_tau"])

    def evaluate(
        self,
        drafter: DFlashDrafter,
        drafter_config: DrafterConfig,
        step: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> dict[str, Any]:
        """eval_* fields for step `step`'s record; keeps the best-by-tau serving export.
        `drafter` is the whole drafter (gathered when sharded); the loop runs on an eager
        copy in `dtype` (the target head's)."""
        assert self.target is not None
        # An eager bf16/fp32 copy: the decode context grows every step, which the compiled
        # (static-shape) training layers must not see.
        eager = DFlashDrafter(drafter_config)
        eager.load_state_dict(drafter.state_dict())
        eager.to(device, dtype).eval()
        report = evaluate_drafter(
            self.target.model,
            self.tokenizer,
            eager,
            self.prompts,
            max_new_tokens=self.config.eval.max_new_tokens,
            reference=False,
            taps=self.target.taps,
        )
        tau = float(report["tau"] or 1.0)
        fields = {
            "eval_tau": round(tau, 4),
            "eval_per_position_acceptance": [
                round(float(x), 4) for x in report["per_position_acceptance"]
            ],
        }
        if tau > self.best_tau:
            self.best_tau = tau
            best = storage.join(self.config.output, "best")
            save_dflash(drafter, best)
            storage.write_json_atomic(
                storage.join(best, "best.json"), {"step": step, "eval_tau": tau}
            )
        return fields
