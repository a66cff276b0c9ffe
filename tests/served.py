"""``lik serve`` as a real process on a loopback port, for the serving tests."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lik_command import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]


def random_shard(path, seed: int, count: int, dim: int, ids=None) -> Path:
    """A shard at ``path`` of ``count`` float32 documents of 1-19 random tokens of ``dim`` (generator
    ``seed``), with ``ids`` if given: the corpus the serving tests put behind their servers."""
    rng = np.random.default_rng(seed)
    docs = [rng.standard_normal((int(n), dim)).astype(np.float32) for n in rng.integers(1, 20, count)]
    from lik_cupy import shards

    shards.pack_arrays(docs, path, ids=ids)
    return path


class Server:
    """``lik serve ARGS`` on an ephemeral loopback port (``port``; ``grpc_port`` too when ARGS hold
    ``--grpc-port 0``), ready when constructed; its stderr kept (``stop`` returns it). ``script``:
    run ``python SCRIPT ARGS`` instead (a server of the test's own: ``tests/slow_served.py``);
    ``env``: variables set for it on top of this process's environment."""

    def __init__(self, *args, script=None, env=None):
        for m in ("starlette", "uvicorn", "prometheus_client"):  # the [serve] extra
            pytest.importorskip(m)
        env = {**os.environ, **(env or {}), "PYTHONPATH": child_pythonpath()}
        command = ["-m", "lik_cupy", "serve"] if script is None else [str(script)]
        self.proc = subprocess.Popen([sys.executable, *command, *map(str, args), "--port", "0"],
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.lines, self.port, self.grpc_port = [], None, None
        listening = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"listening on (http|grpc)://127\.0\.0\.1:(\d+)", line)
                if m and m.group(1) == "grpc":
                    self.grpc_port = int(m.group(2))
                elif m:
                    self.port = int(m.group(2))
                    listening.set()

        threading.Thread(target=drain, daemon=True).start()
        try:
            assert listening.wait(60), f"lik serve did not start: {''.join(self.lines)}"
            for _ in range(600):
                try:
                    if self.get("/v2/health/ready")[0] == 200:
                        return
                except ConnectionRefusedError:  # bound, not yet listening
                    pass
                time.sleep(0.1)
            raise AssertionError(f"lik serve did not turn ready: {''.join(self.lines)}")
        except BaseException:
            self.proc.kill()  # no server outlives a failed start
            self.proc.wait(60)
            raise

    def request(self, method, path, body=None, headers=None, timeout=60):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def get(self, path):
        return self.request("GET", path)

    def infer(self, model, payload, headers=None):
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return self.request("POST", f"/v2/models/{model}/infer", body, headers)

    def metric(self, name, **labels):
        """The value of the sample ``name{labels}`` on /metrics; 0.0 before it has one."""
        want = {f'{k}="{v}"' for k, v in labels.items()}
        for line in self.get("/metrics")[2].decode().splitlines():
            sample, _, value = line.rpartition(" ")
            got, _, rest = sample.partition("{")
            if got == name and set(rest.rstrip("}").split(",")) == want:
                return float(value)
        return 0.0

    def wait_metric(self, name, value, timeout=5.0, **labels):
        """Wait until :meth:`metric` reads ``value``; AssertionError after ``timeout`` seconds."""
        until = time.monotonic() + timeout
        while (got := self.metric(name, **labels)) != value:
            assert time.monotonic() < until, f"{name}{labels} is {got} after {timeout} s, expected {value}"
            time.sleep(0.01)

    def wait_line(self, text, timeout=30.0):
        """Wait until a line of the server's stderr holds ``text``; AssertionError after ``timeout`` seconds."""
        until = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert time.monotonic() < until, f"no line with {text!r}: {''.join(self.lines)}"
            time.sleep(0.01)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        return "".join(self.lines)
