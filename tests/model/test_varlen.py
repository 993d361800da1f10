"""The varlen target path (`target.attn_implementation = "varlen"`): the documents' boundaries
instead of a mask give the taps and labels of the masked path; outside a packed forward it is
sdpa; targets it cannot serve are refused with the reason; a run with it trains the same."""

from __future__ import annotations

import pytest
import torch
from helpers import read_metrics, train_settings
from transformers import Qwen3Config

from flashdraft import cli
from flashdraft.model import varlen
from flashdraft.model.target import Target, load_target, pack_documents


def _row(lengths: tuple[int, ...], padding: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 151000, (n,), generator=gen) for n in lengths]
    return pack_documents(docs, padding)


def test_segments_start_at_every_document_and_every_row() -> None:
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [4, 4, 5, 5, 5, 5]])
    segments = varlen.document_segments(doc_ids)
    assert segments.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12]
    assert segments.cu_seqlens.dtype == torch.int32 and segments.max_len == 4
    # The same document id on both sides of a row boundary is still two segments.
    same = varlen.document_segments(torch.zeros(2, 3, dtype=torch.long))
    assert same.cu_seqlens.tolist() == [0, 3, 6] and same.max_len == 3


@pytest.fixture(scope="module")
def targets(tiny_qwen3_dir):
    """The tiny Qwen3 (GQA: 4 query heads, 2 K/V heads) loaded with sdpa and with varlen."""
    varlen.register()
    sdpa = load_target(str(tiny_qwen3_dir), "float32", "sdpa")
    var = load_target(str(tiny_qwen3_dir), "float32", varlen.NAME)
    plain = Target(sdpa, [1, 3, 5], backend="sdpa")
    packed = Target(var, [1, 3, 5], backend="sdpa")
    assert packed.varlen and not plain.varlen
    yield plain, packed
    plain.taps.remove()
    packed.taps.remove()


def test_packed_rows_give_the_masked_paths_taps_and_labels(targets) -> None:
    """Two stacked rows of documents and padding: the same taps and next tokens as the
    document mask gives, with the boundaries computed from the rows (as the trainer does,
    on the CPU) or from the device tensors (no `segments` given)."""
    plain, packed = targets
    rows = [_row((13, 30, 9), 4, seed=1), _row((40, 16), 0, seed=2)]
    ids, positions, doc_ids = (torch.cat([r[i] for r in rows]) for i in range(3))
    where = torch.arange(ids.shape[1])[None].expand(2, -1)
    want = plain.packed_outputs(ids, positions, doc_ids, where)
    for segments in (varlen.document_segments(doc_ids), None):
        got = packed.packed_outputs(ids, positions, doc_ids, where, segments=segments)
        torch.testing.assert_close(got.features, want.features, rtol=1e-5, atol=1e-5)
        assert got.next_tokens is not None and want.next_tokens is not None
        assert torch.equal(got.next_tokens, want.next_tokens)


def test_outside_a_packed_forward_it_is_sdpa_and_the_startup_checks_pass(targets) -> None:
    plain, packed = targets
    packed.verify_taps()  # a single document through the model's own forward
    ids = _row((21,), 0, seed=3)[0]
    with torch.inference_mode():
        a = plain.model(input_ids=ids).logits
        b = packed.model(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("release", ["2.10", "2.11", "2.13"])
def test_the_kernel_call_fits_each_torch_release(monkeypatch, release) -> None:
    """The arguments handed to torch's varlen_attn, by a stand-in kernel of each release's
    signature (causal spelling, scale, the GQA flag) that computes per segment: the result is
    the CPU path's, with a non-default scale and 2 query heads per K/V head. K/V always
    arrive with their own 2 heads (the flash kernel serves the groups; repeating them was two
    copies per layer), and 2.13's wrapper refuses unequal heads without `enable_gqa`, as
    torch's does."""
    calls = []

    def per_segment(q, k, v, cu_q, max_q, scale):
        assert k.shape[1] == v.shape[1] == 2 and q.shape[1] == 4  # not repeated
        return varlen._each_segment(q, k, v, varlen.Segments(cu_q, max_q), scale, 2)

    def v210(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        assert is_causal
        calls.append("2.10")
        return per_segment(q, k, v, cu_q, max_q, None)

    def v211(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert window_size == (-1, 0) and scale is not None
        calls.append("2.11")
        return per_segment(q, k, v, cu_q, max_q, scale)

    def v213(
        q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        if not enable_gqa and q.shape[1] != k.shape[1]:
            raise ValueError("unequal heads: set enable_gqa=True")
        assert window_size == (-1, 0) and scale is not None
        calls.append("2.13")
        return per_segment(q, k, v, cu_q, max_q, scale)

    fn = {"2.10": v210, "2.11": v211, "2.13": v213}[release]
    causal = {"is_causal": True} if fn is v210 else {"window_size": (-1, 0)}
    kernel = varlen._Kernel(fn, causal, fn is not v210, fn is v213)
    monkeypatch.setattr(varlen, "_KERNEL", kernel)
    monkeypatch.setattr(varlen, "uses_kernel", lambda query: True)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 10, 8, generator=gen)
    k, v = (torch.randn(2, 2, 10, 8, generator=gen) for _ in range(2))
    segments = varlen.document_segments(torch.tensor([[0] * 6 + [1] * 4, [2] * 10]))
    with varlen.packed(segments):
        got, _ = varlen.varlen_attention(torch.nn.Module(), q, k, v, None, scaling=0.2)
    flat = [t.transpose(1, 2).reshape(20, t.shape[1], 8) for t in (q, k, v)]
    want = varlen._each_segment(*flat, segments, 0.2, 2).view(2, 10, 4, 8)
    torch.testing.assert_close(got, want)
    assert calls == [release]


def test_targets_it_cannot_serve_are_refused_with_the_reason() -> None:
    assert varlen.refusal(Qwen3Config()) is None
    sliding = Qwen3Config(use_sliding_window=True, sliding_window=128, max_window_layers=0)
    assert "sliding" in (varlen.refusal(sliding) or "")
    mixed = Qwen3Config(layer_types=["full_attention", "sliding_attention"], num_hidden_layers=2)
    assert "layer types" in (varlen.refusal(mixed) or "")
    assert "at most 256" in (varlen.refusal(Qwen3Config(head_dim=512)) or "")
    assert varlen.refusal(Qwen3Config(head_dim=256)) is None


def test_a_run_with_the_varlen_target_trains_as_the_masked_one(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    """`--set target.attn_implementation="varlen"`: the same losses and labels step by step
    as the default (sdpa on the CPU) at fp32 rounding."""
    runs = {}
    for name, extra in (("mask", {}), ("varlen", {"target.attn_implementation": '"varlen"'})):
        settings = {"optim.max_steps": 3, "log.every": 1, "checkpoint.every": 3, **extra}
        out = tmp_path / name
        assert cli.main(["train", *train_settings(out, tiny_qwen3_dir, qwen_data, **settings)]) == 0
        runs[name] = read_metrics(out)
    for a, b in zip(runs["mask"], runs["varlen"], strict=True):
        assert a["step"] == b["step"] and a["trained_slots"] == b["trained_slots"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


@pytest.mark.gpu
def test_the_flash_kernel_gives_the_flex_paths_taps_on_cuda(tiny_qwen3_dir) -> None:
    """bf16 on CUDA: the varlen kernel (two stacked rows, GQA) against flex with the
    document BlockMask, and against the segment-by-segment SDPA of the CPU path."""
    varlen.register()
    flex = Target(
        load_target(str(tiny_qwen3_dir), "bfloat16", "flex_attention", "cuda"), [1, 3, 5], "flex"
    )
    var = Target(
        load_target(str(tiny_qwen3_dir), "bfloat16", varlen.NAME, "cuda"), [1, 3, 5], "flex"
    )
    rows = [_row((300, 500, 200), 24, seed=4), _row((700, 324), 0, seed=5)]
    ids, positions, doc_ids = (torch.cat([r[i] for r in rows]).cuda() for i in range(3))
    segments = varlen.document_segments(doc_ids.cpu())
    want = flex.packed_outputs(ids, positions, doc_ids, None).features.float()
    got = var.packed_outputs(ids, positions, doc_ids, None, segments=segments).features.float()
    assert varlen.uses_kernel(torch.empty(1, device="cuda", dtype=torch.bfloat16))
    assert float((got - want).norm() / want.norm()) < 1e-2
