"""The eval report: accounting, the near-tie diagnosis, timing, plot, summary and files."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from flashdraft.data.loops import loop_start
from flashdraft.eval.prompts import EvalPrompt
from flashdraft.eval.report import (
    account_lossless,
    diagnose_mismatch,
    first_mismatch,
    format_summary,
    plot_acceptance,
    plot_path,
    prompt_entry,
    speedup,
    steps_before,
    summarize,
    timing,
    write_report,
)
from flashdraft.eval.speculative import DecodeResult

PNG = b"\x89PNG\r\n\x1a\n"


def _result(lengths: list[int], decode_s: float = 0.0, prefill_s: float = 0.0) -> DecodeResult:
    return DecodeResult(
        output_ids=list(range(sum(lengths) + 1)),
        acceptance_lengths=lengths,
        prompt_len=3,
        prefill_s=prefill_s,
        decode_s=decode_s,
        stopped_at_eos=False,
    )


def test_summary_accounting() -> None:
    results = [_result([4, 1, 2, 4]), _result([1, 3]), _result([])]
    report = summarize(results, block_size=4)
    lengths = [4, 1, 2, 4, 1, 3]
    assert report["tau"] == pytest.approx(sum(lengths) / len(lengths))
    assert report["acceptance_histogram"] == [2, 1, 1, 2]
    assert report["total_steps"] == 6 and report["decode_tokens"] == 15
    assert report["output_tokens"] == 15 + 3
    # draft k accepted iff the step emitted >= k + 1 tokens
    assert report["per_position_acceptance"] == pytest.approx([4 / 6, 3 / 6, 2 / 6])
    assert report["conditional_acceptance"] == pytest.approx([4 / 6, 3 / 4, 2 / 3])
    assert report["median_acceptance_length"] == 2.5
    assert report["prompt_tau_mean"] == pytest.approx((11 / 4 + 2) / 2)
    empty = summarize([_result([])], block_size=4)
    assert empty["tau"] is None and empty["per_position_acceptance"] == [0.0, 0.0, 0.0]
    assert plot_acceptance(report)[:8] == PNG
    assert plot_acceptance(empty)[:8] == PNG  # no steps: still a plot


@pytest.mark.parametrize(
    ("ids", "start"),
    [
        ([5] * 128, 0),  # "no no no ..." from the first token
        (list(range(20)) + [7, 8, 9] * 43, 20),  # a period of 3 after an answer
        (list(range(100)) + list(range(32)) * 4, 100),  # the longest period counted: 32
        (list(range(100)) + list(range(33)) * 4, None),  # 33: too long
        ([1, 2] + [5] * 127, None),  # a repeating tail of 127 tokens: too short to tell
        ([5] * 200 + [6], None),  # the loop broken at the end (e.g. by an end of turn)
        (list(range(300)), None),
        ([4, 5, 4, 5] + [1, 2, 3] * 50, 4),  # the earliest start over the periods
    ],
)
def test_loop_start(ids: list[int], start: int | None) -> None:
    assert loop_start(ids) == start


def test_tau_before_the_outputs_fall_into_a_loop() -> None:
    # 12 tokens of answer, then one token forever; steps emit 1 (prefill) + 3 + 4 + 5 ...
    looping = DecodeResult(list(range(12)) + [9] * 190, [3, 4, 5] + [15] * 12 + [9], 3, 0, 0, False)
    assert loop_start(looping.output_ids) == 12  # the answer is indices 0-11
    assert steps_before(looping, 12) == [3, 4]  # the third step emits indices 8-12
    assert steps_before(looping, None) == looping.acceptance_lengths
    report = summarize([_result([4, 1, 2, 4]), looping, _result([1, 3])], block_size=16)
    assert report["loop_prompts"] == 1
    assert report["tau_before_loops"] == pytest.approx((11 + 7 + 4) / 8)
    assert report["tau"] == pytest.approx((11 + 201 + 4) / 22)
    assert summarize([_result([2])], block_size=4)["loop_prompts"] == 0
    entry = prompt_entry(EvalPrompt("p", [1, 2, 3]), looping, None, None, 0.0)
    assert (
        entry["loop_start"] == 12
        and prompt_entry(EvalPrompt("q", [1]), _result([2]), None, None, 0.0)["loop_start"] is None
    )
    report["settings"] = {"block_size": 16, "temperature": 0.0}
    assert format_summary(report).splitlines()[3] == (
        "1 of 3 outputs end in a repetition loop (easy to draft): tau before the loops 2.750"
    )
    only = summarize([DecodeResult([9] * 200, [15] * 13 + [4], 3, 0, 0, False)], block_size=16)
    assert only["loop_prompts"] == 1 and only["tau_before_loops"] is None


def test_first_mismatch() -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2  # one output stops early
    assert first_mismatch([1, 2, 3], [1, 2]) == 2


def test_prompt_entry_claims_losslessness_only_at_t0_with_a_baseline() -> None:
    prompt = EvalPrompt("p", [7, 8, 9])
    result, same, other = _result([2, 1]), _result([2, 1]), _result([1, 1, 1])
    other.output_ids[2] = 99
    entry = prompt_entry(prompt, result, same, None, 0.0)
    assert entry["id"] == "p" and entry["prompt_tokens"] == 3 and entry["text"] is None
    assert entry["lossless"] is True and entry["first_mismatch"] is None
    entry = prompt_entry(prompt, result, other, None, 0.0)
    assert entry["lossless"] is False and entry["first_mismatch"] == 2
    assert "lossless" not in prompt_entry(prompt, result, same, None, 0.7)
    assert "lossless" not in prompt_entry(prompt, result, None, None, 0.0)


def test_timing_and_speedup() -> None:
    spec = [_result([4, 4], decode_s=0.02, prefill_s=0.5), _result([2], decode_s=0.01)]
    base = [_result([1] * 8, decode_s=0.08), _result([1, 1], decode_s=0.02)]
    times = timing(spec, base)
    assert times["decode_tokens"] == 10 and times["baseline_decode_tokens"] == 10
    assert times["prefill_s"] == 0.5 and times["decode_s"] == 0.03
    assert times["time_per_output_token_ms"] == 3.0
    assert times["baseline_time_per_output_token_ms"] == 10.0
    assert speedup(times) == pytest.approx(10 / 3, abs=1e-4)
    alone = timing(spec, [])
    assert "baseline_decode_s" not in alone and speedup(alone) is None


# ---- a T = 0 output that leaves the baseline: near-tie of the target, or a bug ----


class _TableLogits(torch.nn.Module):
    """A 'target' whose logits depend only on the position: row p of `table` predicts the token
    at position p + 1, whatever the tokens are (enough to teacher-force a diagnosis)."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table), requires_grad=False)

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        rows = self.table[: input_ids.shape[1]][None]
        return SimpleNamespace(logits=rows[:, -logits_to_keep:] if logits_to_keep else rows)


FLAT = [5.0, 0.0, 0.0, 0.0]  # token 0 is the clear choice
TIE = [0.0, 12.30, 12.05, 3.0]  # tokens 1 and 2 are 0.25 apart
WIDE = [0.0, 12.30, 10.00, 3.0]


@pytest.mark.parametrize(
    ("at_index_2", "then", "near_tie", "worst"),
    [
        (TIE, 0, True, 0.25),  # a flipped tie, then the target's choice on the new branch
        (WIDE, 0, False, 2.3),  # token 2 is 2.3 below the choice: not a tie
        (TIE, 3, False, 5.0),  # a tie at 2, then a token the target would never pick
    ],
)
def test_mismatch_diagnosis(at_index_2, then, near_tie, worst) -> None:
    prompt, output = [0], [0, 0, 2, then]  # greedy would have emitted token 1 at index 2
    # row p predicts the token at position p + 1: the prompt is position 0, output[i] is i + 1
    target = _TableLogits([FLAT, FLAT, at_index_2, FLAT])
    out = diagnose_mismatch(target, prompt, output, index=2, tolerance=0.5)
    assert out["index"] == 2 and out["token"] == 2 and out["near_tie"] is near_tie
    assert out["worst_below_top"] == pytest.approx(worst, abs=1e-5)
    assert ("reason" in out) is not near_tie


def test_mismatch_diagnosis_of_an_early_stop() -> None:
    out = diagnose_mismatch(_TableLogits([FLAT] * 4), [0], [0, 0], index=2, tolerance=0.5)
    assert out["near_tie"] is False and "stops early" in out["reason"]


def test_lossless_accounting_counts_identical_near_tie_and_unexplained_prompts() -> None:
    target = _TableLogits([FLAT, FLAT, TIE, FLAT])
    prompts = [EvalPrompt(str(i), [0]) for i in range(3)]
    entries = [
        {"output_ids": [0, 0, 1, 0], "first_mismatch": None},  # identical
        {"output_ids": [0, 0, 2, 0], "first_mismatch": 2},  # a flipped tie
        {"output_ids": [0, 0, 2, 3], "first_mismatch": 2},  # then a token never picked
    ]
    counts = account_lossless(target, prompts, entries, tolerance=0.5)
    assert counts == {
        "lossless": False,
        "lossless_prompts": 1,
        "near_tie_prompts": 1,
        "unexplained_mismatch_prompts": 1,
        "lossless_up_to_ties": False,
    }
    assert "mismatch" not in entries[0]
    assert entries[1]["mismatch"]["near_tie"] and not entries[2]["mismatch"]["near_tie"]


# ---- output ----


def _report(**extra: object) -> dict:
    report = summarize([_result([4, 1, 2])], block_size=4)
    report["settings"] = {"block_size": 4, "temperature": 0.0, "tie_tolerance": 0.5}
    report.update(extra)
    return report


def test_format_summary() -> None:
    lossless = {"lossless": True, "lossless_prompts": 1}
    assert format_summary(_report(**lossless)).splitlines() == [
        "tau 2.333",
        "prompts 1  steps 3  output tokens 8",
        "per-position acceptance 0.67 0.33 0.33",
        "lossless True (1/1 identical to the target's greedy decoding)",
    ]
    broken = {
        "lossless": False,
        "lossless_prompts": 0,
        "near_tie_prompts": 1,
        "unexplained_mismatch_prompts": 0,
        "speedup": 1.8734,
    }
    lines = format_summary(_report(**broken)).splitlines()
    assert lines[-2] == (
        "lossless False (0/1 identical to the target's greedy decoding; 1 diverge only where "
        "the target's logits are within 0.5 of a tie, 0 unexplained)"
    )
    assert lines[-1] == "speedup 1.87x (decode time per token, B=1 / B)"
    fast = {"decoder": "static", "graphs": True, "compiled": True, "batch_size": 1}
    same = format_summary(_report(speedup=2.5, loops={"speculative": fast, "baseline": fast}))
    assert same.splitlines()[-1] == (
        "speedup 2.50x (decode time per token, B=1 / B); both loops: static KV cache, "
        "compiled, CUDA graphs, batch 1"
    )
    slow = {"decoder": "hf", "graphs": False, "compiled": False, "batch_size": 1}
    mixed = format_summary(_report(speedup=2.5, loops={"speculative": fast, "baseline": slow}))
    assert mixed.splitlines()[-1].endswith(
        "; B: static KV cache, compiled, CUDA graphs, batch 1; B=1: HF DynamicCache, eager "
        "kernels, batch 1"
    )
    empty = summarize([_result([])], block_size=4)
    assert format_summary(empty).splitlines()[0] == "tau n/a (no verify steps)"


def test_write_report_puts_the_plot_beside_the_json(tmp_path) -> None:
    assert plot_path("runs/r.json") == "runs/r.png"
    assert plot_path("runs/report") == "runs/report.png"
    report = _report()
    plot = write_report(report, str(tmp_path / "eval.json"))
    assert plot == str(tmp_path / "eval.png")
    assert json.loads((tmp_path / "eval.json").read_text()) == report
    assert (tmp_path / "eval.png").read_bytes()[:8] == PNG
