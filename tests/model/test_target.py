import pytest
import torch

from flashdraft.model.target import LayerTaps, Target, decoder_layers, load_target, pack_documents


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return load_target(str(smollm2_dir), dtype="float32", attn_implementation="sdpa")


def test_taps_equal_hidden_states_plus_one(smol) -> None:
    """docs/design.md §8 trap 1: id i is the output of decoder layer i = hidden_states[i + 1]."""
    ids = [0, 1, 8, 14, 20, 28]
    taps = LayerTaps(smol, ids)
    try:
        x = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            out = smol(input_ids=x, output_hidden_states=True, use_cache=False)
        features = taps.features()
        for k, i in enumerate(ids):
            torch.testing.assert_close(
                features[..., k * 576 : (k + 1) * 576], out.hidden_states[i + 1]
            )
        # hidden_states[-1] is the final-normed state, not the last layer's output.
        last = LayerTaps(smol, [29])
        with torch.inference_mode():
            out = smol(input_ids=x, output_hidden_states=True, use_cache=False)
        raw = last.features()
        assert not torch.allclose(raw, out.hidden_states[-1])
        torch.testing.assert_close(smol.model.norm(raw), out.hidden_states[-1])
        last.remove()
    finally:
        taps.remove()


def test_startup_verification_passes_and_catches_an_off_by_one(smol) -> None:
    target = Target(smol, [1, 8, 14, 20, 29], backend="sdpa")
    target.verify_taps()
    target.taps.remove()

    class InputTaps(LayerTaps):
        """A classic bug: capturing a layer's *input* (= output of layer i - 1)."""

        def __init__(self, model, layer_ids):
            super().__init__(model, [])
            self.layer_ids = list(layer_ids)
            layers = decoder_layers(model)
            for i in layer_ids:
                self._handles.append(layers[i].register_forward_pre_hook(self._pre(i)))

        def _pre(self, index):
            def hook(module, args):
                self.captured[index] = args[0]

            return hook

    broken = Target(smol, [8], backend="sdpa")
    broken.taps.remove()
    broken.taps = InputTaps(smol, [8])
    with pytest.raises(ValueError, match="layer-id convention"):
        broken.verify_taps()
    broken.taps.remove()


def test_layer_ids_outside_the_target_are_refused(smol) -> None:
    with pytest.raises(ValueError, match="0-based"):
        LayerTaps(smol, [30])


def test_packed_row_taps_and_labels_equal_documents_alone(smol) -> None:
    """Packing changes no tap: per-document positions and a document-causal mask."""
    target = Target(smol, [1, 14, 27], backend="sdpa")
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 49152, (n,), generator=gen) for n in (7, 12, 5)]
    pad = 4
    ids = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs] + [torch.arange(pad)])[None]
    doc_ids = torch.cat(
        [torch.full((len(d),), i) for i, d in enumerate(docs)] + [torch.full((pad,), -1)]
    )[None]
    label_pos = torch.arange(24)[None]
    out = target.packed_outputs(ids, positions, doc_ids, label_pos)
    packed, next_packed = out.features, out.next_tokens
    start = 0
    for i, d in enumerate(docs):
        one = target.packed_outputs(
            d[None],
            torch.arange(len(d))[None],
            torch.zeros(1, len(d), dtype=torch.long),
            torch.arange(len(d))[None],
        )
        alone, next_alone = one.features, one.next_tokens
        # SmolLM2's residual stream carries outliers of ~2.4e4, so fp32 rounding of other
        # matmul shapes moves taps by ~1e-2 absolute: compare relative to each tap's scale
        # (a leak across documents would move them by the scale itself).
        for k in range(3):
            tap = slice(k * 576, (k + 1) * 576)
            scale = float(alone[..., tap].abs().max())
            diff = float((packed[:, start : start + len(d), tap] - alone[..., tap]).abs().max())
            assert diff <= 1e-5 * scale, (i, k, diff, scale)
        assert torch.equal(next_packed[:, start : start + len(d)], next_alone), i
        # The chunked argmax equals the argmax of the full logits of a plain forward.
        with torch.inference_mode():
            logits = smol(input_ids=d[None]).logits
        assert torch.equal(next_alone, logits.argmax(-1))
        start += len(d)
    assert packed.requires_grad is False and not packed.is_inference()
    target.taps.remove()


def test_packed_soft_labels_equal_documents_alone(smol) -> None:
    """Soft labels (the target's top-k at the label positions) of a packed row are each
    document's own, beside the unchanged hard labels; usable outside inference mode."""
    target = Target(smol, [1, 14], backend="sdpa")
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 49152, (n,), generator=gen) for n in (9, 6)]
    ids, positions, doc_ids = pack_documents(docs, padding=3)
    label_pos = torch.arange(15)[None]
    hard = target.packed_outputs(ids, positions, doc_ids, label_pos).next_tokens
    out = target.packed_outputs(ids, positions, doc_ids, label_pos, chunk_rows=4, soft_top_k=8)
    assert out.soft_ids is not None and out.soft_probs is not None and out.next_tokens is not None
    assert torch.equal(out.next_tokens, hard)
    assert out.soft_ids.shape == (1, 15, 8) and not out.soft_probs.is_inference()
    start = 0
    for d in docs:
        with torch.inference_mode():
            logits = smol(input_ids=d[None]).logits[0]
        top = logits.softmax(-1).topk(8, dim=-1)
        span = slice(start, start + len(d))
        # Compared as distributions over the vocabulary: fp32 rounding of other shapes may
        # swap two near-equal tokens inside the top k.
        got = torch.zeros_like(logits).scatter(1, out.soft_ids[0, span], out.soft_probs[0, span])
        want = torch.zeros_like(logits).scatter(
            1, top.indices, top.values / top.values.sum(-1, keepdim=True)
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        start += len(d)
    target.taps.remove()


@pytest.mark.gpu
def test_packed_flex_forward_on_cuda_equals_documents_alone(tiny_qwen3_dir) -> None:
    """The CUDA target path (HF flex_attention + our document BlockMask, bf16)."""
    model = load_target(str(tiny_qwen3_dir), "bfloat16", "flex_attention", "cuda")
    target = Target(model, [1, 3, 5], backend="flex")
    target.verify_taps()
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 151000, (n,), generator=gen) for n in (300, 500, 200)]
    pad = 24
    ids = torch.cat([*docs, torch.zeros(pad, dtype=torch.long)])[None].cuda()
    positions = torch.cat([torch.arange(len(d)) for d in docs] + [torch.arange(pad)])[None].cuda()
    doc_ids = torch.cat(
        [torch.full((len(d),), i) for i, d in enumerate(docs)] + [torch.full((pad,), -1)]
    )[None].cuda()
    packed = target.packed_outputs(ids, positions, doc_ids, None).features
    start = 0
    for d in docs:
        n = len(d)
        alone = target.packed_outputs(
            d[None].cuda(),
            torch.arange(n)[None].cuda(),
            torch.zeros(1, n, dtype=torch.long).cuda(),
            None,
        ).features
        rel = (packed[:, start : start + n].float() - alone.float()).norm() / alone.float().norm()
        assert rel < 1e-2, float(rel)
        start += n


# ---- hybrid targets (Qwen3.5 / Qwen3.6 / Qwen3-Next): loading, start-up check ----


def test_a_hybrid_checkpoint_passes_the_startup_checks_packing_included(tiny_qwen3_5_dir) -> None:
    model = load_target(str(tiny_qwen3_5_dir), dtype="float32", attn_implementation="sdpa")
    assert model.config.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    target = Target(model, [1, 3, 6], backend="sdpa")
    assert target.linear is not None
    target.verify_taps()  # taps == hidden_states[i + 1], and a packed row == its documents
    # Real tokens (the Qwen3 tokenizer's ids): labels of a packed row == each document's own.
    docs = [torch.arange(1000, 1000 + n) * 7 for n in (9, 16)]
    ids, positions, doc_ids = pack_documents(docs, 3)
    out = target.packed_outputs(ids, positions, doc_ids, torch.arange(28)[None])
    features, labels = out.features, out.next_tokens
    assert features.shape == (1, 28, 3 * 64)
    with torch.inference_mode():
        alone = model(input_ids=docs[1][None]).logits.argmax(-1)
    assert torch.equal(labels[:, 9:25], alone)
    target.taps.remove()


def test_a_multimodal_qwen3_5_checkpoint_loads_as_its_language_model(tmp_path) -> None:
    """Qwen3.5 / Qwen3.6 ship as Qwen3_5ForConditionalGeneration with a vision tower: the
    target is the text model alone, with the real text config, and the same logits."""
    from tiny_models import tiny_qwen3_5
    from transformers import Qwen3_5ForConditionalGeneration

    path = tiny_qwen3_5(tmp_path / "vlm", num_layers=4, multimodal=True)
    model = load_target(str(path), dtype="float32")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert model.config.model_type == "qwen3_5_text"
    assert not any("visual" in name for name, _ in model.named_parameters())
    text = model.config
    assert (text.vocab_size, text.rope_parameters["partial_rotary_factor"]) == (151936, 0.25)
    full = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[151644, 872, 198, 9707, 151645]])
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, full(input_ids=ids).logits)
