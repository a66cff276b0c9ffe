"""One forward call of ColPali (1 query of 1,024 tokens x 1,000 pages of 1,024, d = 128) in the given
dtype, warmed up first, then once more under cudaProfilerStart/Stop (ncu --profile-from-start off)."""
import sys, os
sys.path.insert(0, os.getcwd())
import cupy as cp
import numpy as np
import lik_cupy as lk
dt = sys.argv[1]
B = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
rng = cp.random.default_rng(0)
def unit(shape):
    x = rng.standard_normal(shape, dtype=cp.float32)
    return (x / cp.linalg.norm(x, axis=-1, keepdims=True)).astype(cp.float16)
q, d = unit((1024, 128)), unit((B, 1024, 128))
if dt == "fp8":
    q8, qs = lk.quantize_fp8(q); d8, ds = lk.quantize_fp8(d)
    f = lambda: lk.maxsim_fp8(q8, d8, ds, q_scales=qs)
elif dt == "int8":
    f = None
else:
    f = lambda: lk.maxsim(q, d)
for _ in range(3): f()
cp.cuda.Device().synchronize()
s, e = cp.cuda.Event(), cp.cuda.Event()
s.record(); 
for _ in range(20): f()
e.record(); e.synchronize()
print(dt, "ms per call %.4f" % (cp.cuda.get_elapsed_time(s, e) / 20), flush=True)
cp.cuda.runtime.profilerStart()
f()
cp.cuda.Device().synchronize()
cp.cuda.runtime.profilerStop()
