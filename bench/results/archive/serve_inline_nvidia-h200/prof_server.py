"""bench_serve's server role with timers around the request path; prints medians at exit."""
import asyncio, atexit, collections, functools, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
from lik_cupy.serving import http, _service, _tensors, batcher as B, _queue
rec = collections.defaultdict(list)
def timed(mod, name, label=None, is_async=False):
    f = getattr(mod, name)
    label = label or name
    if is_async:
        @functools.wraps(f)
        async def g(*a, **k):
            t = time.perf_counter(); r = await f(*a, **k); rec[label].append(time.perf_counter() - t); return r
    else:
        @functools.wraps(f)
        def g(*a, **k):
            t = time.perf_counter(); r = f(*a, **k); rec[label].append(time.perf_counter() - t); return r
    setattr(mod, name, g)
timed(http, "_answer_infer", is_async=True)
timed(http, "_body", is_async=True)
timed(_tensors, "read_request")
timed(_tensors, "write_response")
timed(_service, "infer", is_async=True)
timed(_service, "_arguments")
timed(_service, "responded")
timed(http, "_unless_disconnected", is_async=True)
timed(http, "_infer", is_async=True)
timed(_tensors, "binary_outputs")
timed(B.Batcher, "submit")
timed(B.Batcher, "_request")
timed(_queue, "scored")
orig_submit = B.Batcher.submit
def submit(self, *a, **k):
    t = time.monotonic(); f = orig_submit(self, *a, **k); f._t0 = t; return f
B.Batcher.submit = submit
class AP:
    def __getattr__(self, n): return getattr(asyncio, n)
    @staticmethod
    async def _w(fut):
        r = await asyncio.wrap_future(fut)
        tm = fut.timing
        rec["handback"].append(time.monotonic() - (fut._t0 + tm.queue_s + tm.compute_s))
        rec["queue_s"].append(tm.queue_s); rec["compute_s"].append(tm.compute_s)
        return r
    def wrap_future(self, fut): return self._w(fut)
_service.asyncio = AP()
def report():
    for k, v in rec.items():
        v = v[200:] if len(v) > 400 else v
        print(f"PROF {k:16s} n={len(v):6d} median {statistics.median(v)*1e6:8.1f} us", file=sys.stderr, flush=True)
atexit.register(report)
from bench.suites import bench_serve
sys.argv = [bench_serve.__file__] + sys.argv[1:]
bench_serve.main()
