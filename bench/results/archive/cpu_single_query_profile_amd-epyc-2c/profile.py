"""Where one short query's CPU call spends its thread time (1 query of 32 tokens against 1,000 documents of
180, float32, d = 128, unit-norm): thread time of each phase summed over the chunk threads, wall and
process CPU time per call (20 calls), and NumPy's batched GEMM and max in the same process. Run from the
repository root: python3 bench/results/archive/cpu_single_query_profile_amd-epyc-2c/profile.py OUT.json"""
import json, os, sys
import time, numpy as np, threading, collections
import lik_cupy
from lik_cupy._cpu import maxsim as M
from lik_cupy._cpu import runs as R
acc = collections.defaultdict(float)
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.thread_time(); r = f(*a, **k); acc[key] += time.thread_time() - t; return r
    setattr(obj, name, g)
wrap(M, "_winner_similarities", "winners")
wrap(M._DocBlock, "similarities", "gemm+norm+copy")
wrap(R.Runs, "argmax", "argmax"); wrap(R.Runs, "second_max", "second_max"); wrap(R.Runs, "mask_invalid", "mask")
wrap(M.Pending, "add", "pending.add"); wrap(M.Pending, "flush", "flush")
wrap(M, "margin", "margin")
rng = np.random.default_rng(0)
D = rng.standard_normal((1000, 180, 128)).astype(np.float32); D /= np.linalg.norm(D, axis=-1, keepdims=True)
Q = rng.standard_normal((1, 32, 128)).astype(np.float32); Q /= np.linalg.norm(Q, axis=-1, keepdims=True)
for _ in range(3): lik_cupy.maxsim(Q, D, backend="cpu")
acc.clear()
n = 20; w = time.perf_counter(); tt = time.process_time()
for _ in range(n): lik_cupy.maxsim(Q, D, backend="cpu")
w = (time.perf_counter() - w) / n * 1e3; tt = (time.process_time() - tt) / n * 1e3
print("wall %.1f ms/call, process cpu %.1f ms/call" % (w, tt))
for k, v in sorted(acc.items(), key=lambda x: -x[1]): print("%-16s %.2f ms/call (thread time, all threads)" % (k, v / n * 1e3))
t = time.perf_counter()
for _ in range(n): S = np.matmul(Q[0], D.reshape(-1, 128).T).reshape(32, 1000, 180).max(-1).sum(0)
nb = (time.perf_counter() - t) / n * 1e3
print("numpy batched %.1f ms" % nb)
json.dump({"machine": "AMD EPYC, 2 cores (this project's CI machine)", "wall_ms": w, "process_cpu_ms": tt,
           "numpy_batched_ms": nb, "ratio": w / nb, "thread_ms": {k: v / n * 1e3 for k, v in acc.items()},
           "load_1min": os.getloadavg()[0]}, open(sys.argv[1], "w"), indent=1)
