"""Wall-clock split of the fused head's train32 step (ours), by wrappers around its pieces."""
import sys, time, collections
sys.path.insert(0, "bench/suites"); sys.path.insert(0, ".")
import torch
import lik_cupy.torch as lt
import lik_cupy._torch_hidden as TH
import bench_fused_head as B
acc = collections.defaultdict(float)
def wrap(mod, name):
    f = getattr(mod, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
    setattr(mod, name, w)
for n in ("_torch_forward", "_torch_backward", "_fused_forward", "_project", "_rows_launch", "check_hidden", "_checked", "maxsim",
          "maxsim_backward", "_one_torch_chunk", "check_hidden_options"):
    if hasattr(TH, n): wrap(TH, n)
shapes = {"hidden": 768, "dim": 128, "lq": 32, "ld": 300}
Q, H, W, b = B._inputs(torch, 32, 32, torch.bfloat16, True, "cuda", shapes)
labels = torch.arange(32, device="cuda")
leaves = [Q, H, W, b]
def step():
    t0 = time.perf_counter()
    s = lt.maxsim_from_hidden(Q, H, W, b)
    t1 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(s.float() / 0.05, labels)
    t2 = time.perf_counter()
    torch.autograd.grad(loss, leaves)
    t3 = time.perf_counter()
    acc["A_forward_call"] += t1 - t0; acc["B_loss"] += t2 - t1; acc["C_grad"] += t3 - t2
for _ in range(30): step()
torch.cuda.synchronize()
for r in range(3):
    acc.clear()
    t = time.perf_counter()
    n = 300
    for _ in range(n): step()
    torch.cuda.synchronize()
    tot = (time.perf_counter() - t) / n * 1e6
    print(f"round {r}: step {tot:.0f} us;", {k: round(v / n * 1e6, 1) for k, v in sorted(acc.items())}, flush=True)
# the same step with a torch-only stand-in of equal op count, for the autograd engine's share
def plain():
    P = torch.nn.functional.linear(H, W, b)
    s = torch.einsum("qsd,ntd->qnst", Q, torch.nn.functional.normalize(P, dim=-1)).amax(-1).float().sum(-1)
    loss = torch.nn.functional.cross_entropy(s / 0.05, labels)
    torch.autograd.grad(loss, leaves)
for _ in range(30): plain()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(300): plain()
torch.cuda.synchronize()
print("plain torch step us", (time.perf_counter() - t) / 300 * 1e6)
