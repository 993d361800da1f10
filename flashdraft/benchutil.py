"""Timing, memory and FLOP-rate helpers shared by `bench/` scripts and `flashdraft bench`.

CUDA work is timed with device events around each call (after warm-up, so compilation and
autotuning stay out), and the median is reported; peak memory comes from the caching
allocator. MFU is always against a peak measured in the same session (`matmul_peak`), not a
datasheet number.

A benchmark prints a human table (`print_table`, through the log) and then one final line of
JSON (`print_json`, straight to standard output: the machine-readable result).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flashdraft.log import get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    peak_mem_gb: float

    def as_dict(self) -> dict[str, float]:
        return {
            "median_ms": round(self.median_s * 1e3, 3),
            "p10_ms": round(self.p10_s * 1e3, 3),
            "p90_ms": round(self.p90_s * 1e3, 3),
            "peak_mem_gb": round(self.peak_mem_gb, 3),
        }


def free_memory() -> None:
    """Give what a finished stage held back: Python's cycles, then (on CUDA) the caching
    allocator's free blocks, so the next model loaded finds the memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> Timing:
    """Median wall time of `fn` per call on `device`, and the peak memory it reached."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) >= 2 else [times[0]] * 9
    return Timing(statistics.median(times), q[0], q[-1], peak)


def measure_back_to_back(fn: Callable[[], Any], device: torch.device, iters: int) -> Timing:
    """Wall time per call of `fn` run `iters` times back to back, the device synchronised once
    at the end: the steady state of a loop whose host prepares call k + 1 while the device
    runs call k (a training run). `measure` synchronises after every call, so each call
    there also pays the device's wait for its first launches. One number: no spread."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    per_call = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return Timing(per_call, per_call, per_call, peak)


def matmul_peak(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """Measured dense bf16 matmul rate in FLOP/s (random data, the MFU denominator)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timing = measure(lambda: a @ b, device, warmup=3, iters=iters)
    return 2 * n**3 / timing.median_s


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere what `platform` knows)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            return next((ln.split(":", 1)[1].strip() for ln in info if "model name" in ln), model)
    except OSError:
        return model


def device_name(device: torch.device) -> str:
    """What runs on `device`, beside its timings: the GPU's name, or the CPU's model with the
    threads torch uses (CPU times depend on both)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def machine_id() -> str:
    """This host and boot as a short hash (Linux's boot id; elsewhere the host alone): two
    timings with the same id ran on one machine between two of its restarts, so they
    compare. Hashed: reports get shared, host names need not be."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            seen = f"{socket.gethostname()} {boot.read().strip()}"
    except OSError:
        seen = socket.gethostname()
    return hashlib.sha256(seen.encode()).hexdigest()[:16]


def environment() -> dict[str, Any]:
    """Versions and hardware for the benchmark record."""
    commit = os.environ.get("FLASHDRAFT_COMMIT", "")
    try:
        commit = (
            commit
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
        )
    except OSError:
        commit = ""
    import transformers  # heavy: only the benchmark record needs its version

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit or "unknown",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    else:
        info["cpu"] = cpu_model()
        info["threads"] = torch.get_num_threads()
    return info


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """`rows` as left-aligned columns under a header line (a missing value is blank)."""
    widths = {c: max([len(c), *(len(str(r.get(c, ""))) for r in rows)]) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns) for row in rows]
    return "\n".join(lines)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """The human-readable result table of a benchmark, through the log (stdout)."""
    log.info(format_table(rows, columns))


def print_json(result: dict[str, Any]) -> None:
    """The machine-readable last line of every benchmark.

    Printed, not logged: it is the benchmark's output, parsed by scripts, so neither a rank
    tag nor the log level may change it.
    """
    print(json.dumps(result, sort_keys=True), flush=True)
