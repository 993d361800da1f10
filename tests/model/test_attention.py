import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from flashdraft.model.attention import (
    BlockLayout,
    block_mask,
    build_mask,
    decode_mask,
    dflash_mask_mod,
    document_causal_mask_mod,
)


def _layout(valid: list[bool] | None = None) -> BlockLayout:
    # T = 10, B = 4, anchors [3, 6]; document 0 = tokens 0..4, document 1 = tokens 5..9.
    return BlockLayout(
        anchors=torch.tensor([[3, 6]]),
        anchor_valid=torch.tensor([valid or [True, True]]),
        doc_ids=torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]]),
        block_size=4,
    )


def _rows(*rows: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r.replace(" ", "")] for r in rows])


# Columns: 10 context keys | block 0 keys (4) | block 1 keys (4).
FULL = _rows(
    "1110000000 1111 0000",  # block 0 (anchor 3): context 0..2 only (strictly before the anchor)
    "1110000000 1111 0000",
    "1110000000 1111 0000",
    "1110000000 1111 0000",
    "0000010000 0000 1111",  # block 1 (anchor 6): context 5 only (document 1, before 6)
    "0000010000 0000 1111",
    "0000010000 0000 1111",
    "0000010000 0000 1111",
)
# W = 3: the query at position p = anchor + slot sees keys k with k <= p and p - k < 3 (itself
# and the two positions before it), as z-lab, vLLM and SGLang compute it. The window moves with
# the slot: slot 0 of anchor 3 sees context 1..2, slot 1 only 2, slot 2 none; slot 3 loses
# block slot 0 (W < B).
SLIDING_W3 = _rows(
    "0110000000 1000 0000",
    "0010000000 1100 0000",
    "0000000000 1110 0000",
    "0000000000 0111 0000",
    "0000010000 0000 1000",  # anchor 6: positions 4..5 in window, but 4 is in document 0
    "0000010000 0000 1100",
    "0000000000 0000 1110",
    "0000000000 0000 0111",
)


def test_hand_worked_full_mask() -> None:
    mask = build_mask(_layout(), "sdpa")
    assert mask.shape == (1, 1, 8, 18)
    assert torch.equal(mask[0, 0], FULL)


def test_hand_worked_sliding_mask() -> None:
    """docs/design.md §8 trap 5: a per-query window that moves with the slot (the old rule gave every slot
    the last W context positions before the anchor and the whole causal block)."""
    mask = build_mask(_layout(), "sdpa", sliding_window=3)
    assert torch.equal(mask[0, 0], SLIDING_W3)


def _engine_reference(layout: BlockLayout, window: int) -> torch.Tensor:
    """The engines' sliding rule written from absolute positions, one query at a time (z-lab's
    `_attention_mask`: visible iff k <= q and q - k < W) on top of the DFlash context rule."""
    rows, block, ctx = layout.num_rows, layout.block_size, layout.context_len
    num_blocks = layout.anchors.shape[1]
    out = torch.zeros(rows, layout.num_queries, ctx + layout.num_queries, dtype=torch.bool)
    for r in range(rows):
        for j in range(num_blocks):
            a = int(layout.anchors[r, j])
            for s in range(block):
                q, p = j * block + s, a + s
                for t in range(block):  # block key at position a + t
                    out[r, q, ctx + j * block + t] = a + t <= p and p - (a + t) < window
                if not layout.anchor_valid[r, j]:
                    continue
                for c in range(ctx):
                    same_doc = layout.doc_ids[r, c] == layout.doc_ids[r, a]
                    out[r, q, c] = bool(same_doc) and c < a and p - c < window
    return out[:, None]


@pytest.mark.parametrize("window", [1, 3, 6, 11])
def test_sliding_mask_equals_the_engines_rule(window: int) -> None:
    """Random packed rows, windows smaller and larger than the block (B = 4)."""
    layout = _random_layout(5, ctx=30, anchors=4)
    assert torch.equal(build_mask(layout, "sdpa", window), _engine_reference(layout, window))


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_full_mask_equals_the_rule_on_random_packed_rows(seed: int) -> None:
    """docs/design.md §8 traps 2 and 4 on random rows (many documents, padding, invalid anchors): context
    strictly before the anchor and in its document only, each block its own keys only. The
    reference reads every key's document (`doc[c] == doc[a]`); the mask_mod reads the
    document start at the anchor instead."""
    layout = _random_layout(seed, ctx=60, anchors=6)
    assert (~layout.anchor_valid).any() and len(set(layout.doc_ids[0].tolist())) > 3
    block, ctx, docs = layout.block_size, layout.context_len, layout.doc_ids
    want = torch.zeros(layout.num_rows, layout.num_queries, ctx + layout.num_queries, dtype=bool)
    for r in range(layout.num_rows):
        for j, a in enumerate(layout.anchors[r].tolist()):
            queries = slice(j * block, (j + 1) * block)
            want[r, queries, ctx + j * block : ctx + (j + 1) * block] = True  # its own block
            if layout.anchor_valid[r, j]:
                for c in range(a):
                    want[r, queries, c] = bool(docs[r, c] == docs[r, a])
    assert torch.equal(build_mask(layout, "sdpa")[:, 0], want)


def test_invalid_anchor_sees_only_its_block() -> None:
    mask = build_mask(_layout([True, False]), "sdpa")[0, 0]
    assert torch.equal(mask[:4], FULL[:4])
    assert not mask[4:, :10].any()
    assert mask[4:, 14:].all()


def test_every_query_sees_something() -> None:
    mask = build_mask(_layout([False, False]), "sdpa", sliding_window=1)
    assert mask.any(dim=-1).all()


def _random_layout(
    seed: int, rows: int = 2, ctx: int = 40, anchors: int = 5, block: int = 4, new_doc: float = 0.15
) -> BlockLayout:
    gen = torch.Generator().manual_seed(seed)
    docs = torch.cumsum((torch.rand(rows, ctx, generator=gen) < new_doc).long(), dim=1)
    docs[:, -3:] = -1  # padding tail
    anchor_idx = torch.sort(torch.randint(0, ctx - 3, (rows, anchors), generator=gen)).values
    valid = torch.rand(rows, anchors, generator=gen) < 0.8
    return BlockLayout(anchor_idx, valid, docs, block)


def _assert_same_block_mask(got, want) -> None:  # type: ignore[no-untyped-def]
    """Equal tile for tile: counts, and the indices up to each row's count (past it they are
    unused, and argsort may order them differently)."""
    assert got.BLOCK_SIZE == want.BLOCK_SIZE and got.seq_lengths == want.seq_lengths
    for name in ("kv", "full_kv", "q", "full_q"):
        counts, indices = (getattr(got, f"{name}_{part}") for part in ("num_blocks", "indices"))
        ref_counts, ref_indices = (
            getattr(want, f"{name}_{part}") for part in ("num_blocks", "indices")
        )
        assert counts.dtype == ref_counts.dtype == torch.int32, name
        assert torch.equal(counts, ref_counts), name
        used = torch.arange(indices.shape[-1], device=counts.device) < counts[..., None]
        assert torch.equal(indices[used], ref_indices[used]), name
    assert torch.equal(got.to_dense(), want.to_dense())


@pytest.mark.parametrize(
    ("window", "device"),
    [(None, "cpu"), (200, "cpu"), pytest.param(None, "cuda", marks=pytest.mark.gpu)],
)
def test_the_block_mask_is_torch_create_block_mask(window: int | None, device: str) -> None:
    """`block_mask` (tile counts compiled on CUDA, ordering eager: torch 2.11 compiled
    create_block_mask's argsort for 141 s) builds torch's own BlockMask, full tiles apart, for
    the drafter's mask over several 128-tiles (partial tiles at the ends too) and the target's
    document mask."""
    cpu = _random_layout(1, rows=2, ctx=700, anchors=40, block=16, new_doc=0.004)
    layout = BlockLayout(*(t.to(device) for t in (cpu.anchors, cpu.anchor_valid, cpu.doc_ids)), 16)  # type: ignore[arg-type]
    mask_mod = dflash_mask_mod(layout, window)
    q_len, kv_len = layout.num_queries, layout.context_len + layout.num_queries
    got = block_mask(mask_mod, 2, q_len, kv_len, torch.device(device))
    want = create_block_mask(mask_mod, 2, None, q_len, kv_len, device=device)
    _assert_same_block_mask(got, want)
    doc_mod = document_causal_mask_mod(layout.doc_ids)
    want = create_block_mask(doc_mod, 2, None, 700, 700, device=device)
    assert want.full_kv_num_blocks.sum() > 0  # the case has full tiles to tell apart
    _assert_same_block_mask(block_mask(doc_mod, 2, 700, 700, torch.device(device)), want)


@pytest.mark.parametrize("window", [None, 6])
def test_flex_block_mask_equals_dense_mask_forward(window: int | None) -> None:
    """The same mask_mod through flex_attention (BlockMask) and SDPA (dense) on CPU (forward)."""
    layout = _random_layout(0)
    q_len = layout.num_queries
    kv_len = layout.context_len + q_len
    mask_mod = dflash_mask_mod(layout, window)
    block_mask = create_block_mask(mask_mod, layout.num_rows, None, q_len, kv_len, device="cpu")
    dense = create_mask(mask_mod, layout.num_rows, None, q_len, kv_len, device="cpu")
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(layout.num_rows, 4, q_len, 8, generator=gen)
    k = torch.randn(layout.num_rows, 2, kv_len, 8, generator=gen)
    v = torch.randn(layout.num_rows, 2, kv_len, 8, generator=gen)
    out_flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    out_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    torch.testing.assert_close(out_flex, out_sdpa, rtol=1e-5, atol=1e-5)


def test_decode_mask_matches_training_mask_for_one_anchor() -> None:
    # Anchor at packed index 7 of an 8-token document: its visible context is 0..6, exactly
    # the decode-time cache when the anchor (the bonus token) sits at position 7.
    for window in (None, 3, 6):
        layout = BlockLayout(
            torch.tensor([[7]]), torch.tensor([[True]]), torch.zeros(1, 8, dtype=torch.long), 4
        )
        train = build_mask(layout, "sdpa", window)[0, 0]
        assert not train[:, 7].any()  # the anchor's own position is never context
        train = torch.cat([train[:, :7], train[:, 8:]], dim=1)
        decode = decode_mask(7, 4, window, torch.device("cpu"))
        expected = torch.ones_like(train) if decode is None else decode[0, 0]
        assert torch.equal(train, expected)
        if window is not None:  # a cache holding only context positions 2..6
            held = decode_mask(7, 4, window, torch.device("cpu"), context_start=2)
            assert held is not None and torch.equal(held[0, 0], train[:, 2:])


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 64])
def test_flex_equals_sdpa_forward_and_gradients_cuda(window: int | None) -> None:
    layout = _random_layout(2, rows=2, ctx=1024, anchors=48, block=16)
    layout = BlockLayout(
        *(t.cuda() for t in (layout.anchors, layout.anchor_valid, layout.doc_ids)), 16
    )  # type: ignore[arg-type]
    q_len, kv_len = layout.num_queries, layout.context_len + layout.num_queries
    gen = torch.Generator(device="cuda").manual_seed(3)

    def inputs() -> list[torch.Tensor]:
        shapes = [(2, 8, q_len, 64), (2, 2, kv_len, 64), (2, 2, kv_len, 64)]
        return [
            torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for s in shapes
        ]

    q, k, v = inputs()
    from flashdraft.model.attention import attend

    out_flex = attend(q, k, v, build_mask(layout, "flex", window), 0.125)
    grads_flex = torch.autograd.grad(out_flex.float().square().sum(), (q, k, v))
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out_ref = attend(q2, k2, v2, build_mask(layout, "sdpa", window), 0.125)
    grads_ref = torch.autograd.grad(out_ref.square().sum(), (q2, k2, v2))
    torch.testing.assert_close(out_flex.float(), out_ref, rtol=2e-2, atol=2e-2)
    for g_flex, g_ref in zip(grads_flex, grads_ref, strict=True):
        rel = (g_flex.float() - g_ref).norm() / g_ref.norm()
        assert rel < 2e-2, rel


def test_document_starts_are_where_each_run_of_equal_ids_begins() -> None:
    from flashdraft.model.attention import document_starts

    docs = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [5, 5, 5, 5, 5, 5, 5, 5]])
    want = [[0, 0, 0, 3, 3, 5, 6, 6], [0] * 8]
    assert document_starts(docs).tolist() == want


def test_flex_options_reach_flex_attention(monkeypatch) -> None:
    """`FLEX_OPTIONS` (set by `bench/trainer.py --flex-options`) goes to flex_attention as its
    kernel_options; empty, none are passed (torch's defaults)."""
    from flashdraft.model import attention

    seen = []

    def fake_flex(q, k, v, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs["kernel_options"])
        return q

    monkeypatch.setattr(attention, "_flex_attention", fake_flex)
    layout = _random_layout(0)
    mask = build_mask(layout, "flex")
    q = torch.zeros(2, 2, layout.num_queries, 8)
    attention.attend(q, q, q, mask, 1.0)
    monkeypatch.setitem(attention.FLEX_OPTIONS, "BLOCK_M", 64)
    attention.attend(q, q, q, mask, 1.0)
    assert seen == [None, {"BLOCK_M": 64}]
