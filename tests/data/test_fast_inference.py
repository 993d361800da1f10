"""Slot-based continuous batching on a static cache (`SlotDecoder`): greedy equals each prompt
decoded alone by HF `generate` (refills, stop tokens, windows), seeded sampling that does not
depend on the slots a request shared; and `bench/generate.py --synthetic --smoke`."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama

from flashdraft.data.fast_inference import SlotDecoder, cache_length, ladder_length

ROOT = Path(__file__).resolve().parents[2]
STOP = {5, 17, 42}
NEW = 24


@pytest.fixture(scope="module")
def model():
    return tiny_llama(initializer_range=0.3)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(60) for _ in range(rng.randint(1, 20))] for _ in range(17)]


def greedy_alone(model, prompt: list[int], stop: set[int] = STOP) -> list[int]:
    """HF generate on one unpadded prompt, cut after the first stop token (kept)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NEW,
        pad_token_id=0,
        eos_token_id=sorted(stop) or [10**6],
    )[0, len(prompt) :].tolist()
    end = next((i + 1 for i, t in enumerate(out) if t in stop), len(out))
    return out[:end]


@pytest.mark.parametrize("sync_every", [1, 4])
def test_greedy_equals_each_prompt_alone(model, prompts, sync_every) -> None:
    reference = [greedy_alone(model, p) for p in prompts]
    lengths = sorted(len(r) for r in reference)
    assert lengths[0] < 4 and lengths[-1] == NEW  # stops early and runs to the limit, both
    length = cache_length(max(len(p) for p in prompts), NEW, sync_every)
    decoder = SlotDecoder(
        model,
        5,  # fewer slots than prompts: refills
        length,
        max_new_tokens=NEW,
        stop_ids=STOP,
        sync_every=sync_every,
        prefill_tokens=40,  # several prefill batches per refill
    )
    counted: list[int] = []
    out = decoder.generate(prompts, list(range(len(prompts))), counted.append)
    assert out == reference
    assert sum(counted) >= sum(len(r) for r in reference)  # window overshoot included
    # The phase account: every prompt prefilled (padding included), every window counted.
    times = decoder.times
    assert times.prefill_batches >= 2 and times.prefill_tokens >= sum(len(p) for p in prompts)
    assert times.steps % sync_every == 0 and times.steps >= NEW
    assert 0 < times.slot_steps <= times.steps * 5
    assert times.prefill_s > 0 and times.decode_s > 0 and times.capture_s == 0  # CPU: no graphs


def test_sampling_is_seeded_per_request_whatever_shares_its_steps(model, prompts) -> None:
    def run(slots: int, sync_every: int, seeds: list[int]) -> list[list[int]]:
        length = cache_length(20, NEW, sync_every)
        decoder = SlotDecoder(
            model,
            slots,
            length,
            max_new_tokens=NEW,
            stop_ids=STOP,
            temperature=1.0,
            top_k=8,
            sync_every=sync_every,
        )
        return decoder.generate(prompts, seeds)

    seeds = list(range(100, 100 + len(prompts)))
    first = run(6, 4, seeds)
    assert first == run(3, 2, seeds)  # other slots, other windows: the same tokens
    other = run(6, 4, [s + 1000 for s in seeds])
    assert sum(a != b for a, b in zip(first, other, strict=True)) > len(prompts) // 2
    greedy = [greedy_alone(model, p) for p in prompts]
    assert first != greedy  # it does sample
    # top-k 8: every sampled token is among the 8 most likely after its context
    prompt, tokens = prompts[0], first[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    top = logits.topk(8, dim=-1).indices
    assert all(t in row.tolist() for t, row in zip(tokens, top, strict=True))


def test_waiting_for_free_slots_batches_prefill_and_keeps_every_token(model, prompts) -> None:
    """min_admit: new prompts wait until that many slots are free (or the queue is shorter):
    fewer prefill batches, the same tokens, greedy (each prompt's own greedy decoding) and
    sampled (seeded per request)."""
    length = cache_length(max(len(p) for p in prompts), NEW, 2)

    def run(min_admit: int, temperature: float) -> tuple[list[list[int]], int]:
        decoder = SlotDecoder(
            model,
            6,
            length,
            max_new_tokens=NEW,
            stop_ids=STOP,
            temperature=temperature,
            sync_every=2,
            min_admit=min_admit,
        )
        out = decoder.generate(prompts, list(range(len(prompts))))
        return out, decoder.times.prefill_batches

    greedy, batches = run(1, 0.0)
    assert greedy == [greedy_alone(model, p) for p in prompts]
    waited, fewer = run(4, 0.0)
    assert waited == greedy and fewer < batches, (fewer, batches)
    assert run(4, 1.0)[0] == run(1, 1.0)[0]
    assert run(100, 0.0)[0] == greedy  # more than the slots: all of them, then the rest
    with pytest.raises(ValueError, match="min_admit"):
        SlotDecoder(model, 2, length, max_new_tokens=NEW, min_admit=0)


def test_prompts_must_fit_the_cache(model) -> None:
    decoder = SlotDecoder(model, 2, 128, max_new_tokens=100, sync_every=8)
    with pytest.raises(ValueError, match="needs 256 cache slots; this decoder has 128"):
        decoder.generate([[1] * 30], [0])
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate([[]], [0])
    assert cache_length(30, 100, 8) == 256


def test_attention_reads_the_smallest_ladder_length_that_holds_every_position(model) -> None:
    decoder = SlotDecoder(model, 1, 1024, max_new_tokens=8)
    assert decoder.ladder_steps == 4  # the default (docs/speed.md)
    decoder.ladder_steps = 1  # bench/generate.py --buckets pow2
    furthest = [0, 127, 128, 191, 192, 255, 256, 383, 384, 511, 512, 767, 768, 1000, 5000]
    lengths = [decoder._attention_length(f) for f in furthest]
    assert lengths == [128, 128, 256, 256, 256, 256, 512, 512, 512, 512, 1024, 1024] + [1024] * 3
    decoder.ladder_steps = 2  # bench/generate.py --buckets ladder
    lengths = [decoder._attention_length(f) for f in furthest]
    assert (
        lengths == [128, 128, 256, 256, 256, 256, 384, 384, 512, 512, 768, 768, 1024] + [1024] * 2
    )
    decoder.ladder_steps = 4  # --buckets fine
    lengths = [decoder._attention_length(f) for f in furthest]
    assert lengths == [128, 128, 256, 256, 256, 256, 384, 384, 512, 512, 640, 768, 896] + [1024] * 2
    # above an octave of 1024 the stride is 256, and every length is a multiple of 128
    assert [ladder_length(f, 4) for f in (1024, 1279, 1280, 2047, 2048)] == [
        1280,
        1280,
        1536,
        2048,
        2560,
    ]
    assert all(ladder_length(f, s) % 128 == 0 for f in range(0, 5000, 7) for s in (1, 2, 3, 4))
    assert all(ladder_length(f, s) > f for f in range(0, 5000, 7) for s in (1, 2, 3, 4))
    with pytest.raises(ValueError, match="at least 1"):
        ladder_length(10, 0)


def test_greedy_across_attention_lengths_equals_each_prompt_alone(model) -> None:
    # Prompts of 110..250 tokens and 24 new ones, one at a time, on the fine ladder: 128, 256
    # and 384 slots read.
    rng = random.Random(2)
    prompts = [[rng.randrange(60) for _ in range(n)] for n in (110, 200, 250)]
    decoder = SlotDecoder(model, 1, cache_length(250, NEW, 4), max_new_tokens=NEW, sync_every=4)
    decoder.ladder_steps = 4
    seen: set[int] = set()
    window = decoder._run_window
    decoder._run_window = lambda kv_len: (seen.add(kv_len), window(kv_len))[1]  # type: ignore[method-assign]
    out = decoder.generate(prompts, [0, 1, 2])
    assert seen == {128, 256, 384}
    assert out == [greedy_alone(model, p, stop=set()) for p in prompts]


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_bench_synthetic_smoke_runs_on_cpu() -> None:
    out = subprocess.run(
        [sys.executable, "bench/generate.py", "--synthetic", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["backend"] for r in result["rows"]] == ["hf", "static"]
    assert all(r["generated"] == r["prompts"] * r["new tokens"] for r in result["rows"])


def test_compiled_prefill_and_steps_keep_every_token(model, prompts) -> None:
    """`compile_prefill`: refills of every width through the compiled parts (a counting
    backend here: traced graphs, run eagerly) give each prompt's own greedy tokens, in a
    bounded number of graphs however many prefill shapes the refills make."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    decoder = SlotDecoder(
        model,
        5,
        cache_length(max(len(p) for p in prompts), NEW, 4),
        max_new_tokens=NEW,
        stop_ids=STOP,
        sync_every=4,
        prefill_tokens=40,
        compile_backend=counter,
        compile_prefill=True,
    )
    out = decoder.generate(prompts, list(range(len(prompts))))
    assert out == [greedy_alone(model, p) for p in prompts]
    assert decoder.times.prefill_batches >= 4
    # project and finish: the decode steps', the first prefill's, the symbolic prefill's
    assert counter.frame_count == 6
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("attention", "compiled"),
    [("sdpa", False), ("flex", False), ("sdpa", True), ("varlen", False), ("varlen", True)],
    ids=["sdpa", "flex", "sdpa-compiled-prefill", "varlen", "varlen-compiled-prefill"],
)
def test_graphed_slots_equal_the_eager_ones_on_cuda(
    prompts, attention, compiled, monkeypatch
) -> None:
    """Graphed windows with fused projections (compiled flex for "flex"; the flash kernel
    for "varlen", one graph for every length; inductor's decode and prefill parts for
    "compiled") give the eager, unfused sdpa steps' tokens; prompts of up to 150 tokens put
    the slots in different flex blocks. The flash kernel needs half precision: the varlen
    cases run in bf16 (the eager reference too), where two correct paths part at near-ties
    of the tiny model's logits (bf16 flips ~3% of its argmaxes), so there the answers must
    agree on most requests and for most of their length (a kernel reading the wrong slots
    parts at the first decoded token); the others run in fp32 and must also equal HF's own
    greedy decoding."""
    half = attention == "varlen"
    model = tiny_llama(initializer_range=0.3).cuda()
    if half:
        model = model.to(torch.bfloat16)
    rng = random.Random(3)
    prompts = prompts + [[rng.randrange(60) for _ in range(n)] for n in (120, 150)]
    outputs = []
    for graphs, kind in ((False, "sdpa"), (True, attention)):
        monkeypatch.setattr(SlotDecoder, "fuse", graphs)  # the reference: separate GEMMs
        decoder = SlotDecoder(
            model,
            5,
            cache_length(150, NEW, 4),
            max_new_tokens=NEW,
            stop_ids=STOP,
            sync_every=4,
            graphs=graphs,
            attention=kind,
            compile_backend="inductor" if graphs and compiled else None,
            compile_prefill=graphs and compiled,
        )
        if graphs and half:  # the flash path runs, one graph for every length
            assert decoder.lm.steps_read_own_slots
        outputs.append(decoder.generate(prompts, list(range(len(prompts)))))
        if graphs and half:
            assert set(decoder._graphs) == {decoder.max_len}
    if half:
        common = [shared_prefix(a, b) / len(a) for a, b in zip(*outputs, strict=True)]
        assert sum(c == 1 for c in common) >= len(common) / 2, common
        assert sum(common) / len(common) >= 0.6, common
        return
    assert outputs[0] == outputs[1]
    assert outputs[0] == [greedy_alone(model, p) for p in prompts]


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_varlen_slots_equal_each_prompt_alone_at_one_attention_length(
    model, prompts, monkeypatch
) -> None:
    """attention="varlen" (the flash kernel's CPU emulation): every window runs at the
    cache's whole length, one graph for all, and each prompt keeps its own greedy tokens."""
    from helpers import emulated_flash_varlen

    from flashdraft.model import varlen
    from flashdraft.model.static import StaticLM

    monkeypatch.setattr(varlen, "_flash_varlen", emulated_flash_varlen)
    monkeypatch.setattr(StaticLM, "flash_anywhere", True)
    length = cache_length(max(len(p) for p in prompts), NEW, 4)
    decoder = SlotDecoder(
        model, 5, length, max_new_tokens=NEW, stop_ids=STOP, sync_every=4, attention="varlen"
    )
    seen: set[int] = set()
    window = decoder._run_window
    decoder._run_window = lambda kv_len: (seen.add(kv_len), window(kv_len))[1]  # type: ignore[method-assign]
    out = decoder.generate(prompts, list(range(len(prompts))))
    assert seen == {length}
    assert out == [greedy_alone(model, p) for p in prompts]


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_flex_slots_equal_each_prompt_alone(model, prompts) -> None:
    length = cache_length(max(len(p) for p in prompts), NEW, 4)
    decoder = SlotDecoder(
        model, 5, length, max_new_tokens=NEW, stop_ids=STOP, sync_every=4, attention="flex"
    )
    assert decoder.generate(prompts, list(range(len(prompts)))) == [
        greedy_alone(model, p) for p in prompts
    ]
