"""Export formats (SPEC section 6): writing, loading and checking serving-format drafters.

    flashdraft export CHECKPOINT --output DIR [--format dflash|speculators] [--verifier PATH]

* `dflash` (default): what vLLM, SGLang and z-lab's `dflash` load unchanged. `config.json` is
  a Qwen3 config with `architectures: ["DFlashDraftModel"]`, `block_size`,
  `num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids, ...}` and
  `layer_types` (per-layer causality: every engine makes sliding layers causal and full
  layers bidirectional, unless a config sets `is_causal`, which is never written);
  `model.safetensors` holds bf16 weights under the drafter's bare parameter names (no
  embedding, no lm_head, no trainer prefixes).
* `speculators`: vLLM's `speculators` layout (see `to_speculators_config` for every field).
  Same weights file; a config that wraps the Qwen3 layer config and names the verifier.

This module owns loading exports (`load_exported`, `load_dflash`), in both formats and
including drafters published by z-lab, for warm starts and for `flashdraft eval`. Every
export is reloaded and checked before it is reported as written (`save_export`): identical
weights and outputs, and its config.json re-read with transformers' `AutoConfig` as the
engines read it (`verify_export`, `check_engine_config`). `ExportConfig` holds the options
of the command.
"""

from __future__ import annotations

import json
import tempfile
import typing
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from flashdraft import config as cfg
from flashdraft import storage
from flashdraft.config import option
from flashdraft.log import get_logger
from flashdraft.model.config import DrafterConfig, default_target_layer_ids, rope_parameters_of
from flashdraft.model.drafter import DFlashDrafter, DraftCache

log = get_logger(__name__)

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# z-lab's `dflash_config` names for the target's scaling (`DrafterConfig` fields), defaults.
SCALING = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
ExportFormat = Literal["dflash", "speculators"]
FORMATS: tuple[str, ...] = typing.get_args(ExportFormat)
# Written as `speculators_version`; the first release with the DFlash algorithm (its docs
# ask for speculators>=0.5.0). vLLM does not read the field.
SPECULATORS_VERSION = "0.5.0"
# Top-level serving-config keys that are not part of the draft layers' Qwen3 config; the
# speculators layout carries their content in its own fields.
_NOT_LAYER_CONFIG = (
    "architectures",
    "auto_map",
    "block_size",
    "dflash_config",
    "num_target_layers",
)


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    """The options of `flashdraft export`."""

    checkpoint: str = option(
        positional=True,
        help="training checkpoint, run directory (latest checkpoint) or export",
    )
    output: str = option(help="directory to write (local or fsspec URL)")
    format: ExportFormat = option(
        "dflash", help="dflash: vLLM, SGLang, z-lab's dflash; speculators: vLLM's speculators"
    )
    verifier: str | None = option(
        None,
        help="the target's HF id or path, written into the speculators config (required there: "
        "vLLM serves the verifier it names)",
    )
    overwrite: bool = option(False, help="write into a non-empty output directory")

    def __post_init__(self) -> None:
        cfg.validate(self)
        if self.format == "speculators" and not self.verifier:
            raise cfg.ConfigError(
                "verifier", self.verifier, "the speculators format needs the target's HF id or path"
            )


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
            **_scaling_fields(config),
        },
        "layer_types": list(config.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window if sliding else None,
        "max_window_layers": config.num_hidden_layers,
    }


def _scaling_fields(config: DrafterConfig) -> dict[str, Any]:
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
        **_read_scaling(dflash, data),
    )


def _read_scaling(dflash: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
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
    scaled = _scaling_fields(drafter.config)
    if scaled:
        # z-lab's dflash applies all three; vLLM's qwen3_dflash.py (036a00d) and SGLang's
        # models/dflash.py (003b23d) read none of them from dflash_config.
        log.warning(
            f"the target scales its embedding or logits ({scaled}): written to dflash_config "
            "for z-lab's dflash; vLLM and SGLang do not read these fields for DFlash drafters"
        )
    _write_weights(drafter, url)
    storage.write_json_atomic(storage.join(url, "config.json"), to_serving_config(drafter.config))


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
    return _load_weights(from_serving_config(data), url).to(dtype)


def _load_weights(config: DrafterConfig, url: str) -> DFlashDrafter:
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


def to_speculators_config(
    config: DrafterConfig, verifier: str, verifier_architectures: list[str] | None = None
) -> dict[str, Any]:
    """The `speculators` config.json of a DFlash drafter, field by field.

    Confirmed against speculators' `DFlashSpeculatorConfig` / `SpeculatorModelConfig`, its
    z-lab -> speculators converter, and vLLM's `SpeculatorsConfig` loader and `update_dflash`
    (vllm/transformers_utils/configs/speculators/):

    * `speculators_model_type: "dflash"`: the key vLLM dispatches on (its algorithm registry)
      and becomes vLLM's `method`.
    * `architectures: ["DFlashDraftModel"]`: the speculators model class name (what its
      `save_pretrained` writes); vLLM sets the same name on the draft config itself.
    * `transformer_layer_config`: the draft layers' Qwen3 config; vLLM builds the draft
      model's HF config from exactly this dict. We write the dflash serving config without
      the keys that are not layer geometry (as speculators' converter does).
    * `aux_hidden_state_layer_ids`: the tapped target layers in the speculators / vLLM
      convention, z-lab id + 1 (vLLM maps back with `target_layer_ids = aux - 1`).
    * `mask_token_id`, `block_size`, `draft_vocab_size` (= the target vocabulary: no
      reduced draft vocabulary, so no `d2t`/`t2d` tensors), `target_hidden_size`.
    * `sliding_window_non_causal`: vLLM's `update_dflash` turns it into
      `dflash_config.causal = not sliding_window_non_causal` (default True, so absent means
      non-causal), and its DFlash model (`qwen3_dflash._dflash_layer_causal`) applies that one
      flag to EVERY layer, full-attention ones included (vllm-project/vllm PR #56692, the bug
      came with #47745). So: `true` for all-full drafters (bidirectional, as trained),
      `false` for all-sliding ones (causal, as trained), and a drafter that mixes both is
      refused (the dflash format keeps per-layer causality).
    * `speculators_config`: `algorithm: "dflash"`, one `greedy` proposal method with
      `speculative_tokens = block_size - 1` (the anchor slot is the bonus token, not a
      draft), `default_proposal_method: "greedy"`, and `verifier: {name_or_path,
      architectures}`; vLLM requires `proposal_methods[*].proposal_type`,
      `speculative_tokens` and `verifier.name_or_path`, and serves the verifier named there.

    Refused too: a target that scales its embedding or logits (`update_dflash` carries no
    such field into `dflash_config`). Not confirmed: `speculators_version` (vLLM ignores it;
    the value is the first release with DFlash), `verifier_accept_k` / `accept_tolerance`
    (greedy proposal defaults, 1 and 0.0, written explicitly), and whether releases other
    than the one read accept the file unchanged. `num_target_layers` is a flashdraft
    addition (speculators configs allow extra fields) so that a reload knows the target depth.
    """
    kinds = set(config.layer_types)
    if kinds == {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"layer_types {config.layer_types} mix full and sliding attention, which the "
            "speculators format cannot carry: vLLM maps sliding_window_non_causal to one "
            "causal flag for every layer (vllm-project/vllm PR #56692); export in the dflash "
            "format, which keeps causality per layer"
        )
    scaled = _scaling_fields(config)
    if scaled:
        raise ValueError(
            f"the target scales its embedding or logits ({scaled}) and vLLM's speculators "
            "adapter reads no field for that; export in the dflash format (z-lab's dflash "
            "reads them)"
        )
    serving = to_serving_config(config)
    layer_config = {k: v for k, v in serving.items() if k not in _NOT_LAYER_CONFIG}
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(verifier_architectures or []),
            },
        },
        "transformer_layer_config": layer_config,
        "draft_vocab_size": config.vocab_size,
        "target_hidden_size": config.hidden_size,
        "block_size": config.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": kinds == {"full_attention"},
        "num_target_layers": config.num_target_layers,
        "torch_dtype": "bfloat16",
    }


def check_speculators_config(data: dict[str, Any]) -> None:
    """The structure vLLM validates before it loads a speculators drafter (ValueError)."""
    spec = data.get("speculators_config")
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    problems = []
    if data.get("speculators_model_type") != "dflash":
        problems.append("speculators_model_type is not 'dflash'")
    if not isinstance(methods, list) or not methods:
        problems.append("speculators_config.proposal_methods is not a non-empty list")
    elif not all(isinstance(m, dict) and "proposal_type" in m for m in methods):
        problems.append("a proposal method has no proposal_type")
    elif not isinstance(methods[0].get("speculative_tokens"), int):
        problems.append("the proposal method has no speculative_tokens")
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    if not isinstance(verifier, dict) or not verifier.get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is missing")
    if not isinstance(data.get("transformer_layer_config"), dict):
        problems.append("transformer_layer_config is missing or not an object")
    for key in ("aux_hidden_state_layer_ids", "mask_token_id"):
        if data.get(key) is None:
            problems.append(f"{key} is missing")
    if problems:
        raise ValueError("not a loadable speculators DFlash config: " + "; ".join(problems))


def _verifier_config(name_or_path: str | None) -> dict[str, Any] | None:
    """The verifier's config.json when it is a reachable directory, else None."""
    if not name_or_path:
        return None
    url = storage.join(name_or_path, "config.json")
    try:
        found = storage.exists(url)
    except (OSError, ValueError):
        return None
    return dict(storage.read_json(url)) if found else None


def from_speculators_config(
    data: dict[str, Any], num_target_layers: int | None = None
) -> DrafterConfig:
    """A DrafterConfig from a speculators DFlash config.json (ours or another trainer's).

    The target depth comes from our `num_target_layers` field, else the verifier's local
    config, else `num_target_layers` (the caller's target), else the smallest depth the taps
    allow (max aux id + 1: vLLM captures the input of layer aux id): speculators configs do
    not record it themselves. Sliding layers are read as speculators trains them, causal
    unless `sliding_window_non_causal` (then refused: flashdraft has no such layer).
    """
    check_speculators_config(data)
    ids = [int(i) - 1 for i in data["aux_hidden_state_layer_ids"]]
    verifier = data["speculators_config"]["verifier"].get("name_or_path")
    depth = data.get("num_target_layers")
    if depth is None:
        verifier_config = _verifier_config(verifier)
        if verifier_config is not None and "num_hidden_layers" in verifier_config:
            depth = verifier_config["num_hidden_layers"]
    depth = int(depth if depth is not None else (num_target_layers or max(ids) + 2))
    block = data.get("block_size")
    if block is None:
        block = int(data["speculators_config"]["proposal_methods"][0]["speculative_tokens"]) + 1
    serving = {
        **data["transformer_layer_config"],
        "architectures": [ARCHITECTURE],
        "block_size": int(block),
        "num_target_layers": depth,
        "dflash_config": {
            "mask_token_id": int(data["mask_token_id"]),
            "target_layer_ids": ids,
            **{k: data[k] for k in SCALING if k in data},
        },
    }
    config = from_serving_config(serving)
    if "sliding_attention" in config.layer_types and data.get("sliding_window_non_causal"):
        raise ValueError(
            "sliding_window_non_causal is true: its sliding layers are bidirectional inside "
            "the block, which flashdraft's drafter does not implement"
        )
    draft_vocab = data.get("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) != config.vocab_size:
        raise ValueError(
            f"draft_vocab_size {draft_vocab} differs from the vocabulary {config.vocab_size}: "
            "reduced draft vocabularies (d2t/t2d) are not supported"
        )
    return config


def save_speculators(
    drafter: DFlashDrafter, url: str, verifier: str, verifier_architectures: list[str] | None = None
) -> None:
    """Write the speculators layout: config.json + model.safetensors (bf16, bare names)."""
    if verifier_architectures is None:
        verifier_config = _verifier_config(verifier)
        verifier_architectures = list((verifier_config or {}).get("architectures") or [])
    config = to_speculators_config(drafter.config, verifier, verifier_architectures)
    _write_weights(drafter, url)
    storage.write_json_atomic(storage.join(url, "config.json"), config)


def _write_weights(drafter: DFlashDrafter, url: str) -> None:
    storage.makedirs(url)
    storage.write_tensors(storage.join(url, WEIGHTS), serving_state_dict(drafter), {"format": "pt"})


def export_format(url: str) -> str:
    """'dflash' or 'speculators': the layout of an exported folder."""
    config_url = storage.join(url, "config.json")
    if not storage.exists(config_url):
        raise FileNotFoundError(f"{url} has no config.json: not an exported drafter")
    return "speculators" if "speculators_model_type" in storage.read_json(config_url) else "dflash"


def load_exported(
    url: str, dtype: torch.dtype = torch.bfloat16, num_target_layers: int | None = None
) -> DFlashDrafter:
    """An exported drafter in either format (z-lab's published folders are `dflash`).

    `num_target_layers` only fills in a speculators config that does not record the depth.
    """
    if export_format(url) == "dflash":
        return load_dflash(url, dtype)
    config = from_speculators_config(
        storage.read_json(storage.join(url, "config.json")), num_target_layers
    )
    return _load_weights(config, url).to(dtype)


# ---- the config as the engines read it ----

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


def _vllm_translation(data: dict[str, Any]) -> dict[str, Any]:
    """A speculators config.json as the HF config vLLM builds from it: the layer config plus
    what `update_dflash` adds (aux ids - 1, `causal = not sliding_window_non_causal`, default
    True). vLLM drafts `speculative_tokens` per step, hence block_size = that + 1."""
    methods = data["speculators_config"]["proposal_methods"]
    return {
        **data["transformer_layer_config"],
        "architectures": [ARCHITECTURE],
        "block_size": int(methods[0]["speculative_tokens"]) + 1,
        "dflash_config": {
            "mask_token_id": data["mask_token_id"],
            "target_layer_ids": [i - 1 for i in data["aux_hidden_state_layer_ids"]],
            "causal": not data.get("sliding_window_non_causal", True),
        },
    }


def engine_view(url: str) -> dict[str, Any]:
    """What z-lab's dflash, vLLM and SGLang take from the export at `url`, read the way they
    read it: config.json (a speculators one translated as vLLM does) parsed by transformers'
    `AutoConfig`, then the fields their DFlash models use. Causality per layer follows
    z-lab's `Qwen3DFlashAttention` and vLLM's `_dflash_layer_causal`: `is_causal` (and, in
    vLLM, `dflash_config.causal`) forces every layer, else sliding layers are causal."""
    from transformers import AutoConfig

    data = storage.read_json(storage.join(url, "config.json"))
    if "speculators_model_type" in data:
        data = _vllm_translation(data)
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
        **_read_scaling(dflash, hf.to_dict()),
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
    """ValueError naming every field an engine would read differently from `config`."""
    view, want = engine_view(url), expected_engine_view(config)
    problems = []
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


def verify_export(drafter: DFlashDrafter, url: str, seed: int = 0) -> None:
    """Reload `url` (either format) and check it gives the same weights and outputs as
    `drafter` in bf16, and that the engines read the drafter's config from it
    (`check_engine_config`).

    Raises ValueError at the first mismatch: an export that an engine would load
    differently must never be reported as written.
    """
    reloaded = load_exported(url)
    if reloaded.config != drafter.config:
        raise ValueError("export check failed: the reloaded config differs from the drafter's")
    check_engine_config(url, drafter.config)
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


def check_output(url: str, overwrite: bool = False) -> None:
    """Refuse to write into a non-empty directory unless `overwrite`; with it, drop a stale
    sharded-weights index, which loaders would read before our single weights file."""
    fs, path = storage.filesystem(url)
    if not fs.exists(path):
        return
    if not fs.isdir(path):
        raise ValueError(f"--output {url} is a file; give a directory")
    if not overwrite and fs.ls(path):
        raise ValueError(
            f"--output {url} is not empty; pass --overwrite to write the export into it, "
            "or choose a new directory"
        )
    index = storage.join(url, WEIGHTS_INDEX)
    if storage.exists(index):
        shards = set(storage.read_json(index)["weight_map"].values())
        for name in (WEIGHTS_INDEX, *sorted(shards)):
            target = storage.filesystem(storage.join(url, name))[1]
            if fs.exists(target):
                fs.rm(target)


def save_export(
    drafter: DFlashDrafter,
    url: str,
    format: ExportFormat = "dflash",
    verifier: str | None = None,
    overwrite: bool = False,
) -> None:
    """Write `drafter` to `url` in `format` and check the reload (`verify_export`).
    The speculators format needs the `verifier` (the target's HF id or path). A non-empty
    `url` is refused unless `overwrite`."""
    if format == "speculators" and not verifier:
        raise ValueError("the speculators format needs a verifier (the target's HF id or path)")
    check_output(url, overwrite)
    if format == "dflash":
        save_dflash(drafter, url)
    else:
        assert verifier is not None
        save_speculators(drafter, url, verifier)
    verify_export(drafter, url)
