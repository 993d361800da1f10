"""`generate --backend openai`: the client's pieces alone, then whole runs against a real
OpenAI-compatible server (llama.cpp's, through llama-cpp-python, serving the SmolLM2 GGUF):
every prompt answered once, a server SIGKILLed mid-run, faults injected by a proxy, and the
answers through `prepare` and `audit`."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_server
import pytest
from llama_server import API_KEY, MODEL, FaultProxy, LlamaServer

from flashdraft import cli
from flashdraft.config import ConfigError
from flashdraft.data.audit import Thresholds, audit_dataset
from flashdraft.data.dataset import open_dataset
from flashdraft.data.formats import parse_record
from flashdraft.data.generate import GenerateConfig, Summary, _write_answers, generate
from flashdraft.data.inference import Sampling
from flashdraft.data.jobs import jobs_from_record
from flashdraft.data.openai_backend import (
    Completion,
    Failure,
    OpenAIClient,
    Reply,
    ServerError,
    ServerOptions,
    backoff,
    parse_completion,
    request_body,
)
from flashdraft.data.output_log import OutputLog, answer_record, errors_url, rejected_url

# The real-server tests: marked `server` (`make server-test`, run by `make test` and CI, out
# of the default `pytest` run), skipped with the reason where llama_cpp is not installed.
needs_server = pytest.mark.skipif(not llama_server.available(), reason=llama_server.SKIP_REASON)
KEY_ENV = "FLASHDRAFT_TEST_KEY"

QUESTIONS = [
    "Reply with one word: yes or no?",
    "What is 2+2?",
    "Name a colour.",
    "What is the capital of France?",
    "Say hello in French.",
    "Is the sun a star?",
    "Name a fruit.",
    "What is 3 times 3?",
    "Name a planet.",
    "What day comes after Monday?",
    "Name an animal that flies.",
    "What is the opposite of cold?",
]


def _prompts(path: Path, count: int) -> Path:
    records = [
        {"id": f"q{i}", "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _config(
    prompts: Path, output: Path, url: str, sampling: Sampling | None = None, **server: Any
) -> GenerateConfig:
    from flashdraft.assets import smollm2_path

    options = {"model": MODEL, "concurrency": 2, "retry_backoff": 0.02, "api_key_env": KEY_ENV}
    return GenerateConfig(
        target=str(smollm2_path()),
        prompts=[str(prompts)],
        output=str(output),
        backend="openai",
        server=ServerOptions(base_url=url, **{**options, **server}),
        sampling=sampling or Sampling(max_new_tokens=8),
        keep_truncated=True,  # short answers, most cut: kept, so prepare has every one
        progress=False,
    )


def _ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def _answered(output: Path) -> Counter[str]:
    return Counter(_ids(output) + _ids(Path(rejected_url(str(output)))))


# ---------------------------------------------------------------------------------------------
# The pieces, without a server


def test_backoff_grows_with_full_jitter_and_honours_retry_after() -> None:
    waits = [backoff(attempt, 1.0) for attempt in range(8) for _ in range(50)]
    assert min(waits) >= 0 and max(waits) <= 60
    assert max(backoff(3, 1.0) for _ in range(200)) > 4  # up to 8 s at the fourth retry
    assert len({round(w, 6) for w in waits}) > 300  # jittered, not in lockstep
    assert backoff(0, 1.0, floor=7.0) >= 7.0


def test_replies_become_the_records_prepare_reads() -> None:
    (job,) = jobs_from_record(
        {"id": "t", "messages": [{"role": "user", "content": "Weather?"}], "tools": [{"a": 1}]},
        "f:1",
        "last",
    )
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    body = {
        "choices": [
            {
                "index": 0,
                "message": {"content": "", "reasoning_content": "hmm", "tool_calls": [call]},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 5},
    }
    completion = parse_completion(body)
    (reply,) = completion.replies
    record, reason = answer_record(
        job,
        text=reply.text,
        finish_reason=reply.finish_reason,
        prompt_tokens=9,
        completion_tokens=completion.completion_tokens,
        settings={},
        reasoning=reply.reasoning,
        tool_calls=reply.tool_calls,
    )
    assert reason is None and record["tools"] == [{"a": 1}]
    # The turn with its call and reasoning is the trained turn of the record.
    turn = parse_record(json.loads(json.dumps(record)))[-1]
    assert (turn.role, turn.content, turn.reasoning, turn.trained) == ("assistant", "", "hmm", True)
    assert turn.extra["tool_calls"] == [call]
    # Without a server-side reasoning parser, the <think> block in the text is split off.
    plain = parse_completion({"choices": [{"message": {"content": "<think>a</think>B"}}]})
    record, reason = answer_record(
        job, text=plain.replies[0].text, finish_reason="stop", prompt_tokens=9,
        completion_tokens=None, settings={},
    )  # fmt: skip
    assert reason is None and (record["reasoning"], record["completion"]) == ("a", "B")


def test_request_body_passes_every_sampling_setting() -> None:
    sampling = Sampling(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=64)
    body = request_body(
        [{"role": "user", "content": "Hi"}], None, sampling, seed=7, n=3, thinking=True
    )
    assert body == {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 64,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "seed": 7,
        "n": 3,
        "chat_template_kwargs": {"enable_thinking": True},
    }
    greedy = request_body([], None, Sampling(top_k=20), seed=0)
    assert (greedy["temperature"], greedy["top_p"], "top_k" in greedy) == (0.0, 1.0, False)


def test_config_refusals(tmp_path: Path, smollm2_dir: Path) -> None:
    prompts = _prompts(tmp_path / "in.jsonl", 1)
    with pytest.raises(ConfigError, match=r"base_url.*--backend openai needs"):
        GenerateConfig(target="t", prompts=[str(prompts)], output="o.jsonl", backend="openai")
    with pytest.raises(ConfigError, match=r"answers_per_prompt.*temperature above 0"):
        _config(prompts, tmp_path / "o.jsonl", "http://x", answers_per_prompt=2)
    # Issue 76: --thinking on with a template that has no switch would record a lie.
    config = _config(prompts, tmp_path / "o.jsonl", "http://127.0.0.1:9/v1")
    config.thinking = "on"
    with pytest.raises(ValueError, match=r"no thinking switch.*use --thinking off"):
        generate(config)


def test_an_unreachable_server_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = _prompts(tmp_path / "in.jsonl", 2)
    url = f"http://127.0.0.1:{llama_server.free_port()}/v1"
    argv = ["generate", "--target", _config(prompts, tmp_path / "o.jsonl", url).target]
    argv += ["--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]
    assert cli.main([*argv, "--backend", "openai", "--base-url", url, "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == f"generate: cannot reach {url} (ConnectError); is the server running there? (--base-url)"
    )
    assert not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# Against a real server


@pytest.fixture(scope="module")
def server() -> Iterator[LlamaServer]:
    if not llama_server.available():
        pytest.skip(llama_server.SKIP_REASON)
    with LlamaServer() as running:
        yield running


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, API_KEY)


@pytest.mark.server
@needs_server
def test_every_prompt_is_answered_once_and_feeds_prepare_and_audit(
    tmp_path: Path, server: LlamaServer, smollm2_dir: Path
) -> None:
    prompts = _prompts(tmp_path / "in.jsonl", 6)
    output = tmp_path / "out.jsonl"
    summary = generate(_config(prompts, output, server.url, concurrency=3))
    assert _answered(output) == Counter(f"q{i}#1" for i in range(6))
    assert (summary.written, summary.failed, summary.retries) == (6, 0, 0)
    # The server renders SmolLM2's template as its tokenizer does: the counts agree.
    assert summary.template_mismatches == 0 and summary.generated_tokens > 6
    record = json.loads(output.read_text().splitlines()[0])
    assert record["generation"]["target"] == "smollm2-135m-instruct"
    assert record["completion"] and record["prompt_tokens"] > 10
    # Each answer is its own prompt's: the server answers q3's question alone the same way
    # (greedy), whatever else the concurrent requests carried.
    records = {json.loads(line)["id"]: json.loads(line) for line in output.read_text().splitlines()}
    client = OpenAIClient(ServerOptions(base_url=server.url, model=MODEL, api_key_env=KEY_ENV))
    alone = client.complete(
        request_body(records["q3#1"]["prompt"], None, Sampling(max_new_tokens=8), seed=0)
    )
    assert not isinstance(alone, Failure)
    assert alone.replies[0].text == records["q3#1"]["completion"]
    assert records["q3#1"]["prompt"][-1]["content"] == QUESTIONS[3]

    again = generate(_config(prompts, output, server.url))  # nothing left to do
    assert (again.already_done, again.written) == (6, 0)

    data = tmp_path / "data"
    argv = ["prepare", str(output), "--tokenizer", str(smollm2_dir), "--output", str(data)]
    assert cli.main([*argv, "--workers", "1", "--no-progress"]) == 0
    report = audit_dataset(open_dataset(str(data)), None, Thresholds())
    assert report.samples == 6


@pytest.mark.server
@needs_server
def test_wrong_model_and_refused_key_are_one_line(
    tmp_path: Path, server: LlamaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _prompts(tmp_path / "in.jsonl", 1)
    with pytest.raises(ServerError, match=rf"does not serve model 'gpt-9' \(it serves {MODEL}\); fix --model"):  # fmt: skip
        generate(_config(prompts, tmp_path / "o.jsonl", server.url, model="gpt-9"))
    monkeypatch.setenv(KEY_ENV, "wrong")
    with pytest.raises(ServerError, match=rf"refused the API key \(HTTP 401\); set \${KEY_ENV}"):
        generate(_config(prompts, tmp_path / "o.jsonl", server.url))
    # No model named: the server's only one.
    monkeypatch.setenv(KEY_ENV, API_KEY)
    client = OpenAIClient(ServerOptions(base_url=server.url, api_key_env=KEY_ENV))
    client.probe(request_body([{"role": "user", "content": "Hi"}], None, Sampling(max_new_tokens=1), seed=0))  # fmt: skip
    assert client.model == MODEL


@pytest.mark.server
@needs_server
def test_faults_are_retried_and_counted_and_nothing_is_lost(
    tmp_path: Path, server: LlamaServer
) -> None:
    prompts = _prompts(tmp_path / "in.jsonl", 6)
    output = tmp_path / "out.jsonl"
    faults: list[int | str] = [503, "close", 429, 500, "close", 502]
    with FaultProxy(server.url, faults) as proxy:
        summary = generate(_config(prompts, output, proxy.url, max_retries=6))
    assert proxy.injected == 6
    assert (summary.retries, summary.failed, summary.written) == (6, 0, 6)
    assert _answered(output) == Counter(f"q{i}#1" for i in range(6))

    # Out of retries: the prompts go to the errors file, and the next run answers them.
    output = tmp_path / "out2.jsonl"
    with FaultProxy(server.url, [503, 503, "close", "close"]) as proxy:
        summary = generate(_config(prompts, output, proxy.url, max_retries=1, concurrency=1))
    assert (summary.failed, summary.retries, summary.written) == (2, 2, 4)
    failed = _ids(Path(errors_url(str(output))))
    assert len(failed) == 2 and not set(failed) & set(_answered(output))
    summary = generate(_config(prompts, output, server.url))
    assert (summary.already_done, summary.written) == (4, 2)
    assert _answered(output) == Counter(f"q{i}#1" for i in range(6))


@pytest.mark.server
@needs_server
def test_a_server_killed_mid_run_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """SIGKILL the server while requests are in flight, start another, run the same command
    again: every prompt answered exactly once."""
    count = 12
    prompts = _prompts(tmp_path / "in.jsonl", count)
    output = tmp_path / "out.jsonl"
    first = LlamaServer().start()
    outcome: dict[str, Any] = {"summary": Summary()}

    def run() -> None:
        try:
            generate(_config(prompts, output, first.url, max_retries=1), outcome["summary"])
        except ServerError as err:
            outcome["error"] = err

    thread = threading.Thread(target=run)
    try:
        thread.start()
        deadline = time.monotonic() + 120
        while sum(_answered(output).values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        first.kill()
        thread.join(timeout=120)
    finally:
        first.stop()
    assert not thread.is_alive()
    done = _answered(output)
    assert 2 <= len(done) < count and max(done.values()) == 1
    assert "server looks down" in str(outcome.get("error", "")) or outcome["summary"].failed

    with LlamaServer() as second:  # a new server (a new port, as after a reschedule)
        summary = generate(_config(prompts, output, second.url))
    assert summary.already_done == len(done) and summary.written == count - len(done)
    assert _answered(output) == Counter(f"q{i}#1" for i in range(count))


@pytest.mark.server
@needs_server
def test_a_server_rendering_another_template_is_warned_about(
    tmp_path: Path,
    server: LlamaServer,
    tiny_qwen3_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`prepare` will render with Qwen3's template (no default system prompt), the server
    renders SmolLM2's: every prompt's count differs, warned once, counted."""
    prompts = _prompts(tmp_path / "in.jsonl", 2)
    config = _config(prompts, tmp_path / "out.jsonl", server.url)
    config.target = str(tiny_qwen3_dir)  # a Qwen3 target folder: Qwen3's tokenizer
    summary = generate(config)
    assert (summary.written, summary.template_mismatches) == (2, 2)
    warnings = [r.message for r in caplog.records if "prompt tokens" in r.message]
    assert len(warnings) == 2  # the probe's and the first prompt's, then only counted
    assert "its chat template or tokenizer differs" in warnings[0]


def test_answers_per_prompt_are_records_of_their_own(tmp_path: Path) -> None:
    """n answers of one request: ids ID, ID~1, ...; answer 0 written last (its id marks the
    prompt done, so a write cut in between redoes the prompt)."""
    prompts = _prompts(tmp_path / "in.jsonl", 1)
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    config = _config(prompts, tmp_path / "o.jsonl", "http://x", sampling, answers_per_prompt=3)
    (job,) = jobs_from_record({"id": "q", "prompt": "Hi"}, "f:1", "last")
    replies = [Reply(text, None, None, "stop") for text in ("A", "", "C")]  # "" is rejected
    output = OutputLog(config.output)
    summary = Summary()
    _write_answers(job, 5, Completion(replies, 5, 12), config, {}, output, summary)
    output.close()
    assert _ids(tmp_path / "o.jsonl") == ["q#1~2", "q#1"]
    assert _ids(tmp_path / "o.rejected.jsonl") == ["q#1~1"]
    assert (summary.written, summary.rejected["empty"], summary.short_replies) == (2, 1, 0)


@pytest.mark.server
@needs_server
def test_a_server_without_n_gives_one_answer_per_prompt_and_a_warning(
    tmp_path: Path, server: LlamaServer, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = _prompts(tmp_path / "in.jsonl", 2)
    sampling = Sampling(temperature=0.8, max_new_tokens=8)
    config = _config(prompts, tmp_path / "out.jsonl", server.url, sampling, answers_per_prompt=2)
    summary = generate(config)  # llama-cpp-python's server drops `n`
    assert (summary.written, summary.short_replies) == (2, 2)
    assert _answered(tmp_path / "out.jsonl") == Counter(["q0#1", "q1#1"])
    assert any("it may not support n" in r.message for r in caplog.records)


@pytest.mark.server
@needs_server
def test_the_guides_command_line_runs(tmp_path: Path, server: LlamaServer) -> None:
    """docs/data.md's `--backend openai` line (tests/test_docs.py leaves it out: it needs a
    server) runs against the real one, its values swapped for SmolLM2's and small ones."""
    from flashdraft.assets import smollm2_path

    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    start = text.index('OPENAI_API_KEY="$KEY" flashdraft generate')
    line = text[start : text.index("```", start)].replace("\\\n", " ")
    argv = line.split()[2:]  # after the key and `flashdraft`
    swap = {
        "--base-url": server.url,
        "--model": MODEL,
        "--target": str(smollm2_path()),
        "--prompts": str(_prompts(tmp_path / "in.jsonl", 2)),
        "--output": str(tmp_path / "out.jsonl"),
        "--thinking": "off",  # SmolLM2's template has no switch
        "--max-new-tokens": "8",
        "--concurrency": "2",
    }
    assert set(swap) <= set(argv)
    for i, word in enumerate(argv[:-1]):
        if word in swap:
            argv[i + 1] = swap[word]
    assert cli.main([*argv, "--api-key-env", KEY_ENV, "--keep-truncated", "--no-progress"]) == 0
    assert _answered(tmp_path / "out.jsonl") == Counter(["q0#1", "q1#1"])
