"""Where a single-query Corpus.search spends its host time (H200)."""
import cProfile, io, json, os, pstats, statistics, sys, time
import cupy
sys.path.insert(0, os.environ.get("BENCH_ROOT", "."))
from bench.suites.bench_serve import build_corpus, queries, gpu_ms

corpus = build_corpus(100_000, 180, 128, 0, 1)
qs = queries(16, 32, 128, 2)
qd = cupy.asarray(qs)
sync = cupy.cuda.get_current_stream().synchronize

def wall(fn, n=400):
    for j in range(5):
        fn(j)
    sync()
    t = []
    for j in range(n):
        t0 = time.perf_counter(); fn(j); sync(); t.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(t)

fns = {
    "search_host": lambda j: corpus.search(qs[j % 16], 10),
    "search_dev": lambda j: corpus.search(qd[j % 16], 10),
    "score_dev": lambda j: corpus.score(qd[j % 16]),
    "score_host": lambda j: corpus.score(qs[j % 16]),
}
out = {}
for name, fn in fns.items():
    out[name] = {"wall_ms": wall(fn)}
    if name.endswith("_dev"):
        out[name]["gpu_ms"] = gpu_ms(fn)
for name, r in out.items():
    print(f"{name:12s} wall {r['wall_ms']:.4f}  gpu {r.get('gpu_ms', float('nan')):.4f}")

# host time to queue (no sync): search_dev enqueue cost
def enqueue(fn, n=400):
    t = []
    for j in range(n):
        sync(); t0 = time.perf_counter(); fn(j); t.append(time.perf_counter() - t0)
    sync()
    return 1e3 * statistics.median(t)
for name in ("search_dev", "score_dev"):
    out[name]["enqueue_ms"] = enqueue(fns[name])
    print(f"{name:12s} enqueue {out[name]['enqueue_ms']:.4f}")

for name in ("search_dev", "search_host"):
    pr = cProfile.Profile()
    fn = fns[name]
    pr.enable()
    for j in range(300):
        fn(j); sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print(f"==== {name} tottime"); print(s.getvalue()[:6000])
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(45)
    print(f"==== {name} cumtime"); print(s.getvalue()[:8000])

od = os.environ.get("OUT", ".")
json.dump({"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), **out},
          open(os.path.join(od, "probe_search.json"), "w"), indent=1)
