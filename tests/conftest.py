"""Shared fixtures: real offline models, converted once per session into a cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests run on 2 CPU cores in CI; more threads only add contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain HF directory (converted from the GGUF once)."""
    from flashdraft.assets import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    from flashdraft.assets import qwen3_tokenizer_dir

    return qwen3_tokenizer_dir()


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3ForCausalLM (6 layers, width 64) with the real Qwen3 tokenizer."""
    from flashdraft.assets import tiny_qwen3

    return tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3") / "model")
