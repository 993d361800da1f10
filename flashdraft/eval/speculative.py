"""Speculative decoding with a DFlash drafter against the live target (docs/design.md §5).

Model-level code only: no files, no CLI, no metrics aggregation (`flashdraft.eval.evaluate` and
`flashdraft.eval.report` do those). One prompt at a time, batch 1, as in the DFlash paper's acceptance measurements.

Shape legend: P prompt tokens, B block size (bonus + B-1 drafts), H hidden, K taps, V vocab.

The loop, with the target's KV cache and the drafter's cache of projected context K/V:

    prefill the target on the prompt -> first token (the bonus) and the prompt's taps
    repeat:
        drafter: block [bonus, MASK x (B-1)] at positions start..start+B-1 -> B-1 drafts
        target:  one forward over [bonus, drafts] with its KV cache -> B next-token predictions
        accepted = length of the agreeing prefix of the drafts (rejection sampling at T > 0)
        emit accepted drafts + the target's next token (the new bonus)
        crop the target cache to the verified tokens; append their taps to the drafter cache

A hybrid target's linear-attention layers hold recurrent states that cannot be cropped: after
a rejection they are put back as they were before the block and the verified tokens are fed
again (`flashdraft.model.hybrid.LinearStateRollback`), which costs one short target forward
per step with a rejection.

`acceptance_lengths` holds, per verify step, the number of tokens that step emitted
(accepted drafts + 1), so tau = mean(acceptance_lengths) and
sum(acceptance_lengths) + 1 == len(output_ids) (the first token comes from the prefill). A step
that ends the output (max_new_tokens reached, or an eos among its tokens) counts only the
tokens it emitted up to that end, so the output is exactly the target's own decoding,
truncated at the first eos inclusive.

With B = 1 (or no drafter) the same loop is plain decoding with the target: the speedup
baseline, and at T = 0 the lossless reference (tests check it equals HF `generate`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from flashdraft.benchutil import sync
from flashdraft.model.drafter import DFlashDrafter, DraftCache
from flashdraft.model.head import TargetHead
from flashdraft.model.hybrid import LinearStateRollback, decode_cache, is_hybrid
from flashdraft.model.target import LayerTaps


@dataclass(slots=True)
class Sampler:
    """Draft proposal and verification at one temperature.

    T = 0: drafts are the drafter's argmax and a draft is accepted iff it equals the
    target's argmax (greedy verification). T > 0: drafts are sampled from the drafter's
    q = softmax(logits / T), and verified with standard speculative rejection sampling
    (Leviathan et al. 2023, Chen et al. 2023), which leaves the output distributed exactly
    as sampling from the target's p = softmax(logits / T). No top-k / top-p.
    """

    temperature: float = 0.0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sample(self, logits: Tensor) -> Tensor:
        """logits [..., V] -> token ids [...] (argmax at T = 0)."""
        if self.greedy:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        flat = probs.reshape(-1, probs.shape[-1])
        ids = torch.multinomial(flat, 1, generator=self.generator)
        return ids.view(probs.shape[:-1])

    def verify(
        self, drafts: Tensor, draft_logits: Tensor, target_logits: Tensor
    ) -> tuple[Tensor, Tensor]:
        """drafts [n]; draft_logits [n, V]; target_logits [n + 1, V] at the block positions.

        Returns (accepted, next_token) as 0-d device tensors: the number of leading drafts
        kept and the token the target emits after them. No host sync here.
        """
        n = drafts.shape[0]
        if self.greedy:
            target_next = target_logits.argmax(dim=-1)  # [n + 1]
            agree = (drafts == target_next[:n]).long()
            accepted = agree.cumprod(dim=0).sum()
            return accepted, target_next[accepted]
        p = torch.softmax(target_logits.float() / self.temperature, dim=-1)  # [n + 1, V]
        if n == 0:  # plain sampling from the target (B = 1)
            zero = torch.zeros((), dtype=torch.long, device=drafts.device)
            return zero, torch.multinomial(p[0], 1, generator=self.generator)[0]
        q = torch.softmax(draft_logits.float() / self.temperature, dim=-1)  # [n, V]
        rows = torch.arange(n, device=drafts.device)
        p_d, q_d = p[rows, drafts], q[rows, drafts]
        u = torch.rand(n, device=drafts.device, generator=self.generator)
        # Accept draft k with probability min(1, p/q); u * q < p avoids dividing by q.
        keep = (u * q_d < p_d).long()
        accepted = keep.cumprod(dim=0).sum()
        # After rejecting draft k, sample from norm(max(0, p_k - q_k)); after accepting all,
        # from p_n. Built for every row so the choice stays on the device.
        residual = torch.cat([(p[:n] - q).clamp(min=0.0), p[n:]], dim=0)
        row = residual[accepted]
        # An all-zero residual means p == q there, where rejection has probability 0; it can
        # only be reached through rounding, and then p is the right distribution.
        row = torch.where(row.sum() > 0, row, p[accepted])
        next_token = torch.multinomial(row, 1, generator=self.generator)[0]
        return accepted, next_token


@dataclass(slots=True)
class Decoder:
    """What one decode needs besides the prompt: the target and, for B > 1, the drafter.

    `taps` must tap `drafter.config.target_layer_ids` on `target` (the same hooks the
    trainer uses may be passed in). `head` is the target's frozen embedding and LM head,
    used for the drafter's block embeddings and draft logits only: verification always uses
    the target's own forward.
    """

    target: nn.Module
    drafter: DFlashDrafter | None = None
    head: TargetHead | None = None
    taps: LayerTaps | None = None
    block_size: int = 1
    eos_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.block_size > 1 and (self.drafter is None or self.head is None or self.taps is None):
            raise ValueError("block_size > 1 needs a drafter, the target head and layer taps")
        tapped = list(self.taps.layer_ids) if self.taps is not None else None
        wanted = list(self.drafter.config.target_layer_ids) if self.drafter is not None else None
        if tapped is not None and wanted is not None and tapped != wanted:
            raise ValueError(f"taps {tapped} differ from the drafter's target_layer_ids {wanted}")

    @property
    def speculative(self) -> bool:
        return self.block_size > 1


@dataclass(slots=True)
class DecodeResult:
    output_ids: list[int]  # generated tokens, the prefill's first; eos included if reached
    acceptance_lengths: list[int]  # tokens emitted per verify step (accepted drafts + 1)
    prompt_len: int
    prefill_s: float
    decode_s: float  # everything after the first token: the steps; prefill excluded
    stopped_at_eos: bool

    @property
    def num_steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float | None:
        """Mean acceptance length (accepted + 1) over this prompt's steps; None if none."""
        steps = self.acceptance_lengths
        return sum(steps) / len(steps) if steps else None


def eos_token_ids(model: nn.Module, tokenizer: Any = None) -> frozenset[int]:
    """The ids that end generation: the generation config's (SmolLM2: <|im_end|>, not the
    tokenizer's eos), falling back to the tokenizer's eos token."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else [int(i) for i in eos])


def cache_argument(model: nn.Module) -> str:
    """transformers >= 5.2x calls the KV-cache argument `cache` (`past_key_values` is
    deprecated there); earlier 5.x releases only know `past_key_values`."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _drafter_dtype(drafter: DFlashDrafter) -> torch.dtype:
    return next(drafter.parameters()).dtype


def _end_of_output(
    tokens: list[int], room: int, eos_ids: Collection[int]
) -> tuple[list[int], bool]:
    """The tokens a step may emit: at most `room`, and up to the first eos inclusive."""
    tokens = tokens[:room]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1], True
    return tokens, False


# no_grad, not inference_mode: an FSDP2-sharded target all-gathers its weights into buffers
# that inference mode would mark read-only.
@torch.no_grad()
def decode(
    decoder: Decoder,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampler: Sampler | None = None,
) -> DecodeResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids` (docs/design.md §5)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompt_ids:
        raise ValueError("empty prompt: the target needs at least one token to continue")
    sampler = sampler or Sampler()
    target, drafter, taps = decoder.target, decoder.drafter, decoder.taps
    device = _model_device(target)
    cache_arg = cache_argument(target)
    # A plain (non-sliding) cache layer per target layer, even for sliding-window targets:
    # those layers still mask by position, and only a full layer can be cropped after a
    # rejection once the window has been passed. Hybrids: state layers for the linear ones.
    cache = decode_cache(target)
    rollback = LinearStateRollback(cache) if is_hybrid(target.config) else None
    draft_cache = DraftCache()
    block = decoder.block_size
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    prompt_len = prompt.shape[1]

    sync(device)
    t0 = time.perf_counter()
    out = target(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
    bonus = sampler.sample(out.logits[0, -1])
    if taps is not None:
        features = taps.features()
        if decoder.speculative:
            assert drafter is not None
            positions = torch.arange(prompt_len, device=device)[None]
            drafter.extend_cache(draft_cache, features.to(_drafter_dtype(drafter)), positions)
    first = int(bonus)  # host sync: the prefill ends here
    t1 = time.perf_counter()

    output = [first]
    lengths: list[int] = []
    stopped = first in decoder.eos_ids
    while not stopped and len(output) < max_new_tokens:
        start = prompt_len + len(output) - 1  # position of the bonus, the block's anchor
        assert cache.get_seq_length() == start, (cache.get_seq_length(), start)
        block_ids, drafts, draft_logits = _propose(decoder, draft_cache, bonus, start, sampler)
        saved = rollback.save() if rollback is not None and decoder.speculative else None
        logits = target(input_ids=block_ids[None], use_cache=True, **{cache_arg: cache}).logits
        accepted_t, bonus = sampler.verify(drafts, draft_logits, logits[0])
        # The step's one host sync: how many drafts survived, and their values.
        host = torch.cat([accepted_t.view(1), bonus.view(1), drafts]).tolist()
        accepted, next_token, draft_list = host[0], host[1], host[2:]
        emitted, stopped = _end_of_output(
            [*draft_list[:accepted], next_token], max_new_tokens - len(output), decoder.eos_ids
        )
        output.extend(emitted)
        lengths.append(len(emitted))
        if stopped or len(output) >= max_new_tokens:
            break
        # Keep the K/V of the verified tokens (bonus + accepted drafts); the new bonus is
        # fed at the next step. Cropping by a negative count works on every 5.x cache.
        rejected = block - (accepted + 1)
        if rejected and rollback is None:
            cache.crop(-rejected)
        elif rejected:
            # Hybrid: back to before the block, then the verified tokens again (their taps
            # replace the block's, for the drafter below).
            assert rollback is not None and saved is not None
            rollback.rewind(saved, block)
            verified = block_ids[None, : accepted + 1]
            target(input_ids=verified, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        if decoder.speculative:
            assert drafter is not None and taps is not None
            features = taps.features()[:, : accepted + 1]
            positions = torch.arange(start, start + accepted + 1, device=device)[None]
            drafter.extend_cache(draft_cache, features.to(_drafter_dtype(drafter)), positions)
    sync(device)
    t2 = time.perf_counter()
    if taps is not None:
        taps.captured.clear()  # the last verify's taps are not needed; free them
    return DecodeResult(
        output_ids=output,
        acceptance_lengths=lengths,
        prompt_len=prompt_len,
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        stopped_at_eos=stopped,
    )


def _propose(
    decoder: Decoder, draft_cache: DraftCache, bonus: Tensor, start: int, sampler: Sampler
) -> tuple[Tensor, Tensor, Tensor]:
    """(block ids [B] = [bonus, drafts], drafts [B-1], draft logits [B-1, V]) for one step."""
    bonus = bonus.view(1)
    if not decoder.speculative:
        empty = bonus.new_empty(0)
        return bonus, empty, torch.empty(0, 0, device=bonus.device)
    drafter, head = decoder.drafter, decoder.head
    assert drafter is not None and head is not None
    masks = bonus.new_full((decoder.block_size - 1,), drafter.config.mask_token_id)
    query = torch.cat([bonus, masks])
    embeds = head.embed(query[None]).to(_drafter_dtype(drafter))
    hidden = drafter.draft_block(draft_cache, embeds, start)  # [1, B, H]
    draft_logits = head.logits(hidden[0, 1:])  # [B-1, V] fp32; slot 0 is the anchor
    drafts = sampler.sample(draft_logits)
    return torch.cat([bonus, drafts]), drafts, draft_logits
