import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flashdraft import cli
from flashdraft.data.formats import Message, RecordError, parse_record
from flashdraft.data.generate import (
    BadInput,
    GenerateConfig,
    Job,
    OutputLog,
    Summary,
    batch_seed,
    drop_partial_line,
    jobs_from_record,
    make_record,
    plan_batches,
    read_jobs,
    record_key,
    rejected_url,
    render_prompt,
    run_generation,
    split_reasoning,
)
from flashdraft.data.inference import Generated, HFBackend, Sampling

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_EOS = 2


def _write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _config(prompts: Path, output: Path | str, **kw: Any) -> GenerateConfig:
    sampling = Sampling(max_new_tokens=kw.pop("max_new_tokens", 8))
    return GenerateConfig(
        target=kw.pop("target", "model"),
        prompts=[str(prompts)],
        output=str(output),
        sampling=sampling,
        progress=False,
        **kw,
    )


# ---------------------------------------------------------------------------------------------
# Inputs and ids


def test_messages_regenerate_the_last_or_every_assistant_turn() -> None:
    record = {
        "id": "chat-1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye!"},
        ],
    }
    (last,) = jobs_from_record(record, "f:1", "last")
    assert last.id == "chat-1#4"
    assert [m.role for m in last.prompt] == ["system", "user", "assistant", "user"]
    every = jobs_from_record(record, "f:1", "all")
    assert [j.id for j in every] == ["chat-1#2", "chat-1#4"]
    assert [m.content for m in every[0].prompt] == ["Be brief.", "Hi"]


def test_a_conversation_ending_in_a_user_turn_asks_for_the_next_turn() -> None:
    record = {"messages": [{"role": "user", "content": "Hi"}]}
    (job,) = jobs_from_record(record, "f:1", "last")
    assert job.id == f"{record_key(record)}#1"
    assert [m.content for m in job.prompt] == ["Hi"]
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "Bye"},
        ]
    }
    assert [j.id.split("#")[1] for j in jobs_from_record(sharegpt, "f:2", "all")] == ["1", "3"]


def test_prompt_records_with_or_without_completion() -> None:
    (bare,) = jobs_from_record({"prompt": "Hi", "system": "Be brief."}, "f:1", "last")
    assert [(m.role, m.content) for m in bare.prompt] == [("system", "Be brief."), ("user", "Hi")]
    (answered,) = jobs_from_record({"id": 7, "prompt": "Hi", "completion": "Hello"}, "f:2", "all")
    assert answered.id == "7#1"
    assert [m.content for m in answered.prompt] == ["Hi"]


def test_bad_records_raise_with_the_reason() -> None:
    with pytest.raises(RecordError, match="start with a user turn"):
        jobs_from_record({"messages": [{"role": "assistant", "content": "x"}]}, "f:1", "last")
    with pytest.raises(RecordError, match="none of"):
        jobs_from_record({"text": "x"}, "f:1", "last")
    with pytest.raises(RecordError, match="not an object"):
        jobs_from_record([1], "f:1", "last")


def test_ids_are_stable_and_content_derived_without_an_id() -> None:
    a = {"prompt": "Hi"}
    assert record_key(a) == record_key({"prompt": "Hi"}) == record_key(json.loads(json.dumps(a)))
    assert record_key(a) != record_key({"prompt": "Hi!"})
    assert record_key({"id": "x", "prompt": "Hi"}) == "x"
    assert len(record_key(a)) == 16


def test_read_jobs_counts_bad_lines_duplicates_limit_and_shards(tmp_path: Path) -> None:
    prompts = tmp_path / "in.jsonl"
    records = [{"id": f"p{i}", "prompt": f"q{i}"} for i in range(6)]
    _write_jsonl(prompts, [records[0], {"bogus": 1}, records[1], records[0], *records[2:]])
    with prompts.open("a") as f:
        f.write("{cut\n")
    cfg = _config(prompts, tmp_path / "out.jsonl")
    summary = Summary()
    items = list(read_jobs(cfg, {"p2#1"}, summary))
    assert _ids(items) == ["p0#1", "p1#1", "p3#1", "p4#1", "p5#1"]
    # Unknown shape, duplicate id, malformed JSON: each reported with file:line.
    bad = [i.source for i in items if isinstance(i, BadInput)]
    assert bad == [f"{prompts}:2", f"{prompts}:4", f"{prompts}:9"]
    assert (summary.records_read, summary.duplicates, summary.already_done) == (9, 1, 1)

    limited = _config(prompts, tmp_path / "out.jsonl", limit=3)  # done ones count too
    assert _ids(read_jobs(limited, set(), Summary())) == ["p0#1", "p1#1"]
    shards = [
        set(_ids(read_jobs(_config(prompts, tmp_path / "o.jsonl", **kw), set(), Summary())))
        for kw in ({"shard_index": 0, "num_shards": 2}, {"shard_index": 1, "num_shards": 2})
    ]
    assert shards[0].isdisjoint(shards[1])
    assert shards[0] | shards[1] == {f"p{i}#1" for i in range(6)}


def test_the_output_is_never_read_back_as_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    _write_jsonl(data / "in.jsonl", [{"id": "a", "prompt": "Hi"}])
    _write_jsonl(data / "out.jsonl", [{"id": "b", "prompt": "Hi", "completion": "Hello"}])
    _write_jsonl(data / "out.rejected.jsonl", [{"id": "c", "prompt": "Hi"}])
    cfg = GenerateConfig(target="m", prompts=["data"], output="data/out.jsonl", progress=False)
    assert _ids(read_jobs(cfg, set(), Summary())) == ["a#1"]


def _ids(items: Iterable[Job | BadInput]) -> list[str]:
    return [i.id for i in items if isinstance(i, Job)]


def test_config_rejects_outputs_that_cannot_be_appended(tmp_path: Path) -> None:
    for bad in ("out.jsonl.gz", "out.json", "out.rejected.jsonl"):
        with pytest.raises(ValueError, match=r"plain \.jsonl"):
            _config(tmp_path / "in.jsonl", tmp_path / bad)
    assert rejected_url("/x/out.jsonl") == "/x/out.rejected.jsonl"


def test_qwen3_prompt_follows_the_thinking_switch(qwen3_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    prompt = [Message("user", "Hi")]
    off = tokenizer.decode(render_prompt(tokenizer, prompt, thinking=False))
    on = tokenizer.decode(render_prompt(tokenizer, prompt, thinking=True))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------
# Batching


def test_batches_sort_by_length_and_respect_size_and_token_budget() -> None:
    lengths = [5, 50, 7, 48, 6, 30]
    batches = plan_batches(lengths, batch_size=2, max_batch_tokens=None, max_new_tokens=10)
    assert batches == [[1, 3], [5, 2], [4, 0]]
    budget = plan_batches(lengths, batch_size=8, max_batch_tokens=130, max_new_tokens=10)
    assert sorted(i for b in budget for i in b) == list(range(6))
    for batch in budget:
        assert len(batch) == 1 or len(batch) * (max(lengths[i] for i in batch) + 10) <= 130
    assert budget[0] == [1, 3]  # 2 × (50 + 10) = 120 fits, a third row would not


def test_batch_seed_depends_on_seed_and_batch_only() -> None:
    assert batch_seed(0, ["a", "b"]) == batch_seed(0, iter(["a", "b"]))
    assert len({batch_seed(0, ["a", "b"]), batch_seed(1, ["a", "b"]), batch_seed(0, ["b"])}) == 3


# ---------------------------------------------------------------------------------------------
# Records


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


# ---------------------------------------------------------------------------------------------
# Output file and resume


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


# ---------------------------------------------------------------------------------------------
# The whole run: a scripted backend for the bookkeeping, the real SmolLM2 for the rest


class EchoBackend:
    """Answers every prompt with its own length, so a mixed-up batch is caught."""

    name = "echo"
    max_positions = None
    schedules_batches = False

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.stop_ids = [SMOLLM2_EOS]
        self.batches: list[int] = []

    def generate(
        self, prompts: list[list[int]], seed: int, on_tokens: Callable[[int], None]
    ) -> list[Generated]:
        self.batches.append(len(prompts))
        outs = [Generated(self.tokenizer.encode(f"len {len(p)}"), "stop") for p in prompts]
        on_tokens(sum(o.num_generated for o in outs))
        return outs


def test_run_keeps_each_answer_with_its_prompt_and_writes_to_any_url(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = [f"Question {'x ' * (i * 7 % 11)}{i}?" for i in range(10)]
    prompts = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": q} for q in questions])
    for output in (str(tmp_path / "out.jsonl"), "memory://gen/run/out.jsonl"):
        cfg = _config(prompts, output, batch_size=3, sort_window=4)
        backend = EchoBackend(tokenizer)
        summary = run_generation(cfg, backend, tokenizer)
        assert (summary.written, summary.prompts, sum(summary.rejected.values())) == (10, 10, 0)
        assert backend.batches == [3, 1, 3, 1, 2]  # windows of 4 prompts, batches of 3
        with fsspec.open(output, "rt") as f:
            records = [json.loads(line) for line in f]
        assert sorted(r["prompt"][0]["content"] for r in records) == sorted(questions)
        for r in records:
            assert r["completion"] == f"len {r['prompt_tokens']}"
        rerun = run_generation(cfg, EchoBackend(tokenizer), tokenizer)
        assert (rerun.written, rerun.already_done) == (0, 10)


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> tuple[Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return tokenizer, model


def _smol_backend(smol: tuple[Any, Any], max_new_tokens: int, *extra_stop: int) -> HFBackend:
    _, model = smol
    sampling = Sampling(max_new_tokens=max_new_tokens)
    return HFBackend(model, sampling, [SMOLLM2_EOS, *extra_stop], SMOLLM2_EOS)


def test_truncated_and_empty_outputs_are_separated(
    tmp_path: Path, smollm2_dir: Path, smol: tuple[Any, Any]
) -> None:
    tokenizer, _ = smol
    records = [
        {"id": "short", "prompt": "What is 2+2?"},  # answers in 11 tokens
        {"id": "long", "prompt": "Write a long story about a dragon."},
        {"id": "empty", "prompt": "Say hello."},
    ]
    prompts = _write_jsonl(tmp_path / "in.jsonl", records)
    # Force an empty answer: stop on the token SmolLM2 greedily starts "Say hello." with.
    hello = render_prompt(tokenizer, [Message("user", "Say hello.")], thinking=False)
    first = _smol_backend(smol, 1).generate([hello], 0, lambda n: None)[0].token_ids[0]
    out = tmp_path / "out.jsonl"
    cfg = _config(prompts, out, target=str(smollm2_dir), max_new_tokens=14, stop_token_ids=[first])
    backend = _smol_backend(smol, 14, first)
    summary = run_generation(cfg, backend, tokenizer)

    kept, rejected = _read_jsonl(out), _read_jsonl(tmp_path / "out.rejected.jsonl")
    assert [r["id"] for r in kept] == ["short#1"]
    assert kept[0]["finish_reason"] == "stop"
    assert kept[0]["completion"] == "The answer to this classic math problem is 4."
    assert parse_record(kept[0])[-1] == Message("assistant", kept[0]["completion"])
    assert {r["id"]: (r["reason"], r["finish_reason"]) for r in rejected} == {
        "long#1": ("length", "length"),
        "empty#1": ("empty", "stop"),
    }
    assert all("completion" not in r for r in rejected)
    assert summary.written == 1
    assert summary.rejected == {"length": 1, "empty": 1}
    assert summary.generated_tokens == sum(r["completion_tokens"] for r in kept + rejected)
    # Rejected ids are done too: a re-run generates nothing.
    rerun = run_generation(cfg, backend, tokenizer)
    assert (rerun.already_done, rerun.generated_tokens) == (3, 0)


def _lines(*paths: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in paths if p.exists())


def test_resume_after_kill_has_no_duplicates_and_no_gaps(
    tmp_path: Path, smollm2_dir: Path, smol: tuple[Any, Any]
) -> None:
    tokenizer, _ = smol
    questions = ["What is 2+2?", "Name a color.", "Say hello.", "What is the capital of France?"]
    questions += ["Reply with one word: yes or no?", "Hi", "Count to three.", "Name a fruit."]
    prompts = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": q} for q in questions])
    options = {"target": str(smollm2_dir), "max_new_tokens": 6, "batch_size": 1}

    # An uninterrupted run is the reference.
    reference = tmp_path / "ref.jsonl"
    run_generation(_config(prompts, reference, **options), _smol_backend(smol, 6), tokenizer)
    expected = _read_jsonl(reference) + _read_jsonl(tmp_path / "ref.rejected.jsonl")
    assert len(expected) == len(questions)

    # The CLI in a subprocess, killed (SIGKILL: no clean-up) once a few records are written.
    out = tmp_path / "out.jsonl"
    side = tmp_path / "out.rejected.jsonl"
    command = [sys.executable, "-m", "flashdraft.cli", "generate", "--target", str(smollm2_dir)]
    command += ["--prompts", str(prompts), "--output", str(out), "--max-new-tokens", "6"]
    command += ["--batch-size", "1", "--device", "cpu", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with (tmp_path / "stderr.txt").open("wb") as stderr:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 120
        while _lines(out, side) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()
    written = _lines(out, side)
    assert 2 <= written < len(questions)
    # And a crash in the middle of a write: half a line at the end.
    with out.open("ab") as f:
        f.write(b'{"id": "' + expected[-1]["id"].encode() + b'", "source": "')

    summary = run_generation(_config(prompts, out, **options), _smol_backend(smol, 6), tokenizer)
    assert summary.already_done == written
    got = _read_jsonl(out) + _read_jsonl(side)
    ids = [r["id"] for r in got]
    assert len(ids) == len(set(ids))  # no duplicates
    assert sorted(ids) == sorted(r["id"] for r in expected)  # no gaps, the same ids
    by_id = {r["id"]: r for r in got}
    assert all(by_id[r["id"]] == r for r in expected)  # and the same records


def test_cli_reports_a_missing_input_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing, out = str(tmp_path / "nope.jsonl"), str(tmp_path / "out.jsonl")
    code = cli.main(["generate", "--target", "x", "--prompts", missing, "--output", out])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_keep_truncated_writes_cut_answers_to_the_main_output(tmp_path, smollm2_dir) -> None:
    """--keep-truncated: answers cut at max-new-tokens are kept (counted), not side-filed."""
    from flashdraft import cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Tell me a long story about a dragon."}) + "\n")
    out = tmp_path / "out.jsonl"
    args = [
        "generate",
        "--target",
        str(smollm2_dir),
        "--prompts",
        str(prompts),
        "--output",
        str(out),
        "--max-new-tokens",
        "4",
        "--no-progress",
        "--device",
        "cpu",
    ]
    assert cli.main([*args, "--keep-truncated"]) == 0
    record = json.loads(out.read_text())
    assert record["finish_reason"] == "length" and record["completion"]
    assert record["completion_tokens"] == 4
