"""The eval report: acceptance statistics, per-prompt entries, the lossless accounting, timing,
the plot and the text summary. Written as REPORT.json with REPORT.png beside it (`write_report`).

The report holds:

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
* `loop_prompts`: how many outputs end in a repetition loop (each entry's `loop_start`: the
  first output index from which the rest repeats with a period of at most 32 tokens, when
  that rest is at least 128 tokens long: `flashdraft.data.loops`; None: no loop), and
  `tau_before_loops`: tau over the verify steps that end before their prompt's loop starts
  (every step of a prompt without one). A small target's greedy decoding often falls into
  "no no no ..." for the rest of its budget, which any drafter accepts whole: such outputs
  lift `tau` far above what the drafter does on text that stays on topic (SmolLM2-135M, 24
  held-out chat prompts: 17 loop; tau 7.9 over everything, 2.5 before the loops);
* `speedup` (CUDA only): decode time per output token with B = 1 over that with B, on the
  same prompts, prefill excluded; `loops` says how each of the two loops ran (`decoder`:
  static caches or HF's; `graphs`, `compiled`, `batch_size`), as a speedup means little
  without it; plus counts, settings and timings.
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from flashdraft import storage
from flashdraft.data.loops import loop_start
from flashdraft.eval.prompts import EvalPrompt
from flashdraft.eval.speculative import DecodeResult

# How far below the target's top logit an emitted token may be and still count as a tie its
# own rounding can flip. The verify step scores B positions in one forward while the B = 1
# baseline scores one: different kernel shapes, different rounding. In bfloat16 (8 mantissa
# bits) logits of size 10-30 are spaced 0.06-0.25 apart, and the rounding compounds over the
# layers; float32 is ~65,000x finer.
TIE_TOLERANCE = {torch.bfloat16: 0.5, torch.float16: 0.1, torch.float32: 1e-3}
# A target in FP8 (`target.precision = "fp8"`): activations re-quantised per token to e4m3 (3
# mantissa bits) in every layer, so a rounding difference far below bf16's flips values by
# 1/8 and cascades. On SmolLM2-135M (CPU emulation), one token at a time vs the whole sequence
# moved logits by up to 2.76, and a 1e-6 relative input noise by 2.3 on average
# (benchmarks/fp8_eval_cpu_20261208.md): exactness is checkable only up to that noise.
FP8_TIE_TOLERANCE = 3.0


def tie_tolerance(dtype: torch.dtype, precision: str = "bf16") -> float:
    """The tie tolerance of a target in `dtype` whose linear layers run in `precision`."""
    base = TIE_TOLERANCE.get(dtype, 0.0)
    return max(base, FP8_TIE_TOLERANCE) if precision == "fp8" else base


# ---- statistics ----


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
    starts = [loop_start(r.output_ids) for r in results]
    before = [n for r, start in zip(results, starts, strict=True) for n in steps_before(r, start)]
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
        "loop_prompts": sum(start is not None for start in starts),
        "tau_before_loops": sum(before) / len(before) if before else None,
    }


def steps_before(result: DecodeResult, start: int | None) -> list[int]:
    """The acceptance lengths of the verify steps whose tokens all come before output index
    `start` (the prefill emits index 0; None: every step)."""
    if start is None:
        return list(result.acceptance_lengths)
    kept, end = [], 1
    for n in result.acceptance_lengths:
        end += n
        if end > start:
            break
        kept.append(n)
    return kept


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ---- per prompt ----


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (one ending early counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def prompt_entry(
    prompt: EvalPrompt,
    result: DecodeResult,
    baseline: DecodeResult | None,
    tokenizer: Any,
    temperature: float,
) -> dict[str, Any]:
    """One `per_prompt` entry; at T = 0 with a baseline, whether the output is lossless."""
    entry: dict[str, Any] = {
        "id": prompt.id,
        "prompt_tokens": len(prompt.input_ids),
        "acceptance_lengths": result.acceptance_lengths,
        "tau": result.tau,
        "output_ids": result.output_ids,
        "text": tokenizer.decode(result.output_ids) if tokenizer is not None else None,
        "stopped_at_eos": result.stopped_at_eos,
        "loop_start": loop_start(result.output_ids),
        "prefill_s": round(result.prefill_s, 6),
        "decode_s": round(result.decode_s, 6),
    }
    if baseline is not None and temperature == 0.0:
        mismatch = first_mismatch(result.output_ids, baseline.output_ids)
        entry["lossless"] = mismatch is None
        entry["first_mismatch"] = mismatch
    return entry


# ---- the lossless accounting at T = 0 ----


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


def account_lossless(
    target: nn.Module,
    prompts: Sequence[EvalPrompt],
    entries: list[dict[str, Any]],
    tolerance: float,
) -> dict[str, Any]:
    """The report's lossless counts; adds a `mismatch` diagnosis to each entry whose output
    left the greedy decoding (entries from `prompt_entry` at T = 0 with a baseline)."""
    for prompt, entry in zip(prompts, entries, strict=True):
        if entry["first_mismatch"] is not None:
            entry["mismatch"] = diagnose_mismatch(
                target, prompt.input_ids, entry["output_ids"], entry["first_mismatch"], tolerance
            )
    identical = sum(e["first_mismatch"] is None for e in entries)
    ties = sum(e.get("mismatch", {}).get("near_tie", False) for e in entries)
    return {
        "lossless": identical == len(entries),
        "lossless_prompts": identical,
        "near_tie_prompts": ties,
        "unexplained_mismatch_prompts": len(entries) - identical - ties,
        "lossless_up_to_ties": identical + ties == len(entries),
    }


# ---- timing ----


def _tpot_ms(results: Sequence[DecodeResult]) -> float | None:
    """Decode time per output token (prefill and its first token excluded), in ms."""
    tokens = sum(len(r.output_ids) - 1 for r in results)
    return round(1e3 * sum(r.decode_s for r in results) / tokens, 4) if tokens else None


def timing(spec: Sequence[DecodeResult], base: Sequence[DecodeResult]) -> dict[str, Any]:
    """Prefill and decode time of the speculative runs, and of the B = 1 runs when given."""
    out: dict[str, Any] = {
        "prefill_s": round(sum(r.prefill_s for r in spec), 4),
        "decode_s": round(sum(r.decode_s for r in spec), 4),
        "decode_tokens": sum(len(r.output_ids) - 1 for r in spec),
        "time_per_output_token_ms": _tpot_ms(spec),
    }
    if base:
        out["baseline_decode_s"] = round(sum(r.decode_s for r in base), 4)
        out["baseline_decode_tokens"] = sum(len(r.output_ids) - 1 for r in base)
        out["baseline_time_per_output_token_ms"] = _tpot_ms(base)
    return out


def describe_loop(loop: dict[str, Any]) -> str:
    """A loop's `loops` entry in words, e.g. "static KV cache, compiled, CUDA graphs, batch 1"."""
    words = ["static KV cache" if loop.get("decoder") == "static" else "HF DynamicCache"]
    words.append("compiled" if loop.get("compiled") else "eager kernels")
    if loop.get("graphs"):
        words.append("CUDA graphs")
    words.append(f"batch {loop.get('batch_size', 1)}")
    if loop.get("linear_states"):  # a hybrid target: how its recurrent states were kept
        words.append(f"linear-attention states: {loop['linear_states']}")
    return ", ".join(words)


def speedup(timings: dict[str, Any]) -> float | None:
    """Decode time per output token, B = 1 over B (None without both)."""
    base = timings.get("baseline_time_per_output_token_ms")
    spec = timings.get("time_per_output_token_ms")
    return round(base / spec, 4) if base and spec else None


# ---- output ----


def plot_acceptance(report: dict[str, Any]) -> bytes:
    """PNG bytes: per-position acceptance (marginal bars, conditional line)."""
    # matplotlib is heavy and only the plot needs it.
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


def write_report(report: dict[str, Any], url: str) -> str:
    """Write the report as JSON to `url` and its plot beside it; returns the plot's URL."""
    storage.write_json_atomic(url, report)
    plot = plot_path(url)
    storage.write_bytes_atomic(plot, plot_acceptance(report))
    return plot


def format_summary(report: dict[str, Any]) -> str:
    """A few human-readable lines: tau, counts, per-position acceptance, lossless, speedup."""
    tau = report["tau"]
    lines = [
        f"tau {tau:.3f}" if tau is not None else "tau n/a (no verify steps)",
        f"prompts {report['num_prompts']}  steps {report['total_steps']}  "
        f"output tokens {report['output_tokens']}",
        "per-position acceptance "
        + " ".join(f"{x:.2f}" for x in report["per_position_acceptance"]),
    ]
    if report.get("loop_prompts"):
        before = report["tau_before_loops"]
        lines.append(
            f"{report['loop_prompts']} of {report['num_prompts']} outputs end in a repetition "
            f"loop (easy to draft): tau before the loops "
            + (f"{before:.3f}" if before is not None else "n/a")
        )
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
        line = f"speedup {report['speedup']:.2f}x (decode time per token, B=1 / B)"
        loops = report.get("loops", {})
        if "speculative" in loops and "baseline" in loops:
            spec, base = describe_loop(loops["speculative"]), describe_loop(loops["baseline"])
            line += f"; both loops: {spec}" if spec == base else f"; B: {spec}; B=1: {base}"
        lines.append(line)
    return "\n".join(lines)
