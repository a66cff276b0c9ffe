"""Corpus.search: the repeat path (prepared scores + merge by kernel handle) against the streamed
path, alternating call by call in one process (H200). Wall ms per call, back to back, host included."""
import json, os, statistics, sys, time
import numpy as np
import cupy
sys.path.insert(0, os.environ.get("BENCH_ROOT", "."))
from bench.suites.bench_serve import build_corpus, queries, gpu_ms

import lik_cupy

out = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cells": {}}
sync = cupy.cuda.get_current_stream().synchronize
try:
    import torch
except ImportError:
    torch = None


def ab(name, fa, fb, n=400, rounds=5):
    for j in range(5):
        fa(j); fb(j)
    sync()
    ta, tb = [], []
    for r in range(rounds):
        for j in range(n // rounds):
            first, second = (fa, fb) if (j + r) % 2 == 0 else (fb, fa)
            for fn in (first, second):
                t0 = time.perf_counter(); fn(j); sync(); dt = time.perf_counter() - t0
                (ta if fn is fa else tb).append(dt)
    a, b = 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)
    out["cells"][name] = {"repeat_ms": a, "streamed_ms": b, "ratio": a / b}
    print(f"{name:42s} repeat {a:.4f}  streamed {b:.4f}  ratio {a / b:.3f}", flush=True)


for docs, ld in ((100_000, 180), (10_000, 180)):
    A = build_corpus(docs, ld, 128, 0, 1)
    B = lik_cupy.Corpus(A._dev.tokens)  # the same documents, its prepared searches never kept
    B._keep = lambda key, call: None
    qs = queries(16, 32, 128, 2)
    qd = cupy.asarray(qs)
    q8 = cupy.asarray(queries(16 * 8, 32, 128, 3).reshape(16, 8, 32, 128))
    cases = {"1q cupy": lambda c, j: c.search(qd[j % 16], 10),
             "1q cupy 3-D": lambda c, j: c.search(qd[j % 16:j % 16 + 1], 10),
             "8q cupy": lambda c, j: c.search(q8[j % 16], 10),
             "1q numpy": lambda c, j: c.search(qs[j % 16], 10),
             "1q cupy k100": lambda c, j: c.search(qd[j % 16], 100)}
    if torch is not None:
        qt = torch.as_tensor(qs, device="cuda")
        cases["1q torch"] = lambda c, j: c.search(qt[j % 16], 10)
    for cname, f in cases.items():
        for j in range(3):  # the same results, bit for bit
            (sa, ia), (sb, ib) = f(A, j), f(B, j)
            ga = [x.get() if hasattr(x, "get") else (x.cpu().numpy() if hasattr(x, "cpu") else x) for x in (sa, ia)]
            gb = [x.get() if hasattr(x, "get") else (x.cpu().numpy() if hasattr(x, "cpu") else x) for x in (sb, ib)]
            assert all(np.array_equal(x, y) for x, y in zip(ga, gb)), cname
        ab(f"{docs} docs: {cname}", lambda j, f=f: f(A, j), lambda j, f=f: f(B, j))
    from lik_cupy._runtime.prepared_calls import PreparedSearch
    assert any(isinstance(c, PreparedSearch) for c in A._calls.values()) and not B._calls
    out["cells"][f"{docs} docs: 1q cupy"]["gpu_ms"] = gpu_ms(lambda j: A.search(qd[j % 16], 10))
    del A, B
    cupy.get_default_memory_pool().free_all_blocks()

od = os.environ.get("OUT", ".")
json.dump(out, open(os.path.join(od, "search_repeat_ab.json"), "w"), indent=1)

# JAX queries on the corpus's GPU: through the CuPy call (DLPack; the repeat path) against the plain path
try:
    import jax
    import jax.numpy as jnp
except ImportError:
    jax = None
if jax is not None:
    for docs, ld in ((100_000, 180), (10_000, 180)):
        A = build_corpus(docs, ld, 128, 0, 1)
        B = lik_cupy.Corpus(A._dev.tokens)
        B._stand_in = lambda *a, **k: None  # the plain path, as before
        qj = [jnp.asarray(q) for q in queries(16, 32, 128, 2)]
        f = lambda c, j: c.search(qj[j % 16], 10)
        for j in range(3):
            (sa, ia), (sb, ib) = f(A, j), f(B, j)
            assert np.array_equal(np.asarray(sa), np.asarray(sb)) and np.array_equal(np.asarray(ia), np.asarray(ib))

        def jsync(r):
            r[0].block_until_ready(); r[1].block_until_ready()

        ab(f"{docs} docs: 1q jax", lambda j: jsync(f(A, j)), lambda j: jsync(f(B, j)))
        del A, B
        cupy.get_default_memory_pool().free_all_blocks()
    json.dump(out, open(os.path.join(od, "search_repeat_ab.json"), "w"), indent=1)
