"""A thin GEMM for the folded path, measured and not taken: ``out[t, j] = T[t] . A[j]`` for a piece of
tokens T [n, d] and a query's rows A [m, d], two tokens by four rows a step, each dot product's
partial sums vectorised over d (Numba, reassociation allowed: the margins hold for any order).

    python thin_gemm.py            the kernel alone against OpenBLAS, one thread and two at once
    python thin_gemm.py calls      whole calls with it and without (needs thin_gemm_hook.patch applied)
"""
import sys, time, threading
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
import numba
import numpy as np
from threadpoolctl import threadpool_limits


@numba.njit(nogil=True, fastmath={"reassoc", "contract"}, boundscheck=False)
def thin_gemm(T, A, out):
    n, d = T.shape
    m = A.shape[0]
    n2, m4 = n - n % 2, m - m % 4
    for t in range(0, n2, 2):
        for j in range(0, m4, 4):
            s00 = np.float32(0); s01 = np.float32(0); s02 = np.float32(0); s03 = np.float32(0)
            s10 = np.float32(0); s11 = np.float32(0); s12 = np.float32(0); s13 = np.float32(0)
            for k in range(d):
                x0 = T[t, k]; x1 = T[t + 1, k]
                a0 = A[j, k]; a1 = A[j + 1, k]; a2 = A[j + 2, k]; a3 = A[j + 3, k]
                s00 += x0 * a0; s01 += x0 * a1; s02 += x0 * a2; s03 += x0 * a3
                s10 += x1 * a0; s11 += x1 * a1; s12 += x1 * a2; s13 += x1 * a3
            out[t, j] = s00; out[t, j + 1] = s01; out[t, j + 2] = s02; out[t, j + 3] = s03
            out[t + 1, j] = s10; out[t + 1, j + 1] = s11; out[t + 1, j + 2] = s12; out[t + 1, j + 3] = s13
    for t in range(n):
        for j in range(m4 if t < n2 else 0, m):
            s = np.float32(0)
            for k in range(d):
                s += T[t, k] * A[j, k]
            out[t, j] = s


def kernel_alone():
    rng = np.random.default_rng(0)
    n = 90000
    Ts = [rng.standard_normal((n, 128)).astype(np.float32) for _ in range(2)]
    A = rng.standard_normal((32, 128)).astype(np.float32)
    At = np.ascontiguousarray(A.T)
    outs = [np.empty((n, 32), np.float32) for _ in range(2)]
    flop = 2 * n * 32 * 128

    def pieces(f, T, out, piece=400):  # as the folded path calls it: a piece of tokens at a time
        for p0 in range(0, n, piece):
            f(T[p0:p0 + piece], out[p0:p0 + piece])
    ways = {"openblas": lambda T, o: np.matmul(T, At, out=o), "thin_gemm": lambda T, o: thin_gemm(T, A, o)}
    with threadpool_limits(1):
        for name, f in ways.items():
            pieces(f, Ts[0], outs[0])
            one = []
            for _ in range(5):
                t = time.perf_counter(); pieces(f, Ts[0], outs[0]); one.append(time.perf_counter() - t)
            two = []
            for _ in range(5):
                th = [threading.Thread(target=pieces, args=(f, Ts[k], outs[k])) for k in range(2)]
                t0 = time.perf_counter(); [x.start() for x in th]; [x.join() for x in th]
                two.append(time.perf_counter() - t0)
            print(f"{name}: one thread {flop / min(one) / 1e9:.1f} GFLOP/s; two threads at once "
                  f"{2 * flop / min(two) / 1e9:.1f} in all (best of 5)")


def calls():
    import lik_cupy
    import lik_cupy._cpu.maxsim as M
    from _ab import alternate, packed_cell
    assert hasattr(M, "_THIN"), "apply thin_gemm_hook.patch first"
    rng = np.random.default_rng(7)
    cells = {"1q32x1000d180": (1, 32, 1000, 180, 180), "1q32x1000d16-512": (1, 32, 1000, 16, 512),
             "1q1024x16d1024": (1, 1024, 16, 1024, 1024)}
    for name, (nq, lq, nd, lo, hi) in cells.items():
        Q, D, off = packed_cell(rng, nq, lq, nd, lo, hi)
        call = lambda: lik_cupy.maxsim_varlen(Q, D, off, backend="cpu", return_argmax=True)
        got = {}
        for k, v in (("blas", None), ("thin", thin_gemm)):
            M._THIN = v; got[k] = call(); call()
        assert all(np.array_equal(a, b) for a, b in zip(got["blas"], got["thin"]))  # the same bits
        t = alternate(call, lambda k: setattr(M, "_THIN", None if k == "blas" else thin_gemm), ("blas", "thin"), 11)
        med = {k: round(float(np.median(v)), 1) for k, v in t.items()}
        print(name, "median ms", med, "thin / blas", round(med["thin"] / med["blas"], 3), flush=True)


if __name__ == "__main__":
    calls() if sys.argv[1:] == ["calls"] else kernel_alone()
