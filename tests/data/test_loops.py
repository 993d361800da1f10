"""Repetition loops: the runs `prepare --loops untrain` finds, and what it untrains."""

from __future__ import annotations

import numpy as np
import pytest

from flashdraft.data.loops import (
    find_loop,
    loop_excess,
    loop_excess_batch,
    loop_start,
    repeat_runs,
    untrain_loops,
)


def a(*parts: list[int]) -> np.ndarray:
    return np.asarray([t for part in parts for t in part], dtype=np.int32)


@pytest.mark.parametrize(
    ("ids", "runs"),
    [
        (a(list(range(50))), []),
        (a(list(range(10)), [7] * 70), [(10, 80)]),  # one token repeated
        (a(list(range(10)), [1, 2, 3] * 30, list(range(100, 110))), [(10, 100)]),  # then text
        (a([1, 2, 3] * 21), []),  # 63 tokens: under the minimum of 64
        (a(list(range(40)), list(range(200, 232)) * 2), [(40, 104)]),  # period 32, two periods
        (a(list(range(40)), list(range(200, 233)) * 3), []),  # period 33: too long
        (a([5] * 64, list(range(10)), [6, 7] * 40), [(0, 64), (74, 154)]),  # two loops
        (a([9] * 70, [8, 9] * 40), [(0, 150)]),  # overlapping runs of two periods merge
    ],
)
def test_repeat_runs(ids: np.ndarray, runs: list[tuple[int, int]]) -> None:
    assert repeat_runs(ids, min_length=64) == runs


def test_a_loop_at_the_end_is_the_eval_loop_start() -> None:
    ids = a(list(range(30)), [4, 5, 6, 7] * 40)
    assert repeat_runs(ids, min_length=128) == [(30, 190)]
    assert loop_start(ids.tolist()) == 30
    # its period: the shortest (8 and 12 repeat from the same index), None without a loop
    assert find_loop(ids.tolist()) == (30, 4)
    assert find_loop(a(list(range(5)), [9] * 130).tolist()) == (5, 1)
    assert find_loop(a(list(range(200))).tolist()) is None
    assert find_loop(a(list(range(10)), [1, 2, 3] * 30).tolist()) is None  # 90 < 128 tokens


def test_untrain_keeps_the_first_tokens_of_each_loop_and_the_context() -> None:
    ids = a(list(range(10)), [7] * 70, list(range(100, 120)))  # a loop at 10..80
    mask = np.zeros(len(ids), dtype=np.int8)
    mask[5:] = 1  # the answer starts at 5
    out, untrained = untrain_loops(ids, mask, keep=16, min_length=64)
    assert untrained == 70 - 16
    assert out[:26].tolist() == mask[:26].tolist()  # before the loop and its first 16: as was
    assert not out[26:80].any() and out[80:].all()  # the rest of the loop untrained; text after
    assert mask.sum() == len(ids) - 5  # the input is not changed
    # prompt tokens in a loop were never trained: nothing to count there
    prompt_loop = np.zeros(len(ids), dtype=np.int8)
    prompt_loop[80:] = 1
    kept, counted = untrain_loops(ids, prompt_loop, keep=16, min_length=64)
    assert counted == 0 and kept.tolist() == prompt_loop.tolist()
    same, none = untrain_loops(a(list(range(90))), mask[:90], keep=0, min_length=64)
    assert none == 0 and same.tolist() == mask[:90].tolist()


def test_the_batch_count_equals_the_per_sample_runs() -> None:
    """`loop_excess_batch` (the audit's) against `repeat_runs` one sample at a time, on
    samples with loops at their ends, at their starts, two loops, short ones, and loops that
    touch the next sample (a run never crosses a sample boundary)."""
    rng = np.random.default_rng(0)
    samples = [
        a(list(range(10)), [7] * 70),
        a([7] * 70, list(range(10))),  # starts with a loop: touches the one before
        a([1, 2] * 40, rng.integers(100, 200, 30).tolist(), [3, 4, 5] * 30),
        a([9] * 63),  # one short of a loop
        a(rng.integers(100, 200, 120).tolist()),
        a([6] * 40),
        a([6] * 40),  # with the one before: 80 tokens of 6, but two samples
        a([]),
        a([8] * 200),
    ]
    tokens = np.concatenate(samples)
    cuts = np.concatenate([[0], np.cumsum([len(x) for x in samples])])
    expected = [sum(max(0, e - s - 16) for s, e in repeat_runs(x, 64)) for x in samples]
    assert loop_excess_batch(tokens, cuts).tolist() == expected
    assert expected[:4] == [70 - 16, 70 - 16, (80 - 16) + (90 - 16), 0] and expected[5:7] == [0, 0]
    assert [loop_excess(x) for x in samples] == expected
