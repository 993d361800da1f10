"""How much the drafter's bf16 residual stream (flashdraft) moves the training gradient,
against the fp32 residual of speculators' HF modules under the same bf16 autocast.

A real row at the real shape: SmolLM2-135M-Instruct (bf16 features, as on the GPU) on 8
chitchat prompts with its own greedy answers (192 tokens at most, as the quality run's data),
the shipped 5-layer drafter's trained weights (benchmarks/artifacts/smollm2-135m-dflash) in
both models, the same 256 anchors, D-PACE + hard labels (the peer's loss). Three gradients:
speculators in fp32 without autocast (the reference), speculators under CPU bf16 autocast
(the peer's numerics), flashdraft under the same autocast (flashdraft's numerics). Writes
each one's relative error against the reference, per parameter and over all, its cosine
and the loss to ../precision.json (and, for scale, the fp32 gradient's over another draw of
256 anchors from the same row); prints all but the per-parameter errors. With
`--fp32-diagnosis` it instead compares the two sides in fp32 on this row (trained slots,
labels, block states, LM head, logits, loss, gradients, and flashdraft's LM-head chunking)
and writes ../fp32_diag.txt. With `--fp32-residual OUT` (session 28) the same as the
default plus a fourth gradient, flashdraft under the autocast with `drafter.residual_dtype =
"float32"` (its residual stream summed in fp32), written to OUT instead of ../precision.json.

    .venv/bin/python benchmarks/raw/peer_gap_cpu_20261205_s27/scripts/precision27.py
    .venv/bin/python benchmarks/raw/peer_gap_cpu_20261205_s27/scripts/precision27.py --fp32-diagnosis
    .venv/bin/python benchmarks/raw/peer_gap_cpu_20261205_s27/scripts/precision27.py \
        --fp32-residual benchmarks/raw/quality_20261205_s28/precision_fp32_residual.json

(speculators in .venv, as `make test` installs it; the row is cached in /tmp.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "bench"))
import peer_recipe as peer  # noqa: E402

from flashdraft import assets  # noqa: E402
from flashdraft.export import load_dflash  # noqa: E402
from flashdraft.model.attention import default_backend  # noqa: E402
from flashdraft.model.head import TargetHead  # noqa: E402
from flashdraft.model.target import LayerTaps  # noqa: E402
from flashdraft.train.config import LossSection  # noqa: E402
from flashdraft.train.loss import loss_slot_weights  # noqa: E402
from flashdraft.train.step import (  # noqa: E402
    DraftBatch,
    batch_normaliser,
    draft_hidden,
    draft_loss,
    labels_and_mask,
)

DOCS, ANSWER, ANCHORS, SEED = 8, 192, 256, 0
CACHE = Path("/tmp/precision27_row.pt")


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).norm() / theirs.norm())


def overall(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """|ours - theirs| / |theirs| over all weights together."""
    num = sum(float((ours[k] - theirs[k]).pow(2).sum()) for k in theirs)
    return (num / sum(float(theirs[k].pow(2).sum()) for k in theirs)) ** 0.5


def make_row(target_dir: Path, dc: object) -> dict[str, torch.Tensor]:
    """8 chitchat prompts with the bf16 target's greedy answers, packed; its taps and last
    layer (bf16), each document run on its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    ids_l, pos_l, doc_l, mask_l = [], [], [], []
    for d, record in enumerate(assets.chitchat_conversations(DOCS, seed=SEED)):
        prompt = tok.apply_chat_template(
            record["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = target.generate(prompt, max_new_tokens=ANSWER, do_sample=False, eos_token_id=2)
        n, p = out.shape[1], prompt.shape[1]
        ids_l.append(out[0])
        pos_l.append(torch.arange(n))
        doc_l.append(torch.full((n,), d))
        mask_l.append(torch.cat([torch.zeros(p), torch.ones(n - p)]).to(torch.int8))
    ids = torch.cat(ids_l)[None]
    doc = torch.cat(doc_l)[None]
    taps = LayerTaps(target, [*dc.target_layer_ids, dc.num_target_layers - 1])
    feats, lasts = [], []
    with torch.no_grad():
        for d in range(DOCS):
            target(ids[:, doc[0] == d])
            every = taps.features()
            feats.append(every[..., : -dc.hidden_size])
            lasts.append(every[..., -dc.hidden_size :])
    return {
        "ids": ids, "pos": torch.cat(pos_l)[None], "doc": doc, "mask": torch.cat(mask_l)[None],
        "features": torch.cat(feats, 1), "last": torch.cat(lasts, 1),
    }


def main() -> None:
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    target_dir = assets.smollm2_path()
    drafter = load_dflash(str(ROOT / "benchmarks/artifacts/smollm2-135m-dflash"), torch.float32)
    dc = drafter.config
    B = dc.block_size
    if CACHE.exists():  # the row and its features (the generation takes minutes on 2 cores)
        row = torch.load(CACHE)
    else:
        row = make_row(target_dir, dc)
        torch.save(row, CACHE)
    ids, pos, doc, mask = row["ids"], row["pos"], row["doc"], row["mask"]
    features, last = row["features"], row["last"]  # bf16, as the GPU's target gives them
    T = ids.shape[1]
    # The target's tables in fp32, as speculators' loader reads them from its files; the
    # labels are the fp32 argmax of its verifier head for all three runs (below).
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = TargetHead.from_model(target)
    cand = [a for a in range(T - B) if mask[0, a] and mask[0, a + 1] and doc[0, a] == doc[0, a + 1]]
    g = torch.Generator().manual_seed(SEED)
    pick = sorted(torch.tensor(cand)[torch.randperm(len(cand), generator=g)[:ANCHORS]].tolist())
    anchors, valid = torch.tensor(pick), torch.ones(len(pick), dtype=torch.bool)
    with torch.no_grad():
        normed = target.model.norm(last.float())
        where = anchors[:, None] + torch.arange(B - 1)[None]
        next_tokens = head.argmax_at(normed, where[None], 4096)

    flat = peer.speculators_settings()
    flat.update({
        "num_layers": dc.num_hidden_layers, "block_size": B,
        "target_layer_ids": [i + 1 for i in dc.target_layer_ids],
        "mask_token_id": dc.mask_token_id, "draft_vocab_size": dc.vocab_size,
        "verifier_name_or_path": str(target_dir), "max_anchors": len(pick), "total_seq_len": T,
        "draft_attn_impl": "sdpa", "loss_implementation": "eager",
    })
    sp = peer.build_peer_model(flat, dc, torch.device("cpu"))
    own = drafter.state_dict()
    sp.load_state_dict({**sp.state_dict(), **own})
    verifier = sp.verifier_lm_head

    class Fp32Labels(torch.nn.Module):  # its label logits outside autocast, as ours
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", enabled=False):
                return verifier(x.float())

    sp.verifier_lm_head = Fp32Labels()
    import speculators.models.dflash.core as core

    core.select_anchors = lambda lm, n, bs: (anchors.clone(), valid.clone())
    kw, _ = type(sp).get_trainer_kwargs(**flat)
    slot_w = loss_slot_weights(LossSection(weighting="dpace"), B)

    def grads(
        side: str, autocast: bool, chunk: int = 4096
    ) -> tuple[float, dict[str, torch.Tensor]]:
        residual = torch.float32 if side == "flashdraft_fp32_residual" else None
        model = sp if side == "speculators" else drafter
        model.zero_grad(set_to_none=True)
        h = features if autocast else features.float()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if side == "speculators":
                _, loss, _ = sp(
                    hidden_states=h, input_ids=ids, loss_mask=mask, document_ids=doc,
                    verifier_last_hidden_states=last.float(),
                    position_ids=pos, **kw,
                )
            else:
                batch = DraftBatch(
                    input_ids=ids, position_ids=pos, doc_ids=doc, loss_mask=mask,
                    anchors=anchors[None], anchor_valid=valid[None], target_hidden=h,
                    next_tokens=next_tokens,
                )
                norm = batch_normaliser(batch, B, slot_w)
                loss, _ = draft_loss(
                    drafter, head, batch, slot_w, norm, default_backend(torch.device("cpu")),
                    chunk, dpace_alpha=0.5, residual_dtype=residual,
                )
        loss.backward()
        named = dict(model.named_parameters())
        return float(loss), {k: named[k].grad.detach().clone() for k in own}

    if "--fp32-diagnosis" in sys.argv:
        lines = [f"# {Path(__file__).name} --fp32-diagnosis (session 27): flashdraft fp32 vs"
                 " speculators fp32 on this row"]
        with torch.no_grad():
            hs, _, targets, their_mask, _ = sp._backbone_forward(
                features.float(), ids, mask, last.float(), doc, pos, max_anchors=len(pick)
            )
            batch = DraftBatch(
                input_ids=ids, position_ids=pos, doc_ids=doc, loss_mask=mask,
                anchors=anchors[None], anchor_valid=valid[None], target_hidden=features.float(),
                next_tokens=next_tokens,
            )
            ours = draft_hidden(drafter, head, batch, default_backend(torch.device("cpu")))
            labels, our_mask = labels_and_mask(batch, B)
            probe = torch.randn(64, dc.hidden_size)
            same_logits = torch.equal(head.logits(probe), sp.lm_head(probe))
        trained = their_mask.view(len(pick), B).bool()
        their_labels = targets.argmax(-1).view(len(pick), B)
        lines += [
            f"trained-slot masks equal: {torch.equal(our_mask[0].bool(), trained)}",
            f"label mismatches at trained slots: {int((labels[0][trained] != their_labels[trained]).sum())}"
            f" of {int(trained.sum())}",
            f"block states equal: {torch.equal(ours, hs)}",
            f"LM head equal: {torch.equal(sp.lm_head.weight, head.weight)}; embedding equal:"
            f" {torch.equal(sp.embed_tokens.weight, target.model.embed_tokens.weight)};"
            f" logits of 64 random states equal: {same_logits}",
        ]
        ref_loss, ref = grads("speculators", False)
        fd_loss, fd = grads("flashdraft", False)
        fd_512_loss, fd_512 = grads("flashdraft", False, chunk=512)
        worst = sorted(((relative(fd[k], ref[k]), k) for k in ref), reverse=True)[:6]
        lines += [
            f"fp32 losses: speculators {ref_loss!r} flashdraft {fd_loss!r}"
            f" (relative {abs(ref_loss - fd_loss) / ref_loss:.1e})",
            f"fp32 gradients, all weights: relative {overall(fd, ref):.1e}; worst tensors:",
            *(f"  {k}: {r:.2e}" for r, k in worst),
            f"flashdraft, LM-head chunks of 512 vs 4096 rows: loss {fd_512_loss!r} vs {fd_loss!r},"
            f" gradients relative {overall(fd_512, fd):.1e}",
        ]
        text = "\n".join(lines) + "\n"
        (Path(__file__).resolve().parents[1] / "fp32_diag.txt").write_text(text)
        print(text, end="")
        return
    ref_loss, ref = grads("speculators", False)
    _, fd32 = grads("flashdraft", False)
    results = {"T": T, "anchors": len(pick), "reference_loss": ref_loss}
    results["flashdraft_fp32_vs_reference"] = max(
        float((fd32[k] - ref[k]).norm() / ref[k].norm()) for k in ref
    )
    sides = ["speculators", "flashdraft"]
    out = Path(__file__).resolve().parents[1] / "precision.json"
    if "--fp32-residual" in sys.argv:
        sides.append("flashdraft_fp32_residual")
        out = Path(sys.argv[sys.argv.index("--fp32-residual") + 1])
    for side in sides:
        loss, got = grads(side, True)
        num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref)
        den = sum(float(ref[k].pow(2).sum()) for k in ref)
        per = {k: round(float((got[k] - ref[k]).norm() / ref[k].norm()), 4) for k in ref}
        results[side] = {
            "loss": loss,
            "all_params_rel_err": round((num / den) ** 0.5, 5),
            "cosine": round(
                sum(float((got[k] * ref[k]).sum()) for k in ref)
                / (den * sum(float(got[k].pow(2).sum()) for k in ref)) ** 0.5,
                6,
            ),
            "worst": max(per.items(), key=lambda kv: kv[1]),
            "per_param": per,
        }
    # For scale: the same fp32 gradient over another draw of 256 anchors from the same row
    # (the sampling noise every step carries anyway).
    other = torch.randperm(len(cand), generator=g)[:ANCHORS]
    anchors.copy_(torch.tensor(cand)[other].sort().values)
    with torch.no_grad():
        where = anchors[:, None] + torch.arange(B - 1)[None]
        next_tokens.copy_(head.argmax_at(normed, where[None], 4096))
    _, resampled = grads("speculators", False)
    num = sum(float((resampled[k] - ref[k]).pow(2).sum()) for k in ref)
    den = sum(float(ref[k].pow(2).sum()) for k in ref)
    results["other_anchors_fp32_rel_err"] = round((num / den) ** 0.5, 4)
    out.write_text(json.dumps(results, indent=1) + "\n")
    brief = {k: v for k, v in results.items() if k not in sides}
    for side in sides:
        brief[side] = {k: v for k, v in results[side].items() if k != "per_param"}
    print(json.dumps(brief, indent=1))


if __name__ == "__main__":
    main()
