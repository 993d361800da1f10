import json

import pytest
import torch
from helpers import tiny_config, tiny_drafter
from safetensors.torch import load_file, save_file

from flashdraft.export import (
    FORMATS,
    ExportConfig,
    check_engine_config,
    check_speculators_config,
    engine_view,
    export_format,
    from_serving_config,
    from_speculators_config,
    load_dflash,
    load_exported,
    save_dflash,
    save_export,
    save_speculators,
    to_serving_config,
    to_speculators_config,
    verify_export,
)
from flashdraft.model.drafter import DraftCache

# Fields an engine reads from a DFlash config.json (SPEC section 6, trap 9).
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


# ---- vLLM speculators layout ----


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
    """Issue 16 item 2: vLLM turns `sliding_window_non_causal` into ONE causal flag for every
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
    # ...while what flashdraft wrote before issue 16 (all-full, `false`) still loads: speculators
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


def test_export_config() -> None:
    config = ExportConfig(checkpoint="run", output="out")
    assert config.format == "dflash" and config.verifier is None
    assert FORMATS == ("dflash", "speculators")
    with pytest.raises(ValueError, match=r"^verifier = None is not allowed: the speculators"):
        ExportConfig(checkpoint="run", output="out", format="speculators")
    with pytest.raises(ValueError, match=r"^format = 'onnx'"):
        ExportConfig(checkpoint="run", output="out", format="onnx")  # type: ignore[arg-type]
    ExportConfig(checkpoint="run", output="out", format="speculators", verifier="Qwen/Qwen3-8B")


def test_save_export_writes_either_format_and_checks_the_reload(tmp_path) -> None:
    drafter = tiny_drafter()
    save_export(drafter, str(tmp_path / "dflash"))
    assert export_format(str(tmp_path / "dflash")) == "dflash"
    save_export(drafter, str(tmp_path / "spec"), "speculators", verifier="Qwen/Qwen3-8B")
    assert export_format(str(tmp_path / "spec")) == "speculators"
    with pytest.raises(ValueError, match="needs a verifier"):
        save_export(drafter, str(tmp_path / "none"), "speculators")
    assert not (tmp_path / "none").exists()


def test_save_export_refuses_a_non_empty_directory_unless_overwrite(tmp_path) -> None:
    drafter = tiny_drafter()
    save_export(drafter, str(tmp_path / "out"))
    with pytest.raises(ValueError, match="not empty; pass --overwrite"):
        save_export(drafter, str(tmp_path / "out"))
    # A sharded export left there would be read before our single file: it goes.
    index = {"weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "out" / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "out" / "model-00001-of-00002.safetensors").write_text("stale")
    save_export(tiny_drafter(seed=4), str(tmp_path / "out"), overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    with pytest.raises(ValueError, match="is a file"):
        save_export(drafter, str(tmp_path / "out" / "config.json"), overwrite=True)


# ---- config.json as the engines read it (trap 9) ----

MIXED = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}


@pytest.mark.parametrize("overrides", [{}, MIXED], ids=["full", "mixed"])
def test_the_engines_read_the_dflash_export_as_trained(tmp_path, overrides) -> None:
    config = tiny_config(**overrides)
    save_dflash(tiny_drafter(config), str(tmp_path))
    check_engine_config(str(tmp_path), config)
    view = engine_view(str(tmp_path))
    assert view["causal"] == [t == "sliding_attention" for t in config.layer_types]
    assert view["sliding_window"] == config.sliding_window
    # transformers 4.x: no rope_parameters, only rope_theta / rope_scaling.
    data = json.loads((tmp_path / "config.json").read_text())
    del data["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    check_engine_config(str(tmp_path), config)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"is_causal": True}, "causal"),  # z-lab and vLLM apply it to every layer
        ({"use_sliding_window": False}, "sliding_window"),  # Qwen3Config then drops the window
        ({"sliding_window": 4}, "sliding_window"),
        ({"rope_theta": 5.0}, "rope_theta"),
        ({"head_dim": 4}, "head_dim"),
        ({"layer_types": ["full_attention"] * 2}, "layer_types"),
        ({"dflash_config": {"mask_token_id": 96, "target_layer_ids": [2, 4]}}, "target_layer_ids"),
    ],
)
def test_the_engine_check_names_a_field_the_engines_would_read_differently(
    tmp_path, change, field
) -> None:
    config = tiny_config(**MIXED)
    save_dflash(tiny_drafter(config), str(tmp_path))
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, **change}))
    with pytest.raises(ValueError, match=f"engines read.*{field}|{field}: engines read"):
        check_engine_config(str(tmp_path), config)


def test_the_engine_check_reads_speculators_through_vllms_adapter(tmp_path) -> None:
    drafter = tiny_drafter()
    save_speculators(drafter, str(tmp_path), verifier="some/target")
    check_engine_config(str(tmp_path), drafter.config)
    assert engine_view(str(tmp_path))["causal"] == [False, False]
    data = json.loads((tmp_path / "config.json").read_text())
    data["sliding_window_non_causal"] = False  # flashdraft's export before issue 16
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"causal: engines read \[True, True\]"):
        verify_export(drafter, str(tmp_path))


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
