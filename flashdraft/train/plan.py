"""What a run is before anything heavy is loaded: the plan every rank agrees on, the
drafter's geometry, and the one builder of the initial drafter.

`plan_run` decides, identically on every rank, the placement (which rank runs what), the
drafter config (from the target's config), the packed-row stream, the number of steps and
the resume point: the newest checkpoint that verifies, resumed only with settings the run
may change to (`train.config.resume_changes`; every change is recorded in the run).
`initial_drafter` is the drafter a run starts from (seeded init or a warm start from a
serving export); the demo builds its "untrained" baseline with it too, so the baseline is
by construction the trainer's step-0 drafter.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from flashdraft import storage
from flashdraft.data.dataset import dataset_identity, open_datasets
from flashdraft.export import load_dflash
from flashdraft.log import get_logger
from flashdraft.model.config import DrafterConfig, choose_mask_token_id, text_config
from flashdraft.model.drafter import DFlashDrafter, init_seeded
from flashdraft.model.hub import model_errors
from flashdraft.train.checkpoint import latest_checkpoint, set_aside, usable_checkpoint
from flashdraft.train.config import LEGACY_RUN_CONFIG, RUN_CONFIG, RunConfig, resume_changes
from flashdraft.train.packing import RowStream
from flashdraft.train.parallel import DistInfo, Placement, assign_placement, barrier

log = get_logger(__name__)

CONFIG_CHANGES = "run_config_changes.jsonl"  # one line per resume that changed the config


def load_target_config(path: str) -> Any:
    """The target's HF config (no weights read)."""
    from transformers import AutoConfig

    with model_errors(path, "target.path"):
        return AutoConfig.from_pretrained(path, trust_remote_code=False)


def build_drafter_config(config: RunConfig, target_config: Any) -> tuple[DrafterConfig, str]:
    """Drafter geometry from the target and the run config; returns (config, mask note)."""
    section = config.drafter
    if section.mask_token_id is not None:
        mask_id, why = section.mask_token_id, "set in the run config"
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.target.path)
        mask_id, why = choose_mask_token_id(target_config, tokenizer)
    drafter_config = DrafterConfig.from_target_config(
        target_config,
        mask_token_id=mask_id,
        num_layers=section.num_layers,
        block_size=section.block_size,
        target_layer_ids=section.target_layer_ids,
        sliding_window=section.sliding_window,
        sliding_layers=section.sliding_layers,
        intermediate_size=section.intermediate_size,
    )
    return drafter_config, why


def initial_drafter(
    config: RunConfig, drafter_config: DrafterConfig, *, resuming: bool = False
) -> DFlashDrafter:
    """The drafter a run starts from, fp32 on the CPU: seeded (`drafter.init_seed`, else the
    run seed) or warm-started from `drafter.init_from`, whose taps, hidden size, depth and
    MLP width must be the run's. `resuming`: every weight comes from the checkpoint next, so
    the warm start is not read (its folder may be gone by then)."""
    seed = config.seed if config.drafter.init_seed is None else config.drafter.init_seed
    if config.drafter.init_from is None or resuming:
        return init_seeded(drafter_config, seed)
    warm = load_dflash(config.drafter.init_from, dtype=torch.float32)
    if warm.config.target_layer_ids != drafter_config.target_layer_ids or (
        warm.config.hidden_size != drafter_config.hidden_size
    ):
        raise ValueError(
            f"drafter.init_from {config.drafter.init_from}: its taps "
            f"{warm.config.target_layer_ids} / hidden {warm.config.hidden_size} do not match "
            f"this target ({drafter_config.target_layer_ids} / {drafter_config.hidden_size})"
        )
    shape = (warm.config.num_hidden_layers, warm.config.intermediate_size)
    if shape != (drafter_config.num_hidden_layers, drafter_config.intermediate_size):
        raise ValueError(
            f"drafter.init_from {config.drafter.init_from}: {shape[0]} layers of MLP {shape[1]}, "
            f"the run's drafter {drafter_config.num_hidden_layers} of "
            f"{drafter_config.intermediate_size}: set drafter.num_layers={shape[0]} "
            f"drafter.intermediate_size={shape[1]}"
        )
    return warm


@dataclass(slots=True)
class RunPlan:
    """What every rank of a run agrees on before any weight is loaded."""

    config: RunConfig
    info: DistInfo
    placement: Placement
    target_config: Any
    drafter_config: DrafterConfig
    mask_note: str
    stream: RowStream
    dataset: Any
    total_rows: int
    total_steps: int
    start_step: int
    start_cursor: int
    resume_from: str | None
    planned_s: float  # what planning took: the target's config, the data, the rows

    @property
    def rows_per_step(self) -> int:
        return self.placement.dp_world * self.config.optim.grad_accum

    @property
    def rows_left(self) -> int:
        """Rows each drafter replica still trains on (its share of the remaining steps)."""
        return (self.total_steps - self.start_step) * self.config.optim.grad_accum

    def positions(self, dp_rank: int) -> Iterator[int]:
        """Stream positions of dp replica `dp_rank`'s rows, step after step, from the cursor."""
        g = self.config.optim.grad_accum
        base = self.start_cursor
        for _ in range(self.start_step, self.total_steps):
            for m in range(g):
                yield base + dp_rank * g + m
            base += self.rows_per_step


def _row_stream(config: RunConfig, dataset: Any, block_size: int, target_config: Any) -> RowStream:
    return RowStream(
        dataset.num_tokens,
        dataset.sample,
        row_tokens=config.data.row_tokens,
        num_anchors=config.loss.anchors,
        block_size=block_size,
        seed=config.seed,
        epochs=config.optim.epochs,
        overlong=config.data.overlong,
        shuffle=config.data.shuffle,
        pad_id=int(getattr(text_config(target_config), "pad_token_id", None) or 0),
    )


def previous_run_config(run: str) -> dict[str, Any] | None:
    """The resolved config a run recorded: `run_config.json`, or the `config.json` of runs
    written before it had its own name (a run config: it has a `target` table)."""
    for name in (RUN_CONFIG, LEGACY_RUN_CONFIG):
        url = storage.join(run, name)
        if storage.exists(url):
            data = storage.read_json(url)
            if isinstance(data, dict) and (
                name == RUN_CONFIG or isinstance(data.get("target"), dict)
            ):
                return data
    return None


def _resume_point(
    config: RunConfig, resume: bool | str
) -> tuple[str | None, list[tuple[str, str]]]:
    """(the checkpoint to resume from, the newer ones skipped with why). Refuses to start
    over a run that has checkpoints without --resume, a --resume with none usable, and a
    --resume with none at all (`resume="auto"`: then the run starts)."""
    existing = latest_checkpoint(config.output)
    if existing is None:
        if resume is True:
            raise FileNotFoundError(
                f"--resume: {config.output} has no checkpoint to resume from (none has a "
                "COMPLETE marker); run without --resume to start the run, or pass "
                "--resume=auto to resume when there is a checkpoint and start otherwise"
            )
        return None, []
    if not resume:
        raise FileExistsError(
            f"{config.output} already holds checkpoints (latest {existing}); pass --resume "
            "to continue that run or choose a new output"
        )
    found, skipped = usable_checkpoint(config.output)
    if found is None:
        why = "; ".join(f"{url}: {problem}" for url, problem in skipped)
        raise ValueError(
            f"--resume: no checkpoint of {config.output} is usable ({why}); move them away to "
            "start over in this output, or choose a new output"
        )
    return found, skipped


def with_data_identity(config: RunConfig) -> RunConfig:
    """`config` with `data.content_sha256`: what each prepared dataset holds (its manifest's
    content fingerprint, read without the data). A config that names it already (a run's
    recorded config used again) must name what the datasets hold now."""
    found = [dataset_identity(url) for url in config.data.datasets]
    named = config.data.content_sha256
    if named is not None and named != found:
        raise ValueError(
            f"data.content_sha256 names other data than {', '.join(config.data.datasets)} "
            f"hold{'s' if len(found) == 1 else ''} now ({_short(named)} named, {_short(found)} "
            "found): it was prepared again; drop data.content_sha256 from the config to train "
            "on this data"
        )
    data = dataclasses.replace(config.data, content_sha256=found)
    return dataclasses.replace(config, data=data)


def _short(digests: list[str]) -> str:
    return ", ".join(d[:12] for d in digests)


def _check_data_identity(config: RunConfig, previous: dict[str, Any], allow: bool) -> None:
    """Refuse a resume on data that holds other samples than the run trained on (a dataset
    prepared again in place); a run recorded before data identities is not checked."""
    data = previous.get("data")
    recorded = data.get("content_sha256") if isinstance(data, dict) else None
    now = config.data.content_sha256
    if now is None or not isinstance(data, dict):
        return
    if recorded is None:
        log.warning(
            f"{config.output} recorded no data identity (a run of an earlier version): resuming "
            "without checking that the data holds the same samples"
        )
        data["content_sha256"] = now  # nothing to compare: not a change
        return
    if allow or recorded == now or data.get("datasets") != config.data.datasets:
        return  # allowed (and recorded), the same, or a change of data.datasets (refused there)
    changed = [
        f"{url} ({a[:12]} when the run started, {b[:12]} now)"
        for url, a, b in zip(config.data.datasets, recorded, now, strict=False)
        if a != b
    ]
    raise ValueError(
        f"--resume: the data of {config.output} changed since the run started: "
        f"{'; '.join(changed) or _short(now)} hold other samples (prepared again?); resume on "
        "the data the run started on, choose a new output, or pass --allow-config-change to "
        "go on with this data"
    )


def _check_config_change(
    config: RunConfig, state: dict[str, Any], rows_per_step: int, allow: bool
) -> dict[str, Any] | None:
    """The record of what the resumed run changes in the run's config (None: nothing);
    refuses what must not change (`resume_changes`)."""
    previous = previous_run_config(config.output)
    if previous is None:
        log.warning(
            f"{config.output} has no recorded run config ({RUN_CONFIG}): resuming without "
            "checking that the settings are the run's"
        )
        return None
    _check_data_identity(config, previous, allow)
    old_rows = state.get("rows_per_step")
    if old_rows is None and "dp_world" in state:  # checkpoints of earlier versions
        old_rows = int(state["dp_world"]) * int(previous.get("optim", {}).get("grad_accum", 1))
    changes, forced = resume_changes(
        previous, config, rows_per_step=(old_rows, rows_per_step), allow=allow
    )
    if not changes:
        return None
    listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
    if forced:
        log.warning(f"--allow-config-change: resuming with changed settings: {listed}")
    else:
        log.info(f"resuming with changed settings (safe to change): {listed}")
    return {"step": int(state["step"]), "changes": changes, "forced": forced}


def _record_run(
    config: RunConfig, skipped: list[tuple[str, str]], change: dict[str, Any] | None
) -> None:
    """On the main rank: set aside skipped checkpoints, write the resolved config, append
    the config change of this resume to the run's history."""
    storage.makedirs(config.output)
    for url, _ in skipped:
        log.warning(f"set aside unusable checkpoint {url} as {set_aside(url)}")
    storage.write_json_atomic(storage.join(config.output, RUN_CONFIG), config.to_dict())
    if change is not None:
        url = storage.join(config.output, CONFIG_CHANGES)
        before = storage.read_text(url) if storage.exists(url) else ""
        storage.write_text_atomic(url, before + json.dumps(change) + "\n")


def plan_run(
    config: RunConfig,
    info: DistInfo,
    resume: bool | str,
    target_config: Any = None,
    dataset: Any = None,
    *,
    allow_config_change: bool = False,
) -> RunPlan:
    """The plan of a run on this rank; writes the resolved config into the run directory.
    `resume`: True resumes from the newest checkpoint that verifies (refused when there is
    none), "auto" resumes when there is one and starts otherwise. `target_config` and
    `dataset` may be passed in already built (benchmarks, tests)."""
    started = time.perf_counter()
    if dataset is None:  # read from its URLs: what it holds is recorded and checked
        config = with_data_identity(config)
    placement = assign_placement(info, config.parallel.placement, config.parallel.target_ranks)
    rows_per_step = placement.dp_world * config.optim.grad_accum
    resume_from, skipped = _resume_point(config, resume)
    state: dict[str, Any] = {"step": 0, "cursor": 0}
    change = None
    if resume_from is not None:
        state = storage.read_json(storage.join(resume_from, "state.json"))
        change = _check_config_change(config, state, rows_per_step, allow_config_change)
    barrier(info)  # every rank has read the checkpoints before any is set aside
    if info.is_main:
        _record_run(config, skipped, change)
    barrier(info)
    if target_config is None:
        target_config = load_target_config(config.target.path)
    drafter_config, mask_note = build_drafter_config(config, target_config)
    if dataset is None:
        dataset = open_datasets(config.data.datasets)
    stream = _row_stream(config, dataset, drafter_config.block_size, target_config)
    total_rows = stream.total_rows()
    total_steps = total_rows // rows_per_step
    if config.optim.max_steps is not None:
        total_steps = min(total_steps, config.optim.max_steps)
    if total_steps < 1:
        raise ValueError(
            f"the data makes {total_rows} packed rows of {config.data.row_tokens} tokens, "
            f"fewer than one step needs ({placement.dp_world} drafter replica(s) x grad_accum "
            f"{config.optim.grad_accum}); lower data.row_tokens or add data"
        )
    return RunPlan(
        config=config,
        info=info,
        placement=placement,
        target_config=target_config,
        drafter_config=drafter_config,
        mask_note=mask_note,
        stream=stream,
        dataset=dataset,
        total_rows=total_rows,
        total_steps=total_steps,
        start_step=int(state["step"]),
        start_cursor=int(state["cursor"]),
        resume_from=resume_from,
        planned_s=time.perf_counter() - started,
    )
