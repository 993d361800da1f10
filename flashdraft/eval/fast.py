"""The docs/design.md §5 decode loop at device speed: static caches for the target and for the drafter's
context, and the whole step as one static-shape function, replayed as one CUDA graph.

Same contract as `flashdraft.eval.speculative.decode` (it returns the same `DecodeResult`, and
at T = 0 the output is the target's greedy decoding); what differs is how a step runs. The HF
loop launches every kernel from Python, grows a `DynamicCache` and crops it after
rejections, which leaves a small target launch-bound (~30 ms per token for SmolLM2-135M on an
H200). Here nothing is cropped or concatenated (`flashdraft.model.static`: slot j holds
position j; what sits above the current position is invisible and gets overwritten).

Shape legend: P prompt tokens, B block size, L cache slots, V vocabulary, K taps, H hidden.

Device state: `bonus` [1] (the last emitted token, at position `start` [1]). One step:

    drafter: block [bonus, MASK x (B-1)] at start..start+B-1 over its static context cache,
             under the training `mask_mod` (context positions < start) -> drafts [B-1]
    target:  verify [bonus, drafts] at start..start+B-1 -> logits [B, V], taps [B, K*H]
    accept:  T = 0: the agreeing prefix; T > 0: rejection sampling (`Sampler.verify`'s rule)
    context: the taps of all B tokens projected and written at their positions (the rejected
             ones sit at >= the new start: invisible to the drafter, overwritten next step)
    advance: bonus <- the target's next token; start += accepted + 1

The host reads [accepted, next, drafts] once per step (one sync) to emit tokens and stop at an
eos or the length limit. B = 1 without a drafter is the baseline: plain decoding on the same
static cache with the same graphs, so a speedup is the ratio of two equally fast loops.

Sampling at T > 0 draws its noise from `flashdraft.model.static.counter_uniform`, a hash of
(seed, position, purpose): no generator lives in the graph. Each position's noise is used
only by the step that emits that position, so the rejection-sampling argument holds as with
independent draws (a draft that is discarded unseen leaves its position's noise unused).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flashdraft.benchutil import sync
from flashdraft.eval.speculative import DecodeResult
from flashdraft.model.attention import BlockLayout, MaskMod, dflash_mask_mod
from flashdraft.model.drafter import DecoderLayer, DFlashDrafter
from flashdraft.model.graphs import (
    ACCEPT,
    DRAFT,
    TOKEN,
    capture,
    counter_uniform,
    gumbel,
    preserved,
)
from flashdraft.model.head import TargetHead
from flashdraft.model.static import StaticLM


def required_len(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Cache slots a decode needs: the last step writes B positions from the last output."""
    return prompt_len + max_new_tokens + block_size


MIN_SLOTS = 512


def cache_slots(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Slots to allocate for decodes of up to this length: `required_len` rounded up to a
    power of two, at least MIN_SLOTS. The compiled step has static shapes, so every new cache
    size compiles the target forward again (twice: the verify of B tokens and the 1-token
    baseline), and dynamo refuses a ninth entry with fullgraph=True: one process that
    evaluates many prompt sets (`experiments/quality.py`: seven in one call) failed on its fifth
    set when the size followed each set's longest prompt. Buckets keep the entries few, at
    the cost of the unused slots: memory, and a step's attention reads them (SmolLM2-135M at
    2,048 slots instead of 1,216: ~19 MB more per step, a few microseconds on an H200)."""
    need = required_len(prompt_len, max_new_tokens, block_size)
    return max(MIN_SLOTS, 1 << (need - 1).bit_length())


class StaticDecoder:
    """One decode at a time (batch 1), on caches of `max_len` slots allocated once.

    target: the frozen HF causal LM (a layout `flashdraft.model.static` supports); drafter and
    head: for block_size > 1. `lm` may be shared between decoders of one target (the B = 1
    baseline and the speculative loop), as they never run at the same time. graphs: capture
    the step as a CUDA graph (default: on CUDA); compile_backend: compile the target's
    verify forward, and the drafter's block and context projection, first
    (`torch.compile(..., backend=compile_backend)`, e.g. "inductor"); compile_drafter=False
    leaves the drafter's parts eager (benchmarks: what compiling them saves).
    """

    def __init__(
        self,
        target: nn.Module,
        *,
        max_len: int,
        drafter: DFlashDrafter | None = None,
        head: TargetHead | None = None,
        block_size: int = 1,
        temperature: float = 0.0,
        eos_ids: Collection[int] = (),
        graphs: bool | None = None,
        compile_backend: str | Callable[..., Any] | None = None,
        compile_drafter: bool = True,
        lm: StaticLM | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if block_size > 1 and (drafter is None or head is None):
            raise ValueError("block_size > 1 needs a drafter and the target head")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        taps = list(drafter.config.target_layer_ids) if block_size > 1 and drafter else []
        self.lm = lm if lm is not None else StaticLM(target, 1, max_len, taps)
        if self.lm.rows != 1 or self.lm.max_len < max_len or self.lm.tap_ids[: len(taps)] != taps:
            raise ValueError("the shared StaticLM has the wrong rows, length or taps")
        self.block, self.max_len = block_size, max_len
        self.drafter, self.head = drafter, head
        self.temperature, self.eos_ids = temperature, frozenset(eos_ids)
        device = self.lm.device
        self.device = device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        if self.graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.compile_backend = compile_backend
        self._forward: Callable[..., tuple[Tensor, Tensor | None]] = self.lm
        # The drafter's two parts of a step (its block; its context's K/V), compiled like the
        # verify: eager, a 576-wide draft layer is dozens of small kernels, and even replayed
        # in a graph it cost ~0.15 ms, ~2.5 compiled target layers of SmolLM2-135M.
        # The prefill's extend stays eager (its length is the prompt's).
        self._draft_step = self._draft
        self._extend_step = self._extend
        if compile_backend is not None:
            compiled = functools.partial(
                torch.compile, backend=compile_backend, fullgraph=True, dynamic=False
            )
            if self.lm.hybrid:
                # per part (one graph serves every layer of a kind): a 64-layer hybrid
                # forward compiled whole would take minutes per block size
                self.lm.compile_layers(compile_backend)
            else:
                self._forward = compiled(self.lm.__call__)
            if drafter is not None and block_size > 1 and compile_drafter:
                self._draft_step = compiled(self._draft)
                self._extend_step = compiled(self._extend)
        self._graph: Any = None

        long = dict(dtype=torch.long, device=device)
        self.bonus, self.start = torch.zeros(1, **long), torch.zeros(1, **long)
        self.seed = torch.zeros(1, **long)
        self.out = torch.zeros(block_size + 1, **long)  # [accepted, next, drafts...]
        self._offsets = torch.arange(block_size, **long)
        if drafter is not None and block_size > 1:
            self._init_drafter(drafter)
        # A hybrid's verify keeps what rebuilds its linear layers' states after any accepted
        # prefix (`StaticLM.commit`): buffers allocated now, outside any capture.
        self._keep = self.lm.hybrid and block_size > 1
        if self._keep:
            self.lm.prepare_verify(block_size)

    @property
    def info(self) -> dict[str, Any]:
        """How this loop runs, for the report."""
        info = {
            "decoder": "static",
            "graphs": self.graphs,
            "compiled": self.compile_backend is not None,
            "drafter_compiled": self._draft_step != self._draft,
            "batch_size": 1,
        }
        if self.lm.hybrid:
            info["linear_states"] = "static" + (", exact rollback" if self._keep else "")
        return info

    # ---- the drafter's side: a static context cache and its mask ----

    def _init_drafter(self, drafter: DFlashDrafter) -> None:
        config = drafter.config
        parameter = next(drafter.parameters())
        self.drafter_dtype = parameter.dtype
        self.drafter_layers = [layer for layer in drafter.layers if isinstance(layer, DecoderLayer)]
        assert len(self.drafter_layers) == len(drafter.layers)
        shape = (1, config.num_key_value_heads, self.max_len, config.head_dim)
        self.ctx_keys = [
            torch.zeros(shape, dtype=parameter.dtype, device=self.device) for _ in drafter.layers
        ]
        self.ctx_values = [torch.zeros_like(k) for k in self.ctx_keys]
        self._mask_ids = torch.full((self.block - 1,), config.mask_token_id, device=self.device)
        # The training rule itself (docs/design.md §4) for one anchor at `start` whose context is the
        # whole cache: slots >= start are masked as "at or after the anchor".
        layout = BlockLayout(
            anchors=self.start.view(1, 1),
            anchor_valid=torch.ones(1, 1, dtype=torch.bool, device=self.device),
            doc_ids=torch.zeros(1, self.max_len, dtype=torch.long, device=self.device),
            block_size=self.block,
        )
        windows = {"full_attention": None, "sliding_attention": config.sliding_window}
        self._mask_mods: dict[str, MaskMod] = {
            kind: dflash_mask_mod(layout, windows[kind]) for kind in set(config.layer_types)
        }
        # The mask_mod evaluated on broadcast index grids ([B, 1] queries x [1, L + B] keys):
        # the tensor ops of a mask_mod broadcast, and this costs a few kernels, where
        # flex's `create_mask` vmaps every op (tests check the two agree). The batch index is
        # [1], not 0-d: Python indexing may read a 0-d index on the host (a capture error).
        self._grid = (
            torch.zeros(1, dtype=torch.long, device=self.device),
            torch.arange(self.block, device=self.device)[:, None],
            torch.arange(self.max_len + self.block, device=self.device)[None, :],
        )

    def _draft(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [1, B] -> (drafts [B-1], draft logits [B-1, V] fp32)."""
        drafter, head = self.drafter, self.head
        assert drafter is not None and head is not None
        query = torch.cat([self.bonus, self._mask_ids])
        x = head.embed(query[None]).to(self.drafter_dtype)
        rope_q = drafter.rotary(positions, x.dtype)
        zero, queries, keys = self._grid
        masks = {  # [1, 1, B, L + B]
            kind: mod(zero, zero, queries, keys).expand(self.block, keys.shape[1])[None, None]
            for kind, mod in self._mask_mods.items()
        }
        for layer, k, v in zip(self.drafter_layers, self.ctx_keys, self.ctx_values, strict=True):
            x = layer.decode(x, (k, v), rope_q, masks[layer.layer_type])
        logits = head.logits(drafter.norm(x)[0, 1:])  # slot 0 is the anchor
        if self.temperature == 0:
            return logits.argmax(dim=-1), logits
        noise = gumbel(self.seed.expand(self.block - 1), positions[0, 1:], DRAFT, logits.shape[-1])
        return (logits / self.temperature + noise).argmax(dim=-1), logits

    def _extend(self, taps: Tensor, positions: Tensor) -> None:
        """taps [1, N, K*H] at positions [1, N] -> projected context K/V, written in place."""
        drafter = self.drafter
        assert drafter is not None
        ctx = drafter.fuse_context(taps.to(self.drafter_dtype))
        cos, sin = drafter.rotary(positions, ctx.dtype)
        layers = zip(self.drafter_layers, self.ctx_keys, self.ctx_values, strict=True)
        for layer, keys, values in layers:
            k, v = layer.self_attn.project_kv(ctx, cos, sin)  # [1, Hkv, N, D]
            index = positions[:, None, :, None].expand_as(k)
            keys.scatter_(2, index, k)
            values.scatter_(2, index, v)

    # ---- acceptance ----

    def _accept(
        self, drafts: Tensor, draft_logits: Tensor | None, logits: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """drafts [n]; logits [n + 1, V] -> (accepted 0-d, next token [1]), on the device.
        Indexing with device tensors goes through gather / index_select: a 0-d tensor used as
        a Python index would read it on the host, which a graph capture refuses."""
        n = drafts.shape[0]
        if self.temperature == 0:
            target_next = logits.argmax(dim=-1)  # [n + 1]
            accepted = (drafts == target_next[:n]).long().cumprod(dim=0).sum()
            return accepted, target_next.gather(0, accepted.view(1))
        t = self.temperature
        p = torch.softmax(logits.float() / t, dim=-1)  # [n + 1, V]
        accepted = torch.zeros((), dtype=torch.long, device=self.device)
        residual = p
        if n > 0:
            assert draft_logits is not None
            q = torch.softmax(draft_logits.float() / t, dim=-1)  # [n, V]
            p_d = p[:n].gather(1, drafts[:, None])[:, 0]
            q_d = q.gather(1, drafts[:, None])[:, 0]
            u = counter_uniform(self.seed.expand(n), positions[0, 1:], ACCEPT, 1)[:, 0]
            # Accept draft k with probability min(1, p/q) (Sampler.verify's rule).
            accepted = (u * q_d < p_d).long().cumprod(dim=0).sum()
            residual = torch.cat([(p[:n] - q).clamp(min=0.0), p[n:]], dim=0)
        row = residual.index_select(0, accepted.view(1))  # [1, V]
        # All zero only through rounding where p == q; p is then the right distribution.
        row = torch.where(row.sum() > 0, row, p.index_select(0, accepted.view(1)))
        emitted_at = positions[0, :1] + accepted + 1  # the position of the token sampled here
        noise = gumbel(self.seed, emitted_at, TOKEN, row.shape[-1])
        return accepted, (row.log() + noise).argmax(dim=-1)

    # ---- the step ----

    def _step(self) -> None:
        """One whole step on device state: static shapes, no host sync (graph-capturable)."""
        positions = (self.start + self._offsets)[None]  # [1, B]
        speculative = self.block > 1
        drafts, draft_logits = self.bonus[:0], None
        if speculative:
            drafts, draft_logits = self._draft_step(positions)
        block = torch.cat([self.bonus, drafts])[None]
        logits, taps = self._forward(block, positions, keep=self._keep)
        accepted, next_token = self._accept(drafts, draft_logits, logits[0], positions)
        if self._keep:  # the linear layers' states after bonus + the accepted drafts
            self.lm.commit(accepted.view(1))
        if speculative:
            assert taps is not None
            self._extend_step(taps, positions)
        self.out[:1].copy_(accepted.view(1))
        self.out[1:2].copy_(next_token)
        self.out[2:].copy_(drafts)
        self.bonus.copy_(next_token)
        self.start.add_(accepted + 1)

    def parts(self) -> dict[str, Callable[[], object]]:
        """The step's big parts alone, on the current state (for benchmarks): "verify" (the
        target over B tokens) and, with a drafter, "draft" (the drafter's block)."""
        block = torch.zeros(1, self.block, dtype=torch.long, device=self.device)

        def positions() -> Tensor:
            return (self.start + self._offsets)[None]

        out: dict[str, Callable[[], object]] = {
            "verify": lambda: self._forward(block, positions(), keep=self._keep)
        }
        if self.block > 1:
            out["draft"] = lambda: self._draft_step(positions())
        return out

    def warm_up(self) -> None:
        """Compile and capture now (otherwise the first decode does)."""
        if self._graph is not None:
            return
        # Every cache size compiles the target forward again (twice: B tokens and 1), and
        # past dynamo's default of 8 entries fullgraph is a hard error: `cache_slots` keeps
        # the sizes few, this the error away from a process that evaluates many prompt sets.
        limit = max(64, torch._dynamo.config.recompile_limit)
        with (
            torch.no_grad(),
            preserved([self.bonus, self.start, self.out]),
            torch._dynamo.config.patch(recompile_limit=limit),
        ):
            # Any in-range position will do: what warm-up writes is overwritten before use.
            self.start.zero_()
            if self.graphs:
                self._graph = capture(self._step)
            elif self.compile_backend is not None:
                self._step()

    def _run_step(self) -> None:
        if self._graph is not None:
            self._graph.replay()
        else:
            self._step()

    # ---- the loop ----

    def _prefill(self, prompt: Sequence[int]) -> int:
        """The prompt through the target (eagerly: its length varies) -> the first token;
        the drafter's context gets the prompt's taps."""
        n = len(prompt)
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device)[None]
        last = torch.full((1,), n - 1, device=self.device)
        self.lm.reset_states()  # a hybrid's linear layers start from nothing
        logits, taps = self.lm(ids, positions, kv_len=n, logits_at=last)
        scores = logits[:, 0].float()
        if self.temperature > 0:
            at = torch.full((1,), n, device=self.device)
            scores = scores / self.temperature + gumbel(self.seed, at, TOKEN, scores.shape[-1])
        first = scores.argmax(dim=-1)
        if self.block > 1:
            assert taps is not None
            self._extend(taps, positions)
        self.bonus.copy_(first)
        self.start.fill_(n)
        return int(first)  # host sync: the prefill ends here

    @torch.no_grad()
    def decode(self, prompt_ids: Sequence[int], max_new_tokens: int, seed: int = 0) -> DecodeResult:
        """Up to `max_new_tokens` tokens after `prompt_ids` (docs/design.md §5), like `speculative.decode`;
        `seed` keys the sampling noise at T > 0."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not prompt_ids:
            raise ValueError("empty prompt: the target needs at least one token to continue")
        need = required_len(len(prompt_ids), max_new_tokens, self.block)
        if need > self.max_len:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens + {max_new_tokens} new needs {need} cache "
                f"slots; this decoder has {self.max_len}"
            )
        self.warm_up()
        self.seed.fill_(seed)
        sync(self.device)
        t0 = time.perf_counter()
        output = [self._prefill(prompt_ids)]
        t1 = time.perf_counter()
        lengths: list[int] = []
        stopped = output[0] in self.eos_ids
        while not stopped and len(output) < max_new_tokens:
            self._run_step()
            host = self.out.tolist()  # the step's one host sync
            accepted, next_token, drafts = host[0], host[1], host[2:]
            emitted = [*drafts[:accepted], next_token][: max_new_tokens - len(output)]
            for i, token in enumerate(emitted):
                if token in self.eos_ids:
                    emitted, stopped = emitted[: i + 1], True
                    break
            output.extend(emitted)
            lengths.append(len(emitted))
        sync(self.device)
        t2 = time.perf_counter()
        return DecodeResult(
            output_ids=output,
            acceptance_lengths=lengths,
            prompt_len=len(prompt_ids),
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            stopped_at_eos=stopped,
        )
