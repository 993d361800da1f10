"""Hybrid targets (docs/design.md §3, trap 11): linear-attention layers packed exactly, on tiny random
Qwen3.5, Qwen3.5-MoE and Qwen3-Next models (layers linear, linear, linear, full)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import types

import pytest
import torch
from helpers import tiny_hybrid, tiny_llama

from flashdraft.model import hybrid, varlen
from flashdraft.model.routing import PinnedRouting
from flashdraft.model.target import (
    PACKING_TOLERANCE,
    Target,
    decoder_layers,
    default_attention,
    pack_documents,
    tap_errors,
)

KINDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
LENGTHS = [[37, 50, 11], [90, 20], [1, 2, 3, 100]]  # row 1 ends in padding; 1-token docs
ROW = 112


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    return tiny_hybrid(request.param)


def packed_batch(
    vocab: int,
) -> tuple[list[list[torch.Tensor]], torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    docs = [[torch.randint(0, vocab, (n,), generator=gen) for n in row] for row in LENGTHS]
    rows = [pack_documents(row, ROW - sum(len(d) for d in row)) for row in docs]
    ids, positions, doc_ids = (torch.cat(parts) for parts in zip(*rows, strict=True))
    return docs, ids, positions, doc_ids


def every_tap(model, **kwargs) -> Target:
    return Target(model, list(range(len(decoder_layers(model)))), "sdpa", **kwargs)


def assert_packed_equals_alone(target: Target, rtol: float) -> None:
    """Every layer's output (linear and full) and the labels, per document."""
    vocab = target.head.vocab_size
    docs, ids, positions, doc_ids = packed_batch(vocab)
    every = torch.arange(ROW).expand(len(docs), ROW)
    out = target.packed_outputs(ids, positions, doc_ids, every)
    features, labels = out.features, out.next_tokens
    assert labels is not None
    hidden = target.config.hidden_size
    for r, row in enumerate(docs):
        start = 0
        for doc in row:
            with torch.inference_mode():
                logits = target.model(input_ids=doc[None], use_cache=False).logits
            alone = target.taps.features()
            got = features[r : r + 1, start : start + len(doc)]
            for layer in range(target.num_layers):
                cut = slice(layer * hidden, (layer + 1) * hidden)
                scale = float(alone[..., cut].abs().max())
                diff = float((got[..., cut] - alone[..., cut]).abs().max())
                assert diff <= rtol * scale, (r, len(doc), layer, diff, scale)
            assert torch.equal(labels[r, start : start + len(doc)], logits[0].argmax(-1))
            start += len(doc)


def test_the_reference_rule_is_torch_s_even_where_transformers_bound_fla(monkeypatch) -> None:
    """transformers binds `torch_chunk_gated_delta_rule` to fla's kernel when fla was
    importable at its first import; the reference kernels must still be the torch
    arithmetic (unwrapped), or on a machine with fla they would compare fla with fla."""
    import functools

    from transformers.models.qwen3_5 import modeling_qwen3_5

    torch_rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)

    @functools.wraps(torch_rule)
    def bound_to_fla(*args, **kwargs):
        raise AssertionError("the reference called the fla-bound wrapper")

    monkeypatch.setattr(modeling_qwen3_5, "torch_chunk_gated_delta_rule", bound_to_fla)
    torch.manual_seed(0)
    q, k = torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
    v, g, beta = torch.randn(1, 10, 4, 8), -torch.rand(1, 10, 4), torch.rand(1, 10, 4)
    segments = hybrid.Segments(torch.tensor([0, 4, 10]), torch.tensor([0, 4, 10]), 1, 10)
    out = hybrid.REFERENCE_KERNELS.rule(q, k, v, g, beta, segments)
    assert out.shape == (1, 10, 4, 8) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("path", "attention"),
    [("per-document", "sdpa"), ("reference kernels", "sdpa"), ("per-document", "varlen")],
)
def test_packed_rows_equal_documents_alone_for_every_layer_type(model, path, attention) -> None:
    """Every layer's output and the labels, per document; the full-attention layers with the
    document mask (sdpa) or through the varlen path (the documents' boundaries, no mask; on
    the CPU each document through SDPA alone) beside the linear layers' own packing."""
    kernels = hybrid.REFERENCE_KERNELS if path == "reference kernels" else "per-document"
    if attention == "varlen":
        varlen.register()
        model.set_attn_implementation(varlen.NAME)
    target = every_tap(model, linear_kernels=kernels)
    try:
        assert target.varlen is (attention == "varlen")
        assert_packed_equals_alone(target, rtol=1e-5)
    finally:
        target.taps.remove()
        assert target.linear is not None
        target.linear.remove()
        model.set_attn_implementation("sdpa")


def test_a_mask_alone_leaks_across_documents(model, monkeypatch) -> None:
    """The test above can fail: without the linear layers' restart, documents leak."""
    target = every_tap(model, linear_kernels="per-document")
    assert target.linear is not None
    monkeypatch.setattr(target.linear, "packed", lambda doc_ids: contextlib.nullcontext())
    try:
        with pytest.raises(AssertionError):
            assert_packed_equals_alone(target, rtol=1e-2)
    finally:
        target.taps.remove()
        target.linear.remove()


def test_the_startup_check_refuses_a_leaking_packing(model, monkeypatch) -> None:
    target = Target(model, [0, 2], "sdpa", linear_kernels="per-document")
    assert target.linear is not None
    target.verify_taps()  # the exact path passes, packing check included
    monkeypatch.setattr(target.linear, "packed", lambda doc_ids: contextlib.nullcontext())
    with pytest.raises(ValueError, match="leak into each other through the linear-attention"):
        target.verify_taps()
    target.taps.remove()
    target.linear.remove()


@pytest.mark.parametrize(
    ("first", "second", "refusal"),
    [
        (5e-4, 5e-4, None),  # the kernels' rounding, the same in both documents: passes
        (5e-4, 5e-3, "leak into each other"),  # more in the second document: a leak
        (5e-3, 5e-3, "nothing precedes the first document"),  # the path itself is off
    ],
)
def test_the_startup_check_holds_later_documents_to_the_first_ones_rounding(
    monkeypatch, first, second, refusal
) -> None:
    """The first document of the check's row has nothing before it to leak from, so its
    difference from its run alone is the packed path's own rounding (bounded by
    PATH_TOLERANCE: a random 27B-shaped target in bf16 shows 0.015-0.093 there); a later
    document may exceed it by PACKING_TOLERANCE only. Rounding is simulated by scaling the
    reference taps (relative error = the scale - 1; fp32 tolerances 1e-4 and 1e-3)."""
    target = Target(tiny_hybrid("qwen3_5"), [0, 2], "sdpa", linear_kernels="per-document")
    alone = target._document_alone
    calls = []

    def off_by(doc):
        taps, labels, logits = alone(doc)
        calls.append(len(doc))
        return taps * (1 + (first if len(calls) == 1 else second)), labels, logits

    monkeypatch.setattr(target, "_document_alone", off_by)
    try:
        if refusal is None:
            target.verify_packing()
        else:
            with pytest.raises(ValueError, match=refusal):
                target.verify_packing()
    finally:
        target.taps.remove()
        assert target.linear is not None
        target.linear.remove()


def leaky_conv_kernels() -> hybrid.VarlenKernels:
    """The reference kernels with the convolution run over whole rows: its state crosses each
    document start inside a row, while the delta rule's state still restarts there."""

    def conv(x, weight, activation, segments):
        starts = torch.arange(0, segments.rows * segments.length + 1, segments.length)
        rows = hybrid.Segments(starts, starts, segments.rows, segments.length)
        return hybrid.REFERENCE_KERNELS.conv(x, weight, activation, rows)

    return hybrid.VarlenKernels("convolution leak", conv, hybrid.REFERENCE_KERNELS.rule)


def test_in_bf16_the_startup_check_refuses_a_leak_confined_to_the_convolution() -> None:
    """bf16 tolerances are loose (PACKING_TOLERANCE 5e-2). A leaked convolution state reaches
    the first kernel - 1 = 3 tokens of a document directly; over the check's whole 14-token
    second document its error is diluted below the tolerance (0.046 on this model), over
    those 3 tokens alone it is not (0.093): the check compares both. The exact paths pass."""
    model = tiny_hybrid("qwen3_5", std=0.05).to(torch.bfloat16)
    for exact in (hybrid.REFERENCE_KERNELS, "per-document"):
        target = Target(model, [0], "sdpa", linear_kernels=exact)
        target.verify_taps()  # the start-up check, packing included
        target.taps.remove()
        assert target.linear is not None
        target.linear.remove()
    target = Target(model, [0], "sdpa", linear_kernels=leaky_conv_kernels())
    try:
        # The second document of the check's row, as the check measures it.
        gen = torch.Generator().manual_seed(1)
        docs = [torch.randint(0, 64, (n,), generator=gen) for n in (21, 14)]
        ids, positions, doc_ids = pack_documents(docs, 5)
        packed = target.packed_outputs(ids, positions, doc_ids, None).features[0, 21:35]
        alone = target._document_alone(docs[1])[0]
        (whole,) = tap_errors(packed, alone, target.taps)
        (head,) = tap_errors(packed[:3], alone[:3], target.taps)
        assert whole < PACKING_TOLERANCE[torch.bfloat16] < head, (whole, head)
        with pytest.raises(ValueError, match=r"over its first 3 tokens .* leak into each other"):
            target.verify_taps()
    finally:
        target.taps.remove()
        assert target.linear is not None
        target.linear.remove()


def test_on_the_cpu_the_fallback_is_taken_and_announced(capsys) -> None:
    model = tiny_hybrid("qwen3_5")
    assert hybrid.choose_kernels(torch.device("cpu"))[0] is None
    target = Target(model, [1, 2], "sdpa")
    assert target.linear is not None and target.linear.kernels is None
    out = capsys.readouterr().out
    assert out.count("per-document fallback") == 1
    assert "3 of 4 target layers are linear attention" in out
    # Outside a packed forward the layers are the model's own: nothing is wrapped for decode.
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        wrapped = model(input_ids=ids).logits
        target.linear.remove()
        plain = model(input_ids=ids).logits
    assert torch.equal(wrapped, plain)
    target.taps.remove()


def install_fake_fla(monkeypatch, version: str = "0.6.0") -> None:
    """An `fla` package with fla-core 0.6's signatures (B = 1, cu_seqlens, tuple returns)
    computed by the torch reference: checks how flashdraft calls fla, without a GPU."""

    def segments(x: torch.Tensor, cu: torch.Tensor, cu_cpu: torch.Tensor) -> hybrid.Segments:
        assert x.shape[0] == 1, "fla's varlen kernels take one flattened sequence"
        assert torch.equal(cu.cpu(), cu_cpu) and int(cu_cpu[-1]) == x.shape[1]
        return hybrid.Segments(cu, cu_cpu, 1, x.shape[1])

    def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None,
                      output_final_state=False, activation=None, backend="triton",
                      cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):  # fmt: skip
        assert bias is None and initial_state is None and weight.shape == (x.shape[-1], 4)
        seg = segments(x, cu_seqlens, cu_seqlens_cpu)
        return hybrid.REFERENCE_KERNELS.conv(x, weight, activation, seg), None

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                               cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):  # fmt: skip
        assert use_qk_l2norm_in_kernel and initial_state is None and scale is None
        assert g.dtype == torch.float32 and v.shape[2] % q.shape[2] == 0  # grouped value heads
        seg = segments(q, cu_seqlens, cu_seqlens_cpu)
        return hybrid.REFERENCE_KERNELS.rule(q, k, v, g, beta, seg), None

    # transformers binds its fla-or-torch kernels when a hybrid's modeling module is first
    # imported: import them now, with the real environment, or the stand-in stays bound for
    # the rest of the process and later tests in this worker call it
    for kind in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    modules = {name: types.ModuleType(name) for name in FLA_MODULES}
    modules["fla"].__version__ = version  # type: ignore[attr-defined]
    modules["fla.modules.causal_conv1d"].causal_conv1d = causal_conv1d  # type: ignore[attr-defined]
    modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = chunk_gated_delta_rule  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


FLA_MODULES = ["fla", "fla.modules", "fla.modules.causal_conv1d", "fla.ops",
               "fla.ops.gated_delta_rule"]  # fmt: skip


def test_on_cuda_fla_is_chosen_and_called_as_its_api_says(model, monkeypatch) -> None:
    install_fake_fla(monkeypatch)
    kernels, _ = hybrid.choose_kernels(torch.device("cuda"))
    assert kernels is not None and kernels.name == "fla 0.6.0"
    target = every_tap(model, linear_kernels=kernels)
    try:
        assert_packed_equals_alone(target, rtol=1e-5)
    finally:
        target.taps.remove()
        assert target.linear is not None
        target.linear.remove()
    install_fake_fla(monkeypatch, version="0.4.0")
    kernels, why = hybrid.choose_kernels(torch.device("cuda"))
    assert kernels is None and "needs fla-core >= 0.5" in why


def test_hybrids_never_load_with_flex_on_cuda_and_take_a_dense_mask_under_sdpa(tmp_path) -> None:
    """transformers refuses flex_attention for the hybrid classes: `flashdraft train` on CUDA
    must not ask for it (it did: a load-time ValueError on the first GPU run); they take the
    varlen path where torch has its kernel, else sdpa, and a Target given the trainer's "flex"
    backend builds the dense mask their sdpa layers take."""
    hybrid_dir, dense_dir = tmp_path / "hybrid", tmp_path / "dense"
    model = tiny_hybrid("qwen3_5")
    model.save_pretrained(hybrid_dir)
    tiny_llama().save_pretrained(dense_dir)
    assert default_attention(str(hybrid_dir), "cuda") == (
        "varlen" if varlen.available() else "sdpa"
    )
    # a full-attention target takes the varlen flash path where torch has its kernel
    want = "varlen" if varlen.available() else "flex_attention"
    assert default_attention(str(dense_dir), "cuda") == want
    assert default_attention(str(dense_dir), "cpu") == "sdpa"
    flex = Target(model, [0, 3], "flex", linear_kernels="per-document")
    assert flex.backend == "sdpa"
    _, ids, positions, doc_ids = packed_batch(model.config.vocab_size)
    got = flex.packed_outputs(ids, positions, doc_ids, None).features
    flex.taps.remove()
    assert flex.linear is not None
    flex.linear.remove()
    plain = Target(model, [0, 3], "sdpa", linear_kernels="per-document")
    want = plain.packed_outputs(ids, positions, doc_ids, None).features
    plain.taps.remove()
    assert plain.linear is not None
    plain.linear.remove()
    assert torch.equal(got, want)


def test_rollback_puts_a_hybrid_cache_back_exactly(model) -> None:
    """Prefill, feed 5 tokens, take them back, feed 2: as if only the 2 were ever fed."""
    prompt, extra = torch.tensor([[7, 3, 9, 1, 4, 4]]), torch.tensor([[5, 8, 2, 6, 1]])
    with torch.inference_mode():
        cache = hybrid.decode_cache(model)
        model(input_ids=prompt, cache=cache, use_cache=True)
        rollback = hybrid.LinearStateRollback(cache)
        saved = rollback.save()
        model(input_ids=extra, cache=cache, use_cache=True)
        rollback.rewind(saved, 5)
        assert cache.get_seq_length() == 6
        got = model(input_ids=extra[:, :2], cache=cache, use_cache=True).logits
        full = model(input_ids=torch.cat([prompt, extra[:, :2]], 1), use_cache=False).logits
    torch.testing.assert_close(got, full[:, -2:], rtol=1e-4, atol=1e-4)
    # Without the rollback the states have absorbed the 5 tokens: a different continuation.
    with torch.inference_mode():
        model(input_ids=extra[:, 2:], cache=cache, use_cache=True)
        drifted = model(input_ids=extra[:, :1], cache=cache, use_cache=True).logits
        fresh = model(input_ids=torch.cat([prompt, extra[:, :1]], 1), use_cache=False).logits
    assert not torch.allclose(drifted[:, -1], fresh[:, -1], atol=1e-2)


# ---- GPU: fla's varlen kernels against the per-document fallback (bf16) ----


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_fla_varlen_layers_equal_each_document_alone_on_cuda(kind) -> None:
    """Each Gated DeltaNet layer on the same packed input: fla's varlen kernels vs the
    module's own forward per document (bf16). Per layer, so that the MoE kinds' routing,
    which a bf16 rounding difference can flip for a token, does not hide a kernel error or
    fake one (the whole-model comparison below is for the dense-FFN kind)."""
    kernels, why = hybrid.fla_kernels()
    if kernels is None:
        pytest.skip(why)
    model = tiny_hybrid(kind).to("cuda", torch.bfloat16)
    _, _, _, doc_ids = packed_batch(model.config.vocab_size)
    segments = hybrid.Segments.of(doc_ids.cuda())
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows, length = doc_ids.shape
    x = torch.randn(1, rows * length, model.config.hidden_size, generator=gen, device="cuda")
    x = x.to(torch.bfloat16)
    layers = decoder_layers(model)
    with torch.inference_mode():
        for i, module in enumerate(hybrid.gated_delta_nets(layers, model.config)):
            packed = hybrid.gated_delta_net_varlen(module, x, segments, kernels)
            alone = torch.cat([module(x[:, s:e]) for s, e in segments.flat()], dim=1)
            error = float((packed.float() - alone.float()).norm() / alone.float().norm())
            assert error < 2e-2, (kind, i, error)


def packed_path_errors(kind: str, kernels, device: str) -> tuple[list, list]:
    """Per row and tapped layer, the relative error against the fp32 per-document forward of
    the same weights (torch arithmetic, the MoE kinds' expert routing recorded there and
    replayed) of: the bf16 packed path with `kernels`, and the bf16 per-document path."""
    reference = tiny_hybrid(kind).to(device)
    model = tiny_hybrid(kind).to(device, torch.bfloat16)
    docs, ids, positions, doc_ids = packed_batch(model.config.vocab_size)
    ids, positions, doc_ids = ids.to(device), positions.to(device), doc_ids.to(device)
    pins, bf16_pins = PinnedRouting(reference), PinnedRouting(model)
    outputs = []
    for net, choice, routes in (
        (reference, hybrid.REFERENCE_KERNELS, pins.record()),
        (model, kernels, bf16_pins.replay(0, ids.numel())),
        (model, "per-document", bf16_pins.replay(0, ids.numel())),
    ):
        bf16_pins.recorded = pins.recorded
        target = every_tap(net, linear_kernels=choice)
        with routes:
            outputs.append(target.packed_outputs(ids, positions, doc_ids, None).features)
        target.taps.remove()
        assert target.linear is not None
        target.linear.remove()
    exact, packed, per_doc = outputs
    hidden = model.config.hidden_size

    def errors(got):  # per row, per layer: a failure says where the paths part
        rows = []
        for r, row in enumerate(docs):
            real = sum(len(d) for d in row)
            a, b = got[r, :real].float(), exact[r, :real].float()
            cuts = [slice(i * hidden, (i + 1) * hidden) for i in range(a.shape[-1] // hidden)]
            rows.append([float((a[:, c] - b[:, c]).norm() / b[:, c].norm()) for c in cuts])
        return rows

    return errors(packed), errors(per_doc)


def assert_within_bf16_noise(kind: str, packed: list, per_doc: list) -> None:
    """The packed path may differ from exact only as much as bf16 itself does. A leak across
    documents is far above that (the issue: 1.0 after the first full-attention layer); bf16
    alone is ~2% after four layers of these random models, the level the 2026-12-01 H200
    run's fixed 2e-2 bound sat on (qwen3_5_moe failed it with its routing pinned)."""
    for p_row, d_row in zip(packed, per_doc, strict=True):
        for p, d in zip(p_row, d_row, strict=True):
            assert p <= 1.5 * d + 5e-3, (kind, [[round(e, 4) for e in r] for r in packed], per_doc)


def test_the_bf16_noise_bound_holds_with_reference_kernels_on_cpu() -> None:
    """The GPU test's measurement on the CPU, the reference kernels standing in for fla."""
    packed, per_doc = packed_path_errors("qwen3_5_moe", hybrid.REFERENCE_KERNELS, "cpu")
    assert 1e-3 < max(max(r) for r in per_doc) < 5e-2  # bf16 noise is measured, not zero
    assert_within_bf16_noise("qwen3_5_moe", packed, per_doc)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_fla_varlen_path_equals_the_per_document_path_on_cuda(kind) -> None:
    """The whole model: fla's packed path vs exact, within what the per-document path's own
    bf16 rounding gives (the MoE kinds with the exact run's expert routing replayed in both:
    without it they differed by 0.04-0.11 on the first H200 run, routing flips under bf16)."""
    kernels, why = hybrid.fla_kernels()
    if kernels is None:
        pytest.skip(why)
    packed, per_doc = packed_path_errors(kind, kernels, "cuda")
    assert_within_bf16_noise(kind, packed, per_doc)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_fla_target_passes_the_startup_check_on_cuda(kind) -> None:
    """In bf16, the MoE kinds too (their routing pinned by the check)."""
    kernels, why = hybrid.fla_kernels()
    if kernels is None:
        pytest.skip(why)
    model = tiny_hybrid(kind).to("cuda", torch.bfloat16)
    target = Target(model, [0, 1, 3], "sdpa")  # "auto": fla on CUDA
    assert target.linear is not None and target.linear.kernels is not None
    target.verify_taps()
    target.taps.remove()
    target.linear.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_varlen_attention_target_passes_the_startup_check_on_cuda(kind) -> None:
    """bf16, fla's linear kernels and the flash varlen kernel in the attention layers: the
    start-up check (packed row vs each document alone) passes."""
    kernels, why = hybrid.fla_kernels()
    if kernels is None or not varlen.available():
        pytest.skip(why if kernels is None else "torch has no varlen flash kernel")
    varlen.register()
    model = tiny_hybrid(kind).to("cuda", torch.bfloat16)
    model.set_attn_implementation(varlen.NAME)
    target = Target(model, [0, 1, 3], "sdpa")
    assert target.varlen and target.linear is not None
    target.verify_taps()
    target.taps.remove()
    target.linear.remove()
