"""Host cost of plain torch ops on this machine, before and after lik_cupy (and a fused-head step) are imported."""
import sys, time, threading, os
sys.path.insert(0, "bench/suites"); sys.path.insert(0, ".")
import torch

def bench(tag):
    x = torch.randn(9600, 128, device="cuda"); b = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(64, 64, device="cuda"); m = torch.randn(64, 64, device="cuda")
    ops = {"view": lambda: x.view(-1), "float_noop": lambda: x.float(), "empty": lambda: torch.empty(128, device="cuda"),
           "add": lambda: a + m, "cast": lambda: b.float(), "mm": lambda: torch.mm(a, m), "sum0": lambda: x.sum(0)}
    out = {}
    for k, f in ops.items():
        for _ in range(200): f()
        torch.cuda.synchronize()
        best = 1e9
        for r in range(5):
            t = time.perf_counter()
            for _ in range(2000): f()
            best = min(best, (time.perf_counter() - t) / 2000 * 1e6)
            torch.cuda.synchronize()
        out[k] = round(best, 2)
    print(tag, out, "threads", [t.name for t in threading.enumerate()], flush=True)

bench("torch only")
import lik_cupy, lik_cupy.torch as lt
bench("after import lik_cupy.torch")
import bench_fused_head as B
shapes = {"hidden": 768, "dim": 128, "lq": 32, "ld": 300}
leaves = B._inputs(torch, 32, 32, torch.bfloat16, True, "cuda", shapes)
cont = B._contenders(torch, None)
step = B._step(torch, cont["ours"], leaves, True)
for _ in range(20): step()
torch.cuda.synchronize()
bench("after fused-head steps")
t = time.perf_counter()
for _ in range(300): step()
torch.cuda.synchronize()
print("step ms", (time.perf_counter() - t) / 300 * 1e3)
print("cpu", open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0], os.cpu_count(), os.getloadavg())
