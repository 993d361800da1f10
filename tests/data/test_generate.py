"""`flashdraft generate`: the config and its recorded settings, reading jobs, the whole run
(a scripted backend for the bookkeeping, the real SmolLM2 for the rest), resume after a kill."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flashdraft import cli
from flashdraft.data.formats import Message, parse_record
from flashdraft.data.generate import (
    GenerateConfig,
    Summary,
    generate,
    open_backend,
    read_jobs,
    render_prompt,
    run_generation,
)
from flashdraft.data.inference import Generated, HFBackend, Sampling
from flashdraft.data.jobs import BadInput, Job
from flashdraft.data.output_log import rejected_url

REPO = Path(__file__).resolve().parents[2]
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
        for kw in ({"shard": "0/2"}, {"shard": "1/2"})
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


def test_turns_all_answers_only_what_prepare_trains(tmp_path: Path) -> None:
    """A prompt record's prompt is context (`Message.trained`): `--turns all` regenerates
    its completion or open turn only. Answering the prompt's assistant turns would train
    them as completions, and a second pass over generate's own output (each record holding
    the earlier turns in its prompt) would answer every earlier turn once per later record."""
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    prompts = _write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"id": "chat", "messages": [*chat, {"role": "assistant", "content": "Bye!"}]},
            {"id": "gen#3", "prompt": chat, "completion": "Bye!"},  # what generate writes
            {"id": "tail", "prompt": chat, "completion": [{"role": "assistant", "content": "B"}]},
            {"id": "bare", "prompt": chat},
            {
                "id": "empty",
                "prompt": [*chat, {"role": "assistant", "content": "x"}],
                "completion": [],
            },
        ],
    )
    items = list(read_jobs(_config(prompts, tmp_path / "out.jsonl", turns="all"), set(), Summary()))
    assert _ids(items) == ["chat#1", "chat#3", "gen#3#3", "tail#3", "bare#3"]
    (bad,) = [i for i in items if isinstance(i, BadInput)]
    assert bad.source.endswith(":5") and "no assistant turn to regenerate" in bad.reason


def test_config_rejects_outputs_that_cannot_be_appended(tmp_path: Path) -> None:
    for bad in ("out.jsonl.gz", "out.json", "out.rejected.jsonl"):
        with pytest.raises(ValueError, match=r"plain \.jsonl"):
            _config(tmp_path / "in.jsonl", tmp_path / bad)
    assert rejected_url("/x/out.jsonl") == "/x/out.rejected.jsonl"


def test_config_checks_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"shard = '2/2' is not allowed: K/N with 0 <= K < N"):
        GenerateConfig(target="m", prompts=["p"], output="o.jsonl", shard="2/2")
    with pytest.raises(ValueError, match=r"shard = '1-2'"):
        GenerateConfig(target="m", prompts=["p"], output="o.jsonl", shard="1-2")
    with pytest.raises(ValueError, match=r"dtype = 'int8'"):
        GenerateConfig(target="m", prompts=["p"], output="o.jsonl", dtype="int8")
    with pytest.raises(ValueError, match=r"prompts"):
        GenerateConfig(target="m", prompts=[], output="o.jsonl")
    config = GenerateConfig(target="m", prompts=["p"], output="o.jsonl", shard="3/8")
    assert (config.shard_index, config.num_shards) == (3, 8)


def test_recorded_settings_of_a_default_config_are_pinned() -> None:
    """Every record carries these settings and a resumed run must match them exactly, so
    outputs written by earlier versions must still compare equal."""
    config = GenerateConfig(target="/models/Qwen3-8B/", prompts=["p"], output="o.jsonl")
    assert list(config.settings([151645, 151643]).items()) == [
        ("target", "Qwen3-8B"),
        ("thinking", False),
        ("temperature", 0.0),
        ("top_p", 1.0),
        ("top_k", 0),
        ("max_new_tokens", 2048),
        ("seed", 0),
        ("stop_token_ids", [151645, 151643]),
    ]
    other = GenerateConfig(
        target="m",
        prompts=["p"],
        output="o.jsonl",
        thinking="on",
        sampling=Sampling(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64),
        seed=3,
        batch_size=4,  # batching is not a setting: it may differ on resume
    )
    assert other.settings([2]) == {
        "target": "m",
        "thinking": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_new_tokens": 64,
        "seed": 3,
        "stop_token_ids": [2],
    }


def test_qwen3_prompt_follows_the_thinking_switch(qwen3_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    prompt = [Message("user", "Hi")]
    off = tokenizer.decode(render_prompt(tokenizer, prompt, thinking=False))
    on = tokenizer.decode(render_prompt(tokenizer, prompt, thinking=True))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


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


def _smol_config(
    target: Path, prompts: Path, out: Path, max_new_tokens: int, **kw: Any
) -> GenerateConfig:
    """Greedy SmolLM2 on the CPU, two prompts a batch, truncated answers kept."""
    return GenerateConfig(
        target=str(target),
        prompts=[str(prompts)],
        output=str(out),
        sampling=Sampling(temperature=0.0, max_new_tokens=max_new_tokens),
        batch_size=2,
        device="cpu",
        keep_truncated=True,
        progress=False,
        **kw,
    )


def test_generate_is_the_whole_command(tmp_path: Path, smollm2_dir: Path) -> None:
    """The library entry point, called as the demo calls it."""
    prompts = _write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "What is 2+2?"}, {"prompt": "Name a color."}]
    )
    out = tmp_path / "out.jsonl"
    config = _smol_config(smollm2_dir, prompts, out, 4)
    summary = generate(config)
    assert (summary.written, summary.backend) == (2, "hf")
    assert "generate: 2 written to" in summary.describe(config.output)
    records = _read_jsonl(out)
    assert {r["generation"]["target"] for r in records} == {smollm2_dir.name}
    # Other settings are refused before the target is loaded.
    with pytest.raises(ValueError, match="other settings"):
        generate(GenerateConfig(target=str(smollm2_dir), prompts=[str(prompts)], output=str(out)))


def test_one_backend_serves_several_generate_calls(tmp_path: Path, smollm2_dir: Path) -> None:
    """A prompt file answered in two calls (as experiments/quality.py's chunks are) with one
    `open_backend`: the same records as one call that loads its own, the load counted only
    where it happened; a backend with other stop ids is refused."""
    questions = ["What is 2+2?", "Name a color.", "Say hello.", "What is the capital of France?"]
    records = [{"id": f"q{i}", "prompt": q} for i, q in enumerate(questions)]
    prompts = _write_jsonl(tmp_path / "p.jsonl", records)

    def config(out: Path, limit: int | None, **kw: Any) -> GenerateConfig:
        return _smol_config(smollm2_dir, prompts, out, 6, limit=limit, **kw)

    alone = generate(config(tmp_path / "alone.jsonl", None))
    assert alone.load_s > 0
    backend = open_backend(config(tmp_path / "two.jsonl", 2))
    first = generate(config(tmp_path / "two.jsonl", 2), backend=backend)
    second = generate(config(tmp_path / "two.jsonl", None), backend=backend)
    assert (first.written, second.written, second.already_done) == (2, 2, 2)
    assert first.load_s == second.load_s == 0 and second.tokenize_s > 0
    answers = {r["id"]: r["completion"] for r in _read_jsonl(tmp_path / "alone.jsonl")}
    assert {r["id"]: r["completion"] for r in _read_jsonl(tmp_path / "two.jsonl")} == answers
    with pytest.raises(ValueError, match="stops at"):
        generate(config(tmp_path / "other.jsonl", None, stop_token_ids=[7]), backend=backend)


def test_the_static_backend_writes_the_hf_backends_records(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    """`--backend static` (slots on a static cache, sdpa or flex steps) writes the same
    records as `--backend hf` at T = 0; the backend is not a recorded setting, so either may
    resume the other's output."""
    prompts = _write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "What is 2+2?"}, {"prompt": "Name a color."}, {"prompt": "Say hi."}],
    )
    outputs = {}
    for name, backend, attention in (
        ("hf", "hf", "sdpa"),
        ("static", "static", "sdpa"),
        ("static-flex", "static", "flex"),  # --static-attention flex
    ):
        out = tmp_path / f"{name}.jsonl"
        config = GenerateConfig(
            target=str(smollm2_dir),
            prompts=[str(prompts)],
            output=str(out),
            sampling=Sampling(temperature=0.0, max_new_tokens=6),
            backend=backend,
            batch_size=2,
            device="cpu",
            keep_truncated=True,
            progress=False,
            static_attention=attention,
        )
        assert generate(config).backend == backend
        outputs[name] = _read_jsonl(out)
    assert outputs["static"] == outputs["hf"] and len(outputs["hf"]) == 3
    assert outputs["static-flex"] == outputs["hf"]


class _FailsOn:
    """A tokenizer whose chat template raises for one prompt text (as a template's
    raise_exception does), everything else passed through."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        self.tokenizer, self.text = tokenizer, text

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> Any:
        if any(m["content"] == self.text for m in messages):
            from jinja2 import TemplateError

            raise TemplateError("no")
        return self.tokenizer.apply_chat_template(messages, **kw)

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.tokenizer(*args, **kw)


@pytest.mark.parametrize("target", ["smollm2", "qwen3"])
def test_a_window_encoded_as_one_batch_gives_each_prompts_own_ids(
    target: str, smollm2_dir: Path, qwen3_tokenizer_dir: Path
) -> None:
    """`_tokenize` renders a window's prompts and encodes them as one batch: the ids are
    those of each prompt alone (no padding, no special tokens added), and a prompt whose
    template fails is reported without shifting the others' ids."""
    from flashdraft.assets import chitchat_conversations
    from flashdraft.data.generate import _tokenize

    path = smollm2_dir if target == "smollm2" else qwen3_tokenizer_dir
    tokenizer = AutoTokenizer.from_pretrained(path)
    jobs = [
        Job(f"c{i}", f"chitchat:{i}", [Message(m["role"], m["content"]) for m in r["messages"][:3]])
        for i, r in enumerate(chitchat_conversations(limit=12))
    ]
    jobs.insert(5, Job("bad", "x:1", [Message("user", "FAIL")]))
    config = _config(Path("in.jsonl"), Path("out.jsonl"), target=str(path))
    summary = Summary()
    kept, prompts = _tokenize(jobs, _FailsOn(tokenizer, "FAIL"), config, None, summary)
    assert [j.id for j in kept] == [j.id for j in jobs if j.id != "bad"]
    assert summary.bad_inputs == 1
    assert prompts == [render_prompt(tokenizer, j.prompt, thinking=False) for j in kept]
    assert len({len(p) for p in prompts}) > 1  # unequal lengths: nothing was padded
