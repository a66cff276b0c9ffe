"""The CPU path's tokens-first GEMM (``lik_cupy/_cpu/maxsim.py``, ``_TOKENS_FIRST_ROWS``), measured two ways
on the 2-core AMD EPYC machine (OpenBLAS 0.3.31, NumPy 2.4):

1. ``gemm``: one thread, 180,000 x 128 float32 document tokens in pieces of 2,048 columns against
   ``rows`` query rows (``sets`` sets), ``q @ D.T`` into the similarity block (the plain GEMM) against
   ``D @ q.T`` into a scratch of 256 KiB and copied transposed into the block (tokens first); float32
   and float64.
2. ``calls``: whole ``backend="cpu"`` calls, the rule on (64 rows) and off (0) in alternating order in
   one process, nine pairs: 1 q (32) x 1,000 docs (180), the same against 1,000 packed documents of
   16-512 tokens, and 1 q (1,024) x 16 pages (1,024), whose 1,024 rows never take the rule (the
   spread of a cell the rule does not touch).

    python ab.py > ab_output.json
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import lik_cupy  # noqa: E402
import lik_cupy._cpu.maxsim as M  # noqa: E402

rng = np.random.default_rng(0)


def med(f, n=5):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return round(float(np.median(ts)) * 1e3, 2)


def gemm_rows():
    out = []
    with threadpool_limits(1):
        for dt in (np.float32, np.float64):
            for sets, rows, n in ((1, 16, 90000), (1, 32, 90000), (1, 64, 45000), (1, 128, 24000), (8, 32, 11250)):
                A = rng.standard_normal((sets, rows, 128)).astype(dt)
                T = rng.standard_normal((sets, n, 128)).astype(dt)
                S = np.empty((sets, rows, 2048), dt)
                scratch = np.empty((256 << 10) // np.dtype(dt).itemsize, dt)

                def plain():
                    for p in range(0, n, 2048):
                        k = min(2048, n - p)
                        np.matmul(A, T[:, p:p + k].transpose(0, 2, 1), out=S[:, :, :k])

                def tokens_first():
                    step = scratch.size // (sets * rows)
                    for p in range(0, n, 2048):
                        k = min(2048, n - p)
                        for a in range(0, k, step):
                            b = min(k, a + step)
                            St = scratch[:sets * (b - a) * rows].reshape(sets, b - a, rows)
                            np.matmul(T[:, p + a:p + b], A.transpose(0, 2, 1), out=St)
                            np.copyto(S[:, :, a:b], St.transpose(0, 2, 1))
                p_ms, t_ms = med(plain), med(tokens_first)
                out.append({"dtype": np.dtype(dt).name, "sets": sets, "rows": rows, "tokens": sets * n,
                            "plain_ms": p_ms, "tokens_first_ms": t_ms, "ratio": round(t_ms / p_ms, 3)})
    return out


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def calls():
    Q = unit(rng.standard_normal((1, 32, 128), dtype=np.float32))
    D = unit(rng.standard_normal((1000, 180, 128), dtype=np.float32))
    lens = rng.integers(16, 513, 1000)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    T = unit(rng.standard_normal((int(off[-1]), 128), dtype=np.float32))
    Q4 = unit(rng.standard_normal((1, 1024, 128), dtype=np.float32))
    P = unit(rng.standard_normal((16, 1024, 128), dtype=np.float32))
    cells = {"1q32 x 1000d180": lambda: lik_cupy.maxsim(Q, D, backend="cpu"),
             "1q32 x 1000d16-512": lambda: lik_cupy.maxsim_varlen(Q, T, off, backend="cpu"),
             "1q1024 x 16d1024 (not taking it)": lambda: lik_cupy.maxsim(Q4, P, backend="cpu")}
    times = {(c, v): [] for c in cells for v in (64, 0)}
    for r in range(9):
        for c, f in cells.items():
            for v in ((64, 0) if r % 2 else (0, 64)):
                M._TOKENS_FIRST_ROWS = v
                f()
                t = time.perf_counter()
                f()
                times[(c, v)].append(time.perf_counter() - t)
    M._TOKENS_FIRST_ROWS = 64
    out = []
    for c in cells:
        a, b = np.array(times[(c, 64)]) * 1e3, np.array(times[(c, 0)]) * 1e3
        out.append({"case": c, "tokens_first_median_ms": round(float(np.median(a)), 2), "tokens_first_best_ms": round(float(a.min()), 2),
                    "plain_median_ms": round(float(np.median(b)), 2), "plain_best_ms": round(float(b.min()), 2),
                    "ratio_median": round(float(np.median(a) / np.median(b)), 3)})
    return out


if __name__ == "__main__":
    print(json.dumps({"gemm": gemm_rows(), "calls": calls()}, indent=1))
