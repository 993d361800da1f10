import math

import pytest
import torch

from flashdraft.train.blocks import (
    allocate_anchors,
    anchor_candidates,
    block_inputs,
    block_labels,
    data_next_tokens,
    label_positions,
    mix_argmax,
    sample_anchors,
    slot_weights,
)


def test_candidates_need_a_trained_next_token_in_the_same_document() -> None:
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 0])
    docs = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, -1])
    cand = anchor_candidates(loss_mask, docs)
    # a=1 (next 2 trained), 2, 3; a=6 -> next is 7 (trained) but 6 is doc 1's first token too.
    assert cand.nonzero().flatten().tolist() == [1, 2, 3, 6, 7]
    # a=8: next token is padding (doc -1) -> never; a=9 is last -> never.


def test_allocation_is_exact_fair_and_bounded() -> None:
    assert allocate_anchors([3, 4], 10) == [3, 4]  # everything fits
    counts = [1000, 10, 10, 10]
    take = allocate_anchors(counts, 100)
    assert sum(take) == 100
    assert all(0 <= t <= c for t, c in zip(take, counts, strict=True))
    assert min(take[1:]) >= 10  # short documents get their floor share (budget / (2 * docs))
    assert take[0] > 50  # the long document still gets most of the rest
    for counts, budget in [([5, 0, 7, 300], 64), ([1] * 200, 64), ([90, 90], 7)]:
        take = allocate_anchors(counts, budget)
        assert sum(take) == budget and all(t <= c for t, c in zip(take, counts, strict=True))


def test_sample_anchors_distinct_sorted_padded_and_seeded() -> None:
    loss_mask = torch.tensor([0, 1, 1, 1, 1, 1, 0, 1, 1, 1] * 20)
    docs = torch.arange(200) // 50
    cand = set(anchor_candidates(loss_mask, docs).nonzero().flatten().tolist())
    anchors, valid = sample_anchors(loss_mask, docs, 32, torch.Generator().manual_seed(0))
    assert valid.all() and len(anchors) == 32
    picked = anchors.tolist()
    assert picked == sorted(set(picked)) and set(picked) <= cand
    assert {p // 50 for p in picked} == {0, 1, 2, 3}  # every document is represented
    again, _ = sample_anchors(loss_mask, docs, 32, torch.Generator().manual_seed(0))
    other, _ = sample_anchors(loss_mask, docs, 32, torch.Generator().manual_seed(1))
    assert torch.equal(anchors, again) and not torch.equal(anchors, other)
    # More budget than candidates: all candidates, then padding marked invalid.
    anchors, valid = sample_anchors(loss_mask, docs, 500, torch.Generator().manual_seed(0))
    assert int(valid.sum()) == len(cand)
    assert set(anchors[valid].tolist()) == cand and (anchors[~valid] == 0).all()


def test_block_inputs_tokens_and_positions() -> None:
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])  # two packed documents
    blocks, positions = block_inputs(ids, pos, torch.tensor([[1, 4]]), 3, mask_token_id=99)
    assert blocks.tolist() == [[11, 99, 99, 14, 99, 99]]
    # Positions are per document: anchor 4 is position 1 of the second document.
    assert positions.tolist() == [[1, 2, 3, 1, 2, 3]]


def test_labels_are_the_target_prediction_for_each_slot_not_shifted() -> None:
    """docs/design.md §8 trap 3: slot k's label is the target's argmax at a + k - 1 (= its guess of x_{a+k})."""
    ids = torch.arange(100, 112)[None]  # token at packed index i is 100 + i
    # A perfect target: its argmax at position p is the next data token x_{p+1}.
    argmax = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    loss_mask = torch.ones(1, 12, dtype=torch.long)
    docs = torch.zeros(1, 12, dtype=torch.long)
    anchors, valid = torch.tensor([[2, 9]]), torch.tensor([[True, True]])
    positions = label_positions(anchors, 4, 12)
    assert positions.tolist() == [[[2, 3, 4], [9, 10, 11]]]
    next_tokens = argmax.gather(1, positions.flatten(1)).view(positions.shape)
    labels, mask = block_labels(next_tokens, loss_mask, docs, anchors, valid, 4)
    # Slot k of anchor a must predict x_{a+k}.
    assert labels[0, 0].tolist() == [0, 103, 104, 105]
    assert mask[0, 0].tolist() == [0, 1, 1, 1]
    # Anchor 9: slots 1, 2 exist (x_10, x_11), slot 3 would be x_12, past the row: weight 0.
    assert labels[0, 1, 1:3].tolist() == [110, 111]
    assert mask[0, 1].tolist() == [0, 1, 1, 0]
    assert torch.equal(data_next_tokens(ids, anchors, 4)[0, 0], torch.tensor([103, 104, 105]))


def test_label_mask_stops_at_document_end_untrained_tokens_and_invalid_anchors() -> None:
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 1]])
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    anchors, valid = torch.tensor([[1, 3, 5]]), torch.tensor([[True, True, False]])
    next_tokens = torch.zeros(1, 3, 3, dtype=torch.long)
    _, mask = block_labels(next_tokens, loss_mask, docs, anchors, valid, 4)
    assert mask[0, 0].tolist() == [0, 1, 0, 1]  # x_3 is untrained (user turn), x_4 is trained
    assert mask[0, 1].tolist() == [0, 1, 0, 0]  # x_5.. belong to the next document
    assert mask[0, 2].tolist() == [0, 0, 0, 0]  # padding anchor


def test_slot_weights() -> None:
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[8]), math.exp(-1.0), rel_tol=1e-6)
    with pytest.raises(ValueError):
        slot_weights(16, 0.0)


def test_mix_argmax_moves_a_share_of_the_mass_onto_the_argmax() -> None:
    ids = torch.tensor([[7, 3, 9], [2, 5, 8]])
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    argmax = torch.tensor([7, 2])
    assert mix_argmax(ids, probs, argmax, 0.0) is probs  # off: untouched
    half = mix_argmax(ids, probs, argmax, 0.5)
    assert torch.allclose(half, torch.tensor([[0.75, 0.15, 0.1], [0.8, 0.15, 0.05]]))
    assert torch.allclose(half.sum(-1), torch.ones(2))
    assert torch.equal(mix_argmax(ids, probs, argmax, 1.0), torch.tensor([[1.0, 0, 0], [1, 0, 0]]))
    # The argmax need not be the first of the top k (topk and argmax may order ties apart).
    tied = mix_argmax(torch.tensor([[3, 7, 9]]), torch.tensor([[0.4, 0.4, 0.2]]), argmax[:1], 1.0)
    assert tied.tolist() == [[0.0, 1.0, 0.0]]
