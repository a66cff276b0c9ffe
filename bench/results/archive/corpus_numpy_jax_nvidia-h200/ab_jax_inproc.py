"""JAX arrays' Corpus calls on an H200: the plain path against the CuPy stand-in, alternating call by
call in one process (Corpus._stand_in made to answer None for the plain path); 20,000 documents of
180 float16 tokens, d = 128; wall ms per call until the JAX result is ready (median). Appends to
$OUT/jax_stand_in_ab.json."""
import json, os, statistics, sys, time
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import numpy as np
import cupy
import jax
sys.path.insert(0, os.environ["BENCH_ROOT"])
from bench.suites.bench_serve import build_corpus, queries
corpus = build_corpus(20_000, 180, 128, 0, 1)
qs = queries(16, 32, 128, 2)
rng = np.random.default_rng(3)
cands = np.stack([rng.integers(0, 20_000, 1000) for _ in range(16)]).astype(np.int32)
qj = [jax.device_put(qs[i]) for i in range(16)]
cj = [jax.device_put(cands[i]) for i in range(16)]
real = corpus._stand_in
cases = {"rerank 1 q (32) x 1,000 ids": lambda j: corpus.rerank(qj[j % 16], cj[j % 16]),
         "score 1 q (32)": lambda j: corpus.score(qj[j % 16]),
         "search 1 q (32), k 10": lambda j: corpus.search(qj[j % 16], 10)}
run = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "docs": 20_000, "cells": {}}
for name, fn in cases.items():
    times = {"plain": [], "stand_in": []}
    for j in range(20):
        jax.block_until_ready(fn(j))
    for j in range(1200):
        mode = "stand_in" if j % 2 else "plain"
        corpus._stand_in = real if mode == "stand_in" else (lambda *a: None)
        t0 = time.perf_counter(); jax.block_until_ready(fn(j)); times[mode].append(time.perf_counter() - t0)
    corpus._stand_in = real
    row = {m: 1e3 * statistics.median(v) for m, v in times.items()}
    row["ratio"] = row["stand_in"] / row["plain"]
    run["cells"][name] = row
    print(name, {k: round(v, 4) for k, v in row.items()})
path = os.path.join(os.environ.get("OUT", "."), "jax_stand_in_ab.json")
runs = json.load(open(path)) if os.path.exists(path) else []
json.dump(runs + [run], open(path, "w"), indent=1)
