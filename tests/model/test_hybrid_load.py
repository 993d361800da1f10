"""Hybrid targets (docs/design.md §3) as saved and as shaped: Qwen3.5-MoE and Qwen3-Next checkpoints
loaded through `load_target`, the layer types, document segments, the 27B's default taps and
the FLOP count of its linear-attention layers. Packing exactness is in test_hybrid.py."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hybrid
from torch import nn
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeVisionConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
)

from flashdraft.model import hybrid
from flashdraft.model.config import DrafterConfig
from flashdraft.model.target import (
    Target,
    decoder_layers,
    load_target,
)

LINEAR_LINEAR_LINEAR_FULL = ["linear_attention"] * 3 + ["full_attention"]


def tiny_qwen3_5_moe_multimodal(path) -> nn.Module:
    """A tiny random Qwen3.5-MoE saved as it ships (`Qwen3_5MoeForConditionalGeneration`
    with a vision tower), its language model the weights of `tiny_hybrid("qwen3_5_moe")`;
    vocabulary 96, not the config default, so that "as saved" shows."""
    text = tiny_hybrid("qwen3_5_moe", vocab_size=96)
    vision = Qwen3_5MoeVisionConfig(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64
    )
    config = Qwen3_5MoeConfig(text_config=text.config.to_dict(), vision_config=vision.to_dict())
    full = Qwen3_5MoeForConditionalGeneration(config).eval()
    full.model.language_model.load_state_dict(text.model.state_dict())
    full.lm_head.load_state_dict(text.lm_head.state_dict())
    full.save_pretrained(path)
    return full


def test_a_multimodal_qwen3_5_moe_checkpoint_loads_as_its_language_model(tmp_path) -> None:
    """Qwen3.5/3.6-MoE ship as Qwen3_5MoeForConditionalGeneration: the target is the text
    model alone (no vision tower), with the saved text config and the same logits."""
    full = tiny_qwen3_5_moe_multimodal(tmp_path)
    model = load_target(str(tmp_path), dtype="float32", attn_implementation="sdpa")
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert model.config.model_type == "qwen3_5_moe_text"
    assert not any("visual" in name for name, _ in model.named_parameters())
    saved = full.config.text_config
    assert model.config.vocab_size == saved.vocab_size == 96
    assert model.config.layer_types == saved.layer_types == LINEAR_LINEAR_LINEAR_FULL
    rope = model.config.rope_parameters
    assert rope["partial_rotary_factor"] == 0.25 and rope["mrope_section"] == [2, 1, 1]
    ids = torch.tensor([[5, 17, 3, 90, 42, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, full(input_ids=ids).logits)
    target = Target(model, [0, 2], "sdpa")
    target.verify_taps()  # the packing check included, routing pinned
    target.taps.remove()


def test_a_qwen3_next_checkpoint_loads_through_load_target(tmp_path) -> None:
    saved = tiny_hybrid("qwen3_next")
    saved.save_pretrained(tmp_path)
    model = load_target(str(tmp_path), dtype="float32", attn_implementation="sdpa")
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    assert model.config.model_type == "qwen3_next"
    assert model.config.layer_types == saved.config.layer_types == LINEAR_LINEAR_LINEAR_FULL
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.25
    ids = torch.tensor([[5, 17, 3, 60, 42, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, saved(input_ids=ids).logits)
    target = Target(model, [0, 2], "sdpa")
    target.verify_taps()
    target.taps.remove()


def test_layer_types_and_unsupported_recurrent_layers() -> None:
    config = Qwen3_5TextConfig(num_hidden_layers=8)
    assert hybrid.is_hybrid(config)
    assert hybrid.linear_layer_ids(config) == [0, 1, 2, 4, 5, 6]
    dense = Qwen3Config(num_hidden_layers=4)
    assert not hybrid.is_hybrid(dense) and hybrid.linear_layer_ids(dense) == []
    model = tiny_hybrid("qwen3_5")
    model.config.layer_types = ["mamba", "linear_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"\['mamba'\] keep a recurrent state"):
        hybrid.gated_delta_nets(decoder_layers(model), model.config)


def test_segments_restart_at_every_document_and_row() -> None:
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 1, 1, 1, 2, 2]])
    segments = hybrid.Segments.of(doc_ids)
    assert segments.cu_seqlens.tolist() == [0, 3, 5, 6, 7, 10, 12]
    assert list(segments.spans()) == [
        (0, 0, 3),
        (0, 3, 5),
        (0, 5, 6),
        (1, 0, 1),
        (1, 1, 4),
        (1, 4, 6),
    ]
    # A document that continues across the row end is still cut there.
    assert hybrid.Segments.of(torch.tensor([[4, 4], [4, 4]])).cu_seqlens.tolist() == [0, 2, 4]


def test_the_default_taps_of_the_64_layer_27b_are_z_labs() -> None:
    """Qwen3.5/3.6-27B (64 layers, full attention every 4th) with a 5-layer drafter: the
    ids of z-lab's published drafters and `build_target_layer_ids` (dev/hybrid_taps.md),
    four Gated DeltaNet layers and one full-attention layer, each tapped at its output."""
    config = Qwen3_5TextConfig(num_hidden_layers=64)
    drafter = DrafterConfig.from_target_config(config, mask_token_id=248070, num_layers=5)
    assert drafter.target_layer_ids == [1, 16, 31, 46, 61]
    kinds = [hybrid.layer_types(config)[i] for i in drafter.target_layer_ids]
    assert kinds == ["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"] * 2


def test_delta_rule_flops_of_the_27b_geometry() -> None:
    """Qwen3.5/3.6-27B: 48 linear layers, 48 value heads of 128 x 128, chunk 64:
    48 * 48 * (6 * 128 * 128 + 64 * (3 * 128 + 2 * 128)) = 320.9 MFLOP per token."""
    config = Qwen3_5TextConfig(
        hidden_size=5120, num_hidden_layers=64, linear_num_value_heads=48,
        linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    )  # fmt: skip
    assert hybrid.delta_rule_flops_per_token(config) == 48 * 48 * (98304 + 64 * 640)
    assert hybrid.delta_rule_flops_per_token(Qwen3Config()) == 0.0


def test_flops_count_attention_only_in_attention_layers() -> None:
    model = tiny_hybrid("qwen3_5")
    target = Target(model, [1], "sdpa", linear_kernels="per-document")
    text = model.config
    params = sum(p.numel() for p in model.model.parameters()) - text.vocab_size * 64
    attention = 4 * 1 * 4 * 32 * 1000 / 2  # one full layer, 4 heads of 32, half of 1000 keys
    expected = 2 * params + attention + hybrid.delta_rule_flops_per_token(text)
    assert target.flops_per_token(1000) == pytest.approx(expected)
    target.taps.remove()
