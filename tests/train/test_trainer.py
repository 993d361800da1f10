"""End-to-end training through the CLI on real targets (CPU): learning, in-training eval,
S3, the step's loss normaliser, and a non-finite loss stopping the run (resume after a kill
is in tests/test_faults.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import read_metrics, record_run_ahead, train_settings

from flashdraft import cli
from flashdraft.train.checkpoint import complete_checkpoints, load_drafter


def _learns(records: list[dict]) -> None:
    """Loss falls and tau_hat rises: the first two logged intervals against the last two."""
    first, last = records[:2], records[-2:]

    def mean(rs: list[dict], key: str) -> float:
        return sum(r[key] for r in rs) / len(rs)

    assert mean(last, "loss") < mean(first, "loss") - 0.3, [r["loss"] for r in records]
    assert mean(last, "tau_hat") > mean(first, "tau_hat") + 0.02, [r["tau_hat"] for r in records]
    last = records[-1]
    for key in (
        "step",
        "epoch",
        "loss",
        "tau_hat",
        "acc",
        "lr",
        "tokens_per_s",
        "target_s",
        "drafter_s",
    ):
        assert key in last
    assert len(last["acc"]) == 7  # slots 1..B-1 for B = 8


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_trains_end_to_end_on_a_tiny_qwen3_with_the_real_qwen3_tokenizer(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    run = tmp_path / "run"
    # A random target's argmax is mostly noise, so here the drafter learns the data tokens
    # (loss.labels = data); the target-label path is covered on SmolLM2 below.
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **{"loss.labels": '"data"'})
    assert cli.main(["train", *settings]) == 0
    _learns(read_metrics(run))
    assert (run / "export" / "model.safetensors").exists()
    assert json.loads((run / "run_config.json").read_text())["loss"]["anchors"] == 24
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert steps == ["step_00000016", "step_00000024", "step_00000032"]  # keep = 3


@pytest.mark.gpu
@pytest.mark.parametrize("forward_rows", [1, 3])
def test_on_cuda_the_default_run_trains_with_varlen_attention(
    tmp_path, tiny_qwen3_dir, qwen_data, forward_rows
) -> None:
    """`flashdraft train` on a GPU with nothing set about attention: the target loads with
    the varlen flash kernel (`default_attention`), its packed forward compiled, and the run
    learns and exports as on the CPU; also with the target running ahead over 3 rows (the
    group before each checkpoint, every 8 steps, has 2 rows, padded to 3: one compiled
    shape)."""
    from flashdraft.model.target import default_attention

    assert default_attention(str(tiny_qwen3_dir), "cuda") == "varlen"
    run = tmp_path / "run"
    extra = {"loss.labels": '"data"', "device": '"cuda"', "target.forward_rows": forward_rows}
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **extra)
    assert cli.main(["train", *settings]) == 0
    records = read_metrics(run)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    _learns(records)
    assert (run / "export" / "model.safetensors").exists()


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_trains_end_to_end_on_real_smollm2_with_in_training_eval(
    tmp_path, smollm2_dir, smol_data
) -> None:
    prompts = tmp_path / "held_out.jsonl"
    with open(prompts, "w") as f:
        for text in ("What is the capital of France?", "Name three colours."):
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    run = tmp_path / "run"
    extra = {
        "optim.lr": 2e-3,
        "optim.max_steps": 16,
        "eval.every": 8,
        "eval.prompts": f'"{prompts}"',
        "eval.max_new_tokens": 12,
    }
    assert cli.main(["train", *train_settings(run, smollm2_dir, smol_data, **extra)]) == 0
    records = read_metrics(run)
    _learns(records)
    evaluated = {r["step"]: r["eval_tau"] for r in records if "eval_tau" in r}
    assert sorted(evaluated) == [8, 16]
    assert all(1.0 <= tau <= 8.0 for tau in evaluated.values())
    best = json.loads((run / "best" / "best.json").read_text())
    assert best["eval_tau"] == max(evaluated.values())
    assert (run / "best" / "model.safetensors").exists()


def test_checkpoint_round_trip_through_a_real_s3_server(
    tmp_path, tiny_qwen3_dir, qwen_data, s3
) -> None:
    """s3:// output against moto's S3 server on loopback (a real HTTP server, not a mock)."""
    from flashdraft.train.checkpoint import load_checkpoint

    fs, _ = s3
    url = "s3://runs/tiny"
    extra = {"optim.max_steps": 4, "checkpoint.every": 2, "log.every": 2}
    settings = train_settings(tmp_path, tiny_qwen3_dir, qwen_data, **extra)
    settings += ["--set", f'output="{url}"']
    assert cli.main(["train", *settings]) == 0
    found = complete_checkpoints(url)
    assert [step for step, _ in found] == [2, 4]
    drafter = load_drafter(found[-1][1])
    reference = load_drafter(found[-1][1])
    optimizer = torch.optim.AdamW(drafter.parameters())
    state = load_checkpoint(found[-1][1], drafter, optimizer)
    assert state["step"] == 4 and state["cursor"] == 4
    for a, b in zip(drafter.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert len(optimizer.state) == len(list(drafter.parameters()))
    lines = fs.cat(f"{url[5:]}/metrics.jsonl").decode().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]
    assert fs.exists(f"{url[5:]}/export/model.safetensors")


def test_every_micro_batch_is_normalised_by_the_whole_step(
    monkeypatch, tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    """docs/design.md §4: the loss is sum(w m CE) over the whole optimizer step divided by that step's
    sum(w m), not a per-micro-batch mean. Every micro-batch of a step must get the same
    normaliser, equal to the sum of the micro-batches' own sum(w m)."""
    import flashdraft.train.trainer as train_module
    from flashdraft.train.step import batch_normaliser

    real = train_module.draft_loss
    calls: list[tuple[float, float]] = []

    def recording(drafter, head, batch, slot_w, normaliser, *args, **kwargs):
        own = batch_normaliser(batch, drafter.config.block_size, slot_w)
        calls.append((float(normaliser), float(own)))
        return real(drafter, head, batch, slot_w, normaliser, *args, **kwargs)

    monkeypatch.setattr(train_module, "draft_loss", recording)
    run = tmp_path / "run"
    extra = {"optim.grad_accum": 3, "optim.max_steps": 2, "checkpoint.every": 100}
    assert cli.main(["train", *train_settings(run, tiny_qwen3_dir, qwen_data, **extra)]) == 0
    assert len(calls) == 6
    for step in (calls[:3], calls[3:]):
        given = {n for n, _ in step}
        assert len(given) == 1, step  # one normaliser for the whole step
        assert given.pop() == pytest.approx(sum(own for _, own in step))
        assert len({own for _, own in step}) > 1  # the micro-batches differ: the test can fail


def test_a_non_finite_loss_stops_the_run_before_anything_is_written(
    monkeypatch, tmp_path, tiny_qwen3_dir, qwen_data, capsys
) -> None:
    """Step 3's loss is poisoned with NaN. The guard catches it on the device; the run stops
    at the next point where it syncs anyway (the log at step 4), naming step 3, before the
    checkpoint of step 4 is written; the checkpoint of step 2 is intact, and resuming from it
    gives the uninterrupted run."""
    import flashdraft.train.trainer as train_module

    real = train_module.draft_loss
    calls: list[int] = []

    def poisoned(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), stats

    extra = {"optim.max_steps": 6, "checkpoint.every": 2, "log.every": 2, "loss.anchors": 8}
    reference = tmp_path / "reference"
    assert cli.main(["train", *train_settings(reference, tiny_qwen3_dir, qwen_data, **extra)]) == 0

    run = tmp_path / "run"
    settings = train_settings(run, tiny_qwen3_dir, qwen_data, **extra)
    monkeypatch.setattr(train_module, "draft_loss", poisoned)
    capsys.readouterr()
    assert cli.main(["train", *settings]) == 1  # a run that stopped itself, in one line
    assert "flashdraft train: error: loss is not finite at step 3;" in capsys.readouterr().err
    assert [step for step, _ in complete_checkpoints(str(run))] == [2]
    assert [r["step"] for r in read_metrics(run)] == [2]
    assert not (run / "export").exists()
    weights = load_drafter(str(run)).state_dict()
    assert all(torch.isfinite(w).all() for w in weights.values())

    monkeypatch.setattr(train_module, "draft_loss", real)
    assert cli.main(["train", *settings, "--resume"]) == 0
    resumed, expected = read_metrics(run), read_metrics(reference)
    assert [r["step"] for r in resumed] == [r["step"] for r in expected] == [2, 4, 6]
    for got, want in zip(resumed, expected, strict=True):
        for key in ("loss", "tau_hat", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)


@pytest.mark.parametrize("grad_accum", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_rows_with_nothing_to_train_do_not_stop_the_run(
    tmp_path, tiny_qwen3_dir, grad_accum, caplog
) -> None:
    """A conversation whose prompt is longer than a row is split (data.overlong = "split")
    into rows of prompt only and a last row with the answer: steps on the prompt rows have
    no trained slot. They log loss 0, tau_hat 1 and a zero gradient (a 0 / 0 loss stopped
    such runs as "not finite"; that their optimizer step is skipped is tests/train/
    test_optim.py's), and the answer's step trains: with 2 rows a step (docs/design.md §8 trap 10) the
    step is empty only when both rows are, so the answer row's step updates the weights."""
    from flashdraft.export.dflash import load_dflash
    from flashdraft.model.drafter import init_seeded

    long_prompt = " ".join(f"word{i} is here." for i in range(300))  # ~1,500 tokens
    source = tmp_path / "long.jsonl"
    record = {"messages": [
        {"role": "user", "content": long_prompt},
        {"role": "assistant", "content": "A short answer that ends the chat. " * 3},
    ]}  # fmt: skip
    source.write_text(json.dumps(record) + "\n")
    data = tmp_path / "data"
    prepare = ["prepare", str(source), "--tokenizer", str(tiny_qwen3_dir), "--output", str(data)]
    assert cli.main([*prepare, "--workers", "1", "--no-progress"]) == 0
    run = tmp_path / "run"
    steps = 8 // grad_accum  # the whole epoch: 8 rows
    extra = {"optim.max_steps": steps, "optim.grad_accum": grad_accum, "log.every": 1,
             "checkpoint.every": 100, "loss.anchors": 8}  # fmt: skip
    assert cli.main(["train", *train_settings(run, tiny_qwen3_dir, data, **extra)]) == 0
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    empty = [r for r in records if r["blocks"] == 0]
    trained = [r for r in records if r["blocks"] > 0]
    assert len(empty) == steps - 1 and len(trained) == 1, [
        (r["step"], r["blocks"]) for r in records
    ]
    assert all(r["loss"] == 0 and r["tau_hat"] == 1 and r["grad_norm"] == 0 for r in empty)
    assert [r.get("empty_steps") for r in records] == [
        1 if r["blocks"] == 0 else None for r in records
    ]
    assert (
        f"{steps - 1} since this process started" in caplog.text
    )  # said, not only logged as numbers
    assert trained[0]["loss"] > 0 and trained[0]["grad_norm"] > 0
    exported = load_dflash(str(run / "export"))
    seed = json.loads((run / "run_config.json").read_text())["seed"]
    initial = init_seeded(exported.config, seed).to(torch.bfloat16)
    assert not torch.equal(exported.fc.weight, initial.fc.weight)  # the one step was taken


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_a_warm_started_run_resumes_without_its_warm_start_folder(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    """A resumed run takes every weight from its checkpoint, so `drafter.init_from` is not
    read again: the run resumes, to the same numbers, after the warm start's folder is gone
    (a pruned start kept on a machine that has since been replaced)."""
    import shutil

    from flashdraft.export.dflash import save_dflash
    from flashdraft.model.drafter import init_seeded
    from flashdraft.train.plan import build_drafter_config, load_target_config

    extra = {"optim.max_steps": 2, "checkpoint.every": 2, "log.every": 1, "loss.anchors": 8}
    first = tmp_path / "a"
    settings = train_settings(first, tiny_qwen3_dir, qwen_data, **extra)
    config = cli_config(settings)
    drafter_config, _ = build_drafter_config(config, load_target_config(str(tiny_qwen3_dir)))
    warm = tmp_path / "warm"
    save_dflash(init_seeded(drafter_config, 7), str(warm))  # not the run's own seeded init
    settings += ["--set", f'drafter.init_from="{warm}"']
    assert cli.main(["train", *settings]) == 0
    second = tmp_path / "b"
    shutil.copytree(first, second)
    more = ["--set", "optim.max_steps=4", "--resume"]
    assert cli.main(["train", *settings, *more]) == 0
    shutil.rmtree(warm)
    moved = [*settings, "--set", f'output="{second}"', *more]
    assert cli.main(["train", *moved]) == 0
    got, want = read_metrics(second), read_metrics(first)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]


def cli_config(settings: list[str]):
    """The run config that `flashdraft train` builds from these `--set` arguments."""
    from flashdraft import config as cfg
    from flashdraft.train.config import RunConfig

    pairs = [settings[i + 1] for i in range(0, len(settings), 2) if settings[i] == "--set"]
    return cfg.build(RunConfig, cfg.apply_overrides({}, pairs))


def test_the_target_runs_ahead_in_groups_that_end_at_each_checkpoint() -> None:
    from flashdraft.train.step_rows import group_steps

    # 4 steps a group, checkpoints every 6, 13 steps: 4, 2 | 4, 2 | 1.
    starts, step = [], 0
    while step < 13:
        starts.append((step, group_steps(step, 13, 4, 6)))
        step += starts[-1][1]
    assert starts == [(0, 4), (4, 2), (6, 4), (10, 2), (12, 1)]
    assert group_steps(0, 13, 4, 0) == 4 and group_steps(12, 13, 4, 0) == 1  # no checkpoints
    assert group_steps(5, 13, 1, 6) == 1  # one step a group: the run as without running ahead
    assert group_steps(0, 13, 4, 6, 3) == 3 and group_steps(3, 13, 4, 6, 3) == 3  # and evals
    assert group_steps(4, 13, 4, 6, 0) == 2  # evals off


def time_spent(more_steps: int, checkpoints: int) -> str:
    """The pattern of the trainer's closing line on where its time went, its numbers grouped."""
    return (
        r"([\d.]+) s from set-up to export: set up ([\d.]+) s, first step ([\d.]+) s, "
        rf"{more_steps} more steps ([\d.]+) s, {checkpoints} checkpoint\(s\) ([\d.]+) s, "
        r"export ([\d.]+) s"
    )


def setup_total(out: str) -> float:
    """The banner's set-up seconds."""
    return float(re.search(r"set up in ([\d.]+) s:", out).group(1))


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_a_run_with_the_target_ahead_resumes_to_the_uninterrupted_run(
    tmp_path, tiny_qwen3_dir, qwen_data, monkeypatch, capsys
) -> None:
    """target.forward_rows = 2 with checkpoints every 3 steps, soft labels (the held outputs
    are taps, hard and soft labels): the target runs over groups of 2, 1 (padded to 2), 2, 1
    steps' rows; a run stopped at its step-3 checkpoint and resumed forms the same groups and
    ends bit for bit as the run in one go, and both follow the run without running ahead (to
    float rounding)."""
    groups = record_run_ahead(monkeypatch)
    from flashdraft.train.packing import RowStream

    prefetches: list[int] = []
    iterate = RowStream.iterate

    def iterate_recorded(self: RowStream, positions, prefetch: int):
        prefetches.append(prefetch)
        return iterate(self, positions, prefetch)

    monkeypatch.setattr(RowStream, "iterate", iterate_recorded)
    extra = {
        "loss.labels": '"soft"',
        "loss.soft_top_k": 4,
        "optim.max_steps": 6,
        "checkpoint.every": 3,
        "target.forward_rows": 2,
        "log.every": 1,
        "data.prefetch": 1,  # the loader is asked for a whole group (2 rows) ahead
    }
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert cli.main(["train", *train_settings(whole, tiny_qwen3_dir, qwen_data, **extra)]) == 0
    out = capsys.readouterr().out
    assert "the target runs ahead, 2 rows a forward" in out
    # the banner says where the time before the first step went, its parts adding up
    named = r"plan and data ([\d.]+) s, memory check and target ([\d.]+) s, drafter, optimizer"
    setup = re.search(r"set up in ([\d.]+) s: " + named + r" and eval ([\d.]+) s", out)
    assert setup is not None, out
    total, *pieces = (float(x) for x in setup.groups())  # each rounded to 0.1 s
    assert total > 0 and abs(total - sum(pieces)) <= 0.21
    # and where the time after it went, checkpoint by checkpoint and in one line at the end
    assert re.search(r"checkpoint step 3 written in [\d.]+ s", out)
    assert re.search(r"checkpoint step 6 written in [\d.]+ s", out)
    spent = re.search(time_spent(5, 2), out)
    assert spent is not None, out
    total, *pieces = (float(x) for x in spent.groups())
    assert abs(total - sum(pieces)) <= 0.31 and pieces[0] == setup_total(out)
    written = [float(x) for x in re.findall(r"checkpoint step \d+ written in ([\d.]+) s", out)]
    assert len(written) == 2 and abs(pieces[3] - sum(written)) <= 0.16  # the checkpoints own times
    assert prefetches == [2]
    assert groups == [2, 1, 2, 1]
    groups.clear()
    first = train_settings(parts, tiny_qwen3_dir, qwen_data, **{**extra, "optim.max_steps": 3})
    assert cli.main(["train", *first]) == 0
    assert (
        cli.main(["train", *train_settings(parts, tiny_qwen3_dir, qwen_data, **extra), "--resume"])
        == 0
    )
    assert groups == [2, 1, 2, 1]
    out = capsys.readouterr().out  # the first part's three steps and the resumed three
    assert len(re.findall(time_spent(2, 1), out)) == 2  # each part's own line
    assert re.search(time_spent(2, 1), out.split("resuming from")[-1])

    def curve(run) -> list[tuple]:
        return [(r["step"], r["loss"], r["tau_hat"], r["grad_norm"]) for r in read_metrics(run)]

    assert curve(parts) == curve(whole) and len(curve(whole)) == 6
    plain = tmp_path / "plain"
    one_row = {**extra, "target.forward_rows": 1}
    assert cli.main(["train", *train_settings(plain, tiny_qwen3_dir, qwen_data, **one_row)]) == 0
    assert groups == [2, 1, 2, 1]  # it never ran ahead
    assert prefetches[-1] == 1  # nor was the loader asked for more
    for got, want in zip(curve(whole), curve(plain), strict=True):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    final, expected = load_drafter(str(parts)), load_drafter(str(whole))
    for (name, x), y in zip(
        final.state_dict().items(), expected.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
@pytest.mark.parametrize("labels", ["soft", "target"])
def test_dpace_weights_train_with_the_target_ahead(
    tmp_path, tiny_qwen3_dir, qwen_data, monkeypatch, labels
) -> None:
    """D-PACE at the shipped shape, with soft and with hard labels, as the preset runs it, the target ahead over rows: it trains, each
    logged loss finite, and running ahead changes nothing but rounding (as with decay)."""
    groups = record_run_ahead(monkeypatch)
    extra = {
        "loss.weighting": '"dpace"',
        "loss.labels": f'"{labels}"',
        "loss.soft_top_k": 4,
        "optim.max_steps": 4,
        "target.forward_rows": 2,
        "log.every": 1,
    }
    curves = []
    for rows in (2, 1):
        run = tmp_path / f"rows{rows}"
        settings = {**extra, "target.forward_rows": rows}
        assert cli.main(["train", *train_settings(run, tiny_qwen3_dir, qwen_data, **settings)]) == 0
        curves.append([(r["loss"], r["tau_hat"]) for r in read_metrics(run)])
        if rows == 2:
            assert groups == [2, 2]  # it ran ahead: 4 steps' rows in two forwards
    assert len(curves[0]) == 4 and all(torch.isfinite(torch.tensor(c)).all() for c in curves[0])
    for got, want in zip(*curves, strict=True):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-5)


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_soft_labels_with_the_whole_argmax_mixed_in_train_as_hard_labels(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    """`loss.argmax_mix = 1` turns the soft labels into one-hot argmax labels, so three steps
    train as `loss.labels = "target"` does (same losses, same weights, up to rounding); with
    no argmax mixed in the soft labels train otherwise (the check can fail)."""
    runs = {
        "hard": {"loss.labels": '"target"'},
        "mix1": {"loss.labels": '"soft"', "loss.argmax_mix": 1.0},
        "soft": {"loss.labels": '"soft"'},
    }
    curves, weights = {}, {}
    for name, extra in runs.items():
        run = tmp_path / name
        settings = {**extra, "loss.soft_top_k": 4, "optim.max_steps": 3, "log.every": 1}
        settings |= {"checkpoint.every": 3}
        assert cli.main(["train", *train_settings(run, tiny_qwen3_dir, qwen_data, **settings)]) == 0
        curves[name] = [r["loss"] for r in read_metrics(run)]
        weights[name] = load_drafter(complete_checkpoints(str(run))[-1][1]).state_dict()
    assert len(curves["hard"]) == 3
    assert curves["mix1"] == pytest.approx(curves["hard"], rel=1e-4, abs=1e-5)
    for key, want in weights["hard"].items():
        torch.testing.assert_close(weights["mix1"][key], want, rtol=1e-4, atol=1e-5)
    assert curves["soft"] != pytest.approx(curves["hard"], rel=1e-4, abs=1e-5)
