"""Feature sources: the local target's outputs per row, the remote source handing over what
it receives, and the target's head surviving its trip over the wire."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from helpers import train_settings
from torch import nn

from flashdraft.model.head import TargetHead
from flashdraft.model.target import TargetOutputs, decoder_layers
from flashdraft.train.config import LossSection, load_run_config
from flashdraft.train.features import (
    AheadTarget,
    LocalTarget,
    RemoteTarget,
    device_put,
    draft_batch,
    head_from_payload,
    head_payload,
    load_run_target,
    rows_of,
    rows_on_device,
    soft_label_width,
    target_outputs,
)
from flashdraft.train.parallel import DistInfo, _CompiledLayers
from flashdraft.train.plan import plan_run

ONE = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"))


class _ScaledTable(nn.Embedding):
    """As Gemma's: the table's rows times a constant, with the constant as `embed_scale`."""

    def __init__(self, vocab: int, hidden: int, scale: float) -> None:
        super().__init__(vocab, hidden)
        self.embed_scale = torch.tensor(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale


class _TextConfig:
    final_logit_softcapping = 30.0


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_the_head_is_rebuilt_from_its_payload(scale) -> None:
    torch.manual_seed(0)
    table = _ScaledTable(50, 16, scale) if scale != 1.0 else nn.Embedding(50, 16)
    head = TargetHead.from_parts(table, torch.randn(50, 16), _TextConfig())
    payload = head_payload(head)
    assert [tuple(t.shape) for t in payload] == [(50, 16), (50, 16), (1,)]
    received = head_from_payload([t.clone() for t in payload], _TextConfig())
    ids = torch.tensor([[0, 7, 49]])
    torch.testing.assert_close(received.embed(ids), head.embed(ids), rtol=0, atol=0)
    hidden = torch.randn(3, 16)
    torch.testing.assert_close(received.logits(hidden), head.logits(hidden), rtol=0, atol=0)
    assert received.softcap == 30.0


def test_device_put_adds_the_row_dimension() -> None:
    put = device_put(torch.device("cpu"))
    assert put(torch.arange(5)).shape == (1, 5)


@pytest.mark.parametrize("labels", ["target", "data", "soft"])
def test_the_local_source_is_the_target_forward_of_the_row(
    tmp_path, tiny_qwen3_dir, qwen_data, labels
) -> None:
    extra = {"loss.labels": f'"{labels}"', "loss.soft_top_k": 5}
    args = train_settings(tmp_path, tiny_qwen3_dir, qwen_data, **extra)
    config = load_run_config(None, args[1::2])
    plan = plan_run(config, ONE, resume=False)
    target = load_run_target(plan, "sdpa")
    source = LocalTarget(target, config.loss, plan.drafter_config.block_size, ONE.device)
    assert source.head is target.head and source.target is target
    row = next(plan.stream.iterate(iter([0]), prefetch=0))
    put = device_put(ONE.device)
    on_device = rows_on_device([row], put)
    assert on_device[0].shape == (1, config.data.row_tokens)
    out = source.row_outputs([row], on_device)
    taps = len(plan.drafter_config.target_layer_ids) * plan.drafter_config.hidden_size
    labels_shape = (1, config.loss.anchors, plan.drafter_config.block_size - 1)
    assert out.features.shape == (1, config.data.row_tokens, taps)
    assert out.next_tokens is not None and out.next_tokens.shape == labels_shape
    again = target_outputs(target, [row], on_device, put, config.loss, 8)
    assert torch.equal(out.features, again.features)
    assert torch.equal(out.next_tokens, again.next_tokens)
    if labels != "soft":
        assert out.soft_ids is None and out.soft_probs is None
        assert draft_batch(source, [row], put).soft is None
        return
    # Soft labels: the target's top 5 at the same label positions, beside the same hard labels.
    assert out.soft_ids is not None and out.soft_probs is not None
    assert out.soft_ids.shape == out.soft_probs.shape == (*labels_shape, 5)
    hard = target.packed_outputs(*on_device[:3], put(row.label_positions), 256).next_tokens
    assert torch.equal(out.next_tokens, hard)
    torch.testing.assert_close(out.soft_probs.sum(-1), torch.ones(labels_shape))
    # The drafter's batch carries them.
    batch = draft_batch(source, [row], put)
    assert batch.soft is not None and torch.equal(batch.soft[0], out.soft_ids)
    assert torch.equal(batch.next_tokens, out.next_tokens)
    # `loss.argmax_mix`: the same top 5, half their mass moved onto the argmax.
    mixed_loss = dataclasses.replace(config.loss, argmax_mix=0.5)
    mixed = target_outputs(target, [row], on_device, put, mixed_loss, 8)
    assert mixed.soft_ids is not None and mixed.soft_probs is not None
    assert torch.equal(mixed.soft_ids, out.soft_ids)
    on_argmax = (out.soft_ids == out.next_tokens[..., None]).float()
    assert torch.equal(on_argmax.sum(-1), torch.ones(labels_shape))  # always among the top 5
    torch.testing.assert_close(mixed.soft_probs, 0.5 * out.soft_probs + 0.5 * on_argmax)


@pytest.mark.parametrize("labels", ["target", "soft"])
def test_rows_stacked_in_one_forward_equal_each_row_alone(
    tmp_path, tiny_qwen3_dir, qwen_data, labels
) -> None:
    """`optim.rows_per_forward`: two rows through the target at once give each row's own
    taps and labels, and the drafter's batch stacks every per-row field."""
    extra = {"loss.labels": f'"{labels}"', "loss.soft_top_k": 4, "data.row_tokens": 96}
    args = train_settings(tmp_path, tiny_qwen3_dir, qwen_data, **extra)
    config = load_run_config(None, args[1::2])
    plan = plan_run(config, ONE, resume=False)
    source = LocalTarget(
        load_run_target(plan, "sdpa"), config.loss, plan.drafter_config.block_size, ONE.device
    )
    rows = list(itertools.islice(plan.stream.iterate(iter([0, 1]), prefetch=0), 2))
    assert not torch.equal(rows[0].input_ids, rows[1].input_ids)  # two different rows
    put = device_put(ONE.device)
    both = draft_batch(source, rows, put)
    for r, row in enumerate(rows):
        alone = draft_batch(source, [row], put)
        for name in ("input_ids", "doc_ids", "loss_mask", "anchors", "anchor_valid"):
            assert torch.equal(getattr(both, name)[r], getattr(alone, name)[0]), name
        torch.testing.assert_close(both.target_hidden[r], alone.target_hidden[0])
        assert torch.equal(both.next_tokens[r], alone.next_tokens[0])
        if labels == "soft":
            assert both.soft is not None and alone.soft is not None
            assert torch.equal(both.soft[0][r], alone.soft[0][0])


def test_the_target_run_ahead_hands_each_row_its_own_outputs_in_order(
    tmp_path, tiny_qwen3_dir, qwen_data, monkeypatch
) -> None:
    """`target.forward_rows = 2`: the target runs over three rows two at a time, the last
    forward padded to two rows (one compiled shape); each row's taps and soft labels are the
    ones of the row alone, handed over once, in stream order; a row out of order, or a new
    run ahead before the last one is used, is refused."""
    extra = {"loss.labels": '"soft"', "loss.soft_top_k": 4, "data.row_tokens": 96}
    args = train_settings(tmp_path, tiny_qwen3_dir, qwen_data, **extra)
    config = load_run_config(None, args[1::2])
    plan = plan_run(config, ONE, resume=False)
    local = LocalTarget(
        load_run_target(plan, "sdpa"), config.loss, plan.drafter_config.block_size, ONE.device
    )
    ahead = AheadTarget(local, 2)
    forwards: list[int] = []
    real = local.row_outputs

    def counted(rows, on_device):
        forwards.append(len(rows))
        return real(rows, on_device)

    monkeypatch.setattr(local, "row_outputs", counted)
    rows = list(itertools.islice(plan.stream.iterate(iter([0, 1, 2]), prefetch=0), 3))
    put = device_put(ONE.device)
    ahead.run_ahead(rows)
    assert forwards == [2, 2]  # the second: rows[2] and a copy of it
    assert [r for r, _, _ in ahead.held] == rows
    with pytest.raises(RuntimeError, match="has not run ahead"):
        draft_batch(ahead, [rows[1]], put)  # the next one is rows[0]
    with pytest.raises(RuntimeError, match=r"3 row\(s\) of its last run unused"):
        ahead.run_ahead(rows)
    first = draft_batch(ahead, [rows[0]], put)
    rest = draft_batch(ahead, rows[1:], put)  # two rows of two forwards, stacked
    assert not ahead.held
    ahead.run_ahead(rows[:2])
    both = draft_batch(ahead, rows[:2], put)  # two rows of one forward: a view of it
    pairs = [(first, 0, rows[0]), (rest, 0, rows[1]), (rest, 1, rows[2])]
    pairs += [(both, 0, rows[0]), (both, 1, rows[1])]
    for batch, r, row in pairs:
        alone = draft_batch(local, [row], put)
        torch.testing.assert_close(batch.target_hidden[r], alone.target_hidden[0])
        assert torch.equal(batch.next_tokens[r], alone.next_tokens[0])
        assert batch.soft is not None and alone.soft is not None
        assert torch.equal(batch.soft[0][r], alone.soft[0][0])
    out = TargetOutputs(torch.arange(30.0).reshape(3, 5, 2), None, None, None)
    part = rows_of(out, 1, 3)
    assert torch.equal(part.features, out.features[1:3]) and part.next_tokens is None
    assert part.features.data_ptr() == out.features[1].data_ptr()  # a view


def test_soft_labels_wider_than_the_vocabulary_are_refused() -> None:
    loss = LossSection(labels="soft", soft_top_k=100)
    assert soft_label_width(loss, 100) == 100
    assert soft_label_width(LossSection(soft_top_k=100), 10) == 0  # hard labels: no width
    with pytest.raises(ValueError, match=r"loss\.soft_top_k = 100 exceeds"):
        soft_label_width(loss, 99)


def test_the_remote_source_hands_over_what_it_receives() -> None:
    sent = TargetOutputs(torch.ones(1, 4, 6), torch.zeros(1, 2, 3, dtype=torch.long))

    class Receiver:
        def receive(self):
            return sent

    head = TargetHead(embedding=nn.Embedding(5, 2), weight=torch.zeros(5, 2))
    source = RemoteTarget(Receiver(), head)  # type: ignore[arg-type]
    assert source.target is None and source.head is head
    assert source.row_outputs([None], None) is sent  # type: ignore[list-item, arg-type]
    # A split placement's target rank sends row by row; stacked rows are concatenated.
    two = source.row_outputs([None, None], None)  # type: ignore[list-item, arg-type]
    assert two.features.shape == (2, 4, 6) and two.next_tokens is not None
    assert two.next_tokens.shape == (2, 2, 3) and two.soft_ids is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_run_target_is_compiled_on_cuda_only(tmp_path, tiny_qwen3_dir, qwen_data, device):
    """On CUDA the packed forward runs compiled (`parallel.compile_target`); on a CPU, and
    for the HF model the start-up check and the eval loop call, it stays eager."""
    args = train_settings(tmp_path, tiny_qwen3_dir, qwen_data, device=f'"{device}"')
    config = load_run_config(None, args[1::2])
    info = DistInfo(rank=0, world=1, local_rank=0, device=torch.device(device))
    target = load_run_target(plan_run(config, info, resume=False), "sdpa")
    # the default scope "layers" wraps the stack (`_CompiledLayers`); "stack" compiles it whole
    assert config.target.compile_scope == "layers"
    compiled = isinstance(target.base, _CompiledLayers)
    assert compiled == (device == "cuda")
    assert target.base is not target.model.model or device == "cpu"
    assert not isinstance(target.model.model, torch._dynamo.eval_frame.OptimizedModule)
    for layer in decoder_layers(target.model):  # eager outside the packed forward's call
        assert "forward" not in layer.__dict__


def test_the_label_plan_computes_each_needed_position_once() -> None:
    """Overlapping blocks share label positions: `label_plan` lists each of the R rows'
    positions once, as an index into all R*T tokens, and maps every slot back to its own."""
    from flashdraft.train.blocks import label_positions
    from flashdraft.train.features import label_plan
    from flashdraft.train.packing import Row

    def row(anchors: list[int]) -> Row:
        at = torch.tensor(anchors)
        zeros = torch.zeros(20, dtype=torch.long)
        return Row(
            input_ids=zeros,
            position_ids=zeros,
            doc_ids=zeros,
            loss_mask=zeros,
            anchors=at,
            anchor_valid=torch.ones(len(anchors), dtype=torch.bool),
            label_positions=label_positions(at[None], 4, 20)[0],
            normaliser_mask=torch.ones(len(anchors), 4),
            epoch=0,
            index=0,
            tokens=20,
        )

    rows = [row([2, 3, 10]), row([0, 18, 19])]
    needed, index = label_plan(rows)
    flat = torch.stack([r.label_positions for r in rows]) + torch.tensor([0, 20])[:, None, None]
    assert torch.equal(needed[index], flat)  # every slot reads its own position
    assert torch.equal(needed, torch.unique(flat))  # each once, sorted
    # row 0: 2..4, 3..5, 10..12 -> 2..5 and 10..12; row 1: 0..2, 18, 19 (clamped) -> 20..22, 38, 39
    assert needed.tolist() == [2, 3, 4, 5, 10, 11, 12, 20, 21, 22, 38, 39]
