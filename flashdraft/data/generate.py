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
and tokenizer (tests, benchmarks).
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
from flashdraft.data.output_log import OutputLog, make_record, rejected_url
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
        help="the chat template's thinking switch (enable_thinking) while rendering prompts",
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
    backend: Literal["auto", "hf", "static", "vllm"] = option(
        "auto",
        help="auto: static on cuda (static KV cache, continuous batching, CUDA graphs) for the "
        "targets it supports, else hf; vllm (in-process vLLM, not covered by the tests) only "
        "when asked for",
    )
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
        "dense parts too (dynamic shapes; on an H200 within the noise of the eager prefill, "
        "so off by default: docs/speed.md)",
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
    vllm_kwargs: dict[str, Any] = option(factory=dict, help="JSON object for vllm.LLM(...)")
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
        return settings


# -- input ---------------------------------------------------------------------------------


def read_jobs(config: GenerateConfig, done: set[str], summary: Summary) -> Iterator[Job | BadInput]:
    """Jobs still to do, in input order, and the bad input lines (counted by the caller)."""
    # Never read our own output back as input (an input directory may hold it).
    own = {storage.filesystem(u)[1] for u in (config.output, rejected_url(config.output))}
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
    """The target's tokenizer, which must have a chat template (warns when `thinking` is
    asked of a template without the switch)."""
    with model_errors(target, "--target"):
        tokenizer = AutoTokenizer.from_pretrained(target)
    template = tokenizer.chat_template or ""
    if not template:
        raise ValueError(f"the tokenizer of {target} has no chat template")
    if thinking and "enable_thinking" not in template:
        log.warning(
            "generate: the chat template has no enable_thinking switch; "
            "the target thinks (or not) as its template decides"
        )
    return tokenizer


def render_prompt(tokenizer: Any, prompt: list[Message], thinking: bool) -> list[int]:
    """Prompt token ids through the target's chat template, generation prompt appended.

    `enable_thinking` is read by templates with a thinking switch (Qwen3), ignored by others.
    """
    return encode_texts(tokenizer, [prompt_text(tokenizer, prompt, thinking)])[0]


def prompt_text(tokenizer: Any, prompt: list[Message], thinking: bool) -> str:
    """The prompt through the target's chat template, generation prompt appended, as text."""
    text = tokenizer.apply_chat_template(
        [m.to_openai() for m in prompt],
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
        vllm_kwargs=config.vllm_kwargs,
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
    if output.done:
        log.info(f"generate: resuming, {len(output.done)} ids already done")
    if output.dropped_bytes:
        log.warning(f"generate: dropped a partial last line ({output.dropped_bytes} B)")
    if output.unreadable_lines:
        log.warning(f"generate: {output.unreadable_lines} unreadable output lines")
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
            texts.append(prompt_text(tokenizer, job.prompt, config.thinking == "on"))
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
