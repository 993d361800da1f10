"""experiments/zlab_parity.py: z-lab's decode loop against flashdraft's on one export."""

from __future__ import annotations

import pytest
from helpers import script_modules


def test_zlab_parity_compares_the_steps_that_draft_a_whole_block_apart() -> None:
    """experiments/zlab_parity.py: z-lab's loop cuts its last blocks to what is left of
    max_new_tokens; the steps before that are compared on their own, the tail apart (the
    shipped drafter's code prompts differed only there)."""
    bench = script_modules("experiments", "zlab_parity")["zlab_parity"]
    # B = 4, 12 new tokens (the prefill's token and 11 from the steps): after steps of 3, 2,
    # 4 the fourth step has 12 - 10 + 1 = 3 slots left, fewer than B: three whole-block steps
    assert bench.whole_block_steps([3, 2, 4, 1, 1], 12, 4) == 3
    assert bench.whole_block_steps([2, 1], 4, 4) == 1  # 4 slots left at the first step only
    assert bench.whole_block_steps([], 12, 4) == 0
    ours = [[3, 2, 4, 1, 1], [4, 4, 2, 1]]  # whole blocks: 3 steps each
    same_head = [[3, 2, 4, 2], [4, 4, 2, 1]]
    agreement = bench.whole_block_agreement(ours, same_head, 12, 4)
    assert agreement == {"steps": 3 + 3, "identical": True, "tail_steps": 2 + 1,
                         "tail_identical": False}  # fmt: skip
    assert bench.whole_block_agreement(ours, ours, 12, 4)["tail_identical"]
    early = bench.whole_block_agreement(ours, [[3, 3, 3, 1, 1], [4, 4, 2, 1]], 12, 4)
    assert not early["identical"]
    with pytest.raises(ValueError, match="zip"):  # both lists come from the same prompts
        bench.whole_block_agreement(ours[:1], same_head, 12, 4)
