"""D-PACE's log q of the hard label on CUDA: eager (before s41's `_LOG_Q`) against compiled,
at the preset's chunk shape (2,040 rows = 136 blocks of 15 slots, V = 49,152, bf16 z), and
a whole step's worth (15 such chunks + one of 120 rows, A = 2,048 anchors x 15 slots).
Run (s42 copied it to the repository root first): PYTHONPATH=$PWD python3 log_q_time.py"""

import time

import torch

from flashdraft.train import loss

torch.manual_seed(0)
V, H = 49152, 576
w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.05


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    return h @ w.T, torch.randint(0, V, (n,), device="cuda")


def ms(f, *args) -> float:
    for _ in range(3):
        f(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        f(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 50 * 1e3


def step(f, chunks) -> None:
    for z, y in chunks:
        f(z, y, 1.0, None)


big, last = batch(2040), batch(120)
chunks = [big] * 15 + [last]
eager, compiled = loss.hard_label_log_q, loss._LOG_Q
for _ in range(2):
    print(
        "chunk 2040: eager %.3f ms, compiled %.3f ms"
        % (ms(eager, *big, 1.0, None), ms(compiled, *big, 1.0, None)),
        "| a step (16 chunks): eager %.2f ms, compiled %.2f ms"
        % (ms(step, eager, chunks), ms(step, compiled, chunks)),
        flush=True,
    )
a, b = eager(*big, 1.0, None), compiled(*big, 1.0, None)
print("max |eager - compiled| %.3g, equal %s" % ((a - b).abs().max().item(), torch.equal(a, b)))
