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
for a bad request (the message names the problem), 404 for an unknown model, 413 for a body over
``max_body_bytes`` (decompressed too), 503 with ``Retry-After`` when every queue is full or the
server is not ready or stopping, 504 when the deadline passed in the queue. See docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
import time
import zlib

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._dispatch.elements import scaled_dtype
from .._version import __version__
from . import _tensors
from ._ids import IdIndex
from ._metrics import Metrics
from .batcher import OPERATIONS, Batcher
from .errors import DeadlineExceeded, Overloaded, ShuttingDown

__all__ = ["MODELS", "make_app", "run", "serve"]

MODELS = OPERATIONS
_OUTPUTS = {"search": ("SCORES", "IDS"), "rerank": ("SCORES",), "score": ("SCORES",)}
_INPUTS = {"search": ("Q", "K"), "rerank": ("Q", "IDS"), "score": ("Q",)}
_MAX_BODY = 64 << 20
_RETRY_AFTER_S = "1"


class _Service:
    """One server's state: the batcher (once loaded and warm), the id index, the metrics."""

    def __init__(self, load, max_body_bytes: int):
        self.load, self.max_body = load, max_body_bytes
        self.batcher: Batcher | None = None
        self.ids: IdIndex | None = None
        self.ready = False
        self.failure: BaseException | None = None
        self.on_failure = None  # called (from the loading thread) when loading fails
        self.metrics = Metrics(lambda: self.batcher)
        self.accepted = self.answered = 0
        self._count = threading.Lock()

    def start(self) -> None:
        def run():
            try:
                b = self.load(self.metrics)
                self.ids = IdIndex(b.corpus.ids, len(b.corpus))
                self.batcher = b
                b.warm()
                self.ready = True
                print(f"lik serve: ready: {b.corpus!r} on {', '.join(b.devices)}", file=sys.stderr, flush=True)
            except BaseException as e:  # noqa: BLE001 - run() reports it once the server has stopped
                self.failure = e
                if self.on_failure is not None:
                    self.on_failure()

        threading.Thread(target=run, name="lik-serve-load", daemon=True).start()

    def stop(self) -> None:
        self.ready = False
        if self.batcher is not None:
            self.batcher.close()
        print(f"lik serve: stopped; answered {self.answered} of {self.accepted} accepted requests", file=sys.stderr,
              flush=True)

    def count(self, field: str) -> None:
        with self._count:
            setattr(self, field, getattr(self, field) + 1)


def make_app(load, *, max_body_bytes: int = _MAX_BODY) -> Starlette:
    """The ASGI application. ``load``: a callable taking the server's :class:`Observer` (its metrics)
    and returning the :class:`Batcher`; it runs in a thread at startup, while ``/v2/health/live``
    already answers (``ready`` turns true once it returns and the batcher is warm)."""
    svc = _Service(load, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        svc.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, svc.stop)

    async def live(request):
        return Response(status_code=200)

    async def ready(request):
        return Response(status_code=200 if svc.ready else 503)

    async def server(request):
        return JSONResponse({"name": "lik-cupy", "version": __version__, "extensions": ["binary_tensor_data"]})

    async def metadata(request):
        return _metadata(svc, request.path_params["model"])

    async def model_ready(request):
        return _model_ready(svc, request.path_params["model"])

    async def config(request):
        return _config(svc, request.path_params["model"])

    async def stats(request):
        model = request.path_params.get("model")
        if model is not None and model not in MODELS:
            return _unknown(model)
        return JSONResponse({"model_stats": [svc.metrics.statistics(m) for m in ([model] if model else MODELS)]})

    async def infer(request):
        return await _infer(svc, request)

    async def metrics(request):
        return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    model, version = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
    routes = [Route("/v2/health/live", live), Route("/v2/health/ready", ready), Route("/v2", server),
              Route("/v2/models/stats", stats), Route("/metrics", metrics)]
    for base in (model, version):
        routes += [Route(base, metadata), Route(f"{base}/ready", model_ready), Route(f"{base}/config", config),
                   Route(f"{base}/stats", stats), Route(f"{base}/infer", infer, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = svc
    return app


def serve(paths, *, host: str = "127.0.0.1", port: int = 8000, devices=None, max_batch: int = 64,
          max_tokens: int = 65536, max_delay_us: int = 0, max_queue: int = 1024) -> None:
    """Serve the documents of shard ``paths`` (:meth:`Batcher.from_shards` for ``devices``; the rest
    as for :class:`Batcher`) with :func:`run`."""

    def load(observer):
        return Batcher.from_shards(paths, devices, max_batch=max_batch, max_tokens=max_tokens,
                                   max_delay_us=max_delay_us, max_queue=max_queue, observer=observer)

    run(make_app(load), host=host, port=port)


def run(app: Starlette, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``app`` (:func:`make_app`) until SIGINT or SIGTERM, then answer every accepted request and
    return. Prints ``lik serve: listening on http://HOST:PORT`` once bound (``port`` 0: a free one);
    LikError when it cannot listen there or the corpus fails to load."""
    import uvicorn

    from ..errors import LikError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise LikError(f"{host}:{port}", f"cannot listen there: {e.strerror or e}") from None
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    svc = app.state.service
    svc.on_failure = lambda: setattr(server, "should_exit", True)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    print(f"lik serve: listening on http://{shown}:{bound[1]}", file=sys.stderr, flush=True)
    # uvicorn stops gracefully on SIGINT or SIGTERM, then raises the signal again for the handler it
    # found; the queue is drained by then, so that handler does nothing and run returns.
    stops = (signal.SIGINT, signal.SIGTERM)
    before = [signal.signal(s, lambda *_: None) for s in stops]
    try:
        server.run(sockets=[sock])
    finally:
        for s, h in zip(stops, before):
            signal.signal(s, h)
    if svc.failure is not None:
        raise LikError("lik serve", f"loading the corpus failed: {svc.failure}")


# ---------------------------------------------------------------- handlers


def _error(status: int, message: str, **headers) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def _unknown(model: str) -> Response:
    return _error(404, f"unknown model {model!r}; the models are {', '.join(MODELS)}")


def _tensor_specs(svc: _Service, model: str) -> tuple[list, list] | None:
    """(inputs, outputs) of ``model``: name, datatype and shape each; None while the corpus loads."""
    if svc.batcher is None:
        return None
    c = svc.batcher.corpus
    qtype = "FP32" if scaled_dtype(c.dtype) else _tensors.DATATYPES[c.dtype]
    ids = "BYTES" if svc.ids.kind == "string" else "INT64"
    specs = {"Q": (qtype, [-1, c.dim]), "K": ("INT32", [1]), "IDS": (ids, [-1]), "SCORES": ("FP32", [-1])}
    return ([(n, *specs[n]) for n in _INPUTS[model]], [(n, *specs[n]) for n in _OUTPUTS[model]])


def _metadata(svc: _Service, model: str) -> Response:
    if model not in MODELS:
        return _unknown(model)
    specs = _tensor_specs(svc, model)
    if specs is None:
        return _error(503, "the corpus is still loading", **{"Retry-After": _RETRY_AFTER_S})
    inputs, outputs = ([{"name": n, "datatype": t, "shape": s} for n, t, s in part] for part in specs)
    return JSONResponse({"name": model, "versions": ["1"], "platform": "lik_cupy", "inputs": inputs,
                         "outputs": outputs})


def _config(svc: _Service, model: str) -> Response:
    """Triton's model configuration (perf_analyzer reads it): no batch axis of its own (each request
    holds its queries), one instance per replica."""
    if model not in MODELS:
        return _unknown(model)
    specs = _tensor_specs(svc, model)
    if specs is None:
        return _error(503, "the corpus is still loading", **{"Retry-After": _RETRY_AFTER_S})
    inputs, outputs = ([{"name": n, "data_type": f"TYPE_{'STRING' if t == 'BYTES' else t}", "dims": s}
                        for n, t, s in part] for part in specs)
    gpus = sum(d.startswith("cuda") for d in svc.batcher.devices)
    groups = [{"count": n, "kind": kind} for n, kind in ((gpus, "KIND_GPU"), (len(svc.batcher.devices) - gpus,
                                                                              "KIND_CPU")) if n]
    return JSONResponse({"name": model, "platform": "lik_cupy", "backend": "lik_cupy", "max_batch_size": 0,
                         "input": inputs, "output": outputs, "instance_group": groups})


def _model_ready(svc: _Service, model: str) -> Response:
    if model not in MODELS:
        return _unknown(model)
    return Response(status_code=200 if svc.ready else 503)


async def _infer(svc: _Service, request: Request) -> Response:
    model = request.path_params["model"]
    if model not in MODELS:
        return _unknown(model)
    start = time.perf_counter()
    response = await _answer(svc, model, request)
    svc.metrics.responded(model, response.status_code, time.perf_counter() - start)
    return response


async def _answer(svc: _Service, model: str, request: Request) -> Response:
    if not svc.ready:
        return _error(503, "the server is not ready (loading the corpus, or stopping)",
                      **{"Retry-After": _RETRY_AFTER_S})
    too_large = _error(413, f"the request body is over {svc.max_body} bytes")
    body = await _body(request, svc.max_body)
    if body is None:
        return too_large
    try:
        body = _decoded(body, request.headers.get("content-encoding"), svc.max_body)
        if body is None:
            return too_large
        header, inputs = _tensors.read_request(body, request.headers.get("inference-header-content-length"))
        names, binary = _tensors.binary_outputs(header, _OUTPUTS[model])
        Q, arg = _arguments(svc, model, inputs)
        timeout, precision = _parameters(header)
        future = svc.batcher.submit(model, Q, arg, precision=precision, timeout=timeout)
    except (ValueError, TypeError) as e:
        return _error(400, str(e))
    except Overloaded as e:
        return _error(503, str(e), **{"Retry-After": _RETRY_AFTER_S})
    except ShuttingDown as e:
        return _error(503, str(e))
    svc.count("accepted")
    try:
        result = await asyncio.wrap_future(future)
    except DeadlineExceeded as e:
        svc.count("answered")
        return _error(504, str(e))
    except Exception as e:  # noqa: BLE001 - the corpus call failed: say so, keep serving
        svc.count("answered")
        return _error(500, f"{type(e).__name__}: {e}")
    out = dict(zip(_OUTPUTS[model], result if model == "search" else (result,)))
    t = future.timing
    head = {"model_name": model, "model_version": "1",
            "parameters": {"queue_us": round(t.queue_s * 1e6), "compute_us": round(t.compute_s * 1e6),
                           "batch_queries": t.batch_queries}}
    if isinstance(header.get("id"), str):
        head["id"] = header["id"]
    content, json_size = _tensors.write_response(head, [(n, out[n]) for n in names], binary)
    svc.count("answered")
    if json_size is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(json_size)})


async def _body(request: Request, limit: int) -> bytes | None:
    """The body, or None past ``limit`` bytes (read no further)."""
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _decoded(body: bytes, encoding: str | None, limit: int) -> bytes | None:
    """The body decompressed as its Content-Encoding says; None past ``limit`` bytes (inflated no further)."""
    if encoding in (None, "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise ValueError(f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none")
    inflate = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)  # a gzip member, or a zlib stream
    try:
        out = inflate.decompress(body, limit + 1)
    except zlib.error as e:
        raise ValueError(f"the body is not valid {encoding} data: {e}") from None
    if len(out) > limit:
        return None
    if not inflate.eof:
        raise ValueError(f"the body is not valid {encoding} data: it ends early")
    return out


def _arguments(svc: _Service, model: str, inputs: dict) -> tuple[np.ndarray, object]:
    """(Q, the batcher's argument) from the request's inputs, checked by name and shape."""
    want = _INPUTS[model]
    extra = sorted(set(inputs) - set(want))
    missing = [n for n in want if n not in inputs]
    if extra or missing:
        raise ValueError(f"model {model} takes inputs {', '.join(want)}"
                         + (f"; missing {', '.join(missing)}" if missing else "")
                         + (f"; unexpected {', '.join(extra)}" if extra else ""))
    Q = inputs["Q"]
    if Q.dtype.kind in "USiub":
        raise ValueError(f"Q must be FP16, BF16 or FP32 embeddings, got {_datatype(Q)}")
    if model == "search":
        K = inputs["K"]
        if K.dtype not in (np.int32, np.int64) or K.size != 1:
            raise ValueError(f"K must hold one INT32 (or INT64) value, got {_datatype(K)} of shape {list(K.shape)}")
        return Q, int(K.reshape(-1)[0])
    if model == "rerank":
        ids = inputs["IDS"]
        if Q.ndim == 2 and ids.ndim != 1 or Q.ndim == 3 and (ids.ndim != 2 or ids.shape[0] != Q.shape[0]):
            raise ValueError(f"IDS has shape {list(ids.shape)}; expected [K] for Q [Lq, d], or [Nq, K] for Q "
                             f"[Nq, Lq, d]")
        return Q, svc.ids.positions(ids)
    return Q, None


def _parameters(header: dict) -> tuple[float | None, str | None]:
    """(the queue timeout in seconds, the precision) from the request's parameters."""
    params = header.get("parameters") or {}
    if not isinstance(params, dict):
        raise ValueError("the request's parameters must be an object")
    timeout = params.get("timeout")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"parameter timeout must be a positive number of microseconds, got {timeout!r}")
        timeout = timeout * 1e-6
    precision = params.get("precision")
    if precision is not None and not isinstance(precision, str):
        raise ValueError(f"parameter precision must be a string, got {precision!r}")
    return timeout, precision


def _datatype(a: np.ndarray) -> str:
    return "BYTES" if a.dtype.kind in "US" else _tensors.DATATYPES.get(str(a.dtype), str(a.dtype))
