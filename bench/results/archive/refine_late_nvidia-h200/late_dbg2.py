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
config.FwdConfig.name = property(lambda self: orig_name(self) + "".join("_" + k[8:].lower() for k in sorted(extra)))
config.FwdConfig.defines = lambda self: orig_defines(self) | extra
rng = cp.random.default_rng(1)
def unit(*s):
    x = rng.standard_normal(s, dtype=cp.float32); return x / cp.linalg.norm(x, axis=-1, keepdims=True)
base = {"LIK_DBG_NOJOBS": 1, "LIK_DBG_NOSCAN": 1}
for name, (nq, lq, nd, ld) in {"colpali": (1, 1024, 1000, 1024), "medium": (1, 128, 1000, 1024)}.items():
    Q, D = unit(nq, lq, 128), unit(nd, ld, 128)
    t.REFINE_LATE = False; extra.clear(); _dispatch.clear_caches()
    ms = do_bench(lambda: lik_cupy.maxsim(Q, D, precision="tf32"), warmup=20, rep=150)
    print(name, "tf32", round(ms, 4), flush=True)
    t.REFINE_LATE = True
    for ex in ({"LIK_DBG_MAXONLY": 1}, {"LIK_DBG_MAXONLY": 1, "LIK_DBG_NOTILES": 1}, {"LIK_DBG_NOTILES": 1}, {"LIK_DBG_TOP3": 1},
               {"LIK_DBG_FMAX": 1}, {}):
        extra.clear(); extra.update(base); extra.update(ex); _dispatch.clear_caches()
        lik_cupy.maxsim(Q, D); cp.cuda.Device().synchronize()
        ms = do_bench(lambda: lik_cupy.maxsim(Q, D), warmup=20, rep=150)
        print(name, sorted(ex), round(ms, 4), flush=True)
extra.clear(); t.REFINE_LATE = False; _dispatch.clear_caches()
