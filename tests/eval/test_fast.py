"""The static decode loop (docs/design.md §5 on static caches) against the HF loop and HF `generate`:
greedy outputs, acceptance lengths, the drafter's proposals step by step, rewinds after
rejections, eos, sampling in distribution; and `bench/eval.py --speed --smoke`."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import drafter_config_for, tiny_llama, tiny_target
from torch import Tensor
from torch.nn.attention.flex_attention import create_mask

from flashdraft.eval.fast import MIN_SLOTS, StaticDecoder, cache_slots, required_len
from flashdraft.eval.speculative import Decoder, decode
from flashdraft.model.drafter import DFlashDrafter, DraftCache
from flashdraft.model.head import TargetHead
from flashdraft.model.static import StaticLM
from flashdraft.model.target import LayerTaps

PROMPT = [5, 17, 3, 42, 8, 11, 29]
ROOT = Path(__file__).resolve().parents[2]
SLIDING = dict(
    num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=3
)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(initializer_range=0.3)


@pytest.fixture(scope="module")
def qwen3_target():
    return tiny_target("qwen3")


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    """The reference: transformers' own greedy decoding (generated tokens only)."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def chi_square_p_value(counts: Tensor, probs: Tensor) -> float:
    """Pearson chi-square goodness of fit, cells with expected count < 5 pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().view(1)]).double()
    wanted = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    statistic = ((observed - wanted) ** 2 / wanted).sum()
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def drafter_for(target, seed: int = 3, **overrides) -> DFlashDrafter:
    drafter = DFlashDrafter(drafter_config_for(target, **overrides))
    drafter.reset_parameters(seed)
    return drafter.eval()


class OracleDrafts(StaticDecoder):
    """Replaces the drafter's proposals by the greedy continuation, correct for a set number
    of leading slots (from a device-side table, so the step stays one static function), and
    records what the real drafter proposed at every step."""

    def __init__(self, *args, reference: list[int], correct: list[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reference = torch.tensor(reference + [0] * 64)
        self.correct = torch.tensor(correct * 64)  # right drafts per step, cycled
        self.steps = torch.zeros((), dtype=torch.long)
        self.proposals: list[list[int]] = []

    def _draft(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        own, logits = super()._draft(positions)
        self.proposals.append(own.tolist())
        truth = self.reference[positions[0, 1:]]
        slot = torch.arange(self.block - 1)
        wrong = (truth + 1) % self.lm.embed.weight.shape[0]
        drafts = torch.where(slot < self.correct[self.steps], truth, wrong)
        self.steps += 1
        return drafts, logits


def dynamic_proposals(target, drafter, head, prompt, output, lengths) -> list[list[int]]:
    """The drafter's own proposals replayed with flashdraft's dynamic `DraftCache` path
    (`extend_cache` + `draft_block`) over the accepted history."""
    block = drafter.config.block_size
    taps = LayerTaps(target, list(drafter.config.target_layer_ids))
    full = prompt + output
    with torch.no_grad():
        target(torch.tensor([full]))
        features = taps.features()
    taps.remove()
    cache = DraftCache()
    drafter.extend_cache(cache, features[:, : len(prompt)], torch.arange(len(prompt))[None])
    proposals, done = [], 0
    for n in lengths:
        start = len(prompt) + done
        query = torch.tensor([full[start]] + [drafter.config.mask_token_id] * (block - 1))
        hidden = drafter.draft_block(cache, head.embed(query[None]), start)
        proposals.append(head.logits(hidden[0, 1:]).argmax(-1).tolist())
        span = torch.arange(start, start + n)[None]
        drafter.extend_cache(cache, features[:, start : start + n], span)
        done += n
    return proposals


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_equals_generate_and_the_hf_loop_step_for_step(
    kind, sliding, target, qwen3_target
) -> None:
    model = target if kind == "llama" else qwen3_target
    drafter = drafter_for(model, block_size=4, **(SLIDING if sliding else {}))
    head = TargetHead.from_model(model)
    reference = hf_greedy(model, PROMPT, 30)
    lm = StaticLM(model, 1, 64, drafter.config.target_layer_ids)
    spec = StaticDecoder(model, max_len=64, drafter=drafter, head=head, block_size=4, lm=lm)
    base = StaticDecoder(model, max_len=64, lm=lm)
    fast = spec.decode(PROMPT, 30)
    assert fast.output_ids == reference
    assert base.decode(PROMPT, 30).output_ids == reference
    taps = LayerTaps(model, drafter.config.target_layer_ids)
    slow = decode(Decoder(model, drafter, head, taps, block_size=4), PROMPT, 30)
    taps.remove()
    assert fast.acceptance_lengths == slow.acceptance_lengths
    assert sum(fast.acceptance_lengths) + 1 == len(fast.output_ids)
    assert spec.info == {
        "decoder": "static",
        "graphs": False,
        "compiled": False,
        "drafter_compiled": False,
        "batch_size": 1,
    }


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_rewinds_after_rejections_and_the_drafters_proposals(target, sliding) -> None:
    """Rigged drafts (0..3 right per step) exercise partial acceptance and rewinds of both
    caches; the output stays greedy, the lengths are the rigged ones, and the real drafter's
    proposals equal its dynamic-cache path over the same accepted history."""
    drafter = drafter_for(target, block_size=4, **(SLIDING if sliding else {}))
    head = TargetHead.from_model(target)
    reference = hf_greedy(target, PROMPT, 80)
    correct = [2, 0, 3, 1, 3, 3, 0]
    decoder = OracleDrafts(
        target,
        max_len=96,
        drafter=drafter,
        head=head,
        block_size=4,
        reference=PROMPT + reference,
        correct=correct,
    )
    result = decoder.decode(PROMPT, 40)
    assert result.output_ids == reference[:40]
    expected = [
        c + 1 for c in itertools.islice(itertools.cycle(correct), len(result.acceptance_lengths))
    ]
    assert result.acceptance_lengths[:-1] == expected[:-1]  # the last one is cut at 40
    replayed = dynamic_proposals(
        target, drafter, head, PROMPT, result.output_ids, result.acceptance_lengths
    )
    assert decoder.proposals == replayed


def test_eos_inside_an_accepted_run_stops_like_greedy(target) -> None:
    reference = hf_greedy(target, PROMPT, 40)
    eos = reference[12]
    first = reference.index(eos)
    decoder = OracleDrafts(
        target,
        max_len=96,
        drafter=drafter_for(target, block_size=4),
        head=TargetHead.from_model(target),
        block_size=4,
        eos_ids={eos},
        reference=PROMPT + reference,
        correct=[3],
    )
    result = decoder.decode(PROMPT, 40)
    assert result.output_ids == reference[: first + 1] and result.stopped_at_eos


def test_the_cache_must_hold_the_whole_decode(target) -> None:
    decoder = StaticDecoder(target, max_len=32)
    with pytest.raises(ValueError, match="needs 38 cache slots; this decoder has 32"):
        decoder.decode(PROMPT, 30, seed=0)
    with pytest.raises(ValueError, match="needs a drafter"):
        StaticDecoder(target, max_len=32, block_size=4)


def test_cache_slots_hold_the_decode_in_few_sizes() -> None:
    sizes = set()
    for prompt in range(1, 3000, 7):
        slots = cache_slots(prompt, 256, 16)
        assert slots >= required_len(prompt, 256, 16) and slots >= MIN_SLOTS
        assert slots & (slots - 1) == 0  # a power of two
        sizes.add(slots)
    assert sizes == {512, 1024, 2048, 4096}


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_prompt_sets_of_other_lengths_do_not_recompile_the_step(target) -> None:
    """The quality pipeline evaluates many prompt sets in one process; a compiled step per
    set's longest prompt hit dynamo's recompile limit (a hard error with fullgraph) on the
    fifth set. With `cache_slots` the sets below share one cache size: after the first set's
    four graphs (verify of B tokens, the 1-token baseline, the drafter's block and its
    context's K/V), nothing compiles again."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    drafter = drafter_for(target, block_size=4)
    head = TargetHead.from_model(target)
    outputs = []
    for longest in (7, 60, 150, 300):  # 64-rounded sizes would be 64, 128, 192, 384
        prompt = (PROMPT * 50)[:longest]
        slots = cache_slots(longest, 24, 4)
        lm = StaticLM(target, 1, slots, list(drafter.config.target_layer_ids))
        kw = dict(max_len=slots, graphs=False, compile_backend=counter, lm=lm)
        spec = StaticDecoder(target, drafter=drafter, head=head, block_size=4, **kw)
        base = StaticDecoder(target, **kw)
        outputs.append((spec.decode(prompt, 24).output_ids, base.decode(prompt, 24).output_ids))
    assert counter.frame_count == 4
    assert all(s == b for s, b in outputs)  # T = 0: the speculative loop equals the baseline
    # Sizes past dynamo's default limit of 8 entries a function (the verify: two per size)
    # still compile instead of failing (fullgraph makes the limit a hard error).
    for slots in (64, 128, 192, 256, 320):
        lm = StaticLM(target, 1, slots, list(drafter.config.target_layer_ids))
        kw = dict(max_len=slots, graphs=False, compile_backend=counter, lm=lm)
        spec = StaticDecoder(target, drafter=drafter, head=head, block_size=4, **kw)
        base = StaticDecoder(target, **kw)
        assert spec.decode(PROMPT, 8).output_ids == base.decode(PROMPT, 8).output_ids
    assert counter.frame_count == 24
    torch._dynamo.reset()


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_the_compiled_drafter_parts_decode_as_the_eager_ones(temperature) -> None:
    """With a compile backend the drafter's block and its context's K/V projection are
    compiled too (the extend writes the caches in place: a lost write would change what later
    blocks draft). aot_eager functionalises the graphs as inductor does, on the CPU."""
    torch._dynamo.reset()
    # A 4-token vocabulary: a random drafter's blocks are partly accepted.
    model = tiny_llama(vocab_size=4, hidden_size=64, num_layers=3, initializer_range=0.3)
    drafter = drafter_for(model, seed=1, block_size=4, **SLIDING)
    head = TargetHead.from_model(model)
    runs = []
    for backend in (None, "aot_eager"):
        spec = StaticDecoder(
            model, max_len=96, drafter=drafter, head=head, block_size=4,
            temperature=temperature, graphs=False, compile_backend=backend,
        )  # fmt: skip
        assert (spec._draft_step == spec._draft) is (backend is None)
        assert spec.info["drafter_compiled"] is (backend is not None)
        result = spec.decode([0, 1, 2, 1, 3], 40, seed=3)
        runs.append((result.output_ids, result.acceptance_lengths, spec.ctx_keys[0].clone()))
    (eager_ids, eager_lengths, eager_keys), (ids, lengths, keys) = runs
    assert ids == eager_ids and lengths == eager_lengths
    assert max(eager_lengths) > 1  # the drafter's blocks mattered
    torch.testing.assert_close(keys, eager_keys)
    torch._dynamo.reset()


@pytest.mark.parametrize("window", [None, 3])
def test_the_broadcast_mask_equals_flex_create_mask(target, window) -> None:
    """The static loop evaluates the training mask_mod on broadcast index grids; flex's
    create_mask (vmap) is the reference meaning of a mask_mod."""
    overrides = SLIDING if window else {}
    decoder = StaticDecoder(
        target,
        max_len=16,
        drafter=drafter_for(target, block_size=4, **overrides),
        head=TargetHead.from_model(target),
        block_size=4,
    )
    decoder.start.fill_(9)
    kind = "sliding_attention" if window else "full_attention"
    mod = decoder._mask_mods[kind]
    zero, queries, keys = decoder._grid
    mine = mod(zero, zero, queries, keys).expand(4, 20)
    reference = create_mask(mod, 1, None, 4, 20, device="cpu")[0, 0]
    assert torch.equal(mine, reference)
    assert not reference[:, 9:16].any()  # nothing at or after the anchor's context slot


class ResampleFromTarget(StaticDecoder):
    """A wrong rule: after a rejection, sample the target's p (not the residual)."""

    def _accept(self, drafts, draft_logits, logits, positions):
        accepted, _ = super()._accept(drafts, draft_logits, logits, positions)
        from flashdraft.model.graphs import TOKEN, gumbel

        row = torch.softmax(logits.float() / self.temperature, -1).index_select(0, accepted.view(1))
        noise = gumbel(self.seed, positions[0, :1] + accepted + 1, TOKEN, row.shape[-1])
        return accepted, (row.log() + noise).argmax(-1)


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_sampling_matches_the_targets_distribution_and_a_wrong_rule_does_not() -> None:
    """As tests/eval/test_speculative.py, through the static loop's in-graph sampling:
    4-token vocabulary, 4 new tokens, B = 3, the exact joint law of 256 outcomes."""
    vocab, block, new, prompt = 4, 3, 4, [0, 1, 2, 1, 3]
    model = tiny_llama(vocab_size=vocab, hidden_size=32, num_layers=3, initializer_range=0.3)
    outcomes = torch.tensor(list(itertools.product(range(vocab), repeat=new)))
    ids = torch.cat([torch.tensor(prompt).expand(len(outcomes), -1), outcomes], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    steps = logp[:, len(prompt) - 1 : len(prompt) - 1 + new]
    exact = steps.gather(2, outcomes[..., None]).squeeze(-1).sum(dim=1).exp()
    drafter = drafter_for(model, seed=0, block_size=block)
    head = TargetHead.from_model(model)
    p_values, lengths = {}, []
    for rule in (StaticDecoder, ResampleFromTarget):
        decoder = rule(
            model, max_len=16, drafter=drafter, head=head, block_size=block, temperature=1.0
        )
        counts = torch.zeros(len(outcomes))
        for seed in range(400):
            result = decoder.decode(prompt, new, seed=seed)
            lengths += result.acceptance_lengths
            index = sum(t * vocab ** (new - 1 - i) for i, t in enumerate(result.output_ids))
            counts[index] += 1
        p_values[rule.__name__] = chi_square_p_value(counts, exact)
    assert set(lengths) == {1, 2, 3}  # rejections, partial and full acceptance all occur
    assert p_values["StaticDecoder"] > 1e-3, p_values
    assert p_values["ResampleFromTarget"] < 1e-6, p_values


@pytest.mark.slow  # long integration run: `pytest -m slow` (docs/testing.md)
def test_bench_speed_smoke_runs_on_cpu() -> None:
    out = subprocess.run(
        [sys.executable, "bench/eval.py", "--speed", "--smoke", "--layers", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "eval-speed" and result["drafter_layers"] == 2
    assert set(result["baseline_ms_per_token"]) == {
        "HF eager, DynamicCache",
        "static, eager kernels",
    }
    assert result["overhead_ratio"] > 0


# ---- GPU: graphs and compile give the eager loop's tokens and acceptance lengths ----


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["T0", "T1"])
@pytest.mark.parametrize("compiled", [False, True], ids=["graphs", "compiled+graphs"])
def test_graphed_loops_equal_the_eager_ones_on_cuda(compiled, temperature) -> None:
    model = tiny_llama(initializer_range=0.3).cuda()
    drafter = drafter_for(model, block_size=4, **SLIDING).cuda()
    head = TargetHead.from_model(model)
    backend = "inductor" if compiled else None
    outputs = {}
    for graphs in (False, True):
        kw = dict(max_len=96, graphs=graphs, compile_backend=backend if graphs else None)
        kw["temperature"] = temperature  # T = 1: the in-graph sampling, with the same noise
        spec = StaticDecoder(model, drafter=drafter, head=head, block_size=4, **kw)
        base = StaticDecoder(model, **kw)
        s, b = spec.decode(PROMPT, 48, seed=5), base.decode(PROMPT, 48, seed=5)
        outputs[graphs] = (s.output_ids, s.acceptance_lengths, b.output_ids)
        assert spec.info["graphs"] is graphs
        assert spec.info["drafter_compiled"] is (compiled and graphs)
    assert outputs[True] == outputs[False]
    if temperature == 0:
        assert outputs[True][2] == hf_greedy(model, PROMPT, 48)
