"""A look at prepared samples with their trained tokens highlighted (`prepare`, `audit`).

The options shared by both commands (`PreviewOptions`: which samples, how to highlight) are
declared once here and nested in each command's config.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.data.dataset import PreparedDataset

_GREEN, _RESET = "\x1b[1;32m", "\x1b[0m"


@dataclass(kw_only=True, slots=True)
class PreviewOptions:
    seed: int = option(
        0,
        help="seed for choosing the samples --preview shows (the data itself is in input order)",
        tags=("manifest",),  # prepare records it with its options
    )
    color: Literal["auto", "always", "never"] = option(
        "auto",
        help="highlight trained tokens with colour (auto: on a terminal) or with [[ ]] markers",
    )

    def __post_init__(self) -> None:
        cfg.validate(self)

    def colored(self) -> bool:
        """Colour or markers, for text written to standard output."""
        return self.color == "always" or (self.color == "auto" and sys.stdout.isatty())


def preview_segments(
    dataset: PreparedDataset, index: int, tokenizer: Any, max_tokens: int = 1024
) -> tuple[int, list[tuple[str, bool]]]:
    """(tokens left out at the start, [(text, trained), ...]) of one sample's last tokens."""
    ids, mask = dataset.sample(index)
    skipped = max(len(ids) - max_tokens, 0)
    ids, mask = ids[skipped:], mask[skipped:]
    cuts = [0, *(np.flatnonzero(np.diff(mask)) + 1).tolist(), len(ids)]
    segments = [
        (
            str(tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False)),
            bool(mask[a]),
        )
        for a, b in itertools.pairwise(cuts)
        if b > a
    ]
    return skipped, segments


def preview_indices(dataset: PreparedDataset, count: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    count = min(count, len(dataset))
    return sorted(rng.choice(len(dataset), size=count, replace=False).tolist())


def format_preview(
    dataset: PreparedDataset, indices: list[int], tokenizer: Any, *, color: bool
) -> str:
    if color:
        legend = f"trained tokens in {_GREEN}green{_RESET}"
        start, stop = _GREEN, _RESET
    else:
        legend = "trained tokens between [[ and ]]"
        start, stop = "[[", "]]"
    out = [f"preview of {len(indices)} sample(s); {legend}"]
    for index in indices:
        skipped, segments = preview_segments(dataset, index, tokenizer)
        out.append(
            f"--- sample {index}  {dataset.source(index)}  {int(dataset.num_tokens[index]):,} "
            f"tokens, {int(dataset.num_loss_tokens[index]):,} trained ---"
        )
        text = "".join(start + t + stop if trained else t for t, trained in segments)
        out.append((f"... ({skipped:,} earlier tokens not shown)\n" if skipped else "") + text)
    return "\n".join(out)


def preview_json(dataset: PreparedDataset, indices: list[int], tokenizer: Any) -> list[Any]:
    """The same samples as JSON: index, source and [text, trained] segments."""
    return [
        {
            "index": i,
            "source": dataset.source(i),
            "segments": [[t, m] for t, m in preview_segments(dataset, i, tokenizer)[1]],
        }
        for i in indices
    ]
