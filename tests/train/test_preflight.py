"""The memory estimate: it grows with what the run config asks for, and refuses a run that
cannot fit with the numbers and what to change."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from flashdraft.model.config import DrafterConfig
from flashdraft.train import preflight
from flashdraft.train.config import load_run_config


@pytest.fixture
def setup(tiny_qwen3_dir):
    target = AutoConfig.from_pretrained(tiny_qwen3_dir)
    config = load_run_config(
        None, ["output=x", f"target.path={tiny_qwen3_dir}", 'data.datasets=["z"]']
    )
    drafter = DrafterConfig.from_target_config(target, mask_token_id=151669)
    return config, drafter, target


def test_preflight_refuses_a_run_that_cannot_fit(monkeypatch, setup) -> None:
    config, drafter, target = setup
    small = preflight.estimate(config, drafter, target, 10**6)
    config.loss.anchors *= 4
    assert preflight.estimate(config, drafter, target, 10**6).total > small.total
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (small.total / 2, 80 * 2**30)
    )
    with pytest.raises(ValueError, match=r"loss\.anchors \(drafter activations\)"):
        preflight.check(config, drafter, target, 10**6, torch.device("cuda"))
    # A target already loaded on the GPU is in use, not free: its bytes are not asked twice.
    big = preflight.estimate(config, drafter, target, 10**6)
    weights = big.terms["target weights"]
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (big.total - weights / 2, 80 * 2**30)
    )
    with pytest.raises(ValueError, match="loaded already"):
        preflight.check(config, drafter, target, 10**6, torch.device("cuda"), resident=weights / 4)
    preflight.check(config, drafter, target, 10**6, torch.device("cuda"), resident=weights)


def test_each_term_follows_its_setting(setup) -> None:
    config, drafter, target = setup
    base = preflight.estimate(config, drafter, target, 10**6).terms
    sharded = preflight.estimate(config, drafter, target, 10**6, shards=4).terms
    counts = preflight.sizes(target, drafter)
    whole = (counts.target_layers / 4 + counts.target_rest) * 2  # target.dtype auto: bf16
    assert sharded["target weights (layers / 4)"] == pytest.approx(whole)
    assert base["target weights"] == (counts.target_layers + counts.target_rest) * 2
    config.data.row_tokens *= 2
    longer = preflight.estimate(config, drafter, target, 10**6).terms
    layer = "target layer transient (largest layer)"
    assert longer[layer] == pytest.approx(2 * base[layer])
    assert longer["drafter activations (A*B queries)"] == base["drafter activations (A*B queries)"]
    bigger = preflight.estimate(config, drafter, target, 2 * 10**6).terms
    assert bigger["drafter weights (fp32)"] == 2 * 4.0 * 10**6
    assert bigger["optimizer state (adamw)"] == 2 * 8.0 * 10**6
    assert "needed" in preflight.estimate(config, drafter, target, 10**6).table()
    # Rows stacked in one forward: every per-forward term doubles, the weights do not.
    config.data.row_tokens //= 2
    config.optim.grad_accum = config.optim.rows_per_forward = 2
    stacked = preflight.estimate(config, drafter, target, 10**6).terms
    for term in (layer, "drafter activations (A*B queries)"):
        assert stacked[term] == pytest.approx(2 * base[term]), term
    assert stacked["target weights"] == base["target weights"]
    head = "LM head chunk"
    assert stacked[head] == base[head]
    # Two micro-batches a step, one forward each: the gradients live across them.
    config.optim.rows_per_forward = 1
    accum = preflight.estimate(config, drafter, target, 10**6).terms
    assert accum["drafter gradients (fp32, across micro-batches)"] == 4.0 * 10**6
    config.optim.rows_per_forward = 2
    # The target running ahead over 8 rows: its own terms and the held taps grow 8x (of one
    # row), the drafter's stay at its forward's 2 rows.
    config.target.forward_rows = 8
    ahead = preflight.estimate(config, drafter, target, 10**6).terms
    for term in (layer, "taps + last hidden state"):
        assert ahead[term] == pytest.approx(8 * base[term]), term
    drafter_term = "drafter activations (A*B queries)"
    assert ahead[drafter_term] == stacked[drafter_term]
    # An fp32 residual stream under the bf16 target: what autocast saves more, in the drafter
    # step (the count itself: test_drafter's saved-tensor test); with an fp32 target nothing.
    wide = "fp32 residual (casts saved)"
    assert wide not in ahead
    config.drafter.residual_dtype = "float32"
    wider = preflight.estimate(config, drafter, target, 10**6)
    queries = config.loss.anchors * drafter.block_size * 2
    per_query = 10 * drafter.num_hidden_layers + 2
    assert wider.terms[wide] == per_query * queries * drafter.hidden_size
    assert wider.phases[wide] == preflight.DRAFTER_PHASE
    config.target.dtype = "float32"
    assert wide not in preflight.estimate(config, drafter, target, 10**6).terms


def test_on_the_cpu_nothing_is_refused(setup) -> None:
    config, drafter, target = setup
    config.loss.anchors = 10**6
    estimate = preflight.check(config, drafter, target, 10**6, torch.device("cpu"))
    assert estimate.total > 0


def qwen3_6_27b_text_config():
    """The text geometry of Qwen3.5-27B / Qwen3.6-27B (model card, research notes)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
    )  # fmt: skip


def test_a_hybrid_target_is_estimated_with_its_linear_attention_layers(setup) -> None:
    """Qwen3.6-27B: 26.9 B parameters on the meta device; one Gated DeltaNet layer's
    transient (~193 KB per token in bf16) outweighs the MLP's (166 KB), and is what the
    activation term scales with."""
    config, _, _ = setup
    target = qwen3_6_27b_text_config()
    drafter = DrafterConfig.from_target_config(target, mask_token_id=248070)
    terms = preflight.estimate(config, drafter, target, 10**9).terms
    assert terms["target weights"] == 2 * 26_895_998_464
    per_token = preflight.linear_attention_bytes_per_token(target, 2)
    # (1) 2 x (10240 + 3 x 6144) + (2) 4 x (2 x 6144 + 6144 + 96) + (3) 2 x 12288 + (4) 4 x 9216
    assert per_token == 2 * 28672 + 4 * 18528 + 2 * 12288 + 4 * 9216
    assert per_token > 2 * (3 * 17408 + 6 * 5120)
    assert terms["target layer transient (largest layer)"] == config.data.row_tokens * per_token


def test_the_linear_layers_hold_one_qkv_copy_and_their_chunk_states_in_the_target_dtype() -> None:
    """The projection before the convolution is freed when it returns (inference mode), and
    fla keeps the per-chunk states in the input dtype: in fp32 only (1) and (3) grow, by 2
    bytes per element, (2) and (4) are fp32 working copies either way."""
    target = qwen3_6_27b_text_config()
    bf16 = preflight.linear_attention_bytes_per_token(target, 2)
    fp32 = preflight.linear_attention_bytes_per_token(target, 4)
    qkv, gated, states = 10240, 3 * 6144, 48 * 128 * 128 / 64
    assert fp32 - bf16 == 2 * (qkv + gated + states)


def _hybrid_27b(rows: int, *settings: str):
    config = load_run_config(
        None,
        ["output=x", "target.path=x", 'data.datasets=["z"]', f"data.row_tokens={rows}",
         "loss.chunk_rows=2048", *settings],
    )  # fmt: skip
    target = qwen3_6_27b_text_config()
    drafter = DrafterConfig.from_target_config(target, mask_token_id=248319)
    return config, drafter, target


@pytest.mark.parametrize(
    ("rows", "measured", "phase"),
    [
        # benchmarks/hybrid_h200_20261201.md: the 27B-shaped hybrid + 5-layer drafter on an
        # H200; the target forward's 73.6 held one more row's taps for the drafter's timing.
        (8192, 85.4, preflight.DRAFTER_PHASE),
        (8192, 73.6 - 0.47, preflight.LABELS_PHASE),
        (16384, 86.2, preflight.DRAFTER_PHASE),
    ],
)
def test_the_27b_hybrid_is_predicted_within_3_percent_of_its_records(rows, measured, phase) -> None:
    config, drafter, target = _hybrid_27b(rows)
    est = preflight.estimate(config, drafter, target)
    assert est.peak_phase == preflight.DRAFTER_PHASE
    predicted = (est.held + est.phase_bytes(phase)) / 2**30
    assert abs(predicted - measured) / measured < 0.03, (predicted, measured)
    assert est.total == pytest.approx(est.peak * preflight.MARGIN)
    assert "peak (held + the drafter forward)" in est.table()


def test_the_target_forward_and_the_drafter_step_do_not_add_up() -> None:
    """The target's packed forward (inference mode) frees its transients before the drafter
    step starts: the peak holds the larger phase only."""
    config, drafter, target = _hybrid_27b(16384)
    est = preflight.estimate(config, drafter, target)
    phases = [
        preflight.TARGET_PHASE,
        preflight.LABELS_PHASE,
        preflight.DRAFTER_PHASE,
        preflight.BACKWARD_PHASE,
        preflight.OPTIMIZER_PHASE,
    ]
    assert est.peak == pytest.approx(est.held + max(est.phase_bytes(p) for p in phases))
    assert est.peak < est.held + sum(est.phase_bytes(p) for p in phases)
    # Few anchors and long rows: the target's forward is the peak, the drafter's terms drop.
    config.loss.anchors, config.data.row_tokens = 8, 65536
    est = preflight.estimate(config, drafter, target)
    assert est.peak_phase == preflight.TARGET_PHASE
    # Labels from the data: no target label chunk.
    config.loss.labels = "data"
    assert "target label chunk (logits x2)" not in preflight.estimate(config, drafter, target).terms


def test_each_role_holds_its_own_terms() -> None:
    """A split target rank holds the target and the rows queued to its drafters; a split
    drafter rank the target's embedding and LM head, the drafter and the rows received; DDP
    adds its buckets, FSDP2 divides the drafter's state; checkpointing keeps the layers'
    inputs instead of their activations."""
    config, drafter, target = _hybrid_27b(8192)
    counts = preflight.sizes(target, drafter)
    colocated = preflight.estimate(config, drafter, target, counts=counts)
    t = preflight.estimate(config, drafter, target, role="target", consumers=2, counts=counts)
    d = preflight.estimate(config, drafter, target, role="drafter", replicas=2, counts=counts)
    assert "drafter weights (fp32)" not in t.terms and "target weights" in t.terms
    assert t.terms["rows queued to drafter ranks"] > 0
    assert "target weights" not in d.terms
    assert d.terms["target embedding + LM head"] == 2 * counts.target_head
    assert d.terms["DDP gradient buckets"] == counts.drafter * 4 * preflight.DDP_BUCKETS
    assert t.peak < colocated.peak and d.peak < colocated.peak
    config.parallel.drafter_sharding = "fsdp"
    fsdp = preflight.estimate(config, drafter, target, replicas=4, counts=counts)
    assert fsdp.terms["optimizer state (adamw)"] == colocated.terms["optimizer state (adamw)"] / 4
    assert "DDP gradient buckets" not in fsdp.terms
    config.drafter.activation_checkpointing = True
    ckpt = preflight.estimate(config, drafter, target, counts=counts)
    saved = ckpt.phase_bytes(preflight.DRAFTER_PHASE)
    assert saved < colocated.phase_bytes(preflight.DRAFTER_PHASE) - 5 * 2**30
    # Checkpointed, the drafter's peak moves to the end of its backward: every fp32
    # gradient exists by then, beside one layer's recomputed activations.
    assert colocated.peak_phase == preflight.DRAFTER_PHASE
    assert ckpt.peak_phase == preflight.BACKWARD_PHASE
    assert ckpt.terms["drafter gradients (fp32) by then"] == counts.drafter * 4
    assert "drafter activations at the first layer's backward" in ckpt.terms
    # Muon: half AdamW's state, but its step orthogonalises each shape's matrices as one
    # batch: the 10 gate and up projections [17408, 5120] of 5 layers, 22 bytes an element.
    config.drafter.activation_checkpointing = False
    config.parallel.drafter_sharding = "ddp"
    config.optim.optimizer = "muon"
    muon = preflight.estimate(config, drafter, target, counts=counts)
    assert muon.terms["optimizer state (muon)"] == counts.drafter * 4
    assert counts.drafter_matrix_group == 10 * 17408 * 5120
    assert muon.terms["Muon step (largest same-shape batch)"] == 22 * 10 * 17408 * 5120
    assert muon.peak_phase == preflight.OPTIMIZER_PHASE
    with pytest.raises(ValueError, match="role"):
        preflight.estimate(config, drafter, target, role="both", counts=counts)


def test_a_dense_document_mask_is_counted_where_the_target_takes_one(setup) -> None:
    """On CUDA every target, hybrids too, takes varlen (or flex) attention by default: no
    mask; a configured sdpa takes the row's mask dense."""
    config, drafter, target = setup
    name = "dense document mask [T, T] (sdpa)"
    assert name not in preflight.estimate(config, drafter, target, 10**6).terms
    hybrid = qwen3_6_27b_text_config()
    hybrid_drafter = DrafterConfig.from_target_config(hybrid, mask_token_id=248070)
    assert name not in preflight.estimate(config, hybrid_drafter, hybrid, 10**6).terms
    sdpa = load_run_config(
        None,
        ["output=x", "target.path=x", 'data.datasets=["z"]', 'target.attn_implementation="sdpa"'],
    )
    terms = preflight.estimate(sdpa, hybrid_drafter, hybrid, 10**6).terms
    t = config.data.row_tokens
    assert terms[name] == t * t * 3  # bool + bf16 additive copy
    assert name in preflight.estimate(sdpa, drafter, target, 10**6).terms
