"""A :class:`lik_cupy.serving.Batcher` behind the Open Inference Protocol (KServe v2) over HTTP:
starlette on uvicorn, metrics by prometheus-client (the ``[serve]`` extra). ``lik serve`` runs it.

Endpoints: ``GET /v2/health/live``, ``GET /v2/health/ready`` (200 once the corpus is resident and
its kernels warm, else 503), ``GET /v2``, and per model (also under ``/versions/1``):
``GET /v2/models/{model}`` (metadata), ``.../ready``, ``.../config`` and ``.../stats`` (Triton's model
configuration and statistics extensions, which perf_analyzer reads), ``POST .../infer`` (JSON, or
the binary tensor extension: ``lik_cupy/serving/_tensors.py``); ``GET /metrics`` (Prometheus). Models:

- ``search``: inputs ``Q`` ([Lq, d] or [Nq, Lq, d], the corpus's datatype) and ``K`` (INT32 or
  INT64, one value); outputs ``SCORES`` (FP32) and ``IDS`` (the shards' ids: INT64, or BYTES for
  string ids), [k] or [Nq, k].
- ``rerank``: inputs ``Q`` and ``IDS`` ([K] or [Nq, K] external ids); output ``SCORES``.
- ``score``: input ``Q``; output ``SCORES`` ([Nd] or [Nq, Nd]).

Request parameters: ``timeout`` (microseconds the request may wait in the queue, as tritonclient's
``timeout=`` sends it), ``precision`` ("fp32" or "tf32"). Response parameters: ``queue_us``,
``compute_us`` (its batched corpus call) and ``batch_queries`` (that call's queries). Answers: 400
for a bad request (the message names the problem), 404 for an unknown model, a version other than
1 or a path none of these have, 405 for a method its path does not take, 408 for headers or a body
that came too slowly (``header_timeout``, ``body_timeout``, ``body_min_rate``; the connection then
closes), 413 for a body over ``max_body_bytes`` (decompressed too) or one whose reading or outputs
would take more memory than the server holds for all its requests, 431 for headers over 64 KiB, 503 with
``Retry-After`` when every queue is full, the server holds its budget, is not ready or stopping (without,
for a body that had not all arrived when the server began to stop), or more than ``max_connections``
are open, 504 when the deadline passed in the queue
(answered at that deadline, even while a batch runs; never scored); each with the JSON body
``{"error": "..."}``. A request whose client disconnects before its answer is dropped from the
queue, unscored, and counted with status 499. Every refusal is counted in the metrics with its
reason (``_service.REASONS``). A large request is read, and a large answer written,
on the server's parse thread, the event loop serving the others meanwhile (``_service.off_loop``);
a large answer is sent in slices of its arrays, and a client too slow to take it dropped. See
docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import zlib

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._validate import check_timeout
from .._version import __version__
from . import _service, _tensors
from ._connection import ABORT, JOIN, LOST, connection_class
from ._service import (BODY_MIN_RATE, BODY_TIMEOUT_S, GRPC_MAX_CALLS, GRPC_MAX_STREAMS, HEADER_TIMEOUT_S,
                       INLINE_PARSE_BYTES, INLINE_WRITE_VALUES, MAX_BODY, MAX_CONNECTIONS, MODELS, VERSIONS, Held,
                       Refused, Service)
from .batcher import Batcher

__all__ = ["MODELS", "make_app", "run", "run_processes", "serve"]

_RETRY_AFTER_S = "1"
_GRPC_GRACE_S = 300.0  # at shutdown, gRPC calls already accepted may take this long to be answered


def make_app(load, *, max_body_bytes: int = MAX_BODY, grpc_address: str | None = None,
             header_timeout: float = HEADER_TIMEOUT_S, body_timeout: float = BODY_TIMEOUT_S,
             body_min_rate: int = BODY_MIN_RATE, grpc_max_streams: int = GRPC_MAX_STREAMS,
             max_connections: int = MAX_CONNECTIONS, grpc_max_calls: int = GRPC_MAX_CALLS):
    """The ASGI application (inference requests go straight to their handler, the rest through
    starlette's routing). ``load``: a callable taking the server's :class:`Observer` (its metrics)
    and returning the :class:`Batcher`; it runs in a thread at startup, while ``/v2/health/live``
    already answers (``ready`` turns true once it returns and the batcher is warm).
    ``max_body_bytes``: the largest request body (decompressed too), or gRPC message.
    ``grpc_address`` (``host:port``): also serve the protocol over gRPC there, from the same batcher
    (``lik_cupy.serving.grpc``; needs the ``[serve-grpc]`` extra). How slowly a client may send a
    request: its headers within ``header_timeout`` seconds (kept by :func:`run`'s connections);
    its body (408 past these) with no gap over ``body_timeout`` seconds, and once it has taken that
    long, at ``body_min_rate`` bytes a second on average (0: any rate); a gRPC message, within the
    time ``max_body_bytes`` take at that rate (``body_timeout`` at least). A gRPC connection may have
    ``grpc_max_streams`` calls at once (a client keeps those over it waiting; the server refuses any
    opened anyway), as an HTTP connection has one request at a time, and closes after
    ``header_timeout`` without one. The server serves ``max_connections`` HTTP connections at once
    (kept by :func:`run`: a request that comes while more are open is answered 503 and its
    connection closed) and ``grpc_max_calls`` gRPC calls (more: ``RESOURCE_EXHAUSTED``); each queued
    request holds one, so give at least the batcher's ``max_queue`` times its workers."""
    return _application(load, max_body_bytes, grpc_address,
                        limits=(header_timeout, body_timeout, body_min_rate, grpc_max_streams, max_connections,
                                grpc_max_calls))


def _application(load, max_body_bytes: int, grpc_address: str | None, peers=None,
                 limits: tuple = (HEADER_TIMEOUT_S, BODY_TIMEOUT_S, BODY_MIN_RATE, GRPC_MAX_STREAMS, MAX_CONNECTIONS,
                                  GRPC_MAX_CALLS)):
    """:func:`make_app`; ``peers``: set by :func:`run_processes` (``ready`` waits for every process,
    and gRPC shares its port with them); ``limits``: (header_timeout, body_timeout, body_min_rate,
    grpc_max_streams, max_connections, grpc_max_calls)."""
    svc = Service(load, max_body_bytes, peers, *limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        grpc_server = None
        if grpc_address is not None:
            from .grpc import start_server

            try:
                grpc_server = await start_server(svc, grpc_address, shared=peers is not None)
            except Exception as e:  # noqa: BLE001 - the server stops at once and run() raises it
                svc.fail(e)
        if svc.failure is None:
            svc.start()
        yield
        # gRPC takes no new calls; those whose messages have arrived reach the queues before they close,
        # and finish as the batcher drains (grace=None would cancel them), then the count of answers
        # is printed.
        stopped = None if grpc_server is None else asyncio.ensure_future(grpc_server.stop(grace=_GRPC_GRACE_S))
        await _service.all_queued(svc)
        await asyncio.get_running_loop().run_in_executor(None, svc.stop)
        if stopped is not None:
            await stopped
        svc.report()

    async def live(request):
        return Response(status_code=200)

    async def ready(request):
        return Response(status_code=200 if svc.ready else 503)

    async def server(request):
        return JSONResponse({"name": "lik-cupy", "version": __version__, "extensions": ["binary_tensor_data"]})

    async def metadata(request):
        model = request.path_params["model"]
        try:
            inputs, outputs = ([{"name": n, "datatype": t, "shape": s} for n, t, s in part]
                               for part in _service.tensor_specs(svc, model, _version(request)))
        except Refused as e:
            return _refused_response(e)
        return JSONResponse({"name": model, "versions": list(VERSIONS), "platform": "lik_cupy", "inputs": inputs,
                             "outputs": outputs})

    async def model_ready(request):
        try:
            _service.check_model(request.path_params["model"], _version(request))
        except Refused as e:
            return _refused_response(e)
        return Response(status_code=200 if svc.ready else 503)

    async def config(request):
        try:
            return JSONResponse(_service.model_config(svc, request.path_params["model"], _version(request)))
        except Refused as e:
            return _refused_response(e)

    async def stats(request):
        model = request.path_params.get("model")
        try:
            if model is not None:
                _service.check_model(model, _version(request))
        except Refused as e:
            return _refused_response(e)
        return JSONResponse({"model_stats": [svc.metrics.statistics(m) for m in ([model] if model else MODELS)]})

    async def metrics(request):
        return Response(svc.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def not_routed(request, exc):
        # (starlette answers these two in plain text; the protocol's errors are JSON)
        status, body, head = _not_routed(exc.status_code, request.method, request.scope["path"],
                                         (exc.headers or {}).get("Allow", ""))
        return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in head})

    model, version = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
    routes = [Route("/v2/health/live", live), Route("/v2/health/ready", ready), Route("/v2", server),
              Route("/v2/models/stats", stats), Route("/metrics", metrics)]
    for base in (model, version):
        routes += [Route(base, metadata), Route(f"{base}/ready", model_ready), Route(f"{base}/config", config),
                   Route(f"{base}/stats", stats)]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_routed, 405: not_routed})
    app.state.service = svc
    return _App(app, svc)


def _version(request) -> str:
    """The model version a request's path names ("" for none)."""
    return request.path_params.get("version", "")


def serve(paths, *, host: str = "127.0.0.1", port: int = 8000, grpc_port: int | None = None, devices=None,
          partition: bool | None = None, max_batch: int = 64, max_tokens: int = 65536, max_delay_us: int = 0,
          max_queue: int = 1024, processes: int = 1, header_timeout: float = HEADER_TIMEOUT_S,
          body_timeout: float = BODY_TIMEOUT_S, body_min_rate: int = BODY_MIN_RATE,
          grpc_max_streams: int = GRPC_MAX_STREAMS, max_connections: int | None = None,
          grpc_max_calls: int | None = None, client=None, cluster_timeout: float | None = None) -> None:
    """Serve the documents of shard ``paths`` (:meth:`Batcher.from_shards` for ``devices`` and
    ``partition``; the rest as for :class:`Batcher`) with :func:`run`: HTTP on ``port``, and gRPC on
    ``grpc_port`` when given; each shard is opened (and checked) first, so a missing or damaged one
    raises ShardError before the server listens, and the corpus loads from the shards opened then.
    ``header_timeout``, ``body_timeout``, ``body_min_rate``: how slowly a client may send a request;
    ``grpc_max_streams``: the gRPC calls a connection may have at once; ``max_connections``,
    ``grpc_max_calls``: the HTTP connections and gRPC calls each process serves at once
    (:func:`make_app`), by default 8192, or more where ``max_queue`` on each of the ``devices``
    (eight where not given) is more, so that a full queue is never refused.
    ``processes`` > 1: that many server processes on the ports (:func:`run_processes`), each with its
    own replicas (over several GPUs, one GPU's in each process where their count divides
    ``processes``: ``Batcher.from_shards``' ``process``), from the shards as it opens them (a spawned
    process maps the files itself: a Shard's memory maps would pickle as their whole data).
    ``client``: a ``distributed.Client`` (the ``[distributed]`` extra): the documents are kept
    resident on its cluster's workers instead (:class:`lik_cupy.distributed.DistributedCorpus`,
    which reads the shards under the same names there; their ids are read here), one worker of
    the batcher making each batch one call of it; not with ``devices``, ``partition`` or
    ``processes``. The server is ready once every shard is loaded on the cluster, and drops them
    from the workers as it stops, while loading too (the client stays open: it is the caller's).
    It is not ready while the client has no scheduler (``Batcher.unavailable``), nor while it
    reloads the corpus onto a scheduler restarted at the address, or through a client of its own
    where the caller's closed for good (``_cluster.ClusterCorpus.watch``; it closes that one as it
    stops). ``cluster_timeout``:
    the seconds any one wait on the cluster may take (``DistributedCorpus``'s ``timeout``; its
    default, 300, when None); a batch past it is answered 504, each request of it at once."""
    if client is not None and (devices is not None or partition is not None or processes != 1):
        raise ValueError("client serves the corpus from the Dask cluster's workers; devices, partition and processes "
                         "place it in this server: give one or the other")
    if cluster_timeout is not None:
        if client is None:
            raise ValueError("cluster_timeout bounds the waits on the cluster of client; give client too")
        check_timeout(cluster_timeout, "cluster_timeout")
    if grpc_port is not None and grpc_port == port != 0:
        from ..errors import LikError

        raise LikError(f"{host}:{port}", f"the gRPC port must differ from the HTTP port, both are {port}")
    max_connections, grpc_max_calls = _caps(max_connections, grpc_max_calls, max_queue, devices)
    limits = dict(header_timeout=header_timeout, body_timeout=body_timeout, body_min_rate=body_min_rate,
                  grpc_max_streams=grpc_max_streams, max_connections=max_connections, grpc_max_calls=grpc_max_calls)
    _service.check_limits(**limits)  # (before the shards are opened)
    paths = [paths] if isinstance(paths, (str, bytes, os.PathLike)) else list(paths)
    opened = _check_shards(paths)
    kwargs = dict(max_batch=max_batch, max_tokens=max_tokens, max_delay_us=max_delay_us, max_queue=max_queue)
    if processes > 1:
        del opened  # (each process opens them itself)
        loads = [functools.partial(_load_shards, paths, devices, partition, kwargs, process=(i, processes))
                 for i in range(processes)]
        run_processes(loads, processes, host=host, port=port, grpc_port=grpc_port, **limits)
        return
    if client is not None:
        load = _ClusterLoad(client, paths, opened, kwargs,
                            {} if cluster_timeout is None else {"timeout": float(cluster_timeout)})
    else:
        load = functools.partial(_load_shards, opened, devices, partition, kwargs)
    del opened  # (the load holds them until it has run, and Service.start lets it go then: none stay mapped)
    run(make_app(load, grpc_address=None if grpc_port is None else _grpc_address(host, grpc_port), **limits),
        host=host, port=port)


def _caps(max_connections: int | None, grpc_max_calls: int | None, max_queue: int, devices) -> tuple[int, int]:
    """:func:`serve`'s (max_connections, grpc_max_calls), each given or its default: the larger of
    :data:`MAX_CONNECTIONS` and a full queue, ``max_queue`` on each worker (one an entry of
    ``devices``; eight where none are named: as many GPUs as one host has, most)."""
    workers = 8 if devices is None else max(1, len(devices))
    full = max_queue * workers if isinstance(max_queue, int) and not isinstance(max_queue, bool) else 0
    default = min(max(MAX_CONNECTIONS, full), 2**31 - 2)
    return (default if max_connections is None else max_connections,
            default if grpc_max_calls is None else grpc_max_calls)


def _check_shards(paths: list) -> list:
    """Each shard opened before listening (ShardError naming the one at fault): a missing or
    damaged shard then stops ``lik serve`` before it says "listening on" and answers ``live``, rather
    than once its load thread reaches it."""
    from ..shards import open_input

    if not paths:
        raise ValueError("paths is empty; give one shard path or more")
    return [open_input(p) for p in paths]


def _grpc_address(host: str, port: int) -> str:
    return f"{f'[{host}]' if ':' in host else host}:{port}"


def _load_shards(paths, devices, partition, kwargs, observer, process=None) -> Batcher:
    return Batcher.from_shards(paths, devices, partition=partition, process=process, observer=observer, **kwargs)


class _ClusterLoad:
    """``load(observer)`` of ``lik serve --scheduler``: the batcher over a corpus resident on the
    cluster of ``client``. :meth:`cancel` (the server stopping while it runs) closes the corpus
    there and then, dropping what loaded so far: left to the load, it would still be loading as the
    process exits and the client closes, and the workers would keep it for the cluster's life.
    ``kwargs`` go to the Batcher, ``corpus_kwargs`` to the DistributedCorpus."""

    def __init__(self, client, paths, opened, kwargs, corpus_kwargs=None):
        self._args = (client, paths, opened, kwargs)
        self._corpus_kwargs = corpus_kwargs or {}
        self._lock = threading.Lock()
        self._corpus, self._cancelled = None, False

    def __call__(self, observer) -> Batcher:
        from ._cluster import load

        (client, paths, opened, kwargs), self._args = self._args, None  # (none of the shards stays mapped)
        corpus = load(client, paths, opened, started=self._started, **self._corpus_kwargs)
        try:
            return Batcher(corpus, observer=observer, **kwargs)
        except BaseException:
            corpus.close()
            raise

    def _started(self, corpus) -> None:
        """The distributed corpus, handed over before it loads."""
        with self._lock:
            self._corpus, cancelled = corpus, self._cancelled
        if cancelled:
            corpus.close()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled, corpus = True, self._corpus
        if corpus is not None:
            corpus.close()


def run_processes(load, processes: int, *, host: str = "127.0.0.1", port: int = 8000,
                  grpc_port: int | None = None, header_timeout: float = HEADER_TIMEOUT_S,
                  body_timeout: float = BODY_TIMEOUT_S, body_min_rate: int = BODY_MIN_RATE,
                  grpc_max_streams: int = GRPC_MAX_STREAMS, max_connections: int = MAX_CONNECTIONS,
                  grpc_max_calls: int = GRPC_MAX_CALLS) -> None:
    """Serve :func:`make_app` ``(load)`` (with ``header_timeout``, ``body_timeout``,
    ``body_min_rate``, ``grpc_max_streams``, ``max_connections`` and ``grpc_max_calls``, each
    process's) from ``processes`` processes sharing the HTTP port (and ``grpc_port``'s gRPC, when
    given) until SIGINT or SIGTERM; each drains its accepted requests,
    then this returns. ``load`` must pickle (a module-level function or a ``functools.partial`` of
    one): each process calls it for a batcher, and replicas on the devices, of its own (a list of
    ``processes`` of them: process i calls the i-th). One
    process's Python parses, checks and answers about 2,000 requests a second; the processes
    multiply that, and the batching happens within each. ``/v2/health/ready`` answers 200 once every
    process is warm; ``/metrics`` sums the histograms and counters over them (prometheus-client's
    multiprocess mode). LikError when a process fails to start or dies."""
    from ..errors import LikError
    from ._processes import serve_processes

    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be an integer >= 1, got {processes!r}")
    loads = list(load) if isinstance(load, (list, tuple)) else [load] * processes
    if len(loads) != processes:
        raise ValueError(f"load lists {len(loads)} callables for {processes} processes; give one, or one per process")
    limits = (header_timeout, body_timeout, body_min_rate, grpc_max_streams, max_connections, grpc_max_calls)
    _service.check_limits(*limits)  # (here, not in each process)
    # The ports are reserved by sockets bound with SO_REUSEPORT that never listen; each process
    # listens on sockets of its own bound there too (_serve_child). SO_REUSEPORT would also join a
    # group another server already listens in, so each port is first bound without it, as one
    # process binds it, to make sure that nothing listens there.
    sock = _reserved(host, port)
    try:
        grpc_sock = None if grpc_port is None else _reserved(host, grpc_port)
    except LikError:
        sock.close()
        raise
    grpc_address = None if grpc_sock is None else _grpc_address(host, grpc_sock.getsockname()[1])

    def announce():
        _announce(sock)
        if grpc_address is not None:
            print(f"lik serve: listening on grpc://{grpc_address}", file=sys.stderr, flush=True)

    try:
        serve_processes([functools.partial(_serve_child, one, host, sock.getsockname()[1], grpc_address, limits)
                         for one in loads], announce)
    finally:
        sock.close()
        if grpc_sock is not None:
            grpc_sock.close()


def _serve_child(load, host: str, port: int, grpc_address: str | None, limits: tuple, peers) -> None:
    """One process of :func:`run_processes` (spawned): the whole server on a socket of its own at
    ``host:port``, and gRPC at ``grpc_address`` when given."""
    _serve_on(_application(load, MAX_BODY, grpc_address, peers, limits), _listening(host, port, reuse_port=True))


def _reserved(host: str, port: int) -> socket.socket:
    """:func:`run_processes`' reservation of ``host:port`` (a free one for port 0): LikError where
    something already listens."""
    if port:
        _listening(host, port).close()
    return _listening(host, port, reuse_port=True)


def _listening(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A socket bound to ``host:port`` (LikError when it cannot be); ``reuse_port``: one of several
    bound there (SO_REUSEPORT: the kernel spreads connections over those that listen)."""
    from ..errors import LikError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise LikError(f"{host}:{port}", f"cannot listen there: {e.strerror or e}") from None
    return sock


def _announce(sock: socket.socket) -> None:
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    print(f"lik serve: listening on http://{shown}:{bound[1]}", file=sys.stderr, flush=True)


def run(app, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``app`` (:func:`make_app`) until SIGINT or SIGTERM, then answer every accepted request and
    return. Prints ``lik serve: listening on http://HOST:PORT`` once bound (``port`` 0: a free one;
    the gRPC port, if any, is printed as ``grpc://HOST:PORT``); LikError when it cannot listen there
    or the corpus fails to load."""
    sock = _listening(host, port)
    _serve_on(app, sock, announce=lambda: _announce(sock))


def _serve_on(app, sock: socket.socket, announce=None) -> None:
    """:func:`run` on a socket already bound (each process of :func:`run_processes`); ``announce()``
    runs once a signal would stop the server gracefully."""
    import uvicorn

    from ..errors import LikError

    svc = app.state.service

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            svc.stop_reading()  # (before uvicorn waits for every connection's request)
            await super().shutdown(sockets)

    # The connections keep the cap on connections (uvicorn's limit_concurrency would answer over it
    # uncounted), and count what they refuse before the application sees a request.
    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                   http=connection_class(svc.header_timeout, svc.max_connections,
                                                         svc.metrics.refused_unread)))
    svc.on_failure = lambda: setattr(server, "should_exit", True)
    # uvicorn stops gracefully on SIGINT or SIGTERM, then raises the signal again for the handler it
    # found; the queue is drained by then, so that handler's stop changes nothing and run returns. A
    # signal that comes before uvicorn installs its own handlers (just after "listening on", or to a
    # process of run_processes still starting) asks for the same stop: uvicorn starts, sees
    # should_exit, and stops at once.
    stops = (signal.SIGINT, signal.SIGTERM)
    before = [signal.signal(s, lambda *_: setattr(server, "should_exit", True)) for s in stops]
    try:
        if announce is not None:
            announce()
        server.run(sockets=[sock])
    finally:
        for s, h in zip(stops, before):
            signal.signal(s, h)
    if svc.failure is not None:
        if isinstance(svc.failure, LikError):
            raise svc.failure
        raise LikError("lik serve", f"loading the corpus failed: {svc.failure}")


# ---------------------------------------------------------------- handlers


_INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class _App:
    """The ASGI application: ``POST .../infer`` straight to :func:`_answer_infer`, everything else
    (the lifespan, health, metadata, metrics) through the starlette application ``app``. Inference
    is the one hot path, and starlette's request and response objects, middleware and route
    matching took about a sixth of the server's time per request under load."""

    def __init__(self, app: Starlette, svc: Service):
        self._app, self._svc, self.state = app, svc, app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            m = _INFER.fullmatch(scope["path"])
            if m and scope["method"] == "POST":
                return await _answer_infer(self._svc, m.group(1), m.group(2) or "", scope, receive, send)
            if m:  # (no starlette route has this path: it would answer 404)
                return await _send(send, *_not_routed(405, scope["method"], scope["path"], "POST"), self._svc, scope)
        await self._app(scope, receive, send)


class _Disconnected(Exception):
    """The client went away before its request was answered."""


async def _answer_infer(svc: Service, model: str, version: str, scope, receive, send) -> None:
    start = time.perf_counter()
    headers = {k: v for k, v in scope["headers"] if k in _REQUEST_HEADERS}
    held = Held(svc)
    lost = scope.get("extensions", {}).get(LOST, _unwatched)
    try:
        status, body, head = await _infer(svc, model, version, headers, receive, lost, held)
    except _Disconnected:
        _service.abandoned(svc, model, start, expired=False)
        return
    except Exception as e:  # noqa: BLE001 - a Refused, or a fault of ours: say so, keep serving
        if not isinstance(e, Refused):
            _log.exception("inference request failed")
            e = Refused(500, f"internal error: {type(e).__name__}: {e}")
        _service.refused(svc, model, e, start)
        status, body, head = _refused(e)
    else:
        _service.responded(svc, model, 200, start)
    finally:
        held.release()
    await _send(send, status, body, head, svc, scope, model)


async def _send(send, status: int, body: bytes | list, head: tuple, svc: Service, scope: dict,
                model: str = _service.UNNAMED) -> None:
    """Send an answer: ``body`` bytes, or a list of pieces (bytes-like: :func:`_tensors.write_response`'s).
    Up to :data:`_SEND_AT_ONCE` in all, they go in one write with the status line and headers (the
    connection's extension :data:`JOIN`). More go a slice of at most :data:`_SLICE` at a time,
    each once the connection has taken the last (uvicorn's flow control), the event loop serving
    the others meanwhile, rather than joined into one copy and written at once. Such an answer is
    held against ``svc``'s budget until sent, and timed as a request's body is (its client must
    take it as fast): a client too slow has its connection dropped (``scope``'s extension
    :data:`ABORT`), which frees the answer, where it held it and the server's shutdown for as long
    as it stayed connected; counted rejected (``answer_timeout``) under ``model``, its answer
    counted already."""
    if isinstance(body, list):
        size = sum(len(p) for p in body)
        if size <= _SEND_AT_ONCE:
            body = b"".join(body)
    else:
        size = len(body)
    start = {"type": "http.response.start", "status": status,
             "headers": [*head, (b"content-length", str(size).encode())]}
    if not isinstance(body, list):
        join = scope.get("extensions", {}).get(JOIN)
        if join is not None:
            join()
        await send(start)
        await send({"type": "http.response.body", "body": body})
        return
    await send(start)
    svc.keep(size)
    try:
        await _service.departure(svc, lambda clock: _slices(send, body, clock))
    except Refused as e:
        _log.warning("lik serve: %s; the connection is dropped", e)
        svc.metrics.rejected(_service.label(model), e.reason)
        abort = scope.get("extensions", {}).get(ABORT)
        if abort is not None:
            abort()
            await asyncio.sleep(0)  # (uvicorn sees the connection lost before the application returns)
    finally:
        svc.release(size)


async def _slices(send, pieces: list, clock: _service.BodyClock) -> None:
    # (memoryviews: uvicorn's httptools protocol writes any bytes-like body; ASGI says bytes, which
    # would copy each slice)
    for piece in pieces:
        view = memoryview(piece)
        for at in range(0, len(view), _SLICE):
            part = view[at:at + _SLICE]
            await send({"type": "http.response.body", "body": part, "more_body": True})
            clock.got(len(part))
    await send({"type": "http.response.body", "body": b""})


_SEND_AT_ONCE = 256 << 10
_SLICE = 1 << 20


_REQUEST_HEADERS = (b"content-encoding", b"inference-header-content-length")
_JSON = ((b"content-type", b"application/json"),)
_log = logging.getLogger("uvicorn.error")


def _error_json(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def _refused(e: Refused) -> tuple[int, bytes, tuple]:
    """(status, body, headers) of a refusal."""
    return e.status, _error_json(str(e)), _JSON + (((b"retry-after", _RETRY_AFTER_S.encode()),) if e.retry else ()) \
        + (((b"connection", b"close"),) if e.close else ())


_ENDPOINTS = ("/v2, /v2/health/live, /v2/health/ready, /v2/models/stats, /v2/models/{model} and "
              "/v2/models/{model}/versions/1, each of these two alone or with /ready, /config, /stats or /infer, "
              "and /metrics")


def _not_routed(status: int, method: str, path: str, allow: str) -> tuple[int, bytes, tuple]:
    """(status, body, headers) of a path no endpoint has (404) or a method its endpoint does not take
    (405; ``allow``: those it takes)."""
    if status == 405:
        return 405, _error_json(f"{path} does not take {method}; it takes {allow}"), \
            _JSON + ((b"allow", allow.encode()),)
    return status, _error_json(f"no endpoint at {path}; the endpoints are {_ENDPOINTS}"), _JSON


def _refused_response(e: Refused) -> Response:
    status, body, head = _refused(e)
    return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in head})


async def _infer(svc: Service, model: str, version: str, headers: dict, receive, lost,
                 held: Held) -> tuple[int, list, tuple]:
    """(status, body in pieces, headers) of the response to one inference request (raises
    :class:`Refused`, or :class:`_Disconnected`). ``headers``: the request's, by lower-case name, as
    bytes; ``lost``: the connection's extension :data:`LOST`; ``held``: what the body holds of the
    server's budget."""
    _service.check_model(model, version)
    _service.check_ready(svc)  # before reading the body
    body = await _service.arrival(svc, lambda clock: _body(receive, svc.max_body, held, clock))
    try:
        header, inputs, names, binary = await _read(svc, body, headers, _service.OUTPUTS[model], held, lost)
        params = header.get("parameters") or {}
        if not isinstance(params, dict):
            raise ValueError("the request's parameters must be an object")
    except ValueError as e:
        raise Refused(400, str(e)) from None
    as_json = tuple(n for n in names if n not in binary)
    out, params = await _unless_disconnected(
        lambda watch: _service.infer(svc, model, inputs, params, on_wait=watch, json_outputs=as_json, held=held),
        lost)
    head = {"model_name": model, "model_version": "1", "parameters": params}
    if isinstance(header.get("id"), str):
        head["id"] = header["id"]
    outputs = [(n, out[n]) for n in names]
    if _tensors.write_steps(outputs, binary) > INLINE_WRITE_VALUES:
        pieces, json_size = await _service.off_loop(svc, held, _tensors.write_response, head, outputs, binary)
    else:
        pieces, json_size = _tensors.write_response(head, outputs, binary)
    if json_size is None:
        return 200, pieces, _JSON
    return 200, pieces, ((b"content-type", b"application/octet-stream"),
                          (b"inference-header-content-length", str(json_size).encode()))


async def _read(svc: Service, body: bytes | None, headers: dict, outputs: tuple[str, ...], held: Held,
                lost) -> tuple[dict, dict, list, set]:
    """(the JSON header, the inputs by name, the outputs to send of the model's ``outputs``, those to
    send binary) of a request's ``body`` (None: past the body limit), inflated as its
    Content-Encoding says: on the event loop's thread where that takes at most ``INLINE_PARSE_BYTES``
    of work, else on the server's parse thread while the event loop serves the other requests
    (:class:`_Disconnected` as soon as the client has gone meanwhile: ``lost``, the connection's
    extension :data:`LOST`). Raises :class:`Refused` or ValueError."""
    encoding = headers.get(b"content-encoding")
    if body is not None and encoding is not None:
        # (inflating works through the body and what it inflates to: each at most INLINE_PARSE_BYTES
        # on the event loop, else the whole on the parse thread)
        coding, small = encoding.decode("latin-1"), len(body) <= INLINE_PARSE_BYTES
        inflated = _decoded(body, coding, min(svc.max_body, INLINE_PARSE_BYTES)) if small else None
        if inflated is None and (not small or svc.max_body > INLINE_PARSE_BYTES):
            inflated = await _parsed(svc, held, lost, _decoded, body, coding, svc.max_body)
        if inflated is not None and inflated is not body:
            held.add(len(inflated))
        body = inflated
    if body is None:
        raise Refused(413, f"the request body is over {svc.max_body} bytes")
    length = headers.get(b"inference-header-content-length")
    length = None if length is None else length.decode("latin-1")
    hold = held.reading("send fewer values or BYTES elements a request, or numbers as binary data (binary_data_size)")
    try:
        return _request(body, length, outputs, most=INLINE_PARSE_BYTES, hold=hold)
    except _tensors.LongParse:
        return await _parsed(svc, held, lost, _request, body, length, outputs, yielding=True, hold=hold)


def _request(body: bytes, length: str | None, outputs: tuple[str, ...], **kwargs) -> tuple[dict, dict, list, set]:
    """:func:`_tensors.read_request` (``kwargs``: its options) and :func:`_tensors.binary_outputs`, on
    one thread: a header's list of outputs is as long as its client makes it."""
    header, inputs = _tensors.read_request(body, length, **kwargs)
    return (header, inputs, *_tensors.binary_outputs(header, outputs))


async def _parsed(svc: Service, held: Held, lost, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the server's parse thread (:func:`_service.off_loop`), or
    :class:`_Disconnected` as soon as the client has gone meanwhile (``lost``: as :func:`_read` takes it)."""
    async def work(watch):
        watch()
        return await _service.off_loop(svc, held, fn, *args, **kwargs)

    return await _unless_disconnected(work, lost)


async def _unless_disconnected(work, lost):
    """``await work(watch)`` (a coroutine function), or :class:`_Disconnected` once the client has
    gone away after ``work`` called ``watch()``: from then on the connection (``lost``: its extension
    :data:`LOST`) cancels this task when it is lost, as grpcio cancels the task of a call whose client
    left; ``_service.infer`` then drops the request from the queue if it is still there.
    ``_service.infer`` calls it only for a queued request: one scored at once has nothing to drop."""
    task = asyncio.current_task()
    gone = False

    def gone_away():  # (never once the work is done: the finally below stops the watch first)
        nonlocal gone
        gone = True
        task.cancel()

    try:
        return await work(lambda: lost(gone_away))
    except asyncio.CancelledError:
        # Ours is taken back (Python 3.11+ counts a task's cancellations; asyncio.timeout and task
        # groups read the count); one from elsewhere at the same moment goes on as a cancellation.
        if gone and (not hasattr(task, "uncancel") or task.uncancel() == 0):
            raise _Disconnected from None
        raise
    finally:
        lost(None)


def _unwatched(callback) -> None:
    """:data:`LOST` of a connection that is not lik serve's (the application served by another ASGI
    server): its client's departure goes unnoticed, and its queued request is scored."""


async def _body(receive, limit: int, held: Held, clock: _service.BodyClock) -> bytes | None:
    """The request's body, or None past ``limit`` bytes (read no further); each chunk held against
    the server's budget as it arrives (twice: the chunks, then the body they join into), and timed
    by ``clock``."""
    chunks, n = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        clock.got(len(chunk))
        n += len(chunk)
        if n > limit:
            return None
        held.add(len(chunk))
        chunks.append(chunk)
        if not message.get("more_body", False):
            if len(chunks) == 1:
                return chunks[0]
            held.add(n)
            return b"".join(chunks)


def _decoded(body: bytes, encoding: str, limit: int) -> bytes | None:
    """The body decompressed as its Content-Encoding says (a coding's name in any case; gzip's members
    one after another); None past ``limit`` bytes (inflated no further)."""
    coding = encoding.strip().lower()
    if coding == "identity":
        return body
    if coding not in ("gzip", "deflate"):
        raise ValueError(f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none")
    # Each member is fed in steps that double from _INFLATE_STEP: at a member's end zlib copies the
    # input it was given past that end (unused_data), and the whole rest of the body each time made
    # a body of many small members quadratic (160,000 empty ones, 3 MB, took 6 s).
    view, at, parts, n = memoryview(body), 0, [], 0
    while True:
        inflate = zlib.decompressobj(wbits=31 if coding == "gzip" else 15)  # a gzip member, or a zlib stream
        step = _INFLATE_STEP
        while not inflate.eof and at < len(view):
            chunk = view[at:at + step]
            try:
                out = inflate.decompress(chunk, limit + 1 - n)  # (all of chunk is read unless out reaches the limit)
            except zlib.error as e:
                raise ValueError(f"the body is not valid {coding} data: {e}") from None
            n += len(out)
            if n > limit:
                return None
            parts.append(out)
            at += len(chunk) - len(inflate.unused_data)
            step *= 2
        if not inflate.eof:
            raise ValueError(f"the body is not valid {coding} data: it ends early")
        if coding == "deflate" or at == len(view):
            break
    if at < len(view):
        raise ValueError("the body is not valid deflate data: bytes follow the end of its stream")
    return b"".join(parts)


_INFLATE_STEP = 64  # bytes of a member's input fed to zlib first (a gzip member takes 20 at least)
