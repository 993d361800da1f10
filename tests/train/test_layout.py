"""The memory plan: the layouts of a run on N GPUs of M GB, their predicted memory and
tokens/s, and the choice of `parallel.placement = "auto"`."""

from __future__ import annotations

import pytest
import torch
from test_preflight import qwen3_6_27b_text_config

from flashdraft.model.config import DrafterConfig
from flashdraft.train import layout, preflight
from flashdraft.train.config import load_run_config

GB = 2**30
BASE = ["output=x", "target.path=x", 'data.datasets=["z"]', "data.row_tokens=8192"]
# One row of the 27B-shaped hybrid on an H200 (benchmarks/hybrid_h200_20261201.md).
RECORDS = layout.Timings(0.9801, 0.2866, "records")


@pytest.fixture(scope="module")
def hybrid():
    target = qwen3_6_27b_text_config()
    drafter = DrafterConfig.from_target_config(target, mask_token_id=248319)
    return target, drafter, preflight.sizes(target, drafter)


def test_one_gpu_keeps_the_run_checkpoints_or_takes_an_fp8_target_as_memory_shrinks(
    hybrid,
) -> None:
    """The 27B-shaped run on one GPU: unchanged at 96 GB; at 84 GB its drafter checkpointed
    (the same training, one more forward of the layers); at 80 GB nothing that trains the
    same fits (a bf16 target, the drafter's fp32 weights, AdamW state and gradients alone
    are ~78 GB), and the target's forward in FP8 does, marked as changing what is trained."""
    target, drafter, counts = hybrid
    config = load_run_config(None, BASE)
    plain = 8192 / (RECORDS.target_s + RECORDS.drafter_s)
    roomy = layout.plan_layouts(config, drafter, target, 1, 96 * GB, RECORDS, counts).best
    assert roomy is not None and roomy.layout == layout.Layout("colocated")
    assert roomy.tokens_per_s == pytest.approx(plain)
    plan = layout.plan_layouts(config, drafter, target, 1, 84 * GB, RECORDS, counts)
    best = plan.best
    assert best is not None and best.layout.placement == "colocated"
    assert best.layout.checkpointing and not best.layout.changes_training(config)
    assert best.memory["colocated"].total <= 84 * GB < roomy.memory["colocated"].total
    assert best.tokens_per_s < plain  # checkpointing: one more forward of the draft layers
    # The layout as its overrides say, read back as a run config: the same estimate.
    again = load_run_config(None, BASE + best.layout.overrides(config))
    assert again == best.layout.apply(config)
    assert preflight.estimate(again, drafter, target, counts=counts).peak == best.peak
    tight = layout.plan_layouts(config, drafter, target, 1, 80 * GB, RECORDS, counts)
    assert tight.best is not None and tight.best.layout.target_fp8
    assert tight.best.layout.changes_training(config) and " *" in tight.table()
    assert not any(c.fits for c in tight.candidates if not c.layout.changes_training(config))


def test_the_seeds_four_96_gb_cards_colocate_rather_than_split(hybrid) -> None:
    """The seed's 2 target + 2 drafter ranks fit but are target-bound: two target forwards
    feed the drafters, where four colocated ranks each run both."""
    target, drafter, counts = hybrid
    config = load_run_config(None, BASE)
    plan = layout.plan_layouts(config, drafter, target, 4, 96 * GB, RECORDS, counts)
    best = plan.best
    assert best is not None and best.layout.placement == "colocated"
    split = next(c for c in plan.candidates if c.layout == layout.Layout("split", 2))
    assert split.fits and set(split.memory) == {"target", "drafter"}
    assert split.tokens_per_s == pytest.approx(
        2 * 8192 / (RECORDS.target_s + 8192 * 5120 * 5 * 2 / layout.P2P_BYTES_PER_S)
    )
    assert best.tokens_per_s > 1.4 * split.tokens_per_s
    # Four replicas: at most 4x one GPU, less the gradients' traffic.
    one = 8192 / (RECORDS.target_s + RECORDS.drafter_s)
    assert 3.8 * one < best.tokens_per_s < 4 * one


def test_nothing_fits_says_so_and_auto_refuses(hybrid) -> None:
    target, drafter, counts = hybrid
    config = load_run_config(None, BASE)
    plan = layout.plan_layouts(config, drafter, target, 1, 40 * GB, RECORDS, counts)
    assert plan.best is None and "nothing fits" in plan.table()
    with pytest.raises(ValueError, match="no layout of this run fits 1 GPU"):
        layout.resolve_auto(config, target, drafter, 1, 40 * GB)
    # On the CPU (no memory bound) `auto` keeps the run as configured.
    capacity = layout.device_capacity(torch.device("cpu"))
    resolved, _ = layout.resolve_auto(config, target, drafter, 1, capacity)
    assert resolved.parallel.placement == "colocated" and resolved.data == config.data


def test_every_layout_is_a_valid_run_config() -> None:
    """Each layout's overrides load as a run config (the config's own checks pass: no FP8
    target sharded, no Muon on FSDP2, no target running ahead in the split placement)."""
    split = ['parallel.placement="split"', "parallel.target_ranks=2"]
    for settings in ([], ['optim.optimizer="muon"', "target.forward_rows=2"], split):
        config = load_run_config(None, [*BASE, *settings])
        for lay in layout.layouts(config, 4):
            assert load_run_config(None, BASE + settings + lay.overrides(config)) == lay.apply(
                config
            ), lay


def test_muon_is_never_sharded_and_split_keeps_one_target_row() -> None:
    config = load_run_config(None, [*BASE, 'optim.optimizer="muon"', "target.forward_rows=2"])
    kinds = layout.layouts(config, 4)
    assert all(lay.drafter_sharding == "ddp" for lay in kinds)
    splits = [lay for lay in kinds if lay.placement == "split"]
    assert {lay.target_ranks for lay in splits} == {1, 2}
    assert splits[0].apply(config).target.forward_rows == 1
    shorter = layout.Layout("colocated", row_divisor=2).apply(config)
    assert shorter.data.row_tokens == 4096 and shorter.loss.anchors == 256
    assert shorter.optim.grad_accum == 2 * config.optim.grad_accum


def test_train_plan_measures_a_step_here_and_prints_the_layouts(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys
) -> None:
    """`flashdraft train --plan` on the CPU: one short step of the tiny run measured, the
    plan for 4 GPUs of 96 GB from it; `--no-plan-measure` plans from FLOP estimates."""
    from helpers import train_settings

    from flashdraft import cli

    settings = train_settings(tmp_path / "run", tiny_qwen3_dir, qwen_data, **{"loss.anchors": 4})
    plan = ["--plan", "--plan-gpus", "4", "--plan-gb", "96"]
    assert cli.main(["train", *settings, *plan]) == 0
    out = capsys.readouterr().out
    assert "memory plan: 4 GPU(s) of 96.0 GB; times of one row measured on cpu" in out
    assert "split 2 target + 2 drafter" in out
    assert 'chosen: --set parallel.placement="colocated"' in out
    assert "a colocated GPU" in out and "optimizer state (adamw)" in out  # its terms
    assert not (tmp_path / "run" / "export").exists()  # a plan trains nothing
    assert cli.main(["train", *settings, *plan, "--no-plan-measure"]) == 0
    assert "estimated from FLOPs" in capsys.readouterr().out


def test_the_speed_model_reproduces_the_two_gpu_record() -> None:
    """benchmarks/parallel_h200x2_202611.md, the 8B-shaped target + 5-layer drafter at 8192
    rows, 2 rows a step per replica: one GPU 917.6 ms a step, of which the drafter 2 x 171 ms
    (the trainer bench's), so the target ~288 ms a row. Colocated on two GPUs (DDP over the
    4.2 GB of fp32 gradients) the step measured 933-939 ms; split 1 + 1, 538-557 ms."""
    from transformers import Qwen3Config

    target = Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    )  # fmt: skip
    drafter = DrafterConfig.from_target_config(target, mask_token_id=151935)
    counts = preflight.sizes(target, drafter)
    config = load_run_config(None, [*BASE, "optim.grad_accum=2"])
    timings = layout.Timings(0.9176 / 2 - 0.171, 0.171, "records")
    rows = 8192

    def step_ms(lay: layout.Layout, rows_per_step: int) -> float:
        speed = layout.throughput(lay, config, drafter, counts, timings, 2)
        return rows_per_step / (speed / rows) * 1e3

    assert 933 * 0.97 < step_ms(layout.Layout("colocated"), 4) < 939 * 1.03
    assert 538 < step_ms(layout.Layout("split", 1), 2) < 557 * 1.08
