import numpy as np, numba, time
@numba.njit(nogil=True, boundscheck=False, fastmath=True)
def k1(T, AT, S):
    n, d = T.shape
    m = AT.shape[1]
    for t in range(n):
        for r in range(m):
            S[t, r] = 0.0
        for k in range(d):
            a = T[t, k]
            for r in range(m):
                S[t, r] += a * AT[k, r]

@numba.njit(nogil=True, boundscheck=False, fastmath=True)
def k2(T, AT, S):  # four tokens at a time, accumulators in a small local array
    n, d = T.shape
    m = AT.shape[1]
    acc = np.empty((4, m), np.float32)
    t = 0
    while t + 4 <= n:
        acc[:] = 0.0
        for k in range(d):
            a0 = T[t, k]; a1 = T[t + 1, k]; a2 = T[t + 2, k]; a3 = T[t + 3, k]
            for r in range(m):
                b = AT[k, r]
                acc[0, r] += a0 * b
                acc[1, r] += a1 * b
                acc[2, r] += a2 * b
                acc[3, r] += a3 * b
        for i in range(4):
            for r in range(m):
                S[t + i, r] = acc[i, r]
        t += 4
    while t < n:
        for r in range(m):
            S[t, r] = 0.0
        for k in range(d):
            a = T[t, k]
            for r in range(m):
                S[t, r] += a * AT[k, r]
        t += 1

rng = np.random.default_rng(0)
T = rng.standard_normal((180000, 128), dtype=np.float32); A = rng.standard_normal((32, 128), dtype=np.float32)
AT = np.ascontiguousarray(A.T); S = np.empty((180000, 32), np.float32)
ref = T @ A.T
for name, f in (("blas", lambda: np.matmul(T, A.T, out=S)), ("k1", lambda: k1(T, AT, S)), ("k2", lambda: k2(T, AT, S))):
    f(); err = np.abs(S - ref).max()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    print(f"{name:5s} {np.median(ts)*1e3:7.2f} ms  {1.47e9/np.median(ts)/1e9:6.1f} GF/s  maxerr {err:.2e}")
