"""NumPy arguments of Corpus calls on an H200: the plain path against host_staging, alternating call
by call in one process (lik_cupy.corpus._STAGED_BYTES set to 0 for the plain path), 20,000 resident
documents of 180 float16 tokens, d = 128; wall ms per call back to back (median), and the CuPy call
with .get() for scale. Writes $OUT/host_staging_ab.json (appends a run)."""
import json, os, statistics, sys, time
import numpy as np
import cupy
sys.path.insert(0, os.environ["BENCH_ROOT"])
from bench.suites.bench_serve import build_corpus, queries
import lik_cupy._runtime.host_staging as hs
corpus = build_corpus(20_000, 180, 128, 0, 1)
qs = queries(16, 32, 128, 2)
rng = np.random.default_rng(3)
cands = [rng.integers(0, 20_000, 1000).astype(np.int64) for _ in range(16)]
c8 = np.stack(cands[:8])
stream = cupy.cuda.get_current_stream()
real = hs.MAX_BYTES
qd, cd = cupy.asarray(qs), cupy.asarray(np.stack(cands))
cases = {"rerank 1 q (32) x 1,000 ids": lambda j: corpus.rerank(qs[j % 16], cands[j % 16]),
         "rerank 8 q (32) x 1,000 ids": lambda j: corpus.rerank(qs[:8], c8),
         "search 1 q (32), k 10": lambda j: corpus.search(qs[j % 16], 10),
         "score 1 q (32)": lambda j: corpus.score(qs[j % 16])}
run = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "docs": 20_000, "cells": {}}
for name, fn in cases.items():
    times = {"plain": [], "staged": []}
    for j in range(20):
        fn(j)
    for j in range(1200):
        mode = "staged" if j % 2 else "plain"
        hs.MAX_BYTES = real if mode == "staged" else 0
        stream.synchronize()
        t0 = time.perf_counter(); fn(j); stream.synchronize(); times[mode].append(time.perf_counter() - t0)
    hs.MAX_BYTES = real
    row = {m: 1e3 * statistics.median(v) for m, v in times.items()}
    row["ratio"] = row["staged"] / row["plain"]
    run["cells"][name] = row
    print(name, {k: round(v, 4) for k, v in row.items()})
t = []
for j in range(600):
    stream.synchronize(); t0 = time.perf_counter(); corpus.rerank(qd[j % 16], cd[j % 16]).get(); t.append(time.perf_counter() - t0)
run["rerank 1 q from CuPy arrays, .get()"] = 1e3 * statistics.median(t)
print("rerank 1 q cupy + get", round(run["rerank 1 q from CuPy arrays, .get()"], 4))
path = os.path.join(os.environ.get("OUT", "."), "host_staging_ab.json")
runs = json.load(open(path)) if os.path.exists(path) else []
json.dump(runs + [run], open(path, "w"), indent=1)
