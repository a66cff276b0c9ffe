"""A lone staged search: main thread on the default stream, main thread on a stream of its own, and a
second thread on a stream of its own, in rotating rounds (H200 probe)."""
import json, os, queue, statistics, sys, threading, time
from concurrent.futures import Future
import numpy as np
sys.path.insert(0, os.getcwd())
import cupy
from bench.suites.bench_serve import build_corpus, queries
from lik_cupy.serving._queue import Request, scored
from lik_cupy.serving._staging import Staging
corpus = build_corpus(100000, 180, 128, 0, 0)
qs = queries(16, 32, 128, 1)
rng = np.random.default_rng(2)
cand = [rng.choice(100000, 1000, replace=False).astype(np.int64) for _ in qs]
def req(op, j):
    return [Request(op, qs[j % 16][None], 10 if op == "search" else cand[j % 16][None], None, True, None, Future(), 0.0)]
own = cupy.cuda.Stream(non_blocking=True)
st = {"main_default": Staging(), "main_own": Staging(), "thread_own": Staging()}
def timed(op, mode, n):
    t = []
    for j in range(n):
        t0 = time.perf_counter(); scored(corpus, req(op, j), st[mode]); t.append(time.perf_counter() - t0)
        time.sleep(0.0003)
    return t
jobs, done = queue.Queue(), queue.Queue()
def worker():
    with cupy.cuda.Device(0), cupy.cuda.Stream(non_blocking=True):
        while True:
            a = jobs.get()
            if a is None: return
            done.put(timed(*a))
th = threading.Thread(target=worker, daemon=True); th.start()
res = {}
for op in ("search", "rerank"):
    for mode in st:  # warm
        if mode == "thread_own": jobs.put((op, mode, 30)); done.get()
        elif mode == "main_own":
            with own: timed(op, mode, 30)
        else: timed(op, mode, 30)
    for rnd in range(6):
        modes = list(st)[rnd % 3:] + list(st)[:rnd % 3]
        for mode in modes:
            if mode == "thread_own": jobs.put((op, mode, 150)); t = done.get()
            elif mode == "main_own":
                with own: t = timed(op, mode, 150)
            else: t = timed(op, mode, 150)
            res.setdefault(f"{op}_{mode}", []).append(round(1e3 * statistics.median(t), 4))
jobs.put(None)
for k, v in res.items(): print(f"{k:22s} rounds {v}  median {statistics.median(v):.4f}")
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "search_probe2.json"), "w"), indent=1)
