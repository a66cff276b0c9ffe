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
import time
import zlib

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._version import __version__
from . import _service, _tensors
from ._service import MAX_BODY, MODELS, Refused, Service
from .batcher import Batcher

__all__ = ["MODELS", "make_app", "run", "serve"]

_RETRY_AFTER_S = "1"


def make_app(load, *, max_body_bytes: int = MAX_BODY, grpc_address: str | None = None) -> Starlette:
    """The ASGI application. ``load``: a callable taking the server's :class:`Observer` (its metrics)
    and returning the :class:`Batcher`; it runs in a thread at startup, while ``/v2/health/live``
    already answers (``ready`` turns true once it returns and the batcher is warm).
    ``grpc_address`` (``host:port``): also serve the protocol over gRPC there, from the same batcher
    (``lik_cupy.serving.grpc``; needs the ``[serve-grpc]`` extra)."""
    svc = Service(load, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        grpc_server = None
        if grpc_address is not None:
            from .grpc import start_server

            try:
                grpc_server = await start_server(svc, grpc_address)
            except Exception as e:  # noqa: BLE001 - the server stops at once and run() raises it
                svc.fail(e)
        if svc.failure is None:
            svc.start()
        yield
        if grpc_server is not None:  # no new RPCs; those accepted finish on the running batcher
            await grpc_server.stop(grace=None)
        await asyncio.get_running_loop().run_in_executor(None, svc.stop)

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
                               for part in _service.tensor_specs(svc, model))
        except Refused as e:
            return _refused(e)
        return JSONResponse({"name": model, "versions": ["1"], "platform": "lik_cupy", "inputs": inputs,
                             "outputs": outputs})

    async def model_ready(request):
        try:
            _service.check_model(request.path_params["model"])
        except Refused as e:
            return _refused(e)
        return Response(status_code=200 if svc.ready else 503)

    async def config(request):
        try:
            return JSONResponse(_service.model_config(svc, request.path_params["model"]))
        except Refused as e:
            return _refused(e)

    async def stats(request):
        model = request.path_params.get("model")
        try:
            if model is not None:
                _service.check_model(model)
        except Refused as e:
            return _refused(e)
        return JSONResponse({"model_stats": [svc.metrics.statistics(m) for m in ([model] if model else MODELS)]})

    async def infer(request):
        model, start = request.path_params["model"], time.perf_counter()
        try:
            response = await _infer(svc, model, request)
        except Refused as e:
            response = _refused(e)
        _service.responded(svc, model, response.status_code, start)
        return response

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


def serve(paths, *, host: str = "127.0.0.1", port: int = 8000, grpc_port: int | None = None, devices=None,
          partition: bool | None = None, max_batch: int = 64, max_tokens: int = 65536, max_delay_us: int = 0,
          max_queue: int = 1024) -> None:
    """Serve the documents of shard ``paths`` (:meth:`Batcher.from_shards` for ``devices`` and
    ``partition``; the rest as for :class:`Batcher`) with :func:`run`: HTTP on ``port``, and gRPC on
    ``grpc_port`` when given."""

    def load(observer):
        return Batcher.from_shards(paths, devices, partition=partition, max_batch=max_batch, max_tokens=max_tokens,
                                   max_delay_us=max_delay_us, max_queue=max_queue, observer=observer)

    grpc_address = None if grpc_port is None else f"{f'[{host}]' if ':' in host else host}:{grpc_port}"
    run(make_app(load, grpc_address=grpc_address), host=host, port=port)


def run(app: Starlette, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve ``app`` (:func:`make_app`) until SIGINT or SIGTERM, then answer every accepted request and
    return. Prints ``lik serve: listening on http://HOST:PORT`` once bound (``port`` 0: a free one;
    the gRPC port, if any, is printed as ``grpc://HOST:PORT``); LikError when it cannot listen there
    or the corpus fails to load."""
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
        if isinstance(svc.failure, LikError):
            raise svc.failure
        raise LikError("lik serve", f"loading the corpus failed: {svc.failure}")


# ---------------------------------------------------------------- handlers


def _refused(e: Refused) -> JSONResponse:
    return JSONResponse({"error": str(e)}, status_code=e.status,
                        headers={"Retry-After": _RETRY_AFTER_S} if e.retry else None)


async def _infer(svc: Service, model: str, request: Request) -> Response:
    """The response to one inference request (raises :class:`Refused`)."""
    _service.check_model(model)
    _service.check_ready(svc)  # before reading the body
    body = await _body(request, svc.max_body)
    try:
        if body is not None:
            body = _decoded(body, request.headers.get("content-encoding"), svc.max_body)
        if body is None:
            raise Refused(413, f"the request body is over {svc.max_body} bytes")
        header, inputs = _tensors.read_request(body, request.headers.get("inference-header-content-length"))
        names, binary = _tensors.binary_outputs(header, _service.OUTPUTS[model])
        params = header.get("parameters") or {}
        if not isinstance(params, dict):
            raise ValueError("the request's parameters must be an object")
    except ValueError as e:
        raise Refused(400, str(e)) from None
    out, params = await _service.infer(svc, model, inputs, params)
    head = {"model_name": model, "model_version": "1", "parameters": params}
    if isinstance(header.get("id"), str):
        head["id"] = header["id"]
    content, json_size = _tensors.write_response(head, [(n, out[n]) for n in names], binary)
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
