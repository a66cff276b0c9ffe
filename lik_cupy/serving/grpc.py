"""The Open Inference Protocol (KServe v2) over gRPC, beside the HTTP server and on its batcher: grpcio's
asyncio server with the ``inference.GRPCInferenceService`` messages that tritonclient ships (the
``[serve-grpc]`` extra). ``lik serve --grpc-port`` starts it; :func:`lik_cupy.serving.http.make_app`
runs it in the HTTP server's event loop.

RPCs: ``ServerLive``, ``ServerReady``, ``ServerMetadata``, ``ModelReady``, ``ModelMetadata``,
``ModelConfig``, ``ModelStatistics`` and ``ModelInfer``, with the models, inputs, outputs and
parameters of the HTTP side (``lik_cupy/serving/http.py``). Inputs come as ``raw_input_contents``
(what tritonclient sends; BYTES as 4-byte little-endian lengths and the bytes) or as typed
``contents``; outputs go back as ``raw_output_contents``. The call's gRPC deadline bounds its wait
in the queue, as the ``timeout`` parameter does: a call still queued when the sooner passes is
answered ``DEADLINE_EXCEEDED`` then, even while a batch runs, and never scored; so is a call whose
message does not arrive in time (``_service.arrival``). Errors: ``INVALID_ARGUMENT`` (the message
names the problem), ``NOT_FOUND`` (unknown model or version), ``RESOURCE_EXHAUSTED`` (a message over
the HTTP body limit), ``UNAVAILABLE`` (overloaded, not ready or stopping), ``DEADLINE_EXCEEDED`` and
``INTERNAL``. Each is counted in the metrics as the HTTP status of the same outcome, with its
reason (``_service.REASONS``), and so are calls that grpcio cancels (the client cancelled: 499; the
deadline passed: 504; once scored, 200, as HTTP counts them); those that end before their message
(which names the model) arrived under no model (``_service.UNNAMED``). A connection may have
``svc.grpc_max_streams`` calls at once (``lik serve --grpc-max-streams``), and closes after
``svc.header_timeout`` without one; the server serves ``svc.grpc_max_calls`` at once
(``--grpc-max-calls``), refusing more ``RESOURCE_EXHAUSTED`` (:func:`_admitted`), counted. An answer
of over 256 KiB is held against the server's budget until the call ends. Every RPC's message must
arrive within ModelInfer's bound (:func:`_unary`).
"""

from __future__ import annotations

import asyncio
import sys
import time

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import model_config_pb2, service_pb2 as pb, service_pb2_grpc as rpc

from .._version import __version__
from . import _service, _tensors
from ._service import INLINE_PARSE_BYTES, INLINE_WRITE_VALUES, MODELS, VERSIONS, Held, Refused, Service

__all__ = ["start_server"]

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
          408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED, 500: grpc.StatusCode.INTERNAL}
# A call that grpcio cancels with at most this many seconds of its deadline left counts as expired.
# grpcio does not say why it cancels; and a client cancels its call when its own deadline passes,
# which can reach the server before the server's timer fires (that one started when the request
# arrived): a few milliseconds early on a loaded host.
_EXPIRED_S = 0.01
# grpc core refuses a message over its limit unread, and tells the handler nothing (so the metrics
# cannot count it): its limit is twice the body limit, and the handler refuses what is over the body
# limit with 413, as HTTP does. Past twice, core's refusal costs less than reading the message.
_CORE_LIMIT_BODIES = 2
# InferTensorContents' field for each datatype sent as typed values rather than raw bytes.
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}


async def start_server(svc: Service, address: str, shared: bool = False) -> grpc.aio.Server:
    """A started gRPC server for ``svc`` on ``address`` (``host:port``; port 0: a free one), in the
    running event loop. Prints ``lik serve: listening on grpc://HOST:PORT``; LikError when it cannot
    listen there. ``shared``: one of the processes of ``lik serve --processes`` on a port their
    parent reserved (SO_REUSEPORT; the parent prints the line)."""
    from ..errors import LikError

    limit = min(_CORE_LIMIT_BODIES * svc.max_body, 2**31 - 1)  # (grpc core takes a C int)
    # Connections are held as HTTP's are: grpc core closes one that has not begun HTTP/2 within its
    # handshake timeout (60 s unless told), and keeps one without calls for ever unless told; both
    # here the time HTTP gives a request's headers. A connection's calls at once are capped
    # (svc.grpc_max_streams), as HTTP has one request at a time.
    # grpc core's own bounds are kept: a call's headers (8 KiB, refused surely past 16 KiB, where
    # HTTP takes 64 KiB) and a client's pings (closed when it pings more often than every 5 minutes
    # without data).
    header_ms = min(max(1, round(svc.header_timeout * 1000)), 2**31 - 1)
    # The calls at once over all connections are capped too (svc.grpc_max_calls), as HTTP's
    # connections are, by the handlers (_admitted): grpcio's maximum_concurrent_rpcs refuses a call over
    # it before any handler runs, and tells the server nothing to count.
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", -1),
               ("grpc.so_reuseport", int(shared)), ("grpc.server_handshake_timeout_ms", header_ms),
               ("grpc.max_connection_idle_ms", header_ms), ("grpc.max_concurrent_streams", svc.grpc_max_streams)]
    server = grpc.aio.server(options=options)
    handlers = _handlers(_Servicer(svc))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # (grpcio 1.63+: found without the generic lookup)
        server.add_registered_method_handlers(_SERVICE.full_name, handlers)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        port, reason = 0, str(e)
    else:
        reason = "the address is in use or not valid"
    if not port:
        raise LikError(address, f"cannot listen there for gRPC: {reason}")
    await server.start()
    if not shared:
        host = address.rsplit(":", 1)[0]
        print(f"lik serve: listening on grpc://{host}:{port}", file=sys.stderr, flush=True)
    return server


class _Servicer(rpc.GRPCInferenceServiceServicer):
    """The RPCs above; every one answers from ``svc`` or aborts with the status of its :class:`Refused`."""

    def __init__(self, svc: Service):
        self.svc = svc

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.svc.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="lik-cupy", version=__version__, extensions=[])

    async def ModelReady(self, request, context):
        await _checked(context, _service.check_model, request.name, request.version)
        return pb.ModelReadyResponse(ready=self.svc.ready)

    async def ModelMetadata(self, request, context):
        inputs, outputs = await _checked(context, _service.tensor_specs, self.svc, request.name, request.version)
        return pb.ModelMetadataResponse(
            name=request.name, versions=VERSIONS, platform="lik_cupy",
            inputs=[pb.ModelMetadataResponse.TensorMetadata(name=n, datatype=t, shape=s) for n, t, s in inputs],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(name=n, datatype=t, shape=s) for n, t, s in outputs])

    async def ModelConfig(self, request, context):
        config = await _checked(context, _service.model_config, self.svc, request.name, request.version)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))

    async def ModelStatistics(self, request, context):
        if request.name:
            await _checked(context, _service.check_model, request.name, request.version)
        stats = {"model_stats": [self.svc.metrics.statistics(m) for m in ([request.name] if request.name else MODELS)]}
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    async def ModelInfer(self, requests, context):
        # A stream-unary handler on the wire's unary call, as every unary RPC's (_handlers): it runs as
        # the call begins, so that the wait for its message is timed (_message) and ends at shutdown;
        # and it takes the message's bytes, so that its raw contents are read in place.
        svc, model, start = self.svc, None, time.perf_counter()
        if not _admitted(svc, context):
            await _over_cap(svc, context)
        held, unqueued, scored = Held(svc), False, False

        def queued() -> None:  # (the call is queued, or done: as the server stops, its queues wait till then)
            nonlocal unqueued
            if unqueued:
                unqueued, svc.unqueued = False, svc.unqueued - 1

        try:
            data = await _message(svc, context)
            if data is grpc.aio.EOF:
                await _without_message(svc, context, start)
            unqueued, svc.unqueued = True, svc.unqueued + 1
            try:
                rest, raw, head = _split(data)
                named = pb.ModelInferRequest.FromString(head)
            except (ValueError, DecodeError) as e:
                raise Refused(400, f"the request message is not a ModelInferRequest: {e}") from None
            model = named.model_name
            _service.check_model(model, named.model_version)
            size = len(data)
            if size > svc.max_body:
                raise Refused(413, f"the request message is {size} bytes, over the limit of {svc.max_body}")
            held.add(size)  # the message, against the server's budget of request bytes
            hold, outputs = held.reading(_SEND_RAW), _service.OUTPUTS[model]
            if len(rest) > INLINE_PARSE_BYTES:  # typed contents, read a Python step a value: off the event loop
                held.add(len(rest))  # (their message as protobuf holds it)
                request, inputs, params, names = await _service.off_loop(svc, held, _read, rest, raw, outputs, hold)
            else:
                request = _parse(rest)
                if size > INLINE_PARSE_BYTES and any(t.datatype == "BYTES" for t in request.inputs):  # (raw elements)
                    inputs, params, names = await _service.off_loop(svc, held, _request, request, raw, outputs, hold)
                else:
                    inputs, params, names = _request(request, raw, outputs, hold)
            remaining = context.time_remaining()
            out, reply = await _service.infer(svc, model, inputs, params, deadline_s=remaining, on_wait=queued,
                                              held=held)
            queued()
            scored = True
            if sum(out[n].size for n in names if out[n].dtype.kind in "US") > INLINE_WRITE_VALUES:  # (string ids)
                response = await _service.off_loop(svc, held, _response, request, reply, out, names)
            else:
                response = _response(request, reply, out, names)
        except Refused as e:  # (before its message, or its model's name, arrived: counted under none)
            _service.refused(svc, _service.UNNAMED if model is None else model, e, start)
            await context.abort(_CODES[e.status], str(e))
        except asyncio.CancelledError:  # grpcio cancels the task when the client cancels or the deadline passes
            if scored:  # (answered, its answer unsent: as HTTP counts a client that leaves while its answer is written)
                _service.responded(svc, model, 200, start)
            else:
                _given_up(svc, context, _service.UNNAMED if model is None else model, start)
            raise
        finally:
            queued()
            held.release()
        _service.responded(svc, model, 200, start)
        size = response.ByteSize()  # (0.2 us: protobuf adds up the sizes it keeps)
        if size > _HOLD_ANSWER:
            # Held until grpcio has sent it (the call's end), as HTTP holds its large answers: the
            # message and the bytes grpcio serializes it to, which it keeps until then.
            svc.keep(2 * size)
            context.add_done_callback(lambda _: svc.release(2 * size))
        return response


def _admitted(svc: Service, context) -> bool:
    """Whether a call is served: it is counted in ``svc.grpc_calls`` until it ends (its answer sent),
    unless as many as ``svc.grpc_max_calls`` are in progress (then :func:`_over_cap`)."""
    if svc.grpc_calls >= svc.grpc_max_calls:
        return False
    svc.grpc_calls += 1
    context.add_done_callback(svc.grpc_call_ended)
    return True


async def _over_cap(svc: Service, context) -> None:
    """Abort a call over ``svc.grpc_max_calls`` ``RESOURCE_EXHAUSTED``, counted as HTTP's 503 over
    ``--max-connections`` is, under no model (``max_calls``): its message is not read."""
    svc.metrics.refused_unread(503, "max_calls")
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the server serves {svc.grpc_max_calls} gRPC calls at once, and as many are in progress; "
                        f"retry later")


async def _without_message(svc: Service, context, start: float) -> None:
    """End a call whose read ended without a message: its client half-closed it so (400), or
    cancelled it, or its deadline passed, which end the read too, a moment before grpcio cancels the
    task. grpc core then refuses the status, the call being over (grpcio's ExecuteBatchError, which
    it drops for a call its client closed): counted as given up (:func:`_given_up`). Always raises."""
    try:
        await context.abort(_CODES[400], "the call ended without a request message")
    except grpc.aio.AbortError:  # (the status was sent)
        _service.refused(svc, _service.UNNAMED, Refused(400, "the call ended without a request message"), start)
        raise
    except Exception:
        _given_up(svc, context, _service.UNNAMED, start)
        raise


def _given_up(svc: Service, context, model: str, start: float) -> None:
    """Count a call of ``model`` that ended unanswered (``_service.abandoned``): its deadline
    passed where at most :data:`_EXPIRED_S` of it was left, else its client cancelled it."""
    remaining = context.time_remaining()
    _service.abandoned(svc, model, start, expired=remaining is not None and remaining <= _EXPIRED_S)


def _handlers(servicer) -> dict:
    """The service's method handlers, each RPC's messages (de)serialized by protobuf. Every unary RPC
    is served stream-unary (the wire does not tell the two apart), so that the wait for its message
    is timed as a request's body is (:func:`_unary`): grpcio runs a unary handler once the message
    has all arrived, and waits for it untimed. ``ModelInfer`` takes its request's bytes
    (``_Servicer.ModelInfer``)."""
    kinds = {(True, False): grpc.stream_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    handlers = {}
    for m in _SERVICE.methods:
        method, parse = getattr(servicer, m.name), getattr(pb, m.input_type.name).FromString
        write = getattr(pb, m.output_type.name).SerializeToString
        if m.client_streaming or m.server_streaming:  # (none served: the servicer's base refuses them, unread)
            handlers[m.name] = kinds[m.client_streaming, m.server_streaming](
                method, request_deserializer=parse, response_serializer=write)
            continue
        if m.name != "ModelInfer":
            method = _unary(servicer.svc, method, parse, m.input_type.name)
        handlers[m.name] = grpc.stream_unary_rpc_method_handler(method, response_serializer=write)
    return handlers


def _unary(svc: Service, method, parse, name: str):
    """A stream-unary handler running ``method(request, context)`` on the call's one message, parsed
    by ``parse``: the call ends ``DEADLINE_EXCEEDED`` where the message does not arrive within
    ModelInfer's bound (:func:`_message`), ``UNAVAILABLE`` where the server begins to stop first,
    ``INVALID_ARGUMENT`` where it ends without one or ``parse`` cannot read it. Not counted in the
    metrics, as HTTP's requests other than inference are not (but over ``--grpc-max-calls``)."""
    async def handler(requests, context):
        if not _admitted(svc, context):
            await _over_cap(svc, context)
        try:
            data = await _message(svc, context)
            if data is grpc.aio.EOF:
                raise Refused(400, "the call ended without a request message")
            try:
                request = parse(data)
            except DecodeError as e:
                raise Refused(400, f"the request message is not a {name}: {e}") from None
        except Refused as e:
            await context.abort(_CODES[e.status], str(e))
        return await method(request, context)

    return handler


async def _message(svc: Service, context):
    """The call's request message as bytes (grpc.aio.EOF where it ended without one), or
    :class:`Refused`: 408 where it has not all arrived within the time the largest takes at the
    minimum rate (``_service.arrival``), 503 where the server begins to stop first."""
    return await _service.arrival(svc, lambda clock: context.read(), whole=True)


_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
_RAW_INPUT_CONTENTS = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
_NAMES = {pb.ModelInferRequest.DESCRIPTOR.fields_by_name[f].number for f in ("model_name", "model_version")}


def _split(data: bytes) -> tuple[bytes, list[memoryview], bytes]:
    """A serialized ModelInferRequest in three: its fields but ``raw_input_contents`` (``data``
    itself where it has none), each ``raw_input_contents`` as a view of ``data`` (protobuf's message
    holds a copy of each, and reading one from it makes another), and its ``model_name`` and
    ``model_version`` fields
    (read before the rest, whose parse may go off the event loop). Top-level fields only, in order,
    so that protobuf reads the first part as it read the whole. ValueError where ``data`` is not
    protobuf's wire format (groups, a field number 0, a field past the end)."""
    view, n, at = memoryview(data), len(data), 0
    rest, raw, head = [], [], []
    while at < n:
        begin = at
        key, at = _varint(view, at, n)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ValueError(f"a field at byte {begin} has number 0")
        if wire == 0:
            at = _varint(view, at, n)[1]
        elif wire == 1 or wire == 5:
            at += 8 if wire == 1 else 4
        elif wire == 2:
            length, at = _varint(view, at, n)
            at += length
            if field == _RAW_INPUT_CONTENTS and at <= n:
                raw.append(view[at - length:at])
                continue
        else:
            raise ValueError(f"field {field} at byte {begin} has wire type {wire} (groups are not taken)")
        if at > n:
            raise ValueError(f"field {field} at byte {begin} runs past the message's end ({n} bytes)")
        rest.append(view[begin:at])
        if field in _NAMES:
            head.append(view[begin:at])
    return (data if not raw else b"".join(rest)), raw, b"".join(head)


def _varint(view: memoryview, at: int, n: int) -> tuple[int, int]:
    """(the varint at byte ``at`` of ``view``, the byte after it)."""
    value = shift = 0
    while at < n and shift < 64:
        b = view[at]
        at += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, at
        shift += 7
    raise ValueError(f"a varint runs past {'the message' if at >= n else '10 bytes'} at byte {at}")


def _parse(rest: bytes):
    """The ``ModelInferRequest`` of :func:`_split`'s first part; :class:`Refused` (400) where protobuf
    cannot read it."""
    try:
        return pb.ModelInferRequest.FromString(rest)
    except DecodeError as e:
        raise Refused(400, f"the request message is not a ModelInferRequest: {e}") from None


def _read(rest: bytes, raw: list[memoryview], outputs: tuple[str, ...], hold=None):
    """(the request, its inputs by name, parameters, the outputs to send) from :func:`_split`'s
    parts (:func:`_parse`, then :func:`_request`), on one thread."""
    request = _parse(rest)
    return (request, *_request(request, raw, outputs, hold))


def _response(request, reply: dict, out: dict, names: list[str]):
    """The ``ModelInferResponse`` of ``request``: the outputs ``names`` of ``out``, raw, and the
    response parameters ``reply``."""
    response = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
    for key, value in reply.items():
        response.parameters[key].int64_param = value
    for name in names:
        a = out[name]
        datatype = "BYTES" if a.dtype.kind in "US" else _tensors.DATATYPES[str(a.dtype)]
        response.outputs.add(name=name, datatype=datatype, shape=list(a.shape))
        response.raw_output_contents.append(_tensors.tensor_bytes(a))
    return response


async def _checked(context, fn, *args):
    """``fn(*args)``, or the call aborted with the status of the :class:`Refused` it raises."""
    try:
        return fn(*args)
    except Refused as e:
        await context.abort(_CODES[e.status], str(e))


_SEND_RAW = "send fewer values or BYTES elements a request, or numbers as raw_input_contents"
_HOLD_ANSWER = 256 << 10  # an answer's bytes past which it is held until sent (HTTP's _SEND_AT_ONCE)


def _request(request, raw: list, outputs: tuple[str, ...], hold=None) -> tuple[dict[str, np.ndarray], dict, list[str]]:
    """(the inputs by name, the parameters, the outputs to send in ``outputs`` order) of a
    ``ModelInferRequest`` whose ``raw_input_contents`` are ``raw`` (bytes-like each; the message's
    own are not read); :class:`Refused` (400) naming what is malformed. ``hold(nbytes)``: called
    with what reading BYTES elements and typed contents takes, before they are read."""
    try:
        if raw and len(raw) != len(request.inputs):
            raise ValueError(f"the request has {len(request.inputs)} inputs but {len(raw)} raw_input_contents; "
                             f"give every input's data raw, or none")
        inputs = {}
        for i, t in enumerate(request.inputs):
            shape = _tensors.check_input(inputs, t.name, list(t.shape), t.datatype)
            if raw:
                inputs[t.name] = _tensors.tensor_from_bytes(t.name, memoryview(raw[i]), shape, t.datatype, hold)
            elif t.datatype in _CONTENTS:
                values = getattr(t.contents, _CONTENTS[t.datatype])
                if t.datatype == "BYTES":
                    if hold is not None:
                        hold(_tensors.string_bytes(len(values), t.contents.ByteSize()))
                    inputs[t.name] = _tensors.tensor_from_strings(t.name, list(values), shape, hold)
                else:
                    inputs[t.name] = _tensors.tensor_from_numbers(t.name, values, shape, t.datatype, hold)
            else:
                raise ValueError(f"input {t.name}: {t.datatype} data must come as raw_input_contents")
        params = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in request.parameters.items()
                  if v.WhichOneof("parameter_choice")}
        asked = [o.name for o in request.outputs]
        unknown = [n for n in asked if n not in outputs]
        if unknown:
            raise ValueError(f"unknown output {unknown[0]!r}; this model has {', '.join(outputs)}")
        names = [n for n in outputs if not asked or n in asked]
    except ValueError as e:
        raise Refused(400, str(e)) from None
    return inputs, params, names
