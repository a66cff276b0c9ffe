"""The fold kernel alone, before and after, on similarities and tokens held in the cache: every document
of a call the same L tokens (start 0), so that only the kernel's own work is timed, not memory. ns a
similarity (a token's row of R) and a token, best of 15 alternating calls; the results checked equal.

    python fold_cached.py OLD_FOLD_KERNELS.py [out.json]
"""
import json, sys, time
from pathlib import Path
from _ab import fold_ways
import numpy as np

ways = fold_ways(sys.argv[1])
rng = np.random.default_rng(1)
out = {}
for R, L, nb in [(32, 180, 400), (1024, 256, 40)]:
    T = rng.standard_normal((L, 128)).astype(np.float32)
    A64 = rng.standard_normal((R, 128))
    St = rng.standard_normal((L, R)).astype(np.float32)
    start, length = np.zeros(nb, np.int64), np.full(nb, L, np.int64)
    best, res = {}, {}
    for rep in range(15):
        for k, (kern, cls) in ways.items():
            f = cls(start, length, None, A64, T, np.float32, kern)
            t = time.perf_counter(); f.piece(St, 0, L); dt = time.perf_counter() - t
            best[k] = min(best.get(k, 1e9), dt)
            res[k] = (f.first, f.best, f.second, f.win)
    assert all(np.array_equal(a, b) for a, b in zip(res["before"], res["after"]))
    out[f"R={R}"] = {k: {"ns_per_similarity": round(b / (R * L * nb) * 1e9, 3), "ns_per_token": round(b / (L * nb) * 1e9, 1)}
                     for k, b in best.items()}
    print(R, out[f"R={R}"], flush=True)
if len(sys.argv) > 2:
    Path(sys.argv[2]).write_text(json.dumps(out, indent=1) + "\n")
