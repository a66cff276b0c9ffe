"""Where a server's lone search spends more than the in-process call (H200 probe)."""
import cProfile, io, json, os, pstats, statistics, sys, threading, time
from concurrent.futures import Future
import numpy as np
sys.path.insert(0, os.getcwd())
import cupy
from bench.suites.bench_serve import build_corpus, queries
from lik_cupy.serving._queue import scored
from lik_cupy.serving._staging import Staging
from lik_cupy.serving._queue import Request
corpus = build_corpus(100000, 180, 128, 0, 0)
qs = queries(16, 32, 128, 1)
rng = np.random.default_rng(2)
cand = [rng.choice(100000, 1000, replace=False).astype(np.int64) for _ in qs]
staging = Staging()
out = {}
def med(fn, n=400):
    for j in range(20): fn(j)
    t = []
    for j in range(n):
        t0 = time.perf_counter(); fn(j); t.append(time.perf_counter() - t0)
        time.sleep(0.0003)  # one at a time, as a lone client's requests come
    return round(1e3 * statistics.median(t), 4)
def req(op, j):
    q = qs[j % 16][None]
    return [Request(op, q, 10 if op == "search" else cand[j % 16][None], None, True, None, Future(), 0.0)]
cases = {
 "search_2d_host": lambda j: corpus.search(qs[j % 16], 10),
 "search_3d_host": lambda j: corpus.search(qs[j % 16][None], 10),
 "search_staged": lambda j: scored(corpus, req("search", j), staging),
 "rerank_2d_host": lambda j: corpus.rerank(qs[j % 16], cand[j % 16]),
 "rerank_staged": lambda j: scored(corpus, req("rerank", j), staging),
}
dq = cupy.asarray(qs)
cases["search_3d_device"] = lambda j: cupy.asnumpy(corpus.search(dq[j % 16][None], 10)[0])
for name, fn in cases.items():
    out[name + "_default_stream"] = med(fn)
    with cupy.cuda.Stream(non_blocking=True):
        out[name + "_own_stream"] = med(fn)
# the worker's thread and stream
def in_thread(fn, key):
    def run():
        with cupy.cuda.Device(0), cupy.cuda.Stream(non_blocking=True):
            out[key] = med(fn)
    t = threading.Thread(target=run); t.start(); t.join()
in_thread(cases["search_staged"], "search_staged_thread")
in_thread(cases["search_2d_host"], "search_2d_host_thread")
for k, v in out.items(): print(f"{k:40s} {v:8.4f} ms", flush=True)
for name in ("search_2d_host", "search_staged"):
    pr = cProfile.Profile(); pr.enable()
    for j in range(200): cases[name](j)
    pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print("=====", name); print("\n".join(l for l in s.getvalue().splitlines() if l.strip())[:3000])
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "search_probe.json"), "w"), indent=1)
