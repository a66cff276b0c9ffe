"""``lik serve --processes N``: N server processes, started and stopped together.

One process's Python (HTTP parsing, the protocol's checks, the hand-over to its batcher's worker
and back, under one GIL) answers about 2,000 requests a second on an H200 host, whatever the GPU
has left. :func:`serve_processes` starts N spawned children, each running the whole server that
``lik_cupy.serving.http.run_processes`` hands it (on sockets of its own bound with SO_REUSEPORT to
the ports the parent reserved, so the kernel spreads connections evenly over them; a shared
listening socket hands most of them to whichever process waits last), with a batcher, and so
replicas, of its own; replicas over several GPUs are dealt out, each process keeping one GPU's
(:func:`process_share`). Readiness waits for all of them (a shared count); metrics are summed through
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


def process_share(devices: list, i: int, n: int) -> list:
    """The replicas' ``devices`` entries that server process ``i`` of ``n`` keeps: over k >= 2 GPUs
    with ``n`` a multiple of k, those of the ``i mod k``-th GPU (its "cpu" entries dropped), so that each
    GPU serves n / k processes and each process batches all its requests in one queue; else all."""
    gpus = list(dict.fromkeys(d for d in devices if d != "cpu"))
    if len(gpus) < 2 or n % len(gpus):
        return list(devices)
    return [d for d in devices if d == gpus[i % len(gpus)]]


def serve_processes(children: list, announce) -> None:
    """Run each ``child(peers)`` of ``children`` in a spawned process of its own until SIGINT or
    SIGTERM (then each is sent SIGTERM, and drains) or until one of them ends. Each child must
    pickle; ``peers`` is (a shared count of the processes that are ready, how many there are).
    ``announce()`` runs once they are started. LikError when a process ended with an error."""
    from ..errors import LikError

    ctx = multiprocessing.get_context("spawn")
    processes = len(children)
    ready = ctx.Value("i", 0)
    metrics_dir = tempfile.mkdtemp(prefix="lik-serve-metrics-")
    before_env = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the children read it as they import prometheus_client
    stopping = []
    stops = (signal.SIGINT, signal.SIGTERM)
    before = [signal.signal(s, lambda *_: stopping.append(True)) for s in stops]
    procs = []
    try:
        for i, child in enumerate(children):
            procs.append(ctx.Process(target=_run, args=(child, (ready, processes)), name=f"lik-serve-{i}"))
            procs[-1].start()
        announce()
        while not stopping and all(c.is_alive() for c in procs):
            wait([c.sentinel for c in procs], timeout=0.2)
        for c in procs:
            if c.is_alive():
                os.kill(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for c in procs:
            c.join(max(0.0, deadline - time.monotonic()))
            if c.is_alive():
                c.kill()
                c.join()
    finally:
        for c in procs:
            if c.is_alive():
                c.kill()
        for s, h in zip(stops, before):
            signal.signal(s, h)
        if before_env is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = before_env
        shutil.rmtree(metrics_dir, ignore_errors=True)
    # Stopping, a child that the signal ended before it could handle it (still starting) did not fail.
    stopped = (-signal.SIGINT, -signal.SIGTERM) if stopping else ()
    failed = [c for c in procs if c.exitcode and c.exitcode not in stopped]
    if failed and not stopping:
        raise LikError("lik serve", f"server process {failed[0].name} stopped (exit code {failed[0].exitcode}); "
                       f"the others were stopped with it")
    if failed:
        raise LikError("lik serve", f"server process {failed[0].name} ended with exit code {failed[0].exitcode}")


def _run(child, peers) -> None:
    """A spawned process: ``child(peers)``; a LikError (the corpus did not load, a port was taken) is
    printed and ends it with exit code 1."""
    from ..errors import LikError

    try:
        child(peers)
    except LikError as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(1)
