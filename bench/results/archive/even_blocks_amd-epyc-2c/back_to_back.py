import time, sys, numpy as np
sys.path.insert(0, '/work/main')
import lik_cupy
from lik_cupy._cpu import maxsim as mx
if sys.argv[1] == "old": mx._even = lambda n, most: most
rng = np.random.default_rng(0)
Q = rng.standard_normal((1, 1024, 128)).astype(np.float32); Q /= np.linalg.norm(Q, axis=-1, keepdims=True)
D = rng.standard_normal((16, 1024, 128)).astype(np.float32); D /= np.linalg.norm(D, axis=-1, keepdims=True)
f = lambda: lik_cupy.maxsim(Q, D, backend="cpu")
f(); ts = []
for _ in range(15):
    a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
print(sys.argv[1], "median %.1f best %.1f" % (1e3*np.median(ts), 1e3*min(ts)))
