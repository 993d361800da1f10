"""flashdraft's training step with the peer's settings is speculators' DFlash step, numerically.

The oracle is speculators 0.9.0 itself (`make test` installs it; skipped where it is not
installed). The peer's settings are `experiments/peer_config.py`'s `flashdraft_overrides` (its
loss, optimizers, schedule and clipping as `--set` words) over the `smollm2-135m` preset,
as a device run of them gets them. Both models get the same weights, the same packed row,
the same target features and the same anchors (speculators draws its own inside its
forward: `select_anchors` is replaced by the chosen ones). In fp32 on the CPU the two must
then give the same trained slots, labels, block states, loss and gradients; the two
optimizers, fed the same gradients, the same weights; the two schedules the same learning
rates. What then remains between a flashdraft run of these settings and the peer's is the
random draws (init, anchors), the anchor rule (s26: the same slots within 0.7%), the
numerics of the GPU, and a block that runs into the next document (below).

The labels here are flashdraft's head (`TargetHead.argmax_at`, what the target side calls)
on the final-normed last layer; speculators computes its own from the same last layer, and
the two are compared. The peer's smoke test (`test_peer_recipe.py`, slow) runs the whole
target and checks the same agreement there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiny_models
import torch
from helpers import script_modules, speculators_oracle
from torch import Tensor
from transformers import AutoModelForCausalLM

from flashdraft import config as cfg
from flashdraft.model.attention import default_backend
from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.head import TargetHead
from flashdraft.train.config import RunConfig
from flashdraft.train.loss import dpace_alpha_of, loss_slot_weights
from flashdraft.train.optim import build_optimizer
from flashdraft.train.presets import smollm2_135m
from flashdraft.train.schedule import lr_at
from flashdraft.train.step import (
    DraftBatch,
    batch_normaliser,
    draft_hidden,
    draft_loss,
    labels_and_mask,
)

BLOCK, LAYERS, ANCHORS = 16, 2, 10
STEPS = 4626  # the 2-epoch runs' (s21, s25): the warmup is 1% of them
CPU = torch.device("cpu")
# (start, end, prompt tokens) of each packed document; every prompt at least a block long
DOCS = [(0, 48, 16), (48, 110, 16), (110, 160, 18)]


class Pair:
    """speculators' `DFlashDraftModel` and flashdraft's drafter with the same weights, and one
    packed row with its features, labels and anchors (valid under both anchor rules)."""

    def __init__(self, root: Path, docs: list[tuple[int, int, int]]) -> None:
        peer: Any = script_modules("experiments", "peer_config")["peer_config"]
        self.peer = peer
        target_dir = tiny_models.tiny_qwen3(root / "target")
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        config = DrafterConfig.from_target_config(
            target.config, mask_token_id=151643, num_layers=LAYERS, block_size=BLOCK
        )
        self.length = length = docs[-1][1]
        self.flat = peer.speculators_settings()
        self.flat.update(
            num_layers=LAYERS,
            block_size=BLOCK,
            target_layer_ids=[i + 1 for i in config.target_layer_ids],
            mask_token_id=config.mask_token_id,
            draft_vocab_size=config.vocab_size,
            verifier_name_or_path=str(target_dir),
            max_anchors=ANCHORS,
            total_seq_len=length,
            draft_attn_impl="sdpa",
            loss_implementation="eager",
        )
        preset = smollm2_135m(target=str(target_dir), datasets=("unused",), output="unused")
        overrides = peer.flashdraft_overrides(self.flat, STEPS)
        self.run: RunConfig = cfg.build(RunConfig, cfg.apply_overrides(preset.to_dict(), overrides))
        torch.manual_seed(0)
        self.theirs = peer.build_peer_model(self.flat, config, CPU)
        self.ours = DFlashDrafter(config)
        self.sync()
        self.head = TargetHead.from_model(target)

        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 5000, (1, length), generator=gen)
        self.positions = torch.zeros(1, length, dtype=torch.long)
        self.doc_ids = torch.zeros(1, length, dtype=torch.long)
        self.loss_mask = torch.zeros(1, length, dtype=torch.int8)
        for d, (start, end, prompt) in enumerate(docs):
            self.positions[0, start:end] = torch.arange(end - start)
            self.doc_ids[0, start:end] = d
            self.loss_mask[0, start + prompt : end] = 1
        taps, hidden = len(config.target_layer_ids), config.hidden_size
        self.taps = torch.randn(1, length, taps * hidden, generator=gen)
        self.last = torch.randn(1, length, hidden, generator=gen) * 2
        # flashdraft's anchors need loss_mask[a+1] in a's document, speculators' loss_mask[a]
        # and a < T - B: both hold here; two padding anchors, invalid on both sides.
        m, d = self.loss_mask[0], self.doc_ids[0]
        both = [a for a in range(length - BLOCK) if m[a] and m[a + 1] and d[a] == d[a + 1]]
        chosen = torch.tensor(both)[torch.randperm(len(both), generator=gen)[: ANCHORS - 2]]
        self.anchors = torch.zeros(ANCHORS, dtype=torch.long)
        self.valid = torch.zeros(ANCHORS, dtype=torch.bool)
        self.anchors[: ANCHORS - 2], self.valid[: ANCHORS - 2] = chosen.sort().values, True
        with torch.no_grad():  # flashdraft's labels: the target's argmax at a + k - 1
            normed = target.model.norm(self.last)
        where = self.anchors[:, None] + torch.arange(BLOCK - 1)[None]
        self.next_tokens = self.head.argmax_at(normed, where[None], 4096)

    def sync(self) -> None:
        """flashdraft's drafter takes speculators' draft weights (the serving names on both)."""
        mine = self.ours.state_dict()
        self.ours.load_state_dict({k: v for k, v in self.theirs.state_dict().items() if k in mine})

    def batch(self) -> DraftBatch:
        return DraftBatch(
            input_ids=self.ids,
            position_ids=self.positions,
            doc_ids=self.doc_ids,
            loss_mask=self.loss_mask,
            anchors=self.anchors[None],
            anchor_valid=self.valid[None],
            target_hidden=self.taps,
            next_tokens=self.next_tokens,
        )

    @contextlib.contextmanager
    def our_anchors(self) -> Iterator[None]:
        """speculators' `select_anchors` (called inside its forward) returns ours meanwhile."""
        core = speculators_oracle("speculators.models.dflash.core")
        chosen = (self.anchors.clone(), self.valid.clone())
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(core, "select_anchors", lambda mask, n, block: chosen)
            yield

    def their_step(self) -> tuple[float, dict[str, Tensor]]:
        """speculators' loss and gradients on our anchors."""
        self.theirs.zero_grad(set_to_none=True)
        kwargs, _ = type(self.theirs).get_trainer_kwargs(**self.flat)
        with self.our_anchors():
            _, loss, _ = self.theirs(
                hidden_states=self.taps,
                input_ids=self.ids,
                loss_mask=self.loss_mask,
                verifier_last_hidden_states=self.last,
                document_ids=self.doc_ids,
                position_ids=self.positions,
                **kwargs,
            )
        loss.backward()
        return float(loss.detach()), self.grads(self.theirs)

    def our_step(self) -> tuple[float, dict[str, Tensor]]:
        """flashdraft's loss and gradients with the run's loss section (the peer's)."""
        self.ours.zero_grad(set_to_none=True)
        batch = self.batch()
        slot_w = loss_slot_weights(self.run.loss, BLOCK)
        normaliser = batch_normaliser(batch, BLOCK, slot_w)
        backend, alpha = default_backend(CPU), dpace_alpha_of(self.run.loss)
        chunk = self.run.loss.chunk_rows
        loss, _ = draft_loss(
            self.ours, self.head, batch, slot_w, normaliser, backend, chunk, dpace_alpha=alpha
        )
        loss.backward()
        return float(loss.detach()), self.grads(self.ours)

    def grads(self, model: torch.nn.Module) -> dict[str, Tensor]:
        mine = self.ours.state_dict()
        return {k: p.grad.clone() for k, p in model.named_parameters() if k in mine}

    def their_blocks(self) -> tuple[Tensor, Tensor, Tensor]:
        """speculators' trained-slot mask [A, B], labels [A, B] (its targets' argmax) and
        final-normed block states [A * B, H] of the row (`_backbone_forward`'s)."""
        with self.our_anchors(), torch.no_grad():
            hidden, _, targets, mask, _ = self.theirs._backbone_forward(
                self.taps,
                self.ids,
                self.loss_mask,
                self.last,
                self.doc_ids,
                self.positions,
                max_anchors=ANCHORS,
            )
        shape = (ANCHORS, BLOCK)
        return mask.view(shape).bool(), targets.argmax(-1).view(shape), hidden[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    speculators_oracle()
    return Pair(tmp_path_factory.mktemp("peer_step"), DOCS)


def relative(ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> float:
    """The worst parameter's |ours - theirs| / |theirs| (norms over the whole tensor)."""
    assert sorted(ours) == sorted(theirs)
    ratios = torch.stack([(ours[k] - theirs[k]).norm() / theirs[k].norm() for k in theirs])
    assert torch.isfinite(ratios).all(), dict(zip(theirs, ratios.tolist(), strict=True))
    return float(ratios.max())


def test_the_peer_loss_gives_speculators_loss_and_gradients(pair: Pair) -> None:
    """Same trained slots, labels, block states, loss and gradient of every draft weight
    (fp32; the D-PACE normaliser differs by speculators' + 1e-5 only), and speculators
    trains no weight flashdraft's drafter does not have."""
    pair.sync()
    labels, mask = labels_and_mask(pair.batch(), BLOCK)
    their_mask, their_labels, their_hidden = pair.their_blocks()
    trained = mask[0].bool()
    assert torch.equal(trained, their_mask)
    assert int(trained.sum()) > 60  # a real comparison: most slots of 8 blocks are trained
    assert torch.equal(labels[0][trained], their_labels[trained])
    with torch.no_grad():
        hidden = draft_hidden(pair.ours, pair.head, pair.batch(), default_backend(CPU))
    torch.testing.assert_close(hidden[0], their_hidden, rtol=1e-5, atol=1e-5)
    their_loss, theirs = pair.their_step()
    our_loss, ours = pair.our_step()
    assert our_loss == pytest.approx(their_loss, rel=1e-5)
    trainable = {k for k, p in pair.theirs.named_parameters() if p.requires_grad}
    assert trainable == {k for k, _ in pair.ours.named_parameters()}
    assert relative(ours, theirs) < 1e-5


def test_a_block_into_the_next_document_is_where_the_two_differ(tmp_path: Path) -> None:
    """The one difference on purpose (docs/design.md §4: a block never trains past its document): with a
    prompt shorter than a block, speculators also trains the slots that land in the next
    document's answer; flashdraft gives them weight 0. The masks differ nowhere else."""
    speculators_oracle()
    short = Pair(tmp_path, [(0, 48, 12), (48, 110, 16), (110, 160, 6)])
    ours = labels_and_mask(short.batch(), BLOCK)[1][0].bool()
    theirs = short.their_blocks()[0]
    slot = (short.anchors[:, None] + torch.arange(BLOCK)[None]).clamp(max=short.length - 1)
    crossing = short.doc_ids[0, slot] != short.doc_ids[0, short.anchors][:, None]
    crossing &= short.valid[:, None]
    assert (theirs & crossing).any()  # the case occurs in this row
    assert torch.equal(ours, theirs & ~crossing)


@pytest.mark.slow  # the experiments' tests stay under a minute together
def test_the_peer_optimizer_settings_give_speculators_update(pair: Pair) -> None:
    """Fed the same (clipped) gradients, flashdraft's Muon + AdamW with the run's optimizer
    section (the peer's: AdamW betas 0.9 / 0.999 and weight decay 0.01 on the norms, Muon's
    momentum 0.95 and weight decay 0.1) move every weight as speculators' `torch.optim.Muon`
    + `AdamW` do; with the preset's own AdamW settings (0.95, no decay) the norms move
    otherwise (the comparison can fail)."""

    def moves(optim: Any) -> float:
        pair.sync()
        start = {k: v.clone() for k, v in pair.ours.state_dict().items()}
        ours = build_optimizer(pair.ours, optim, CPU)
        theirs, _ = pair.peer.build_optimizers(pair.theirs, pair.flat, STEPS)
        worst = 0.0
        for lr in (2e-4, 1e-3, 5e-4):
            pair.their_step()  # speculators' gradients, in its parameters
            torch.nn.utils.clip_grad_norm_(list(pair.theirs.parameters()), optim.grad_clip)
            named = dict(pair.ours.named_parameters())
            for k, p in pair.theirs.named_parameters():
                if k in named:
                    named[k].grad = p.grad.clone()
            for optimizer in [*theirs, *ours]:
                for group in optimizer.param_groups:  # the schedules: the next test
                    group["lr"] = lr
                optimizer.step()
            mine = pair.ours.state_dict()
            peer = {k: v for k, v in pair.theirs.state_dict().items() if k in mine}
            ahead = {k: mine[k] - start[k] for k in mine}
            worst = max(worst, relative(ahead, {k: peer[k] - start[k] for k in mine}))
        return worst

    assert moves(pair.run.optim) < 5e-4  # measured 7.6e-6
    own = dataclasses.replace(pair.run.optim, betas=[0.9, 0.95], weight_decay=0.0)
    assert moves(own) > 5e-3  # measured 1.0e-2


def test_the_peer_schedule_gives_speculators_learning_rates(pair: Pair) -> None:
    """flashdraft's `lr_at` with the run's optimizer section against speculators' scheduler
    (transformers' linear warmup and decay) over all 4,626 steps: the same after the warmup;
    during it flashdraft is one step ahead (speculators' first step runs at lr 0)."""
    _, schedulers = pair.peer.build_optimizers(pair.theirs, pair.flat, STEPS)
    theirs = [pair.run.optim.lr * schedulers[0].lr_lambdas[0](s) for s in range(STEPS + 1)]
    ours = [lr_at(s, STEPS, pair.run.optim) for s in range(STEPS)]
    warmup = pair.run.optim.warmup_steps
    assert warmup == STEPS // 100 == 46
    assert ours[:warmup] == pytest.approx(theirs[1 : warmup + 1], rel=1e-9)
    assert ours[warmup:] == pytest.approx(theirs[warmup:STEPS], rel=1e-9, abs=1e-15)
