"""The `dflash` serving format (docs/design.md §6): what vLLM, SGLang and z-lab's `dflash` load
unchanged.

`config.json` is a Qwen3 config with `architectures: ["DFlashDraftModel"]`, `block_size`,
`num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids, ...}` and
`layer_types` (per-layer causality: every engine makes sliding layers causal and full layers
bidirectional, unless a config sets `is_causal`, which is never written); `model.safetensors`
holds bf16 weights under the drafter's bare parameter names (no embedding, no lm_head, no
trainer prefixes). `load_dflash` reads ours and the drafters z-lab publishes. The weights
helpers (`write_weights`, `load_weights`) serve the speculators layout too: same file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flashdraft import storage
from flashdraft.log import get_logger
from flashdraft.model.config import DrafterConfig, default_target_layer_ids
from flashdraft.model.drafter import DFlashDrafter

log = get_logger(__name__)

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# z-lab's `dflash_config` names for the target's scaling (`DrafterConfig` fields), defaults.
SCALING = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def to_serving_config(config: DrafterConfig) -> dict[str, Any]:
    rope = dict(config.rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    sliding = "sliding_attention" in config.layer_types
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        # transformers 4.x reads rope_theta / rope_scaling, 5.x rope_parameters: write both.
        "rope_theta": rope["rope_theta"],
        "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None,
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": config.initializer_range,
        "use_cache": False,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
            **scaling_fields(config),
        },
        "layer_types": list(config.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window if sliding else None,
        "max_window_layers": config.num_hidden_layers,
    }


def scaling_fields(config: DrafterConfig) -> dict[str, Any]:
    """The target scaling fields that differ from z-lab's defaults (absent means default)."""
    return {k: getattr(config, k) for k, d in SCALING.items() if getattr(config, k) != d}


def from_serving_config(data: dict[str, Any]) -> DrafterConfig:
    """A DrafterConfig from a serving config.json (ours or z-lab's)."""
    arch = (data.get("architectures") or [""])[0]
    if arch != ARCHITECTURE:
        raise ValueError(
            f"config.json names architecture {arch!r}, not {ARCHITECTURE!r}: not a DFlash drafter"
        )
    dflash = data.get("dflash_config") or {}
    layers = int(data["num_hidden_layers"])
    num_target_layers = int(data["num_target_layers"])
    ids = dflash.get("target_layer_ids") or default_target_layer_ids(num_target_layers, layers)
    mask_token_id = dflash.get("mask_token_id", data.get("mask_token_id"))
    if mask_token_id is None:
        raise ValueError("config.json has no dflash_config.mask_token_id")
    if isinstance(data.get("rope_parameters"), dict):
        rope = dict(data["rope_parameters"])
    else:
        rope = {"rope_type": "default", **(data.get("rope_scaling") or {})}
        rope["rope_theta"] = float(data["rope_theta"])
        if "type" in rope:
            rope["rope_type"] = rope.pop("type")
    layer_types = data.get("layer_types")
    if not layer_types:
        windowed = data.get("use_sliding_window") and data.get("sliding_window")
        first = int(data.get("max_window_layers", layers))
        layer_types = [
            "sliding_attention" if windowed and i >= first else "full_attention"
            for i in range(layers)
        ]
    sliding = "sliding_attention" in layer_types
    heads = int(data["num_attention_heads"])
    return DrafterConfig(
        hidden_size=int(data["hidden_size"]),
        intermediate_size=int(data["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_parameters=rope,
        max_position_embeddings=int(data.get("max_position_embeddings", 40960)),
        vocab_size=int(data["vocab_size"]),
        block_size=int(data.get("block_size") or dflash.get("block_size") or 16),
        num_target_layers=num_target_layers,
        target_layer_ids=[int(i) for i in ids],
        mask_token_id=int(mask_token_id),
        layer_types=list(layer_types),
        sliding_window=int(data["sliding_window"]) if sliding else None,
        initializer_range=float(data.get("initializer_range", 0.02)),
        **read_scaling(dflash, data),
    )


def read_scaling(dflash: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """The scaling fields as z-lab reads them: dflash_config first, then the top level; a
    softcap <= 0 means none."""
    out = {k: dflash.get(k, data.get(k, d)) for k, d in SCALING.items()}
    if out["final_logit_softcapping"] is not None and out["final_logit_softcapping"] <= 0:
        out["final_logit_softcapping"] = None
    return out


def serving_state_dict(drafter: DFlashDrafter) -> dict[str, Tensor]:
    """bf16, contiguous, bare names: exactly what goes into model.safetensors."""
    return {
        k: v.detach().to("cpu", torch.bfloat16).contiguous()
        for k, v in drafter.state_dict().items()
    }


def save_dflash(drafter: DFlashDrafter, url: str) -> None:
    """Write config.json + model.safetensors to `url` (a directory; local or fsspec)."""
    scaled = scaling_fields(drafter.config)
    if scaled:
        # z-lab's dflash applies all three; vLLM's qwen3_dflash.py (036a00d) and SGLang's
        # models/dflash.py (003b23d) read none of them from dflash_config.
        log.warning(
            f"the target scales its embedding or logits ({scaled}): written to dflash_config "
            "for z-lab's dflash; vLLM and SGLang do not read these fields for DFlash drafters"
        )
    write_weights(drafter, url)
    storage.write_json_atomic(storage.join(url, "config.json"), to_serving_config(drafter.config))


def write_weights(drafter: DFlashDrafter, url: str) -> None:
    storage.makedirs(url)
    storage.write_tensors(storage.join(url, WEIGHTS), serving_state_dict(drafter), {"format": "pt"})


def _read_weights(url: str) -> dict[str, Tensor]:
    index_url = storage.join(url, WEIGHTS_INDEX)
    files = (
        sorted(set(storage.read_json(index_url)["weight_map"].values()))
        if storage.exists(index_url)
        else [WEIGHTS]
    )
    weights: dict[str, Tensor] = {}
    for name in files:
        weights.update(storage.read_tensors(storage.join(url, name)))
    return weights


def load_dflash(url: str, dtype: torch.dtype = torch.bfloat16) -> DFlashDrafter:
    """Load a serving-format drafter (ours or a published z-lab one). Strict on names."""
    config_url = storage.join(url, "config.json")
    if not storage.exists(config_url):
        raise FileNotFoundError(f"{url} has no config.json: not a DFlash serving directory")
    data = storage.read_json(config_url)
    if "speculators_model_type" in data:
        raise ValueError(f"{url} is a speculators export: load it with load_exported")
    return load_weights(from_serving_config(data), url).to(dtype)


def load_weights(config: DrafterConfig, url: str) -> DFlashDrafter:
    """A drafter of `config` with the weights of `url`. Strict on names."""
    weights = _read_weights(url)
    drafter = DFlashDrafter(config)
    expected = set(drafter.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{url}: weights do not match a DFlash drafter of this config: "
            f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
            f"unexpected {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}"
        )
    drafter.load_state_dict(weights)
    return drafter
