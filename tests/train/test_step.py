from unittest import mock

import pytest
import torch
from helpers import read_metrics, tiny_config, tiny_drafter, tiny_head, train_settings

from flashdraft import cli
from flashdraft.train import features, trainer
from flashdraft.train.blocks import label_positions, slot_weights
from flashdraft.train.parallel import DistInfo
from flashdraft.train.step import DraftBatch, batch_normaliser, draft_hidden, draft_loss

ONE = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"))


def _doc(seed: int, length: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 90, (length,), generator=gen)
    hidden = torch.randn(length, 64, generator=gen)
    argmax = torch.randint(0, 90, (length,), generator=gen)
    loss_mask = torch.zeros(length, dtype=torch.long)
    loss_mask[length // 3 :] = 1
    return ids, hidden, argmax, loss_mask


def _batch(docs, anchors_per_doc, pad: int = 0) -> DraftBatch:
    """Pack documents into one row (positions restart per document), anchors given per doc."""
    ids = torch.cat([d[0] for d in docs] + [torch.zeros(pad, dtype=torch.long)])[None]
    hidden = torch.cat([d[1] for d in docs] + [torch.zeros(pad, 64)])[None]
    argmax = torch.cat([d[2] for d in docs] + [torch.zeros(pad, dtype=torch.long)])[None]
    loss_mask = torch.cat([d[3] for d in docs] + [torch.zeros(pad, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(len(d[0])) for d in docs] + [torch.arange(pad)])[None]
    doc_ids = torch.cat(
        [torch.full((len(d[0]),), i) for i, d in enumerate(docs)] + [torch.full((pad,), -1)]
    )[None]
    offsets = torch.cumsum(torch.tensor([0] + [len(d[0]) for d in docs]), 0)
    anchors = torch.cat([torch.tensor(a) + offsets[i] for i, a in enumerate(anchors_per_doc)])[None]
    positions_for_labels = label_positions(anchors, 4, ids.shape[1])
    next_tokens = argmax.gather(1, positions_for_labels.flatten(1)).view(positions_for_labels.shape)
    return DraftBatch(
        input_ids=ids,
        position_ids=positions,
        doc_ids=doc_ids,
        loss_mask=loss_mask,
        anchors=anchors,
        anchor_valid=torch.ones_like(anchors, dtype=torch.bool),
        target_hidden=hidden,
        next_tokens=next_tokens,
    )


def test_packed_row_gives_the_same_blocks_and_loss_as_its_documents_alone() -> None:
    """docs/design.md §8 traps 4 and 7: packing changes nothing (per-document masks and positions)."""
    config = tiny_config()
    drafter, head = tiny_drafter(config), tiny_head(config)
    slot_w = slot_weights(4, 7.0)
    docs = [_doc(0, 9), _doc(1, 13), _doc(2, 7)]
    anchors = [[3, 7], [4, 6, 11], [2, 5]]
    packed = _batch(docs, anchors, pad=5)
    alone = [_batch([d], [a]) for d, a in zip(docs, anchors, strict=True)]

    hidden_packed = draft_hidden(drafter, head, packed, "sdpa")
    hidden_alone = torch.cat([draft_hidden(drafter, head, b, "sdpa") for b in alone], dim=1)
    torch.testing.assert_close(hidden_packed, hidden_alone, rtol=1e-5, atol=1e-5)

    norm = batch_normaliser(packed, 4, slot_w)
    assert torch.isclose(norm, sum(batch_normaliser(b, 4, slot_w) for b in alone))
    loss_packed, stats_packed = draft_loss(drafter, head, packed, slot_w, norm, "sdpa", 8)
    losses = [draft_loss(drafter, head, b, slot_w, norm, "sdpa", 8) for b in alone]
    torch.testing.assert_close(loss_packed, sum(loss for loss, _ in losses), rtol=1e-5, atol=1e-6)
    total = losses[0][1].add(losses[1][1]).add(losses[2][1])
    packed_summary, total_summary = stats_packed.summary(), total.summary()
    assert packed_summary.pop("loss") == pytest.approx(total_summary.pop("loss"), rel=1e-5)
    assert packed_summary == total_summary


def test_loss_falls_when_training_on_a_fixed_batch() -> None:
    config = tiny_config()
    drafter, head = tiny_drafter(config), tiny_head(config)
    batch = _batch([_doc(0, 30)], [[10, 14, 18, 22]])
    slot_w = slot_weights(4, 7.0)
    norm = batch_normaliser(batch, 4, slot_w)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss, stats = draft_loss(drafter, head, batch, slot_w, norm, "sdpa", 16)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss.detach())
    assert float(loss.detach()) < 0.5 * first
    assert stats.summary()["tau_hat"] > 1.0


def test_draft_loss_sums_the_residual_in_the_dtype_asked() -> None:
    """`draft_loss(..., residual_dtype=)` reaches the drafter's layers: under bf16 autocast on
    bf16 features they read an fp32 residual stream when asked, bf16 otherwise."""
    config = tiny_config()
    drafter, head = tiny_drafter(config), tiny_head(config)
    batch = _batch([_doc(0, 9), _doc(1, 13)], [[3, 4], [4, 6]])
    batch.target_hidden = batch.target_hidden.bfloat16()
    slot_w = slot_weights(4, 7.0)
    norm = batch_normaliser(batch, 4, slot_w)
    seen: list[torch.dtype] = []
    hook = drafter.layers[0].register_forward_hook(lambda m, inp, out: seen.append(inp[0].dtype))
    for residual in (None, torch.float32):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            draft_loss(drafter, head, batch, slot_w, norm, "sdpa", 16, residual_dtype=residual)
    hook.remove()
    assert seen == [torch.bfloat16, torch.float32]


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_the_trainer_learns_with_soft_labels_and_dpace(tmp_path, tiny_qwen3_dir, qwen_data) -> None:
    """`flashdraft train` with both loss options on the tiny Qwen3 target: the trainer's
    batches carry the soft labels (else the run would be hard-label training) and its loss
    weights slots by D-PACE; the loss falls. 20 rows are too few for tau_hat to move with any
    weighting (the fixed-batch test above checks it); each option alone is checked against
    its dense definition in tests/train/test_loss.py. `drafter.residual_dtype` reaches the
    drafter's forward too (in fp32 on the CPU it changes no number; under autocast:
    tests/model/test_drafter.py)."""
    run = tmp_path / "run"
    options = {
        "loss.labels": '"soft"',
        "loss.weighting": '"dpace"',
        "loss.dpace_alpha": 0.2,
        "drafter.residual_dtype": '"float32"',
    }
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **options)
    settings += ["--set", "optim.max_steps=20", "--set", "log.every=1"]
    sent, alphas, residuals = [], [], []
    real_outputs, real_loss = features.target_outputs, trainer.draft_loss

    def outputs_spy(*args, **kwargs):
        sent.append(real_outputs(*args, **kwargs))
        return sent[-1]

    def loss_spy(*args, **kwargs):
        alphas.append(kwargs["dpace_alpha"])
        residuals.append(kwargs["residual_dtype"])
        return real_loss(*args, **kwargs)

    with (
        mock.patch.object(features, "target_outputs", outputs_spy),
        mock.patch.object(trainer, "draft_loss", loss_spy),
    ):
        assert cli.main(["train", *settings]) == 0
    assert sent and all(o.soft_ids is not None and o.soft_ids.shape[-1] == 32 for o in sent)
    assert alphas and set(alphas) == {0.2}
    assert set(residuals) == {torch.float32}
    history = read_metrics(run)
    first, last = history[:4], history[-4:]

    def mean(part, key):
        return sum(h[key] for h in part) / len(part)

    assert mean(last, "loss") < mean(first, "loss") - 0.3, [h["loss"] for h in history]
