"""Batched generation at device speed: slot-based continuous batching on a static KV cache.

`SlotDecoder` runs S requests at once in the S rows ("slots") of one
`flashdraft.model.static.StaticLM` cache; a request that ends frees its slot for the next
prompt, so long answers do not hold short ones back (HF `generate` keeps finished rows in the
batch until the longest ends). `flashdraft.data.inference.StaticBackend` puts it behind the
`generate` command's backend interface.

Shape legend: S slots, L cache slots per row, K steps per window, V vocabulary, P prompt.

A slot's K/V sit at positions 0..len-1 of its row (no left padding). The decode step is one
static-shape function of device state, `tok` [S] (each slot's last token), `pos` [S] (its
position) and `live` [S]:

    logits = lm(tok, pos) -> next = sample(logits) -> window[k] = next; tok = next; pos += live

so on CUDA a window of K steps is captured as one CUDA graph per attention length and
replayed once per window; the host reads the K x S window once (one sync per K steps),
emits tokens, stops requests at a stop token or the length limit and refills free slots.
A request that ends inside a window decodes a few more tokens into its own row, which are
dropped; an idle slot decodes garbage at position 0 of its own row. Neither is ever visible
to a real request (the static cache's invariant). New prompts are prefilled eagerly, as a
right-padded batch written straight into their slots' rows.

Sampling at T > 0 uses `flashdraft.model.static.gumbel`: noise that is a hash of (the
request's seed, the token's position), so a request's tokens do not depend on which other
requests shared its steps, and no generator runs inside the graphs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from flashdraft.model.graphs import TOKEN, capture, filter_logits, gumbel, preserved
from flashdraft.model.static import StaticLM

_ATTENTION_BUCKET = 128  # cache rows are sized in multiples of this


def cache_length(longest_prompt: int, max_new_tokens: int, sync_every: int) -> int:
    """Slots per row for requests of up to `longest_prompt` tokens: a request may run up to
    `sync_every` steps past its end before the host sees it; rounded up to 128."""
    need = longest_prompt + max_new_tokens + sync_every
    return -(-need // _ATTENTION_BUCKET) * _ATTENTION_BUCKET


def ladder_length(furthest: int, steps: int = 1) -> int:
    """The smallest attention length above `furthest` on a ladder of multiples of 128 with
    `steps` lengths per octave: 1 gives 128, 256, 512, ...; 2 adds 384, 768, 1536, ...; 4
    gives 128, 256, 384, 512, 640, 768, 896, 1024, 1280, ..."""
    if steps < 1:
        raise ValueError(f"ladder steps must be at least 1, got {steps}")
    octave = _ATTENTION_BUCKET
    while 2 * octave <= furthest:
        octave *= 2
    if furthest < octave:  # below the first octave
        return octave
    # furthest in [octave, 2 * octave): the next of octave * (1 + j / steps), j = 1..steps
    stride = -(-octave // (steps * _ATTENTION_BUCKET)) * _ATTENTION_BUCKET
    return min(2 * octave, (furthest // stride + 1) * stride)


@dataclass(slots=True)
class PhaseTimes:
    """Where a decoder's wall time went (host clock). Every prefill batch and every window
    ends in a host read (a sync), so each span covers its GPU work: no extra syncs."""

    prefill_s: float = 0.0  # admitting prompts: the eager prefill batches
    decode_s: float = 0.0  # the windows of decode steps (graph replays) and their read
    capture_s: float = 0.0  # capturing new graphs (inside the windows, counted apart)
    prefill_tokens: int = 0  # prompt tokens prefilled (padding included)
    prefill_batches: int = 0
    steps: int = 0  # decode steps (each advances every slot by one token)
    slot_steps: int = 0  # of those x slots, the ones that held a request

    def as_dict(self) -> dict[str, float]:
        """The decode time without the captures, per step too, and the mean busy slots."""
        decode = self.decode_s - self.capture_s
        steps = max(1, self.steps)
        return {
            "prefill_s": round(self.prefill_s, 3),
            "decode_s": round(decode, 3),
            "capture_s": round(self.capture_s, 3),
            "prefill_tokens": self.prefill_tokens,
            "prefill_batches": self.prefill_batches,
            "steps": self.steps,
            "ms_per_step": round(1e3 * decode / steps, 3),
            "slot_use": round(self.slot_steps / steps, 1),
        }


@dataclass(slots=True)
class _Slot:
    request: int = -1  # index of the request it holds, -1 when free
    position: int = 0  # the position of its last token (what the next step feeds)
    tokens: list[int] = field(default_factory=list)


class SlotDecoder:
    """Generates for many prompts with `slots` of them in flight at a time.

    model: a frozen HF causal LM that `StaticLM` supports; max_len: cache slots per row
    (`cache_length`); stop_ids end a request (the stop token is kept in its tokens);
    sync_every: steps between host reads; prefill_tokens: prompt tokens (padded) per prefill
    batch; min_admit: new prompts wait until this many slots are free (or the queue holds
    fewer, or no slot is busy): fewer, larger prefill batches for some idle slots, the same
    tokens (each request's decoding does not depend on its neighbours); graphs: capture the
    steps (default: on CUDA); attention: the steps' attention, "sdpa", "flex" (each slot
    reads only its own K/V blocks) or "varlen" (only its own slots; see `StaticLM`);
    compile_backend: compile the decode steps' dense layer parts first
    (`StaticLM.compile_layers`);
    compile_prefill: with compile_backend, the prefill batches' parts too (dynamic shapes).
    """

    # q/k/v and gate/up as one GEMM each (`StaticLM.fuse_projections`; a copy of those
    # weights). A class attribute, as `ladder_steps`: benches and tests set it.
    fuse: bool = True

    def __init__(
        self,
        model: Any,
        slots: int,
        max_len: int,
        *,
        max_new_tokens: int,
        stop_ids: Collection[int] = (),
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        sync_every: int = 8,
        prefill_tokens: int = 16384,
        min_admit: int = 1,
        graphs: bool | None = None,
        attention: str = "sdpa",
        compile_backend: str | Callable[..., Any] | None = None,
        compile_prefill: bool = False,
    ) -> None:
        self.lm = StaticLM(model, slots, max_len, attention=attention)
        if self.fuse:
            self.lm.fuse_projections()
        if compile_backend is not None:
            self.lm.compile_layers(compile_backend, prefill=compile_prefill)
        self.slots, self.max_len, self.max_new = slots, max_len, max_new_tokens
        self.stop = frozenset(stop_ids)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        if min_admit < 1:
            raise ValueError(f"min_admit must be at least 1, got {min_admit}")
        self.sync_every, self.prefill_tokens = sync_every, prefill_tokens
        self.min_admit = min(min_admit, slots)
        device = self.lm.device
        self.device = device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        self.tok = torch.zeros(slots, dtype=torch.long, device=device)  # last tokens
        self.pos = torch.zeros_like(self.tok)  # their positions
        self.live = torch.zeros_like(self.tok)  # 1 where a slot holds a request
        self.seeds = torch.zeros_like(self.tok)  # each request's sampling seed
        self.window = torch.zeros(sync_every, slots, dtype=torch.long, device=device)
        self._graphs: dict[int, Any] = {}  # attention length -> the window's graph
        self._pool: Any = None
        self._state = [_Slot() for _ in range(slots)]
        self.times = PhaseTimes()

    # ---- sampling and the step (device only, graph-capturable) ----

    def _sample(self, logits: Tensor, seeds: Tensor, at: Tensor) -> Tensor:
        """logits [R, V] -> tokens [R], for tokens at positions `at` [R]."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        scores = filter_logits(logits.float() / self.temperature, self.top_k, self.top_p)
        return (scores + gumbel(seeds, at, TOKEN, scores.shape[-1])).argmax(dim=-1)

    def _step(self, k: int, kv_len: int) -> None:
        logits, _ = self.lm(self.tok[:, None], self.pos[:, None], kv_len=kv_len)
        token = self._sample(logits[:, 0], self.seeds, self.pos + 1)
        self.window[k].copy_(token)
        self.tok.copy_(token)
        self.pos.add_(self.live)

    def _window_steps(self, kv_len: int) -> None:
        for k in range(self.sync_every):
            self._step(k, kv_len)

    def _run_window(self, kv_len: int) -> None:
        """The window's K steps: eagerly, or as one CUDA graph per attention length (one
        replay per window). Its warm-up is a single step (every step of a window has the
        same shapes), so a capture costs ~K + 1 steps, not 3 per step as K graphs did."""
        if not self.graphs:
            self._window_steps(kv_len)
            return
        graph = self._graphs.get(kv_len)
        if graph is None:
            start = time.perf_counter()
            # The warm-up and the capture write K/V at each slot's next positions (at most K
            # past its current one, what a window writes anyway): overwritten by the real
            # steps before any query reads them.
            with preserved([self.tok, self.pos, self.window]):
                graph = capture(
                    lambda: self._window_steps(kv_len),
                    warm=lambda: self._step(0, kv_len),
                    warmup=1,
                    pool=self._pool,
                )
            self._pool = graph.pool()
            self._graphs[kv_len] = graph
            self.times.capture_s += time.perf_counter() - start
        graph.replay()

    # Attention reads the first kv_len slots of every row, kv_len from a ladder of lengths
    # (multiples of 128): `ladder_steps` per octave, so a window reads at most 1 + 1/steps
    # times the slots its furthest request needs. Each length is one graph to capture.
    # With one graph per step, 2 steps per octave were slower end to end than powers of two
    # on an H200 (17.5K vs 19.9K tok/s, 2,048 prompts: the captures cost more than the reads
    # saved). With one graph per 8-step window, 4 steps per octave against 1, 4,096 prompts
    # at batch 256: 53.3K vs 46.9K tok/s (3.03 vs 3.40 ms per step; the captures, ~0.7 vs
    # ~0.3 s, are paid once per process).
    ladder_steps: int = 4

    def _attention_length(self, furthest: int) -> int:
        """The smallest ladder length (at most L) above `furthest`; L when each step reads
        only its rows' own slots anyway (attention="varlen"): one graph for every length."""
        if self.lm.steps_read_own_slots:
            return self.max_len
        return min(self.max_len, ladder_length(furthest, self.ladder_steps))

    # ---- prefill: new prompts into free slots ----

    def _prefill(
        self, slots: list[int], prompts: list[Sequence[int]], seeds: list[int]
    ) -> list[int]:
        """Right-padded batch prefill into the slots' rows; returns each first token."""
        start = time.perf_counter()
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(list(prompt))
        ids = ids.to(self.device)
        positions = torch.arange(width, device=self.device)[None].expand(len(prompts), -1)
        rows = torch.tensor(slots, device=self.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        request_seeds = torch.tensor(seeds, device=self.device)
        logits, _ = self.lm(ids, positions, rows=rows, kv_len=width, logits_at=last, fresh=True)
        first = self._sample(logits[:, 0], request_seeds, last + 1)
        self.tok[rows] = first
        self.pos[rows] = last + 1
        self.live[rows] = 1
        self.seeds[rows] = request_seeds
        firsts = first.tolist()  # host sync, once per prefill batch
        self.times.prefill_s += time.perf_counter() - start
        self.times.prefill_tokens += width * len(prompts)
        self.times.prefill_batches += 1
        return firsts

    def _admit(
        self,
        free: list[int],
        queue: deque[int],
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
    ) -> list[tuple[int, int]]:
        """Prefill queued requests into free slots, a padded token budget per batch, longest
        first; returns (slot, first token) of each admitted one."""
        admitted: list[tuple[int, int]] = []
        while free and queue:
            width = len(prompts[queue[0]])  # the queue is sorted longest first
            take = max(1, min(len(free), len(queue), self.prefill_tokens // width))
            chosen = [queue.popleft() for _ in range(take)]
            slots, free = free[:take], free[take:]
            firsts = self._prefill(slots, [prompts[r] for r in chosen], [seeds[r] for r in chosen])
            admitted += list(zip(slots, firsts, strict=True))
            for slot, request in zip(slots, chosen, strict=True):
                self._state[slot] = _Slot(request, len(prompts[request]), [])
        return admitted

    # ---- the loop ----

    def _done(self, tokens: list[int]) -> bool:
        return len(tokens) >= self.max_new or (bool(tokens) and tokens[-1] in self.stop)

    def _free(self, slots: list[int]) -> None:
        """Slots whose request ended: idle from now on (decoding at position 0)."""
        if not slots:
            return
        index = torch.tensor(slots, device=self.device)
        self.live[index] = 0
        self.pos[index] = 0
        for slot in slots:
            self._state[slot] = _Slot()

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        on_tokens: Callable[[int], None] = lambda n: None,
    ) -> list[list[int]]:
        """The generated tokens of each prompt, in order: up to max_new_tokens, ending at the
        first stop token (kept). `seeds` [one per prompt] key the sampling noise."""
        longest = max((len(p) for p in prompts), default=0)
        if longest + self.max_new + self.sync_every > self.max_len:
            raise ValueError(
                f"a prompt of {longest} tokens + {self.max_new} new needs "
                f"{cache_length(longest, self.max_new, self.sync_every)} cache slots; "
                f"this decoder has {self.max_len}"
            )
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: the target needs at least one token to continue")
        queue = deque(sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i)))
        results: list[list[int]] = [[] for _ in prompts]
        self._free(list(range(self.slots)))
        while True:
            free = [s for s, slot in enumerate(self._state) if slot.request < 0]
            busy = len(free) < self.slots
            if busy and len(free) < min(self.min_admit, len(queue)):
                free = []  # too few to prefill yet: they wait for more to free up
            admitted = self._admit(free, queue, prompts, seeds)
            ended = []
            for s, first in admitted:
                self._state[s].tokens.append(first)
                if self._done(self._state[s].tokens):
                    results[self._state[s].request] = self._state[s].tokens
                    ended.append(s)
            on_tokens(len(admitted))
            self._free(ended)
            active = [s for s, slot in enumerate(self._state) if slot.request >= 0]
            if not active:
                if queue:
                    continue
                return results
            furthest = max(self._state[s].position for s in active) + self.sync_every
            kv_len = self._attention_length(furthest)
            start = time.perf_counter()
            self._run_window(kv_len)
            window = self.window.tolist()  # the one host sync per window
            self.times.decode_s += time.perf_counter() - start
            self.times.steps += self.sync_every
            self.times.slot_steps += self.sync_every * len(active)
            on_tokens(self._collect(active, window, results))

    def _collect(self, active: list[int], window: list[list[int]], results: list[list[int]]) -> int:
        """Append a window's tokens to the active requests; frees the ones that ended.
        Returns the number of tokens emitted."""
        ended, emitted = [], 0
        for s in active:
            slot = self._state[s]
            for k in range(self.sync_every):
                slot.tokens.append(window[k][s])
                emitted += 1
                if self._done(slot.tokens):
                    break
            slot.position += self.sync_every
            if self._done(slot.tokens):
                results[slot.request] = slot.tokens
                ended.append(s)
        self._free(ended)
        return emitted
