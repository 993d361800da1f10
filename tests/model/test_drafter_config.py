from types import SimpleNamespace

import pytest

from flashdraft.model.config import DrafterConfig, choose_mask_token_id, default_target_layer_ids


def test_default_layer_ids_match_spec_examples() -> None:
    # docs/design.md §3: Qwen3-8B (36 layers, 5 draft layers) and a 64-layer target.
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(36, 1) == [18]
    # Python's round (banker's) as the serving engines use: 7.5 -> 8, 20.5 -> 20.
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]


def _target(**kw: object) -> SimpleNamespace:
    base = dict(
        num_hidden_layers=36,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        vocab_size=151936,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_from_target_config_mirrors_geometry() -> None:
    cfg = DrafterConfig.from_target_config(_target(), mask_token_id=151669)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (4096, 32, 8)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert cfg.layer_types == ["full_attention"] * 5
    assert cfg.rope_parameters["rope_theta"] == 1_000_000.0
    assert cfg.num_taps == 5


def test_sliding_layers() -> None:
    cfg = DrafterConfig.from_target_config(
        _target(), mask_token_id=151669, sliding_window=2048, sliding_layers=[0, 1]
    )
    assert cfg.layer_types[:3] == ["sliding_attention", "sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="sliding_window"):
        DrafterConfig.from_target_config(_target(), mask_token_id=1, sliding_layers=[0])


def test_mask_token_outside_table_is_refused() -> None:
    # docs/design.md §8 trap 6: the mask id must exist in the target's embedding table.
    with pytest.raises(ValueError, match="outside the target's embedding table"):
        DrafterConfig.from_target_config(_target(), mask_token_id=151936)


def test_layer_id_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="0-based"):
        DrafterConfig.from_target_config(_target(), mask_token_id=0, target_layer_ids=[1, 36])


def test_mask_token_choice_on_real_tokenizers(smollm2_dir, qwen3_tokenizer_dir) -> None:
    from transformers import AutoConfig, AutoTokenizer

    qwen = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    mask_id, why = choose_mask_token_id(_target(), qwen)
    assert mask_id == 151669 and "padded" in why

    smol = AutoTokenizer.from_pretrained(smollm2_dir)
    config = AutoConfig.from_pretrained(smollm2_dir)
    mask_id, why = choose_mask_token_id(config, smol)
    assert 0 <= mask_id < config.vocab_size
    assert mask_id not in (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id)
    # It is a special token the chat template never writes.
    assert smol.convert_ids_to_tokens(mask_id) not in (smol.chat_template or "")
    assert "reserved" in why


def test_the_last_target_layer_is_refused() -> None:
    """docs/design.md §8 trap 12: the engines read layer L-1 after the final norm, our hooks before it."""
    with pytest.raises(ValueError, match="after the final norm"):
        DrafterConfig.from_target_config(_target(), mask_token_id=0, target_layer_ids=[1, 35])
    DrafterConfig.from_target_config(_target(), mask_token_id=0, target_layer_ids=[1, 34])


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, (1.0, 1.0, None)),
        ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, (64.0, 1.0, 30.0)),
        ({"model_type": "cohere", "logit_scale": 0.0625}, (1.0, 0.0625, None)),
        ({"model_type": "granite", "logits_scaling": 8.0}, (1.0, 0.125, None)),
        ({"model_type": "gemma2", "final_logit_softcapping": None}, (64.0, 1.0, None)),
    ],
)
def test_target_scaling_is_recorded(fields: dict, expected: tuple) -> None:
    cfg = DrafterConfig.from_target_config(_target(**fields), mask_token_id=0)
    assert (
        cfg.input_embedding_scale,
        cfg.output_multiplier,
        cfg.final_logit_softcapping,
    ) == expected


def test_bad_scaling_is_refused() -> None:
    base = DrafterConfig.from_target_config(_target(), mask_token_id=0).to_dict()
    for name, value in (("output_multiplier", 0.0), ("final_logit_softcapping", float("inf"))):
        with pytest.raises(ValueError, match=name):
            DrafterConfig.from_dict({**base, name: value})
    # Configs saved before these fields existed still load (defaults: no scaling).
    old = {k: v for k, v in base.items() if "scal" not in k and "softcap" not in k}
    assert DrafterConfig.from_dict(old) == DrafterConfig.from_dict(base)
