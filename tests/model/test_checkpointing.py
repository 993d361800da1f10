"""Activation checkpointing of the draft layers (`drafter.activation_checkpointing`): the same
loss and gradients as keeping the activations, and fewer tensors saved for backward."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config, tiny_drafter, tiny_head

from flashdraft.train.blocks import label_positions, sample_anchors, slot_weights
from flashdraft.train.step import DraftBatch, batch_normaliser, draft_loss


def _batch(ctx: int = 96, anchors: int = 6, hidden: int = 32, seed: int = 0) -> DraftBatch:
    """One packed row of three documents with taps of K = 2 layers."""
    gen = torch.Generator().manual_seed(seed)
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate((40, 30, ctx - 70))])
    positions = torch.cat([torch.arange(int((docs == d).sum())) for d in range(3)])
    loss_mask = (torch.rand(ctx, generator=gen) < 0.8).long()
    first, valid = sample_anchors(loss_mask, docs, anchors, gen)
    return DraftBatch(
        input_ids=torch.randint(0, 96, (1, ctx), generator=gen),
        position_ids=positions[None],
        doc_ids=docs[None],
        loss_mask=loss_mask[None],
        anchors=first[None],
        anchor_valid=valid[None],
        target_hidden=torch.randn(1, ctx, 2 * hidden, generator=gen),
        next_tokens=torch.randint(0, 96, label_positions(first[None], 4, ctx).shape, generator=gen),
    )


def _loss_and_grads(checkpointed: bool, compile_backend: str | None = None):
    config = tiny_config(layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    drafter = tiny_drafter(config)
    drafter.set_activation_checkpointing(checkpointed)
    if compile_backend is not None:
        for layer in drafter.layers:
            layer.compile(backend=compile_backend, dynamic=False)
    head, batch = tiny_head(config), _batch()
    slot_w = slot_weights(config.block_size, 7.0)
    norm = batch_normaliser(batch, config.block_size, slot_w)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = draft_loss(drafter, head, batch, slot_w, norm, "sdpa", 16)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    return loss.detach(), grads, sum(saved)


def test_checkpointed_layers_give_the_same_loss_and_gradients_bit_for_bit() -> None:
    loss, grads, kept = _loss_and_grads(False)
    loss_ckpt, grads_ckpt, kept_ckpt = _loss_and_grads(True)
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    for name, g in grads.items():
        assert torch.equal(g, grads_ckpt[name]), name
    # What backward keeps: of the layers, only their inputs (the rest is recomputed).
    assert kept_ckpt < kept / 2, (kept_ckpt, kept)


def test_checkpointing_is_off_by_default_and_outside_autograd() -> None:
    drafter = tiny_drafter()
    assert not any(layer.checkpointed for layer in drafter.layers)
    drafter.set_activation_checkpointing(True)
    assert all(layer.checkpointed for layer in drafter.layers)
    assert set(drafter.state_dict()) == set(tiny_drafter().state_dict())


def test_compiled_checkpointed_layers_match_eager() -> None:
    """Each layer compiled with the checkpoint inside its graph (as `compile_drafter` does on
    CUDA; here dynamo + AOTAutograd without inductor, to stay fast on the CPU)."""
    torch._dynamo.reset()
    loss, grads, _ = _loss_and_grads(False)
    loss_c, grads_c, _ = _loss_and_grads(True, compile_backend="aot_eager")
    torch._dynamo.reset()
    assert torch.allclose(loss, loss_c, rtol=1e-6, atol=0)
    for name, g in grads.items():
        assert torch.allclose(g, grads_c[name], rtol=1e-5, atol=1e-7), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpointed_compiled_flex_drafter_matches_and_saves_memory_cuda() -> None:
    """The CUDA training path (compiled layers, flex BlockMask, bf16 autocast) with and
    without checkpointing: the same loss and gradients up to bf16 rounding, a lower peak."""
    from flashdraft.train.parallel import compile_drafter

    config = tiny_config(
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        block_size=16,
        vocab_size=1000,
        mask_token_id=999,
        num_hidden_layers=4,
    )
    gen = torch.Generator().manual_seed(0)
    ctx = 4096
    docs = torch.cumsum((torch.rand(ctx, generator=gen) < 0.002).long(), 0)
    positions = torch.cat([torch.arange(int((docs == d).sum())) for d in docs.unique()])
    loss_mask = (torch.rand(ctx, generator=gen) < 0.8).long()
    anchors, valid = sample_anchors(loss_mask, docs, 256, gen)
    batch = DraftBatch(
        input_ids=torch.randint(0, 999, (1, ctx), generator=gen),
        position_ids=positions[None],
        doc_ids=docs[None],
        loss_mask=loss_mask[None],
        anchors=anchors[None],
        anchor_valid=valid[None],
        target_hidden=torch.randn(1, ctx, 2 * 512, generator=gen).bfloat16(),
        next_tokens=torch.randint(
            0, 999, label_positions(anchors[None], 16, ctx).shape, generator=gen
        ),
    ).to(torch.device("cuda"))
    head = tiny_head(config)
    head.embedding.cuda()
    head.weight = head.weight.cuda()
    slot_w = slot_weights(16, 7.0).cuda()
    norm = batch_normaliser(batch, 16, slot_w)
    results = []
    for checkpointed in (False, True):
        drafter = tiny_drafter(config).cuda()
        drafter.set_activation_checkpointing(checkpointed)
        compile_drafter(drafter)
        for _ in range(2):  # the first call compiles; the second is measured
            drafter.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = draft_loss(drafter, head, batch, slot_w, norm, "flex", 256)
            loss.backward()
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        results.append((float(loss), [p.grad.float() for p in drafter.parameters()], peak))
    (loss, grads, peak), (loss_c, grads_c, peak_c) = results
    assert abs(loss - loss_c) / loss < 1e-2
    for g, g_c in zip(grads, grads_c, strict=True):
        assert (g - g_c).norm() / g.norm().clamp(min=1e-12) < 3e-2
    assert peak_c < peak, (peak_c, peak)
