"""Variants of the fold's loop over a token's rows (fold_kernels.piece), alone on one core: ns a row, and
whether each leaves the same state bit for bit. python loop_variants.py [rows]"""
import sys, time, statistics
import numpy as np, numba
def t(f, k=7):
    f(); xs = []
    for _ in range(k):
        t0 = time.perf_counter(); f(); xs.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(xs)

def make(variant):
    if variant == "orig":
        @numba.njit(nogil=True, boundscheck=False)
        def k(St, top, runner, at, nan, p0, p1):
            for t in range(p0, p1):
                row = St[t]; off = at.dtype.type(t)
                for r in range(St.shape[1]):
                    v = row[r]; up = v > top[r]
                    runner[r] = top[r] if up else (v if v > runner[r] else runner[r])
                    at[r] = off if up else at[r]
                    top[r] = v if up else top[r]
                    nan[r] |= v != v
    elif variant == "locals":
        @numba.njit(nogil=True, boundscheck=False)
        def k(St, top, runner, at, nan, p0, p1):
            for t in range(p0, p1):
                row = St[t]; off = at.dtype.type(t)
                for r in range(St.shape[1]):
                    v = row[r]; tp = top[r]; rn = runner[r]; up = v > tp
                    c = v if v > rn else rn
                    runner[r] = tp if up else c
                    at[r] = off if up else at[r]
                    top[r] = v if up else tp
                    nan[r] |= v != v
    elif variant == "nanflag":  # nan as (v != v) accumulated into int via arithmetic
        @numba.njit(nogil=True, boundscheck=False)
        def k(St, top, runner, at, nan, p0, p1):
            for t in range(p0, p1):
                row = St[t]; off = at.dtype.type(t)
                for r in range(St.shape[1]):
                    v = row[r]; tp = top[r]; rn = runner[r]; up = v > tp
                    c = v if v > rn else rn
                    runner[r] = tp if up else c
                    at[r] = off if up else at[r]
                    top[r] = v if up else tp
                    nan[r] = nan[r] | (v != v)
    return k

rng = np.random.default_rng(1)
R, n = int(sys.argv[1]) if len(sys.argv) > 1 else 512, 1024
St = rng.standard_normal((n, R)).astype(np.float32)
St[5, 7] = np.nan
ref = None
for variant in ("orig", "locals", "nanflag"):
    k = make(variant)
    for nan_dt in (np.bool_, np.uint8, np.int32):
        for at_dt in (np.int32, np.int64):
            top = np.full(R, -np.inf, np.float32); run = top.copy(); at = np.zeros(R, at_dt); nan = np.zeros(R, nan_dt)
            k(St, top, run, at, nan, 0, n)
            res = (top.copy(), run.copy(), at.astype(np.int64), nan.astype(bool))
            if ref is None: ref = res
            same = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) if a.dtype != bool else np.array_equal(a, b) for a, b in zip(res, ref))
            ms = t(lambda: k(St, top, run, at, nan, 0, n))
            print(variant, np.dtype(nan_dt).name, np.dtype(at_dt).name, "%.2f ns/elem" % (1e6 * ms / (n * R)), "same" if same else "DIFF")
