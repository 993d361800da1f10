"""A resume trains on the data the run started on: the prepared datasets are identified by
content (their manifests' `content_sha256`), recorded in the run config and compared on
`--resume` like every guarded key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import tiny_drafter, train_settings

from flashdraft.data.dataset import dataset_identity, open_dataset, write_dataset
from flashdraft.train.checkpoint import save_checkpoint
from flashdraft.train.config import load_run_config
from flashdraft.train.parallel import DistInfo
from flashdraft.train.plan import CONFIG_CHANGES, plan_run

ONE = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
# the mask token the tokenizer would give, set: no tokenizer load (2 s a plan here)
FAST = {"optim.max_steps": 5, "drafter.mask_token_id": 151669}


def _checkpoint(run, step: int) -> None:
    drafter = tiny_drafter()
    optimizer = torch.optim.AdamW(drafter.parameters())
    state = {"cursor": step, "rows_per_step": 1}
    save_checkpoint(str(run), step, drafter, optimizer, state, keep=5, is_main=True)


def test_a_resume_on_data_prepared_again_in_place_is_refused_in_one_line(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    """`prepare --overwrite` into the run's dataset (here: half of its samples) between two
    sessions: the resume names the dataset and both identities, writes nothing; with
    --allow-config-change it goes on, recorded. The same data copied elsewhere would be
    the same identity (what it holds, not where)."""
    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(qwen_data, data)
    settings = train_settings(run, tiny_qwen3_dir, data, **FAST)
    config = load_run_config(None, settings[1::2])
    before = dataset_identity(str(data))
    plan_run(config, ONE, resume=False)
    assert json.loads((run / "run_config.json").read_text())["data"]["content_sha256"] == [before]
    _checkpoint(run, 2)

    dataset = open_dataset(str(data))
    half = [(*dataset.sample(i), dataset.source(i)) for i in range(len(dataset) // 2)]
    write_dataset(str(data), half)  # prepared again, in place
    now = dataset_identity(str(data))
    recorded = (run / "run_config.json").read_bytes()
    with pytest.raises(ValueError) as refused:
        plan_run(config, ONE, resume=True)
    assert str(refused.value) == (
        f"--resume: the data of {run} changed since the run started: {data} ({before[:12]} "
        f"when the run started, {now[:12]} now) hold other samples (prepared again?); resume "
        "on the data the run started on, choose a new output, or pass --allow-config-change "
        "to go on with this data"
    )
    assert (run / "run_config.json").read_bytes() == recorded

    assert plan_run(config, ONE, resume=True, allow_config_change=True).start_step == 2
    (change,) = [json.loads(x) for x in (run / CONFIG_CHANGES).read_text().splitlines()]
    assert change["changes"] == {"data.content_sha256": [[before], [now]]}
    assert change["forced"] == ["data.content_sha256"]


def test_a_config_naming_other_data_is_refused_and_an_earlier_run_is_not_checked(
    tmp_path, tiny_qwen3_dir, qwen_data, caplog
) -> None:
    run = tmp_path / "run"
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **FAST)
    named = load_run_config(None, [*settings[1::2], 'data.content_sha256=["0123456789abcdef"]'])
    with pytest.raises(ValueError, match=r"data\.content_sha256 names other data than"):
        plan_run(named, ONE, resume=False)
    config = load_run_config(None, settings[1::2])
    run.mkdir()  # a run of an earlier version: its recorded config has no identity
    earlier = config.to_dict()
    del earlier["data"]["content_sha256"]
    (run / "run_config.json").write_text(json.dumps(earlier))
    _checkpoint(run, 2)
    assert plan_run(config, ONE, resume=True).start_step == 2
    assert "recorded no data identity" in caplog.text
