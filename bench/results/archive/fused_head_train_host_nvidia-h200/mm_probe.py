"""Host time per GEMM call (enqueue time, GPU kept busy behind a sleep) and the fused-head train32 step."""
import json, os, sys, time, statistics
import torch
sys.path.insert(0, os.getcwd())
out = {}
dev = "cuda"
def host_us(fn, n=200, reps=5):
    fn(); torch.cuda.synchronize()
    best = []
    for _ in range(reps):
        torch.cuda._sleep(200_000_000)
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(best)
for dt in (torch.bfloat16, torch.float16):
    h2 = torch.randn(9600, 768, device=dev, dtype=dt)
    W = torch.randn(128, 768, device=dev, dtype=dt)
    dP = torch.randn(9600, 128, device=dev, dtype=dt)
    small_a = torch.randn(64, 64, device=dev, dtype=dt)
    for lib in ("default", "cublas", "cublaslt"):
        if lib != "default":
            torch.backends.cuda.preferred_blas_library(lib)
        key = f"{str(dt)[6:]}_{lib}"
        out[key] = {
            "mm_hWt": host_us(lambda: torch.mm(h2, W.t())),
            "mm_dPW": host_us(lambda: torch.mm(dP, W)),
            "mm_dPt_h": host_us(lambda: torch.mm(dP.t(), h2)),
            "mm_small": host_us(lambda: torch.mm(small_a, small_a)),
            "linear": host_us(lambda: torch.nn.functional.linear(h2, W)),
            "add": host_us(lambda: torch.add(small_a, small_a)),
            "empty": host_us(lambda: torch.empty(100, device=dev)),
        }
        print(key, {k: round(v, 1) for k, v in out[key].items()}, flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
try:
    import cupy
    a = cupy.random.standard_normal((9600, 768)).astype(cupy.float16); b = cupy.random.standard_normal((768, 128)).astype(cupy.float16)
    def cmm(): cupy.matmul(a, b)
    cmm(); cupy.cuda.Device().synchronize()
    ts = []
    for _ in range(5):
        torch.cuda._sleep(200_000_000)
        t = time.perf_counter()
        for _ in range(200): cmm()
        ts.append((time.perf_counter() - t) / 200 * 1e6)
        torch.cuda.synchronize()
    out["cupy_matmul_fp16"] = statistics.median(ts); print("cupy matmul", out["cupy_matmul_fp16"])
except Exception as e:
    print("cupy", e)
# the fused head train32 step under each library
from bench.suites import bench_fused_head as b
import lik_cupy.torch as lt
shapes = {"hidden": 768, "dim": 128, "lq": 32, "ld": 300}
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    for cell, n in (("train32", 32), ("train64", 64)):
        leaves = b._inputs(torch, n, n, torch.bfloat16, True, dev, shapes)
        step = b._step(torch, lambda Q, H, W, bb: lt.maxsim_from_hidden(Q, H, W, bb), leaves, True)
        for _ in range(5): step()
        torch.cuda.synchronize()
        ts = []
        for r in range(5):
            t = time.perf_counter()
            for _ in range(50): step()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) / 50 * 1e3)
        out[f"step_{cell}_{lib}_ms"] = ts
        print(cell, lib, [round(x, 3) for x in ts], flush=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(20): step()
    torch.cuda.synchronize()
tab = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
print(tab[-6000:])
o = os.environ.get("OUT", "/tmp")
json.dump(out, open(f"{o}/mm_probe.json", "w"), indent=1)
open(f"{o}/mm_probe_profile.txt", "w").write(tab)
