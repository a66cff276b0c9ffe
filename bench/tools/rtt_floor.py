"""The floor under issue 45's low-load target: what one tritonclient request costs over loopback
beyond the server's own work, when that work takes ``D`` ms, against a server that does nothing
else.

A bare asyncio server in a process of its own reads each request (HTTP/1.1, its body by
Content-Length) and answers a search's response (SCORES [1, 10] float32 and IDS [1, 10] int64 in
the binary tensor extension, as ``lik serve`` writes it) after ``D`` ms of work, done one of two
ways, as ``lik serve`` does its own:

- ``spin``: the event loop's thread busy for ``D`` (a request scored inline, whose thread spins in
  the CUDA stream's synchronize);
- ``thread``: a worker thread (one, waiting on a queue) sleeps ``D`` and hands the answer back with ``call_soon_threadsafe``
  (the worker's path, the event loop idle meanwhile).

One tritonclient.http client (binary tensors, a 32 x 128 float16 query and K, as
``bench_serve.py`` sends) times ``--requests`` requests per (mode, D); the excess is end to end
less ``D``. If the excess grows with ``D``, the difference is paid while the client and server wait
(their threads' wake-ups after an idle), not by any server's code.

    python3 bench/tools/rtt_floor.py --delays-ms 0 0.2 1.2 10 --json OUT.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib
from bench.lib.results import write_json  # noqa: E402


def _response() -> bytes:
    scores, ids = np.arange(10, dtype=np.float32)[None], np.arange(10, dtype=np.int64)[None]
    head = json.dumps({"model_name": "search", "model_version": "1", "outputs": [
        {"name": "SCORES", "datatype": "FP32", "shape": [1, 10], "parameters": {"binary_data_size": 40}},
        {"name": "IDS", "datatype": "INT64", "shape": [1, 10], "parameters": {"binary_data_size": 80}}]},
        separators=(",", ":")).encode()
    body = head + scores.tobytes() + ids.tobytes()
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
            b"inference-header-content-length: %d\r\ncontent-length: %d\r\n\r\n" % (len(head), len(body))) + body


class _Bare(asyncio.Protocol):
    """HTTP/1.1 requests in, one canned answer each after the work (``mode``, ``delay_s``)."""

    mode, delay_s, answer = "spin", 0.0, _response()

    def connection_made(self, transport):
        self.transport, self.buf, self.need = transport, b"", None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                length = 0
                for line in self.buf[:end].split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.need, self.buf = length, self.buf[end + 4:]
            if len(self.buf) < self.need:
                return
            self.buf, self.need = self.buf[self.need:], None
            self._work()

    def _work(self) -> None:
        if self.mode == "spin":
            until = time.perf_counter() + self.delay_s
            while time.perf_counter() < until:
                pass
            self.transport.write(self.answer)
            return
        _worker().put((asyncio.get_running_loop(), self.transport))


_jobs = None


def _worker() -> queue.SimpleQueue:
    """The one worker thread's queue (started on first use): each job sleeps ``_Bare.delay_s``, then
    hands the answer to the event loop."""
    global _jobs
    if _jobs is None:
        _jobs = queue.SimpleQueue()

        def run():
            while True:
                loop, transport = _jobs.get()
                time.sleep(_Bare.delay_s)
                loop.call_soon_threadsafe(transport.write, _Bare.answer)

        threading.Thread(target=run, daemon=True).start()
    return _jobs


def serve(mode: str, delay_s: float) -> None:
    """The server role: listen on an ephemeral loopback port, print it, serve until killed."""
    _Bare.mode, _Bare.delay_s = mode, delay_s

    async def main():
        server = await asyncio.get_running_loop().create_server(_Bare, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await server.serve_forever()

    asyncio.run(main())


def timed(port: int, n: int, warm: int) -> list[float]:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(f"127.0.0.1:{port}", concurrency=1)
    q = triton.InferInput("Q", [32, 128], "FP16")
    q.set_data_from_numpy(np.zeros((32, 128), np.float16), binary_data=True)
    k = triton.InferInput("K", [1], "INT32")
    k.set_data_from_numpy(np.array([10], np.int32), binary_data=True)
    outputs = [triton.InferRequestedOutput(name, binary_data=True) for name in ("SCORES", "IDS")]
    times = []
    for j in range(warm + n):
        t0 = time.perf_counter()
        r = client.infer("search", [q, k], outputs=outputs)
        t1 = time.perf_counter()
        assert r.as_numpy("IDS").shape == (1, 10)
        if j >= warm:
            times.append(t1 - t0)
    client.close()
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 0.2, 1.2, 10.0])
    ap.add_argument("--modes", nargs="+", default=["spin", "thread"], choices=["spin", "thread"])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--warm", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="each (mode, delay) this many times, in rotation")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--role", choices=("driver", "server"), default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="spin", help=argparse.SUPPRESS)
    ap.add_argument("--delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "server":
        serve(args.mode, args.delay_s)
        return {}
    cells = [(m, d) for m in args.modes for d in args.delays_ms]
    samples = {c: [] for c in cells}
    for rnd in range(args.rounds):
        for mode, delay in (cells if rnd % 2 == 0 else cells[::-1]):
            proc = subprocess.Popen([sys.executable, __file__, "--role", "server", "--mode", mode, "--delay-s",
                                     str(delay * 1e-3)], stdout=subprocess.PIPE, text=True)
            try:
                port = int(proc.stdout.readline())
                samples[(mode, delay)] += timed(port, args.requests, args.warm)
            finally:
                proc.kill()
                proc.wait()
    rows = []
    for mode, delay in cells:
        e2e = [1e3 * t for t in samples[(mode, delay)]]
        row = {"mode": mode, "delay_ms": delay, "e2e_p50_ms": statistics.median(e2e),
               "excess_p50_ms": statistics.median(e2e) - delay, "excess_p10_ms": np.percentile(e2e, 10) - delay,
               "excess_p90_ms": np.percentile(e2e, 90) - delay, "n": len(e2e)}
        rows.append(row)
        print(f"{mode:6s} D {delay:6.2f} ms: end to end p50 {row['e2e_p50_ms']:.3f} ms, excess p50 "
              f"{row['excess_p50_ms']:.3f} (p10 {row['excess_p10_ms']:.3f}, p90 {row['excess_p90_ms']:.3f})",
              flush=True)
    out = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
