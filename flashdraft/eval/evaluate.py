"""`flashdraft eval`: real acceptance (tau) and speedup with the draft-and-verify loop.

    flashdraft eval --target PATH --drafter PATH --prompts FILE --output REPORT.json

Prompts are JSONL records with OpenAI `messages` (rendered with the target tokenizer's chat
template and generation prompt; trailing assistant turns are dropped, so training
conversations can serve as prompts), ShareGPT `conversations`, or a raw `prompt` string
(tokenized as-is). The drafter may be a training checkpoint, a run directory, or an exported
folder (ours in either format, or one published by z-lab).

The report (JSON, with a PNG of per-position acceptance beside it) holds:

* `tau`: mean over all verify steps of all prompts of the acceptance length (accepted + 1);
* `acceptance_histogram`: entry i counts the steps with acceptance length i + 1 (i < B);
* `per_position_acceptance`: entry k - 1 is the fraction of steps whose draft k was
  accepted (k = 1..B-1), and `conditional_acceptance` the same given that draft k - 1 was;
* `per_prompt`: `acceptance_lengths` (per step, in order), `tau`, `output_ids`, `text`, and
  at T = 0 `lossless`: whether the output equals the target's own greedy decoding (the same
  loop with B = 1 and no drafter, which tests prove equal to HF `generate`);
* at T = 0, for each prompt that is not identical, `mismatch`: its first differing token and
  how far each token from there on sits below the target's top logit (one cache-free forward
  over prompt + output). In bfloat16 the verify step (B positions per forward) and the
  baseline (one) round differently, so where the target's top logits are within an ulp or
  two (often exactly tied) the two decodings may take different branches: a `near_tie`, not
  an error, when every token stays within `settings.tie_tolerance` of the top. The report counts
  `lossless_prompts` (identical), `near_tie_prompts` and `unexplained_mismatch_prompts`;
  `lossless_up_to_ties` is true when nothing is unexplained (anything unexplained is a bug);
* `speedup` (CUDA only): decode time per output token with B = 1 over that with B, on the
  same prompts, prefill excluded; plus counts, settings and timings.

`evaluate_drafter` is the same measurement as a plain function, for in-training evaluation.
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flashdraft.data.formats import RecordError, read_records
from flashdraft.eval.speculative import Decoder, DecodeResult, Sampler, decode, eos_token_ids
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.head import TargetHead
from flashdraft.model.target import LayerTaps, decoder_layers


@dataclass(slots=True)
class EvalPrompt:
    id: str
    input_ids: list[int]


# ---- prompts ----


def render_prompt(record: dict[str, Any], tokenizer: Any) -> list[int]:
    """Token ids of one prompt record (see the module docstring for the accepted shapes).

    Chats are read and rendered exactly as `flashdraft generate` reads and renders the prompts
    it answers (trailing assistant turns dropped; the template's default thinking mode), so a
    drafter is evaluated on prompts shaped like its on-policy training data.
    """
    from flashdraft.data.generate import jobs_from_record
    from flashdraft.data.generate import render_prompt as render_chat

    if not isinstance(record, dict):
        raise RecordError(f"record is a JSON {type(record).__name__}, not an object")
    if isinstance(record.get("prompt"), str) and not ({"messages", "conversations"} & set(record)):
        return list(tokenizer(record["prompt"]).input_ids)  # raw text, tokenized as-is
    jobs = jobs_from_record(record, "", "last")
    if not jobs or not jobs[-1].prompt:
        raise RecordError("no user turn to answer")
    return render_chat(tokenizer, jobs[-1].prompt, thinking=True)


def load_prompts(url: str, tokenizer: Any, limit: int | None = None) -> list[EvalPrompt]:
    """Prompts of a JSONL file; a bad record is an error naming its file:line."""
    prompts: list[EvalPrompt] = []
    for source, record in read_records(url):
        if limit is not None and len(prompts) >= limit:
            break
        try:
            if isinstance(record, RecordError):
                raise record
            ids = render_prompt(record, tokenizer)
        except RecordError as err:
            raise ValueError(f"{source}: {err}") from None
        prompts.append(EvalPrompt(str(record.get("id") or source), ids))
    if not prompts:
        raise ValueError(f"{url} holds no prompts")
    return prompts


def _as_prompt(
    item: EvalPrompt | dict[str, Any] | Sequence[int], index: int, tokenizer: Any
) -> EvalPrompt:
    if isinstance(item, EvalPrompt):
        return item
    if isinstance(item, dict):
        if tokenizer is None:
            raise ValueError("prompt records need a tokenizer to be rendered")
        return EvalPrompt(str(item.get("id") or index), render_prompt(item, tokenizer))
    return EvalPrompt(str(index), [int(t) for t in item])


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


# ---- the measurement ----


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
    differs from the baseline gets a `mismatch` diagnosis (see `diagnose_mismatch`);
    `tie_tolerance` defaults to `TIE_TOLERANCE` of the target's dtype.
    """
    from tqdm.auto import tqdm

    check_compatible(drafter, target)
    block = block_size or drafter.config.block_size
    device = next(target.parameters()).device
    cuda = device.type == "cuda"
    items = [_as_prompt(p, i, tokenizer) for i, p in enumerate(prompts)]
    if reference is None:
        reference = temperature == 0.0 or cuda
    head = TargetHead.from_model(target)
    eos = eos_token_ids(target, tokenizer)

    def run(prompt: EvalPrompt, speculative: bool, new_tokens: int, index: int) -> DecodeResult:
        generator = torch.Generator(device=device).manual_seed(seed + index)
        sampler = Sampler(temperature, generator)
        if not speculative:
            return decode(Decoder(target, eos_ids=eos), prompt.input_ids, new_tokens, sampler)
        hooks = taps if taps is not None else LayerTaps(target, drafter.config.target_layer_ids)
        try:
            decoder = Decoder(target, drafter, head, hooks, block_size=block, eos_ids=eos)
            return decode(decoder, prompt.input_ids, new_tokens, sampler)
        finally:
            if taps is None:
                hooks.remove()

    if cuda and items:  # warm-up: CUDA context, cuBLAS handles and kernels stay out of timing
        run(items[0], True, min(max_new_tokens, 2 * block), 0)
        if reference:
            run(items[0], False, min(max_new_tokens, 2 * block), 0)

    spec_results, base_results = [], []
    for index, prompt in enumerate(tqdm(items, desc="eval", unit="prompt", disable=not progress)):
        if reference:
            base_results.append(run(prompt, False, max_new_tokens, index))
        spec_results.append(run(prompt, True, max_new_tokens, index))

    report = summarize(spec_results, block)
    baselines: list[DecodeResult | None] = list(base_results) or [None] * len(items)
    report["per_prompt"] = [
        _prompt_entry(p, r, b, tokenizer, temperature)
        for p, r, b in zip(items, spec_results, baselines, strict=True)
    ]
    dtype = next(target.parameters()).dtype
    tolerance = tie_tolerance if tie_tolerance is not None else TIE_TOLERANCE.get(dtype, 0.0)
    if reference and temperature == 0.0:
        for prompt, entry in zip(items, report["per_prompt"], strict=True):
            if entry["first_mismatch"] is not None:
                entry["mismatch"] = diagnose_mismatch(
                    target,
                    prompt.input_ids,
                    entry["output_ids"],
                    entry["first_mismatch"],
                    tolerance,
                )
        entries = report["per_prompt"]
        identical = sum(e["first_mismatch"] is None for e in entries)
        ties = sum(e.get("mismatch", {}).get("near_tie", False) for e in entries)
        report.update(
            lossless=identical == len(entries),
            lossless_prompts=identical,
            near_tie_prompts=ties,
            unexplained_mismatch_prompts=len(entries) - identical - ties,
            lossless_up_to_ties=identical + ties == len(entries),
        )
    report["timing"] = _timing(spec_results, base_results)
    if cuda and base_results:
        base_tpot = report["timing"]["baseline_time_per_output_token_ms"]
        spec_tpot = report["timing"]["time_per_output_token_ms"]
        if base_tpot and spec_tpot:
            report["speedup"] = round(base_tpot / spec_tpot, 4)
    report["settings"] = {
        "block_size": block,
        "drafter_block_size": drafter.config.block_size,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "reference": reference,
        **({"tie_tolerance": tolerance} if reference and temperature == 0.0 else {}),
        "eos_ids": sorted(eos),
        "device": str(device),
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "drafter_dtype": str(next(drafter.parameters()).dtype).removeprefix("torch."),
    }
    return report


def summarize(results: Sequence[DecodeResult], block_size: int) -> dict[str, Any]:
    """Acceptance statistics over every verify step of every prompt."""
    lengths = [n for r in results for n in r.acceptance_lengths]
    steps = len(lengths)
    histogram = [0] * block_size
    for n in lengths:
        histogram[n - 1] += 1
    # Draft k (1-based) was accepted in a step iff that step emitted at least k + 1 tokens.
    at_least = [sum(histogram[k:]) for k in range(block_size)]  # steps with length >= k + 1
    marginal = [at_least[k] / steps if steps else 0.0 for k in range(1, block_size)]
    conditional = [
        at_least[k] / at_least[k - 1] if at_least[k - 1] else 0.0 for k in range(1, block_size)
    ]
    output_tokens = sum(len(r.output_ids) for r in results)
    return {
        "tau": sum(lengths) / steps if steps else None,
        "acceptance_histogram": histogram,
        "per_position_acceptance": [round(x, 6) for x in marginal],
        "conditional_acceptance": [round(x, 6) for x in conditional],
        "num_prompts": len(results),
        "total_steps": steps,
        "output_tokens": output_tokens,
        "decode_tokens": sum(lengths),  # output tokens after the prefill's first one
        "mean_accepted_drafts": (sum(lengths) / steps - 1) if steps else None,
        "median_acceptance_length": statistics.median(lengths) if steps else None,
        "prompt_tau_mean": _mean([r.tau for r in results if r.tau is not None]),
    }


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


# How far below the target's top logit an emitted token may be and still count as a tie its
# own rounding can flip. The verify step scores B positions in one forward while the B = 1
# baseline scores one: different kernel shapes, different rounding. In bfloat16 (8 mantissa
# bits) logits of size 10-30 are spaced 0.06-0.25 apart, and the rounding compounds over the
# layers; float32 is ~65,000x finer.
TIE_TOLERANCE = {torch.bfloat16: 0.5, torch.float16: 0.1, torch.float32: 1e-3}


def diagnose_mismatch(
    target: nn.Module,
    prompt_ids: Sequence[int],
    output_ids: list[int],
    index: int,
    tolerance: float,
) -> dict[str, Any]:
    """Whether a T = 0 output that left the target's greedy decoding at `index` is still the
    target's choice, up to ties its own rounding can flip.

    Up to `index` the output equals the greedy decoding. One cache-free forward over prompt +
    output (a third kernel shape, neither the baseline's nor the verify step's) teacher-forces
    the rest: every token from `index` on must be within `tolerance` of the target's top
    logit at its position, given the output before it. Then the divergence is a `near_tie`
    (and any later token is the target's choice on its new branch). A token further below is
    unexplained: the loop emitted something the target would not, a bug to report.
    """
    out: dict[str, Any] = {"index": index, "near_tie": False}
    if index >= len(output_ids):
        out["reason"] = "the output stops early, on a prefix of the greedy decoding"
        return out
    device = next(target.parameters()).device
    ids = torch.tensor([[*prompt_ids, *output_ids[:-1]]], device=device)
    checked = len(output_ids) - index  # the logits that predict output_ids[index:]
    with torch.no_grad():
        logits = target(input_ids=ids, use_cache=False, logits_to_keep=checked).logits[0].float()
    tokens = torch.tensor(output_ids[index:], device=device)
    below = logits.max(dim=-1).values - logits.gather(1, tokens[:, None])[:, 0]  # [checked]
    worst = int(below.argmax())
    out.update(
        token=output_ids[index],
        below_top=round(float(below[0]), 6),
        worst_index=index + worst,
        worst_below_top=round(float(below[worst]), 6),
    )
    out["near_tie"] = float(below[worst]) <= tolerance
    if not out["near_tie"]:
        out["reason"] = (
            f"the token at {index + worst} is {float(below[worst]):.3g} logits below the "
            "target's choice"
        )
    return out


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _prompt_entry(
    prompt: EvalPrompt,
    result: DecodeResult,
    baseline: DecodeResult | None,
    tokenizer: Any,
    temperature: float,
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": prompt.id,
        "prompt_tokens": len(prompt.input_ids),
        "acceptance_lengths": result.acceptance_lengths,
        "tau": result.tau,
        "output_ids": result.output_ids,
        "text": tokenizer.decode(result.output_ids) if tokenizer is not None else None,
        "stopped_at_eos": result.stopped_at_eos,
        "prefill_s": round(result.prefill_s, 6),
        "decode_s": round(result.decode_s, 6),
    }
    if baseline is not None and temperature == 0.0:
        mismatch = _first_mismatch(result.output_ids, baseline.output_ids)
        entry["lossless"] = mismatch is None
        entry["first_mismatch"] = mismatch
    return entry


def _tpot_ms(results: Sequence[DecodeResult]) -> float | None:
    """Decode time per output token (prefill and its first token excluded), in ms."""
    tokens = sum(len(r.output_ids) - 1 for r in results)
    return round(1e3 * sum(r.decode_s for r in results) / tokens, 4) if tokens else None


def _timing(spec: Sequence[DecodeResult], base: Sequence[DecodeResult]) -> dict[str, Any]:
    timing: dict[str, Any] = {
        "prefill_s": round(sum(r.prefill_s for r in spec), 4),
        "decode_s": round(sum(r.decode_s for r in spec), 4),
        "decode_tokens": sum(len(r.output_ids) - 1 for r in spec),
        "time_per_output_token_ms": _tpot_ms(spec),
    }
    if base:
        timing["baseline_decode_s"] = round(sum(r.decode_s for r in base), 4)
        timing["baseline_decode_tokens"] = sum(len(r.output_ids) - 1 for r in base)
        timing["baseline_time_per_output_token_ms"] = _tpot_ms(base)
    return timing


# ---- the plot ----


def plot_acceptance(report: dict[str, Any]) -> bytes:
    """PNG bytes: per-position acceptance (marginal bars, conditional line)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Figure + Agg canvas directly: no pyplot, so no global backend state is touched.
    fig = Figure(figsize=(7, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    marginal = report["per_position_acceptance"]
    positions = list(range(1, len(marginal) + 1))
    ax.bar(positions, marginal, color="#4878d0", label="accepted (fraction of steps)")
    ax.plot(positions, report["conditional_acceptance"], "o-", color="#ee854a",
            label="accepted given the previous draft was")  # fmt: skip
    ax.set_xlabel("draft position k in the block")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(positions)
    tau = report["tau"]
    settings = report.get("settings", {})
    title = f"tau = {tau:.3f}" if tau is not None else "tau = n/a (no steps)"
    title += f"   B = {settings.get('block_size', len(marginal) + 1)}"
    title += f"   T = {settings.get('temperature', 0.0)}   {report['num_prompts']} prompts"
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def plot_path(report_url: str) -> str:
    """REPORT.json -> REPORT.png beside it."""
    stem = report_url[: -len(".json")] if report_url.endswith(".json") else report_url
    return stem + ".png"


def format_summary(report: dict[str, Any]) -> str:
    tau = report["tau"]
    lines = [
        f"tau {tau:.3f}" if tau is not None else "tau n/a (no verify steps)",
        f"prompts {report['num_prompts']}  steps {report['total_steps']}  "
        f"output tokens {report['output_tokens']}",
        "per-position acceptance "
        + " ".join(f"{x:.2f}" for x in report["per_position_acceptance"]),
    ]
    if "lossless" in report:
        line = (
            f"lossless {report['lossless']} ({report['lossless_prompts']}/{report['num_prompts']}"
        )
        line += " identical to the target's greedy decoding"
        if not report["lossless"]:
            line += (
                f"; {report['near_tie_prompts']} diverge only where the target's logits are "
                f"within {report['settings']['tie_tolerance']:g} of a tie, "
                f"{report['unexplained_mismatch_prompts']} unexplained"
            )
        lines.append(line + ")")
    if "speedup" in report:
        lines.append(f"speedup {report['speedup']:.2f}x (decode time per token, B=1 / B)")
    return "\n".join(lines)
