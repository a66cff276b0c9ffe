"""Where the compiled in-batch step's host time goes, against eager (fp16, d = 128; N = 32 with 32 x 80 tokens,
N = 64 with 32 x 300): wall us per step (best of three rounds of 300), with the host time spent inside
lik_cupy.maxsim and lik_cupy.maxsim_backward as the step calls them (wrappers around them), and cProfile
listings of N = 32's steps. compile_split.json: {cell_mode: [step, forward, backward]} (each mode's second
eager run overwrote the first). Run from the repository root on a GPU (one H200, this stop's first call)."""
import cProfile, io, json, os, pstats, sys, time
sys.path.insert(0, os.getcwd())
import torch, torch.nn.functional as F
import lik_cupy.torch as lt
import lik_cupy._torch_autograd as ta
out = os.environ.get("OUT", "/tmp")
acc = {"fwd": 0.0, "bwd": 0.0}
def wrap(mod, name, key):
    f = getattr(mod, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[key] += time.perf_counter() - t; return r
    setattr(mod, name, g)
wrap(ta, "_maxsim", "fwd"); wrap(ta, "_maxsim_backward", "bwd"); wrap(lt, "_maxsim", "fwd")
torch.manual_seed(0)
res = {}
for (n, lq, ld) in ((32, 32, 80), (64, 32, 300)):
    q = F.normalize(torch.randn(n, lq, 128, device="cuda"), dim=-1).half().requires_grad_()
    d = F.normalize(torch.randn(n, ld, 128, device="cuda"), dim=-1).half().requires_grad_()
    labels = torch.arange(n, device="cuda")
    def loss(a, b): return F.cross_entropy(lt.maxsim(a, b).float() / 0.05, labels)
    for mode in ("eager", "compile", "eager"):
        torch._dynamo.reset()
        fn = loss if mode == "eager" else torch.compile(loss)
        def step():
            q.grad = d.grad = None; fn(q, d).backward()
        for _ in range(5): step()
        torch.cuda.synchronize()
        best = None
        for r in range(3):
            acc["fwd"] = acc["bwd"] = 0.0
            t = time.perf_counter()
            for _ in range(300): step()
            torch.cuda.synchronize()
            row = ((time.perf_counter() - t) / 300 * 1e6, acc["fwd"] / 300 * 1e6, acc["bwd"] / 300 * 1e6)
            if best is None or row[0] < best[0]: best = row
        key = f"n{n}_{mode}"
        res[key] = best
        print(key, "step %.0f us  fwd %.0f  bwd %.0f  rest %.0f" % (best + (best[0]-best[1]-best[2],)), flush=True)
        if n == 32 and (mode == "compile" or key not in res or True):
            pr = cProfile.Profile(); pr.enable()
            for _ in range(300): step()
            torch.cuda.synchronize()
            pr.disable()
            for order in ("tottime", "cumtime"):
                s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(order).print_stats(60)
                open(f"{out}/prof_{key}_{order}.txt", "w").write(s.getvalue())
json.dump(res, open(f"{out}/compile_split.json", "w"), indent=1)
