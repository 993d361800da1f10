"""`flashdraft eval`: real acceptance (tau) and speedup with the draft-and-verify loop.

    flashdraft eval --target PATH --drafter PATH --prompts FILE --output REPORT.json

`EvalConfig` holds the command's options. The drafter may be a training checkpoint, a run
directory, or an exported folder (ours in either format, or one published by z-lab); the
command loads it (`flashdraft.train.checkpoint.load_drafter`) after the target, then
`run_eval` measures it. Prompts are read by `flashdraft.eval.prompts`, the report is built and
written by `flashdraft.eval.report` (its docstring lists every field).

`evaluate_drafter` is the measurement itself as a plain function, for in-training evaluation:
every prompt decoded by the speculative loop, and, as the reference, by the target alone
(B = 1) on the same prompts. Two implementations of the loop, chosen once per evaluation
(`choose_decoder`): the HF one (`flashdraft.eval.speculative`: HF forward, DynamicCache,
eager) and the static one (`flashdraft.eval.fast`: static caches, one CUDA graph per step),
the default on CUDA for targets it supports. Both loops of one evaluation use the same kind,
so the speedup compares like with like; the report says how each ran (`loops`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from flashdraft import config as cfg
from flashdraft.benchutil import device_name, machine_id
from flashdraft.config import option
from flashdraft.data.inference import resolve_dtype
from flashdraft.eval.fast import StaticDecoder, cache_slots
from flashdraft.eval.prompts import EvalPrompt, as_prompt, load_prompts
from flashdraft.eval.report import (
    account_lossless,
    prompt_entry,
    speedup,
    summarize,
    timing,
)
from flashdraft.eval.report import tie_tolerance as default_tie_tolerance
from flashdraft.eval.speculative import Decoder, DecodeResult, Sampler, decode, eos_token_ids
from flashdraft.log import get_logger
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.fp8 import precision_of
from flashdraft.model.head import TargetHead
from flashdraft.model.hub import check_model_path
from flashdraft.model.hybrid import is_hybrid
from flashdraft.model.static import StaticLM, unsupported_reason
from flashdraft.model.target import LayerTaps, decoder_layers, load_target

log = get_logger(__name__)

REPORT = ("report",)  # settings `flashdraft eval` records in its report
Decoders = Literal["auto", "hf", "static"]
HF_LOOP = {"decoder": "hf", "graphs": False, "compiled": False, "batch_size": 1}


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """The options of `flashdraft eval`."""

    target: str = option(help="HF model directory or hub id", tags=REPORT)
    drafter: str = option(
        help="training checkpoint, run directory, or exported folder (dflash / speculators / z-lab)",
        tags=REPORT,
    )
    prompts: str = option(help="JSONL: messages / conversations / prompt", tags=REPORT)
    output: str = option(help="REPORT.json (the plot goes beside it)")
    max_new_tokens: int = option(256, ge=1, help="tokens generated per prompt")
    temperature: float = option(0.0, ge=0, help="sampling temperature (0: greedy)")
    block_size: int | None = option(None, ge=1, help="default: the drafter's")
    limit: int | None = option(None, ge=1, help="evaluate the first N prompts")
    seed: int = option(0, help="sampling seed (T > 0)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = option(
        "auto", help="target and drafter dtype (auto: bfloat16 on CUDA, float32 on CPU)"
    )
    device: str | None = option(None, help="default: cuda if available, else cpu")
    precision: Literal["bf16", "fp8"] = option(
        "bf16",
        help="the target's linear layers: bf16 (in --dtype) or fp8 (float8 weights and "
        "per-token activations, as FP8 servers run it; CUDA sm_89+, emulated on the CPU); "
        "the report's settings say which ran (target_precision)",
    )
    attn_implementation: str = option("sdpa", help="the target's HF attention implementation")
    reference: bool = option(
        True,
        help="run the target alone (B = 1) for the lossless check and the speedup",
        off_help="skip the target-alone run (B = 1): no lossless check, no speedup",
    )
    decoder: Decoders = option(
        "auto",
        help="the decode loop, for both runs: static (static KV caches, one CUDA graph per "
        "step), hf (HF forward + DynamicCache, eager); auto: static on CUDA for the targets "
        "it supports (Llama, Mistral, Qwen2, Qwen3 layouts), else hf",
        tags=REPORT,
    )
    compile: bool = option(
        True,
        help="static decoder on CUDA: torch.compile the target's step before capturing it "
        "(~30 s per block size, once)",
        off_help="static decoder on CUDA: capture graphs of eager kernels, no torch.compile",
        tags=REPORT,
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


# ---- checks ----


def check_compatible(drafter: DFlashDrafter, target: Any) -> None:
    """Refuse a drafter built for another target (ValueError naming the mismatch)."""
    config, text = drafter.config, target.config.get_text_config()
    layers = len(decoder_layers(target))
    vocab = int(target.get_input_embeddings().weight.shape[0])
    problems = []
    if config.hidden_size != int(text.hidden_size):
        problems.append(f"hidden size {config.hidden_size} vs the target's {text.hidden_size}")
    if config.num_target_layers != layers:
        problems.append(f"built for {config.num_target_layers} target layers, target has {layers}")
    if not 0 <= config.mask_token_id < vocab:
        problems.append(f"mask token {config.mask_token_id} outside the target's {vocab} rows")
    if config.vocab_size != vocab:
        problems.append(f"vocab size {config.vocab_size} vs the target's {vocab}")
    if problems:
        raise ValueError("the drafter does not fit this target: " + "; ".join(problems))
    TargetHead.from_model(target).check_drafter(config)


# ---- the measurement ----


def choose_decoder(requested: str, target: nn.Module) -> str:
    """ "static" or "hf" for `requested` (auto / hf / static) and this target (ValueError
    when static is asked of a target it cannot run)."""
    if requested not in ("auto", "hf", "static"):
        raise ValueError(f"decoder {requested!r}: use auto, hf or static")
    if requested == "hf":
        return "hf"
    reason = unsupported_reason(target)
    if requested == "static" and reason is not None:
        raise ValueError(f"decoder 'static' cannot run this target ({reason}); use --decoder hf")
    if requested == "static":
        return "static"
    if next(target.parameters()).device.type != "cuda":
        return "hf"  # on a CPU both are eager; the HF loop is the reference
    if reason is not None:
        log.info(f"eval: the HF decode loop runs: the static one does not support {reason}")
        return "hf"
    return "static"


@dataclass(slots=True)
class _Loop:
    """Decodes one prompt, speculatively (the drafter proposes B - 1 tokens per step) or with
    the target alone, seeded per prompt so that both runs of a prompt sample alike. With
    `max_len` set, it runs the static loops (built on first use, sharing one target cache);
    else the HF loop."""

    target: nn.Module
    drafter: DFlashDrafter
    block_size: int
    temperature: float
    seed: int
    eos: frozenset[int]
    taps: LayerTaps | None  # hooks the caller holds on the target, else added per prompt
    max_len: int | None = None  # static caches of this many slots; None: the HF loop
    compile_backend: str | None = None
    head: TargetHead = field(init=False)
    device: torch.device = field(init=False)
    static: dict[bool, StaticDecoder] = field(init=False, default_factory=dict)
    lm: StaticLM | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.head = TargetHead.from_model(self.target)
        self.device = next(self.target.parameters()).device

    def info(self, speculative: bool) -> dict[str, Any]:
        """How the speculative or the B = 1 loop runs, for the report."""
        if self.max_len is not None:
            return self._static(speculative).info
        info = dict(HF_LOOP)
        if is_hybrid(self.target.config):  # LinearStateRollback: re-run after a rejection
            info["linear_states"] = "HF cache" + (
                ", re-run after rejections" if speculative else ""
            )
        return info

    def use_static(self, max_len: int, compile_backend: str | None) -> None:
        """Run the static loops from now on: one target cache of `max_len` slots with the
        drafter's taps (the B = 1 loop ignores them), checked against an HF forward
        (ValueError if it differs)."""
        taps = list(self.drafter.config.target_layer_ids)
        lm = StaticLM(self.target, 1, max_len, taps)
        try:
            lm.verify()
        finally:  # an HF forward: the caller's hooks fired; leave them empty
            if self.taps is not None:
                self.taps.captured.clear()
        self.lm, self.max_len, self.compile_backend = lm, max_len, compile_backend

    def _static(self, speculative: bool) -> StaticDecoder:
        if speculative not in self.static:
            assert self.max_len is not None and self.lm is not None
            self.static[speculative] = StaticDecoder(
                self.target,
                max_len=self.max_len,
                drafter=self.drafter if speculative else None,
                head=self.head if speculative else None,
                block_size=self.block_size if speculative else 1,
                temperature=self.temperature,
                eos_ids=self.eos,
                compile_backend=self.compile_backend,
                lm=self.lm,
            )
        return self.static[speculative]

    def run(
        self, prompt: EvalPrompt, speculative: bool, new_tokens: int, index: int
    ) -> DecodeResult:
        if self.max_len is not None:
            static = self._static(speculative)
            return static.decode(prompt.input_ids, new_tokens, seed=self.seed + index)
        generator = torch.Generator(device=self.device).manual_seed(self.seed + index)
        sampler = Sampler(self.temperature, generator)
        if not speculative:
            decoder = Decoder(self.target, eos_ids=self.eos)
            return decode(decoder, prompt.input_ids, new_tokens, sampler)
        ids = self.drafter.config.target_layer_ids
        hooks = self.taps if self.taps is not None else LayerTaps(self.target, ids)
        try:
            decoder = Decoder(
                self.target,
                self.drafter,
                self.head,
                hooks,
                block_size=self.block_size,
                eos_ids=self.eos,
            )
            return decode(decoder, prompt.input_ids, new_tokens, sampler)
        finally:
            if self.taps is None:  # the B = 1 baseline runs hook-free
                hooks.remove()


def _decode_all(
    loop: _Loop, prompts: list[EvalPrompt], max_new_tokens: int, reference: bool, progress: bool
) -> tuple[list[DecodeResult], list[DecodeResult]]:
    """(speculative results, target-alone results: empty without `reference`), per prompt."""
    if loop.device.type == "cuda" and prompts:
        # Warm-up: CUDA context, cuBLAS handles and kernels stay out of the timing.
        warm_tokens = min(max_new_tokens, 2 * loop.block_size)
        loop.run(prompts[0], True, warm_tokens, 0)
        if reference:
            loop.run(prompts[0], False, warm_tokens, 0)
    spec, base = [], []
    for index, prompt in enumerate(tqdm(prompts, desc="eval", unit="prompt", disable=not progress)):
        if reference:
            base.append(loop.run(prompt, False, max_new_tokens, index))
        spec.append(loop.run(prompt, True, max_new_tokens, index))
    return spec, base


def _use_static(
    loop: _Loop, decoder: str, items: list[EvalPrompt], max_new_tokens: int, compile: bool
) -> None:
    """Switch `loop` to the static loops, with caches for the longest prompt; if the static
    forward fails its check against HF's, `auto` keeps the HF loop (and says so)."""
    longest = max(len(p.input_ids) for p in items)
    slots = cache_slots(longest, max_new_tokens, loop.block_size)
    try:
        loop.use_static(slots, "inductor" if compile else None)
    except ValueError as err:
        if decoder == "static":
            raise
        log.warning(f"eval: the HF decode loop runs instead of the static one: {err}")


def evaluate_drafter(
    target: nn.Module,
    tokenizer: Any,
    drafter: DFlashDrafter,
    prompts: Sequence[EvalPrompt | dict[str, Any] | Sequence[int]],
    *,
    max_new_tokens: int = 128,
    block_size: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    reference: bool | None = None,
    taps: LayerTaps | None = None,
    progress: bool = False,
    tie_tolerance: float | None = None,
    decoder: str = "auto",
    compile: bool = False,
) -> dict[str, Any]:
    """Run the real draft-and-verify loop on `prompts` and return the report dict.

    target: the frozen HF causal LM (eval mode); drafter: an eager, unwrapped drafter (not
    compiled with static shapes: the context grows every step); prompts: records (rendered
    with `tokenizer`), `EvalPrompt`s or token-id lists (then `tokenizer` may be None).
    block_size defaults to the drafter's. `reference` runs the target alone (B = 1) on the
    same prompts: the lossless check at T = 0 and the speedup baseline on CUDA; by default
    it runs when either applies. `taps` lets a caller share hooks it already holds on the
    target (they must tap the drafter's layers); otherwise hooks are added per prompt and
    removed after it, so the B = 1 baseline runs hook-free. At T = 0 a prompt whose output
    differs from the baseline gets a `mismatch` diagnosis (`report.diagnose_mismatch`);
    `tie_tolerance` defaults to the target's dtype's and precision's (`report.tie_tolerance`). `decoder` picks the
    loop (`choose_decoder`; the static one reads its taps itself and ignores `taps`);
    `compile` compiles the static loop's target step on CUDA.
    """
    check_compatible(drafter, target)
    block = block_size or drafter.config.block_size
    eos = eos_token_ids(target, tokenizer)
    items = [as_prompt(p, i, tokenizer) for i, p in enumerate(prompts)]
    loop = _Loop(target, drafter, block, temperature, seed, eos, taps)
    cuda = loop.device.type == "cuda"
    if choose_decoder(decoder, target) == "static" and items:
        _use_static(loop, decoder, items, max_new_tokens, compile and cuda)
    if reference is None:
        reference = temperature == 0.0 or cuda
    spec, base = _decode_all(loop, items, max_new_tokens, reference, progress)

    report = summarize(spec, block)
    baselines: list[DecodeResult | None] = list(base) or [None] * len(items)
    report["per_prompt"] = [
        prompt_entry(p, r, b, tokenizer, temperature)
        for p, r, b in zip(items, spec, baselines, strict=True)
    ]
    target_dtype = next(target.parameters()).dtype
    tolerance = tie_tolerance
    if tolerance is None:
        tolerance = default_tie_tolerance(target_dtype, precision_of(target))
    checked = reference and temperature == 0.0
    if checked:
        report.update(account_lossless(target, items, report["per_prompt"], tolerance))
    report["timing"] = timing(spec, base)
    gain = speedup(report["timing"]) if cuda and base else None
    if gain is not None:
        report["speedup"] = gain
    # How each loop ran, next to the speedup (both use the same kind of loop).
    report["loops"] = {
        "speculative": loop.info(True),
        **({"baseline": loop.info(False)} if base else {}),
    }
    report["settings"] = {
        "block_size": block,
        "drafter_block_size": drafter.config.block_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "reference": reference,
        **({"tie_tolerance": tolerance} if checked else {}),
        "eos_ids": sorted(eos),
        "device": str(loop.device),
        # what ran the timings: they compare only within one machine's boot (experiments/quality_speed)
        "device_name": device_name(loop.device),
        "machine": machine_id(),
        "target_dtype": str(target_dtype).removeprefix("torch."),
        "target_precision": precision_of(target),
        "drafter_dtype": str(next(drafter.parameters()).dtype).removeprefix("torch."),
    }
    return report


# ---- `flashdraft eval`, as library functions ----


def load_eval_target(config: EvalConfig) -> tuple[nn.Module, Any]:
    """(the frozen target on `config.device` in `config.dtype` and `config.precision`, its
    tokenizer)."""
    # transformers is heavy: imported when a model is loaded, not with the package.
    from transformers import AutoTokenizer

    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(config.dtype, device.type)
    check_model_path(config.target, "--target")
    target = load_target(config.target, dtype, config.attn_implementation, device, config.precision)
    return target, AutoTokenizer.from_pretrained(config.target)


def run_eval(
    config: EvalConfig, target: nn.Module, tokenizer: Any, drafter: DFlashDrafter
) -> dict[str, Any]:
    """The report of `flashdraft eval`: `drafter` (any dtype and device) evaluated as served,
    in the target's dtype on its device, on the prompts of `config`. Writes nothing."""
    parameter = next(target.parameters())
    drafter = drafter.to(device=parameter.device, dtype=parameter.dtype).eval()
    prompts = load_prompts(config.prompts, tokenizer, config.limit)
    report = evaluate_drafter(
        target,
        tokenizer,
        drafter,
        prompts,
        max_new_tokens=config.max_new_tokens,
        block_size=config.block_size,
        temperature=config.temperature,
        seed=config.seed,
        reference=None if config.reference else False,
        progress=True,
        decoder=config.decoder,
        compile=config.compile,
    )
    report["settings"].update(cfg.settings(config, "report"))
    return report
