"""The CPU path's 32-row GEMM both ways round (see README.md): 180,000 tokens x 32 rows, d = 128."""
import sys
import time

import numpy as np

rng = np.random.default_rng(0)
D = rng.standard_normal((180000, 128), np.float32)
q = rng.standard_normal((32, 128), np.float32)
qT = np.ascontiguousarray(q.T)
S1 = np.empty((32, 180000), np.float32)  # today's layout: query rows x tokens
S2 = np.empty((180000, 32), np.float32)  # tokens x query rows


def t(f, n=7):
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return round(1e3 * np.median(ts), 1), round(1e3 * min(ts), 1)


def blocks(b):
    return [(i, min(b, 180000 - i)) for i in range(0, 180000, b)]


for rnd in range(2):
    for b in (1024, 2048, 4096):
        tmp = np.empty((b, 32), np.float32)
        ways = {
            "q @ D.T into S": lambda: [np.matmul(q, D[i:i + m].T, out=S1[:, i:i + m]) for i, m in blocks(b)],
            "D @ q.T into S'": lambda: [np.matmul(D[i:i + m], qT, out=S2[i:i + m]) for i, m in blocks(b)],
            "D @ q.T into S.T": lambda: [np.matmul(D[i:i + m], qT, out=S1[:, i:i + m].T) for i, m in blocks(b)],
            "D @ q.T, copied back": lambda: [(np.matmul(D[i:i + m], qT, out=tmp[:m]), np.copyto(S1[:, i:i + m], tmp[:m].T))
                                             for i, m in blocks(b)],
        }
        print(rnd, b, {k: t(f) for k, f in ways.items()}, flush=True)
sys.exit(0)
