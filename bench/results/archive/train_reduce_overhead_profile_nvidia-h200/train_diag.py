"""Why is our reduce-overhead step slower than eager? Profile 10 replays, ours vs flash vs torch."""
import sys, time, collections
sys.path.insert(0, '.')
import torch, torch.nn.functional as F
import lik_cupy.torch as lt
import torch._inductor.config as icfg
print("graph_partition", getattr(icfg, "graph_partition", None), "cudagraph_trees", icfg.triton.cudagraph_trees, flush=True)
N, LQ, LD = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s):
    x = torch.randn(*s, generator=g, device='cuda'); return (x / x.norm(dim=-1, keepdim=True)).half()
q = unit(N, LQ, 128).requires_grad_(); d = unit(N, LD, 128).requires_grad_()
labels = torch.arange(N, device='cuda')
scorers = {"ours": lambda a, b: lt.maxsim(a, b),
           "torch": lambda a, b: torch.einsum("isk,jtk->ijst", a, b).amax(-1).float().sum(-1)}
try:
    import flash_maxsim
    tr = getattr(flash_maxsim, "flash_maxsim_batched_train", None)
    if tr: scorers["flash"] = lambda a, b: tr(a, b, shared_docs=True)
except Exception as e: print("no flash", e)
for name, sc in scorers.items():
    for mode in ("eager", "reduce-overhead"):
        torch._dynamo.reset()
        def loss(a, b, sc=sc): return F.cross_entropy(sc(a, b).float() / 0.05, labels)
        fn = loss if mode == "eager" else torch.compile(loss, mode="reduce-overhead")
        def step():
            if mode != "eager": torch.compiler.cudagraph_mark_step_begin()
            q.grad = d.grad = None
            v = fn(q, d); v.backward(); return v
        for _ in range(6): step()
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(50): step()
            torch.cuda.synchronize(); best = min(best, (time.perf_counter() - t) / 50 * 1e3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10): step()
            torch.cuda.synchronize()
        ev = prof.key_averages()
        launches = {e.key: e.count for e in ev if any(s in e.key for s in ("GraphLaunch", "LaunchKernel", "cuLaunch", "Memcpy", "Memset", "lik_cupy"))}
        print(f"== {name} {mode}: {best:.3f} ms/step; launches per 10 steps: {launches}", flush=True)
        if name == "ours" or mode != "eager":
            print(ev.table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
