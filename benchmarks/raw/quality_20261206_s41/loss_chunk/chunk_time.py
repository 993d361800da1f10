import torch, time
import old_loss as old
from flashdraft.train import loss as new
torch.manual_seed(0)
n, V, H = 2048, 49152, 576
w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.05
h = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
z = h @ w.T
y = torch.randint(0, V, (n,), device="cuda"); c = torch.rand(n, device="cuda")
ids = torch.randint(0, V, (n, 32), device="cuda"); p = torch.softmax(torch.randn(n, 32, device="cuda"), -1)
def t(f, *a):
    for _ in range(3): f(*a)
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(50): f(*a)
    torch.cuda.synchronize(); return (time.perf_counter() - s) / 50 * 1e3
for name, mod in (("old", old), ("new", new), ("old", old), ("new", new)):
    hc = torch.compile(mod.hard_label_chunk, dynamic=False); sc = torch.compile(mod.soft_label_chunk, dynamic=False)
    print(name, "hard %.3f ms" % t(hc, z, y, c, 1.0, None, True), "soft %.3f ms" % t(sc, z, y, c, ids, p, 1.0, None, True), flush=True)
a = torch.compile(old.hard_label_chunk, dynamic=False)(z, y, c, 1.0, None, True); b = torch.compile(new.hard_label_chunk, dynamic=False)(z, y, c, 1.0, None, True)
print("hard equal", torch.equal(a[0], b[0]), torch.equal(a[2], b[2]))
a = torch.compile(old.soft_label_chunk, dynamic=False)(z, y, c, ids, p, 1.0, None, True); b = torch.compile(new.soft_label_chunk, dynamic=False)(z, y, c, ids, p, 1.0, None, True)
print("soft equal", torch.equal(a[0], b[0]), torch.equal(a[2], b[2]))
