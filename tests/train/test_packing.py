import numpy as np
import pytest
import torch

from flashdraft.train.packing import RowStream, build_row, plan_epoch


def _lengths(n: int = 300, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, 400, n)


def test_plan_packs_every_document_once_within_budget() -> None:
    lengths = _lengths()
    plan = plan_epoch(lengths, 1024, seed=0, epoch=0)
    seen = sorted(p.sample for row in plan.rows for p in row)
    assert seen == list(range(len(lengths)))
    assert all(sum(p.length for p in row) <= 1024 for row in plan.rows)
    assert plan.tokens == int(lengths.sum())
    assert plan.tokens / (len(plan.rows) * 1024) > 0.95  # best fit keeps padding low


def test_plan_is_seeded_per_epoch() -> None:
    lengths = _lengths()
    a, b = plan_epoch(lengths, 1024, 0, 0), plan_epoch(lengths, 1024, 0, 0)
    assert a.rows == b.rows
    assert plan_epoch(lengths, 1024, 0, 1).rows != a.rows
    assert plan_epoch(lengths, 1024, 1, 0).rows != a.rows


@pytest.mark.parametrize(
    ("policy", "pieces", "counts"),
    [("split", 3, (1, 0, 0)), ("truncate", 1, (0, 1, 0)), ("drop", 0, (0, 0, 1))],
)
def test_overlong_documents_are_handled_and_counted(policy, pieces, counts) -> None:
    plan = plan_epoch(np.array([250, 40]), 100, 0, 0, overlong=policy)
    long_pieces = [p for row in plan.rows for p in row if p.sample == 0]
    assert len(long_pieces) == pieces
    assert (plan.split, plan.truncated, plan.dropped) == counts
    if policy == "split":
        assert sorted((p.start, p.length) for p in long_pieces) == [(0, 100), (100, 100), (200, 50)]


def _dataset(lengths):
    rng = np.random.default_rng(1)
    data = [
        (rng.integers(0, 1000, n).astype(np.int32), (rng.random(n) < 0.6).astype(np.int8))
        for n in lengths
    ]
    return data, lambda i: data[i]


def test_build_row_lays_out_documents_positions_and_padding() -> None:
    data, sample = _dataset([5, 7, 250])
    plan = plan_epoch(np.array([5, 7, 250]), 100, 0, 0, shuffle=False)
    row = build_row(
        plan.rows[0], sample, 100, num_anchors=8, block_size=4, seed=0, epoch=0, index=0
    )
    first = plan.rows[0]
    at = 0
    for doc, piece in enumerate(first):
        ids, mask = data[piece.sample]
        seg = slice(at, at + piece.length)
        assert row.input_ids[seg].tolist() == ids[piece.start : piece.start + piece.length].tolist()
        assert (
            row.loss_mask[seg].tolist() == mask[piece.start : piece.start + piece.length].tolist()
        )
        assert row.position_ids[seg].tolist() == list(
            range(piece.start, piece.start + piece.length)
        )
        assert (row.doc_ids[seg] == doc).all()
        at += piece.length
    assert (row.doc_ids[at:] == -1).all() and (row.loss_mask[at:] == 0).all()
    assert row.tokens == at
    # Anchors are candidates of this row and the normaliser mask matches them.
    assert row.normaliser_mask[~row.anchor_valid].sum() == 0
    assert (row.normaliser_mask[row.anchor_valid][:, 1] == 1).all()


def test_split_pieces_keep_their_true_positions() -> None:
    _, sample = _dataset([250])
    plan = plan_epoch(np.array([250]), 100, 0, 0, shuffle=False)
    row = build_row(plan.rows[1], sample, 100, 8, 4, 0, 0, 1)
    assert row.position_ids[:100].tolist() == list(range(100, 200))


def _stream(epochs: int = 2) -> RowStream:
    lengths = _lengths(80)
    _, sample = _dataset(lengths)
    return RowStream(
        lengths,
        sample,
        row_tokens=512,
        num_anchors=16,
        block_size=4,
        seed=3,
        epochs=epochs,
        overlong="split",
        shuffle=True,
    )


def test_stream_positions_cross_epochs_and_rows_do_not_depend_on_who_builds_them() -> None:
    stream = _stream()
    per_epoch = len(stream.plan(0).rows)
    assert stream.locate(per_epoch) == (1, 0)
    assert stream.total_rows() == per_epoch + len(stream.plan(1).rows)
    a = stream.row(per_epoch + 2)
    b = _stream().row(per_epoch + 2)  # a fresh stream, e.g. another rank or a resumed run
    assert torch.equal(a.anchors, b.anchors) and torch.equal(a.input_ids, b.input_ids)
    with pytest.raises(IndexError):
        stream.locate(stream.total_rows())


def test_prefetch_yields_the_same_rows_as_inline() -> None:
    stream = _stream()
    positions = [0, 3, 5, 9, 10]
    inline = list(stream.iterate(iter(positions), prefetch=0))
    ahead = list(stream.iterate(iter(positions), prefetch=3))
    for x, y in zip(inline, ahead, strict=True):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.anchors, y.anchors)


def test_prefetch_surfaces_loader_errors() -> None:
    stream = _stream()
    with pytest.raises(IndexError):
        list(stream.iterate(iter([0, 10_000]), prefetch=2))


def test_each_epoch_is_planned_once_while_streaming_across_epochs(monkeypatch) -> None:
    """Locating positions and logging must not replan earlier epochs (seconds each at scale)."""
    import flashdraft.train.packing as packing

    calls: list[int] = []
    real = packing.plan_epoch

    def counting(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(packing, "plan_epoch", counting)
    stream = _stream(epochs=3)
    total = stream.total_rows()
    assert calls == [0, 1, 2]
    calls.clear()
    for position in range(total):
        stream.row(position)
        stream.locate(position)
    assert calls == [0, 1, 2]  # each epoch planned again exactly once, in order
