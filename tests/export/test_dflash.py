"""The dflash serving format: config.json fields, bf16 bare-name weights, loading ours
and z-lab's, the target's scaling fields."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_config, tiny_drafter, tiny_hybrid
from safetensors.torch import load_file, save_file

from flashdraft.export.artifact import save_export, verify_export
from flashdraft.export.dflash import (
    from_serving_config,
    load_dflash,
    save_dflash,
    to_serving_config,
)
from flashdraft.export.engine import check_engine_config
from flashdraft.export.speculators import to_speculators_config
from flashdraft.model.config import TARGET_ONLY_ROPE_KEYS, DrafterConfig
from flashdraft.model.drafter import DraftCache

# Fields an engine reads from a DFlash config.json (docs/design.md §6, trap 9).
REQUIRED_FIELDS = {
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "hidden_act",
    "attention_bias",
    "tie_word_embeddings",
    "block_size",
    "num_target_layers",
    "dflash_config",
    "layer_types",
}


def test_serving_config_fields() -> None:
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    data = to_serving_config(config)
    assert set(data) >= REQUIRED_FIELDS
    assert data["architectures"] == ["DFlashDraftModel"] and data["model_type"] == "qwen3"
    assert data["dflash_config"]["mask_token_id"] == 96
    assert data["dflash_config"]["target_layer_ids"] == [1, 3]  # z-lab ids, not +1
    assert data["tie_word_embeddings"] is False and data["attention_bias"] is False
    assert data["sliding_window"] == 64 and data["use_sliding_window"] is True
    assert from_serving_config(json.loads(json.dumps(data))) == config


def test_export_reload_gives_identical_weights_and_outputs(tmp_path) -> None:
    drafter = tiny_drafter()
    save_dflash(drafter, str(tmp_path))
    weights = load_file(tmp_path / "model.safetensors")
    assert set(weights) == set(drafter.state_dict())
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert not any(
        "embed" in k or "lm_head" in k or k.startswith(("model.", "_orig_mod")) for k in weights
    )
    verify_export(drafter, str(tmp_path))
    reloaded = load_dflash(str(tmp_path), dtype=torch.float32)
    cache = DraftCache()
    hidden = torch.randn(1, 5, 64)
    reloaded.extend_cache(cache, hidden, torch.arange(5)[None])
    assert reloaded.draft_block(cache, torch.randn(1, 4, 32), 5).shape == (1, 4, 32)


def test_loads_a_zlab_style_config(tmp_path) -> None:
    """z-lab's published configs: transformers-4 rope fields, block_size top-level only."""
    drafter = tiny_drafter()
    save_dflash(drafter, str(tmp_path))
    data = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "use_sliding_window", "max_window_layers"):
        data.pop(key)
    data["dflash_config"].pop("block_size")
    data["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (tmp_path / "config.json").write_text(json.dumps(data))
    reloaded = load_dflash(str(tmp_path))
    assert reloaded.config == drafter.config


def test_unknown_weight_names_are_an_error_not_silently_ignored(tmp_path) -> None:
    drafter = tiny_drafter()
    save_dflash(drafter, str(tmp_path))
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.fc.weight"] = weights.pop("fc.weight")  # a trainer prefix left in
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected"):
        load_dflash(str(tmp_path))


def test_not_a_drafter(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        load_dflash(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_dflash(str(tmp_path / "missing"))


def test_target_scaling_is_written_where_zlab_reads_it(tmp_path) -> None:
    config = tiny_config(input_embedding_scale=8.0, output_multiplier=0.25)
    data = to_serving_config(config)
    assert data["dflash_config"]["input_embedding_scale"] == 8.0
    assert data["dflash_config"]["output_multiplier"] == 0.25
    assert "final_logit_softcapping" not in data["dflash_config"]  # absent = none
    assert "input_embedding_scale" not in to_serving_config(tiny_config())["dflash_config"]
    assert from_serving_config(json.loads(json.dumps(data))) == config
    save_export(tiny_drafter(config), str(tmp_path))  # the engine check included
    with pytest.raises(ValueError, match="scales its embedding or logits"):
        to_speculators_config(config, "t")


def test_a_hybrid_targets_drafter_exports_without_the_targets_rope_keys(tmp_path) -> None:
    """Qwen3.5's partial (0.25) multimodal RoPE is the target's: the drafter rotates whole
    heads, so its config.json carries none of those keys, and the engine check refuses one
    that leaked in, wherever an engine would read it."""
    target = tiny_hybrid("qwen3_5")
    assert set(TARGET_ONLY_ROPE_KEYS) <= set(target.config.rope_parameters)
    config = DrafterConfig.from_target_config(
        target.config, mask_token_id=63, num_layers=2, target_layer_ids=[0, 2]
    )
    save_export(tiny_drafter(config), str(tmp_path))  # the engine check included
    data = json.loads((tmp_path / "config.json").read_text())
    for place in (data, data["rope_parameters"], data["rope_scaling"] or {}):
        assert not set(TARGET_ONLY_ROPE_KEYS) & set(place)
    assert data["rope_parameters"]["rope_theta"] == 10_000_000.0  # the target's theta kept
    rope = data["rope_parameters"]
    for leak in (
        {"rope_parameters": {**rope, "partial_rotary_factor": 0.25}},
        {"partial_rotary_factor": 0.25},  # top level: transformers 4.x configs
        {"rope_parameters": {**rope, "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
    ):
        (tmp_path / "config.json").write_text(json.dumps({**data, **leak}))
        with pytest.raises(ValueError, match=r"rope_parameters: engines read the target's \["):
            check_engine_config(str(tmp_path), config)
