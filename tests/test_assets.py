"""Offline assets from PyPI: prompts and the cache location (the models are exercised by the
fixtures in conftest.py, which every model test uses)."""

from __future__ import annotations

import itertools

import pytest
import tiny_models

from flashdraft import assets


def test_chitchat_conversations_are_alternating_chats_that_end_with_the_assistant() -> None:
    records = assets.chitchat_conversations(limit=50, seed=0)
    assert len(records) == 50
    assert len({r["id"] for r in records}) == 50
    for record in records:
        roles = [m["role"] for m in record["messages"]]
        assert roles[0] == "user" and roles[-1] == "assistant"
        assert all(a != b for a, b in itertools.pairwise(roles))
    # The order is a seeded shuffle: the same seed, the same records.
    assert assets.chitchat_conversations(limit=5, seed=0) == records[:5]
    assert assets.chitchat_conversations(limit=5, seed=1) != records[:5]


def test_humaneval_prompts_are_all_164_tasks_as_chat_records() -> None:
    records = assets.humaneval_prompts()
    assert len(records) == 164
    assert records[0]["id"] == "HumanEval/0"
    assert records[0]["messages"][0]["role"] == "user"
    assert "def has_close_elements" in records[0]["messages"][0]["content"]


def test_the_cache_directory_follows_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    assert assets.cache_dir() == tmp_path / "cache"
    assert (tmp_path / "cache").is_dir()


def test_tiny_qwen3_5_is_a_hybrid_qwen3_5_with_the_qwen3_tokenizer(tiny_qwen3_5_dir) -> None:
    import json

    from transformers import AutoTokenizer

    config = json.loads((tiny_qwen3_5_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    assert config["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert (config["linear_num_key_heads"], config["linear_num_value_heads"]) == (2, 4)
    rope = config["rope_parameters"]
    assert rope["partial_rotary_factor"] == 0.25 and rope["mrope_interleaved"] is True
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_5_dir)
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config["vocab_size"] == 151936 > len(tokenizer)
    # Built once: a second call finds it and writes nothing.
    stamp = (tiny_qwen3_5_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny_models.tiny_qwen3_5(tiny_qwen3_5_dir) == tiny_qwen3_5_dir
    assert (tiny_qwen3_5_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_shipped_drafter_is_package_data_that_loads_as_the_engines_read_it(
    tmp_path, monkeypatch
) -> None:
    """The reference drafter ships inside the package (found the same way from a checkout
    and from an installed wheel): a dflash export the engines read as trained, under 25 MB.
    A missing file is one clear error naming the folder, not a crash later in the demo."""
    from flashdraft.export import load_dflash, verify_export

    folder = assets.shipped_drafter()
    assert folder.parent.name == "artifacts" and folder.parent.parent.name == "flashdraft"
    verify_export(load_dflash(str(folder)), str(folder))
    assert (folder / "model.safetensors").stat().st_size <= 25_000_000
    monkeypatch.setattr(assets, "SHIPPED_DRAFTER", "nothing-here")
    with pytest.raises(FileNotFoundError, match=r"nothing-here lacks config\.json"):
        assets.shipped_drafter()
