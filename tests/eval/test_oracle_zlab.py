"""z-lab's reference implementation (`dflash` 0.1.0, installed by `make test`) as the oracle for
what flashdraft trains, exports and evaluates.

On the real SmolLM2-135M target in fp32, for a drafter with only full-attention layers and one
that mixes full and sliding layers with a window smaller than the block (W = 5, B = 8; random,
non-trivial weights), z-lab's `DFlashDraftModel` loaded from our dflash export must give
  * the draft logits of our decode path and of our training path (all blocks of a row in one
    pass under the flex/SDPA mask), and
  * through its own `dflash_generate`, the tokens, acceptance lengths and per-step drafts of
    `flashdraft.eval.evaluate.evaluate_drafter` (the HF decode loop).
The sliding case fails with the older per-block window mask (docs/design.md §8 trap 5).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from dflash.model import DFlashDraftModel, dflash_generate, extract_context_feature
from helpers import tiny_drafter

from flashdraft.eval.evaluate import evaluate_drafter
from flashdraft.eval.speculative import eos_token_ids
from flashdraft.export import load_dflash, save_dflash
from flashdraft.model.attention import BlockLayout
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter, DraftCache
from flashdraft.model.head import TargetHead
from flashdraft.model.target import LayerTaps, load_target
from flashdraft.train.blocks import block_inputs

BLOCK, WINDOW = 8, 5
# (draft layers that slide, the MLP width: None is the target's; "narrow" is how a 5-layer
# SmolLM2 drafter fits the 25 MB: engines and z-lab read the width from config.json)
KINDS: dict[str, tuple[list[int], int | None]] = {
    "full": ([], None),
    "mixed": ([0], None),
    "narrow": ([], 704),
}
PROMPTS = ("What is the capital of France?", "List three prime numbers.")


@pytest.fixture(scope="module")
def target(smollm2_dir):
    return load_target(str(smollm2_dir), "float32")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(
    scope="module",
    params=[pytest.param(k, marks=pytest.mark.slow) if k == "narrow" else k for k in sorted(KINDS)],
)
def pair(request, target, tmp_path_factory) -> tuple[DFlashDrafter, Any]:
    """(our drafter, z-lab's model), both read from one dflash export, fp32."""
    sliding, width = KINDS[request.param]
    config = DrafterConfig.from_target_config(
        target.config,
        mask_token_id=0,  # <|endoftext|>: in the table, never in a prompt below
        num_layers=2,
        block_size=BLOCK,
        sliding_window=WINDOW if sliding else None,
        sliding_layers=sliding,
        intermediate_size=width,
    )
    config = DrafterConfig.from_dict({**config.to_dict(), "initializer_range": 0.05})
    out = tmp_path_factory.mktemp(f"export-{request.param}")
    save_dflash(tiny_drafter(config, seed=11), str(out))
    ours = load_dflash(str(out), torch.float32).eval()
    zlab = DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    if width is not None:
        assert zlab.config.intermediate_size == width != target.config.intermediate_size
    return ours, zlab


def _prompt_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def _zlab_block(zlab, target, features, block_ids, anchor) -> torch.Tensor:
    """z-lab's draft logits [B-1, V] for the block anchored at `anchor`, one forward."""
    embeds = torch.nn.functional.embedding(block_ids, target.get_input_embeddings().weight)
    hidden = zlab(
        target_hidden=features[:, :anchor],
        noise_embedding=embeds,
        position_ids=torch.arange(anchor + BLOCK)[None],
    )
    return zlab.compute_logits(hidden[:, 1:], target.lm_head)[0]


def test_draft_logits_equal_zlab_decode_and_training_paths(pair, target, tokenizer) -> None:
    ours, zlab = pair
    config = ours.config
    head = TargetHead.from_model(target)
    ids = torch.tensor([_prompt_ids(tokenizer, " ".join(PROMPTS))])
    length = ids.shape[1]
    taps = LayerTaps(target, config.target_layer_ids)
    try:
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
        ours_features = taps.features()
    finally:
        taps.remove()
    features = extract_context_feature(out.hidden_states, config.target_layer_ids)
    torch.testing.assert_close(ours_features, features, rtol=0, atol=0)  # the tap convention

    anchors = torch.tensor([[3, 17, length - BLOCK - 1]])
    positions = torch.arange(length)[None]
    block_ids, block_pos = block_inputs(ids, positions, anchors, BLOCK, config.mask_token_id)
    layout = BlockLayout(anchors, torch.ones_like(anchors, dtype=torch.bool), 0 * ids, BLOCK)
    with torch.no_grad():
        trained = ours(
            features, head.embed(block_ids), positions, block_pos, ours.build_masks(layout, "sdpa")
        )
    trained = trained.view(anchors.shape[1], BLOCK, -1)
    for j, anchor in enumerate(anchors[0].tolist()):
        reference = _zlab_block(
            zlab, target, features, block_ids[:, j * BLOCK : (j + 1) * BLOCK], anchor
        )
        cache = DraftCache()
        ours.extend_cache(cache, features[:, :anchor], positions[:, :anchor])
        with torch.no_grad():
            decoded = ours.draft_block(
                cache, head.embed(block_ids[:, j * BLOCK : (j + 1) * BLOCK]), anchor
            )
        # Within 1e-5 of the logit scale (|logits| ~ 20): the training path reduces over the
        # whole packed row in another order than a single block does.
        atol = 1e-5 * float(reference.abs().max())
        torch.testing.assert_close(head.logits(decoded[0, 1:]), reference, rtol=1e-5, atol=atol)
        torch.testing.assert_close(head.logits(trained[j, 1:]), reference, rtol=1e-5, atol=atol)


def test_generation_equals_zlab_dflash_generate(pair, target, tokenizer, monkeypatch) -> None:
    ours, zlab = pair
    max_new = 10
    # dflash_generate times itself with torch.cuda.synchronize when asked for its stats.
    monkeypatch.setattr("dflash.model._cuda_time", time.perf_counter)
    stop = sorted(eos_token_ids(target, tokenizer))
    prompts = [_prompt_ids(tokenizer, text) for text in PROMPTS]

    # Record every step's draft hidden states (slots 1..B-1) on both sides.
    zlab_steps: list[torch.Tensor] = []
    ours_steps: list[torch.Tensor] = []
    zlab_logits = zlab.compute_logits

    def zlab_record(hidden, head):
        zlab_steps.append(hidden[0].clone())
        return zlab_logits(hidden, head)

    ours_draft = ours.draft_block

    def ours_record(cache, embeds, start):
        hidden = ours_draft(cache, embeds, start)
        ours_steps.append(hidden[0, 1:].clone())
        return hidden

    zlab.compute_logits = zlab_record
    ours.draft_block = ours_record
    try:
        report = evaluate_drafter(
            target, None, ours, prompts, max_new_tokens=max_new, reference=False
        )
        expected = []
        for ids in prompts:
            result = dflash_generate(
                zlab, target, torch.tensor([ids]), max_new, stop, return_stats=True
            )
            expected.append((result.output_ids[0, len(ids) :].tolist(), result.acceptance_lengths))
    finally:
        del zlab.compute_logits, ours.draft_block
    got = [(p["output_ids"], p["acceptance_lengths"]) for p in report["per_prompt"]]
    assert got == expected
    # z-lab drafts a shorter block once fewer than B tokens remain: compare full blocks only.
    full = [(z, o) for z, o in zip(zlab_steps, ours_steps, strict=True) if z.shape[0] == BLOCK - 1]
    assert len(full) >= len(prompts) * 3
    for z, o in full:
        torch.testing.assert_close(o, z, rtol=1e-5, atol=1e-5)
