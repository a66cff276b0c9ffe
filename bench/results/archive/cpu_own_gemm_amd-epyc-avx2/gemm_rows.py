"""The folded path's GEMM alone, gemm_kernels.tokens_by_rows against OpenBLAS (np.matmul), on pieces
of tokens as maxsim.py hands them over (_FOLD_PIECE_BYTES), R query rows, d = 128: GFLOP/s on one thread,
and in all with two threads at once; best of three alternating rounds.
    python gemm_rows.py > gemm_rows.txt"""
import sys, threading, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import numpy as np
from threadpoolctl import threadpool_limits
from lik_cupy._cpu import gemm_kernels as G
from lik_cupy._cpu.maxsim import _FOLD_PIECE_BYTES, _FOLD_PIECE_MIN


def rates(R: int, rng, d: int = 128, lanes=(8,)) -> dict:
    """{way: (GFLOP/s on one thread, in all on two at once)} for R rows, best of three rounds; the kernel
    with tiles of each of ``lanes``' vector widths."""
    n = max(20000, 180000 * 32 // R)
    Ts = [rng.standard_normal((n, d)).astype(np.float32) for _ in range(2)]
    A = rng.standard_normal((R, d)).astype(np.float32)
    At = A.T
    outs = [np.empty((n, R), np.float32) for _ in range(2)]
    step = max(_FOLD_PIECE_MIN, _FOLD_PIECE_BYTES // ((R + d) * 4))
    flop = 2 * n * R * d

    def pieces(f, T, out):
        for p0 in range(0, n, step):
            f(T[p0:p0 + step], out[p0:p0 + step])
    ways = {"openblas": lambda T, o: np.matmul(T, At, out=o)}
    for w in lanes:
        ways["gemm_kernels" + ("" if w == 8 else f"_{w}")] = lambda T, o, Ap=G.pack(A, w): G.tokens_by_rows(T, Ap, o)
    res = {}
    with threadpool_limits(1):
        for _ in range(3):
            for name, f in ways.items():
                pieces(f, Ts[0], outs[0])
                t = time.perf_counter(); pieces(f, Ts[0], outs[0]); one = time.perf_counter() - t
                th = [threading.Thread(target=pieces, args=(f, Ts[k], outs[k])) for k in range(2)]
                t0 = time.perf_counter(); [x.start() for x in th]; [x.join() for x in th]
                res.setdefault(name, []).append((flop / one / 1e9, 2 * flop / (time.perf_counter() - t0) / 1e9))
    return {k: (round(max(a for a, _ in v), 1), round(max(b for _, b in v), 1)) for k, v in res.items()}


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    print("rows: (one thread, two threads) GFLOP/s")
    for R in (8, 16, 32, 48, 64, 128, 256, 512, 1024):
        print(R, rates(R, rng), flush=True)
