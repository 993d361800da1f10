"""An export's config as the engines read it (docs/design.md §6, trap 9).

`engine_view` re-reads config.json with transformers' `AutoConfig`, as z-lab's dflash, vLLM
and SGLang do (a speculators config through vLLM's adapter first), and takes the fields their
DFlash models use; `check_engine_config` names every field that differs from the drafter as
it was trained (`expected_engine_view`), and a hybrid target's partial / multimodal RoPE keys
if they leaked into the export.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

from flashdraft import storage
from flashdraft.export.dflash import SCALING, read_scaling
from flashdraft.export.speculators import vllm_translation
from flashdraft.model.config import TARGET_ONLY_ROPE_KEYS, DrafterConfig, rope_parameters_of

_GEOMETRY = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
)


def engine_view(url: str) -> dict[str, Any]:
    """What z-lab's dflash, vLLM and SGLang take from the export at `url`, read the way they
    read it: config.json (a speculators one translated as vLLM does) parsed by transformers'
    `AutoConfig`, then the fields their DFlash models use. Causality per layer follows
    z-lab's `Qwen3DFlashAttention` and vLLM's `_dflash_layer_causal`: `is_causal` (and, in
    vLLM, `dflash_config.causal`) forces every layer, else sliding layers are causal."""
    from transformers import AutoConfig

    data = storage.read_json(storage.join(url, "config.json"))
    if "speculators_model_type" in data:
        data = vllm_translation(data)
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/config.json", "w") as f:
            json.dump(data, f)
        hf = AutoConfig.from_pretrained(tmp)
    dflash = dict(getattr(hf, "dflash_config", None) or {})
    layers = int(hf.num_hidden_layers)
    layer_types = list(getattr(hf, "layer_types", None) or ["full_attention"] * layers)
    forced = getattr(hf, "is_causal", None)
    forced = dflash.get("causal") if forced is None else forced
    sliding = "sliding_attention" in layer_types
    return {
        **{k: getattr(hf, k, None) for k in _GEOMETRY},
        "hidden_act": getattr(hf, "hidden_act", None),
        "attention_bias": getattr(hf, "attention_bias", None),
        "rope_parameters": rope_parameters_of(hf),
        "rope_theta (transformers 4.x)": data.get("rope_theta"),
        "layer_types": layer_types,
        "sliding_window": getattr(hf, "sliding_window", None) if sliding else None,
        "causal": [
            t == "sliding_attention" if forced is None else bool(forced) for t in layer_types
        ],
        "block_size": dflash.get("block_size", getattr(hf, "block_size", None)),
        "mask_token_id": dflash.get("mask_token_id"),
        "target_layer_ids": dflash.get("target_layer_ids"),
        **read_scaling(dflash, hf.to_dict()),
    }


def expected_engine_view(config: DrafterConfig) -> dict[str, Any]:
    """`engine_view` of a correct export of `config`: the drafter as it was trained."""
    sliding = "sliding_attention" in config.layer_types
    return {
        **{k: getattr(config, k) for k in _GEOMETRY},
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_parameters": dict(config.rope_parameters),
        "rope_theta (transformers 4.x)": config.rope_parameters["rope_theta"],
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window if sliding else None,
        "causal": [t == "sliding_attention" for t in config.layer_types],
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        **{k: getattr(config, k) for k in SCALING},
    }


def check_engine_config(url: str, config: DrafterConfig) -> None:
    """ValueError naming every field an engine would read differently from `config`, and
    any target-only RoPE key (`TARGET_ONLY_ROPE_KEYS`) an engine would apply to it."""
    view, want = engine_view(url), expected_engine_view(config)
    problems = []
    # Compared key by key below (transformers adds derived keys), a leaked key would pass:
    # the drafter rotates whole heads, whatever its config says.
    leaked = [k for k in TARGET_ONLY_ROPE_KEYS if k in view["rope_parameters"]]
    if leaked:
        problems.append(
            f"rope_parameters: engines read the target's {leaked}, but the drafter rotates "
            "whole heads (vLLM would rotate only part of each)"
        )
    for key, expected in want.items():
        got = view[key]
        if key == "rope_parameters":  # transformers may add derived keys; ours must match
            got = {k: got.get(k) for k in expected}
        if got != expected:
            problems.append(f"{key}: engines read {got!r}, the drafter has {expected!r}")
    if problems:
        raise ValueError(
            "export check failed (config.json as the engines read it): " + "; ".join(problems)
        )
