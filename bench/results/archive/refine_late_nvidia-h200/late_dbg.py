import sys, os
sys.path.insert(0, os.getcwd())
import cupy as cp
from triton.testing import do_bench
import lik_cupy
from lik_cupy import _dispatch
import lik_cupy._dispatch.tables as t
from lik_cupy._dispatch import config
t.REFINE_LATE = True
extra = {}
orig_defines = config.FwdConfig.defines
orig_name = config.FwdConfig.__dict__["name"].func
def suffix():
    return "".join("_" + k[8:].lower() for k in sorted(extra))
config.FwdConfig.name = property(lambda self: orig_name(self) + suffix())
config.FwdConfig.defines = lambda self: orig_defines(self) | extra
rng = cp.random.default_rng(1)
def unit(*s):
    x = rng.standard_normal(s, dtype=cp.float32); return x / cp.linalg.norm(x, axis=-1, keepdims=True)
for name, (nq, lq, nd, ld) in {"medium": (1, 128, 1000, 1024), "colpali": (1, 1024, 1000, 1024)}.items():
    Q, D = unit(nq, lq, 128), unit(nd, ld, 128)
    for ex in ({"LIK_DBG_COUNT": 1}, {"LIK_DBG_NOJOBS": 1, "LIK_DBG_NOSCAN": 1}, {"LIK_DBG_NOSCAN": 1}, {"LIK_DBG_NOJOBS": 1}, {}):
        extra.clear(); extra.update(ex); _dispatch.clear_caches()
        lik_cupy.maxsim(Q, D); cp.cuda.Device().synchronize()
        if "LIK_DBG_COUNT" in ex:
            from lik_cupy._runtime import nvrtc
            cfg = _dispatch.choose_forward(90, "float32", 128, lq, False, True, tma=True, x3=True, ld=ld)
            mod = nvrtc.get_module("maxsim_fwd.cu", cfg.defines(), cfg.target(90), 0)
            c = cp.ndarray((8,), cp.uint64, mod.get_global("lik_dbg_counts"))
            c[...] = 0
            lik_cupy.maxsim(Q, D); cp.cuda.Device().synchronize()
            print(name, "lanes, jobs, scans:", cp.asnumpy(c)[:3].tolist(), flush=True)
        ms = do_bench(lambda: lik_cupy.maxsim(Q, D), warmup=20, rep=150)
        print(name, ex, round(ms, 4), flush=True)
extra.clear()
t.REFINE_LATE = False; _dispatch.clear_caches()
