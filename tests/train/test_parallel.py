"""Two processes on CPU (gloo) under torchrun: the same loss curve as one process on the same
global batch, in both placements, and resuming on a different world size."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import random_packed_row, read_metrics, train_settings

from flashdraft import cli

COMPARED = ("loss", "tau_hat", "acc", "grad_norm", "trained_slots", "tokens", "rows")


def _torchrun(nproc: int, settings: list[str], *extra: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "flashdraft.cli",
        "train",
        *settings,
        *extra,
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


def _settings(run: Path, target: Path, data: Path, **extra: object) -> list[str]:
    """`train_settings` with 8 anchors per row, not 24: the drafter's loss over Qwen3's
    152k-token vocabulary is most of a CPU step (8 rows: 27 s -> 15 s of CPU), and every
    comparison below runs the same settings on both sides."""
    return train_settings(run, target, data, **{"loss.anchors": 8, **extra})


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_qwen3_dir, qwen_data) -> list[dict]:
    """The control: one process, two rows per step (grad_accum 2)."""
    run = tmp_path_factory.mktemp("single") / "run"
    settings = _settings(
        run, tiny_qwen3_dir, qwen_data, **{"optim.grad_accum": 2, "optim.max_steps": 8}
    )
    assert cli.main(["train", *settings]) == 0
    return read_metrics(run)


def _same_curve(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)


# Colocated (2 replicas x 1 row) is test_two_colocated_processes_match_one_and_resume_on_one.
@pytest.mark.parametrize(
    ("placement", "extra"),
    [
        (
            "split",
            {"optim.grad_accum": 2, "parallel.placement": '"split"', "parallel.target_ranks": 1},
        ),
        # the target rank sends row by row; the drafter rank stacks the step's two rows
        pytest.param(
            "split-stacked",
            {
                "optim.grad_accum": 2,
                "optim.rows_per_forward": 2,
                "parallel.placement": '"split"',
                "parallel.target_ranks": 1,
            },
            marks=pytest.mark.slow,
        ),
        # the target's decoder layers sharded over the 2 ranks with FSDP2 (a target too big
        # for one GPU); the drafter replicas still see the whole target's features
        pytest.param(
            "sharded-target",
            {"optim.grad_accum": 1, "parallel.shard_target": "true"},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_two_processes_match_one_on_the_same_global_batch(
    tmp_path, tiny_qwen3_dir, qwen_data, single, placement, extra
) -> None:
    run = tmp_path / placement
    settings = _settings(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 8, **extra})
    out = _torchrun(2, settings)
    assert ("target layers sharded over 2 ranks" in out) == (placement == "sharded-target")
    _same_curve(read_metrics(run), single)
    assert (run / "export" / "model.safetensors").exists()


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_fsdp_drafter_matches_one_process_and_exports_full_weights(
    tmp_path, tiny_qwen3_dir, qwen_data, single
) -> None:
    """drafter_sharding = "fsdp": the same curve as one process, and the in-training eval,
    the best-by-tau export and the final export see the whole drafter, not a rank's shard."""
    from safetensors.torch import load_file

    prompts = tmp_path / "held_out.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Name three colours."}]}) + "\n"
    )
    run = tmp_path / "fsdp"
    extra = {
        "optim.max_steps": 8,
        "optim.grad_accum": 1,
        "parallel.drafter_sharding": '"fsdp"',
        "eval.every": 4,
        "eval.prompts": f'"{prompts}"',
        "eval.max_new_tokens": 8,
    }
    out = _torchrun(2, _settings(run, tiny_qwen3_dir, qwen_data, **extra))
    assert "(drafter sharded, FSDP2)" in out
    records = read_metrics(run)
    _same_curve([r for r in records if "loss" in r], single)
    assert sorted(r["step"] for r in records if "eval_tau" in r) == [4, 8]
    final = load_file(str(run / "checkpoints" / "step_00000008" / "drafter.safetensors"))
    export = load_file(str(run / "export" / "model.safetensors"))
    assert (run / "best" / "model.safetensors").exists()
    for name, tensor in export.items():
        assert tensor.shape == final[name].shape, name  # whole tensors, not a rank's half
        assert torch.equal(tensor, final[name].to(tensor.dtype)), name


def test_two_colocated_processes_match_one_and_resume_on_one(
    tmp_path, tiny_qwen3_dir, qwen_data, single
) -> None:
    """Colocated, 2 replicas x 1 row, each replica's target running ahead over 2 steps' rows
    (`target.forward_rows = 2`): the same curve as one process without. Checkpoints hold full
    state and a global row cursor: the run as it stood at its step-4 checkpoint resumes on 1
    process (2 rows per step, the same global batch) to the same curve. One torchrun launch
    serves both checks."""
    two = tmp_path / "colocated"
    extra = {
        "optim.max_steps": 8,
        "optim.grad_accum": 1,
        "checkpoint.every": 4,
        "target.forward_rows": 2,
    }
    out = _torchrun(2, _settings(two, tiny_qwen3_dir, qwen_data, **extra))
    assert "target layers sharded" not in out
    assert "the target runs ahead, 2 rows a forward" in out
    _same_curve(read_metrics(two), single)
    assert (two / "export" / "model.safetensors").exists()

    # 2 processes -> 1 process, from what the run held after its step-4 checkpoint: its
    # config, that checkpoint, the metrics up to step 4 (so every later line is the resume's).
    run = tmp_path / "run"
    shutil.copytree(two / "checkpoints" / "step_00000004", run / "checkpoints" / "step_00000004")
    shutil.copy(two / "run_config.json", run / "run_config.json")
    lines = (two / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(x for x in lines if json.loads(x)["step"] <= 4))
    state = json.loads((run / "checkpoints" / "step_00000004" / "state.json").read_text())
    assert state["cursor"] == 8 and state["dp_world"] == 2
    one = _settings(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 8, "optim.grad_accum": 2})
    assert cli.main(["train", *one, "--resume"]) == 0
    _same_curve(read_metrics(run), single)
    assert (run / "checkpoints" / "step_00000008").exists()


def _trace(folder: Path, rank: int) -> list[dict]:
    """The events of `rank` written so far (a line still being written left out)."""
    path = folder / f"trace-rank{rank}.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(x) for x in lines]


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_sigterm_to_one_rank_stops_both_after_the_same_step_with_a_checkpoint(
    tmp_path, tiny_qwen3_dir, qwen_data, single
) -> None:
    """A SIGTERM reaches the ranks of a run at different steps (here: rank 1 only, during its
    first steps). The ranks agree at the next log point (step 4), both stop after it, the
    checkpoint of step 4 is written (none is due before step 8) and nothing is exported;
    resumed on one process from it, the run ends on the same curve as the run in one go."""
    run, trace = tmp_path / "run", tmp_path / "trace"
    extra = {"optim.max_steps": 8, "optim.grad_accum": 1, "checkpoint.every": 8}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLASHDRAFT_TRACE": str(trace)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "flashdraft.cli", "train", *_settings(run, tiny_qwen3_dir, qwen_data, **extra)]
    output = tmp_path / "out.txt"
    with output.open("w") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        # rank 1's process, once rank 0 has begun its first step
        while not any(e["event"] == "row" for e in _trace(trace, 0)):
            assert process.poll() is None and time.monotonic() < deadline, output.read_text()
            time.sleep(0.05)
        pid = next(e["pid"] for e in _trace(trace, 1) if e["event"] == "role")
        os.kill(pid, signal.SIGTERM)
        process.wait(timeout=300)
    finally:  # nothing left running on a failure: torchrun, and its workers (own sessions)
        if process.poll() is None:
            process.kill()
            process.wait()
            for rank in (0, 1):
                for pid in (e["pid"] for e in _trace(trace, rank) if e["event"] == "role"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    log = output.read_text()
    # torchrun reports its workers' 143 (the one it may SIGTERM itself once the other has
    # exited can end with -15 instead, its checkpoint written: the ranks passed its barrier)
    assert process.returncode != 0 and re.search(r"exitcode\s*:\s*143\b", log), log[-4000:]
    assert "stopped by SIGTERM after step 4 of 8; checkpoint " in log, log[-4000:]
    for rank in (0, 1):  # rank 0, never signalled, stopped after the same step
        assert max(e["step"] for e in _trace(trace, rank) if e["event"] == "row") == 4
    assert (run / "checkpoints" / "step_00000004" / "COMPLETE").exists()
    assert not (run / "export").exists()
    assert [r["step"] for r in read_metrics(run)] == [4]
    one = _settings(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 8, "optim.grad_accum": 2})
    assert cli.main(["train", *one, "--resume"]) == 0
    _same_curve(read_metrics(run), single)


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
@pytest.mark.parametrize("depth", [2, 5])
def test_ctrl_c_to_a_split_target_rank_stops_every_rank_after_one_checkpoint(
    tmp_path, tiny_qwen3_dir, qwen_data, single, depth
) -> None:
    """Split placement (1 target rank + 1 drafter rank), SIGINT to the target rank only, in
    the drafter's first step: the ranks vote to stop at the step-4 log point; the target
    rank has sent the rows the drafter posted receives for (queue_depth - 1 past the
    stop), which the drafter drains; one checkpoint, every rank exits 143, no traceback; and
    resumed on one process the run ends on the curve of the run in one go."""
    run, trace = tmp_path / "run", tmp_path / "trace"
    extra = {
        "optim.max_steps": 8,
        "optim.grad_accum": 2,
        "checkpoint.every": 8,
        "parallel.placement": '"split"',
        "parallel.target_ranks": 1,
        "parallel.queue_depth": depth,
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLASHDRAFT_TRACE": str(trace)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "flashdraft.cli", "train", *_settings(run, tiny_qwen3_dir, qwen_data, **extra)]
    output = tmp_path / "out.txt"
    with output.open("w") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not any(e["event"] == "row" for e in _trace(trace, 1)):  # the drafter's step 1
            assert process.poll() is None and time.monotonic() < deadline, output.read_text()
            time.sleep(0.05)
        pid = next(e["pid"] for e in _trace(trace, 0) if e["event"] == "role")
        os.kill(pid, signal.SIGINT)
        process.wait(timeout=300)
    finally:  # nothing left running on a failure: torchrun, and its workers (own sessions)
        if process.poll() is None:
            process.kill()
            process.wait()
            for rank in (0, 1):
                for pid in (e["pid"] for e in _trace(trace, rank) if e["event"] == "role"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    log = output.read_text()
    # torchrun's own summary of its failed workers is the only traceback
    assert process.returncode != 0 and "KeyboardInterrupt" not in log, log[-4000:]
    assert log.count("Traceback") == log.count("ChildFailedError: \n"), log[-4000:]
    assert re.search(r"exitcode\s*:\s*143\b", log), log[-4000:]
    for rank in (0, 1):  # the target rank had the signal; the drafter rank stopped with it
        assert re.search(
            rf"\[rank {rank}\] flashdraft train: stopped by SIG(INT|TERM) after step 4 of 8", log
        ), log[-4000:]
    assert max(e["step"] for e in _trace(trace, 1) if e["event"] == "row") == 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004"]
    assert not (run / "export").exists() and not (run / "LOCK").exists()
    one = _settings(run, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 8, "optim.grad_accum": 2})
    assert cli.main(["train", *one, "--resume"]) == 0
    _same_curve(read_metrics(run), single)


def test_split_placement_needs_a_drafter_rank() -> None:
    from flashdraft.train.parallel import DistInfo, assign_placement

    info = DistInfo(rank=0, world=1, local_rank=0, device=__import__("torch").device("cpu"))
    with pytest.raises(ValueError, match="target_ranks"):
        assign_placement(info, "split", 1)


@pytest.mark.multigpu
@pytest.mark.parametrize(
    ("placement", "extra"),
    [
        ("colocated", {"optim.grad_accum": 1}),
        (
            "split",
            {"optim.grad_accum": 2, "parallel.placement": '"split"', "parallel.target_ranks": 1},
        ),
        # the target rank sends row by row; the drafter rank stacks the step's two rows
        (
            "split-stacked",
            {
                "optim.grad_accum": 2,
                "optim.rows_per_forward": 2,
                "parallel.placement": '"split"',
                "parallel.target_ranks": 1,
            },
        ),
        # the target's decoder layers sharded over the 2 ranks with FSDP2 (a target too big
        # for one GPU); the drafter replicas still see the whole target's features
        ("sharded-target", {"optim.grad_accum": 1, "parallel.shard_target": "true"}),
        ("fsdp-drafter", {"optim.grad_accum": 1, "parallel.drafter_sharding": '"fsdp"'}),
    ],
)
def test_two_gpus_match_one_gpu_on_the_same_global_batch(
    tmp_path, tiny_qwen3_dir, qwen_data, placement, extra
) -> None:
    """NCCL on 2 GPUs, bf16 target and autocast: the 1-GPU curve within bf16 noise."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cuda = {"device": '"cuda"', "optim.max_steps": 8, "optim.lr": 3e-3}
    control = tmp_path / "one"
    settings = train_settings(control, tiny_qwen3_dir, qwen_data, **{**cuda, "optim.grad_accum": 2})
    assert cli.main(["train", *settings]) == 0
    run = tmp_path / placement
    _torchrun(2, train_settings(run, tiny_qwen3_dir, qwen_data, **{**cuda, **extra}))
    got, want = read_metrics(run), read_metrics(control)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2), a["step"]
        assert a["tokens"] == b["tokens"] and a["trained_slots"] == b["trained_slots"]


@pytest.mark.slow
def test_four_processes_split_two_plus_two_match_one(tmp_path, tiny_qwen3_dir, qwen_data) -> None:
    """The original layout on CPU: targets on 2 ranks, drafters on 2 (data parallel x2),
    2 replicas x 2 rows per step, compared with 1 process x 4 rows (the same global batch)."""
    control = tmp_path / "one"
    one = train_settings(
        control, tiny_qwen3_dir, qwen_data, **{"optim.max_steps": 4, "optim.grad_accum": 4}
    )
    assert cli.main(["train", *one]) == 0
    run = tmp_path / "split22"
    settings = train_settings(
        run,
        tiny_qwen3_dir,
        qwen_data,
        **{"optim.max_steps": 4, "optim.grad_accum": 2},
        **{"parallel.placement": '"split"', "parallel.target_ranks": 2},
    )
    _torchrun(4, settings)
    _same_curve(read_metrics(run), read_metrics(control))


def test_gradient_sync_defers_the_reduction_for_ddp_and_fsdp2(monkeypatch) -> None:
    """Gradient accumulation: every micro-batch but the last skips the cross-replica reduction,
    with DDP's `no_sync` and FSDP2's `set_requires_gradient_sync` alike (FSDP2 modules have
    no `no_sync`; probing for it silently reduced every micro-batch)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from flashdraft.train.parallel import gradient_sync

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
        with gradient_sync(ddp, enabled=False):
            assert not ddp.require_backward_grad_sync
        assert ddp.require_backward_grad_sync

        fsdp = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
        calls: list[bool] = []
        monkeypatch.setattr(fsdp, "set_requires_gradient_sync", calls.append)
        with gradient_sync(fsdp, enabled=False):
            assert calls == [False]
        assert calls == [False, True]
        with gradient_sync(fsdp, enabled=True):
            pass
        assert calls == [False, True]
    finally:
        dist.destroy_process_group()


# ---- the compiled target forward (small targets are launch-bound eagerly) ----


@pytest.mark.parametrize(
    ("scope", "precision"),
    [("layers", "bf16"), ("layers", "fp8"), pytest.param("stack", "bf16", marks=pytest.mark.slow)],
)
def test_the_compiled_target_is_one_graph_for_every_row(scope, precision) -> None:
    """compile_target: "stack" traces the taps' hooks into one graph of the whole stack,
    "layers" compiles each decoder layer's forward with the hooks outside it, one graph for
    all layers (a graph per layer would make the cold compile grow with depth). Either way:
    the eager taps and labels, no graph break, and rows with new document boundaries reuse
    the graph (for "stack", dynamo guards on the hooks' dict being empty, which
    `features()` ensures: a stale capture recompiles), and the HF model outside the packed
    forward stays eager. The same over FP8 linear layers (`target.precision = "fp8"`)."""
    from helpers import tiny_llama

    from flashdraft.model.target import Target, set_precision
    from flashdraft.train.parallel import compile_target, target_compile_refusal

    target = Target(tiny_llama(), [1, 2], "sdpa")
    set_precision(target.model, precision)
    labels_at = torch.arange(40)[None]
    eager = [target.packed_outputs(*random_packed_row(s), labels_at) for s in range(3)]
    graphs: list[object] = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    assert target_compile_refusal(target) is None
    torch._dynamo.reset()
    compile_target(target, backend=counting_backend, scope=scope)
    compiled = [target.packed_outputs(*random_packed_row(s), labels_at) for s in range(3)]
    assert len(graphs) == 1
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a.features, b.features) and torch.equal(a.next_tokens, b.next_tokens)
    # The HF model itself stays eager (the HF eval loop's shapes change every step).
    with torch.no_grad():
        target.model(input_ids=torch.arange(7)[None], use_cache=False)
    target.taps.features()
    assert len(graphs) == 1
    if scope == "stack":
        target.taps.captured[1] = torch.zeros(1)  # a stale capture: the guard fails
        target.packed_outputs(*random_packed_row(3), labels_at)
        assert len(graphs) == 2
    with pytest.raises(ValueError, match="layers or stack"):
        compile_target(target, scope="model")


def test_hybrid_targets_are_not_compiled() -> None:
    from types import SimpleNamespace

    from flashdraft.train.parallel import target_compile_refusal

    hybrid = SimpleNamespace(
        config=SimpleNamespace(layer_types=["linear_attention", "full_attention"]),
        base=torch.nn.Linear(2, 2),
    )
    assert "hybrid" in (target_compile_refusal(hybrid) or "")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["layers", "stack"])
def test_the_compiled_flex_target_matches_the_eager_one_on_cuda(tiny_qwen3_dir, scope) -> None:
    """bf16, flex attention with a new BlockMask per row: the compiled forward (per layer or
    the whole stack) gives the eager taps (to bf16 rounding) and labels, and compiles once
    for rows of one length."""
    from torch._dynamo.utils import counters

    from flashdraft.model.target import Target, load_target
    from flashdraft.train.parallel import compile_target

    model = load_target(str(tiny_qwen3_dir), "bfloat16", "flex_attention", "cuda")
    target = Target(model, [1, 3], "flex")
    labels_at = torch.arange(200, device="cuda")[None]
    rows = [tuple(t.cuda() for t in random_packed_row(s, 256)) for s in range(3)]
    eager = [target.packed_outputs(*row, labels_at) for row in rows]
    torch._dynamo.reset()
    compile_target(target, scope=scope)
    graphs = []  # unique graphs after each row: the first row compiles, the others reuse
    compiled = []
    for row in rows:
        compiled.append(target.packed_outputs(*row, labels_at))
        graphs.append(int(counters["stats"]["unique_graphs"]))
    # The first row builds 2 graphs (H200, torch 2.11, both scopes): the target's, and the
    # BlockMask builder's (`attention._create_block_mask`, compiled anew after the reset: on
    # the CPU the same row gives 2 unique graphs while a counting backend given to
    # compile_target sees 1). What matters here: a new row does not recompile
    assert graphs[0] == graphs[-1], graphs
    for a, b in zip(eager, compiled, strict=True):
        f1, l1, f2, l2 = a.features, a.next_tokens, b.features, b.next_tokens
        assert float((f1.float() - f2.float()).abs().max() / f1.float().abs().max()) < 2e-2
        assert float((l1 == l2).float().mean()) > 0.95  # argmax may flip at bf16 near-ties
