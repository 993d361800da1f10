"""One DFlash drafter training step: flashdraft against speculators and SpecForge.

Times forward + backward + optimizer of each framework's DFlash drafter on the same device,
the same geometry and the same seeded inputs, each in its own subprocess (so one that fails
or runs out of memory leaves the others standing, and peak memory is per framework):

  * flashdraft   `flashdraft.train.step.draft_loss` + clip + fused AdamW (what `flashdraft train`
                 runs per row), plus the target-side label argmax over the anchor blocks;
  * speculators  0.9.0 (vLLM project): `DFlashDraftModel` called as its `Trainer` calls it
                 (autocast, zero_grad, backward, clip 1.0, `build_optimizers` -> AdamW);
  * SpecForge    0.2.0 (SGLang project): `OnlineDFlashModel` around `DFlashDraftModel`
                 (from `AutoDraftModel.from_config`), stepped by its `BF16Optimizer`.

Default geometry: Qwen3-8B width (hidden 4096, 32 / 8 heads, head_dim 128,
intermediate 12288, vocab 151936), 5 draft layers, K = 5 taps [1, 9, 17, 25, 33] of 36,
block B = 16, gamma 7, one 8192-token row with A = 512 anchors and one 32768-token row with
A = 2048, bf16. The row is one document whose loss mask covers [0, T - B] (the only packed
row all three express identically: SpecForge takes no document or position ids).

    python bench/peers.py                       # GPU: both sizes, all three, loss parity
    python bench/peers.py --sizes 8192:512 --out a.json     # one size per call, then
    python bench/peers.py --merge a.json b.json             # one table from both calls
    python bench/peers.py --smoke               # tiny sizes on CPU, fp32: end-to-end check

Each peer must be importable (installed from its PyPI wheel; dev/gpu/peers_wheels.sh fetches
the wheels the GPU image lacks). A loss-parity pass at T = A + B, where every candidate is an
anchor, runs all three on identical weights, inputs and blocks and compares their losses.
Prints a table, then one JSON line; where the frameworks' definitions differ (anchors,
labels, loss normalisation, optimizer) the output lists it under "caveats". The steps
themselves are in peers_steps.py beside it, their seeded inputs in peers_inputs.py; this file
runs them, one worker process per framework and size, and makes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from peers_inputs import SEED, SPAWNED_AT, Case, Geometry, drafter_config, phase, phases_of
from peers_steps import run_flashdraft, run_specforge, run_speculators

FRAMEWORKS = ("flashdraft", "speculators", "specforge")
PACKAGES = {"flashdraft": None, "speculators": "speculators", "specforge": "specforge"}
RESULT_TAG = "PEERS_RESULT "

# ---------------------------------------------------------------------------------------------
# Worker: one framework, one size, in this process
# ---------------------------------------------------------------------------------------------


def framework_version(framework: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    package = PACKAGES[framework]
    if package is None:
        from flashdraft.benchutil import environment

        return str(environment()["commit"])
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def worker(case: Case, g: Geometry) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(SEED)
    run = {"flashdraft": run_flashdraft, "speculators": run_speculators, "specforge": run_specforge}
    t0 = time.perf_counter()
    import transformers

    phase("imported")  # then the framework builds its drafter (and the parity pass runs)

    result: dict[str, Any] = {
        "framework": case.framework,
        "version": framework_version(case.framework),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
    }
    if device.type == "cuda":  # to check that separate calls ran on the same GPU
        result["gpu_uuid"] = str(getattr(torch.cuda.get_device_properties(0), "uuid", ""))
    try:
        result.update(run[case.framework](case, g, device))
        result["status"] = "ok"
    except torch.OutOfMemoryError as err:
        result["status"] = f"out of memory: {str(err).splitlines()[0]}"
    except Exception as err:  # report any failure as a row, never take the parent down
        traceback.print_exc()
        result["status"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["max_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Parent: one subprocess per (size, framework), then the table
# ---------------------------------------------------------------------------------------------


CAVEATS = [
    "The row is one document with its loss mask on [0, T - B]: SpecForge's OnlineDFlashModel "
    "takes no document or position ids, so a multi-document packed row cannot be expressed for "
    "it; all three run this same single-document row.",
    "Anchors: each framework draws its own A of the same T - B candidates (flashdraft on the "
    "CPU in its data pipeline, untimed; the peers on the GPU inside the step), so step-0 losses "
    "at the timed sizes differ by sampling. The parity pass (T = A + B) fixes the blocks.",
    "Labels: flashdraft the target argmax at a + k - 1 (timed in its step here), speculators "
    "the argmax of its verifier head at a + k - 1 (full-vocabulary logits inside its step), "
    "SpecForge the data token x[a + k]; the inputs make all three equal.",
    "Loss: flashdraft and SpecForge sum(w m CE) / sum(w m); speculators sum(w m CE) / sum(m). "
    "speculators runs loss 'ce' and SpecForge and speculators gamma 7 to match flashdraft "
    "(their defaults: kl_div with gamma 4, and no decay).",
    "Optimizer step as each trainer does it: flashdraft clip 1.0 + fused AdamW on fp32 weights; "
    "speculators clip 1.0 + AdamW (foreach) on fp32 weights; SpecForge bf16 weights, "
    "BF16Optimizer (clip 0.5, fp32 master AdamW, copy back). LR schedulers are not stepped.",
]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", help="context:anchors,... (default 8192:512,32768:2048)")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=12288)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--taps", type=int, default=5)
    p.add_argument("--target-layers", type=int, default=36)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--mask-token", type=int, default=151669, help="Qwen3's padded-vocab id")
    p.add_argument(
        "--parity-anchors",
        type=int,
        help="loss-parity pass at T = this + B, where every candidate is an anchor (default 64; "
        "0: skip); run with the first size only",
    )
    p.add_argument(
        "--speculators-loss", default="ce", help="'ce' matches flashdraft; their default is kl_div"
    )
    p.add_argument(
        "--speculators-impl",
        default="auto",
        choices=["auto", "fused", "eager"],
        help="their loss kernels: fused (their default: Triton), eager, or auto: fused, and, "
        "once it fails (on torch 2.11 it does not compile), eager for that case and the rest",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--timeout", type=int, default=300, help="seconds per framework and size")
    p.add_argument(
        "--deadline", type=int, default=0, help="seconds for the whole run; later runs are skipped"
    )
    p.add_argument("--out", help="also write the JSON result here, updated after every run")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="combine --out files of earlier runs")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.heads, args.kv_heads, args.head_dim = 64, 4, 2, 16
        args.intermediate, args.vocab, args.layers, args.mask_token = 128, 1000, 2, 999
        args.warmup, args.iters = 1, 3
    if args.sizes is None:
        args.sizes = "256:16,512:32" if args.smoke else "8192:512,32768:2048"
    if args.parity_anchors is None:
        args.parity_anchors = 8 if args.smoke else 64
    return args


def geometry(args: argparse.Namespace) -> Geometry:
    return Geometry(
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
        layers=args.layers,
        vocab=args.vocab,
        taps=args.taps,
        target_layers=args.target_layers,
        block=args.block,
        gamma=args.gamma,
        mask_token=args.mask_token,
    )


def timeout_status(timeout: float, phases: dict[str, float]) -> str:
    """'timed out after N s', then how far the worker got (its last phase, or none)."""
    if not phases:
        return f"timed out after {timeout:.0f} s (no phase marked: still starting)"
    last = list(phases)[-1]
    return f"timed out after {timeout:.0f} s (last: {last} at {phases[last]:.1f} s)"


def spawn(case: Case, g: Geometry, timeout: float) -> dict[str, Any]:
    """Run one worker; a crash, a timeout or a missing result becomes a status, not an error.
    Every row keeps the phases the worker marked (`phases`: name -> seconds since spawned)."""
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), repo) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env[SPAWNED_AT] = repr(time.time())  # the workers' phases count from here, as the timeout
    cmd = [sys.executable, __file__, "--worker", case.framework]
    cmd += ["--case", json.dumps(asdict(case)), "--geometry", json.dumps(asdict(g))]
    base = {"framework": case.framework, "context": case.context, "anchors": case.anchors}
    t0 = time.perf_counter()
    # Its own process group (same session), so a timeout also ends its compile workers.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, process_group=0
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        phases = phases_of(stderr)
        status = timeout_status(timeout, phases)
        return {**base, "status": status, "phases": phases, "stderr_tail": stderr[-2000:]}
    base["phases"] = phases_of(stderr)
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG) :])
            if result.get("status") != "ok":
                result["stderr_tail"] = stderr[-2000:]
            return {**base, **result}
    status = f"worker exited with {proc.returncode} and no result"
    if "OutOfMemoryError" in stderr or proc.returncode in (-9, 137):
        status = f"out of memory (worker exited with {proc.returncode})"
    return {
        **base,
        "status": status,
        "wall_s": round(time.perf_counter() - t0, 1),
        "stderr_tail": stderr[-2000:],
    }


def add_rates(rows: list[dict[str, Any]], g: Geometry, peak: float | None) -> None:
    """Query tokens/s, model TFLOP/s and MFU of each measured row, in place.

    Model FLOPs are the same numerator for every framework (bench/drafter.py's formula): the
    drafter layers x3 for fwd + bwd, plus the head forward and its gradient w.r.t. h on the
    B - 1 trained slots of each block. Work a framework adds (full-vocabulary verifier logits,
    recomputation) is not counted: it shows as a lower rate.
    """
    from flashdraft.model.drafter import DFlashDrafter

    with torch.device("meta"):
        model = DFlashDrafter(drafter_config(g))
    for row in rows:
        if row.get("status") != "ok":
            continue
        queries = row["anchors"] * g.block
        flops = 3 * model.num_flops_per_query_token(row["context"], queries) * queries
        flops += 2 * 2 * g.hidden * g.vocab * row["anchors"] * (g.block - 1)
        step_s = row["timing"]["median_ms"] / 1e3
        row["query_tok_per_s"] = round(queries / step_s)
        row["tflops"] = round(flops / step_s / 1e12, 1)
        if peak:
            row["mfu"] = round(flops / step_s / peak, 3)


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size: flashdraft / peer for step time and peak memory, and the issue's two goals."""
    sizes: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row.get("status") == "ok":
            sizes.setdefault(f"{row['context']}:{row['anchors']}", {})[row["framework"]] = row
    out = {}
    for key, by_fw in sizes.items():
        ours = by_fw.get("flashdraft")
        peers = [by_fw[p] for p in ("speculators", "specforge") if p in by_fw]
        if ours is None or not peers:
            continue
        r: dict[str, Any] = {"peers_measured": [p["framework"] for p in peers]}
        for peer in peers:
            ms = ours["timing"]["median_ms"] / peer["timing"]["median_ms"]
            r[f"time_vs_{peer['framework']}"] = round(ms, 3)
            if ours["timing"]["peak_mem_gb"] and peer["timing"]["peak_mem_gb"]:
                gb = ours["timing"]["peak_mem_gb"] / peer["timing"]["peak_mem_gb"]
                r[f"memory_vs_{peer['framework']}"] = round(gb, 3)
        faster = min(peers, key=lambda p: p["timing"]["median_ms"])
        r["time_vs_faster_peer"] = r[f"time_vs_{faster['framework']}"]
        r["goal_time_met"] = (
            r["time_vs_faster_peer"] <= 0.8
        )  # the goal: at most 0.8x the faster peer's time
        if all(p["timing"]["peak_mem_gb"] for p in [*peers, ours]):
            leaner = min(peers, key=lambda p: p["timing"]["peak_mem_gb"])
            r["memory_vs_leaner_peer"] = r[f"memory_vs_{leaner['framework']}"]
            r["goal_memory_met"] = r["memory_vs_leaner_peer"] <= 1.0
        out[key] = r
    return out


def parity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Losses on identical weights, inputs and blocks (T = A + B: every candidate an anchor)."""
    by_fw = {r["framework"]: r["parity"] for r in rows if r.get("status") == "ok" and "parity" in r}
    out: dict[str, Any] = {"losses": by_fw}
    ours = by_fw.get("flashdraft")
    if ours is None:
        return out
    if "specforge" in by_fw:  # same normalisation: sum(w m CE) / sum(w m)
        out["specforge_rel_diff"] = rel_diff(by_fw["specforge"]["loss"], ours["loss"])
    if "speculators" in by_fw:  # it divides by sum(m): compare with ours renormalised
        theirs = by_fw["speculators"]["loss"]
        out["speculators_rel_diff"] = rel_diff(theirs, ours["loss_as_speculators"])
    return out


def rel_diff(a: float, b: float) -> float:
    return float(f"{abs(a - b) / max(abs(b), 1e-12):.3g}")


def report(
    rows: list[dict[str, Any]], g: Geometry, peak: float | None, env: dict[str, Any]
) -> dict[str, Any]:
    add_rates(rows, g, peak)
    return {
        "bench": "peers",
        "geometry": asdict(g),
        "peak_tflops": round(peak / 1e12, 1) if peak else None,
        "rows": rows,
        "ratios": ratios(rows),
        "parity": parity(rows),
        "caveats": CAVEATS,
        **env,
    }


def print_report(result: dict[str, Any]) -> None:
    from flashdraft.benchutil import print_table

    table = []
    for row in result["rows"]:
        t = row.get("timing", {})
        table.append(
            {
                "framework": row["framework"],
                "version": row.get("version", ""),
                "T": row["context"],
                "A": row["anchors"],
                "step_ms": t.get("median_ms", "-"),
                "p10_ms": t.get("p10_ms", "-"),
                "p90_ms": t.get("p90_ms", "-"),
                "peak_gb": t.get("peak_mem_gb") or "-",
                "query_tok/s": row.get("query_tok_per_s", "-"),
                "TFLOP/s": row.get("tflops", "-"),
                "mfu": row.get("mfu", "-"),
                "loss@0": round(row["first_step"]["loss"], 4) if "first_step" in row else "-",
                "status": row.get("status", "")
                + (" (fused loss failed)" if "fused_loss" in row else ""),
            }
        )
    if result["peak_tflops"]:
        print(f"measured bf16 matmul peak: {result['peak_tflops']} TFLOP/s")
    print_table(table, list(table[0]))
    print("(loss@0: each framework's own definition, before any update; anchors differ)")
    for key, r in result["ratios"].items():
        print(f"flashdraft / peer at T:A = {key}: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    losses = result["parity"]["losses"]
    if losses:
        print("loss parity at T = A + B (identical weights, inputs and blocks):")
        for fw, p in losses.items():
            print(f"  {fw:12s} " + ", ".join(f"{k} {round(v, 6)}" for k, v in p.items()))
        for key in ("specforge_rel_diff", "speculators_rel_diff"):
            if key in result["parity"]:
                print(f"  {key}: {result['parity'][key]}")
    print("caveats:")
    for line in result["caveats"]:
        print(f"  * {line}")
    seen = set()
    for row in result["rows"]:
        if row.get("status") == "ok" and row["framework"] not in seen:
            seen.add(row["framework"])
            print(f"{row['framework']}: " + "; ".join(row.get("notes", [])))
    for row in result["rows"]:
        if row.get("status") != "ok":
            print(f"--- {row['framework']} T={row['context']} A={row['anchors']}: {row['status']}")
            print("\n".join(row.get("stderr_tail", "").splitlines()[-8:]))


def spawn_in_time(case: Case, g: Geometry, args: argparse.Namespace, t0: float) -> dict[str, Any]:
    """One worker under --timeout, or a skipped row where --deadline leaves too little time."""
    left = args.deadline - (time.perf_counter() - t0) - 20 if args.deadline else 1e9
    if left < 60:  # too little time to start, compile and time a worker
        base = {"framework": case.framework, "context": case.context, "anchors": case.anchors}
        return {**base, "status": "skipped: --deadline reached"}
    return spawn(case, g, min(args.timeout, left))


def fused_loss_failed(row: dict[str, Any]) -> bool:
    """speculators' fused-loss row failed in a way its eager loss may not: an error or a crash,
    not out of memory (eager needs more), a timeout or a skip."""
    status = row.get("status", "")
    return (
        row["framework"] == "speculators"
        and status != "ok"
        and not status.startswith(("out of memory", "timed out", "skipped"))
    )


def run_all(args: argparse.Namespace, g: Geometry) -> list[dict[str, Any]]:
    frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown:
        raise SystemExit(f"unknown framework(s) {unknown}; choose from {FRAMEWORKS}")
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    fused_failed = ""  # auto: why speculators' fused loss failed on an earlier case, if it did
    for i, (context, anchors) in enumerate(sizes):
        for framework in frameworks:
            impl = args.speculators_impl  # auto: speculators' fused until it fails, then eager
            if impl == "auto":
                impl = "eager" if fused_failed and framework == "speculators" else "fused"
            case = Case(
                framework=framework,
                context=context,
                anchors=anchors,
                parity_anchors=args.parity_anchors if i == 0 else 0,
                warmup=args.warmup,
                iters=args.iters,
                speculators_loss=args.speculators_loss,
                speculators_impl=impl,
            )
            row = spawn_in_time(case, g, args, t0)
            auto = args.speculators_impl == "auto" and impl == "fused"
            if auto and fused_loss_failed(row):  # the same case with their eager loss
                failed = row
                fused_failed = f"{failed['status']} (T={context} A={anchors})"
                row = spawn_in_time(replace(case, speculators_impl="eager"), g, args, t0)
                row["fused_stderr_tail"] = failed.get("stderr_tail", "")
            if framework == "speculators" and fused_failed:  # eager, as the fused loss failed
                row["fused_loss"] = fused_failed
                row.setdefault("notes", []).append(f"eager loss; their fused loss: {fused_failed}")
            rows.append(row)
            ms = row.get("timing", {}).get("median_ms", "-")
            first = row.get("phases", {}).get("first step done", "-")  # a cold compile's end
            print(
                f"[{time.perf_counter() - t0:5.0f} s] {framework} T={context} A={anchors}: "
                f"{row['status']} (step {ms} ms, first step done at {first} s, "
                f"worker {row.get('wall_s', '-')} s)",
                file=sys.stderr,
                flush=True,
            )
            if args.out:  # partial results survive a run that is killed
                Path(args.out).write_text(json.dumps({"geometry": asdict(g), "rows": rows}))
    return rows


ENV_KEYS = ("date", "commit", "python", "torch", "transformers", "gpu", "gpus", "cuda", "cpu")


def main() -> int:
    from flashdraft.benchutil import environment

    if "--worker" in sys.argv:
        return worker_main()
    args = parse()
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        g = Geometry(**parts[0]["geometry"])
        if any(Geometry(**p["geometry"]) != g for p in parts):
            raise SystemExit("the merged runs used different geometries")
        rows = [row for p in parts for row in p["rows"]]
        peaks = [p["peak_tflops"] for p in parts if p.get("peak_tflops")]
        peak = peaks[0] * 1e12 if peaks else None
        env = {k: parts[0][k] for k in ENV_KEYS if k in parts[0]}  # where it was measured
        gpus = {r.get("gpu_uuid") for r in rows if r.get("gpu_uuid")}
        if len(gpus) > 1:
            print(f"note: the merged runs used {len(gpus)} different GPUs: {sorted(gpus)}")
    else:
        g = geometry(args)
        rows = run_all(args, g)
        env = environment()
        peak = None
        if torch.cuda.is_available():
            from flashdraft.benchutil import matmul_peak

            peak = matmul_peak(torch.device("cuda"))
    result = report(rows, g, peak, env)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    print_report(result)
    from flashdraft.benchutil import print_json

    print_json(result)
    return 0


def worker_main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True, choices=FRAMEWORKS)
    p.add_argument("--case", required=True)
    p.add_argument("--geometry", required=True)
    args = p.parse_args()
    return worker(Case(**json.loads(args.case)), Geometry(**json.loads(args.geometry)))


if __name__ == "__main__":
    sys.exit(main())
