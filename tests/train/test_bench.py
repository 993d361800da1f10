import json

from helpers import train_settings

from flashdraft import cli


def test_bench_times_a_run_config_on_this_device(
    tmp_path, tiny_qwen3_dir, qwen_data, capsys
) -> None:
    settings = train_settings(tmp_path / "unused", tiny_qwen3_dir, qwen_data)
    assert cli.main(["bench", *settings, "--warmup", "0", "--iters", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "run"
    names = [r["what"] for r in result["results"]]
    assert names == ["target forward", "drafter step", "full online step"]
    assert result["overhead_ratio"] > 0 and result["tokens_per_s"] > 0
    assert all(r["median_ms"] > 0 for r in result["results"])
