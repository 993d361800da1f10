"""`flashdraft eval`: prompts, report accounting, and lossless decoding on real SmolLM2-135M."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import drafter_config_for, tiny_config, tiny_llama

from flashdraft import cli
from flashdraft.eval.evaluate import (
    EvalPrompt,
    diagnose_mismatch,
    evaluate_drafter,
    load_prompts,
    plot_acceptance,
    render_prompt,
    summarize,
)
from flashdraft.eval.speculative import DecodeResult
from flashdraft.export import save_dflash, save_speculators
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter, init_seeded
from flashdraft.model.head import TargetHead
from flashdraft.model.target import Target, load_target
from flashdraft.train.blocks import label_positions, slot_weights
from flashdraft.train.checkpoint import save_drafter
from flashdraft.train.step import DraftBatch, batch_normaliser, draft_loss

SMOL_EOS = 2  # <|im_end|>, from SmolLM2's generation config


def _result(lengths: list[int]) -> DecodeResult:
    return DecodeResult(
        output_ids=list(range(sum(lengths) + 1)),
        acceptance_lengths=lengths,
        prompt_len=3,
        prefill_s=0.0,
        decode_s=0.0,
        stopped_at_eos=False,
    )


def test_summary_accounting() -> None:
    results = [_result([4, 1, 2, 4]), _result([1, 3]), _result([])]
    report = summarize(results, block_size=4)
    lengths = [4, 1, 2, 4, 1, 3]
    assert report["tau"] == pytest.approx(sum(lengths) / len(lengths))
    assert report["acceptance_histogram"] == [2, 1, 1, 2]
    assert report["total_steps"] == 6 and report["decode_tokens"] == 15
    assert report["output_tokens"] == 15 + 3
    # draft k accepted iff the step emitted >= k + 1 tokens
    assert report["per_position_acceptance"] == pytest.approx([4 / 6, 3 / 6, 2 / 6])
    assert report["conditional_acceptance"] == pytest.approx([4 / 6, 3 / 4, 2 / 3])
    assert report["median_acceptance_length"] == 2.5
    assert report["prompt_tau_mean"] == pytest.approx((11 / 4 + 2) / 2)
    empty = summarize([_result([])], block_size=4)
    assert empty["tau"] is None and empty["per_position_acceptance"] == [0.0, 0.0, 0.0]
    assert plot_acceptance(report)[:8] == b"\x89PNG\r\n\x1a\n"


# ---- prompts ----


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_prompt_shapes_render_with_the_generation_prompt(smol_tokenizer) -> None:
    tok = smol_tokenizer
    chat = [{"role": "user", "content": "Hi there"}]
    expected = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = render_prompt({"messages": chat}, tok)
    assert tok.decode(ids) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    # A training conversation: its final answer is dropped, the model is asked for it.
    answered = [*chat, {"role": "assistant", "content": "Hello!"}]
    assert render_prompt({"messages": answered}, tok) == ids
    sharegpt = {"conversations": [{"from": "human", "value": "Hi there"}]}
    assert render_prompt(sharegpt, tok) == ids
    assert render_prompt({"prompt": "def add(a, b):"}, tok) == tok("def add(a, b):").input_ids


def test_load_prompts_names_the_bad_line(tmp_path, smol_tokenizer) -> None:
    path = tmp_path / "prompts.jsonl"
    good = json.dumps({"id": "a", "prompt": "Once upon a time"})
    path.write_text(good + "\n\n" + json.dumps({"completion": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:3"):
        load_prompts(str(path), smol_tokenizer)
    prompts = load_prompts(str(path), smol_tokenizer, limit=1)
    assert prompts[0].id == "a" and prompts[0].input_ids


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
        ids = render_prompt({"messages": [{"role": "user", "content": q}]}, smol_tokenizer)
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
        features, labels = target.forward_packed(
            ids, positions, docs, label_positions(anchors, BLOCK, length)
        )
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


# ---- the CLI end to end (tiny Qwen3 target, exported and training-checkpoint drafters) ----


def test_eval_cli_writes_report_and_plot(tmp_path, tiny_qwen3_dir) -> None:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    drafter = DFlashDrafter(drafter_config_for(target, mask_token_id=151669, block_size=4))
    drafter.reset_parameters(seed=0)
    save_drafter(str(tmp_path / "ckpt"), drafter)
    save_speculators(drafter, str(tmp_path / "spec"), verifier=str(tiny_qwen3_dir))
    # z-lab's published configs: transformers-4 rope fields, no layer_types, an auto_map.
    save_dflash(drafter, str(tmp_path / "zlab"))
    zlab = json.loads((tmp_path / "zlab" / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "use_sliding_window", "max_window_layers"):
        zlab.pop(key)
    zlab["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (tmp_path / "zlab" / "config.json").write_text(json.dumps(zlab))
    prompts = tmp_path / "prompts.jsonl"
    records = [
        {"id": "p0", "messages": [{"role": "user", "content": "Say hi"}]},
        {"id": "p1", "prompt": "The quick brown fox"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    for source in ("zlab", "spec", "ckpt"):  # our dflash export is the zlab one, unstripped
        out = tmp_path / f"{source}.json"
        argv = ["eval", "--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / source)]
        argv += ["--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "12"]
        assert cli.main(argv) == 0
        report = json.loads(out.read_text())
        assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
        assert {"tau", "acceptance_histogram", "per_position_acceptance", "per_prompt"} <= set(
            report
        )
        assert [p["id"] for p in report["per_prompt"]] == ["p0", "p1"]
        assert report["lossless"] is True
        for entry in report["per_prompt"]:
            assert {"acceptance_lengths", "output_ids", "text", "lossless"} <= set(entry)
            assert sum(entry["acceptance_lengths"]) + 1 == len(entry["output_ids"])
        assert report["settings"]["block_size"] == 4


def test_eval_refuses_a_drafter_for_another_target(tmp_path, tiny_qwen3_dir, capsys) -> None:
    config = tiny_config(vocab_size=151936, mask_token_id=151669)  # hidden 32, not 64
    drafter = DFlashDrafter(config)
    save_dflash(drafter, str(tmp_path / "export"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    argv = ["eval", "--target", str(tiny_qwen3_dir), "--drafter", str(tmp_path / "export")]
    argv += ["--prompts", str(prompts), "--output", str(tmp_path / "r.json")]
    assert cli.main(argv) == 2
    assert "hidden size 32" in capsys.readouterr().err


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


# ---- a T = 0 output that leaves the baseline: near-tie of the target, or a bug ----


class _TableLogits(torch.nn.Module):
    """A 'target' whose logits depend only on the position: row p of `table` predicts the token
    at position p + 1, whatever the tokens are (enough to teacher-force a diagnosis)."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table), requires_grad=False)

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        from types import SimpleNamespace

        rows = self.table[: input_ids.shape[1]][None]
        return SimpleNamespace(logits=rows[:, -logits_to_keep:] if logits_to_keep else rows)


FLAT = [5.0, 0.0, 0.0, 0.0]  # token 0 is the clear choice
TIE = [0.0, 12.30, 12.05, 3.0]  # tokens 1 and 2 are 0.25 apart
WIDE = [0.0, 12.30, 10.00, 3.0]


@pytest.mark.parametrize(
    ("at_index_2", "then", "near_tie", "worst"),
    [
        (TIE, 0, True, 0.25),  # a flipped tie, then the target's choice on the new branch
        (WIDE, 0, False, 2.3),  # token 2 is 2.3 below the choice: not a tie
        (TIE, 3, False, 5.0),  # a tie at 2, then a token the target would never pick
    ],
)
def test_mismatch_diagnosis(at_index_2, then, near_tie, worst) -> None:
    prompt, output = [0], [0, 0, 2, then]  # greedy would have emitted token 1 at index 2
    # row p predicts the token at position p + 1: the prompt is position 0, output[i] is i + 1
    target = _TableLogits([FLAT, FLAT, at_index_2, FLAT])
    out = diagnose_mismatch(target, prompt, output, index=2, tolerance=0.5)
    assert out["index"] == 2 and out["token"] == 2 and out["near_tie"] is near_tie
    assert out["worst_below_top"] == pytest.approx(worst, abs=1e-5)
    assert ("reason" in out) is not near_tie


def test_mismatch_diagnosis_of_an_early_stop() -> None:
    out = diagnose_mismatch(_TableLogits([FLAT] * 4), [0], [0, 0], index=2, tolerance=0.5)
    assert out["near_tie"] is False and "stops early" in out["reason"]


def test_a_broken_verify_step_is_an_unexplained_mismatch(monkeypatch) -> None:
    """If the loop emitted anything but the target's choice, eval must say so, not call it a tie:
    here the verify step emits the target's least likely token after the first step."""
    from flashdraft.eval.speculative import Sampler

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
