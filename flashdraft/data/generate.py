"""`flashdraft generate`: regenerate assistant turns with the target (on-policy data) for `prepare`.

A drafter learns the target's own distribution best, so the dataset's answers are replaced by
the target's. Inputs are what `prepare` reads (formats.py) plus bare prompts: a prompt record
without a completion, or a conversation ending in a user turn ("answer this"). Each
regenerated turn becomes one prompt/completion record, one JSON object per line:

    {"id": "chitchat/17#3", "source": "in.jsonl:12", "prompt": [<messages before the turn>],
     "completion": "...", "reasoning": "..." (only when the target thought),
     "finish_reason": "stop", "prompt_tokens": 412, "completion_tokens": 96,
     "generation": {"target": ..., "thinking": ..., "temperature": ..., ...}}

`completion_tokens` counts what the target generated, its stop token included (as OpenAI-style
usage does). Ids are stable (`jobs.py`), and a re-run skips ids already written: the output is
an append-only log (`output_log.py`) whose records all carry the same `generation` settings,
the config fields tagged "generation" (`GenerateConfig.settings`).

`generate(config)` is the whole command; `run_generation` is its loop over a given backend
and tokenizer (tests, benchmarks), `run_openai` its loop over a running server's answers
(`--backend openai`, `openai_backend.py`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from jinja2 import TemplateError
from tqdm import tqdm
from transformers import AutoTokenizer

from flashdraft import config as cfg
from flashdraft import storage
from flashdraft.config import option
from flashdraft.data.formats import Message, RecordError, read_records
from flashdraft.data.inference import (
    DTYPE_CHOICES,
    GenerationBackend,
    Sampling,
    load_backend,
    stop_token_ids,
)
from flashdraft.data.jobs import BadInput, Job, batch_seed, jobs_from_record, plan_batches, shard_of
from flashdraft.data.openai_backend import (
    Completion,
    OpenAIClient,
    ServerError,
    ServerOptions,
    request_body,
)
from flashdraft.data.output_log import (
    OutputLog,
    answer_record,
    error_record,
    errors_url,
    make_record,
    rejected_url,
)
from flashdraft.log import get_logger
from flashdraft.model.hub import model_errors

log = get_logger(__name__)

_RECORDED = ("generation",)  # carried by every output record (`GenerateConfig.settings`)
_SHARD = re.compile(r"([0-9]+)/([0-9]+)")
_MAX_EXAMPLES = 10  # bad input lines reported; all are counted


@dataclass(kw_only=True, slots=True)
class GenerateConfig:
    """`flashdraft generate`: every option, declared once (flags, defaults, checks, records)."""

    target: str = option(help="the target: an HF model directory (or hub name)", tags=_RECORDED)
    prompts: list[str] = option(
        metavar="INPUT",
        help="JSONL files, globs, directories or URLs: prompts, conversations or completions",
    )
    output: str = option(
        metavar="OUT.jsonl",
        help="where the records go, appended (running again resumes); rejected answers go "
        "to OUT.rejected.jsonl",
    )
    thinking: Literal["on", "off"] = option(
        "off",
        help="the chat template's thinking switch (enable_thinking) while rendering prompts; "
        "on is refused for a template without the switch",
        tags=_RECORDED,
    )
    sampling: Sampling = field(default_factory=Sampling)
    seed: int = option(
        0, help="seeds sampling, per batch (a resumed run draws the same tokens)", tags=_RECORDED
    )
    stop_token_ids: list[int] = option(
        factory=list,
        ge=0,
        help="stop on these ids too (the target's own eos ids always stop)",
        tags=_RECORDED,
    )
    turns: Literal["last", "all"] = option(
        "last",
        help="regenerate the last assistant turn of each conversation, or each one (the "
        "assistant turns inside a prompt record's prompt are context, never regenerated)",
    )
    backend: Literal["auto", "hf", "static", "openai"] = option(
        "auto",
        help="auto: static on cuda (static KV cache, continuous batching, CUDA graphs) for the "
        "targets it supports, else hf; openai: a running OpenAI-compatible server (vLLM, "
        "SGLang, llama.cpp) at --base-url, only when asked for",
    )
    server: ServerOptions = field(default_factory=ServerOptions)
    batch_size: int = option(
        32, ge=1, help="prompts per batch at most (static backend: prompts decoded at once)"
    )
    max_batch_tokens: int | None = option(
        None, ge=1, help="token budget per batch: rows × (longest prompt + max new tokens)"
    )
    static_attention: Literal["sdpa", "flex", "varlen"] = option(
        "varlen",
        help="static backend: the decode steps' attention (varlen: the flash kernel over each "
        "slot's own positions, one graph for every length, CUDA in half precision, elsewhere "
        "sdpa; 53.2K -> 66.8K tok/s on an H200; sdpa: every slot up to the longest request's "
        "position, masked; flex: each slot's own K/V blocks)",
    )
    static_compile: bool = option(
        True,
        help="static backend on CUDA: compile the decode steps' norms, projections, RoPE and "
        "MLP (one graph for all layers; 10.2 -> 8.4 ms per step at 512 slots on an H200)",
    )
    static_compile_prefill: bool = option(
        False,
        help="static backend on CUDA, with --static-compile: compile the prefill batches' "
        "dense parts too (dynamic shapes; on an H200 50.0K tok/s vs 53.2K eager, within the "
        "noise, so off by default: benchmarks/small_targets_h200_20261203_s17.md)",
    )
    static_min_admit: int = option(
        1,
        ge=1,
        help="static backend: new prompts wait until this many slots are free (fewer, larger "
        "prefill batches; the tokens do not change; no faster on the synthetic bench, where "
        "every request has the same length; real answers not yet timed)",
    )
    sort_window: int = option(4096, ge=1, help="prompts read ahead and sorted by length at once")
    limit: int | None = option(
        None, ge=0, help="only the first N prompts of the input (done ones included)"
    )
    shard: str = option(
        "0/1",
        metavar="K/N",
        help="do part K of N (0 <= K < N); jobs are assigned by a hash of their id",
    )
    device: str | None = option(None, help="default: cuda when available")
    dtype: str = option(
        "auto", choices=DTYPE_CHOICES, help="auto: bfloat16 on cuda, float32 on cpu"
    )
    precision: Literal["bf16", "fp8"] = option(
        "bf16",
        help="the target's linear layers: bf16 (in --dtype) or fp8 (float8 weights and "
        "per-token activations, as FP8 servers run it; CUDA sm_89+, emulated on the CPU); "
        "fp8 records say so in their settings",
    )
    progress: bool = option(True, help="progress bar on standard error (--no-progress: none)")
    keep_truncated: bool = option(
        False,
        help="keep answers cut at --max-new-tokens in the main output (counted; the chat "
        "template closes them with its end-of-turn token); default: side file",
    )

    def __post_init__(self) -> None:
        cfg.validate(self)
        if not self.prompts:
            raise cfg.ConfigError("prompts", self.prompts, "name at least one input")
        if not self.output.endswith(".jsonl") or self.output.endswith(".rejected.jsonl"):
            raise cfg.ConfigError(
                "output",
                self.output,
                "a plain .jsonl file (uncompressed, so that it can be appended to), not "
                "ending in .rejected.jsonl",
            )
        match = _SHARD.fullmatch(self.shard)
        if match is None or int(match[1]) >= int(match[2]):
            raise cfg.ConfigError("shard", self.shard, "K/N with 0 <= K < N, e.g. 0/8")
        if self.backend == "openai" and not self.server.base_url:
            raise cfg.ConfigError(
                "base_url",
                None,
                "--backend openai needs the server's URL, e.g. http://localhost:8000/v1",
            )
        if self.server.answers_per_prompt > 1 and (
            self.backend != "openai" or self.sampling.greedy
        ):
            raise cfg.ConfigError(
                "answers_per_prompt",
                self.server.answers_per_prompt,
                "more than 1 needs --backend openai and a --temperature above 0",
            )

    @property
    def shard_index(self) -> int:
        return int(self.shard.partition("/")[0])

    @property
    def num_shards(self) -> int:
        return int(self.shard.partition("/")[2])

    def settings(self, stop_ids: list[int]) -> dict[str, Any]:
        """What every record carries; a resumed run must match it (batching may differ).

        The fields tagged "generation", as the target used them: its directory name, the
        thinking switch as a bool, and every stop id (the target's eos ids first).
        """
        settings = cfg.settings(self, "generation")
        settings["target"] = os.path.basename(self.target.rstrip("/"))
        settings["thinking"] = self.thinking == "on"
        settings["stop_token_ids"] = stop_ids
        if self.precision != "bf16":  # absent in bf16: earlier outputs stay resumable
            settings["precision"] = self.precision
        return settings


# -- input ---------------------------------------------------------------------------------


def read_jobs(config: GenerateConfig, done: set[str], summary: Summary) -> Iterator[Job | BadInput]:
    """Jobs still to do, in input order, and the bad input lines (counted by the caller)."""
    # Never read our own output back as input (an input directory may hold it).
    outputs = (config.output, rejected_url(config.output), errors_url(config.output))
    own = {storage.filesystem(u)[1] for u in outputs}
    urls = [u for u in storage.expand_inputs(config.prompts) if storage.filesystem(u)[1] not in own]
    seen: set[str] = set()
    for url in urls:
        for source, value in read_records(url):
            summary.records_read += 1
            try:
                if isinstance(value, RecordError):
                    raise value
                jobs = jobs_from_record(value, source, config.turns)
            except RecordError as err:
                yield BadInput(source, str(err))
                continue
            for job in jobs:
                if config.limit is not None and summary.prompts >= config.limit:
                    return
                summary.prompts += 1
                if (
                    config.num_shards > 1
                    and shard_of(job.id, config.num_shards) != config.shard_index
                ):
                    continue
                if job.id in seen:
                    summary.duplicates += 1
                    yield BadInput(source, f"duplicate id {job.id!r} (ids must be unique)")
                    continue
                seen.add(job.id)
                if job.id in done:
                    summary.already_done += 1
                    continue
                yield job


def load_chat_tokenizer(target: str, thinking: bool) -> Any:
    """The target's tokenizer, which must have a chat template, and a thinking switch when
    `thinking` is asked for (else every record would say `"thinking": true` of a target
    that thinks, or not, as its template decides)."""
    with model_errors(target, "--target"):
        tokenizer = AutoTokenizer.from_pretrained(target)
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer of {target} has no chat template")
    if thinking and not has_thinking_switch(tokenizer):
        raise ValueError(
            f"--thinking on: the chat template of {target} has no thinking switch "
            "(enable_thinking); use --thinking off (the template decides whether it thinks)"
        )
    return tokenizer


def has_thinking_switch(tokenizer: Any) -> bool:
    return "enable_thinking" in (tokenizer.chat_template or "")


def render_prompt(
    tokenizer: Any,
    prompt: list[Message],
    thinking: bool,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Prompt token ids through the target's chat template, generation prompt appended.

    `enable_thinking` is read by templates with a thinking switch (Qwen3), ignored by others.
    """
    return encode_texts(tokenizer, [prompt_text(tokenizer, prompt, thinking, tools)])[0]


def prompt_text(
    tokenizer: Any,
    prompt: list[Message],
    thinking: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt through the target's chat template, generation prompt appended, as text
    (with the record's `tools`, as `prepare` renders it)."""
    text = tokenizer.apply_chat_template(
        [m.to_openai() for m in prompt],
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    return str(text)


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of rendered prompts, as one batch: a fast tokenizer encodes a list on all
    cores (one by one, encoding was ~85% of the ~1 ms a 317-token prompt took on 2 cores;
    the batch took 0.44x the time there). The template writes the special tokens (bos
    included) itself."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


# -- the run -------------------------------------------------------------------------------


@dataclass(slots=True)
class Summary:
    records_read: int = 0
    prompts: int = 0  # turns to regenerate in the input, after --limit, before --shard
    bad_inputs: int = 0
    duplicates: int = 0  # part of bad_inputs
    already_done: int = 0
    written: int = 0
    truncated_kept: int = 0  # finish_reason "length" written with --keep-truncated
    rejected: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0  # generation loop wall time, model loading excluded
    load_s: float = 0.0  # loading the backend (0 when the caller passed one in)
    tokenize_s: float = 0.0  # inside `seconds`: prompts through the template and tokenizer
    bad_examples: list[str] = field(default_factory=list)
    backend: str = ""  # the backend's name, once it is loaded
    # --backend openai: tries beyond the first, prompts written to OUT.errors.jsonl, and
    # prompts whose token count the server saw differently (its template differs).
    retries: int = 0
    failed: int = 0
    template_mismatches: int = 0
    short_replies: int = 0  # requests answered with fewer answers than --answers-per-prompt

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rejected"] = dict(self.rejected)
        out["tokens_per_s"] = round(self.tokens_per_s, 1)
        return out

    def describe(self, output: str) -> str:
        """The summary a person reads, for the run that wrote `output`."""
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(self.rejected.items())) or "none"
        kept = (
            f" ({self.truncated_kept} cut at max-new-tokens, kept)" if self.truncated_kept else ""
        )
        return "\n".join(
            [
                f"generate: {self.written} written to {output}{kept}",
                f"  rejected: {sum(self.rejected.values())} ({rejected}) in {rejected_url(output)}",
                f"  input: {self.records_read} records, {self.prompts} prompts, "
                f"{self.already_done} already done, {self.bad_inputs} bad "
                f"({self.duplicates} duplicate ids)",
                f"  {self.generated_tokens} tokens generated in {self.seconds:.1f} s "
                f"= {self.tokens_per_s:.1f} tok/s ({self.backend}; prompts tokenized in "
                f"{self.tokenize_s:.1f} s of it; backend loaded in {self.load_s:.1f} s)",
                *(
                    [
                        f"  requests: {self.retries} retries, {self.failed} failed (in "
                        f"{errors_url(output)}; run again to retry them), "
                        f"{self.template_mismatches} prompts counted differently by the server"
                    ]
                    if self.backend == "openai"
                    else []
                ),
            ]
        )


def generate(
    config: GenerateConfig,
    summary: Summary | None = None,
    backend: GenerationBackend | None = None,
) -> Summary:
    """The whole of `flashdraft generate`: every pending turn of `config.prompts` answered
    by the target into `config.output`; returns the counts.

    Everything that can be refused is checked before the target is loaded: the inputs
    exist, the tokenizer has a chat template, the output holds no records generated with
    other settings. `summary` is filled in place, so a caller still has the counts after an
    interrupt. `backend`: one `open_backend` built for a config of the same target,
    sampling and backend settings (a caller answering one prompt file in several calls
    keeps its model, caches and graphs between them); None loads one.
    """
    storage.expand_inputs(config.prompts)
    tokenizer = load_chat_tokenizer(config.target, config.thinking == "on")
    stop_ids = stop_token_ids(config.target, config.stop_token_ids)
    output = OutputLog(config.output)
    output.check_settings(config.settings(stop_ids))
    summary = summary if summary is not None else Summary()
    if config.backend == "openai":
        return run_openai(config, tokenizer, stop_ids, output=output, summary=summary)
    if backend is None:
        started = time.perf_counter()
        backend = open_backend(config)
        summary.load_s = time.perf_counter() - started
    elif list(backend.stop_ids) != stop_ids:
        raise ValueError(
            f"generate: the backend given stops at {backend.stop_ids}, this config at {stop_ids}"
        )
    return run_generation(config, backend, tokenizer, output=output, summary=summary)


def open_backend(config: GenerateConfig) -> GenerationBackend:
    """The backend `generate(config)` loads, to pass to several `generate` calls."""
    if config.backend == "openai":
        raise ValueError("--backend openai answers through a server: call generate(config)")
    tokenizer = load_chat_tokenizer(config.target, config.thinking == "on")
    stop_ids = stop_token_ids(config.target, config.stop_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    return load_backend(
        config.backend,
        config.target,
        config.sampling,
        stop_ids,
        pad_id,
        device=config.device,
        dtype=config.dtype,
        precision=config.precision,
        batch_size=config.batch_size,
        max_batch_tokens=config.max_batch_tokens,
        static_attention=config.static_attention,
        static_compile=config.static_compile,
        static_min_admit=config.static_min_admit,
        static_compile_prefill=config.static_compile_prefill,
    )


def run_generation(
    config: GenerateConfig,
    backend: GenerationBackend,
    tokenizer: Any,
    *,
    output: OutputLog | None = None,
    summary: Summary | None = None,
) -> Summary:
    """Generate every pending prompt of `config` into its output with `backend`; returns
    the counts (`summary`, filled in place)."""
    summary = summary if summary is not None else Summary()
    summary.backend = backend.name
    settings = config.settings(backend.stop_ids)
    output = output if output is not None else OutputLog(config.output)
    output.check_settings(settings)
    _report_resume(output)
    bar = _progress(config.progress)
    start = time.perf_counter()
    try:
        jobs_read = read_jobs(config, output.done, summary)
        for window in _windows(jobs_read, config.sort_window, summary):
            started = time.perf_counter()
            jobs, prompts = _tokenize(window, tokenizer, config, backend.max_positions, summary)
            summary.tokenize_s += time.perf_counter() - started
            if backend.schedules_batches:
                batches = [list(range(len(jobs)))] if jobs else []
            else:
                batches = plan_batches(
                    [len(p) for p in prompts],
                    batch_size=config.batch_size,
                    max_batch_tokens=config.max_batch_tokens,
                    max_new_tokens=config.sampling.max_new_tokens,
                )
            for batch in batches:
                seed = batch_seed(config.seed, (jobs[i].id for i in batch))
                outs = backend.generate([prompts[i] for i in batch], seed, bar.update)
                kept: dict[str, list[dict[str, Any]]] = {"ok": [], "rejected": []}
                for i, out in zip(batch, outs, strict=True):
                    text = tokenizer.decode(out.token_ids, skip_special_tokens=False)
                    record, reason = make_record(
                        jobs[i], prompts[i], out, text, settings, config.keep_truncated
                    )
                    kept["ok" if reason is None else "rejected"].append(record)
                    if reason is not None:
                        summary.rejected[reason] += 1
                    elif out.finish_reason == "length":
                        summary.truncated_kept += 1
                    summary.prompt_tokens += len(prompts[i])
                    summary.generated_tokens += out.num_generated
                output.append("ok", kept["ok"])
                output.append("rejected", kept["rejected"])
                summary.written += len(kept["ok"])
                bar.set_postfix(written=summary.written, rejected=sum(summary.rejected.values()))
    finally:
        summary.seconds = time.perf_counter() - start
        bar.close()
        output.close()
    return summary


def run_openai(
    config: GenerateConfig,
    tokenizer: Any,
    stop_ids: list[int],
    *,
    output: OutputLog | None = None,
    summary: Summary | None = None,
    client: OpenAIClient | None = None,
) -> Summary:
    """Every pending prompt of `config` answered by the server at `--base-url` into its
    output (`--backend openai`); returns the counts (`summary`, filled in place).

    Each answer is appended (and fsynced) as it arrives, so a kill loses only the requests
    in flight, which a re-run sends again; a request that failed after its last retry goes
    to OUT.errors.jsonl and is sent again by a re-run too. `tokenizer` (the target's, which
    `prepare` will use) renders each prompt only to count its tokens, compared with the
    server's count. Raises ServerError when the server is unusable at the start, or looks
    down (as many requests in a row failed as are in flight, at least 4).
    """
    summary = summary if summary is not None else Summary()
    summary.backend = "openai"
    settings = config.settings(stop_ids)
    output = output if output is not None else OutputLog(config.output)
    output.check_settings(settings)
    _report_resume(output)
    owned = client is None
    client = client if client is not None else OpenAIClient(config.server)
    thinking = config.thinking == "on" if has_thinking_switch(tokenizer) else None

    def body(job: Job, sampling: Sampling = config.sampling) -> dict[str, Any]:
        return request_body(
            [m.to_openai() for m in job.prompt],
            job.tools,
            sampling,
            seed=batch_seed(config.seed, [job.id]) % 2**31,  # the same per job on a re-run
            n=config.server.answers_per_prompt,
            thinking=thinking,
            stop_token_ids=config.stop_token_ids,
        )

    def requests() -> Iterator[tuple[tuple[Job, int], dict[str, Any]]]:
        for window in _windows(
            read_jobs(config, output.done, summary), config.sort_window, summary
        ):
            started = time.perf_counter()
            jobs, prompts = _tokenize(window, tokenizer, config, None, summary)
            summary.tokenize_s += time.perf_counter() - started
            for job, ids in zip(jobs, prompts, strict=True):
                yield (job, len(ids)), body(job)

    bar = _progress(config.progress)
    start = time.perf_counter()
    try:
        hello = Job("probe", "probe", [Message("user", "Hello")])
        probe = client.probe(body(hello, dataclasses.replace(config.sampling, max_new_tokens=1)))
        summary.load_s = time.perf_counter() - start
        summary.retries += probe.retries
        ours = len(render_prompt(tokenizer, hello.prompt, config.thinking == "on"))
        _check_template(probe, ours, config.target, "a one-line prompt")
        log.info(f"generate: {config.server.base_url} serves {client.model}")
        in_a_row = 0  # transient failures since the last answer
        for (job, prompt_tokens), result in client.complete_all(requests()):
            summary.retries += result.retries
            if isinstance(result, Completion):
                in_a_row = 0
                _write_answers(job, prompt_tokens, result, config, settings, output, summary)
                bar.update(result.completion_tokens or 0)
                if summary.template_mismatches == 0:
                    _check_template(result, prompt_tokens, config.target, job.id)
                summary.template_mismatches += result.prompt_tokens not in (None, prompt_tokens)
            else:
                summary.failed += 1
                output.append("errors", [error_record(job, result.error, result.retries, settings)])
                if summary.failed <= _MAX_EXAMPLES:
                    log.warning(f"generate: {job.id} failed: {result.error}")
                in_a_row = in_a_row + 1 if result.transient else 0
                if in_a_row >= max(4, config.server.concurrency):
                    raise ServerError(
                        f"generate: {in_a_row} requests in a row failed (last: {result.error}); "
                        "the server looks down: run the same command again when it is back "
                        "(the answers written are kept)"
                    )
            bar.set_postfix(
                written=summary.written,
                rejected=sum(summary.rejected.values()),
                failed=summary.failed,
                retries=summary.retries,
            )
    finally:
        summary.seconds = time.perf_counter() - start
        bar.close()
        output.close()
        if owned:
            client.close()
    return summary


def _write_answers(
    job: Job,
    prompt_tokens: int,
    result: Completion,
    config: GenerateConfig,
    settings: dict[str, Any],
    output: OutputLog,
    summary: Summary,
) -> None:
    """One record per answer of `result` (ids ID, ID~1, ...), appended in one write."""
    kept: dict[str, list[dict[str, Any]]] = {"ok": [], "rejected": []}
    one = len(result.replies) == 1  # usage counts all the answers of a request together
    asked = config.server.answers_per_prompt
    if len(result.replies) != asked and not summary.short_replies:
        log.warning(
            f"generate: the server gave {len(result.replies)} answers to {job.id}, "
            f"{asked} asked (--answers-per-prompt): it may not support n"
        )
    summary.short_replies += len(result.replies) != asked
    for k, reply in enumerate(result.replies):
        record, reason = answer_record(
            job,
            text=reply.text,
            finish_reason=reply.finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=result.completion_tokens if one else None,
            settings=settings,
            keep_truncated=config.keep_truncated,
            reasoning=reply.reasoning,
            tool_calls=reply.tool_calls,
            record_id=job.id if k == 0 else f"{job.id}~{k}",
        )
        kept["ok" if reason is None else "rejected"].append(record)
        if reason is not None:
            summary.rejected[reason] += 1
        elif reply.finish_reason == "length":
            summary.truncated_kept += 1
    # Answer 0 last: its id marks the prompt done, so a cut write leaves it to be redone.
    first = "ok" if kept["ok"] and kept["ok"][0]["id"] == job.id else "rejected"
    for key in sorted(kept, key=lambda key: key == first):
        output.append(key, kept[key][::-1])
    summary.written += len(kept["ok"])
    summary.prompt_tokens += prompt_tokens
    summary.generated_tokens += result.completion_tokens or 0


def _check_template(result: Completion, ours: int, target: str, what: str) -> None:
    if result.prompt_tokens is None or result.prompt_tokens == ours:
        return
    log.warning(
        f"generate: the server counts {result.prompt_tokens} prompt tokens in {what}, the "
        f"tokenizer of {target} (which prepare will use) {ours}: its chat template or "
        "tokenizer differs, so the answers follow prompts the drafter is not trained on; "
        "serve the target's own template (or pass its tokenizer as --target)"
    )


def _report_resume(output: OutputLog) -> None:
    if output.done:
        log.info(f"generate: resuming, {len(output.done)} ids already done")
    if output.dropped_bytes:
        log.warning(f"generate: dropped a partial last line ({output.dropped_bytes} B)")
    if output.unreadable_lines:
        log.warning(f"generate: {output.unreadable_lines} unreadable output lines")


def _report_bad(bad: BadInput, summary: Summary) -> None:
    summary.bad_inputs += 1
    if len(summary.bad_examples) < _MAX_EXAMPLES:
        line = f"{bad.source}: {bad.reason}"
        summary.bad_examples.append(line)
        log.warning(f"generate: skipped {line}")


def _windows(items: Iterator[Job | BadInput], size: int, summary: Summary) -> Iterator[list[Job]]:
    window: list[Job] = []
    for item in items:
        if isinstance(item, BadInput):
            _report_bad(item, summary)
            continue
        window.append(item)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def _tokenize(
    window: list[Job],
    tokenizer: Any,
    config: GenerateConfig,
    limit: int | None,
    summary: Summary,
) -> tuple[list[Job], list[list[int]]]:
    rendered: list[Job] = []
    texts: list[str] = []
    for job in window:
        try:
            texts.append(prompt_text(tokenizer, job.prompt, config.thinking == "on", job.tools))
        except (TemplateError, ValueError) as err:  # e.g. a template's raise_exception
            _report_bad(BadInput(job.source, f"chat template failed: {err}"), summary)
            continue
        rendered.append(job)
    jobs, prompts = [], []
    for job, ids in zip(rendered, encode_texts(tokenizer, texts), strict=True):
        if limit is not None and len(ids) + config.sampling.max_new_tokens > limit:
            why = f"prompt of {len(ids)} tokens + max_new_tokens exceeds the target's {limit}"
            _report_bad(BadInput(job.source, why), summary)
            continue
        jobs.append(job)
        prompts.append(ids)
    return jobs, prompts


def _progress(enabled: bool) -> Any:
    # Not a terminal (a cluster log): a line every 30 s still shows the run is alive.
    interval = 1.0 if sys.stderr.isatty() else 30.0
    return tqdm(
        desc="generate", unit="tok", unit_scale=True, disable=not enabled, mininterval=interval
    )
