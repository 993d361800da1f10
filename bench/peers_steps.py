"""One DFlash drafter training step of each framework, as `bench/peers.py`'s workers run it:
flashdraft's, speculators' and SpecForge's step on the seeded inputs of `peers_inputs.py`,
each timed and, at the parity size, its loss on identical blocks. Each framework is imported
only inside its own function: a worker loads the one it runs (and a peer that is not installed
fails its own rows only)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from peers_inputs import (  # beside this script
    SEED,
    Case,
    Geometry,
    Row,
    compute_setup,
    drafter_config,
    load_drafter_weights,
    make_row,
    make_tables,
    seeded_weights,
    timed,
)
from torch import Tensor, nn

# ---------------------------------------------------------------------------------------------
# flashdraft
# ---------------------------------------------------------------------------------------------


def run_flashdraft(case: Case, g: Geometry, device: torch.device) -> dict[str, Any]:
    from flashdraft.model.attention import default_backend
    from flashdraft.model.drafter import DFlashDrafter
    from flashdraft.model.head import TargetHead
    from flashdraft.train.blocks import label_positions, sample_anchors, slot_weights
    from flashdraft.train.parallel import compile_drafter
    from flashdraft.train.step import DraftBatch, batch_normaliser, draft_loss

    dtype, autocast = compute_setup(device)
    chunk_rows = 2048
    embed_w, head_w = make_tables(g, device, dtype)
    embedding = nn.Embedding(g.vocab, g.hidden, device=device, dtype=dtype)
    embedding.weight.data.copy_(embed_w)
    embedding.requires_grad_(False)
    head = TargetHead(embedding=embedding, weight=head_w)
    drafter = DFlashDrafter(drafter_config(g)).to(device)
    load_drafter_weights(drafter, seeded_weights(g, device))
    backend = default_backend(device)
    slot_w = slot_weights(g.block, g.gamma).to(device)

    def build(row: Row, anchors: int) -> DraftBatch:
        # Anchors are drawn on the CPU in the data pipeline (docs/design.md §4), outside the step.
        gen = torch.Generator().manual_seed(SEED + 2)
        picked, valid = sample_anchors(row.loss_mask[0].cpu(), row.doc_ids[0].cpu(), anchors, gen)
        return DraftBatch(
            input_ids=row.input_ids,
            position_ids=row.position_ids,
            doc_ids=row.doc_ids,
            loss_mask=row.loss_mask.to(torch.int8),
            anchors=picked[None].to(device),
            anchor_valid=valid[None].to(device),
            target_hidden=row.taps,
            next_tokens=torch.zeros(1, anchors, g.block - 1, dtype=torch.long, device=device),
        )

    def labels(row: Row, batch: DraftBatch) -> None:
        # Target-side work in flashdraft (inside the target forward); timed here because
        # speculators computes its labels from the same last hidden state inside its step.
        with torch.no_grad():
            where = label_positions(batch.anchors, g.block, row.input_ids.shape[1])
            batch.next_tokens = head.argmax_at(row.last_hidden, where, chunk_rows)

    def loss_of(batch: DraftBatch, norm: Tensor) -> tuple[Tensor, Any]:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            return draft_loss(drafter, head, batch, slot_w, norm, backend, chunk_rows)

    def losses(stats: Any) -> dict[str, float]:
        weighted, weight = float(stats.weighted_ce), float(stats.weight)
        trained = float(stats.trained.sum())
        return {
            "loss": weighted / weight,  # sum(w m CE) / sum(w m)
            "loss_as_speculators": weighted / (trained + 1e-5),  # sum(w m CE) / sum(m)
        }

    out: dict[str, Any] = {}
    if case.parity_anchors:
        row = make_row(g, case.parity_anchors + g.block, head_w, device)
        batch = build(row, case.parity_anchors)
        labels(row, batch)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            _, stats = loss_of(batch, batch_normaliser(batch, g.block, slot_w))
        out["parity"] = {
            **losses(stats),
            "anchors": int(batch.anchor_valid.sum()),
            "trained_slots": int(stats.trained.sum()),
        }

    if device.type == "cuda":
        compile_drafter(drafter)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=device.type == "cuda")
    row = make_row(g, case.context, head_w, device)
    batch = build(row, case.anchors)
    # Known to the trainer from the CPU rows before the step (masks and anchors only).
    norm = batch_normaliser(batch, g.block, slot_w)
    first: list[dict[str, float]] = []

    def step() -> None:
        labels(row, batch)
        loss, stats = loss_of(batch, norm)
        loss.backward()
        nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not first:
            first.append(losses(stats))  # host sync: first call only, during warm-up

    out["timing"] = timed(step, device, case)
    out["first_step"] = first[0]

    from flashdraft.benchutil import measure

    out["labels_ms"] = round(measure(lambda: labels(row, batch), device, 2, 5).median_s * 1e3, 3)
    out["notes"] = [
        "anchors: sample_anchors (CPU, data pipeline, not timed), candidates loss_mask[a+1]=1 "
        "in a's document",
        "step: target label argmax over A*(B-1) slots + draft_loss fwd/bwd "
        + (
            "(bf16 autocast, fp32 weights, compiled layers, flex BlockMask) + clip 1.0 + fused AdamW"
            if device.type == "cuda"
            else "(fp32, eager, SDPA on the dense mask of the same mask_mod) + clip 1.0 + AdamW"
        ),
    ]
    return out


# ---------------------------------------------------------------------------------------------
# speculators (vLLM project)
# ---------------------------------------------------------------------------------------------


def qwen3_config(g: Geometry, layers: int, **extra: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=g.hidden,
        intermediate_size=g.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=g.heads,
        num_key_value_heads=g.kv_heads,
        head_dim=g.head_dim,
        vocab_size=g.vocab,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        **extra,
    )


def run_speculators(case: Case, g: Geometry, device: torch.device) -> dict[str, Any]:
    from speculators import SpeculatorModel, SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig

    dtype, autocast = compute_setup(device)
    # What `speculators train` builds from a verifier: the draft layers' Qwen3 config with
    # num_hidden_layers = draft layers, full draft vocabulary (no t2d/d2t), no verifier path
    # (so nothing is downloaded; we load the frozen tables ourselves, as load_verifier_weights
    # would). Flex attention on CUDA is its default; the CPU has no flex backward, so SDPA.
    layer_config = qwen3_config(g, g.layers)
    layer_config._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    verifier = qwen3_config(g, g.target_layers, architectures=["Qwen3ForCausalLM"])
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=g.vocab,
        block_size=g.block,
        # speculators / vLLM convention: z-lab id + 1 (as flashdraft.export writes it)
        aux_hidden_state_layer_ids=[i + 1 for i in g.layer_ids],
        mask_token_id=g.mask_token,
        sample_from_anchor=False,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=g.block - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_config(verifier, name_or_path=None),
        ),
    )
    model = DFlashDraftModel(config)
    SpeculatorModel.verify_training_compatible(model)
    model.to(device)  # fp32 parameters: the Trainer keeps them fp32 and runs under autocast
    embed_w, head_w = make_tables(g, device, dtype)
    load_drafter_weights(model, seeded_weights(g, device))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed_w)
        model.lm_head.weight.copy_(head_w)
        model.verifier_lm_head.weight.copy_(head_w)
        model.verifier_norm.weight.fill_(1.0)

    # fused = their Triton kernels (their default on a GPU); eager where fused fails to compile
    impl = case.speculators_impl if device.type == "cuda" else "eager"
    train_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(
        loss_fn=case.speculators_loss,
        loss_implementation=impl,
        dflash_decay_gamma=g.gamma,
        max_anchors=case.anchors,
    )

    def batch_of(row: Row) -> dict[str, Tensor]:
        return {
            "hidden_states": row.taps,
            "input_ids": row.input_ids,
            "loss_mask": row.loss_mask,
            "verifier_last_hidden_states": row.last_hidden,
            "document_ids": row.doc_ids,
            "position_ids": row.position_ids,
        }

    def forward(batch: dict[str, Tensor], kwargs: dict[str, Any]) -> tuple[Tensor, Any]:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, loss, metrics = model(**batch, **kwargs)
        return loss, metrics

    out: dict[str, Any] = {}
    model.train()
    if case.parity_anchors:
        row = make_row(g, case.parity_anchors + g.block, head_w, device)
        kwargs = {**train_kwargs, "max_anchors": case.parity_anchors}
        torch.manual_seed(SEED)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            loss, metrics = forward(batch_of(row), kwargs)
        out["parity"] = {"loss": float(loss), "trained_slots": int(metrics["full_acc_total"])}

    with tempfile.TemporaryDirectory() as tmp:
        optimizers = build_optimizers(model, TrainerConfig(lr=1e-4, num_epochs=1, save_path=tmp))
    batch = batch_of(make_row(g, case.context, head_w, device))
    first: list[dict[str, float]] = []
    torch.manual_seed(SEED)

    def step() -> None:
        loss, _ = forward(batch, train_kwargs)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        if not first:
            first.append({"loss": float(loss)})

    out["timing"] = timed(step, device, case)
    out["first_step"] = first[0]
    out["loss_implementation"] = impl
    out["notes"] = [
        f"loss_fn={case.speculators_loss!r} ({impl}), gamma={g.gamma}; "
        "speculators' own defaults are kl_div and gamma 4",
        "anchors: select_anchors inside the step (GPU randperm), candidates loss_mask[a]=1 "
        "and a < T-B, no document check on block slots",
        "labels: argmax of the frozen verifier head over verifier_norm(last hidden) at a+k-1, "
        "computed inside the step as full [A*B or T, V] logits",
        "loss = sum(w m CE) / sum(m): normalised by the mask count, not the weight sum",
        "frozen embed_tokens / lm_head / verifier_lm_head are fp32 copies inside the model",
    ]
    return out


# ---------------------------------------------------------------------------------------------
# SpecForge (SGLang project)
# ---------------------------------------------------------------------------------------------


def run_specforge(case: Case, g: Geometry, device: torch.device) -> dict[str, Any]:
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
    from specforge.optimizer import BF16Optimizer

    dtype, _ = compute_setup(device)
    backend = "flex_attention" if device.type == "cuda" else "sdpa"
    # The draft config SpecForge generates for a Qwen3 target (populate_dflash_generated_config
    # + apply_dflash_overrides for 5 layers), built in memory instead of from a target path.
    draft_config = qwen3_config(
        g,
        g.layers,
        architectures=["DFlashDraftModel"],
        block_size=g.block,
        num_target_layers=g.target_layers,
        layer_types=["full_attention"] * g.layers,
        sliding_window=None,
        use_sliding_window=False,
        dflash_config={"target_layer_ids": g.layer_ids, "mask_token_id": g.mask_token},
    )
    draft_config._attn_implementation = backend
    # model.torch_dtype defaults to bfloat16: the draft itself is bf16 (fp32 masters live in
    # BF16Optimizer). On the CPU smoke run everything is fp32.
    draft = AutoDraftModel.from_config(draft_config, torch_dtype=dtype).to(device)
    load_drafter_weights(draft, seeded_weights(g, device))
    target = TargetEmbeddingsAndHead(qwen3_config(g, g.target_layers))
    embed_w, head_w = make_tables(g, device, dtype)
    target.to(device=device, dtype=dtype)
    with torch.no_grad():
        target.embed_tokens.weight.copy_(embed_w)
        target.lm_head.weight.copy_(head_w)
    target.eval()
    target.requires_grad_(False)

    def wrap(num_anchors: int) -> nn.Module:
        return OnlineDFlashModel(
            draft_model=draft,
            target_lm_head=target.lm_head,
            target_embed_tokens=target.embed_tokens,
            mask_token_id=g.mask_token,
            block_size=g.block,
            attention_backend=backend,
            num_anchors=num_anchors,
            loss_decay_gamma=g.gamma,
            objective_chunk_blocks=128,
            loss_type="dflash",
        ).to(device=device, dtype=dtype)

    def batch_of(row: Row) -> dict[str, Tensor]:
        return {
            "input_ids": row.input_ids,
            "hidden_states": row.taps,
            "loss_mask": row.loss_mask.long(),
        }

    def forward(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Any]:
        loss, _acc, metrics = model(**batch)
        return loss, metrics

    out: dict[str, Any] = {}
    if case.parity_anchors:
        row = make_row(g, case.parity_anchors + g.block, head_w, device)
        torch.manual_seed(SEED)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            loss, metrics = forward(wrap(case.parity_anchors).train(), batch_of(row))
        out["parity"] = {"loss": float(loss), "trained_slots": int(metrics["accuracy_denom"])}

    model = wrap(case.anchors).train()
    # SpecForge's defaults: lr 1e-4, no weight decay, max_grad_norm 0.5, cosine with warm-up.
    optimizer = BF16Optimizer(draft, lr=1e-4, max_grad_norm=0.5, total_steps=10_000)
    batch = batch_of(make_row(g, case.context, head_w, device))
    first: list[dict[str, float]] = []
    torch.manual_seed(SEED)

    def step() -> None:
        loss, _ = forward(model, batch)
        loss.backward()
        optimizer.step()  # clip, fp32 master AdamW, copy back to bf16, grads to None
        if not first:
            first.append({"loss": float(loss)})

    out["timing"] = timed(step, device, case)
    out["first_step"] = first[0]
    out["notes"] = [
        f"attention_backend={backend!r}; create_block_mask is not compiled (rebuilt each step)",
        "anchors: sampled inside the step (GPU rand+argsort), candidates loss_mask[a] = "
        "loss_mask[a+1] = 1, no document ids or position ids (no packing)",
        "labels: the data token x[a+k] (here equal to the target's argmax by construction)",
        "loss = sum(w m CE) / sum(w m) in chunks of 128 blocks with activation checkpointing",
        "draft weights bf16 with fp32 masters in BF16Optimizer (clip 0.5); the trainer's FSDP "
        "wrapper (even on one GPU) is not applied here",
    ]
    return out
