"""The degenerate-data checks (docs/design.md §8 trap 8), the report and the preview."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flashdraft import cli
from flashdraft.data.audit import AuditConfig, Thresholds, audit, audit_dataset, normalized_keys
from flashdraft.data.dataset import open_dataset, write_dataset


def sample(
    tokenizer: Any, prompt: str, answer: str, source: str
) -> tuple[np.ndarray, np.ndarray, str]:
    head = tokenizer.encode(prompt, add_special_tokens=False)
    tail = tokenizer.encode(answer, add_special_tokens=False)
    ids = np.array(head + tail, dtype=np.int32)
    mask = np.array([0] * len(head) + [1] * len(tail), dtype=np.int8)
    return ids, mask, source


def chat(tokenizer: Any, i: int, answer: str) -> tuple[np.ndarray, np.ndarray, str]:
    prompt = f"<|im_start|>user\nQuestion number {i}?<|im_end|>\n<|im_start|>assistant\n"
    return sample(tokenizer, prompt, answer, f"data.jsonl:{i + 1}")


def healthy(tokenizer: Any, n: int) -> list[tuple[np.ndarray, np.ndarray, str]]:
    return [
        chat(tokenizer, i, f"Answer {i}: the value is {i * 7} because of reason {i % 5}.<|im_end|>")
        for i in range(n)
    ]


def write(tmp_path: Path, name: str, rows: list[Any], tokenizer_dir: Path, **manifest: Any) -> str:
    url = str(tmp_path / name)
    write_dataset(url, rows, manifest={"tokenizer": {"name": str(tokenizer_dir)}, **manifest})
    return url


def test_healthy_data_passes(
    tmp_path: Path, qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path
) -> None:
    url = write(tmp_path, "ok", healthy(qwen3_tokenizer, 50), qwen3_tokenizer_dir)
    report = audit_dataset(open_dataset(url), qwen3_tokenizer, Thresholds())
    assert report.problems == []
    assert report.samples == 50 and report.repeated == 0 and report.all_ones == 0
    assert sum(c for _, _, c in report.loss_histogram) == 50
    assert cli.main(["audit", url]) == 0


def test_the_six_boilerplate_tokens_case_is_an_error(
    tmp_path: Path,
    qwen3_tokenizer: Any,
    qwen3_tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 87% of samples train only an empty think block and "OK." (the incident in the issue).
    rows = healthy(qwen3_tokenizer, 13) + [
        chat(qwen3_tokenizer, 100 + i, "<think>\n\n</think>\n\nOK.") for i in range(87)
    ]
    assert int(rows[-1][1].sum()) == 6
    url = write(tmp_path, "six", rows, qwen3_tokenizer_dir)
    report = audit_dataset(open_dataset(url), qwen3_tokenizer, Thresholds())
    assert report.repeated == 86 and report.identical == 86
    assert report.median_loss_tokens == 6
    assert report.top_repeats[0].count == 87
    assert report.top_repeats[0].text == "<think>\n\n</think>\n\nOK."
    assert len(report.problems) == 2
    assert cli.main(["audit", url]) == 1
    out = capsys.readouterr().out
    assert "DEGENERATE DATA" in out
    assert "86 of 100 samples (86.0%) train on a response that another sample also trains on" in out
    assert "87 x '<think>\\n\\n</think>\\n\\nOK.'" in out
    assert "median sample trains on only 6 tokens" in out


def test_near_identical_ignores_case_whitespace_and_punctuation(
    tmp_path: Path, qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path
) -> None:
    answers = ["OK.<|im_end|>", "ok!<|im_end|>", " Ok<|im_end|>", "OK<|im_end|>"]
    rows = healthy(qwen3_tokenizer, 36) + [
        chat(qwen3_tokenizer, 50 + i, a) for i, a in enumerate(answers)
    ]
    url = write(tmp_path, "near", rows, qwen3_tokenizer_dir)
    report = audit_dataset(open_dataset(url), qwen3_tokenizer, Thresholds(min_median_loss_tokens=0))
    assert report.identical == 0
    assert report.repeated == 3
    assert report.problems == []  # 3 of 40 is under the 10% default
    strict = audit_dataset(open_dataset(url), qwen3_tokenizer, Thresholds(max_repeated_share=0.05))
    assert len(strict.problems) == 1 and "ignoring case" in strict.problems[0]
    # Without a tokenizer, only identical token sequences count.
    assert audit_dataset(open_dataset(url), None, Thresholds()).repeated == 0


def test_non_latin_text_is_not_mistaken_for_empty(qwen3_tokenizer: Any) -> None:
    keys = normalized_keys(qwen3_tokenizer)
    ids = qwen3_tokenizer.encode("你好世界", add_special_tokens=False)
    assert all(keys[i] != 0 for i in ids)
    assert keys[qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")] == 0
    assert keys[qwen3_tokenizer.encode("!", add_special_tokens=False)[0]] == 0


def test_all_ones_empty_and_truncated(
    tmp_path: Path, qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path
) -> None:
    rows = healthy(qwen3_tokenizer, 40)
    ids = np.array(
        qwen3_tokenizer.encode("no assistant marker at all", add_special_tokens=False), np.int32
    )
    rows.append((ids, np.ones_like(ids, dtype=np.int8), "x:1"))
    rows.append(chat(qwen3_tokenizer, 99, "...<|im_end|>"))  # only punctuation and end of turn
    url = write(tmp_path, "bad", rows, qwen3_tokenizer_dir, counts={"samples": 42, "truncated": 10})
    report = audit_dataset(open_dataset(url), qwen3_tokenizer, Thresholds())
    assert (report.all_ones, report.empty, report.truncated) == (1, 1, 10)
    text = " ".join(report.problems)
    assert "all-ones loss mask" in text
    assert "empty response" in text
    assert "truncated at --max-length" in text


def test_audit_json(
    tmp_path: Path,
    qwen3_tokenizer: Any,
    qwen3_tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = write(tmp_path, "ok", healthy(qwen3_tokenizer, 5), qwen3_tokenizer_dir)
    assert cli.main(["audit", url, "--json", "--preview", "2", "--seed", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 5 and report["problems"] == []
    assert len(report["preview"]) == 2
    assert any(trained for segment in report["preview"][0]["segments"] for trained in segment[1:])


def test_thresholds_are_validated() -> None:
    with pytest.raises(ValueError, match=r"max_repeated_share = 2\.0 is not allowed"):
        Thresholds(max_repeated_share=2.0)
    with pytest.raises(ValueError, match="min_median_loss_tokens = -1"):
        Thresholds(min_median_loss_tokens=-1)


def test_audit_entry_point_text_and_json(
    tmp_path: Path, qwen3_tokenizer: Any, qwen3_tokenizer_dir: Path
) -> None:
    """`audit(AuditConfig)` is what the command prints: the report (and a preview), or JSON."""
    url = write(tmp_path, "ok", healthy(qwen3_tokenizer, 6), qwen3_tokenizer_dir)
    report, text = audit(AuditConfig(datasets=[url], preview=1))
    assert report.samples == 6 and report.problems == []
    assert text.startswith("samples          6") and "all checks passed" in text
    assert "preview of 1 sample(s)" in text
    report, output = audit(AuditConfig(datasets=[url], json_output=True))
    assert json.loads(output)["samples"] == 6 and json.loads(output)["preview"] == []
    # Without a loadable tokenizer, the report says so and compares token ids only.
    _, text = audit(AuditConfig(datasets=[url], tokenizer=str(tmp_path / "missing")))
    assert text.startswith("note: cannot load the tokenizer")
    assert "by token ids (tokenizer unavailable)" in text
    with pytest.raises(ValueError, match="datasets"):
        AuditConfig(datasets=[])
