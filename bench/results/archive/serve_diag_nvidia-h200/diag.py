"""Serving diagnostics on the GPU host: where a rerank/search request's time goes."""
import cProfile, io, json, os, pstats, statistics, subprocess, sys, threading, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd() + "/bench/suites")
import numpy as np
import bench_serve as bs
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

OUT = os.environ.get("OUT", "/tmp")
DOCS = int(os.environ.get("DIAG_DOCS", "100000"))
res = {}

def med_ms(fn, n=200):
    for j in range(5): fn(j)
    t = []
    for j in range(n):
        t0 = time.perf_counter(); fn(j); t.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(t)

def inprocess():
    import cupy
    c = bs.build_corpus(DOCS, 180, 128, 0, 0)
    qs = bs.queries(16, 32, 128, 1)
    rng = np.random.default_rng(2)
    cand = [rng.choice(DOCS, 1000, replace=False) for _ in qs]
    off1 = np.array([0, 32], np.int64)
    q8 = np.concatenate([q for q in qs[:8]]).reshape(-1, 128)
    off8 = np.arange(0, 8 * 32 + 1, 32, dtype=np.int64)
    c8 = np.stack(cand[:8])
    fns = {
        "rerank_plain": lambda j: c.rerank(qs[j % 16], cand[j % 16]),
        "rerank_offsets": lambda j: c.rerank(qs[j % 16].reshape(-1, 128), cand[j % 16][None], q_offsets=off1),
        "rerank_offsets_x8": lambda j: c.rerank(q8, c8, q_offsets=off8),
        "search_plain": lambda j: c.search(qs[j % 16], 10),
        "search_offsets": lambda j: c.search(qs[j % 16].reshape(-1, 128), 10, q_offsets=off1),
        "search_offsets_x8": lambda j: c.search(q8, 10, q_offsets=off8),
    }
    r = {k: med_ms(f) for k, f in fns.items()}
    # the same in a worker thread on its own non-blocking stream, as the batcher runs them
    out = {}
    def worker():
        with cupy.cuda.Device(0), cupy.cuda.Stream(non_blocking=True):
            for k in ("rerank_offsets", "search_offsets", "rerank_offsets_x8"):
                out["thread_" + k] = med_ms(fns[k])
    th = threading.Thread(target=worker); th.start(); th.join()
    r.update(out)
    # device-side arrays: the repeat path
    qd = cupy.asarray(qs); cd = cupy.asarray(np.stack(cand))
    r["rerank_device"] = med_ms(lambda j: c.rerank(qd[j % 16], cd[j % 16]).get())
    r["search_device"] = med_ms(lambda j: [a.get() for a in c.search(qd[j % 16], 10)])
    for k in ("rerank_offsets", "search_offsets"):
        pr = cProfile.Profile(); f = fns[k]
        pr.enable()
        for j in range(300): f(j)
        pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        open(f"{OUT}/cprofile_{k}.txt", "w").write(s.getvalue())
    res["inprocess_ms"] = r
    print(json.dumps(r, indent=1), flush=True)
    del c; cupy.get_default_memory_pool().free_all_blocks()

class A: pass

def servers():
    import types
    args = types.SimpleNamespace(ld=180, dim=128, devices="0", max_delay_us=0, max_queue=4096, seed=0)
    qs = bs.queries(64, 32, 128, 1)
    rng = np.random.default_rng(2)
    cand = [rng.choice(DOCS, 1000, replace=False) for _ in qs]
    payloads = {"search": [bs.request_bytes("search", q) for q in qs],
                "rerank": [bs.request_bytes("rerank", q, c) for q, c in zip(qs, cand)]}
    pool = ProcessPoolExecutor(6, mp_context=get_context("spawn"))
    os.environ["PYTHONPATH"] = os.getcwd() + "/.scratch/serve/site:" + os.environ.get("PYTHONPATH", "")
    for switch in (os.environ.get("DIAG_SWITCHES", "default,0.0001")).split(","):
        if switch == "default": os.environ.pop("LIK_DIAG_SWITCH", None)
        else: os.environ["LIK_DIAG_SWITCH"] = switch
        t0 = time.time()
        srv = bs.Server(args, DOCS, 64)
        print(f"server up in {time.time()-t0:.1f} s (switch {switch})", flush=True)
        rows = []
        try:
            for w in ("rerank", "search"):
                for clients in (1, 8, 64):
                    before = srv.metrics()
                    prof = None
                    if clients == 64 and switch == "default" or clients == 64 and w == "rerank":
                        prof = subprocess.Popen([os.environ.get("PYSPY", "py-spy"), "record", "-p", str(srv.proc.pid), "-d", "2", "-r", "250",
                                                 "-f", "raw", "--threads", "-o", f"{OUT}/pyspy_{w}_{clients}_{switch}.txt"],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                    qps, p50, p99, err = bs.run_load(pool, 6, srv.port, payloads[w], clients, 2.5, None)
                    h = bs.batch_histogram(before, srv.metrics())
                    if prof: 
                        e = prof.communicate()[1]
                        if prof.returncode: print("py-spy:", e.decode()[-300:], flush=True)
                    row = dict(switch=switch, workload=w, clients=clients, qps=qps, p50=p50, p99=p99, errors=err,
                               mean_batch=h["mean_batch"], compute_ms=h["compute_ms_mean"])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            srv.stop()
        res.setdefault("servers", []).extend(rows)
    pool.shutdown()

if __name__ == "__main__":
    if os.environ.get("DIAG_INPROC", "1") == "1":
        inprocess()
    servers()
    json.dump(res, open(f"{OUT}/serve_diag.json", "w"), indent=1)
