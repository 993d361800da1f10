"""config.json as the engines read it (trap 9): the engine check catches every field an
engine would read differently."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_config, tiny_drafter

from flashdraft.export.artifact import verify_export
from flashdraft.export.dflash import save_dflash
from flashdraft.export.engine import check_engine_config, engine_view
from flashdraft.export.speculators import save_speculators

MIXED = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}


@pytest.mark.parametrize("overrides", [{}, MIXED], ids=["full", "mixed"])
def test_the_engines_read_the_dflash_export_as_trained(tmp_path, overrides) -> None:
    config = tiny_config(**overrides)
    save_dflash(tiny_drafter(config), str(tmp_path))
    check_engine_config(str(tmp_path), config)
    view = engine_view(str(tmp_path))
    assert view["causal"] == [t == "sliding_attention" for t in config.layer_types]
    assert view["sliding_window"] == config.sliding_window
    # transformers 4.x: no rope_parameters, only rope_theta / rope_scaling.
    data = json.loads((tmp_path / "config.json").read_text())
    del data["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    check_engine_config(str(tmp_path), config)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"is_causal": True}, "causal"),  # z-lab and vLLM apply it to every layer
        ({"use_sliding_window": False}, "sliding_window"),  # Qwen3Config then drops the window
        ({"sliding_window": 4}, "sliding_window"),
        ({"rope_theta": 5.0}, "rope_theta"),
        ({"head_dim": 4}, "head_dim"),
        ({"layer_types": ["full_attention"] * 2}, "layer_types"),
        ({"dflash_config": {"mask_token_id": 96, "target_layer_ids": [2, 4]}}, "target_layer_ids"),
    ],
)
def test_the_engine_check_names_a_field_the_engines_would_read_differently(
    tmp_path, change, field
) -> None:
    config = tiny_config(**MIXED)
    save_dflash(tiny_drafter(config), str(tmp_path))
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, **change}))
    with pytest.raises(ValueError, match=f"engines read.*{field}|{field}: engines read"):
        check_engine_config(str(tmp_path), config)


def test_the_engine_check_reads_speculators_through_vllms_adapter(tmp_path) -> None:
    drafter = tiny_drafter()
    save_speculators(drafter, str(tmp_path), verifier="some/target")
    check_engine_config(str(tmp_path), drafter.config)
    assert engine_view(str(tmp_path))["causal"] == [False, False]
    data = json.loads((tmp_path / "config.json").read_text())
    data["sliding_window_non_causal"] = False  # what older flashdraft exports wrote
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"causal: engines read \[True, True\]"):
        verify_export(drafter, str(tmp_path))
