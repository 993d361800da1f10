import json

import pytest
from helpers import rows_by_part, train_settings

from flashdraft import cli


def test_bench_times_a_run_config_on_this_device(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys
) -> None:
    settings = train_settings(tmp_path / "unused", tiny_qwen3_dir, qwen_data)
    assert cli.main(["bench", *settings, "--warmup", "0", "--iters", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "run"
    names = [r["what"] for r in result["results"]]
    assert names == [
        "target forward",
        "drafter step",
        "full online step",
        "full online steps, back to back",  # no sync between steps: a run's steady state
    ]
    assert result["overhead_ratio"] > 0 and result["tokens_per_s"] > 0
    assert result["tokens_per_s_back_to_back"] > 0
    assert all(r["median_ms"] > 0 for r in result["results"])


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_bench_with_stacked_rows_counts_every_row(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys
) -> None:
    """optim.rows_per_forward = 2: the parts time one forward of two rows, the full step takes
    grad_accum rows, and tokens/s counts all of them."""
    settings = train_settings(
        tmp_path / "unused",
        tiny_qwen3_dir,
        qwen_data,
        **{"optim.grad_accum": 4, "optim.rows_per_forward": 2},
    )
    assert cli.main(["bench", *settings, "--warmup", "0", "--iters", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rows_by_part(result) == (2, 2, 4, 4)  # target, drafter, full, back to back
    full = result["results"][-2]
    # tokens/s x seconds / rows = the mean real tokens of a packed row: up to a full row.
    per_row = full["tokens_per_s"] * full["median_ms"] / 1000 / 4
    assert 0.5 * full["row"] < per_row <= 1.01 * full["row"]


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_bench_with_the_target_run_ahead_times_whole_groups(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys
) -> None:
    """target.forward_rows = 4, one row a step: the target's part is one forward of 4 rows,
    the drafter's one row, and a full step call is the group of 4 steps the target ran
    ahead for (its forward comes before the group's first step)."""
    settings = train_settings(
        tmp_path / "unused", tiny_qwen3_dir, qwen_data, **{"target.forward_rows": 4}
    )
    assert cli.main(["bench", *settings, "--warmup", "0", "--iters", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rows_by_part(result) == (4, 1, 4, 4)  # target, drafter, full, back to back
    assert result["overhead_ratio"] > 0


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_bench_with_the_target_ahead_as_far_as_the_drafter_stacks(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys
) -> None:
    """target.forward_rows = optim.rows_per_forward = grad_accum = 2: the target's part is
    still its run ahead (it once went through the drafter's batch path and was refused)."""
    extra = {"optim.grad_accum": 2, "optim.rows_per_forward": 2, "target.forward_rows": 2}
    settings = train_settings(tmp_path / "unused", tiny_qwen3_dir, qwen_data, **extra)
    assert cli.main(["bench", *settings, "--warmup", "0", "--iters", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rows_by_part(result)[0] == 2


def test_slowest_kernels_reads_dynamo_s_per_graph_top_kernels(monkeypatch) -> None:
    """Each compiled graph records its slowest Triton compiles as a JSON list of [name, us];
    the helper merges them over graphs (a kernel deduplicated across graphs counts once,
    at its longest), slowest first, in seconds; graphs without the field are skipped."""
    from types import SimpleNamespace

    import torch._dynamo.utils as dynamo_utils

    from flashdraft.train.bench import slowest_kernels

    graphs = [
        SimpleNamespace(triton_kernel_compile_times_us='[["flex_bwd", 41000000], ["mm_a", 900]]'),
        SimpleNamespace(triton_kernel_compile_times_us=None),
        SimpleNamespace(triton_kernel_compile_times_us='[["mm_a", 1200], ["pointwise", 5000]]'),
    ]
    monkeypatch.setattr(dynamo_utils, "get_compilation_metrics", lambda: graphs)
    assert slowest_kernels() == [("flex_bwd", 41.0), ("pointwise", 0.005), ("mm_a", 0.0012)]
    assert slowest_kernels(limit=1) == [("flex_bwd", 41.0)]
