#!/usr/bin/env python3
"""``lik serve`` under load over loopback (issue 45): the batching server against itself with batching
off and against in-process calls.

Corpus: ``--docs`` documents (default 100,000 and 1,000,000) of Ld = 180 unit random tokens, d = 128,
float16, built on each server's devices (no shard files); requests are single queries of 32 tokens
sent with the binary tensor protocol. Workloads:

  search   top-10 over each corpus size;
  rerank   1,000 ids per query, over the first size.

For each workload, two servers (``--max-batch 64`` with ``--max-delay-us``, and ``--max-batch 1``:
batching off) each take:

  closed   ``--clients`` connections (1 .. 256) each sending back to back for ``--duration`` s: QPS,
           p50 / p99, the batch-size histogram (from the server's /metrics) and its mean;
  open     Poisson arrivals (open loop: latency counts from each request's scheduled time, so a
           request waiting for a free connection counts) at fractions of the best closed-loop QPS,
           over 256 connections: ``sustained_qps`` is the highest offered rate served in full
           (>= 97 %) with p99 under the workload's target (search 50 ms, rerank 10 ms).

Beside them, in process: one ``Corpus`` call per request back to back (``inprocess_qps``,
``call_ms``), and the GPU time of one call (``kernel_ms``, CUDA events); ``p50_over_kernel`` is the
served p50 at one client over it, ``p50_minus_call_ms`` the served p50 at one client less the
in-process call (target: 0.3 ms). Issue 45's targets: search over 100,000 documents at least 3x the
unbatched server's sustained QPS with p99 under 50 ms; rerank of 1,000 ids at least 5,000 QPS with
p99 under 10 ms; two GPUs (``--devices 0,1``) at least 1.8x one.

Load comes from ``--procs`` processes of asyncio HTTP/1.1 clients on keep-alive connections. The
device image lacks the [serve] extra: carry its wheels (starlette, uvicorn, httptools, uvloop,
prometheus-client, anyio, h11, sniffio, idna, typing-extensions) in .whl/serve and install them as
bench/README.md says. Runs, from the repository root:

    python3 bench/suites/bench_serve.py --out bench/results                  # JSON: serve_<gpu>.json
    python3 bench/suites/bench_serve.py --docs 100000 --devices 0,1 --out /tmp/two
    python3 bench/suites/bench_serve.py --docs 1000000 --devices 0,1 --partition --out /tmp/split
    python3 bench/suites/bench_serve.py --smoke --out /tmp/smoke             # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: bench.lib, and this checkout's lik_cupy

DIM, LQ, LD, K = 128, 32, 180, 10
P99_TARGET_MS = {"search": 50.0, "rerank": 10.0}
OPEN_FRACTIONS = (0.25, 0.5, 0.7, 0.8, 0.9, 1.0)


# ---------------------------------------------------------------- the corpus (server and in process)


def build_corpus(docs: int, ld: int, dim: int, device, seed: int):
    """``docs`` documents of ``ld`` unit random float16 tokens on ``device`` (a CUDA ordinal, or "cpu")."""
    import lik_cupy

    if device == "cpu":
        x = np.random.default_rng(seed).standard_normal((docs, ld, dim), np.float32)
        x /= np.linalg.norm(x, axis=-1, keepdims=True)
        return lik_cupy.Corpus(x.astype(np.float16), device="cpu")
    import cupy

    with cupy.cuda.Device(device):
        D = cupy.empty((docs, ld, dim), cupy.float16)
        gen = cupy.random.default_rng(seed)
        step = max(1, (1 << 28) // (ld * dim * 4))  # 1 GiB of float32 draws at a time
        for a in range(0, docs, step):
            x = gen.standard_normal((min(step, docs - a), ld, dim), dtype=cupy.float32)
            x /= cupy.linalg.norm(x, axis=-1, keepdims=True)
            D[a:a + x.shape[0]] = x.astype(cupy.float16)
            del x
        cupy.get_default_memory_pool().free_all_blocks()
        return lik_cupy.Corpus(D)


def queries(n: int, lq: int, dim: int, seed: int):
    x = np.random.default_rng(seed).standard_normal((n, lq, dim), np.float32)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float16)


def synthetic_batcher(args, observer, process=None):
    """The server's batcher: a synthetic corpus on ``--devices`` (entries naming one device share its
    corpus: --devices 0,0 gives two workers on GPU 0); ``process=(i, n)``: server process i of n keeps
    its share of the GPUs, as ``lik serve --processes`` deals them (``Batcher.from_shards``)."""
    from lik_cupy.serving import Batcher
    from lik_cupy.serving._processes import process_share

    devices = ["cpu" if d == "cpu" else int(d) for d in args.devices.split(",")]
    if args.partition:
        # One worker over the corpus split across the distinct devices (``lik serve --partition``):
        # each part its even share of the documents, generated on its device.
        from lik_cupy.serving._partition import Partition, devices_per_part

        parts = devices_per_part(devices)
        if len(parts) < 2:
            raise SystemExit(f"--partition needs two devices, got --devices {args.devices}")
        bounds = np.linspace(0, args.docs[0], len(parts) + 1).astype(int)
        corpus = Partition([build_corpus(int(b - a), args.ld, args.dim, d, args.seed + n)
                            for n, (d, a, b) in enumerate(zip(parts, bounds, bounds[1:]))])
        return Batcher(corpus, max_batch=args.max_batch, max_delay_us=args.max_delay_us, max_queue=args.max_queue,
                       observer=observer)
    if process is not None:
        devices = process_share(devices, *process)
    loaded = {}
    for d in devices:
        if d not in loaded:
            loaded[d] = build_corpus(args.docs[0], args.ld, args.dim, d, args.seed)
    return Batcher([loaded[d] for d in devices], max_batch=args.max_batch, max_delay_us=args.max_delay_us,
                   max_queue=args.max_queue, observer=observer)


def serve_synthetic(args) -> None:
    """The server role: ``synthetic_batcher`` served by lik_cupy.serving.http, from ``--processes`` processes."""
    import functools

    from lik_cupy.serving.http import make_app, run, run_processes

    load = functools.partial(synthetic_batcher, args)
    if args.processes > 1:
        loads = [functools.partial(synthetic_batcher, args, process=(i, args.processes)) for i in range(args.processes)]
        run_processes(loads, args.processes, host="127.0.0.1", port=0)
    else:
        run(make_app(load), host="127.0.0.1", port=0)


class Server:
    """This script in the server role, as a process on an ephemeral loopback port."""

    def __init__(self, args, docs: int, max_batch: int):
        cmd = [sys.executable, __file__, "--role", "server", "--docs", str(docs), "--ld", str(args.ld), "--dim",
               str(args.dim), "--devices", args.devices, "--max-batch", str(max_batch), "--max-delay-us",
               str(args.max_delay_us), "--max-queue", str(args.max_queue), "--seed", str(args.seed),
               "--processes", str(args.processes)] + (["--partition"] if args.partition else [])
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
        self.lines, self.port, bound = [], None, threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    bound.set()

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.time() + 1800
        while not bound.is_set() or self.get("/v2/health/ready")[0] != 200:
            if self.proc.poll() is not None or time.time() > deadline:
                self.proc.kill()
                raise SystemExit(f"the server did not turn ready: {''.join(self.lines)}")
            time.sleep(0.2)

    def get(self, path: str):
        import http.client

        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, r.read()
        except ConnectionRefusedError:
            return None, b""
        finally:
            c.close()

    def metrics(self) -> dict:
        """{metric line's name and labels: value} of /metrics."""
        out = {}
        for line in self.get("/metrics")[1].decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(300)
        return "".join(self.lines)


# ---------------------------------------------------------------- requests and load


def request_bytes(model: str, q, ids=None, k: int = K) -> bytes:
    """One binary-protocol request (tritonclient's layout): the HTTP head and body."""
    second = {"name": "K", "shape": [1], "datatype": "INT32", "parameters": {"binary_data_size": 4}}
    raw = np.array([k], "<i4").tobytes()
    if model == "rerank":
        raw = np.asarray(ids, "<i8").tobytes()
        second = {"name": "IDS", "shape": [len(ids)], "datatype": "INT64", "parameters": {"binary_data_size": len(raw)}}
    qb = np.ascontiguousarray(q, "<f2").tobytes()
    header = json.dumps({"inputs": [{"name": "Q", "shape": list(q.shape), "datatype": "FP16",
                                     "parameters": {"binary_data_size": len(qb)}}, second],
                         "parameters": {"binary_data_output": True}}).encode()
    body = header + qb + raw
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return head + body


async def _exchange(reader, writer, payload: bytes) -> int:
    writer.write(payload)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(int(v) for k, _, v in (x.partition(":") for x in lines[1:]) if k.lower() == "content-length")
    await reader.readexactly(length)
    return status


async def _load(port: int, payloads: list[bytes], conns: int, duration: float, rate: float | None, seed: int):
    """``conns`` keep-alive connections for ``duration`` s: back to back (``rate`` None) or taking
    Poisson arrivals at ``rate`` per second. Returns (latencies in s of the 200s, other answers)."""
    clock = time.perf_counter  # uvloop's loop.time() counts whole milliseconds
    rng = random.Random(seed)
    lat, errors = [], [0]
    start = clock()
    end = start + duration
    arrivals: asyncio.Queue | None = None
    if rate is not None:
        arrivals = asyncio.Queue()

        async def schedule():
            t = start
            while True:
                t += rng.expovariate(rate)
                if t >= end:
                    return
                await asyncio.sleep(max(0.0, t - clock()))
                arrivals.put_nowait(t)

    async def client(c: int):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = c
        try:
            while True:
                if arrivals is None:
                    t0 = clock()
                    if t0 >= end:
                        return
                else:
                    left = end - clock()
                    if left <= 0:
                        return
                    try:
                        t0 = await asyncio.wait_for(arrivals.get(), left)
                    except asyncio.TimeoutError:
                        return
                status = await _exchange(reader, writer, payloads[i % len(payloads)])
                i += conns
                if status == 200:
                    lat.append(clock() - t0)
                else:
                    errors[0] += 1
        finally:
            writer.close()

    tasks = [client(c) for c in range(conns)]
    if arrivals is not None:
        tasks.append(schedule())
    await asyncio.gather(*tasks)
    return lat, errors[0]


def load_part(port, payloads, conns, duration, rate, seed):
    """One load process's share (runs in a worker process)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_load(port, payloads, conns, duration, rate, seed))


def run_load(pool, procs: int, port: int, payloads, clients: int, duration: float, rate: float | None):
    """Clients spread over the load processes; (QPS of the 200s, p50 ms, p99 ms, other answers)."""
    parts = min(procs, clients)
    shares = [clients // parts + (i < clients % parts) for i in range(parts)]
    futures = [pool.submit(load_part, port, payloads, n, duration, None if rate is None else rate / parts, 1000 + i)
               for i, n in enumerate(shares)]
    lat, errors = [], 0
    for f in futures:
        a, e = f.result()
        lat += a
        errors += e
    lat.sort()

    def pct(p):
        return 1e3 * lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")

    return len(lat) / duration, pct(0.5), pct(0.99), errors


def batch_histogram(before: dict, after: dict) -> dict:
    """Calls per batch-size bucket (queries) between two scrapes, summed over devices, and the mean."""
    cum = {}
    for key, v in after.items():
        if key.startswith("lik_serve_batch_queries_bucket{"):
            le = re.search(r'le="([^"]+)"', key).group(1)
            cum[le] = cum.get(le, 0) + v - before.get(key, 0)
    les = sorted(cum, key=lambda x: float(x))
    hist, prev = {}, 0
    for le in les:
        if cum[le] - prev:
            hist[le] = int(cum[le] - prev)
        prev = cum[le]

    def total(name):
        return sum(v - before.get(k, 0) for k, v in after.items() if k.startswith(name + "{"))

    calls = total("lik_serve_batch_queries_count")
    return {"histogram": hist, "mean_batch": total("lik_serve_batch_queries_sum") / calls if calls else None,
            "compute_ms_mean": 1e3 * total("lik_serve_compute_seconds_sum") / calls if calls else None}


# ---------------------------------------------------------------- a workload


def in_process(args, docs: int, workloads, qs, cand):
    """One call per request with host queries, back to back, on the first device, and the GPU time of
    one call: {workload: {inprocess_qps, call_ms, kernel_ms}}."""
    device = args.devices.split(",")[0]
    on_gpu = device != "cpu"
    corpus = build_corpus(docs, args.ld, args.dim, int(device) if on_gpu else "cpu", args.seed)
    out = timed_calls(corpus, workloads, qs, cand, args.duration, on_gpu)
    del corpus
    if on_gpu:
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    return out


def timed_calls(corpus, workloads, qs, cand, duration: float, on_gpu: bool) -> dict:
    import statistics

    def calls(q, c):
        return {"search": lambda j: corpus.search(q[j % len(q)], K),
                "rerank": lambda j: corpus.rerank(q[j % len(q)], c[j % len(c)])}

    host, out = calls(qs, cand), {}
    for w in workloads:
        fn = host[w]
        for j in range(3):
            fn(j)
        times, t_end, j = [], time.perf_counter() + duration, 0
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn(j)
            times.append(time.perf_counter() - t0)
            j += 1
        out[w] = {"inprocess_qps": len(times) / sum(times), "call_ms": 1e3 * statistics.median(times),
                  "kernel_ms": 1e3 * statistics.median(times)}
    if on_gpu:
        import cupy

        on_device = calls(cupy.asarray(qs), cupy.asarray(np.stack(cand)) if cand else None)
        for w in workloads:
            out[w]["kernel_ms"] = gpu_ms(on_device[w])
    return out


_SPIN = r'''extern "C" __global__ void lik_bench_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}'''


def gpu_ms(fn, reps: int = 20) -> float:
    """Median GPU time of ``fn(j)`` (device queries): each call queued behind a spin kernel of about
    10 ms, so the host's time to queue it is hidden where the call does not wait on the device."""
    import statistics

    import cupy

    spin = cupy.RawKernel(_SPIN, "lik_bench_spin")
    fn(0)
    times = []
    for j in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        spin((1,), (1,), (np.int64(20_000_000),))
        a.record()
        fn(j)
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def measure(args, pool, server: Server, workload: str, payloads) -> dict:
    closed = []
    for c in args.clients:
        before = server.metrics()
        qps, p50, p99, errors = run_load(pool, args.procs, server.port, payloads, c, args.duration, None)
        closed.append({"clients": c, "qps": qps, "p50_ms": p50, "p99_ms": p99, "errors": errors,
                       **batch_histogram(before, server.metrics())})
        print(f"    closed {c:>4} clients: {qps:9.1f} QPS  p50 {p50:8.3f} ms  p99 {p99:8.3f} ms  "
              f"mean batch {closed[-1]['mean_batch'] or 0:.1f}  errors {errors}", flush=True)
    best = max(r["qps"] for r in closed)
    target = P99_TARGET_MS[workload]
    opened, sustained = [], 0.0
    for f in args.open_fractions:
        rate = f * best
        qps, p50, p99, errors = run_load(pool, args.procs, server.port, payloads, max(args.clients), args.duration,
                                         rate)
        ok = qps >= 0.97 * rate and p99 <= target and not errors
        opened.append({"offered_qps": rate, "qps": qps, "p50_ms": p50, "p99_ms": p99, "errors": errors,
                       "sustained": ok})
        if ok:
            sustained = max(sustained, rate)
        print(f"    open   {rate:9.1f} offered: {qps:9.1f} QPS  p50 {p50:8.3f} ms  p99 {p99:8.3f} ms  "
              f"{'ok' if ok else 'over target'}", flush=True)
    return {"closed": closed, "open": opened, "p99_target_ms": target, "sustained_qps": sustained,
            "low_load_p50_ms": closed[0]["p50_ms"] if closed[0]["clients"] == 1 else None}


def run(args) -> dict:
    from bench.lib.results import out_dir, slugify, write_json

    gpu = "cpu"
    if args.devices.split(",")[0] != "cpu":
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(int(args.devices.split(",")[0]))["name"]
        gpu = name.decode() if isinstance(name, bytes) else str(name)
    res = {"suite": "serve", "gpu": gpu, "args": vars(args), "dim": args.dim, "lq": args.lq, "ld": args.ld,
           "workloads": []}
    path = out_dir(args.out) / f"serve_{slugify(gpu)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    qs = queries(64, args.lq, args.dim, args.seed + 1)
    rng = np.random.default_rng(args.seed + 2)
    pool = ProcessPoolExecutor(args.procs, mp_context=get_context("spawn"))
    try:
        for n, docs in enumerate(args.docs):
            workloads = ["search"] + (["rerank"] if n == 0 else [])
            cand = [rng.choice(docs, min(args.rerank_ids, docs), replace=False) for _ in qs] if n == 0 else []
            payloads = {"search": [request_bytes("search", q) for q in qs],
                        "rerank": [request_bytes("rerank", q, c) for q, c in zip(qs, cand)]}
            print(f"{docs} documents: in process", flush=True)
            local = in_process(args, docs, workloads, qs, cand)
            rows = {w: {"workload": w, "docs": docs, "k": K if w == "search" else None,
                        "ids": args.rerank_ids if w == "rerank" else None, **local[w], "servers": {}}
                    for w in workloads}
            for label, max_batch in (("batched", args.max_batch), ("unbatched", 1)):
                print(f"{docs} documents: {label} server (--max-batch {max_batch})", flush=True)
                server = Server(args, docs, max_batch)
                try:
                    for w in workloads:
                        print(f"  {w}", flush=True)
                        rows[w]["servers"][label] = measure(args, pool, server, w, payloads[w])
                finally:
                    server.stop()
            for w, row in rows.items():
                b, u = row["servers"]["batched"], row["servers"]["unbatched"]
                row["sustained_over_unbatched"] = \
                    b["sustained_qps"] / u["sustained_qps"] if u["sustained_qps"] else None
                if b["low_load_p50_ms"] is not None:
                    row["p50_over_kernel"] = b["low_load_p50_ms"] / row["kernel_ms"]
                    row["p50_minus_call_ms"] = b["low_load_p50_ms"] - row["call_ms"]
                res["workloads"].append(row)
                write_json(path, res)
    finally:
        pool.shutdown()
    print(f"wrote {path}", flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output directory (default $OUT, else bench/results)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: check the harness")
    ap.add_argument("--docs", type=int, nargs="+", help="corpus sizes (default 100000 1000000; --smoke: 300)")
    ap.add_argument("--ld", type=int, default=LD)
    ap.add_argument("--dim", type=int, default=DIM)
    ap.add_argument("--lq", type=int, default=LQ)
    ap.add_argument("--rerank-ids", type=int, default=1000)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--open-fractions", type=float, nargs="+", default=list(OPEN_FRACTIONS))
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per load point")
    ap.add_argument("--devices", default="0", help="the server's workers: GPU indices or cpu (0,0: two on GPU 0)")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-delay-us", type=int, default=0)
    ap.add_argument("--max-queue", type=int, default=4096)
    ap.add_argument("--processes", type=int, default=1, help="server processes (lik serve --processes)")
    ap.add_argument("--partition", action="store_true",
                    help="split the corpus over the distinct --devices, one worker over all parts (lik serve --partition)")
    ap.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                    help="load-generator processes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--role", choices=("driver", "server"), default="driver", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.docs, args.ld, args.dim, args.rerank_ids = args.docs or [300], 12, 32, 50
        args.clients, args.open_fractions, args.duration, args.procs = [1, 4], [0.5], 0.3, 1
        args.devices = "cpu,cpu" if args.partition else "cpu"
    args.docs = args.docs or [100_000, 1_000_000]
    if args.role == "server":
        serve_synthetic(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
