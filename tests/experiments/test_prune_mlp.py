"""experiments/prune_mlp.py: a drafter's MLPs cut to the neurons of the largest score, everything
else unchanged; the narrow export loads and drafts like the wide one minus those neurons."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from helpers import script_modules, tiny_drafter

from flashdraft.export.dflash import load_dflash, save_dflash

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prune() -> ModuleType:
    return script_modules("experiments", "prune_mlp")["prune_mlp"]


def test_keeping_every_neuron_is_the_same_drafter(prune: ModuleType) -> None:
    drafter = tiny_drafter()
    width = drafter.config.intermediate_size
    same = prune.narrow(drafter, [torch.arange(width)] * drafter.config.num_hidden_layers)
    wide, narrow = drafter.state_dict(), same.state_dict()
    assert list(wide) == list(narrow)
    for name, tensor in wide.items():
        assert torch.equal(tensor, narrow[name]), name


def test_a_narrow_mlp_is_the_wide_one_without_the_dropped_neurons(prune: ModuleType) -> None:
    drafter = tiny_drafter()
    keep = [torch.tensor([0, 3, 7, 8, 20, 63]), torch.tensor([1, 2, 5, 40, 41, 62])]
    narrow = prune.narrow(drafter, keep)
    assert narrow.config.intermediate_size == 6
    x = torch.randn(3, 5, drafter.config.hidden_size)
    for wide, thin, k in zip(drafter.layers, narrow.layers, keep, strict=True):
        mask = torch.zeros(drafter.config.intermediate_size)
        mask[k] = 1
        act = F.silu(wide.mlp.gate_proj(x)) * wide.mlp.up_proj(x) * mask
        torch.testing.assert_close(thin.mlp(x), wide.mlp.down_proj(act))
        assert torch.equal(thin.input_layernorm.weight, wide.input_layernorm.weight)
    with pytest.raises(ValueError, match="as many neurons"):
        prune.narrow(drafter, [torch.arange(4), torch.arange(5)])


def test_activation_scores_are_the_rms_activation_times_the_output_norm(
    prune: ModuleType,
) -> None:
    drafter = tiny_drafter()
    xs = [torch.randn(2, 7, drafter.config.hidden_size) for _ in range(3)]

    def run() -> None:
        for x in xs:
            for layer in drafter.layers:
                layer.mlp(x)

    scores = prune.activation_scores(drafter, run)
    for layer, score in zip(drafter.layers, scores, strict=True):
        act = torch.cat(
            [(F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x)).reshape(-1, 64) for x in xs]
        )
        want = act.pow(2).mean(0).sqrt() * layer.mlp.down_proj.weight.norm(dim=0)
        torch.testing.assert_close(score, want.detach())
    assert not any(layer.mlp.down_proj._forward_pre_hooks for layer in drafter.layers)
    with pytest.raises(RuntimeError, match="drafted nothing"):
        prune.activation_scores(drafter, lambda: None)


def test_the_top_neurons_are_the_largest_scores_in_order(prune: ModuleType) -> None:
    scores = [torch.tensor([0.5, 3.0, 0.1, 2.0]), torch.tensor([9.0, 1.0, 8.0, 0.0])]
    picked = prune.top_neurons(scores, 2)
    assert [p.tolist() for p in picked] == [[1, 3], [0, 2]]
    with pytest.raises(ValueError, match="--width 5"):
        prune.top_neurons(scores, 5)


@pytest.mark.slow  # the experiments' tests stay under a minute together
def test_the_script_writes_a_narrow_export_that_loads(tmp_path: Path) -> None:
    save_dflash(tiny_drafter(), str(tmp_path / "wide"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "prune_mlp.py"), "--drafter",
         str(tmp_path / "wide"), "--width", "16", "--output", str(tmp_path / "narrow")],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == "prune-mlp" and result["scores"] == "weight"
    assert len(result["kept_score_share"]) == 2
    assert all(0.25 < share < 1 for share in result["kept_score_share"])
    narrow = load_dflash(str(tmp_path / "narrow"))
    assert narrow.config.intermediate_size == 16
    assert narrow.layers[0].mlp.down_proj.weight.shape == (32, 16)


def test_the_calibration_mix_takes_the_first_prompt_of_each_source_per_kind(
    prune: ModuleType,
) -> None:
    records = [
        {"id": "c1", "kind": "chat", "source": "conv-a"},
        {"id": "x1", "kind": "code", "source": "f.py"},
        {"id": "c2", "kind": "chat", "source": "conv-a"},  # a second turn of conv-a: skipped
        {"id": "x2", "kind": "code", "source": "f.py"},
        {"id": "h1", "kind": "humaneval", "source": "HumanEval/3"},
        {"id": "c3", "kind": "chat", "source": "conv-b"},
        {"id": "x3", "kind": "code", "source": "g.py"},
        {"id": "c4", "kind": "chat", "source": "conv-c"},  # over chat's count
        {"id": "x4", "kind": "code", "source": "h.py"},
    ]
    mix = prune.parse_mix("chat=2, code=3")
    assert mix == {"chat": 2, "code": 3}
    picked = prune.calibration_prompts(records, mix)
    assert [r["id"] for r in picked] == ["c1", "x1", "c3", "x3", "x4"]  # kinds take turns
    with pytest.raises(ValueError, match=re.escape("too few sources for {'humaneval': 1}")):
        prune.calibration_prompts(records, {"humaneval": 2})
    for bad in ("chat", "chat=0", "chat=two", ""):
        with pytest.raises(ValueError, match="--mix"):
            prune.parse_mix(bad)


@pytest.mark.slow  # the experiments' tests stay under a minute together
def test_the_mix_needs_a_calibration_file(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "prune_mlp.py"), "--drafter", str(tmp_path),
         "--width", "16", "--output", str(tmp_path / "narrow"), "--mix", "chat=1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--mix picks from --calibration" in done.stderr.strip().splitlines()[-1]
