"""Will this run fit? A memory model of one GPU from the run config, before anything loads.

Every term is in bytes, per GPU, named, and belongs either to the whole step (held: weights,
optimizer state, gradients kept across micro-batches, buffers in flight) or to one phase of
it. A step's phases never overlap on the GPU (`Trainer.train_step`: `make_batch`, then
`draft_loss` and its backward): the target's packed forward under inference mode, whose
per-layer transients and document mask are freed before its labels are computed and before
`Target.packed_outputs` returns, the labels' logits chunk, the drafter's forward (its saved
activations and, last, the LM head's chunk), its backward (the activations not yet freed,
the gradients made so far: the peak with checkpointed layers) and the optimizer step (every
gradient; Muon's batched Newton-Schulz: its peak with a large drafter). The
predicted peak (what `torch.cuda.max_memory_allocated` reports) is the held terms plus the
largest phase; `MemoryEstimate.total` adds the allocator's slack (`MARGIN`).

The role says which placement's GPU is modelled (`train/layout.py` asks for each):
"colocated" (target and a drafter replica), "target" (a split placement's target rank: the
target and the rows queued to its drafter ranks) or "drafter" (a split placement's drafter
rank: the target's embedding and LM head, the drafter, the rows received).

Calibrated against the records (GB = GiB, as the benches print `max_memory_allocated`):

| run (H200) | measured | this model |
|---|---|---|
| 27B-shaped hybrid + 5-layer drafter (1,835M), 8192-token rows, full step | 85.4 | 86.3 |
| the same, target forward (the bench held one more row's taps: +0.47) | 73.6 | 73.0 + 0.47 |
| the same at 16384-token rows | 86.2 | 87.2 |
| 8B-width 5-layer drafter step alone (benchmarks/drafter_h200_202611.md) | 23.0 | 22.2 |
| 8B-shaped target + drafter, 2 rows a step (benchmarks/parallel_h200x2_202611.md) | 44.1 | 41.7 |
| the same, 2 GPUs with DDP | 48.9 | 46.6 |
| the same, split 1 + 1, drafter rank (the bench also built the whole target there) | 46.7 | 29.4 + 15.3 |

The hybrid's record is benchmarks/hybrid_h200_20261201.md. The former estimate said 114.1 GB
for the 27B at 16384: it counted the drafter's activations at 16 bytes per (H + I) element
per query and layer, its gradients whole beside them (with one forward per optimizer step
they are made layer by layer as the activations are freed: `BACKWARD_PHASE`), and a 10%
margin on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashdraft.model.config import DrafterConfig
from flashdraft.model.drafter import DFlashDrafter, param_count
from flashdraft.model.fp8 import fp8_weight_count
from flashdraft.model.hybrid import DELTA_RULE_CHUNK, linear_layer_ids
from flashdraft.model.target import decoder_layers
from flashdraft.train.config import RunConfig

GB = 2**30
# Bytes saved for backward per element of (4 H + 3 q + 3 kv + 3 I) per query token and draft
# layer: the compiled layer keeps, in bf16, its input and normed input (2 H), q before its
# norm, after RoPE and the attention output (3 q), k and v of the block and k before its norm
# (3 kv), the second residual and its normed input (2 H), gate, up and their product (3 I);
# 2 bytes each, x 1.13 for what the list leaves out (norm statistics, the attention's
# log-sum-exp, allocator rounding): fitted to the 8B-width drafter's +19.6 GB from 8192 to
# 32768 queries (benchmarks/peers_h200_202611.md).
DRAFTER_SAVED_BYTES = 2.25
# The chunked LM head + loss in the drafter's forward (`train/loss.py`): z = h W^T in bf16,
# its fp32 logits and gradient and the bf16 gradient, ~14 bytes per logit of a chunk: fitted
# to the 8B-width drafter step's 23.0 GB (benchmarks/drafter_h200_202611.md).
LM_BYTES_PER_LOGIT = 14
# DDP keeps its gradient buckets beside the gradients: +4.84 GB for 1,049M fp32 gradients
# (3.91 GB) on two H200s (benchmarks/parallel_h200x2_202611.md).
DDP_BUCKETS = 1.24
# Muon's step on one batch of same-shaped matrices (`train/optim.py`): the stacked fp32
# gradients, momenta, Nesterov update and step (4 x 4 bytes) and three bf16 Newton-Schulz
# iterates (3 x 2), per element.
MUON_BYTES = 22
MARGIN = 1.05  # the caching allocator's reserved memory over its peak allocation

TARGET_PHASE = "target forward"
LABELS_PHASE = "target labels"
DRAFTER_PHASE = "drafter forward"
BACKWARD_PHASE = "drafter backward"
OPTIMIZER_PHASE = "optimizer step"
ROLES = ("colocated", "target", "drafter")


@dataclass(slots=True)
class MemoryEstimate:
    terms: dict[str, float]  # name -> bytes
    phases: dict[str, str]  # name -> one of the phases; absent: held throughout
    role: str = "colocated"

    def phase_bytes(self, phase: str) -> float:
        return sum(v for name, v in self.terms.items() if self.phases.get(name) == phase)

    @property
    def held(self) -> float:
        return sum(v for name, v in self.terms.items() if name not in self.phases)

    @property
    def peak_phase(self) -> str:
        present = {p for p in self.phases.values()} or {DRAFTER_PHASE}
        return max(sorted(present), key=self.phase_bytes)

    @property
    def peak(self) -> float:
        """The predicted peak of allocated memory (`torch.cuda.max_memory_allocated`)."""
        return self.held + self.phase_bytes(self.peak_phase)

    @property
    def total(self) -> float:
        """What the GPU must have for it: the peak and the allocator's slack."""
        return self.peak * MARGIN

    def table(self) -> str:
        rows = [
            f"  {name:<50} {value / GB:8.2f} GB  {self.phases.get(name, 'held')}"
            for name, value in self.terms.items()
        ]
        rows.append(f"  {'peak (held + the ' + self.peak_phase + ')':<50} {self.peak / GB:8.2f} GB")
        rows.append(
            f"  {'needed (x' + str(MARGIN) + ' allocator slack)':<50} {self.total / GB:8.2f} GB"
        )
        return "\n".join(rows)


@dataclass(frozen=True, slots=True)
class Sizes:
    """Parameter counts the terms read, counted once (the target on the meta device)."""

    target_layers: int  # decoder layers' parameters (what FSDP2 shards)
    target_rest: int  # embedding, final norm, LM head: whole on every rank
    target_layer_max: int  # the largest decoder layer (FSDP2 gathers it whole)
    target_head: int  # embedding + LM head (a split drafter rank receives them)
    drafter: int
    drafter_layer_max: int
    # The most elements of the drafter's weight matrices of one shape: what Muon orthogonalises
    # as one batch (`train/optim.py`: gate and up of every layer, for one).
    drafter_matrix_group: int = 0
    target_fp8: int = 0  # weights of the linear layers `target.precision = "fp8"` converts


def sizes(target_config: Any, drafter: DrafterConfig) -> Sizes:
    """Count the target's and the drafter's parameters on the meta device (no memory, no
    weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config)
        draft = DFlashDrafter(drafter)
    layers = [param_count(layer) for layer in decoder_layers(model)]
    groups: dict[tuple[int, ...], int] = {}
    for param in draft.parameters():
        if param.ndim == 2 and min(param.shape) > 1:
            groups[tuple(param.shape)] = groups.get(tuple(param.shape), 0) + param.numel()
    total = param_count(model)
    text = target_config.get_text_config()
    head = text.vocab_size * text.hidden_size * (1 if text.tie_word_embeddings else 2)
    return Sizes(
        target_layers=sum(layers),
        target_rest=total - sum(layers),
        target_layer_max=max(layers),
        target_head=head,
        drafter=param_count(draft),
        drafter_layer_max=max(param_count(layer) for layer in draft.layers),
        drafter_matrix_group=max(groups.values(), default=0),
        target_fp8=fp8_weight_count(decoder_layers(model)),
    )


def target_param_bytes(target_config: Any, dtype_bytes: int) -> float:
    """Parameters of the target counted on the meta device (no memory, no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config)
    return float(sum(p.numel() for p in model.parameters()) * dtype_bytes)


def drafter_saved_bytes_per_query(drafter: DrafterConfig) -> float:
    """What one draft layer keeps for backward per query token (`DRAFTER_SAVED_BYTES`)."""
    h, i = drafter.hidden_size, drafter.intermediate_size
    q, kv = (
        drafter.num_attention_heads * drafter.head_dim,
        drafter.num_key_value_heads * drafter.head_dim,
    )
    return DRAFTER_SAVED_BYTES * (4 * h + 3 * q + 3 * kv + 3 * i)


def linear_attention_bytes_per_token(text: Any, dtype_bytes: int) -> float:
    """Transient bytes per token of one Gated DeltaNet layer of a hybrid target, at its peak
    inside the delta rule. The target runs under inference mode, so only what the layer's
    code still references is alive:
    (1) in the target dtype, the q/k/v projection after the convolution, once (2 nk dk +
        nv dv: the projection before it is released when the convolution returns, `mixed`
        rebound in `hybrid.gated_delta_net_varlen` as in transformers' forward), the gate z,
        the rule's output and the gated norm's (3 nv dv);
    (2) fp32 working copies of q and k repeated to the value heads, v, g and beta
        (transformers' torch path, the per-document fallback): 4 x (2 nv dk + nv dv + 2 nv);
    (3) the chunked rule's state at every chunk start, dk x dv per value head every C tokens,
        in the target dtype: fla allocates it so (`k.new_empty(B, NT, HV, K, V)`,
        `chunk_gated_delta_rule_fwd_h` in fla/ops/common/chunk_delta_h.py), transformers'
        torch path keeps one running state per sequence only: dtype nv dk dv / C;
    (4) about three C x C intra-chunk matrices per value head: 4 x 3 nv C.
    Qwen3.6-27B in bf16: 192.9 KB per token (it was 238.0 with (1) counted twice and (3) in
    fp32). Measured as a whole, not per term: the 27B-shaped hybrid + 5-layer drafter at
    16384-token rows peaked at 86.2 GB on an H200 (benchmarks/hybrid_h200_20261201.md, fla
    path), in the drafter step, where this term is no longer held. (2) and (4) stay
    estimates: they size the torch path's fp32 copies, which also bound fla's bf16 working
    set (normed q/k, w, u, the new values). Training runs without a cache: no K/V and no
    state outlives the layer."""
    nk, nv = text.linear_num_key_heads, text.linear_num_value_heads
    dk, dv, chunk = text.linear_key_head_dim, text.linear_value_head_dim, DELTA_RULE_CHUNK
    low = dtype_bytes * ((2 * nk * dk + nv * dv) + 3 * nv * dv)  # (1)
    working = 4 * (2 * nv * dk + nv * dv + 2 * nv)  # (2)
    states = dtype_bytes * nv * dk * dv / chunk  # (3)
    intra = 4 * 3 * nv * chunk  # (4)
    return float(low + working + states + intra)


def estimate(
    config: RunConfig,
    drafter: DrafterConfig,
    target_config: Any,
    drafter_params: int | None = None,
    shards: int = 1,
    *,
    role: str = "colocated",
    replicas: int = 1,
    consumers: int = 1,
    counts: Sizes | None = None,
) -> MemoryEstimate:
    """The memory of one GPU of the run. `shards`: ranks the target's decoder layers are
    sharded over (FSDP2, colocated); `replicas`: drafter replicas (DDP buckets, or FSDP2 shards
    with `parallel.drafter_sharding = "fsdp"`); `consumers`: drafter ranks a split target rank
    feeds. `drafter_params` overrides the drafter's count (tests)."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: one of {', '.join(ROLES)}")
    counts = counts or sizes(target_config, drafter)
    p_draft = counts.drafter if drafter_params is None else drafter_params
    text = target_config.get_text_config()
    dtype_bytes = 4 if config.target.dtype == "float32" else 2
    h, vocab = text.hidden_size, text.vocab_size
    # What one forward holds: `optim.rows_per_forward` rows at once (their tokens, anchors);
    # the target's forward `target.forward_rows` rows when it runs ahead, their outputs held.
    rows, target_rows = config.optim.rows_per_forward, config.target_rows
    row = config.data.row_tokens
    t, t_target = row * rows, row * target_rows
    q = config.loss.anchors * drafter.block_size * rows
    kv_dim = drafter.num_key_value_heads * drafter.head_dim
    layers = drafter.num_hidden_layers
    soft = config.loss.soft_top_k if config.loss.labels == "soft" else 0
    slots = config.loss.anchors * (drafter.block_size - 1)  # trained slots of a row
    # One row on the wire (split): taps [T, K*H], next tokens, soft labels.
    payload = row * h * drafter.num_taps * dtype_bytes + slots * 8 * (1 + soft) + slots * soft * 4
    terms: dict[str, float] = {}
    phases: dict[str, str] = {}

    def add(name: str, value: float, phase: str | None = None) -> None:
        terms[name] = float(value)
        if phase is not None:
            phases[name] = phase

    if role in ("colocated", "target"):
        weights = (counts.target_layers / shards + counts.target_rest) * dtype_bytes
        if config.target.precision == "fp8":  # 1-byte weights (their fp32 scales: ~0.1%)
            weights -= counts.target_fp8 * (dtype_bytes - 1)
        add("target weights" + (f" (layers / {shards})" if shards > 1 else ""), weights)
        # One layer's transient at row length: MLP gate/up/act and attention q/k/v/out; on a
        # hybrid target the largest of that and a linear-attention layer's.
        per_token = (3 * text.intermediate_size + 6 * h) * dtype_bytes
        if linear_layer_ids(target_config):
            per_token = max(per_token, linear_attention_bytes_per_token(text, dtype_bytes))
        add("target layer transient (largest layer)", t_target * per_token, TARGET_PHASE)
        if shards > 1:  # FSDP2 gathers a layer whole, the next one prefetched
            add(
                "FSDP2 gathered target layers (2)",
                2 * counts.target_layer_max * dtype_bytes,
                TARGET_PHASE,
            )
        # A target loaded with an attention that is neither flex nor varlen (configured: on
        # CUDA every target, hybrids too, defaults to one of those, `target.default_attention`)
        # takes the packed row's document mask dense: [T, T] booleans, and SDPA's additive
        # copy of it in the target dtype.
        dense = config.target.attn_implementation not in (None, "flex_attention", "varlen")
        if dense:
            add(
                "dense document mask [T, T] (sdpa)",
                target_rows * row * row * (1 + dtype_bytes),
                TARGET_PHASE,
            )
        # The target's labels (`TargetHead.labels_at`): a chunk of logits in the target dtype
        # and its scaled copy (softcap / multiplier), after the layers.
        if config.loss.labels != "data":
            add(
                "target label chunk (logits x2)",
                2.0 * config.loss.chunk_rows * vocab * dtype_bytes,
                LABELS_PHASE,
            )
        # The taps, made in the target's forward and read by the drafter's step (colocated),
        # or sent (split: the target rank keeps `queue_depth` rows in flight per consumer).
        add("taps + last hidden state", t_target * h * (drafter.num_taps + 1) * dtype_bytes)
        if role == "target":
            add("rows queued to drafter ranks", config.parallel.queue_depth * consumers * payload)
        if soft:
            add("soft labels (top-k ids + fp32 probs)", slots * target_rows * soft * 12)
    if role == "target":
        return MemoryEstimate(terms, phases, role)
    if role == "drafter":
        add("target embedding + LM head", counts.target_head * dtype_bytes)
        # `FeatureReceiver`: `queue_depth` receives posted, and the one being trained on.
        add("rows received (queue + current)", (config.parallel.queue_depth + 1) * payload)

    sharded = config.parallel.drafter_sharding == "fsdp" and replicas > 1
    split = replicas if sharded else 1
    optimizer = 4 if config.optim.optimizer == "muon" else 8  # momentum; AdamW's m and v
    add("drafter weights (fp32)", p_draft * 4 / split)
    add(f"optimizer state ({config.optim.optimizer})", p_draft * optimizer / split)
    if config.optim.grad_accum > rows:  # gradients live across the step's micro-batches
        add("drafter gradients (fp32, across micro-batches)", p_draft * 4 / split)
    if replicas > 1 and not sharded:
        add("DDP gradient buckets", p_draft * 4 * DDP_BUCKETS)
    wider = config.drafter.residual_dtype == "float32" and dtype_bytes == 2
    layer_acts = q * drafter_saved_bytes_per_query(drafter)  # what one layer keeps
    checkpointed = config.drafter.activation_checkpointing
    layer_input = q * h * (4 if wider else dtype_bytes)  # the residual stream into a layer
    if checkpointed:
        # Each layer keeps only its input; its activations exist again while its backward
        # recomputes them, one layer at a time.
        add("drafter layer inputs (checkpointed)", layers * layer_input, DRAFTER_PHASE)
        kv_layers = 1
    else:
        add("drafter activations (A*B queries)", layers * layer_acts, DRAFTER_PHASE)
        kv_layers = layers
        if wider:
            # `drafter.residual_dtype = "float32"` under a 2-byte target: the norms' outputs
            # are fp32, and autocast saves a bf16 cast of them for each projection that reads
            # one (q, k, v; gate, up): measured with saved-tensor hooks under eager CPU
            # autocast, 10 more bytes per query, hidden unit and layer, plus 2 (final norm).
            add("fp32 residual (casts saved)", (10 * layers + 2) * q * h, DRAFTER_PHASE)
    # The fused context [T, H] and each layer's context K/V, before and after the block's
    # keys are appended ([T, kv] and [T + Q, kv], k and v, bf16).
    context = t * h * dtype_bytes + kv_layers * 2 * (2 * t + q) * kv_dim * dtype_bytes
    add("drafter context + K/V", context, DRAFTER_PHASE)
    # The forward's last big allocation: the LM head's chunk (the loss and its gradient are
    # computed in forward, `train/loss.py`).
    add(
        "LM head chunk",
        config.loss.chunk_rows * drafter.vocab_size * LM_BYTES_PER_LOGIT,
        DRAFTER_PHASE,
    )
    # The backward of layer i (last to first) holds the activations of layers 0..i (the
    # inputs of 0..i and layer i's recomputed activations, checkpointed) and the fp32
    # gradients of layers i..L-1: linear in i, so the worst is at an end: i = L-1 (every
    # layer's activations, one layer's gradients) or i = 0 (one layer's activations, every
    # gradient, the fused context's `fc` too). Gradients held across micro-batches are
    # counted as held, not again here.
    grad_layer = 0.0 if config.optim.grad_accum > rows else counts.drafter_layer_max * 4 / split
    grad_rest = 0.0 if not grad_layer else (p_draft - layers * counts.drafter_layer_max) * 4 / split
    if checkpointed:
        last, first = layers * layer_input + layer_acts, layer_input + layer_acts
    else:
        last, first = layers * layer_acts, layer_acts
    if last + grad_layer >= first + layers * grad_layer + grad_rest:
        acts, grads, where = last, grad_layer, "the last layer's"
    else:
        acts, grads, where = first, layers * grad_layer + grad_rest, "the first layer's"
    add(f"drafter activations at {where} backward", acts, BACKWARD_PHASE)
    add("drafter gradients (fp32) by then", grads, BACKWARD_PHASE)
    add("drafter context + K/V (still held)", context, BACKWARD_PHASE)
    # The optimizer step: every gradient (fused AdamW updates in place, no temporaries),
    # and Muon's batched Newton-Schulz on its largest group of same-shaped matrices.
    if grad_layer:
        add("drafter gradients (fp32, all)", p_draft * 4 / split, OPTIMIZER_PHASE)
    if config.optim.optimizer == "muon":
        add(
            "Muon step (largest same-shape batch)",
            counts.drafter_matrix_group * MUON_BYTES,
            OPTIMIZER_PHASE,
        )
    if sharded:  # FSDP2 gathers a layer's fp32 weights whole (and the next one prefetched)
        gathered = 2 * counts.drafter_layer_max * 4
        add("FSDP2 gathered drafter layers (2)", gathered, DRAFTER_PHASE)
        # and a layer's whole gradient before its reduce-scatter
        add(
            "FSDP2 gathered layers + a whole gradient",
            gathered + counts.drafter_layer_max * 4,
            BACKWARD_PHASE,
        )
    return MemoryEstimate(terms, phases, role)


def check(
    config: RunConfig,
    drafter: DrafterConfig,
    target_config: Any,
    drafter_params: int,
    device: torch.device,
    resident: float = 0.0,
) -> MemoryEstimate:
    """Raise ValueError, with the numbers and what to change, if the run cannot fit.
    `resident`: bytes of the estimate already on the GPU (a target model handed in loaded),
    which the free memory no longer includes."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    split = config.parallel.placement == "split"
    shards = world if config.parallel.shard_target and not split else 1
    result = estimate(
        config,
        drafter,
        target_config,
        drafter_params,
        shards,
        role="drafter" if split else "colocated",
        replicas=world - config.parallel.target_ranks if split else world,
    )
    if device.type != "cuda":
        return result
    free, total = torch.cuda.mem_get_info(device)
    if result.total - resident > free:
        loaded = f" ({resident / GB:.1f} GB of it loaded already)" if resident else ""
        raise ValueError(
            f"this run needs about {result.total / GB:.1f} GB per GPU{loaded} but "
            f"{free / GB:.1f} GB of {total / GB:.1f} GB are free:\n{result.table()}\n"
            "to fit: lower optim.rows_per_forward, target.forward_rows, loss.anchors (drafter "
            "activations), data.row_tokens (target activations, context), loss.chunk_rows (LM "
            "head), drafter.num_layers; or let `flashdraft train --plan` list the layouts "
            "that fit (parallel.placement = 'auto' picks the fastest). "
            "Set preflight = false to try anyway."
        )
    return result
