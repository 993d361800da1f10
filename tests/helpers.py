"""Small deterministic builders shared by the tests (not fixtures: plain functions)."""

from __future__ import annotations

import importlib
import json
import sys
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.head import TargetHead


def tiny_config(**overrides: object) -> DrafterConfig:
    base: dict[str, object] = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=97,
        block_size=4,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        mask_token_id=96,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512,
    )
    base.update(overrides)
    return DrafterConfig(**base)  # type: ignore[arg-type]


def tiny_drafter(config: DrafterConfig | None = None, seed: int = 0) -> DFlashDrafter:
    config = config or tiny_config()
    drafter = DFlashDrafter(config)
    drafter.reset_parameters(seed)
    # Non-trivial norm weights, so a norm applied in the wrong place shows.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return drafter


def tiny_head(config: DrafterConfig, seed: int = 0, softcap: float | None = None) -> TargetHead:
    gen = torch.Generator().manual_seed(seed)
    embedding = nn.Embedding(config.vocab_size, config.hidden_size)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(embedding.weight.shape, generator=gen))
    weight = torch.randn(config.vocab_size, config.hidden_size, generator=gen) * 0.2
    return TargetHead(embedding=embedding, weight=weight, softcap=softcap)


def prepare_chitchat(out: Path, tokenizer: Path, count: int) -> Path:
    """A prepared dataset of `count` real chitchat conversations, through the CLI."""
    from flashdraft import cli
    from flashdraft.assets import chitchat_conversations

    out.parent.mkdir(parents=True, exist_ok=True)
    source = out.parent / f"{out.name}.jsonl"
    with open(source, "w") as f:
        for record in chitchat_conversations(count, seed=1):
            f.write(json.dumps(record) + "\n")
    args = ["prepare", str(source), "--tokenizer", str(tokenizer), "--output", str(out)]
    assert cli.main([*args, "--workers", "1", "--no-progress"]) == 0
    return out


def train_settings(output: object, target: Path, data: Path, **extra: object) -> list[str]:
    """`--set` arguments of a small, fast training run (override any key with `extra`)."""
    values: dict[str, object] = {
        "output": f'"{output}"',
        "target.path": f'"{target}"',
        "data.datasets": f'["{data}"]',
        "data.row_tokens": 256,
        "drafter.num_layers": 1,
        "drafter.block_size": 8,
        "loss.anchors": 24,
        "loss.chunk_rows": 256,
        "optim.lr": 1e-2,
        "optim.warmup_steps": 3,
        "optim.max_steps": 32,
        "log.every": 4,
        "log.progress": "false",
        "checkpoint.every": 8,
        **extra,
    }
    args: list[str] = []
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return args


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def tiny_llama(
    vocab_size: int = 64,
    hidden_size: int = 64,
    num_layers: int = 4,
    initializer_range: float = 0.02,
    seed: int = 0,
) -> nn.Module:
    """A tiny random Llama target (frozen, eval mode) for decode-loop tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.eval().requires_grad_(False)


def drafter_config_for(target: nn.Module, **overrides: object) -> DrafterConfig:
    """Drafter geometry matching a tiny target (2 taps, last vocab id as MASK)."""
    text = target.config
    base: dict[str, object] = dict(
        hidden_size=text.hidden_size,
        intermediate_size=2 * text.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=text.hidden_size // 4,
        vocab_size=text.vocab_size,
        block_size=4,
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=[1, text.num_hidden_layers - 2],
        mask_token_id=text.vocab_size - 1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512,
    )
    base.update(overrides)
    return DrafterConfig(**base)  # type: ignore[arg-type]


def config_flags(cls: type) -> dict[str, str]:
    """Field name -> its command-line flag, for every leaf field of a typed command config
    (nested configs flattened; `--no-x` for booleans that default to true; positional
    fields by name)."""
    import dataclasses
    import typing

    flags: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            flags.update(config_flags(hints[f.name]))
        elif f.metadata.get("positional"):
            flags[f.name] = f.name
        else:
            negated = "--no-" if f.default is True else "--"
            flags[f.name] = f.metadata.get("flag") or negated + f.name.replace("_", "-")
    return flags


def parse_command(module: object, cls: type, *argv: str) -> object:
    """The typed config of a subcommand from its command line (`module.add_arguments`)."""
    import argparse

    from flashdraft import config as cfg

    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return cfg.from_args(cls, parser.parse_args(list(argv)))


def tiny_hybrid(
    kind: str = "qwen3_5",
    vocab_size: int = 64,
    hidden_size: int = 64,
    num_layers: int = 4,
    std: float = 0.15,
    seed: int = 0,
) -> nn.Module:
    """A tiny random hybrid target (frozen, eval mode, fp32, sdpa): `tiny_models.tiny_hybrid_model`
    (Qwen3.5, its MoE variant or Qwen3-Next) with a small vocabulary and no special tokens."""
    from tiny_models import tiny_hybrid_model

    model = tiny_hybrid_model(
        kind,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        max_position_embeddings=512,
        std=std,
        seed=seed,
    )
    model.config._attn_implementation = "sdpa"
    return model.eval().requires_grad_(False)


def tiny_target(kind: str) -> torch.nn.Module:
    """Tiny random targets whose greedy paths vary (weights larger than the default init)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if kind == "llama":
        return tiny_llama(initializer_range=0.3)
    common = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if kind == "mistral":  # a window on every layer
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=6))
    else:  # qwen3; "qwen3-sliding": the last two layers slide over 5 positions
        sliding = dict(use_sliding_window=True, sliding_window=5, max_window_layers=2)
        extra = sliding if kind == "qwen3-sliding" else {}
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, **extra))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval().requires_grad_(False)


def random_packed_row(seed: int, length: int = 48) -> tuple[torch.Tensor, ...]:
    """A packed row of 4 documents of random lengths (new boundaries every seed): ids,
    per-document positions, doc ids, each [1, length]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (1, length), generator=gen)
    sizes = torch.randint(5, 15, (3,), generator=gen).tolist()
    sizes.append(length - sum(sizes))
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])[None]
    positions = torch.cat([torch.arange(n) for n in sizes])[None]
    return ids, positions, docs


def emulated_flash_varlen(query, key, value, cu_q, cu_k, max_q, max_k, used_k, scale):
    """What `flashdraft.model.varlen._flash_varlen` computes (FA2's varlen forward with
    `seqused_k`), one sequence at a time on any device: queries cu_q[s]..cu_q[s+1] attend,
    unmasked, to keys cu_k[s]..cu_k[s] + used_k[s]; the rest of a span is never read (here
    it is poisoned with NaN first, so a read would show)."""
    out = torch.empty_like(query)
    key, value = key.clone(), value.clone()
    for s in range(len(cu_q) - 1):
        q0, q1, k0, used = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(used_k[s])
        assert q1 - q0 <= max_q and used <= int(cu_k[s + 1]) - k0 <= max_k
        key[k0 + used : int(cu_k[s + 1])] = float("nan")
        q = query[q0:q1].transpose(0, 1)  # [H, n, D]
        k, v = (t[k0 : k0 + used].transpose(0, 1) for t in (key, value))
        weights = torch.softmax((q @ k.transpose(1, 2)) * scale, dim=-1)
        out[q0:q1] = (weights @ v).transpose(0, 1)
    return out


def script_modules(folder: str, *names: str) -> dict[str, ModuleType]:
    """FOLDER/NAME.py (FOLDER: `bench` or `experiments`) as modules, imported as their scripts
    run: they import their neighbours, so FOLDER is on sys.path while they load."""
    path = str(Path(__file__).resolve().parents[1] / folder)
    sys.path.insert(0, path)
    try:
        return {name: importlib.import_module(name) for name in names}
    finally:
        sys.path.remove(path)


def record_run_ahead(monkeypatch: object) -> list[int]:
    """The row count of every `AheadTarget.run_ahead` call (the target's groups), in order."""
    from flashdraft.train.features import AheadTarget

    groups: list[int] = []
    run_ahead = AheadTarget.run_ahead

    def recorded(self: AheadTarget, rows: list) -> None:
        groups.append(len(rows))
        run_ahead(self, rows)

    monkeypatch.setattr(AheadTarget, "run_ahead", recorded)  # type: ignore[attr-defined]
    return groups


BENCH_PARTS = (
    "target forward",
    "drafter step",
    "full online step",
    "full online steps, back to back",
)


def rows_by_part(result: dict) -> tuple[int, ...]:
    """A bench result's rows of each timed part, in `BENCH_PARTS` order (a part it lacks: 0)."""
    rows = {r["what"]: r["rows"] for r in result["results"]}
    return tuple(rows.get(part, 0) for part in BENCH_PARTS)


def speculators_oracle(module: str = "speculators") -> ModuleType:
    """speculators (the peer, a test oracle; `make test` installs it) or a skip where it is not
    installed at all. Installed but failing to import (a dependency missing) is an error, not
    a skip: the oracle tests must not vanish silently from a run that meant to have them."""
    try:
        metadata.version("speculators")
    except metadata.PackageNotFoundError:
        pytest.skip("speculators is not installed (make test installs it: the Makefile's ORACLES)")
    return importlib.import_module(module)


def quality_eval_report(tau: float, acc: list[float], **extra: object) -> dict:
    return {
        "tau": tau,
        "num_prompts": 8,
        "per_position_acceptance": acc,
        "lossless_prompts": 7,
        "near_tie_prompts": 1,
        "unexplained_mismatch_prompts": 0,
        **extra,
    }


def synthetic_quality_run(out: Path) -> None:
    """A finished `experiments/quality.py` run in OUT/runs/r: metrics of 10 logged intervals (evals
    at steps 50 and 100), two held-out reports, the split and the stage markers."""
    run = out / "runs" / "r"
    (run / "eval").mkdir(parents=True)
    lines = []
    for step in range(10, 101, 10):
        record = {"step": step, "loss": 5.0 - step / 50, "tau_hat": 1 + step / 100, "tokens": 81920}
        if step in (50, 100):
            record["eval_tau"] = 1.5 if step == 50 else 2.25
        lines.append(json.dumps(record))
    # Step 30 logged before a crash, then again by the resumed run: the later line counts.
    lines.insert(2, json.dumps({"step": 30, "loss": 9.0, "tau_hat": 9.0, "tokens": 1}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    zlab = {"tau": 2.4, "steps": 10}
    (run / "eval" / "chat.json").write_text(
        json.dumps(quality_eval_report(2.5, [0.6, 0.4, 0.2], speedup=1.8, zlab_reference=zlab))
    )
    looped = {**quality_eval_report(3.75, [0.8] * 15), "loop_prompts": 3, "tau_before_loops": 2.9}
    (run / "eval" / "humaneval.json").write_text(json.dumps(looped))
    (run / "eval" / "chat_t1.json").write_text(json.dumps(quality_eval_report(1.4, [0.3, 0.1])))
    (run / "eval" / "chat_trained.json").write_text(
        json.dumps(quality_eval_report(4.6, [0.7, 0.5]))
    )
    (out / "stages").mkdir()
    (out / "stages" / "train-r.json").write_text(json.dumps({"finished": True, "seconds": 612.0}))
    sampling = {"temperature": 0.0, "max_new_tokens": 256}
    (out / "stages" / "generate-greedy.json").write_text(
        json.dumps({"settings": {"prompts": 1000, "sampling": sampling, "seed": 0}, "seconds": 9})
    )
    (out / "prompts").mkdir()
    counts = {"sources": 10, "held_out_sources": 2, "train_prompts": 30, "held_out_prompts": 6}
    (out / "prompts" / "split.json").write_text(
        json.dumps({"settings": {"seed": 3}, "counts": {"chat": counts}})
    )
