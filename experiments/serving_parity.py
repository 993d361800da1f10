"""flashdraft's drafter against the reference implementations, on the real SmolLM2-135M target.

    python experiments/serving_parity.py                    # z-lab's dflash on the dflash export
    python experiments/serving_parity.py --speculators   # + speculators (make test installs it)

For three random drafters with non-trivial weights (two full-attention layers; one sliding and
one full layer; two sliding layers; window W = 5 < B = 8), on one chat prompt in fp32: the
draft logits of flashdraft's training path (all blocks of the row in one pass) at a few
anchors, against
  * z-lab's `DFlashDraftModel` (`dflash` 0.1.0) loaded from the dflash export, one forward per
    block, as its `dflash_generate` drafts;
  * with `--speculators`, speculators' `DFlashDraftModel` (0.9.0) loaded from the speculators
    export (verifier weights from the same SmolLM2 directory), through its training forward
    with the same anchors; the mixed drafter has no speculators export (refused: vLLM would
    make its full layers causal, vllm-project/vllm PR #56692);
  * the per-layer causality vLLM's speculators adapter derives from that export
    (`flashdraft.export.engine_view`), against the trained one.
Reports, per drafter and reference, the largest absolute logit difference and the argmax
agreement over all drafted slots. speculators is not a flashdraft dependency (it pins
transformers <= 5.19 and pulls torchvision); a side environment that reuses this one's
packages: `python -m venv V && echo $PWD/.venv/lib/python3.11/site-packages >
V/lib/python3.11/site-packages/main.pth && V/bin/pip install --no-deps speculators==0.9.0
hs-connectors && V/bin/pip install loguru openai pydantic-settings`.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flashdraft.assets import smollm2_path
from flashdraft.benchutil import environment, print_json, print_table
from flashdraft.export import engine_view, load_dflash, save_dflash, save_speculators
from flashdraft.model.attention import BlockLayout
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter, init_seeded
from flashdraft.model.head import TargetHead
from flashdraft.model.target import LayerTaps, load_target
from flashdraft.train.blocks import block_inputs

BLOCK, WINDOW = 8, 5
KINDS = {"full": [], "mixed": [0], "sliding": [0, 1]}  # draft layers that slide
PROMPT = "Name three rivers in Europe and say which sea each one flows into."


def make_drafter(target: Any, sliding: list[int], seed: int) -> DFlashDrafter:
    """Random weights (initializer_range 0.05) and norms away from 1, so every part shows."""
    config = DrafterConfig.from_target_config(
        target.config,
        mask_token_id=0,
        num_layers=2,
        block_size=BLOCK,
        sliding_window=WINDOW if sliding else None,
        sliding_layers=sliding,
    )
    config = DrafterConfig.from_dict({**config.to_dict(), "initializer_range": 0.05})
    drafter = init_seeded(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return drafter


def ours_logits(drafter: DFlashDrafter, head: TargetHead, features, ids, anchors) -> Tensor:
    """Training path: [A, B-1, V] draft logits of every anchor's block in one pass."""
    config, length = drafter.config, ids.shape[1]
    positions = torch.arange(length)[None]
    block_ids, block_pos = block_inputs(ids, positions, anchors, BLOCK, config.mask_token_id)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    layout = BlockLayout(anchors, valid, torch.zeros_like(ids), BLOCK)
    with torch.no_grad():
        hidden = drafter(
            features,
            head.embed(block_ids),
            positions,
            block_pos,
            drafter.build_masks(layout, "sdpa"),
        )
    return head.logits(hidden.view(anchors.shape[1], BLOCK, -1)[:, 1:])


@torch.no_grad()
def zlab_logits(export: str, target: Any, features, ids, anchors, mask_id: int) -> Tensor:
    from dflash.model import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(export, dtype=torch.float32).eval()
    out = []
    for anchor in anchors[0].tolist():
        block = torch.full((1, BLOCK), mask_id)
        block[0, 0] = ids[0, anchor]
        embeds = torch.nn.functional.embedding(block, target.get_input_embeddings().weight)
        hidden = model(
            target_hidden=features[:, :anchor],
            noise_embedding=embeds,
            position_ids=torch.arange(anchor + BLOCK)[None],
        )
        out.append(model.compute_logits(hidden[:, 1:], target.lm_head)[0])
    return torch.stack(out)


@torch.no_grad()
def speculators_logits(export: str, features, ids, anchors) -> Tensor:
    """speculators' own training forward, anchors forced to ours, dense SDPA masks (CPU)."""
    from speculators.models.dflash import DFlashDraftModel, core
    from torch.nn.attention.flex_attention import create_mask

    model = DFlashDraftModel.from_pretrained(export, dtype=torch.float32).eval()
    model.load_verifier_weights()
    model.float()
    model.config.transformer_layer_config._attn_implementation = "sdpa"
    model._create_mask_fn = create_mask
    chosen = (anchors[0], torch.ones(anchors.shape[1], dtype=torch.bool))
    core.select_anchors = lambda *args: chosen
    length = ids.shape[1]
    loss_mask = torch.ones(1, length, dtype=torch.long)
    _, logits, *_ = model._backbone_forward(
        features,
        ids,
        loss_mask,
        torch.zeros(1, length, model.config.transformer_layer_config.hidden_size),
        torch.zeros(1, length, dtype=torch.long),
        max_anchors=anchors.shape[1],
    )
    return logits.view(anchors.shape[1], BLOCK, -1)[:, 1:].float()


def compare(name: str, kind: str, ours: Tensor, theirs: Tensor) -> dict[str, Any]:
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean()
    return {
        "drafter": kind,
        "reference": name,
        "max_abs_diff": float((ours - theirs).abs().max()),
        "logit_scale": float(theirs.abs().max()),
        "argmax_agreement": round(float(agree), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--speculators", action="store_true", help="also speculators 0.9.0")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    path = str(smollm2_path())
    target = load_target(path, "float32")
    head = TargetHead.from_model(target)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    length = ids.shape[1]
    anchors = torch.tensor([[2, 9, length // 2, length - BLOCK - 1]])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, sliding in KINDS.items():
            drafter = make_drafter(target, sliding, args.seed)
            export = str(Path(tmp) / kind)
            save_dflash(drafter, export)
            drafter = load_dflash(export, torch.float32)  # the bf16-rounded weights, in fp32
            taps = LayerTaps(target, drafter.config.target_layer_ids)
            with torch.no_grad():
                target(ids)
            features = taps.features()
            taps.remove()
            ours = ours_logits(drafter, head, features, ids, anchors)
            mask_id = drafter.config.mask_token_id
            theirs = zlab_logits(export, target, features, ids, anchors, mask_id)
            rows.append(compare("z-lab dflash 0.1.0", kind, ours, theirs))
            if kind == "mixed":
                continue
            spec = str(Path(tmp) / f"{kind}-speculators")
            save_speculators(drafter, spec, verifier=path)
            causal = engine_view(spec)["causal"]
            trained = [t == "sliding_attention" for t in drafter.config.layer_types]
            rows[-1]["vllm_causal_as_trained"] = causal == trained
            if args.speculators:
                theirs = speculators_logits(spec, features, ids, anchors)
                rows.append(compare("speculators 0.9.0", kind, ours, theirs))
    columns = ["drafter", "reference", "max_abs_diff", "logit_scale", "argmax_agreement"]
    print_table(rows, [*columns, "vllm_causal_as_trained"])
    print_json({"rows": rows, "block_size": BLOCK, "window": WINDOW, **environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
