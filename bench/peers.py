"""One DFlash drafter training step: flashdraft against speculators and SpecForge (issue 10).

Times forward + backward + optimizer of each framework's DFlash drafter on the same device,
the same geometry and the same seeded inputs, each in its own subprocess (so one that fails
or runs out of memory leaves the others standing, and peak memory is per framework):

  * flashdraft   `flashdraft.train.step.draft_loss` + clip + fused AdamW (what `flashdraft train`
                 runs per row), plus the target-side label argmax over the anchor blocks;
  * speculators  0.9.0 (vLLM project): `DFlashDraftModel` called as its `Trainer` calls it
                 (autocast, zero_grad, backward, clip 1.0, `build_optimizers` -> AdamW);
  * SpecForge    0.2.0 (SGLang project): `OnlineDFlashModel` around `DFlashDraftModel`
                 (from `AutoDraftModel.from_config`), stepped by its `BF16Optimizer`.

Default geometry (issue 10): Qwen3-8B width (hidden 4096, 32 / 8 heads, head_dim 128,
intermediate 12288, vocab 151936), 5 draft layers, K = 5 taps [1, 9, 17, 25, 33] of 36,
block B = 16, gamma 7, one 8192-token row with A = 512 anchors and one 32768-token row with
A = 2048, bf16. The row is one document whose loss mask covers [0, T - B] (the only packed
row all three express identically: SpecForge takes no document or position ids).

    python bench/peers.py                       # GPU: both sizes, all three, loss parity
    python bench/peers.py --sizes 8192:512 --out a.json     # one size per call, then
    python bench/peers.py --merge a.json b.json             # one table from both calls
    python bench/peers.py --smoke               # tiny sizes on CPU, fp32: end-to-end check

Each peer must be importable (installed from its PyPI wheel; bench/peers_wheels.sh fetches
the wheels the GPU image lacks). A loss-parity pass at T = A + B, where every candidate is an
anchor, runs all three on identical weights, inputs and blocks and compares their losses.
Prints a table, then one JSON line; where the frameworks' definitions differ (anchors,
labels, loss normalisation, optimizer) the output lists it under "caveats".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

FRAMEWORKS = ("flashdraft", "speculators", "specforge")
PACKAGES = {"flashdraft": None, "speculators": "speculators", "specforge": "specforge"}
RESULT_TAG = "PEERS_RESULT "
SEED = 1234


# ---------------------------------------------------------------------------------------------
# Geometry and the shared, seeded inputs (rebuilt identically inside every worker)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Geometry:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    taps: int
    target_layers: int
    block: int
    gamma: float
    mask_token: int

    @property
    def layer_ids(self) -> list[int]:
        """SPEC 3 default ids (Qwen3-8B, 5 taps -> [1, 9, 17, 25, 33]); SpecForge's rule agrees."""
        from flashdraft.model.config import default_target_layer_ids

        return default_target_layer_ids(self.target_layers, self.taps)


@dataclass(frozen=True, slots=True)
class Case:
    framework: str
    context: int  # T, tokens in the row
    anchors: int  # A
    parity_anchors: int  # 0: no parity pass; else a pass at T = parity_anchors + B
    warmup: int
    iters: int
    speculators_loss: str
    speculators_impl: str = "fused"


def compute_setup(device: torch.device) -> tuple[torch.dtype, bool]:
    """(input / frozen-table dtype, autocast on): bf16 on CUDA as every trainer runs; fp32 on CPU."""
    cuda = device.type == "cuda"
    return (torch.bfloat16 if cuda else torch.float32), cuda


@dataclass(slots=True)
class Row:
    """One packed row of target features and labels, identical for all three frameworks.

    input_ids[p + 1] is the target's greedy token after p by construction: last_hidden[p] is
    the head row of input_ids[p + 1] (scaled), so argmax(head(norm(last_hidden[p]))) equals it
    with a margin of ~80 logits. So the three label sources coincide: flashdraft's target
    argmax at a + k - 1, speculators' argmax of the verifier logits at a + k - 1, and
    SpecForge's data token x[a + k].
    """

    input_ids: Tensor  # [1, T] long
    loss_mask: Tensor  # [1, T] bool: 1 on [0, T - B], so every framework has T - B candidates
    doc_ids: Tensor  # [1, T] long, one document
    position_ids: Tensor  # [1, T] long
    taps: Tensor  # [1, T, K*H] concatenated target features
    last_hidden: Tensor  # [1, T, H] the target's last-layer state (speculators' label source)


def make_tables(g: Geometry, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The target's input embedding and LM head, [V, H] each (seeded, on device)."""
    gen = torch.Generator(device).manual_seed(SEED)
    embed = torch.randn(g.vocab, g.hidden, generator=gen, device=device) * 0.02
    head = torch.randn(g.vocab, g.hidden, generator=gen, device=device) * 0.02
    return embed.to(dtype), head.to(dtype)


def make_row(g: Geometry, context: int, head: Tensor, device: torch.device) -> Row:
    gen = torch.Generator(device).manual_seed(SEED + context)
    ids = torch.randint(0, g.vocab, (1, context), generator=gen, device=device)
    greedy = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # the token after p (last: any)
    loss_mask = torch.zeros(1, context, dtype=torch.bool, device=device)
    loss_mask[:, : context - g.block + 1] = True
    taps = torch.randn(1, context, g.taps * g.hidden, generator=gen, device=device)
    return Row(
        input_ids=ids,
        loss_mask=loss_mask,
        doc_ids=torch.zeros(1, context, dtype=torch.long, device=device),
        position_ids=torch.arange(context, device=device)[None],
        taps=taps.to(head.dtype),
        last_hidden=(head[greedy] / 0.02).to(head.dtype),
    )


def drafter_config(g: Geometry) -> Any:
    from flashdraft.model.config import DrafterConfig

    return DrafterConfig(
        hidden_size=g.hidden,
        intermediate_size=g.intermediate,
        num_hidden_layers=g.layers,
        num_attention_heads=g.heads,
        num_key_value_heads=g.kv_heads,
        head_dim=g.head_dim,
        vocab_size=g.vocab,
        block_size=g.block,
        num_target_layers=g.target_layers,
        target_layer_ids=g.layer_ids,
        mask_token_id=g.mask_token,
    )


def seeded_weights(g: Geometry, device: torch.device) -> dict[str, Tensor]:
    """Drafter weights by serving-format name (SPEC 6), fp32, identical in every worker.

    All three frameworks name the drafter's parameters alike (`layers.{i}.self_attn.q_proj.
    weight`, `fc.weight`, ...); each worker loads this dict and checks every name and shape
    exists in its model, which is also a check that the three architectures agree.
    """
    from flashdraft.model.drafter import DFlashDrafter

    with torch.device("meta"):
        shapes = {n: p.shape for n, p in DFlashDrafter(drafter_config(g)).named_parameters()}
    gen = torch.Generator(device).manual_seed(SEED + 1)
    out = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shapes[name], device=device)
        else:
            out[name] = torch.randn(shapes[name], generator=gen, device=device) * 0.02
    return out


def load_drafter_weights(module: nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy `weights` into `module`; its trainable parameters must be exactly these.

    Same names, same shapes, nothing trainable besides: the three drafters are one
    architecture, so the step does the same work in each (frozen tables may differ).
    """
    params = dict(module.named_parameters())
    extra = sorted(n for n, p in params.items() if p.requires_grad and n not in weights)
    if extra:
        raise ValueError(f"{type(module).__name__} trains parameters flashdraft lacks: {extra}")
    with torch.no_grad():
        for name, value in weights.items():
            target = params.get(name)
            if target is None or target.shape != value.shape:
                raise ValueError(
                    f"{type(module).__name__} has no parameter {name} of shape "
                    f"{tuple(value.shape)}: its architecture differs from the flashdraft drafter"
                )
            target.copy_(value)


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
        # Anchors are drawn on the CPU in the data pipeline (SPEC 4), outside the step.
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


# ---------------------------------------------------------------------------------------------
# Worker: one framework, one size, in this process
# ---------------------------------------------------------------------------------------------


def timed(step: Callable[[], None], device: torch.device, case: Case) -> dict[str, Any]:
    from flashdraft.benchutil import measure

    timing = measure(step, device, case.warmup, case.iters)
    out: dict[str, Any] = timing.as_dict()
    if device.type == "cuda":
        out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
    else:
        out["peak_mem_gb"] = None  # the caching allocator's peak exists on CUDA only
    return out


def framework_version(framework: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    package = PACKAGES[framework]
    if package is None:
        from flashdraft.benchutil import environment

        return str(environment()["commit"])
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def worker(case: Case, g: Geometry) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(SEED)
    run = {"flashdraft": run_flashdraft, "speculators": run_speculators, "specforge": run_specforge}
    t0 = time.perf_counter()
    import transformers

    result: dict[str, Any] = {
        "framework": case.framework,
        "version": framework_version(case.framework),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
    }
    if device.type == "cuda":  # to check that separate calls ran on the same GPU
        result["gpu_uuid"] = str(getattr(torch.cuda.get_device_properties(0), "uuid", ""))
    try:
        result.update(run[case.framework](case, g, device))
        result["status"] = "ok"
    except torch.OutOfMemoryError as err:
        result["status"] = f"out of memory: {str(err).splitlines()[0]}"
    except Exception as err:  # report any failure as a row, never take the parent down
        traceback.print_exc()
        result["status"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["max_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Parent: one subprocess per (size, framework), then the table
# ---------------------------------------------------------------------------------------------


CAVEATS = [
    "The row is one document with its loss mask on [0, T - B]: SpecForge's OnlineDFlashModel "
    "takes no document or position ids, so a multi-document packed row cannot be expressed for "
    "it; all three run this same single-document row.",
    "Anchors: each framework draws its own A of the same T - B candidates (flashdraft on the "
    "CPU in its data pipeline, untimed; the peers on the GPU inside the step), so step-0 losses "
    "at the timed sizes differ by sampling. The parity pass (T = A + B) fixes the blocks.",
    "Labels: flashdraft the target argmax at a + k - 1 (timed in its step here), speculators "
    "the argmax of its verifier head at a + k - 1 (full-vocabulary logits inside its step), "
    "SpecForge the data token x[a + k]; the inputs make all three equal.",
    "Loss: flashdraft and SpecForge sum(w m CE) / sum(w m); speculators sum(w m CE) / sum(m). "
    "speculators runs loss 'ce' and SpecForge and speculators gamma 7 to match flashdraft "
    "(their defaults: kl_div with gamma 4, and no decay).",
    "Optimizer step as each trainer does it: flashdraft clip 1.0 + fused AdamW on fp32 weights; "
    "speculators clip 1.0 + AdamW (foreach) on fp32 weights; SpecForge bf16 weights, "
    "BF16Optimizer (clip 0.5, fp32 master AdamW, copy back). LR schedulers are not stepped.",
]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", help="context:anchors,... (default 8192:512,32768:2048)")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--taps", type=int, default=5)
    p.add_argument("--target-layers", type=int, default=36)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--mask-token", type=int, default=151669, help="Qwen3's padded-vocab id")
    p.add_argument(
        "--parity-anchors",
        type=int,
        help="loss-parity pass at T = this + B, where every candidate is an anchor (default 64; "
        "0: skip); run with the first size only",
    )
    p.add_argument(
        "--speculators-loss", default="ce", help="'ce' matches flashdraft; their default is kl_div"
    )
    p.add_argument(
        "--speculators-impl",
        default="fused",
        choices=["fused", "eager"],
        help="their loss kernels; 'eager' where the fused Triton loss fails under torch.compile",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--timeout", type=int, default=300, help="seconds per framework and size")
    p.add_argument(
        "--deadline", type=int, default=0, help="seconds for the whole run; later runs are skipped"
    )
    p.add_argument("--out", help="also write the JSON result here, updated after every run")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="combine --out files of earlier runs")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.heads, args.kv_heads, args.head_dim = 64, 4, 2, 16
        args.intermediate, args.vocab, args.layers, args.mask_token = 128, 1000, 2, 999
        args.warmup, args.iters = 1, 3
    if args.sizes is None:
        args.sizes = "256:16,512:32" if args.smoke else "8192:512,32768:2048"
    if args.parity_anchors is None:
        args.parity_anchors = 8 if args.smoke else 64
    return args


def geometry(args: argparse.Namespace) -> Geometry:
    return Geometry(
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
        layers=args.layers,
        vocab=args.vocab,
        taps=args.taps,
        target_layers=args.target_layers,
        block=args.block,
        gamma=args.gamma,
        mask_token=args.mask_token,
    )


def spawn(case: Case, g: Geometry, timeout: float) -> dict[str, Any]:
    """Run one worker; a crash, a timeout or a missing result becomes a status, not an error."""
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), repo) if p)
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, __file__, "--worker", case.framework]
    cmd += ["--case", json.dumps(asdict(case)), "--geometry", json.dumps(asdict(g))]
    base = {"framework": case.framework, "context": case.context, "anchors": case.anchors}
    t0 = time.perf_counter()
    # Its own process group (same session), so a timeout also ends its compile workers.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, process_group=0
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        return {**base, "status": f"timed out after {timeout:.0f} s", "stderr_tail": stderr[-2000:]}
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG) :])
            if result.get("status") != "ok":
                result["stderr_tail"] = stderr[-2000:]
            return {**base, **result}
    status = f"worker exited with {proc.returncode} and no result"
    if "OutOfMemoryError" in stderr or proc.returncode in (-9, 137):
        status = f"out of memory (worker exited with {proc.returncode})"
    return {
        **base,
        "status": status,
        "wall_s": round(time.perf_counter() - t0, 1),
        "stderr_tail": stderr[-2000:],
    }


def add_rates(rows: list[dict[str, Any]], g: Geometry, peak: float | None) -> None:
    """Query tokens/s, model TFLOP/s and MFU of each measured row, in place.

    Model FLOPs are the same numerator for every framework (bench/drafter.py's formula): the
    drafter layers x3 for fwd + bwd, plus the head forward and its gradient w.r.t. h on the
    B - 1 trained slots of each block. Work a framework adds (full-vocabulary verifier logits,
    recomputation) is not counted: it shows as a lower rate.
    """
    from flashdraft.model.drafter import DFlashDrafter

    with torch.device("meta"):
        model = DFlashDrafter(drafter_config(g))
    for row in rows:
        if row.get("status") != "ok":
            continue
        queries = row["anchors"] * g.block
        flops = 3 * model.num_flops_per_query_token(row["context"], queries) * queries
        flops += 2 * 2 * g.hidden * g.vocab * row["anchors"] * (g.block - 1)
        step_s = row["timing"]["median_ms"] / 1e3
        row["query_tok_per_s"] = round(queries / step_s)
        row["tflops"] = round(flops / step_s / 1e12, 1)
        if peak:
            row["mfu"] = round(flops / step_s / peak, 3)


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size: flashdraft / peer for step time and peak memory, and the issue's two goals."""
    sizes: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row.get("status") == "ok":
            sizes.setdefault(f"{row['context']}:{row['anchors']}", {})[row["framework"]] = row
    out = {}
    for key, by_fw in sizes.items():
        ours = by_fw.get("flashdraft")
        peers = [by_fw[p] for p in ("speculators", "specforge") if p in by_fw]
        if ours is None or not peers:
            continue
        r: dict[str, Any] = {"peers_measured": [p["framework"] for p in peers]}
        for peer in peers:
            ms = ours["timing"]["median_ms"] / peer["timing"]["median_ms"]
            r[f"time_vs_{peer['framework']}"] = round(ms, 3)
            if ours["timing"]["peak_mem_gb"] and peer["timing"]["peak_mem_gb"]:
                gb = ours["timing"]["peak_mem_gb"] / peer["timing"]["peak_mem_gb"]
                r[f"memory_vs_{peer['framework']}"] = round(gb, 3)
        faster = min(peers, key=lambda p: p["timing"]["median_ms"])
        r["time_vs_faster_peer"] = r[f"time_vs_{faster['framework']}"]
        r["goal_time_met"] = r["time_vs_faster_peer"] <= 0.8  # issue 10: at most 0.8x
        if all(p["timing"]["peak_mem_gb"] for p in [*peers, ours]):
            leaner = min(peers, key=lambda p: p["timing"]["peak_mem_gb"])
            r["memory_vs_leaner_peer"] = r[f"memory_vs_{leaner['framework']}"]
            r["goal_memory_met"] = r["memory_vs_leaner_peer"] <= 1.0
        out[key] = r
    return out


def parity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Losses on identical weights, inputs and blocks (T = A + B: every candidate an anchor)."""
    by_fw = {r["framework"]: r["parity"] for r in rows if r.get("status") == "ok" and "parity" in r}
    out: dict[str, Any] = {"losses": by_fw}
    ours = by_fw.get("flashdraft")
    if ours is None:
        return out
    if "specforge" in by_fw:  # same normalisation: sum(w m CE) / sum(w m)
        out["specforge_rel_diff"] = rel_diff(by_fw["specforge"]["loss"], ours["loss"])
    if "speculators" in by_fw:  # it divides by sum(m): compare with ours renormalised
        theirs = by_fw["speculators"]["loss"]
        out["speculators_rel_diff"] = rel_diff(theirs, ours["loss_as_speculators"])
    return out


def rel_diff(a: float, b: float) -> float:
    return float(f"{abs(a - b) / max(abs(b), 1e-12):.3g}")


def report(
    rows: list[dict[str, Any]], g: Geometry, peak: float | None, env: dict[str, Any]
) -> dict[str, Any]:
    add_rates(rows, g, peak)
    return {
        "bench": "peers",
        "geometry": asdict(g),
        "peak_tflops": round(peak / 1e12, 1) if peak else None,
        "rows": rows,
        "ratios": ratios(rows),
        "parity": parity(rows),
        "caveats": CAVEATS,
        **env,
    }


def print_report(result: dict[str, Any]) -> None:
    from flashdraft.benchutil import print_table

    table = []
    for row in result["rows"]:
        t = row.get("timing", {})
        table.append(
            {
                "framework": row["framework"],
                "version": row.get("version", ""),
                "T": row["context"],
                "A": row["anchors"],
                "step_ms": t.get("median_ms", "-"),
                "p10_ms": t.get("p10_ms", "-"),
                "p90_ms": t.get("p90_ms", "-"),
                "peak_gb": t.get("peak_mem_gb") or "-",
                "query_tok/s": row.get("query_tok_per_s", "-"),
                "TFLOP/s": row.get("tflops", "-"),
                "mfu": row.get("mfu", "-"),
                "loss@0": round(row["first_step"]["loss"], 4) if "first_step" in row else "-",
                "status": row.get("status", ""),
            }
        )
    if result["peak_tflops"]:
        print(f"measured bf16 matmul peak: {result['peak_tflops']} TFLOP/s")
    print_table(table, list(table[0]))
    print("(loss@0: each framework's own definition, before any update; anchors differ)")
    for key, r in result["ratios"].items():
        print(f"flashdraft / peer at T:A = {key}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    losses = result["parity"]["losses"]
    if losses:
        print("loss parity at T = A + B (identical weights, inputs and blocks):")
        for fw, p in losses.items():
            print(f"  {fw:12s} " + ", ".join(f"{k} {round(v, 6)}" for k, v in p.items()))
        for key in ("specforge_rel_diff", "speculators_rel_diff"):
            if key in result["parity"]:
                print(f"  {key}: {result['parity'][key]}")
    print("caveats:")
    for line in result["caveats"]:
        print(f"  * {line}")
    seen = set()
    for row in result["rows"]:
        if row.get("status") == "ok" and row["framework"] not in seen:
            seen.add(row["framework"])
            print(f"{row['framework']}: " + "; ".join(row.get("notes", [])))
    for row in result["rows"]:
        if row.get("status") != "ok":
            print(f"--- {row['framework']} T={row['context']} A={row['anchors']}: {row['status']}")
            print("\n".join(row.get("stderr_tail", "").splitlines()[-8:]))


def run_all(args: argparse.Namespace, g: Geometry) -> list[dict[str, Any]]:
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown:
        raise SystemExit(f"unknown framework(s) {unknown}; choose from {FRAMEWORKS}")
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for i, (context, anchors) in enumerate(sizes):
        for framework in frameworks:
            case = Case(
                framework=framework,
                context=context,
                anchors=anchors,
                parity_anchors=args.parity_anchors if i == 0 else 0,
                warmup=args.warmup,
                iters=args.iters,
                speculators_loss=args.speculators_loss,
                speculators_impl=args.speculators_impl,
            )
            timeout: float = args.timeout
            left = args.deadline - (time.perf_counter() - t0) - 20 if args.deadline else 1e9
            if left < 60:  # too little time to start, compile and time a worker
                row = {"framework": framework, "context": context, "anchors": anchors}
                row["status"] = "skipped: --deadline reached"
            else:
                row = spawn(case, g, min(timeout, left))
            rows.append(row)
            ms = row.get("timing", {}).get("median_ms", "-")
            print(
                f"[{time.perf_counter() - t0:5.0f} s] {framework} T={context} A={anchors}: "
                f"{row['status']} (step {ms} ms, worker {row.get('wall_s', '-')} s)",
                file=sys.stderr,
                flush=True,
            )
            if args.out:  # partial results survive a run that is killed
                Path(args.out).write_text(json.dumps({"geometry": asdict(g), "rows": rows}))
    return rows


ENV_KEYS = ("date", "commit", "python", "torch", "transformers", "gpu", "gpus", "cuda", "cpu")


def main() -> int:
    from flashdraft.benchutil import environment

    if "--worker" in sys.argv:
        return worker_main()
    args = parse()
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        g = Geometry(**parts[0]["geometry"])
        if any(Geometry(**p["geometry"]) != g for p in parts):
            raise SystemExit("the merged runs used different geometries")
        rows = [row for p in parts for row in p["rows"]]
        peaks = [p["peak_tflops"] for p in parts if p.get("peak_tflops")]
        peak = peaks[0] * 1e12 if peaks else None
        env = {k: parts[0][k] for k in ENV_KEYS if k in parts[0]}  # where it was measured
        gpus = {r.get("gpu_uuid") for r in rows if r.get("gpu_uuid")}
        if len(gpus) > 1:
            print(f"note: the merged runs used {len(gpus)} different GPUs: {sorted(gpus)}")
    else:
        g = geometry(args)
        rows = run_all(args, g)
        env = environment()
        peak = None
        if torch.cuda.is_available():
            from flashdraft.benchutil import matmul_peak

            peak = matmul_peak(torch.device("cuda"))
    result = report(rows, g, peak, env)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    print_report(result)
    from flashdraft.benchutil import print_json

    print_json(result)
    return 0


def worker_main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True, choices=FRAMEWORKS)
    p.add_argument("--case", required=True)
    p.add_argument("--geometry", required=True)
    args = p.parse_args()
    return worker(Case(**json.loads(args.case)), Geometry(**json.loads(args.geometry)))


if __name__ == "__main__":
    sys.exit(main())
