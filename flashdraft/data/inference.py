"""Batched generation with the target: prompt token ids in, generated token ids out.

Two in-process backends behind one small interface, so `generate` writes identical records
with either (a running server's answers come through `openai_backend.py` instead):

* `HFBackend`: transformers `generate` on left-padded batches with its KV cache, on any device.
  The reference: its greedy output equals `model.generate` on each prompt alone.
* `StaticBackend`: continuous batching in the slots of a static KV cache, the decode step
  captured as CUDA graphs (`flashdraft.data.fast_inference`); the fast path on GPUs, for the
  target layouts `flashdraft.model.static` supports. Its greedy
  output equals the HF backend's (tested on CPU); at T > 0 a request's tokens depend only on
  its seed, not on the requests it shared steps with.
All stop on the same ids: the target's generation_config eos ids (the real end of turn; a
tokenizer's `eos_token` can be wrong, e.g. SmolLM2's names `<|im_start|>` in some versions)
plus any extra ids the user gives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import AutoTokenizer, GenerationConfig

from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.data.fast_inference import SlotDecoder, cache_length
from flashdraft.log import get_logger
from flashdraft.model.static import unsupported_reason
from flashdraft.model.target import DTYPES, load_target

log = get_logger(__name__)

# `--dtype` values: the target dtypes by name, or auto (bfloat16 on CUDA, float32 on CPU).
DTYPE_CHOICES = ("auto", *DTYPES)

# `generate` records the sampling settings with every output record ("generation").
_RECORDED = ("generation",)


@dataclass(kw_only=True, slots=True)
class Sampling:
    temperature: float = option(0.0, ge=0, help="0 = greedy", tags=_RECORDED)
    top_p: float = option(1.0, gt=0, le=1, help="nucleus sampling share (1 = off)", tags=_RECORDED)
    top_k: int = option(0, ge=0, help="sample among the k most likely (0 = off)", tags=_RECORDED)
    max_new_tokens: int = option(
        2048, ge=1, help="longest answer, its stop token included", tags=_RECORDED
    )

    def __post_init__(self) -> None:
        cfg.validate(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class Generated:
    token_ids: list[int]  # the answer, end-of-turn token excluded
    finish_reason: str  # "stop": a stop token was emitted; "length": max_new_tokens reached

    @property
    def num_generated(self) -> int:
        """Tokens the target produced: the answer and its stop token."""
        return len(self.token_ids) + (self.finish_reason == "stop")


def finish(tokens: Iterable[int], stop_ids: set[int], stopped: bool = False) -> Generated:
    """Cut generated tokens at the first stop token (what follows it is padding).

    `stopped`: the engine reports a stop although no stop id is among `tokens` (an engine
    that leaves the stop token out of its output).
    """
    answer: list[int] = []
    for token in tokens:
        if token in stop_ids:
            return Generated(answer, "stop")
        answer.append(token)
    return Generated(answer, "stop" if stopped else "length")


class GenerationBackend(Protocol):
    name: str
    stop_ids: list[int]
    max_positions: int | None  # prompt + max_new_tokens must fit (None: no known limit)
    schedules_batches: bool  # True: give it many prompts at once, it batches them itself

    def generate(
        self, prompts: list[list[int]], seed: int, on_tokens: Callable[[int], None]
    ) -> list[Generated]:
        """One result per prompt, in order; `on_tokens(n)` reports progress as it goes."""
        ...


def stop_token_ids(target: str, extra: Iterable[int] = ()) -> list[int]:
    """The target's generation_config eos ids (else its tokenizer's eos), then `extra`."""
    try:
        eos = GenerationConfig.from_pretrained(target).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = AutoTokenizer.from_pretrained(target).eos_token_id
    if eos is None:
        raise ValueError(f"{target} names no eos token; pass --stop-token-ids")
    ids = [eos] if isinstance(eos, int) else list(eos)
    return ids + [t for t in extra if t not in ids]


def default_device(device: str | None) -> str:
    """`device`, or cuda when available, else cpu."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


class HFBackend:
    name = "hf"
    schedules_batches = False

    def __init__(self, model: Any, sampling: Sampling, stop_ids: list[int], pad_id: int):
        self.model = model
        self.stop_ids = stop_ids
        self.pad_id = pad_id
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_positions = limit if isinstance(limit, int) else None
        sample = not sampling.greedy
        # Every sampling field is set: generate() fills unset ones from the checkpoint's
        # generation_config (e.g. Qwen3's top_k=20, or a repetition_penalty), which would
        # silently differ from the settings written into each record and from vLLM.
        self.generation_config = GenerationConfig(
            do_sample=sample,
            temperature=sampling.temperature if sample else None,
            top_p=sampling.top_p if sample else None,
            top_k=sampling.top_k if sample else None,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
        )
        model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=pad_id)

    @classmethod
    def load(
        cls,
        target: str,
        sampling: Sampling,
        stop_ids: list[int],
        pad_id: int,
        *,
        device: str | None = None,
        dtype: str = "auto",
    ) -> HFBackend:
        device = default_device(device)
        model = load_target(target, resolve_dtype(dtype, device), None, device)
        return cls(model, sampling, stop_ids, pad_id)

    def generate(
        self, prompts: list[list[int]], seed: int, on_tokens: Callable[[int], None]
    ) -> list[Generated]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: all rows end at one column
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        # generate() samples with the global RNG: seeding it per batch makes a batch
        # reproducible whatever ran before it.
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self.generation_config,
                streamer=_TokenCounter(self.stop_ids, on_tokens),
            )
        new_tokens = out[:, width:].tolist()  # host sync, once per batch
        stop = set(self.stop_ids)
        return [finish(row, stop) for row in new_tokens]


class _TokenCounter:
    """A generate() streamer that reports each step's new answer tokens (not the padding of
    rows that have stopped). Duck-typed BaseStreamer: generate() only calls put/end."""

    def __init__(self, stop_ids: list[int], on_tokens: Callable[[int], None]):
        self.stop_ids = torch.tensor(stop_ids)
        self.on_tokens = on_tokens
        self.alive: Any = None

    def put(self, value: Any) -> None:
        if self.alive is None:  # generate() streams the prompt first
            self.alive = torch.ones(value.shape[0], dtype=torch.bool)
            return
        self.on_tokens(int(self.alive.sum()))
        self.alive &= ~torch.isin(value.reshape(-1), self.stop_ids)

    def end(self) -> None:
        pass


class StaticBackend:
    """Continuous batching on a static KV cache (`SlotDecoder`): `slots` requests decode at
    once, each refilled as soon as its request ends. Gets a whole window of prompts per call.

    The cache holds slots x (longest prompt + max_new_tokens + a window) positions, sized on
    the first call and grown when a later call needs longer rows; `max_batch_tokens` caps
    slots x row length (fewer slots for long prompts), as it caps the HF backend's batches.
    Request i of a call samples with seed `seed + i`.
    """

    name = "static"
    schedules_batches = True

    def __init__(
        self,
        model: Any,
        sampling: Sampling,
        stop_ids: list[int],
        *,
        slots: int = 32,
        max_batch_tokens: int | None = None,
        sync_every: int = 8,
        min_admit: int = 1,
        graphs: bool | None = None,
        attention: str = "varlen",
        compile_backend: str | None = None,
        compile_prefill: bool = False,
    ):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"--backend static cannot run this target ({reason}); use hf")
        self.model, self.sampling, self.stop_ids = model, sampling, stop_ids
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_positions = limit if isinstance(limit, int) else None
        self.slots, self.max_batch_tokens = slots, max_batch_tokens
        self.sync_every, self.graphs, self.attention = sync_every, graphs, attention
        self.compile_backend, self.min_admit = compile_backend, min_admit
        self.compile_prefill = compile_prefill
        self._decoder: SlotDecoder | None = None

    # A window of prompts that needs a longer cache than the decoder's rebuilds it (a new
    # cache, compiled parts and graph captures: seconds on a GPU; the reference data's five
    # generate calls rebuilt it once, 1664 -> 1920 positions), so a new cache is sized up to
    # a multiple of this.
    grow_to: int = 512

    def _decoder_for(self, prompts: list[list[int]]) -> SlotDecoder:
        length = cache_length(
            max(len(p) for p in prompts), self.sampling.max_new_tokens, self.sync_every
        )
        if self._decoder is not None and self._decoder.max_len >= length:
            return self._decoder
        length = -(-length // self.grow_to) * self.grow_to
        slots = self.slots
        if self.max_batch_tokens is not None:
            slots = max(1, min(slots, self.max_batch_tokens // length))
        self._decoder = None  # free the old cache before allocating the new one
        s = self.sampling
        self._decoder = SlotDecoder(
            self.model,
            slots,
            length,
            max_new_tokens=s.max_new_tokens,
            stop_ids=self.stop_ids,
            temperature=s.temperature,
            top_k=0 if s.greedy else s.top_k,
            top_p=1.0 if s.greedy else s.top_p,
            sync_every=self.sync_every,
            min_admit=self.min_admit,
            graphs=self.graphs,
            attention=self.attention,
            compile_backend=self.compile_backend,
            compile_prefill=self.compile_prefill,
        )
        log.info(f"generate: static cache of {slots} slots x {length} positions")
        return self._decoder

    @property
    def decoder(self) -> SlotDecoder | None:
        """The slot decoder of the last call (its `times` say where the time went)."""
        return self._decoder

    def generate(
        self, prompts: list[list[int]], seed: int, on_tokens: Callable[[int], None]
    ) -> list[Generated]:
        if not prompts:
            return []
        decoder = self._decoder_for(prompts)
        seeds = [(seed + i) % 2**63 for i in range(len(prompts))]
        stop = set(self.stop_ids)
        out = [finish(tokens, stop) for tokens in decoder.generate(prompts, seeds, on_tokens)]
        log.info(f"generate: static decoder so far {decoder.times.as_dict()}")
        return out


def auto_backend(model: Any, device: str) -> str:
    """What `--backend auto` runs for a loaded target: static on a GPU where it supports the
    target, else hf (never openai: a server is only used when asked for)."""
    if not device.startswith("cuda"):
        return "hf"
    reason = unsupported_reason(model)
    if reason is not None:
        log.info(f"generate: the HF backend runs: the static one does not support {reason}")
    return "static" if reason is None else "hf"


def load_backend(
    name: str,
    target: str,
    sampling: Sampling,
    stop_ids: list[int],
    pad_id: int,
    *,
    device: str | None = None,
    dtype: str = "auto",
    precision: str = "bf16",
    batch_size: int = 32,
    max_batch_tokens: int | None = None,
    static_attention: str = "varlen",
    static_compile: bool = False,
    static_min_admit: int = 1,
    static_compile_prefill: bool = False,
) -> GenerationBackend:
    """An in-process backend: `auto` is, on a GPU, the static backend when it supports the
    target, else HF. `batch_size` is the static backend's number of slots (the HF backend gets
    its batches from `generate`). `precision`: the target's linear layers (bf16 or fp8,
    `flashdraft.model.fp8`)."""
    if name not in ("auto", "hf", "static"):
        raise ValueError(f"unknown in-process backend {name!r} (auto, hf, static)")
    device = default_device(device)
    model = load_target(target, resolve_dtype(dtype, device), None, device, precision)
    if name == "auto":
        name = auto_backend(model, device)
    if name == "static":
        return StaticBackend(
            model,
            sampling,
            stop_ids,
            slots=batch_size,
            max_batch_tokens=max_batch_tokens,
            attention=static_attention,
            compile_backend="inductor" if static_compile and device.startswith("cuda") else None,
            min_admit=static_min_admit,
            compile_prefill=static_compile_prefill,
        )
    return HFBackend(model, sampling, stop_ids, pad_id)
