"""The sample preview: trained tokens highlighted, samples chosen by seed, the shared options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flashdraft.data.dataset import open_dataset, write_dataset
from flashdraft.data.preview import (
    PreviewOptions,
    format_preview,
    preview_indices,
    preview_json,
    preview_segments,
)


def chats(tokenizer: Any, n: int, tmp_path: Path) -> str:
    rows = []
    for i in range(n):
        prompt = f"<|im_start|>user\nQuestion number {i}?<|im_end|>\n<|im_start|>assistant\n"
        answer = f"Answer {i}: the value is {i * 7} because of reason {i % 5}.<|im_end|>"
        head = tokenizer.encode(prompt, add_special_tokens=False)
        tail = tokenizer.encode(answer, add_special_tokens=False)
        ids = np.array(head + tail, dtype=np.int32)
        mask = np.array([0] * len(head) + [1] * len(tail), dtype=np.int8)
        rows.append((ids, mask, f"data.jsonl:{i + 1}"))
    url = str(tmp_path / "ok")
    write_dataset(url, rows)
    return url


def test_preview_highlights_trained_tokens(tmp_path: Path, qwen3_tokenizer: Any) -> None:
    dataset = open_dataset(chats(qwen3_tokenizer, 3, tmp_path))
    plain = format_preview(dataset, [1], qwen3_tokenizer, color=False)
    assert (
        "<|im_start|>assistant\n[[Answer 1: the value is 7 because of reason 1.<|im_end|>]]"
        in plain
    )
    assert "--- sample 1  data.jsonl:2" in plain
    colored = format_preview(dataset, [1], qwen3_tokenizer, color=True)
    assert "\x1b[1;32mAnswer 1" in colored and "[[" not in colored
    (entry,) = preview_json(dataset, [2], qwen3_tokenizer)
    assert entry["source"] == "data.jsonl:3"
    assert "".join(t for t, trained in entry["segments"] if trained).startswith("Answer 2:")


def test_long_samples_show_their_last_tokens(tmp_path: Path, qwen3_tokenizer: Any) -> None:
    dataset = open_dataset(chats(qwen3_tokenizer, 1, tmp_path))
    ids, _ = dataset.sample(0)
    skipped, segments = preview_segments(dataset, 0, qwen3_tokenizer, max_tokens=5)
    assert skipped == len(ids) - 5
    assert [trained for _, trained in segments] == [True]


def test_samples_are_chosen_by_seed(tmp_path: Path, qwen3_tokenizer: Any) -> None:
    dataset = open_dataset(chats(qwen3_tokenizer, 10, tmp_path))
    first = preview_indices(dataset, 3, seed=0)
    assert first == sorted(first) and len(set(first)) == 3
    assert preview_indices(dataset, 3, seed=0) == first
    assert preview_indices(dataset, 50, seed=1) == list(range(10))  # at most every sample


def test_options(monkeypatch: pytest.MonkeyPatch) -> None:
    assert PreviewOptions(color="always").colored()
    assert not PreviewOptions(color="never").colored()
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert PreviewOptions().colored()
    with pytest.raises(ValueError, match="color = 'blue' is not allowed"):
        PreviewOptions(color="blue")  # type: ignore[arg-type]
