"""The measurement: lossless decoding on real SmolLM2-135M, sampling, broken loops, the config."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest
import torch
from helpers import drafter_config_for, tiny_llama

from flashdraft.benchutil import machine_id
from flashdraft.eval.evaluate import (
    EvalConfig,
    check_compatible,
    choose_decoder,
    evaluate_drafter,
    load_eval_target,
    run_eval,
)
from flashdraft.eval.prompts import EvalPrompt, prompt_ids
from flashdraft.eval.speculative import Sampler
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter, init_seeded
from flashdraft.model.head import TargetHead
from flashdraft.model.target import LayerTaps, Target, load_target
from flashdraft.train.blocks import label_positions, slot_weights
from flashdraft.train.step import DraftBatch, batch_normaliser, draft_loss

SMOL_EOS = 2  # <|im_end|>, from SmolLM2's generation config


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


# ---- real SmolLM2-135M: lossless with an untrained and a trained drafter ----

TRAINED_TOKENS, EVAL_TOKENS, BLOCK = 16, 24, 4


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return load_target(str(smollm2_dir), dtype="float32", attn_implementation="sdpa")


@pytest.fixture(scope="module")
def chats(smol, smol_tokenizer):
    """Two chat prompts and SmolLM2's own greedy answers (HF `generate`, the reference)."""
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    out = []
    for q in questions:
        ids = prompt_ids({"messages": [{"role": "user", "content": q}]}, smol_tokenizer)
        x = torch.tensor([ids])
        generated = smol.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=EVAL_TOKENS,
            eos_token_id=[SMOL_EOS],
            pad_token_id=SMOL_EOS,
        )
        out.append((ids, generated[0, len(ids) :].tolist()))
    return out


def fit_drafter(smol, chats, steps: int = 100) -> DFlashDrafter:
    """A drafter fit to SmolLM2's answers to the test prompts (their first TRAINED_TOKENS).

    Cheap on a CPU: one layer, and the cross-entropy over a 2k-token slice of the vocabulary
    (the labels plus random negatives) instead of all 49152 rows; decoding then uses the
    full head. It memorises the trained spans and knows nothing past them, so decoding to
    EVAL_TOKENS mixes full, partial and no acceptance.
    """
    config = DrafterConfig.from_target_config(
        smol.config, mask_token_id=16, num_layers=1, block_size=BLOCK, intermediate_size=512
    )
    drafter = init_seeded(config, seed=0)
    target = Target(smol, config.target_layer_ids, backend="sdpa")
    rows = []
    for prompt, answer in chats:
        ids = torch.tensor([prompt + answer[:TRAINED_TOKENS]])
        length, start = ids.shape[1], len(prompt)
        positions = torch.arange(length)[None]
        docs = torch.zeros_like(ids)
        loss_mask = (positions >= start).long()
        anchors = torch.arange(start, length - 1)[None]
        out = target.packed_outputs(ids, positions, docs, label_positions(anchors, BLOCK, length))
        features, labels = out.features, out.next_tokens
        assert labels is not None
        valid = torch.ones_like(anchors, dtype=torch.bool)
        rows.append(DraftBatch(ids, positions, docs, loss_mask, anchors, valid, features, labels))
    target.taps.remove()
    vocab = smol.config.vocab_size
    negatives = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:2000]
    keep = torch.unique(torch.cat([negatives, *(r.next_tokens.flatten() for r in rows)]))
    remap = torch.full((vocab,), -1, dtype=torch.long)
    remap[keep] = torch.arange(len(keep))
    for r in rows:
        r.next_tokens = remap[r.next_tokens]
    head = TargetHead(embedding=smol.get_input_embeddings(), weight=smol.lm_head.weight[keep])
    slot_w = slot_weights(BLOCK, 7.0)
    norm = sum(batch_normaliser(r, BLOCK, slot_w) for r in rows)
    opt = torch.optim.AdamW(drafter.parameters(), lr=2e-3, weight_decay=0.0)
    for _ in range(steps):
        opt.zero_grad()
        for r in rows:
            loss, _ = draft_loss(drafter, head, r, slot_w, norm, "sdpa", 256)
            loss.backward()
        opt.step()
    return drafter


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_lossless_on_smollm2_with_an_untrained_drafter(smol, smol_tokenizer, chats) -> None:
    config = DrafterConfig.from_target_config(
        smol.config, mask_token_id=16, num_layers=1, block_size=BLOCK, intermediate_size=512
    )
    drafter = init_seeded(config, seed=1)
    prompt, greedy = chats[1]  # the longer answer: 24 tokens, no eos
    report = evaluate_drafter(smol, smol_tokenizer, drafter, [prompt], max_new_tokens=EVAL_TOKENS)
    entry = report["per_prompt"][0]
    assert entry["output_ids"] == greedy
    assert report["lossless"] and entry["lossless"]
    assert report["tau"] == pytest.approx(
        sum(entry["acceptance_lengths"]) / len(entry["acceptance_lengths"])
    )
    assert "speedup" not in report  # CPU: no speedup claim


def test_lossless_on_smollm2_with_a_trained_drafter(smol, smol_tokenizer, chats) -> None:
    drafter = fit_drafter(smol, chats)
    prompts = [EvalPrompt(f"chat{i}", p) for i, (p, _) in enumerate(chats)]
    report = evaluate_drafter(smol, smol_tokenizer, drafter, prompts, max_new_tokens=EVAL_TOKENS)
    lengths = []
    for entry, (_, greedy) in zip(report["per_prompt"], chats, strict=True):
        assert entry["output_ids"] == greedy  # equal to HF generate, token for token
        assert entry["lossless"]
        assert entry["text"] == smol_tokenizer.decode(greedy)
        lengths += entry["acceptance_lengths"]
    assert report["lossless"] and report["lossless_prompts"] == 2
    assert report["tau"] == pytest.approx(sum(lengths) / len(lengths))
    assert report["tau"] > 1.5, report["acceptance_histogram"]
    assert max(lengths) == BLOCK and min(lengths) == 1  # full and no acceptance both occur
    assert sum(report["acceptance_histogram"][1:-1]) > 0  # and partial acceptance
    assert sum(report["acceptance_histogram"]) == report["total_steps"] == len(lengths)


def test_sampling_eval_is_seeded_and_makes_no_lossless_claim() -> None:
    target = tiny_llama(initializer_range=0.3)
    drafter = DFlashDrafter(drafter_config_for(target, block_size=4))
    drafter.reset_parameters(seed=0)
    prompts = [[5, 17, 3, 42], [8, 11, 29]]  # token ids: no tokenizer needed

    def run(seed: int) -> dict:
        return evaluate_drafter(
            target, None, drafter, prompts, max_new_tokens=20, temperature=0.8, seed=seed
        )

    first, again, other = run(0), run(0), run(1)
    outputs = [[p["output_ids"] for p in r["per_prompt"]] for r in (first, again, other)]
    assert outputs[0] == outputs[1] != outputs[2]
    assert "lossless" not in first and "lossless" not in first["per_prompt"][0]
    assert first["settings"]["reference"] is False  # nothing to compare against on a CPU
    assert first["per_prompt"][0]["text"] is None


# ---- golden values: recorded with the evaluation code of `a5725ce`, before it was split ----

GOLDEN = {
    0.0: {
        "output_ids": [
            [12, 36, 38, 11, 16, 25, 32, 4, 57, 25, 18, 26, 41, 24, 55, 52],
            [61, 12, 21, 12, 16, 52, 25, 16, 29, 53, 28, 13, 23, 48, 39, 46],
        ],
        "acceptance_lengths": [[1] * 15, [1] * 15],
        "acceptance_histogram": [30, 0, 0, 0],
    },
    1.5: {
        "output_ids": [
            [58, 27, 0, 55, 46, 61, 59, 6, 38, 46, 45, 49, 45, 25, 55, 25],
            [0, 16, 52, 54, 19, 33, 61, 14, 41, 50, 27, 23, 39, 56, 15, 57],
        ],
        "acceptance_lengths": [[1, 1, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1, 1], [2, 3, 2, 1, 2, 1, 3, 1]],
        "acceptance_histogram": [14, 5, 2, 0],
    },
}


@pytest.mark.parametrize("temperature", sorted(GOLDEN))
def test_a_fixed_seed_eval_reproduces_the_pinned_outputs(temperature: float) -> None:
    target = tiny_llama(initializer_range=0.3)
    drafter = DFlashDrafter(drafter_config_for(target, block_size=4))
    drafter.reset_parameters(seed=0)
    prompts = [[5, 17, 3, 42], [8, 11, 29]]
    report = evaluate_drafter(
        target, None, drafter, prompts, max_new_tokens=16, temperature=temperature
    )
    golden = GOLDEN[temperature]
    assert [e["output_ids"] for e in report["per_prompt"]] == golden["output_ids"]
    assert [e["acceptance_lengths"] for e in report["per_prompt"]] == golden["acceptance_lengths"]
    assert report["acceptance_histogram"] == golden["acceptance_histogram"]
    lengths = [n for row in golden["acceptance_lengths"] for n in row]
    assert report["tau"] == sum(lengths) / len(lengths)


# ---- a T = 0 output that leaves the baseline: a bug must be called one ----


def test_a_broken_verify_step_is_an_unexplained_mismatch(monkeypatch) -> None:
    """If the loop emitted anything but the target's choice, eval must say so, not call it a tie:
    here the verify step emits the target's least likely token after the first step."""
    target = tiny_llama(initializer_range=0.3)
    drafter = DFlashDrafter(drafter_config_for(target, block_size=4))
    drafter.reset_parameters(seed=0)
    prompts = [[5, 17, 3, 42], [8, 11, 29]]
    clean = evaluate_drafter(target, None, drafter, prompts, max_new_tokens=12)
    assert clean["lossless"] and clean["lossless_up_to_ties"]
    assert clean["near_tie_prompts"] == clean["unexplained_mismatch_prompts"] == 0
    assert all("mismatch" not in e for e in clean["per_prompt"])

    verify = Sampler.verify

    def broken(self, drafts, draft_logits, target_logits):
        accepted, token = verify(self, drafts, draft_logits, target_logits)
        if drafts.shape[0] == 0:  # the B = 1 baseline stays honest
            return accepted, token
        return accepted, target_logits[accepted].argmin()

    monkeypatch.setattr(Sampler, "verify", broken)
    report = evaluate_drafter(target, None, drafter, prompts, max_new_tokens=12)
    assert not report["lossless"] and not report["lossless_up_to_ties"]
    assert report["unexplained_mismatch_prompts"] == 2 and report["near_tie_prompts"] == 0
    for entry in report["per_prompt"]:
        assert "logits below the target's choice" in entry["mismatch"]["reason"]


# ---- the options of `flashdraft eval` and `run_eval` ----


def _config(**overrides: object) -> EvalConfig:
    base: dict[str, object] = {"target": "t", "drafter": "d", "prompts": "p", "output": "r.json"}
    return EvalConfig(**{**base, **overrides})  # type: ignore[arg-type]


def test_eval_config_defaults_and_validation() -> None:
    config = _config()
    assert config.max_new_tokens == 256 and config.temperature == 0.0 and config.reference
    assert config.block_size is None and config.limit is None and config.dtype == "auto"
    assert config.attn_implementation == "sdpa" and config.device is None
    for key, value in [
        ("max_new_tokens", 0),
        ("block_size", 0),
        ("limit", 0),
        ("temperature", -0.5),
        ("dtype", "int8"),
        ("decoder", "vllm"),
    ]:
        with pytest.raises(ValueError, match=rf"^{key} = "):
            _config(**{key: value})


def test_check_compatible_names_every_mismatch() -> None:
    target = tiny_llama()
    check_compatible(DFlashDrafter(drafter_config_for(target)), target)
    other = drafter_config_for(
        target, hidden_size=32, head_dim=8, num_target_layers=6, vocab_size=80, mask_token_id=70
    )
    with pytest.raises(ValueError, match="does not fit this target") as err:
        check_compatible(DFlashDrafter(other), target)
    for problem in ("hidden size 32", "6 target layers", "mask token 70", "vocab size 80"):
        assert problem in str(err.value)


def test_run_eval_casts_the_drafter_and_records_the_command_settings(
    tmp_path, tiny_qwen3_dir
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    records = [{"id": f"p{i}", "prompt": f"Count to {i}"} for i in range(3)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = _config(
        target=str(tiny_qwen3_dir), prompts=str(prompts), limit=2, max_new_tokens=6, device="cpu"
    )
    target, tokenizer = load_eval_target(config)
    assert next(target.parameters()).dtype == torch.float32  # auto on a CPU
    drafter = DFlashDrafter(drafter_config_for(target, mask_token_id=151669, block_size=4))
    drafter.reset_parameters(seed=0)
    report = run_eval(config, target, tokenizer, drafter.to(torch.bfloat16))
    assert [p["id"] for p in report["per_prompt"]] == ["p0", "p1"]
    settings = report["settings"]
    assert settings["drafter_dtype"] == "float32" and settings["max_new_tokens"] == 6
    # what ran the timings: the CPU's model and torch's threads, this host and boot, hashed
    assert settings["device"] == "cpu"
    assert settings["device_name"].endswith(f", {torch.get_num_threads()} threads")
    assert settings["machine"] == machine_id() and len(machine_id()) == 16  # a hash, no host name
    assert socket.gethostname() not in json.dumps(report)
    assert list(settings)[-5:] == ["target", "drafter", "prompts", "decoder", "compile"]
    assert report["loops"]["baseline"]["decoder"] == "hf"  # auto on a CPU
    assert settings["prompts"] == str(prompts) and settings["drafter"] == "d"
    assert report["lossless"] is True
    alone = run_eval(dataclasses.replace(config, reference=False), target, tokenizer, drafter)
    assert alone["settings"]["reference"] is False and "lossless" not in alone


# ---- the two decode loops: static caches (graphs on CUDA) and HF's ----


def test_the_static_loop_gives_the_hf_loops_report() -> None:
    """Same outputs, acceptance lengths and lossless accounting at T = 0; the report says
    which loop ran. With the trainer's hooks passed in, the static loop reads its taps
    itself and leaves the hooks untouched."""
    target = tiny_llama(initializer_range=0.3)
    drafter = DFlashDrafter(drafter_config_for(target, block_size=4))
    drafter.reset_parameters(seed=0)
    prompts = [[5, 17, 3, 42], [8, 11, 29]]
    hf = evaluate_drafter(target, None, drafter, prompts, max_new_tokens=16, decoder="hf")
    taps = LayerTaps(target, drafter.config.target_layer_ids)
    static = evaluate_drafter(
        target, None, drafter, prompts, max_new_tokens=16, decoder="static", taps=taps
    )
    assert not taps.captured
    taps.remove()
    for key in ("output_ids", "acceptance_lengths", "lossless"):
        assert [e[key] for e in static["per_prompt"]] == [e[key] for e in hf["per_prompt"]]
    assert static["tau"] == hf["tau"] and static["lossless"]
    loop = {"decoder": "static", "graphs": False, "compiled": False, "batch_size": 1}
    loop["drafter_compiled"] = False
    assert static["loops"] == {"speculative": loop, "baseline": loop}
    assert hf["loops"]["speculative"]["decoder"] == "hf"
    sampled = [
        evaluate_drafter(target, None, drafter, prompts, max_new_tokens=16, temperature=1.5,
                         decoder="static", seed=seed)["per_prompt"][0]["output_ids"]
        for seed in (0, 0, 1)
    ]  # fmt: skip
    assert sampled[0] == sampled[1] != sampled[2]  # seeded per prompt


def test_the_decoder_choice() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tiny_llama()
    assert choose_decoder("auto", target) == "hf"  # CPU: both eager, HF is the reference
    assert choose_decoder("static", target) == "static"
    assert choose_decoder("hf", target) == "hf"
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert choose_decoder("auto", gpt2) == "hf"
    with pytest.raises(ValueError, match="decoder 'static' cannot run this target"):
        choose_decoder("static", gpt2)


@pytest.mark.gpu
def test_on_cuda_the_static_loop_runs_with_graphs_and_stays_lossless() -> None:
    target = tiny_llama(initializer_range=0.3).cuda()
    drafter = DFlashDrafter(drafter_config_for(target, block_size=4))
    drafter.reset_parameters(seed=0)
    prompts = [[5, 17, 3, 42], [8, 11, 29]]
    hf = evaluate_drafter(target, None, drafter.cuda(), prompts, max_new_tokens=24, decoder="hf")
    # (the compiled step is checked in tests/eval/test_fast.py: each compile costs ~20 s)
    report = evaluate_drafter(target, None, drafter, prompts, max_new_tokens=24)
    loop = report["loops"]["speculative"]
    assert loop == {
        "decoder": "static",
        "graphs": True,
        "compiled": False,
        "drafter_compiled": False,
        "batch_size": 1,
    }
    assert report["loops"]["baseline"] == loop and report["lossless"]
    assert "speedup" in report
    for key in ("output_ids", "acceptance_lengths"):
        assert [e[key] for e in report["per_prompt"]] == [e[key] for e in hf["per_prompt"]]


def test_a_static_forward_that_fails_its_check_is_refused(monkeypatch) -> None:
    """The static forward is checked against HF's before use; asked for explicitly, a failed
    check stops the eval (under auto, on CUDA, the HF loop runs instead, with a warning)."""
    from flashdraft.model.static import StaticLM

    def differs(self: StaticLM, length: int = 12) -> None:
        raise ValueError("static decoding differs from the HF forward (logits: ...)")

    monkeypatch.setattr(StaticLM, "verify", differs)
    target = tiny_llama()
    drafter = DFlashDrafter(drafter_config_for(target, block_size=4))
    with pytest.raises(ValueError, match="differs from the HF forward"):
        evaluate_drafter(target, None, drafter, [[5, 17, 3]], max_new_tokens=4, decoder="static")
