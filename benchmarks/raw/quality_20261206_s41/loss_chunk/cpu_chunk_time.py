"""The eager label chunks before (89e31cc) and after (4e17ac2) on the CPU, one thread, at the
golden test's shape: 192 rows (24 anchors x 8) of the tiny Qwen3 head, V = 151,936, fp32.
Run from the repo root: python benchmarks/raw/quality_20261206_s41/loss_chunk/cpu_chunk_time.py"""

import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.train import loss as new

torch.set_num_threads(1)
source = subprocess.run(
    ["git", "show", "89e31cc:flashdraft/train/loss.py"], capture_output=True, text=True, check=True
).stdout
path = Path(tempfile.mkdtemp()) / "old_loss.py"
path.write_text(source)
spec = importlib.util.spec_from_file_location("old_loss", path)
assert spec is not None and spec.loader is not None
old = importlib.util.module_from_spec(spec)
sys.modules['old_loss'] = old  # dataclasses look their module up
spec.loader.exec_module(old)

gen = torch.Generator().manual_seed(0)
n, V, H = 192, 151936, 64
w = torch.randn(V, H, generator=gen)
h = torch.randn(n, H, generator=gen)
y = torch.randint(0, V, (n,), generator=gen)
c = torch.rand(n, generator=gen)
ids = torch.randint(0, V, (n, 32), generator=gen)
p = torch.softmax(torch.randn(n, 32, generator=gen), -1)
z = h @ w.T


def timed(f, *args):
    f(*args)
    start = time.perf_counter()
    for _ in range(5):
        f(*args)
    return (time.perf_counter() - start) / 5 * 1e3


for name, mod in (("old", old), ("new", new), ("old", old), ("new", new)):
    hard = timed(mod.hard_label_chunk, z, y, c, 1.0, None, True)
    soft = timed(mod.soft_label_chunk, z, y, c, ids, p, 1.0, None, True)
    print(f"{name}: hard {hard:.0f} ms, soft {soft:.0f} ms (chunk only, z given)", flush=True)
a, b = old.hard_label_chunk(z, y, c, 1.0, None, True), new.hard_label_chunk(z, y, c, 1.0, None, True)
print("hard equal:", all(torch.equal(u, v) for u, v in zip(a, b, strict=True)))
a = old.soft_label_chunk(z, y, c, ids, p, 1.3, 3.0, True)
b = new.soft_label_chunk(z, y, c, ids, p, 1.3, 3.0, True)
print("soft equal (scale 1.3, softcap 3):", all(torch.equal(u, v) for u, v in zip(a, b, strict=True)))
print(torch.__version__, sys.version.split()[0])
