"""Host-time profile of the fused head's training step (train32, bf16) and rerank call, ours only."""
import cProfile, io, os, pstats, sys, time
sys.path.insert(0, os.getcwd())
import torch
from bench.lib.gpu import setup_cupy
import bench.suites.bench_fused_head as bf
class C: pass
ctx = C(); ctx.torch = torch
setup_cupy(ctx)
import lik_cupy.torch as lt

dev = "cuda"
def make(name):
    nq, nd, train = bf.CELLS[name]
    leaves = bf._inputs(torch, nq, nd, torch.bfloat16, train, dev, bf.SHAPES)
    fn = lambda Q, H, W, b: lt.maxsim_from_hidden(Q, H, W, b)
    return bf._step(torch, fn, leaves, train), leaves

def wall(call, n=200):
    for _ in range(10): call()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): call()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) * 1e3 / n)
    return best

def host_only(call, n=200):
    """host time per call with the GPU far ahead: no wait (the queue never fills at these sizes)"""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): call()
    h = (time.perf_counter() - t) * 1e3 / n
    torch.cuda.synchronize()
    return h

out = {}
for name in ("train32", "train64", "rerank"):
    step, leaves = make(name)
    out[name] = (wall(step), host_only(step))
    print(f"{name}: wall {out[name][0]:.3f} ms/step, host loop {out[name][1]:.3f}", flush=True)
    # GPU time: torch profiler's CUDA kernel total over 20 steps
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20): step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in ka if e.device_type.name == "CUDA") / 20 / 1e3
    nk = sum(e.count for e in ka if e.device_type.name == "CUDA") / 20
    print(f"  GPU {gpu:.3f} ms/step over {nk:.0f} kernels and copies a step")
    if name == "train32":
        print(ka.table(sort_by="self_cpu_time_total", row_limit=30))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(100): step()
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        ps = pstats.Stats(pr, stream=s).sort_stats("tottime"); ps.print_stats(45)
        ps.sort_stats("cumulative"); ps.print_stats(60)
        open(os.path.join(os.environ.get("OUT", "."), "cprof_train32.txt"), "w").write(s.getvalue())
