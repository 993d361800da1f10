"""Will this run fit? A memory estimate from the run config, checked before anything loads.

All terms in bytes, per GPU, for the colocated placement (the target and a drafter replica on
every rank). Coefficients of the activation terms were measured on an H200 (bench/drafter.py,
bench/trainer.py) and are deliberately a little generous; the estimate is a guard against
runs that cannot fit, not an allocator.

A step has two phases that never overlap on the GPU (`Trainer.train_step`: `make_batch`, then
`draft_loss` and its backward): the target's packed forward, under inference mode
(`Target.no_grad`), whose per-layer transients and document mask are freed when
`Target.packed_outputs` returns, and the drafter's step. So the peak is the terms held across
both (weights, optimizer state, the taps) plus the larger phase, not the sum of all terms.

Measured against it: a Qwen3.6-27B-shaped hybrid target + 5-layer drafter, 16384-token rows,
A = 512, B = 16, peaked at 86.2 GB on an H200 (benchmarks/hybrid_h200_20261201.md); the
estimate says 103.7 GB (114.1 with the margin), where summing every term and the former
linear-attention term said 108.1 (118.9). The rest of the gap is in the drafter step's terms,
kept as generous estimates: its fp32 gradients (with one forward per optimizer step they do
not exist yet at the activation peak: `zero_grad(set_to_none=True)`), the activation
coefficient and the context K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashdraft.model.config import DrafterConfig
from flashdraft.model.hybrid import DELTA_RULE_CHUNK, linear_layer_ids
from flashdraft.train.config import RunConfig

GB = 2**30
# Saved activations per query token per drafter layer, in bytes per unit of (H + I):
# 23.0 GB peak for A*B = 8192 queries, 5 layers, H = 4096, I = 12288 (bench/drafter.py),
# after weights, gradients, bf16 weight copies and the LM-head chunk: ~13 B; rounded up.
DRAFTER_ACT_BYTES = 16
MARGIN = 1.10  # allocator fragmentation and CUDA context


TARGET_PHASE = "target forward"
DRAFTER_PHASE = "drafter step"


@dataclass(slots=True)
class MemoryEstimate:
    terms: dict[str, float]  # name -> bytes
    phases: dict[str, str]  # name -> TARGET_PHASE or DRAFTER_PHASE; absent: held throughout

    def phase_bytes(self, phase: str) -> float:
        return sum(v for name, v in self.terms.items() if self.phases.get(name) == phase)

    @property
    def peak_phase(self) -> str:
        target, drafter = self.phase_bytes(TARGET_PHASE), self.phase_bytes(DRAFTER_PHASE)
        return TARGET_PHASE if target > drafter else DRAFTER_PHASE

    @property
    def total(self) -> float:
        held = sum(v for name, v in self.terms.items() if name not in self.phases)
        return (held + self.phase_bytes(self.peak_phase)) * MARGIN

    def table(self) -> str:
        rows = [
            f"  {name:<34} {value / GB:8.2f} GB  {self.phases.get(name, '')}"
            for name, value in self.terms.items()
        ]
        rows.append(
            f"  {'total (x' + str(MARGIN) + ' margin)':<34} {self.total / GB:8.2f} GB  "
            f"(peak in the {self.peak_phase}; the other phase's terms are freed before it)"
        )
        return "\n".join(rows)


def target_param_bytes(target_config: Any, dtype_bytes: int) -> float:
    """Parameters of the target counted on the meta device (no memory, no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target_config)
    return float(sum(p.numel() for p in model.parameters()) * dtype_bytes)


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
    drafter_params: int,
    shards: int = 1,
) -> MemoryEstimate:
    text = target_config.get_text_config()
    dtype_bytes = 4 if config.target.dtype == "float32" else 2
    # What one forward holds: `optim.rows_per_forward` rows at once (their tokens, anchors);
    # the target's forward `target.forward_rows` rows when it runs ahead, their outputs held.
    rows = config.optim.rows_per_forward
    target_rows = config.target_rows
    t, h = config.data.row_tokens * rows, text.hidden_size
    t_target = config.data.row_tokens * target_rows
    inter = text.intermediate_size
    q = config.loss.anchors * drafter.block_size * rows
    kv_dim = drafter.num_key_value_heads * drafter.head_dim
    # One layer's transient at row length: MLP gate/up/act and attention q/k/v/out; on a
    # hybrid target the largest of that and a linear-attention layer's.
    per_token = (3 * inter + 6 * h) * dtype_bytes
    if linear_layer_ids(target_config):
        per_token = max(per_token, linear_attention_bytes_per_token(text, dtype_bytes))
    # Soft labels: k int64 ids + k fp32 probabilities per trained slot of a row (the target's
    # top-k runs inside its label chunk).
    soft = config.loss.soft_top_k if config.loss.labels == "soft" else 0
    slots = config.loss.anchors * (drafter.block_size - 1) * target_rows
    soft_labels = {"soft labels (top-k ids + fp32 probs)": float(slots * soft * (8 + 4))}
    # The target's labels (`TargetHead.labels_at`): a chunk of logits in the target dtype and
    # its scaled copy (softcap / multiplier), in the target forward only.
    chunk = 2.0 * config.loss.chunk_rows * text.vocab_size * dtype_bytes
    target_labels = {"target label chunk (logits x2)": chunk}
    # Targets whose attention is not flex (hybrids: transformers has none; or a configured
    # implementation) take the packed row's document mask dense: [T, T] booleans, and SDPA's
    # additive copy of it in the target dtype.
    dense = linear_layer_ids(target_config) or config.target.attn_implementation not in (
        None,
        "flex_attention",
        "varlen",
    )
    row = config.data.row_tokens
    mask = {"dense document mask [T, T] (sdpa)": float(target_rows * row * row * (1 + dtype_bytes))}
    # `drafter.residual_dtype = "float32"` under a 2-byte target: the norms' outputs are fp32,
    # and autocast saves a bf16 cast of them for each projection that reads one (the block's
    # q, k, v; gate, up). Measured with saved-tensor hooks under eager CPU autocast (a tiny
    # drafter at 2 and 4 layers): 10 more bytes per query token, hidden unit and layer, plus
    # 2 (the final norm). Compiled layers may save less.
    wider = config.drafter.residual_dtype == "float32" and dtype_bytes == 2
    residual = {"fp32 residual (casts saved)": (10 * drafter.num_hidden_layers + 2) * q * h}
    # Alive only in one phase of the step (module docstring); the rest is held throughout.
    phases = {
        "target activations": TARGET_PHASE,
        "target label chunk (logits x2)": TARGET_PHASE,
        "dense document mask [T, T] (sdpa)": TARGET_PHASE,
        "drafter activations (A*B queries)": DRAFTER_PHASE,
        "drafter context K/V (row length)": DRAFTER_PHASE,
        "LM head chunk (fp32 logits x3)": DRAFTER_PHASE,
        "fp32 residual (casts saved)": DRAFTER_PHASE,
    }
    terms = {
        "target weights": target_param_bytes(target_config, dtype_bytes) / shards,
        "target activations": t_target * per_token,
        **(target_labels if config.loss.labels != "data" else {}),
        "taps + last hidden state": t_target * h * (drafter.num_taps + 1) * dtype_bytes,
        "drafter weights+grads+AdamW (fp32)": drafter_params * 16.0,
        "drafter bf16 weight copies": drafter_params * 2.0,
        "drafter activations (A*B queries)": (
            q * drafter.num_hidden_layers * DRAFTER_ACT_BYTES * (h + drafter.intermediate_size)
        ),
        "drafter context K/V (row length)": t
        * (drafter.num_hidden_layers * 6 * kv_dim * 4 + 8 * h),
        "LM head chunk (fp32 logits x3)": 3.0 * config.loss.chunk_rows * drafter.vocab_size * 4,
        **(soft_labels if soft else {}),
        **(mask if dense else {}),
        **(residual if wider else {}),
    }
    return MemoryEstimate(terms, {k: v for k, v in phases.items() if k in terms})


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
    shards = 1
    if config.parallel.shard_target and torch.distributed.is_initialized():
        shards = torch.distributed.get_world_size()
    result = estimate(config, drafter, target_config, drafter_params, shards)
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
            "head), drafter.num_layers; or shard the "
            "target (parallel.shard_target) / use parallel.placement = 'split'. "
            "Set preflight = false to try anyway."
        )
    return result
