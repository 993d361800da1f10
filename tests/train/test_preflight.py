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
    with pytest.raises(ValueError, match=r"lower loss\.anchors"):
        preflight.check(config, drafter, target, 10**6, torch.device("cuda"))


def test_each_term_follows_its_setting(setup) -> None:
    config, drafter, target = setup
    base = preflight.estimate(config, drafter, target, 10**6).terms
    sharded = preflight.estimate(config, drafter, target, 10**6, shards=4).terms
    assert sharded["target weights"] == pytest.approx(base["target weights"] / 4)
    config.data.row_tokens *= 2
    longer = preflight.estimate(config, drafter, target, 10**6).terms
    assert longer["target activations"] == pytest.approx(2 * base["target activations"])
    assert longer["drafter activations (A*B queries)"] == base["drafter activations (A*B queries)"]
    bigger = preflight.estimate(config, drafter, target, 2 * 10**6).terms
    assert bigger["drafter weights+grads+AdamW (fp32)"] == 2 * 16.0 * 10**6
    assert "total" in preflight.estimate(config, drafter, target, 10**6).table()


def test_on_the_cpu_nothing_is_refused(setup) -> None:
    config, drafter, target = setup
    config.loss.anchors = 10**6
    estimate = preflight.check(config, drafter, target, 10**6, torch.device("cpu"))
    assert estimate.total > 0
