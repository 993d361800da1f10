"""Serving format (SPEC section 6): what vLLM, SGLang and z-lab's `dflash` load unchanged.

`config.json` is a Qwen3 config with `architectures: ["DFlashDraftModel"]`, `block_size`,
`num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}` and `layer_types`;
`model.safetensors` holds bf16 weights under the drafter's bare parameter names (no
embedding, no lm_head, no trainer prefixes). Loading accepts the same format, including
drafters published by z-lab, for warm starts and for `flashdraft eval`.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from flashdraft import storage
from flashdraft.config import DrafterConfig, default_target_layer_ids
from flashdraft.drafter import DFlashDrafter, DraftCache

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS = "model.safetensors"


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
        },
        "layer_types": list(config.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window if sliding else None,
        "max_window_layers": config.num_hidden_layers,
    }


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
    )


def serving_state_dict(drafter: DFlashDrafter) -> dict[str, Tensor]:
    """bf16, contiguous, bare names: exactly what goes into model.safetensors."""
    return {
        k: v.detach().to("cpu", torch.bfloat16).contiguous()
        for k, v in drafter.state_dict().items()
    }


def save_dflash(drafter: DFlashDrafter, url: str) -> None:
    """Write config.json + model.safetensors to `url` (a directory; local or fsspec)."""
    storage.makedirs(url)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, WEIGHTS)
        save_file(serving_state_dict(drafter), local, metadata={"format": "pt"})
        with open(local, "rb") as f:
            storage.write_bytes_atomic(storage.join(url, WEIGHTS), f.read())
    storage.write_json_atomic(storage.join(url, "config.json"), to_serving_config(drafter.config))


def _read_weights(url: str) -> dict[str, Tensor]:
    index_url = storage.join(url, "model.safetensors.index.json")
    files = (
        sorted(set(storage.read_json(index_url)["weight_map"].values()))
        if storage.exists(index_url)
        else [WEIGHTS]
    )
    weights: dict[str, Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in files:
            local = os.path.join(tmp, name)
            with storage.open_url(storage.join(url, name), "rb") as src, open(local, "wb") as dst:
                dst.write(src.read())
            weights.update(load_file(local))
    return weights


def load_dflash(url: str, dtype: torch.dtype = torch.bfloat16) -> DFlashDrafter:
    """Load a serving-format drafter (ours or a published z-lab one). Strict on names."""
    config_url = storage.join(url, "config.json")
    if not storage.exists(config_url):
        raise FileNotFoundError(f"{url} has no config.json: not a DFlash serving directory")
    config = from_serving_config(storage.read_json(config_url))
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
    return drafter.to(dtype)


def verify_export(drafter: DFlashDrafter, url: str, seed: int = 0) -> None:
    """Reload `url` and check it gives the same weights and outputs as `drafter` in bf16.

    Raises ValueError at the first mismatch: an export that an engine would load
    differently must never be reported as written.
    """
    reloaded = load_dflash(url)
    expected = serving_state_dict(drafter)
    for name, tensor in reloaded.state_dict().items():
        if not torch.equal(tensor.cpu(), expected[name]):
            raise ValueError(f"export check failed: {name} differs after reload")
    reference = DFlashDrafter(drafter.config).to(torch.bfloat16)
    reference.load_state_dict(expected)
    config = drafter.config
    gen = torch.Generator().manual_seed(seed)
    ctx_len, block = 8, config.block_size
    hidden = torch.randn(1, ctx_len, config.num_taps * config.hidden_size, generator=gen)
    embeds = torch.randn(1, block, config.hidden_size, generator=gen)
    outputs = []
    for model in (reference, reloaded):
        cache = DraftCache()
        positions = torch.arange(ctx_len)[None]
        model.extend_cache(cache, hidden.to(torch.bfloat16), positions)
        outputs.append(model.draft_block(cache, embeds.to(torch.bfloat16), ctx_len))
    if not torch.equal(outputs[0], outputs[1]):
        raise ValueError("export check failed: reloaded drafter gives different outputs")
