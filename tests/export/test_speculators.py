"""vLLM's speculators layout: its fields, causality through vLLM's adapter, reload, other
trainers' configs."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_config, tiny_drafter
from safetensors.torch import load_file

from flashdraft.export.artifact import export_format, load_exported, verify_export
from flashdraft.export.dflash import load_dflash
from flashdraft.export.speculators import (
    check_speculators_config,
    from_speculators_config,
    save_speculators,
    to_speculators_config,
)


def test_speculators_config_fields() -> None:
    config = tiny_config(layer_types=["sliding_attention"] * 2, sliding_window=64)
    data = to_speculators_config(config, "Qwen/Qwen3-8B", ["Qwen3ForCausalLM"])
    check_speculators_config(data)
    assert data["speculators_model_type"] == "dflash"
    assert data["architectures"] == ["DFlashDraftModel"]
    spec = data["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [
        {
            "proposal_type": "greedy",
            "speculative_tokens": 3,  # B - 1: the anchor slot carries the bonus token
            "verifier_accept_k": 1,
            "accept_tolerance": 0.0,
        }
    ]
    assert spec["verifier"] == {
        "name_or_path": "Qwen/Qwen3-8B",
        "architectures": ["Qwen3ForCausalLM"],
    }
    # speculators / vLLM count aux layers one higher; vLLM maps back with aux - 1.
    assert data["aux_hidden_state_layer_ids"] == [2, 4]
    assert [i - 1 for i in data["aux_hidden_state_layer_ids"]] == config.target_layer_ids
    layer = data["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2
    assert layer["layer_types"] == ["sliding_attention"] * 2
    assert not {"dflash_config", "block_size", "architectures", "is_causal"} & set(layer)
    assert data["mask_token_id"] == 96 and data["block_size"] == 4
    assert data["draft_vocab_size"] == 97
    assert from_speculators_config(json.loads(json.dumps(data))) == config


def test_speculators_causality_survives_vllms_adapter() -> None:
    """vLLM turns `sliding_window_non_causal` into ONE causal flag for every
    layer (`dflash_config.causal = not sliding_window_non_causal`, PR #56692). All-full
    drafters must stay bidirectional there, all-sliding ones causal; mixed ones are refused."""
    full = to_speculators_config(tiny_config(), "t")
    assert full["sliding_window_non_causal"] is True
    sliding = tiny_config(layer_types=["sliding_attention"] * 2, sliding_window=5)
    assert to_speculators_config(sliding, "t")["sliding_window_non_causal"] is False
    mixed = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    with pytest.raises(ValueError, match="56692"):
        to_speculators_config(mixed, "t")
    # Reading another trainer's file: bidirectional sliding layers are not ours to load...
    bidirectional = {**to_speculators_config(sliding, "t"), "sliding_window_non_causal": True}
    with pytest.raises(ValueError, match="sliding_window_non_causal is true"):
        from_speculators_config(bidirectional)
    # ...while what older flashdraft exports wrote (all-full, `false`) still loads: speculators
    # itself keeps full layers bidirectional whatever the flag (only vLLM misreads it).
    old = {**full, "sliding_window_non_causal": False}
    assert from_speculators_config(old) == tiny_config()


def test_speculators_export_reload_gives_identical_weights_and_outputs(tmp_path) -> None:
    drafter = tiny_drafter()
    save_speculators(drafter, str(tmp_path), verifier="some/target")
    weights = load_file(tmp_path / "model.safetensors")
    assert set(weights) == set(drafter.state_dict())  # bare names, as vLLM expects
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    verify_export(drafter, str(tmp_path))
    assert export_format(str(tmp_path)) == "speculators"
    assert load_exported(str(tmp_path)).config == drafter.config
    with pytest.raises(ValueError, match="speculators export"):
        load_dflash(str(tmp_path))


def test_verify_export_catches_a_corrupted_speculators_export(tmp_path) -> None:
    drafter = tiny_drafter()
    save_speculators(drafter, str(tmp_path), verifier="some/target")
    data = json.loads((tmp_path / "config.json").read_text())
    data["aux_hidden_state_layer_ids"] = [1, 3]  # z-lab ids written unshifted: off by one
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="config differs"):
        verify_export(drafter, str(tmp_path))


def test_speculators_config_of_another_trainer() -> None:
    """No num_target_layers, no top-level block_size, a hub verifier we cannot read."""
    data = to_speculators_config(tiny_config(), "Qwen/Qwen3-8B")
    del data["num_target_layers"], data["block_size"]
    config = from_speculators_config(data, num_target_layers=6)
    assert config == tiny_config()
    # Lower bound: max aux id + 1 (vLLM captures the input of layer aux id), i.e. max id + 2.
    assert from_speculators_config(data).num_target_layers == 5
    broken = {**data, "speculators_config": {"proposal_methods": []}}
    with pytest.raises(ValueError, match="proposal_methods"):
        from_speculators_config(broken)
