import time, sys, threading, numpy as np
sys.path.insert(0, '/work/main')
import lik_cupy
from lik_cupy._cpu import maxsim as mx
rng = np.random.default_rng(0)
Q = rng.standard_normal((1, 1024, 128)).astype(np.float32); Q /= np.linalg.norm(Q, axis=-1, keepdims=True)
D = rng.standard_normal((16, 1024, 128)).astype(np.float32); D /= np.linalg.norm(D, axis=-1, keepdims=True)
ev = []
orig = mx._DocBlock.similarities
def sim(self, *a, **k):
    t0 = time.perf_counter(); r = orig(self, *a, **k); ev.append((threading.get_ident(), "sim", t0, time.perf_counter())); return r
mx._DocBlock.similarities = sim
origw = mx._winner_similarities
def win(*a, **k):
    t0 = time.perf_counter(); r = origw(*a, **k); ev.append((threading.get_ident(), "win", t0, time.perf_counter())); return r
mx._winner_similarities = win
f = lambda: lik_cupy.maxsim(Q, D, backend="cpu")
for _ in range(3): f()
for rep in range(4):
    ev.clear(); T0 = time.perf_counter(); f(); T1 = time.perf_counter()
    ths = sorted({e[0] for e in ev})
    print("call %.1f ms" % (1e3*(T1-T0)))
    for th in ths:
        es = [e for e in ev if e[0] == th]
        print("  thread", ths.index(th), " ".join(f"{e[1]}[{1e3*(e[2]-T0):.1f}-{1e3*(e[3]-T0):.1f}]" for e in es))
