"""One client against real ``lik serve`` servers of one or more source trees, in alternating rounds:
where a search's time goes at low load, beside the in-process call (issue 45: "at low load, the
end-to-end p50 is at most the in-process call time plus 300 us").

Each tree's server is ``bench/suites/bench_serve.py``'s server role (``make_app`` and ``run`` on a
loopback port, over a synthetic corpus of ``--docs`` documents of ``--ld`` unit float16 tokens, d =
``--dim``, built from one seed), all running throughout. A round sends ``--requests`` searches (top
``--k``, one ``--lq``-token float16 query each, after ``--warm`` unmeasured ones) from one
tritonclient.http client with binary tensors to each server in turn, in an order that alternates by
round, and times as many in-process ``Corpus.search`` calls of the same queries on the same corpus
in a thread (the server calls it in its worker thread), before and after the servers' turns. Per
round and tree: the p50 of end to end, its excess over the in-process call's p50, and the p50s of
the server's ``queue_us`` and ``compute_us`` and of what is left (end to end less both: HTTP, the
clients, the hand-back to the event loop). Then each tree's medians over the rounds, and each
tree's paired differences from the first tree's, round by round: a host whose latencies drift by
0.1 ms between rounds still shows a difference of 0.01 ms between trees.

On the CPU path every request goes through the worker thread (host replicas are never scored
inline), so a small corpus (the default: 20 documents of 12 tokens, a call of about 0.4 ms) shows
the queued path's overhead. Needs tritonclient[http]. From the repository root:

    python3 bench/tools/serve_low_load.py --trees /path/to/before . --rounds 30 --requests 800
    python3 bench/tools/serve_low_load.py --devices 0 --docs 100000 --ld 180   # a GPU

``--blas-threads`` (default 1) sets ``OPENBLAS_NUM_THREADS`` for the servers and this process: a
second BLAS thread spinning after each small GEMM took the core another thread wanted.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def _bench_serve(tree: Path):
    spec = importlib.util.spec_from_file_location("bench_serve", tree / "bench" / "suites" / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Server:
    """``tree``'s bench_serve.py server role on an ephemeral loopback port (``env``: added to its
    environment), and a tritonclient.http client of it."""

    def __init__(self, tree: Path, args, env: dict):
        import tritonclient.http as triton

        cmd = [sys.executable, str(tree / "bench" / "suites" / "bench_serve.py"), "--role", "server", "--docs",
               str(args.docs), "--ld", str(args.ld), "--dim", str(args.dim), "--devices", args.devices,
               "--max-batch", "64", "--max-delay-us", "0", "--max-queue", "4096", "--seed", str(args.seed)]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=tree, env={**os.environ, **env})
        self.lines, port, bound = [], [], threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    port.append(int(m.group(1)))
                    bound.set()

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + 1800
        while not bound.wait(0.2):
            self._check(deadline)
        self.client = triton.InferenceServerClient(f"127.0.0.1:{port[0]}", concurrency=1)
        while not self._ready():
            self._check(deadline)
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return self.client.is_server_ready()
        except Exception:  # noqa: BLE001 - not listening yet
            return False

    def _check(self, deadline: float) -> None:
        if self.proc.poll() is not None or time.monotonic() > deadline:
            self.proc.kill()
            raise SystemExit(f"the server did not turn ready:\n{''.join(self.lines)}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(300)


def served(server: Server, requests: list, outputs: list, n: int, warm: int) -> dict:
    """p50s in ms of ``n`` searches back to back: end to end, the server's queue and compute times,
    and end to end less both."""
    e2e, queue, compute = [], [], []
    for j in range(warm + n):
        t0 = time.perf_counter()
        r = server.client.infer("search", requests[j % len(requests)], outputs=outputs)
        t1 = time.perf_counter()
        if j >= warm:
            p = r.get_response()["parameters"]
            e2e.append(t1 - t0)
            queue.append(p["queue_us"] * 1e-6)
            compute.append(p["compute_us"] * 1e-6)
    rest = [a - b - c for a, b, c in zip(e2e, queue, compute)]
    return {name: 1e3 * statistics.median(x) for name, x in
            (("e2e_ms", e2e), ("queue_ms", queue), ("compute_ms", compute), ("rest_ms", rest))}


def in_process(corpus, qs, k: int, n: int, warm: int, gap_s: float = 0.0) -> float:
    """p50 in ms of ``n`` calls ``corpus.search(q, k)`` in a thread of their own, back to back or, with
    ``gap_s``, each after that long idle (as a served call finds the GPU after a client's round trip)."""
    times = []

    def run():
        for j in range(warm + n):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            corpus.search(qs[j % len(qs)], k)
            times.append(time.perf_counter() - t0)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return 1e3 * statistics.median(times[warm:])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", type=Path, default=[ROOT],
                    help="source trees whose servers to compare (default: this one); the first is the baseline, "
                         "and its bench_serve.py and lik_cupy build the in-process corpus")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--ld", type=int, default=12)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--lq", type=int, default=32)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--devices", default="cpu", help="the servers' --devices, and the in-process corpus's first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=800, help="measured requests a tree a round, and in-process calls")
    ap.add_argument("--warm", type=int, default=100, help="unmeasured requests before each")
    ap.add_argument("--blas-threads", default="1", help="OPENBLAS_NUM_THREADS and OMP_NUM_THREADS ('': as set)")
    ap.add_argument("--env", nargs="*", default=[], metavar="I:NAME=VALUE",
                    help="an environment variable for the server of tree I alone")
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="also time in-process calls each after this long idle (call_gap_ms, over_gap_ms)")
    ap.add_argument("--json", type=Path, help="write every round's numbers there")
    args = ap.parse_args(argv)
    if args.blas_threads:
        os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = args.blas_threads
    import tritonclient.http as triton

    trees = [t.resolve() for t in args.trees]
    envs = [{} for _ in trees]
    for e in args.env:
        i, _, assignment = e.partition(":")
        name, _, value = assignment.partition("=")
        envs[int(i)][name] = value
    sys.path.insert(0, str(trees[0]))  # (its lik_cupy for the in-process corpus)
    bench_serve = _bench_serve(trees[0])
    qs = bench_serve.queries(64, args.lq, args.dim, args.seed + 1)
    requests = []
    for q in qs:
        Q = triton.InferInput("Q", list(q.shape), "FP16")
        Q.set_data_from_numpy(q, binary_data=True)
        K = triton.InferInput("K", [1], "INT32")
        K.set_data_from_numpy(np.array([args.k], np.int32), binary_data=True)
        requests.append([Q, K])
    outputs = [triton.InferRequestedOutput(n, binary_data=True) for n in ("SCORES", "IDS")]
    device = args.devices.split(",")[0]
    corpus = bench_serve.build_corpus(args.docs, args.ld, args.dim, device if device == "cpu" else int(device),
                                      args.seed)
    names = [f"{i}:{t.name}" for i, t in enumerate(trees)]
    servers = []
    rows = {n: [] for n in names}
    try:
        for t, env in zip(trees, envs):
            servers.append(Server(t, args, env))
        for s, name in zip(servers, names):  # each answers as the in-process call, bitwise
            r = s.client.infer("search", requests[0], outputs=outputs)
            scores, ids = corpus.search(qs[0], args.k)
            if not (np.array_equal(r.as_numpy("SCORES"), scores) and np.array_equal(r.as_numpy("IDS"), ids)):
                raise SystemExit(f"{name}'s search differs from the in-process call")
        for rnd in range(args.rounds):
            call = in_process(corpus, qs, args.k, args.requests, args.warm)
            got = {}
            for i in (range(len(servers)) if rnd % 2 == 0 else reversed(range(len(servers)))):
                got[i] = served(servers[i], requests, outputs, args.requests, args.warm)
            call = (call + in_process(corpus, qs, args.k, args.requests, args.warm)) / 2
            gap = {}
            if args.gap_us:
                gap["call_gap_ms"] = in_process(corpus, qs, args.k, args.requests, args.warm, args.gap_us * 1e-6)
            for i, name in enumerate(names):
                if gap:
                    gap["over_gap_ms"] = got[i]["e2e_ms"] - gap["call_gap_ms"]
                rows[name].append({"call_ms": call, "over_ms": got[i]["e2e_ms"] - call, **gap, **got[i]})
            print(f"round {rnd}: in-process {call:.3f} ms; " + "; ".join(
                f"{n} e2e {rows[n][-1]['e2e_ms']:.3f} over {rows[n][-1]['over_ms']:.3f} (queue "
                f"{rows[n][-1]['queue_ms']:.3f}, compute {rows[n][-1]['compute_ms']:.3f}, rest "
                f"{rows[n][-1]['rest_ms']:.3f})" for n in names), flush=True)
    finally:
        for s in servers:
            s.stop()
    keys = ("e2e_ms", "call_ms", "over_ms", "queue_ms", "compute_ms", "rest_ms") \
        + (("call_gap_ms", "over_gap_ms") if args.gap_us else ())
    medians = {n: {k: statistics.median(r[k] for r in rows[n]) for k in keys} for n in names}
    for n in names:
        print(f"{n}: medians over {args.rounds} rounds: " + ", ".join(f"{k} {v:.3f}" for k, v in medians[n].items()))
    paired = {}
    for n in names[1:]:
        paired[n] = {}
        for k in ("over_ms", "queue_ms", "compute_ms", "rest_ms"):
            d = sorted(b[k] - a[k] for a, b in zip(rows[names[0]], rows[n]))
            paired[n][k] = {"median": statistics.median(d), "min": d[0], "max": d[-1],
                            "rounds_lower": sum(x < 0 for x in d)}
            print(f"{n} - {names[0]}: {k} {statistics.median(d):+.3f} (rounds {d[0]:+.3f} .. {d[-1]:+.3f}; "
                  f"lower in {sum(x < 0 for x in d)} of {len(d)})")
    out = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "trees"},
           "trees": [str(t) for t in trees], "rounds": rows, "medians": medians, "paired": paired}
    if args.json:
        sys.path.insert(0, str(ROOT))  # (bench.lib: the JSON with the sources' provenance, as every bench script writes)
        from bench.lib.results import write_json

        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
