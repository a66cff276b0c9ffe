"""Probe: where a served search's host time goes, against a rerank's, at one client (cProfile of the
server's main thread, which runs the event loop and the inline calls). One server per operation."""
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import pstats
import io

import numpy as np
import tritonclient.http as triton

OUT = os.environ.get("OUT", "/tmp")
N, WARM = int(os.environ.get("N", "1500")), 200


def start(tag, profile):
    cmd = [sys.executable] + (["-m", "cProfile", "-o", f"{OUT}/prof_{tag}.out"] if profile else []) + [
        "bench/suites/bench_serve.py", "--role", "server", "--docs", os.environ.get("DOCS", "100000"), "--ld", "180", "--dim", "128",
        "--devices", os.environ.get("DEV", "0"), "--max-batch", "64", "--max-delay-us", "0", "--max-queue", "4096", "--seed", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    port, ev = [], threading.Event()

    def drain():
        for line in proc.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                ev.set()
    threading.Thread(target=drain, daemon=True).start()
    assert ev.wait(600)
    c = triton.InferenceServerClient(f"127.0.0.1:{port[0]}", concurrency=1)
    while True:
        try:
            if c.is_server_ready():
                break
        except Exception:
            pass
        time.sleep(0.2)
    return proc, c


def run(c, op):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((32, 128)).astype(np.float32)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float16)
    Q = triton.InferInput("Q", [32, 128], "FP16")
    Q.set_data_from_numpy(q, binary_data=True)
    if op == "search":
        A = triton.InferInput("K", [1], "INT32")
        A.set_data_from_numpy(np.array([10], np.int32), binary_data=True)
        outs = [triton.InferRequestedOutput(n, binary_data=True) for n in ("SCORES", "IDS")]
    else:
        A = triton.InferInput("IDS", [int(os.environ.get("K", "1000"))], "INT64")
        A.set_data_from_numpy(rng.choice(int(os.environ.get("DOCS", "100000")), int(os.environ.get("K", "1000")), replace=False).astype(np.int64), binary_data=True)
        outs = [triton.InferRequestedOutput("SCORES", binary_data=True)]
    e2e, qu, co = [], [], []
    for j in range(WARM + N):
        t0 = time.perf_counter()
        r = c.infer(op, [Q, A], outputs=outs)
        t1 = time.perf_counter()
        if j >= WARM:
            p = r.get_response()["parameters"]
            e2e.append(t1 - t0)
            qu.append(p["queue_us"] * 1e-6)
            co.append(p["compute_us"] * 1e-6)
    m = lambda x: 1e3 * statistics.median(x)  # noqa: E731
    return m(e2e), m(qu), m(co), m([a - b - d for a, b, d in zip(e2e, qu, co)])


for profile in (False, True):
    for op in ("search", "rerank"):
        proc, c = start(op, profile)
        e2e, qu, co, rest = run(c, op)
        print(f"{'profiled ' if profile else ''}{op}: e2e {e2e:.3f} queue {qu:.3f} compute {co:.3f} rest {rest:.3f}",
              flush=True)
        c.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
for op in ("search", "rerank"):
    s = io.StringIO()
    st = pstats.Stats(f"{OUT}/prof_{op}.out", stream=s)
    st.sort_stats("tottime").print_stats(45)
    open(f"{OUT}/prof_{op}_tottime.txt", "w").write(s.getvalue())
    s = io.StringIO()
    st = pstats.Stats(f"{OUT}/prof_{op}.out", stream=s)
    st.sort_stats("cumulative").print_stats(70)
    open(f"{OUT}/prof_{op}_cum.txt", "w").write(s.getvalue())
    os.remove(f"{OUT}/prof_{op}.out")
print("done")
