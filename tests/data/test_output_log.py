"""Generations -> output records, and the append-only log that resumes after a crash."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from flashdraft.data.formats import Message, RecordError, parse_record
from flashdraft.data.inference import Generated
from flashdraft.data.jobs import jobs_from_record
from flashdraft.data.output_log import (
    OutputLog,
    drop_partial_line,
    make_record,
    rejected_url,
    split_reasoning,
)


def test_split_reasoning() -> None:
    assert split_reasoning("<think>\nhmm\n</think>\n\nYes.") == ("hmm", "Yes.", True)
    # The template opened the block in the prompt: the output only closes it.
    assert split_reasoning("hmm</think>\n\nYes.") == ("hmm", "Yes.", True)
    assert split_reasoning("Yes.") == (None, "Yes.", True)
    assert split_reasoning("<think>\nhmm, and then") == ("hmm, and then", "", False)


def test_records_round_trip_through_parse_record() -> None:
    (job,) = jobs_from_record(
        {"id": "r", "prompt": [{"role": "user", "content": "Hi"}]}, "f:1", "last"
    )
    settings = {"thinking": True}
    out = Generated([1, 2, 3], "stop")
    record, reason = make_record(job, [9] * 5, out, "<think>\nhmm\n</think>\n\nHello.", settings)
    assert reason is None
    assert (record["prompt_tokens"], record["completion_tokens"]) == (5, 4)
    assert parse_record(json.loads(json.dumps(record))) == [
        Message("user", "Hi"),
        Message("assistant", "Hello.", "hmm"),
    ]
    for text, finish_reason, why in [
        ("Hello", "length", "length"),
        (" \n", "stop", "empty"),
        ("<think>\nhmm", "stop", "unclosed_think"),
        ("<think>hmm</think>\n", "stop", "empty"),
    ]:
        rejected, reason = make_record(job, [9], Generated([1], finish_reason), text, settings)
        assert (reason, rejected["reason"], rejected["text"]) == (why, why, text)
        # A rejected record has no completion: prepare can never train on it.
        with pytest.raises(RecordError):
            parse_record(rejected)


def test_drop_partial_line_local_and_remote(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ')
    assert drop_partial_line(str(path)) == 6
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert drop_partial_line(str(path)) == 0
    path.write_bytes(b'{"c": ')
    assert drop_partial_line(str(path)) == 6
    assert path.read_bytes() == b""
    assert drop_partial_line(str(tmp_path / "missing.jsonl")) == 0
    with fsspec.open("memory://gen/out.jsonl", "wb") as f:
        f.write(b'{"a": 1}\n{"b"')
    assert drop_partial_line("memory://gen/out.jsonl") == 4
    with fsspec.open("memory://gen/out.jsonl", "rb") as f:
        assert f.read() == b'{"a": 1}\n'


def test_output_log_resumes_and_refuses_other_settings(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    settings = {"temperature": 0.0}
    log = OutputLog(str(out))
    log.append("ok", [{"id": "a#1", "generation": settings}])
    log.append("rejected", [{"id": "b#1", "generation": settings}])
    log.close()
    with out.open("ab") as f:
        f.write(b'{"id": "c#1", "gen')  # a crash mid-write
    again = OutputLog(str(out))
    assert again.done == {"a#1", "b#1"}
    assert again.dropped_bytes > 0
    again.check_settings(settings)
    with pytest.raises(ValueError, match="other settings"):
        again.check_settings({"temperature": 0.7})


def test_rejected_answers_go_to_a_side_file(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert rejected_url(str(out)) == str(tmp_path / "out.rejected.jsonl")
    log = OutputLog(str(out))
    log.append("rejected", [{"id": "a#1", "generation": {}}])
    log.append("ok", [])  # nothing to write: no file
    log.close()
    assert not out.exists()
    assert json.loads((tmp_path / "out.rejected.jsonl").read_text())["id"] == "a#1"
    # A line that is not a record is counted, not fatal.
    with out.open("w") as f:
        f.write("not json\n")
    assert OutputLog(str(out)).unreadable_lines == 1
