"""Shared fixtures: real offline models, converted once per session into a cache."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import script_modules

# Test tensors are tiny: intra-op threads only add overhead, and when anything else runs on
# the 2 CI cores, spinning OpenMP threads slow small ops down by ~100x (measured: 13 ms vs
# 1 s for one tiny drafter step).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One thread before every test and again after it: a command run in-process (the demo
    uses every core) must not change the arithmetic of the tests after it (test_golden.py and
    test_faults.py compare weights bit for bit; thread count changes reduction order). The
    reset after is the one that counts for the next test's module and session fixtures
    (test_faults.py's reference run): they are set up before its function fixtures."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


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
    from tiny_models import tiny_qwen3

    return tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3") / "model")


@pytest.fixture(scope="session")
def qwen_data(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Path:
    """80 real chitchat conversations prepared with the Qwen3 tokenizer and template."""
    from helpers import prepare_chitchat

    return prepare_chitchat(tmp_path_factory.mktemp("data") / "qwen", tiny_qwen3_dir, 80)


@pytest.fixture(scope="session")
def smol_data(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """80 real chitchat conversations prepared with SmolLM2's tokenizer and template."""
    from helpers import prepare_chitchat

    return prepare_chitchat(tmp_path_factory.mktemp("data") / "smol", smollm2_dir, 80)


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir: Path) -> object:
    """The real Qwen3 tokenizer with its chat template, as `prepare` loads it."""
    from flashdraft.data.template import load_tokenizer

    return load_tokenizer(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path) -> object:
    """SmolLM2-135M-Instruct's tokenizer with its chat template, as `prepare` loads it."""
    from flashdraft.data.template import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random hybrid Qwen3.5 (8 layers: 3 linear-attention + 1 full, twice; width 64)
    with the real Qwen3 tokenizer."""
    from tiny_models import tiny_qwen3_5

    return tiny_qwen3_5(tmp_path_factory.mktemp("tiny-qwen3_5") / "model")


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[object, dict[str, str]]]:
    """A real S3 server (moto, on loopback) with a bucket `runs`: (its fsspec filesystem, the
    AWS_* variables that point a client at it, set in this process for the test)."""
    pytest.importorskip("s3fs")
    import fsspec
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        # moto keeps its buckets in process-wide state, across servers: start empty.
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"))
        aws = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ENDPOINT_URL_S3": endpoint,
        }
        for key, value in aws.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint})
        fs.mkdir("runs")
        yield fs, aws
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture(scope="session")
def quality() -> ModuleType:
    """experiments/quality.py as a module (it imports its neighbours, bench/quality_*.py, as the
    script does; each is then in sys.modules under its own name)."""
    return script_modules("experiments", "quality")["quality"]
