"""Logging: INFO to stdout, warnings to stderr, a rank tag under torchrun."""

from __future__ import annotations

from flashdraft.log import get_logger


def test_info_goes_to_stdout_and_warnings_to_stderr(capsys, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    log = get_logger("flashdraft.test")
    log.info("hello %s", "world")
    log.warning("careful")
    out, err = capsys.readouterr()
    assert out == "hello world\n" and err == "careful\n"


def test_every_line_is_tagged_with_the_rank_under_torchrun(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    get_logger("test.module").info("two\nlines")
    assert capsys.readouterr().out == "[rank 3] two\n[rank 3] lines\n"


def test_module_names_are_placed_under_the_flashdraft_logger() -> None:
    assert get_logger("flashdraft.train").name == "flashdraft.train"
    assert get_logger("bench.trainer").name == "flashdraft.bench.trainer"


def test_trace_writes_one_json_line_per_event_per_rank(tmp_path, monkeypatch) -> None:
    import json

    from flashdraft.log import trace

    monkeypatch.delenv("FLASHDRAFT_TRACE", raising=False)
    trace("row", index=1)  # off: nothing written anywhere
    monkeypatch.setenv("FLASHDRAFT_TRACE", str(tmp_path))
    monkeypatch.setenv("RANK", "2")
    trace("row", epoch=0, index=5)
    trace("write", what="checkpoint")
    lines = (tmp_path / "trace-rank2.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"event": "row", "rank": 2, "node": None, "epoch": 0, "index": 5},
        {"event": "write", "rank": 2, "node": None, "what": "checkpoint"},
    ]
