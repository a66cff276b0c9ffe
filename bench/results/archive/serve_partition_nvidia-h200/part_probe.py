"""Where a two-GPU Partition's call spends its time (rerank of 1,000 ids, search top-10), against one part's call."""
import sys, os, time
sys.path.insert(0, os.getcwd())
import numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "bench", "suites"))
from bench_serve import build_corpus
from lik_cupy.serving._partition import Partition
docs = int(sys.argv[1]) if len(sys.argv) > 1 else 200000
parts = [build_corpus(docs // 2, 180, 128, d, d) for d in (0, 1)]
P = Partition(parts)
rng = np.random.default_rng(0)
x = rng.standard_normal((1, 32, 128), np.float32); x /= np.linalg.norm(x, axis=-1, keepdims=True)
Q = x[0].astype(np.float16); off = np.array([0, 32], np.int64)
cand = rng.integers(0, docs, (1, 1000))
def t(f, n=200):
    for _ in range(10): f()
    s = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - s) / n * 1e3
print("part0 rerank ms %.3f" % t(lambda: parts[0].rerank(Q, cand % (docs // 2), q_offsets=off)))
print("part1 rerank ms %.3f" % t(lambda: parts[1].rerank(Q, cand % (docs // 2), q_offsets=off)))
import lik_cupy.serving._partition as _pt
for mode, lim in (("threads", -1.0), ("as chosen", _pt.SEQUENTIAL_MAX_S), ("in sequence", 1e9)):
    _pt.SEQUENTIAL_MAX_S = lim
    print(mode, "partition rerank ms %.3f" % t(lambda: P.rerank(Q, cand, q_offsets=off)),
          "search ms %.3f" % t(lambda: P.search(Q, 10, q_offsets=off), 50), flush=True)
from concurrent.futures import Future
from lik_cupy.serving._queue import Request, scored
from lik_cupy.serving._staging import Staging
st = Staging()
for mode, lim in (("staged, threads", -1.0), ("staged, as chosen", 0.6e-3), ("staged, in sequence", 1e9)):
    _pt.SEQUENTIAL_MAX_S = lim
    print(mode, "rerank ms %.3f" % t(lambda: scored(P, [Request("rerank", Q[None], cand, None, True, None, Future(), 0.0)], st)),
          "search ms %.3f" % t(lambda: scored(P, [Request("search", Q[None], 10, None, True, None, Future(), 0.0)], st), 50), flush=True)
print("one part staged rerank ms %.3f" % t(lambda: scored(parts[0], [Request("rerank", Q[None], cand % (docs // 2), None, True, None, Future(), 0.0)], st)))
_pt.SEQUENTIAL_MAX_S = -1.0
print("part0 search ms %.3f" % t(lambda: parts[0].search(Q, 10, q_offsets=off), 50))
def each_noop():
    P._each("noop", lambda p, n: None)
print("partition _each(noop) ms %.3f" % t(each_noop))
# the same rerank calls from the pool threads themselves, timed inside
acc = {}
def timed_part(p, n):
    mine = (cand >= P.starts[n]) & (cand < P.starts[n + 1])
    loc = np.where(mine, cand - P.starts[n], 0)
    s0 = time.perf_counter(); p.rerank(Q, loc, q_offsets=off); acc.setdefault(n, []).append(time.perf_counter() - s0)
for _ in range(100): P._each("probe", timed_part)
print({n: "%.3f ms" % (1e3 * np.median(v)) for n, v in acc.items()})
