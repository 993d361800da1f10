"""vLLM's `speculators` layout of a DFlash drafter (docs/design.md §6; `to_speculators_config`
gives every field): the dflash weights file, and a config.json that wraps the draft layers'
Qwen3 config and names the verifier. Reads other trainers' speculators configs too
(`from_speculators_config`), and holds the translation vLLM's adapter applies to such a
config (`vllm_translation`), through which the engine check reads it.
"""

from __future__ import annotations

from typing import Any

from flashdraft import storage
from flashdraft.export.dflash import (
    ARCHITECTURE,
    SCALING,
    from_serving_config,
    scaling_fields,
    to_serving_config,
    write_weights,
)
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter

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
    scaled = scaling_fields(config)
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
    write_weights(drafter, url)
    storage.write_json_atomic(storage.join(url, "config.json"), config)


def vllm_translation(data: dict[str, Any]) -> dict[str, Any]:
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
