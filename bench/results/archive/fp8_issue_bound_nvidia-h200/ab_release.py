"""A/B of per-warp slot release (RELEASE) for the scaled types' one-shot TMA tiles: LIK_SCALED_RELEASE=REL
forced into every forward build of this process. Kernel ms by CUDA events (median of 5 runs of N calls),
scores saved to $OUT/ab_release_REL.npz for a bitwise comparison."""
import sys, os, json, time
sys.path.insert(0, os.getcwd())
rel = int(sys.argv[1]); tag = sys.argv[2]
from lik_cupy._dispatch import config as C
_orig = C.FwdConfig.defines
C.FwdConfig.defines = lambda self: {**_orig(self), "LIK_SCALED_RELEASE": rel}
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
cells = {"colpali": (1024, 1024, 1000, 20), "colpali10k": (1024, 1024, 10000, 3), "textual": (32, 300, 10000, 50),
         "longdoc": (32, 1024, 10000, 30), "q128x1000": (128, 300, 10000, 30)}
res, saved = {}, {}
for name, (lq, ld, B, n) in cells.items():
    q, d = unit((lq, 128)), unit((B, ld, 128))
    for dt in ("fp8", "int8"):
        if dt == "fp8":
            q8, qs = lk.quantize_fp8(q); d8, ds = lk.quantize_fp8(d); f = lambda: lk.maxsim_fp8(q8, d8, ds, q_scales=qs)
            fa = lambda: lk.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=True)
        else:
            q8, qs = lk.quantize_int8(q); d8, ds = lk.quantize_int8(d); f = lambda: lk.maxsim_int8(q8, d8, ds, q_scales=qs)
            fa = lambda: lk.maxsim_int8(q8, d8, ds, q_scales=qs, return_argmax=True)
        res[f"{dt}_{name}"] = timed(f, n); saved[f"{dt}_{name}"] = cp.asnumpy(f())
        if name in ("colpali", "textual"):
            res[f"{dt}_{name}_argmax"] = timed(fa, n)
            s_, a_ = fa(); saved[f"{dt}_{name}_argmax_s"] = cp.asnumpy(s_); saved[f"{dt}_{name}_argmax_a"] = cp.asnumpy(a_)
        del q8, qs, d8, ds
    del q, d; cp.get_default_memory_pool().free_all_blocks()
print(tag, rel, json.dumps({k: round(v, 4) for k, v in res.items()}), flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(f"{out}/ab_release_{tag}.json", "w"))
np.savez(f"{out}/ab_release_{tag}.npz", **saved)
