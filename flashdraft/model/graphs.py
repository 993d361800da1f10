"""CUDA graphs over functions of persistent device state, and sampling that can live inside
them.

`capture(fn)` records `fn` (no arguments: it reads and writes tensors that persist between
calls) as one `torch.cuda.CUDAGraph`; `preserved` restores that state after the warm-up runs
and the capture have mutated it. The decode loops (`flashdraft.eval.fast`,
`flashdraft.data.fast_inference`) replay such graphs for every step.

A graph cannot hold a random generator's host-side state, so the loops sample with noise
that is a pure function of (seed, position, stream): `counter_uniform` hashes the three
(Wellons' lowbias32), `gumbel` turns it into Gumbel noise for the Gumbel-max trick, and a
request's tokens do not depend on which other requests shared its steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

# ---- one CUDA graph over a function of persistent device state ----


@contextmanager
def preserved(tensors: Sequence[Tensor]) -> Iterator[None]:
    """Restore `tensors` to their current values on exit (warm-up and capture mutate state)."""
    saved = [t.clone() for t in tensors]
    try:
        yield
    finally:
        for t, s in zip(tensors, saved, strict=True):
            t.copy_(s)


@torch.no_grad()
def capture(
    fn: Callable[[], object],
    *,
    warmup: int = 2,
    pool: Any = None,
    warm: Callable[[], object] | None = None,
) -> Any:
    """`fn` (no arguments: it reads and writes persistent tensors) as a `torch.cuda.CUDAGraph`
    whose `replay()` does what `fn()` does. Warm-up runs (cuBLAS workspaces, compilation,
    allocator) happen on a side stream first: `warmup` runs of `warm` (default `fn`; a
    cheaper function that runs the same kernels, e.g. one step of a many-step `fn`). They
    execute, so callers wrap this in `preserved(...)` for the state they care about."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            (warm or fn)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: only this thread must not touch CUDA unsafely while capturing (a trainer
    # may have a row-prefetch thread running during an in-training eval).
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        fn()
    return graph


# ---- graph-safe sampling: randomness as a hash of (seed, position, stream) ----

_MASK32 = 0xFFFFFFFF
# Random streams: each position of an output draws independent noise for each purpose.
TOKEN, DRAFT, ACCEPT = 0, 1, 2


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for 0 <= x, c < 2**32, in int64 without overflow (16-bit halves)."""
    low, high = x & 0xFFFF, x >> 16
    return (low * c + (((high * c) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer hash with good avalanche (Wellons' "lowbias32")."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seed: Tensor, counter: Tensor, stream: int, n: int) -> Tensor:
    """Uniforms in (0, 1), [R, n] float32, a pure function of (seed [R], counter [R], stream,
    column): no generator state, so the same inside and outside a CUDA graph and on every
    device. 24 random bits each (the float32 mantissa)."""
    seed = (seed ^ (seed >> 32)) & _MASK32
    key = _hash32(seed ^ _hash32((counter * 4 + stream) & _MASK32))
    key2 = _hash32(key ^ 0x5BD1E995)
    columns = torch.arange(n, device=seed.device)
    bits = _hash32(_hash32(columns[None, :] ^ key[:, None]) ^ key2[:, None])
    return ((bits >> 8).float() + 0.5) * 2.0**-24


def gumbel(seed: Tensor, counter: Tensor, stream: int, n: int) -> Tensor:
    """Gumbel(0, 1) noise [R, n]: argmax(log p + G) is a sample from p (the Gumbel-max
    trick; exact in distribution, no multinomial, no host sync)."""
    return -torch.log(-torch.log(counter_uniform(seed, counter, stream, n)))


def filter_logits(scores: Tensor, top_k: int, top_p: float) -> Tensor:
    """scores [R, V] with the tokens outside top-k / the top-p nucleus set to -inf, as HF's
    TopK and TopP warpers do (top-k first; the most likely token always stays)."""
    if top_k > 0:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, index = scores.sort(dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        scores = scores.scatter(1, index, ordered.masked_fill(drop, float("-inf")))
    return scores
