"""``lik serve --processes N``: N server processes on one port.

One process's Python (HTTP parsing, the protocol's checks, the hand-over to its batcher's worker
and back, under one GIL) answers about 2,000 requests a second on an H200 host, whatever the GPU
has left. The parent reserves the port (a socket bound with SO_REUSEPORT that never listens) and
starts N spawned children. Each listens on a socket of its own bound there too, so the kernel
spreads connections evenly over them (a shared listening socket hands most of them to whichever
process waits last), and runs the whole server (:func:`lik_cupy.serving.http.make_app`'s
application) with a batcher, and so replicas, of its own. gRPC (``--grpc-port``) shares its port
the same way. Readiness waits for all of them (a shared count); metrics are summed through
prometheus-client's multiprocess mode, in a directory the parent makes and removes. SIGINT or
SIGTERM reaches every child, and each drains its accepted requests; a child that dies stops the
rest, and the parent raises.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.connection import wait

_GRACE_S = 300.0  # how long a stopping child may take to drain before it is killed


def serve_processes(load, processes: int, host: str, port: int, grpc_port: int | None = None) -> None:
    from ..errors import LikError
    from .http import _announce, _grpc_address, _listening

    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be an integer >= 1, got {processes!r}")
    sock = _listening(host, port, reuse_port=True)
    try:
        grpc_sock = None if grpc_port is None else _listening(host, grpc_port, reuse_port=True)
    except LikError:
        sock.close()
        raise
    grpc_address = None if grpc_sock is None else _grpc_address(host, grpc_sock.getsockname()[1])
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Value("i", 0)
    metrics_dir = tempfile.mkdtemp(prefix="lik-serve-metrics-")
    before_env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the children read it as they import prometheus_client
    stopping = []
    stops = (signal.SIGINT, signal.SIGTERM)
    before = [signal.signal(s, lambda *_: stopping.append(True)) for s in stops]
    children = []
    try:
        for i in range(processes):
            children.append(ctx.Process(target=_child, args=(load, host, sock.getsockname()[1], grpc_address,
                                                              (ready, processes)), name=f"lik-serve-{i}"))
            children[-1].start()
        _announce(sock)
        if grpc_address is not None:
            print(f"lik serve: listening on grpc://{grpc_address}", file=sys.stderr, flush=True)
        while not stopping and all(c.is_alive() for c in children):
            wait([c.sentinel for c in children], timeout=0.2)
        for c in children:
            if c.is_alive():
                os.kill(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for c in children:
            c.join(max(0.0, deadline - time.monotonic()))
            if c.is_alive():
                c.kill()
                c.join()
    finally:
        for c in children:
            if c.is_alive():
                c.kill()
        sock.close()
        if grpc_sock is not None:
            grpc_sock.close()
        for s, h in zip(stops, before):
            signal.signal(s, h)
        if before_env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = before_env
        shutil.rmtree(metrics_dir, ignore_errors=True)
    failed = [c for c in children if c.exitcode]
    if failed and not stopping:
        raise LikError("lik serve", f"server process {failed[0].name} stopped (exit code {failed[0].exitcode}); "
                       f"the others were stopped with it")
    if failed:
        raise LikError("lik serve", f"server process {failed[0].name} ended with exit code {failed[0].exitcode}")


def _child(load, host: str, port: int, grpc_address: str | None, peers) -> None:
    """One server process (spawned): the whole server on a socket of its own at ``host:port``, and
    gRPC at ``grpc_address`` when given."""
    from ..errors import LikError
    from ._service import MAX_BODY
    from .http import _application, _listening, _serve_on

    try:
        _serve_on(_application(load, MAX_BODY, grpc_address, peers), _listening(host, port, reuse_port=True))
    except LikError as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(1)
