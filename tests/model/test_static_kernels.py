"""The static-cache forward's attention kernels and compiled graphs: flex and varlen decoding
steps against the sdpa ones (the flash kernel emulated on CPU, the real one on GPU), flex's
block listing, and the compiled layer parts and whole step as `flashdraft eval` compiles
them. Equivalence with HF's own forward is in test_static.py."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import tiny_target

from flashdraft.model.graphs import capture
from flashdraft.model.static import StaticLM

PROMPT = [5, 17, 3, 42, 8, 11, 29, 2, 60]


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3-sliding", "mistral"])
def target(request) -> torch.nn.Module:
    return tiny_target(request.param)


def decode_rows(lm: StaticLM, prompts: list[list[int]], kv_len: int, steps: int = 4) -> list:
    """Each prompt prefilled into its own row, then `steps` greedy one-token steps of every
    row at once (rows at different positions): [(logits, taps)] per step."""
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        lm(torch.tensor([prompt]), torch.arange(n)[None], rows=torch.tensor([row]), kv_len=n)
    tokens = torch.tensor([[p[-1]] for p in prompts])
    positions = torch.tensor([[len(p) - 1] for p in prompts])
    out = []
    for _ in range(steps):
        logits, taps = lm(tokens, positions, kv_len=kv_len)
        out.append((logits, taps))
        tokens, positions = logits.argmax(-1), positions + 1
    return out


@torch.no_grad()
def test_flex_decoding_steps_equal_the_sdpa_ones(target) -> None:
    """attention="flex" (each row reads only its own K/V blocks, windows included) gives the
    logits of the sdpa steps, rows at different positions, across a block boundary (128)."""
    rng = random.Random(5)
    lengths = [3, 126, 150]  # the second row crosses from block 0 into block 1 while decoding
    prompts = [[rng.randrange(60) for _ in range(n)] for n in lengths]
    lms = {a: StaticLM(target, 3, 256, [1], attention=a) for a in ("sdpa", "flex")}
    outputs = {name: decode_rows(lm, prompts, kv_len=256) for name, lm in lms.items()}
    for (a, ta), (b, tb) in zip(outputs["sdpa"], outputs["flex"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(tb, ta, rtol=1e-4, atol=1e-4)


@pytest.fixture
def emulated_flash(monkeypatch):
    """attention="varlen" on CPU: the flash kernel's call stood in by its emulation."""
    from helpers import emulated_flash_varlen

    from flashdraft.model import varlen

    monkeypatch.setattr(varlen, "_flash_varlen", emulated_flash_varlen)
    monkeypatch.setattr(StaticLM, "flash_anywhere", True)


@torch.no_grad()
def test_varlen_decoding_steps_equal_the_sdpa_ones(target, emulated_flash) -> None:
    """attention="varlen" (full layers: each (row, K/V head) one flash sequence of its G
    query heads over the row's own slots; sliding layers keep the mask) gives the sdpa
    steps' logits and taps, rows at different positions; slots above a row's position hold
    stale K/V (a longer earlier prompt) that must stay unread."""
    rng = random.Random(6)
    lengths = [3, 40, 17]
    prompts = [[rng.randrange(60) for _ in range(n)] for n in lengths]
    stale = torch.tensor([[rng.randrange(60) for _ in range(60)]] * 3)
    lms = {a: StaticLM(target, 3, 128, [1], attention=a) for a in ("sdpa", "varlen")}
    outputs = {}
    for name, lm in lms.items():
        lm(stale, torch.arange(60)[None].expand(3, -1), rows=torch.arange(3), kv_len=60)
        outputs[name] = decode_rows(lm, prompts, kv_len=64)
    for (a, ta), (b, tb) in zip(outputs["sdpa"], outputs["varlen"], strict=True):
        assert not b.isnan().any()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(tb, ta, rtol=1e-4, atol=1e-4)
    full = all(w is None for w in lms["varlen"].windows)
    assert lms["varlen"].steps_read_own_slots == full
    assert not lms["sdpa"].steps_read_own_slots


def test_varlen_needs_the_flash_kernel_else_it_runs_sdpa(target) -> None:
    lm = StaticLM(target, 1, 64, attention="varlen")  # CPU, fp32: no flash kernel
    assert not lm.steps_read_own_slots
    prompt = torch.tensor([PROMPT])
    lm(prompt, torch.arange(len(PROMPT))[None], fresh=True)
    step, _ = lm(prompt[:, -1:], torch.tensor([[len(PROMPT)]]), kv_len=16)  # sdpa, no error
    assert not step.isnan().any()


@torch.no_grad()
def test_compiled_layer_parts_give_the_eager_steps_with_one_graph_for_every_layer(
    target,
) -> None:
    """`compile_layers`: decode steps through the compiled dense parts give the eager steps'
    logits, and each part is one graph for all layers and attention lengths (the layers'
    modules are graph inputs; a graph per layer would multiply the cold compile)."""
    from torch._dynamo.testing import CompileCounter

    prompt = torch.tensor([PROMPT, PROMPT[::-1]])
    eager, compiled = StaticLM(target, 2, 128, [1]), StaticLM(target, 2, 128, [1])
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled.compile_layers(counter)
    for lm in (eager, compiled):
        n = prompt.shape[1]
        lm(prompt, torch.arange(n)[None].expand(2, -1), rows=torch.tensor([0, 1]), kv_len=n)
    tokens, positions = prompt[:, -1:], torch.full((2, 1), prompt.shape[1] - 1)
    for step, kv_len in enumerate((16, 16, 32, 128)):
        (a, ta), (b, tb) = (lm(tokens, positions + step, kv_len=kv_len) for lm in (eager, compiled))
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tb, ta, rtol=1e-5, atol=1e-5)
        tokens = a.argmax(-1)
    assert counter.frame_count == 2  # project and finish, once each


@torch.no_grad()
def test_compiled_prefill_parts_give_the_eager_prefill_in_few_graphs(target) -> None:
    """`compile_layers(prefill=True)`: prefill batches of other rows and widths through the
    compiled parts give the eager logits, taps and cache; after the first batch's graphs
    and one recompile with symbolic sizes nothing compiles again (a batch's shape is new
    every time in generation), and the decode steps keep their own graphs."""
    from torch._dynamo.testing import CompileCounter

    rng = random.Random(5)
    eager, compiled = StaticLM(target, 4, 64, [1]), StaticLM(target, 4, 64, [1])
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled.compile_layers(counter, prefill=True)
    frames = []
    for r, width in ((2, 9), (3, 14), (4, 6), (2, 20), (3, 11)):
        ids = torch.tensor([[rng.randrange(60) for _ in range(width)] for _ in range(r)])
        positions = torch.arange(width)[None].expand(r, -1)
        rows = torch.tensor(rng.sample(range(4), r))
        (a, ta), (b, tb) = (
            lm(ids, positions, rows=rows, kv_len=width, fresh=True) for lm in (eager, compiled)
        )
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tb, ta, rtol=1e-5, atol=1e-5)
        frames.append(counter.frame_count)
    for x, y in zip(eager.keys + eager.values, compiled.keys + compiled.values, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    # project and finish for the first shape, then symbolic (the sliding kinds' mixed layers
    # cost finish one more graph); the batches after the second compile nothing
    assert frames[0] == 2 and frames[1] <= 5 and frames[-1] == frames[1]
    tokens, positions = torch.tensor([[3], [4], [5], [6]]), torch.full((4, 1), 20)
    (a, _), (b, _) = (lm(tokens, positions, kv_len=32) for lm in (eager, compiled))
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == frames[-1] + 2  # + the decode step's own two
    torch._dynamo.reset()


@torch.no_grad()
def test_the_whole_step_traces_in_one_graph_as_the_eval_loop_compiles_it() -> None:
    """`flashdraft eval`'s static loop compiles `StaticLM.__call__` with fullgraph=True (on
    CUDA, inductor): a graph break anywhere in a decode step (a context manager, a host read)
    would fail it there; aot_eager checks the trace on the CPU."""
    lm = StaticLM(tiny_target("qwen3-sliding"), 1, 64, [1])
    ids = torch.tensor([PROMPT])
    n = len(PROMPT)
    lm(ids, torch.arange(n)[None], rows=torch.tensor([0]), kv_len=n, fresh=True)
    step = torch.compile(lm.__call__, backend="aot_eager", fullgraph=True, dynamic=False)
    tokens, positions = torch.tensor([[7, 3]]), torch.tensor([[n, n + 1]])
    compiled = step(tokens, positions, kv_len=32)
    eager = lm(tokens, positions, kv_len=32)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)


def test_flex_block_masks_list_every_block_a_row_can_see() -> None:
    """The CPU's eager flex applies mask_mod densely and ignores which blocks are listed, so
    the test above cannot see a missing block: the listing is checked here (on CUDA the
    kernel reads only listed blocks)."""
    lm = StaticLM(tiny_target("qwen3-sliding"), 4, 512, attention="flex")
    positions = torch.tensor([[0], [127], [128], [300]])
    for window, mask in lm._block_masks(positions, 384).items():
        listed = mask.to_dense()[:, 0, 0, :]  # [rows, blocks]: 1 where a block is read
        assert listed.shape == (4, 3)
        for row, p in enumerate(positions[:, 0].tolist()):
            assert listed[row].tolist() == [int(b <= p // 128) for b in range(3)], (window, p)


def test_flex_needs_block_sized_rows() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        StaticLM(tiny_target("llama"), 1, 100, attention="flex")
    with pytest.raises(ValueError, match="one of sdpa, flex, varlen"):
        StaticLM(tiny_target("llama"), 1, 128, attention="eager")


def test_the_forward_compiles_as_one_graph() -> None:
    """torch.compile(fullgraph=True) traces it without a break (aot_eager: the tracing, fast)."""
    target = tiny_target("qwen3-sliding")
    lm = StaticLM(target, 1, 32, [1])
    compiled = torch.compile(lm.__call__, backend="aot_eager", fullgraph=True, dynamic=False)
    with torch.no_grad():
        lm(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])
        eager = lm(torch.tensor([[4]]), torch.tensor([[len(PROMPT)]]))
        traced = compiled(torch.tensor([[4]]), torch.tensor([[len(PROMPT)]]))
    torch.testing.assert_close(traced[0], eager[0])
    torch.testing.assert_close(traced[1], eager[1])


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3-sliding"])
def test_varlen_steps_on_the_flash_kernel_equal_the_sdpa_ones_in_bf16(kind) -> None:
    """The real kernel (`_flash_varlen`, FA2 with seqused_k) under the packing that the CPU
    emulation checks: the sdpa steps' logits up to bf16 rounding, rows at different
    positions over stale slots, captured as a CUDA graph. Teacher-forced (the same fixed
    tokens into both): in bf16, free-running greedy decoding of a tiny random model leaves
    the other path at a near-tie within a few dozen tokens."""
    target = tiny_target(kind).cuda().to(torch.bfloat16)
    rng = random.Random(7)
    lengths = [3, 100, 37, 64]
    prompts = [[rng.randrange(60) for _ in range(n)] for n in lengths]
    rows, steps = len(prompts), 6
    feed = torch.randint(0, 60, (steps, rows, 1), generator=torch.Generator().manual_seed(1))
    outs = {}
    for attention in ("sdpa", "varlen"):
        lm = StaticLM(target, rows, 256, [1], attention=attention)
        assert lm.steps_read_own_slots == (attention == "varlen" and kind != "qwen3-sliding")
        stale = torch.randint(0, 60, (rows, 120), device="cuda")
        lm(stale, torch.arange(120, device="cuda")[None].expand(rows, -1), fresh=True)
        for row, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device="cuda")
            positions = torch.arange(len(prompt), device="cuda")[None]
            lm(ids, positions, rows=torch.tensor([row], device="cuda"), kv_len=len(prompt))
        token = torch.zeros(rows, 1, dtype=torch.long, device="cuda")
        position = torch.tensor([[n] for n in lengths], device="cuda")
        logits_out = torch.zeros(rows, 1, target.config.vocab_size, device="cuda")

        def step(lm=lm, token=token, position=position, logits_out=logits_out) -> None:
            logits, _ = lm(token, position, kv_len=256)
            logits_out.copy_(logits.float())

        graph = capture(step)
        logits = []
        for k in range(steps):  # host-side inputs between replays, as the decode loops do
            token.copy_(feed[k])
            position.copy_(torch.tensor([[n + k] for n in lengths]))
            graph.replay()
            logits.append(logits_out.clone())
        outs[attention] = logits
    for a, b in zip(outs["sdpa"], outs["varlen"], strict=True):
        torch.testing.assert_close(b, a, rtol=0.02, atol=0.02 * float(a.abs().max()))
