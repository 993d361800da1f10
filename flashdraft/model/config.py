"""The drafter's geometry (docs/design.md §2), the default tap rule (docs/design.md §3) and the choice of
the mask token: plain data with validation; no torch modules are built in this file."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from flashdraft.config import build

LAYER_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """docs/design.md §3: z-lab ids (id i = output of decoder layer i) spread over the target.

    One id -> the middle layer; otherwise evenly spaced over [1, L - 3] with Python's
    round (the rounding z-lab, vLLM and SGLang use: L=36, N=5 -> [1, 9, 17, 25, 33]).
    """
    if num_draft_layers < 1:
        raise ValueError(f"need at least one draft layer, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 5:
        raise ValueError(
            f"a target with {num_target_layers} layers is too shallow for the default tap rule; "
            "pass target_layer_ids explicitly"
        )
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# RoPE settings of a target that describe its own attention, not the drafter's: Qwen3.5's
# partial rotary factor (0.25: a quarter of each head rotated) and multimodal sections. The
# drafter rotates whole heads (model/drafter.py); an export carrying these keys would make vLLM
# rotate only part of each head.
TARGET_ONLY_ROPE_KEYS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def drafter_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The target's RoPE settings as the drafter uses them (`rope_parameters_of` without
    `TARGET_ONLY_ROPE_KEYS`)."""
    params = rope_parameters_of(hf_config)
    return {k: v for k, v in params.items() if k not in TARGET_ONLY_ROPE_KEYS}


def rope_parameters_of(hf_config: Any) -> dict[str, Any]:
    """RoPE settings of an HF config as a transformers-5 `rope_parameters` dict.

    transformers 5 keeps them in `rope_parameters`; 4.x in `rope_theta` + `rope_scaling`.
    Targets with one RoPE per layer type (Gemma 3) give the full-attention layers' one.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        theta = getattr(hf_config, "rope_theta", None)
        if theta is None:
            raise ValueError("target config has no rope_theta / rope_parameters")
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        out = {"rope_type": "default", **dict(scaling), "rope_theta": float(theta)}
        if "type" in out and "rope_type" not in scaling:
            out["rope_type"] = out.pop("type")
    out.setdefault("rope_type", "default")
    return out


def logit_scaling_of(text_config: Any) -> tuple[float, float | None]:
    """(multiplier, softcap) the target applies to `h @ W^T` to get its logits: Cohere's
    `logit_scale`, Granite's 1 / `logits_scaling`, Gemma 2/3's `final_logit_softcapping`."""
    multiplier = float(getattr(text_config, "logit_scale", None) or 1.0)
    granite = getattr(text_config, "logits_scaling", None)
    if granite:
        multiplier /= float(granite)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    return multiplier, float(softcap) if softcap else None


# transformers 5 model types whose input embedding module scales its rows (a
# `*ScaledWordEmbedding` with `embed_scale = sqrt(hidden_size)`); MiniCPM3 scales by the
# config's `scale_emb`. `TargetHead.check_drafter` compares with the live module.
_SQRT_HIDDEN_EMBEDDING = frozenset(
    {"gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4"}
    | {"gemma4_text", "vaultgemma"}
)


def embedding_scale_of(text_config: Any) -> float:
    """What the target's input embedding module multiplies its rows by (1.0 for most)."""
    model_type = str(getattr(text_config, "model_type", ""))
    if model_type in _SQRT_HIDDEN_EMBEDDING:
        return float(text_config.hidden_size) ** 0.5
    if model_type == "minicpm3":
        return float(text_config.scale_emb)
    return 1.0


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    """Geometry of a DFlash drafter (docs/design.md §2). H (hidden) always equals the target's.

    `input_embedding_scale`, `output_multiplier` and `final_logit_softcapping` record how the
    target's embedding and head scale (block embeddings are raw table rows times the scale;
    logits are `softcap(multiplier * h @ W^T)`), under z-lab's `dflash_config` names, so that
    an export tells the engines what training used.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int = 5
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0}
    )
    max_position_embeddings: int = 40960
    vocab_size: int
    block_size: int = 16
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    initializer_range: float = 0.02
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} "
                "draft layers; give one per layer"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"unknown layer type(s) {bad}; use one of {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window > 0")
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be >= 2 (one anchor + drafts), got {self.block_size}"
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        out_of_range = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if out_of_range:
            raise ValueError(
                f"target_layer_ids {out_of_range} are outside the target's "
                f"{self.num_target_layers} layers (z-lab convention: id i = output of layer i, "
                f"0-based, so ids run 0..{self.num_target_layers - 1})"
            )
        last = self.num_target_layers - 1
        if last in self.target_layer_ids:
            raise ValueError(
                f"target_layer_ids tap layer {last}, the target's last layer: z-lab's dflash, "
                "vLLM and SGLang read its output after the final norm (HF hidden_states[L]), "
                "while flashdraft's hooks read it before the norm, so the served drafter would "
                f"see other features than it was trained on; tap layers 0..{last - 1}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target's embedding table "
                f"(vocab_size {self.vocab_size}); pick an id the table holds, e.g. a reserved "
                "special token"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if "rope_theta" not in self.rope_parameters:
            raise ValueError("rope_parameters needs rope_theta")
        for name in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")

    @property
    def num_taps(self) -> int:
        """K, the number of tapped target layers (the fc input is K * H wide)."""
        return len(self.target_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        result: DrafterConfig = build(cls, data, "drafter_config.")
        return result

    @classmethod
    def from_target_config(
        cls,
        hf_config: Any,
        *,
        mask_token_id: int,
        num_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        sliding_window: int | None = None,
        sliding_layers: list[int] | None = None,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """Drafter geometry mirroring the target (z-lab recipe), `num_layers` deep.

        `sliding_layers` lists the draft layers (0-based) that use sliding attention with
        window `sliding_window`; all others attend to the whole context.
        """
        text = text_config(hf_config)
        num_target_layers = int(text.num_hidden_layers)
        heads = int(text.num_attention_heads)
        ids = (
            list(target_layer_ids)
            if target_layer_ids is not None
            else default_target_layer_ids(num_target_layers, num_layers)
        )
        multiplier, softcap = logit_scaling_of(text)
        sliding = set(sliding_layers or [])
        if sliding and not sliding_window:
            raise ValueError("sliding_layers given without sliding_window")
        if any(not 0 <= i < num_layers for i in sliding):
            raise ValueError(f"sliding_layers {sorted(sliding)} outside 0..{num_layers - 1}")
        return cls(
            hidden_size=int(text.hidden_size),
            intermediate_size=int(intermediate_size or text.intermediate_size),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_parameters=drafter_rope_parameters(text),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 40960)),
            vocab_size=int(text.vocab_size),
            block_size=block_size,
            num_target_layers=num_target_layers,
            target_layer_ids=ids,
            mask_token_id=mask_token_id,
            layer_types=[
                "sliding_attention" if i in sliding else "full_attention" for i in range(num_layers)
            ],
            sliding_window=sliding_window if sliding else None,
            input_embedding_scale=embedding_scale_of(text),
            output_multiplier=multiplier,
            final_logit_softcapping=softcap,
        )


def text_config(hf_config: Any) -> Any:
    """The language-model part of an HF config (multimodal configs nest it)."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def choose_mask_token_id(hf_config: Any, tokenizer: Any) -> tuple[int, str]:
    """An id for the drafter's MASK token that exists in the target's embedding table.

    Returns (id, reason). Order: the tokenizer's own mask token; the first id past the
    tokenizer when the table is padded (Qwen3: 151669); otherwise a special token that chat
    formatting never emits. Never an id outside the table (docs/design.md §8 trap 6).
    """
    text = text_config(hf_config)
    vocab = int(text.vocab_size)
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is not None and 0 <= mask_id < vocab:
        return int(mask_id), f"the tokenizer's mask token {tokenizer.mask_token!r}"
    if len(tokenizer) < vocab:
        return len(tokenizer), (
            f"first unused row of the padded embedding table (tokenizer has {len(tokenizer)} "
            f"tokens, table {vocab})"
        )
    in_use = {
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.unk_token_id,
    }
    template = getattr(tokenizer, "chat_template", None) or ""
    candidates = [
        (tid, tok)
        for tok, tid in sorted(tokenizer.get_added_vocab().items(), key=lambda kv: -kv[1])
        if tid < vocab and tid not in in_use and tok not in template
    ]
    if not candidates:
        raise ValueError(
            "the tokenizer fills the whole embedding table and has no spare special token; "
            "set mask_token_id explicitly to a token the target never produces"
        )
    tid, tok = candidates[0]
    return int(tid), f"reserved special token {tok!r} (the vocabulary fills the table)"
