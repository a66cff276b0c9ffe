import numpy as np, time
rng = np.random.default_rng(0)
T = rng.standard_normal((180000, 128), dtype=np.float32); A = rng.standard_normal((32, 128), dtype=np.float32)
S1 = np.empty((180000, 32), np.float32); S2 = np.empty((32, 180000), np.float32)
c = 4096
S1c = np.empty((c, 32), np.float32); S2c = np.empty((32, c), np.float32)
def chunked1():
    for i in range(0, 180000, c): np.matmul(T[i:i+c], A.T, out=S1c[:min(c, 180000-i)])
def chunked2():
    for i in range(0, 180000, c): np.matmul(A, T[i:i+c].T, out=S2c[:, :min(c, 180000-i)])
for name, f in (("tokens-first T@A.T", lambda: np.matmul(T, A.T, out=S1)), ("rows-first A@T.T", lambda: np.matmul(A, T.T, out=S2)),
                ("chunked tokens-first", chunked1), ("chunked rows-first", chunked2)):
    f(); ts = []
    for _ in range(7):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    print(f"{name:22s} {np.median(ts)*1e3:7.2f} ms  {1.47e9/np.median(ts)/1e9:6.1f} GF/s")
