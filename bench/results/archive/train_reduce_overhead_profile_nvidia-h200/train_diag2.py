"""What does the cudagraph-tree step copy, ours vs flash (reduce-overhead, N=64 32x300)."""
import sys, time
sys.path.insert(0, '.')
import torch, torch.nn.functional as F
import lik_cupy.torch as lt
N, LQ, LD = 64, 32, 300
g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s):
    x = torch.randn(*s, generator=g, device='cuda'); return (x / x.norm(dim=-1, keepdim=True)).half()
q = unit(N, LQ, 128).requires_grad_(); d = unit(N, LD, 128).requires_grad_()
labels = torch.arange(N, device='cuda')
import flash_maxsim
tr = flash_maxsim.flash_maxsim_batched_train
scorers = {"ours": lambda a, b: lt.maxsim(a, b), "flash": lambda a, b: tr(a, b, shared_docs=True)}
for name, sc in scorers.items():
    for variant in ("leaf", "param"):
        torch._dynamo.reset()
        qq, dd = (q, d) if variant == "leaf" else (torch.nn.Parameter(q.detach().clone()), torch.nn.Parameter(d.detach().clone()))
        def loss(a, b, sc=sc): return F.cross_entropy(sc(a, b).float() / 0.05, labels)
        fn = torch.compile(loss, mode="reduce-overhead")
        def step():
            torch.compiler.cudagraph_mark_step_begin()
            qq.grad = dd.grad = None
            v = fn(qq, dd); v.backward(); return v
        for _ in range(6): step()
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(50): step()
            torch.cuda.synchronize(); best = min(best, (time.perf_counter() - t) / 50 * 1e3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(10): step()
            torch.cuda.synchronize()
        print(f"== {name} {variant}: {best:.3f} ms/step", flush=True)
        for e in prof.key_averages(group_by_input_shape=True):
            if e.key in ("aten::copy_", "aten::_foreach_copy_", "aten::empty_strided", "aten::fill_", "aten::zero_", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
                print(f"   {e.key:24s} n={e.count:3d} cpu_total={e.cpu_time_total/e.count:8.1f}us shapes={str(e.input_shapes)[:150]}", flush=True)
