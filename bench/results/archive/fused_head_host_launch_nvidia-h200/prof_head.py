"""Where the fused head's training step goes: wall vs queued GPU time, and the profiler's top ops."""
import sys, time, json, os
sys.path.insert(0, "bench/suites"); sys.path.insert(0, ".")
import torch
import bench_fused_head as B
from bench.lib.timing import per_call_ms, wall_ms
shapes = {"hidden": 768, "dim": 128, "lq": 32, "ld": 300}
cont = B._contenders(torch, None)
out = {}
for cell, (nq, nd, train) in B.CELLS.items():
    leaves = B._inputs(torch, nq, nd, torch.bfloat16, train, "cuda", shapes)
    for who in ("ours", "unfused"):
        step = B._step(torch, cont[who], leaves, train)
        for _ in range(5): step()
        torch.cuda.synchronize()
        w = wall_ms(torch, step, 50)
        q = per_call_ms(torch, step, 20, spin_cycles=int(2e9 * 0.05))
        out[f"{cell}/{who}"] = {"wall_ms": w, "queued_ms": q}
        print(f"{cell:8s} {who:8s} wall {w:.3f} ms  queued(GPU) {q:.3f} ms", flush=True)
# profile one ours train32 step set
leaves = B._inputs(torch, 32, 32, torch.bfloat16, True, "cuda", shapes)
step = B._step(torch, cont["ours"], leaves, True)
for _ in range(5): step()
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(10): step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
# host phases
def t(fn, n=30):
    torch.cuda.synchronize(); a = time.perf_counter()
    for _ in range(n): fn()
    b = time.perf_counter(); torch.cuda.synchronize(); c = time.perf_counter()
    return (b - a) * 1e3 / n, (c - a) * 1e3 / n
import lik_cupy.torch as lt
Q, H, W, b = leaves
labels = torch.arange(32, device="cuda")
print("fwd only (host-issue, total) ms", t(lambda: lt.maxsim_from_hidden(Q, H, W, b)))
def fb():
    s = lt.maxsim_from_hidden(Q, H, W, b)
    loss = torch.nn.functional.cross_entropy(s.float() / 0.05, labels)
    torch.autograd.grad(loss, leaves)
print("fwd+bwd (host-issue, total) ms", t(fb))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "prof_head.json"), "w"), indent=1)
