"""A/B of LIK_SPLITN (whole scores-only wgmma tiles multiplied as two column halves, the first folded
while the second multiplies): forced into every forward build of this process. Kernel ms by CUDA
events (median of 5 runs of N calls), scores saved for a bitwise comparison."""
import sys, os, json
sys.path.insert(0, os.getcwd())
tag = sys.argv[1]; extra = {a.split("=")[0]: int(a.split("=")[1]) for a in sys.argv[2:]}; on = extra
from lik_cupy._dispatch import config as C
_orig = C.FwdConfig.defines
C.FwdConfig.defines = lambda self: {**_orig(self), **extra}
import cupy as cp, numpy as np
import lik_cupy as lk
rng = cp.random.default_rng(1)
def unit(shape):
    x = rng.standard_normal(shape, dtype=cp.float32)
    return (x / cp.linalg.norm(x, axis=-1, keepdims=True)).astype(cp.float16)
def timed(f, n):
    for _ in range(3): f()
    cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event(); out = []
    for _ in range(5):
        s.record()
        for _ in range(n): f()
        e.record(); e.synchronize(); out.append(cp.cuda.get_elapsed_time(s, e) / n)
    return float(np.median(out))
cells = {"colpali": (1024, 1024, 1000, 20), "colpali1030": (1024, 1030, 1000, 20), "colpali10k": (1024, 1024, 10000, 3),
         "textual": (32, 300, 10000, 50), "longdoc": (32, 1024, 10000, 30), "q128x1000": (128, 300, 10000, 30)}
res, saved = {}, {}
for name, (lq, ld, B, n) in cells.items():
    q, d = unit((lq, 128)), unit((B, ld, 128))
    fns = {}
    q8, qs = lk.quantize_fp8(q); d8, ds = lk.quantize_fp8(d)
    fns["fp8"] = lambda: lk.maxsim_fp8(q8, d8, ds, q_scales=qs)
    fns["fp16"] = lambda: lk.maxsim(q, d)
    if name in ("colpali", "textual"):
        q32, d32 = q.astype(cp.float32), d.astype(cp.float32)
        fns["tf32"] = lambda: lk.maxsim(q32, d32, precision="tf32")
        i8q, i8qs = lk.quantize_int8(q); i8d, i8ds = lk.quantize_int8(d)
        fns["int8"] = lambda: lk.maxsim_int8(i8q, i8d, i8ds, q_scales=i8qs)
        fns["fp8_argmax"] = lambda: lk.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=True)[0]
    for k, f in fns.items():
        try:
            res[f"{k}_{name}"] = timed(f, n); saved[f"{k}_{name}"] = cp.asnumpy(f())
        except Exception as e:  # a probe variant that does not build is reported, not fatal
            print(tag, k, name, type(e).__name__, str(e)[:300], flush=True)
    del fns, q8, qs, d8, ds
    q32 = d32 = i8q = i8d = None
    del q, d; cp.get_default_memory_pool().free_all_blocks()
print(tag, on, json.dumps({k: round(v, 4) for k, v in res.items()}), flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(f"{out}/ab_splitn_{tag}.json", "w"))
np.savez(f"{out}/ab_splitn_{tag}.npz", **saved)
