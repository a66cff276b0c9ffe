"""``lik serve`` and clients that send slowly, or too much before their body (CPU path, a real server
on loopback): a body that stops arriving or trickles is answered 408 and gives back what it held of
the server's budget; headers that never finish are answered 408, and headers without end 431; a gRPC
message that never arrives is refused, and does not keep the server from stopping; gRPC's raw
contents are read in place; a large answer is sent in slices of its arrays, uncopied, and a client
that stops taking it is dropped."""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import signal
import socket
import threading
import time

import numpy as np
import pytest

from lik_cupy import shards
import http2
from served import ROOT, Server, random_shard

DIM = 16
SLOW_SERVED = ROOT / "tests" / "slow_served.py"
_SMALL = json.dumps({"inputs": [{"name": "Q", "shape": [2, DIM], "datatype": "FP32", "data": [0.5] * 2 * DIM}]}).encode()


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    return random_shard(tmp_path_factory.mktemp("serve_slow_clients") / "shard0", 41, 100, DIM)


def _begin(port: int, length: int, body: bytes = b"", head: bytes = b"") -> socket.socket:
    """A connection that has sent an inference request's headers (Content-Length ``length``) and
    ``body``, the start of its body."""
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(b"POST /v2/models/score/infer HTTP/1.1\r\nHost: lik\r\n" + head
              + b"Content-Length: %d\r\n\r\n" % length + body)
    return c


def _answer(c: socket.socket, timeout: float = 60, closing: bool = True) -> tuple[int, dict, bytes, bool]:
    """(status, headers, body, whether the server then closed the connection: ``closing``, else
    False unread) of the answer on ``c``."""
    c.settimeout(timeout)
    r = http.client.HTTPResponse(c)
    r.begin()
    status, head, body = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    return status, head, body, closing and _closed_unanswered(c, timeout)


def _closed_unanswered(c: socket.socket, timeout: float = 60) -> bool:
    c.settimeout(timeout)
    try:
        return c.recv(1) == b""
    except ConnectionResetError:
        return True


def _closed(c: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``c`` within ``timeout`` seconds (whatever it sends first)."""
    c.settimeout(timeout)
    try:
        while c.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_bodies_that_stop_arriving_are_answered_408_and_give_back_the_budget():
    """A body being read holds what has arrived of it against the server's budget (16 bodies' worth):
    16 clients that each sent all but a byte of a body and stopped held it whole, and every other
    request got 503, for as long as they stayed connected. Each is answered 408 now, once nothing
    of it has arrived for --body-timeout seconds, and the connection closes; then the others are
    served again. The metrics name why each was refused: the 503 was counted by its status alone."""
    limit = 64 << 10
    server = Server(0, "--max-body-bytes", limit, "--body-timeout", 5, "--body-min-rate", 0, script=SLOW_SERVED)
    stalled = []
    try:
        for _ in range(16):
            stalled.append(_begin(server.port, limit, b" " * (limit - 1)))
        until = time.monotonic() + 60
        while (status := server.infer("score", _SMALL)[0]) != 503:  # (once the server has read the 16 bodies)
            assert status == 200 and time.monotonic() < until, status
            time.sleep(0.01)
        for c in stalled:
            status, head, body, closed = _answer(c)
            assert status == 408 and head["connection"] == "close" and closed, (status, head, body)
            assert json.loads(body)["error"] == f"the request's body stopped arriving: nothing for 5 s, after {limit - 1} bytes"
        status, _, body = server.infer("score", _SMALL)
        assert status == 200, body
        assert server.metric("lik_serve_responses_total", model="score", code="408") == 16
        assert server.metric("lik_serve_rejected_total", model="score", reason="body_timeout") == 16
        assert server.metric("lik_serve_responses_total", model="score", code="503") == 1
        assert server.metric("lik_serve_rejected_total", model="score", reason="budget") == 1
    finally:
        for c in stalled:
            c.close()
        server.stop()


def test_a_trickled_body_is_answered_408_below_the_minimum_rate(shard):
    """A client that sends a byte now and then, never waiting --body-timeout, held its body's share
    of the budget for as long as it kept on; past --body-timeout, a body must average
    --body-min-rate bytes a second."""
    server = Server(shard, "--devices", "cpu", "--body-timeout", 1, "--body-min-rate", 1000)
    c = _begin(server.port, 100_000, b"{")
    answered = threading.Event()

    def trickle():
        while not answered.is_set():
            try:
                c.sendall(b" ")
            except OSError:
                return
            time.sleep(0.1)

    t = threading.Thread(target=trickle)
    t.start()
    try:
        status, head, body, closed = _answer(c)
        answered.set()
        assert status == 408 and closed, (status, body)
        assert "the request's body arrives too slowly" in json.loads(body)["error"], body
        assert "the server takes 1000 bytes a second at least" in json.loads(body)["error"], body
    finally:
        answered.set()
        t.join(60)
        c.close()
        server.stop()


def test_a_body_faster_than_the_minimum_rate_is_answered_however_long_it_takes(shard):
    """The rate is an average since the body began: a body that takes several --body-timeout's but
    keeps above it is read and answered."""
    server = Server(shard, "--devices", "cpu", "--body-timeout", 2, "--body-min-rate", 1000)
    body = _SMALL[:-1] + b" " * 30_000 + b"}"  # (JSON takes the spaces; 30 kB in 3 s, 10 times the rate)
    c = _begin(server.port, len(body))
    try:
        for at in range(0, len(body), 250):
            c.sendall(body[at:at + 250])
            time.sleep(0.025)
        status, _, out, _ = _answer(c)
        assert status == 200 and len(json.loads(out)["outputs"][0]["data"]) == 100, out[:300]
    finally:
        c.close()
        server.stop()


def test_headers_that_never_finish_are_answered_408_and_closed(shard):
    """uvicorn timed only an idle connection after an answer (its keep-alive, which any byte puts
    off): a connection that sent nothing, or part of a request's headers, or a byte of them now and
    then, stayed open for as long as its client did. The 408s are counted (they were not), under no
    model: the request was not read."""
    server = Server(shard, "--devices", "cpu", "--header-timeout", 1)
    partial = socket.create_connection(("127.0.0.1", server.port))
    silent = socket.create_connection(("127.0.0.1", server.port))
    kept = socket.create_connection(("127.0.0.1", server.port))
    answered = threading.Event()
    try:
        partial.sendall(b"POST /v2/models/score/infer HTTP/1.1\r\nHost: lik\r\n")
        kept.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: lik\r\n\r\n")
        assert _answer(kept, closing=False)[0] == 200

        def trickle():  # (the next request's headers, a byte at a time after the answer)
            for b in b"GET /v2/health/live HTTP/1.1\r\nHost: lik\r\n":
                if answered.wait(0.2):
                    return
                try:
                    kept.sendall(bytes([b]))
                except OSError:
                    return

        t = threading.Thread(target=trickle)
        t.start()
        for c in (partial, kept):
            status, head, body, closed = _answer(c)
            assert status == 408 and closed, (status, body)
            assert json.loads(body) == {"error": "the request's headers had not all arrived after 1 s"}
        answered.set()
        t.join(60)
        assert _closed_unanswered(silent)
        assert server.infer("score", _SMALL)[0] == 200
        assert server.metric("lik_serve_rejected_total", model="", reason="header_timeout") == 2
        assert server.metric("lik_serve_responses_total", model="", code="408") == 2  # (the silent one: no answer)
    finally:
        answered.set()
        for c in (partial, silent, kept):
            c.close()
        server.stop()


def test_headers_past_the_limit_are_answered_431_and_closed(shard):
    """httptools takes headers of any size, and uvicorn kept each: one connection sending header
    lines without end grew the server by all of them. Past 64 KiB they are refused now, and counted
    under no model."""
    server = Server(shard, "--devices", "cpu")
    try:
        status, _, body = server.infer("score", _SMALL, {f"X-Pad-{i}": "a" * 1000 for i in range(10)})  # (10 kB)
        assert status == 200, body
        line = b"POST /v2/models/score/infer HTTP/1.1\r\nHost: lik\r\n"
        # (unfinished, one byte over: the server reads every byte sent before it refuses them, so that
        # it closes the connection with none unread, which would reset it, the answer perhaps lost)
        headers = line + b"X-Pad: " + b"a" * (65536 + 1 - len(line) - 7)
        c = socket.create_connection(("127.0.0.1", server.port))
        try:
            c.sendall(headers)
            status, head, body, closed = _answer(c)
            assert status == 431 and closed, (status, body)
            assert json.loads(body) == {"error": "the request's line and headers take over 65536 bytes"}
        finally:
            c.close()
        assert server.infer("score", _SMALL)[0] == 200
        assert server.metric("lik_serve_rejected_total", model="", reason="header_size") == 1
        assert server.metric("lik_serve_responses_total", model="", code="431") == 1
    finally:
        server.stop()


@pytest.mark.parametrize("refused", ["headers too slow", "body too slow", "headers too long"])
def test_a_client_still_sending_reads_its_refusal_before_the_connection_closes(shard, refused):
    """A connection refused with 408 or 431 was closed at once, its client still sending: the
    server's kernel then resets it, and a client that sends its whole request before it reads (as
    most do) met the reset on its next send, never reading the answer. The server now sends its
    answer and its end of the stream, and reads and drops what still comes (1 MiB at most, for 2 s
    at most) before it closes."""
    line = b"POST /v2/models/score/infer HTTP/1.1\r\nHost: lik\r\n"
    if refused == "headers too slow":
        server = Server(shard, "--devices", "cpu", "--header-timeout", 1)
        c = socket.create_connection(("127.0.0.1", server.port))
        c.sendall(line + b"X-Pad: ")
        piece, pause, status = b"a", 0.05, 408
    elif refused == "body too slow":
        server = Server(shard, "--devices", "cpu", "--body-timeout", 1, "--body-min-rate", 1000)
        c = _begin(server.port, 100_000, b"{")
        piece, pause, status = b" ", 0.05, 408
    else:
        server = Server(shard, "--devices", "cpu")
        c = socket.create_connection(("127.0.0.1", server.port))
        c.sendall(line + b"X-Pad: " + b"a" * (65536 + 1 - len(line) - 7))
        piece, pause, status = b"a" * (16 << 10), 0.01, 431
    try:
        until = time.monotonic() + 60
        while not select.select([c], [], [], pause)[0]:  # (until the answer has arrived, unread)
            assert time.monotonic() < until, "no answer within 60 s"
            c.sendall(piece)
        for i in range(20):  # (the rest of the request, 320 KiB at most)
            try:
                c.sendall(piece)
            except OSError as e:
                raise AssertionError(f"the connection was reset under its client, at send {i + 1} after the "
                                     f"answer arrived: {e!r}") from None
            time.sleep(pause)
        got, head, body, closed = _answer(c)
        assert got == status and head["connection"] == "close" and closed, (got, head, body)
        # Then the server closes, its bounds reached: sending more fails (the reset)
        sent, until = 0, time.monotonic() + 60
        with pytest.raises(OSError):
            while sent < 64 << 20 and time.monotonic() < until:
                c.sendall(piece)
                sent += len(piece)
                time.sleep(pause if status == 408 else 0)
    finally:
        c.close()
        server.stop()


def _grpc_waiting_call(port: int, sent: threading.Event):
    """A ModelInfer call that sends its headers and no message until ``sent`` is set (grpcio's
    client-streaming form of the method: the wire is the same), with a deadline of 120 s."""
    grpc = pytest.importorskip("grpc")
    from tritonclient.grpc import service_pb2 as pb

    def messages():
        sent.wait(120)
        return
        yield

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=pb.ModelInferRequest.SerializeToString,
                                response_deserializer=pb.ModelInferResponse.FromString)
    return channel, call.future(messages(), timeout=120)


def test_a_grpc_message_that_never_arrives_is_refused(shard):
    """grpc core holds what has arrived of a call's message, out of the server's budget, and waited
    for the rest for as long as the call lasted (a partial message of 59 MiB, for 100 s and more). A
    message must arrive within the time the largest takes at --body-min-rate (--body-timeout at
    least). It is counted as HTTP's 408s are."""
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("lik_cupy.serving.grpc")
    server = Server(shard, "--devices", "cpu", "--grpc-port", 0, "--body-timeout", 1, "--body-min-rate", 1 << 30)
    sent = threading.Event()
    channel, future = _grpc_waiting_call(server.grpc_port, sent)
    try:
        with pytest.raises(grpc.RpcError) as e:
            future.result(120)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert e.value.details().startswith("the request message had not all arrived after 1 s"), e.value.details()
        # (counted as HTTP's 408 is, under no model: the message names it)
        server.wait_metric("lik_serve_responses_total", 1.0, model="", code="408")
        assert server.metric("lik_serve_rejected_total", model="", reason="body_timeout") == 1
    finally:
        sent.set()
        channel.close()
        server.stop()


def test_a_partial_message_of_any_grpc_call_is_refused(shard):
    """grpcio serves a unary RPC once its message has all arrived, and waits for it untimed: a client
    that sent 1 KiB of a declared 1 MiB ServerLive message kept its call, what had arrived, and its
    connection (closed only without calls) for as long as it stayed. Every RPC's message has
    ModelInfer's bound now (DEADLINE_EXCEEDED), and the calls that send theirs are answered."""
    pytest.importorskip("lik_cupy.serving.grpc")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    server = Server(shard, "--devices", "cpu", "--grpc-port", 0, "--body-timeout", 1, "--body-min-rate", 1 << 30)
    c = http2.Connection(server.grpc_port)
    partial = b"\x00" + (1 << 20).to_bytes(4, "big") + bytes(1024)  # (a message's prefix: uncompressed, its length)
    methods = {1: "ServerLive", 3: "ModelMetadata", 5: "RepositoryIndex", 7: "ModelInfer"}
    try:
        c.settings()
        c.send(*(f for stream, method in methods.items()
                 for f in (http2.frame(http2.HEADERS, http2.END_HEADERS, stream, http2.call_headers(method)),
                           http2.frame(http2.DATA, 0, stream, partial))))
        ended = c.trailers(methods, timeout=60)
        for stream, method in methods.items():
            assert ended[stream].get("grpc-status") == "4", (method, ended[stream])  # DEADLINE_EXCEEDED
            assert ended[stream]["grpc-message"].startswith("the request message had not all arrived after 1 s"), \
                (method, ended[stream])
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        assert client.is_server_live() and client.is_model_ready("score")
        assert client.get_model_metadata("score").name == "score"
        client.close()
    finally:
        c.close()
        server.stop()


def test_a_grpc_connection_without_calls_is_closed_at_the_header_timeout(shard):
    """grpc core waits 60 s for a connection's HTTP/2 preface unless told; it is told --header-timeout.
    And it kept a connection that never made a call, or made none since, for as long as its client
    did (grpc.max_connection_idle_ms unset): it closes after --header-timeout too, as HTTP's."""
    pytest.importorskip("lik_cupy.serving.grpc")
    server = Server(shard, "--devices", "cpu", "--grpc-port", 0, "--header-timeout", 1)
    silent = socket.create_connection(("127.0.0.1", server.grpc_port))
    half = socket.create_connection(("127.0.0.1", server.grpc_port))
    idle = http2.Connection(server.grpc_port)
    try:
        half.sendall(b"PRI * HTTP/2.0\r\n")
        idle.settings()
        assert _closed(silent, 30) and _closed(half, 30)  # (after grpc core's SETTINGS, its preface)
        assert _closed(idle.sock, 30)  # (after its GOAWAY)
    finally:
        silent.close()
        half.close()
        idle.close()
        server.stop()


def test_sigterm_refuses_a_grpc_call_whose_message_has_not_arrived(shard):
    """The gRPC server gives the calls it accepted 300 s to finish as it stops, and one whose
    message never came kept it that long; it is refused at once now, as HTTP's half-sent bodies are."""
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("lik_cupy.serving.grpc")
    server = Server(shard, "--devices", "cpu", "--grpc-port", 0)
    sent = threading.Event()
    channel, future = _grpc_waiting_call(server.grpc_port, sent)
    try:
        assert not future.done() and server.get("/v2/health/ready")[0] == 200  # (by then the call has begun)
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
        with pytest.raises(grpc.RpcError) as e:
            future.result(60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "had not all arrived" in e.value.details()
    finally:
        sent.set()
        channel.close()
        log = server.stop()
    assert server.proc.returncode == 0 and "stopped; answered 0 of 0 accepted requests" in log, log


def _model_infer_requests(rng):
    """Random ModelInferRequests (every field, raw contents or typed), and their wire bytes with the
    top-level fields in a random order (protobuf reads any order, repeated fields in theirs)."""
    from tritonclient.grpc import service_pb2 as pb

    for i in range(300):
        r = pb.ModelInferRequest(model_name=["score", "rerank", "é"][i % 3], model_version=str(i % 2), id=f"r{i}")
        raw = i % 2 == 0
        for j in range(int(rng.integers(0, 4))):
            t = r.inputs.add(name=f"X{j}", datatype="FP32", shape=[int(rng.integers(0, 5))])
            values = rng.standard_normal(t.shape[0]).astype(np.float32)
            if raw:
                r.raw_input_contents.append(values.tobytes() + bytes(int(rng.integers(0, 3)) * 200))
            else:
                t.contents.fp32_contents.extend(values.tolist())
        for j in range(int(rng.integers(0, 3))):
            r.outputs.add(name=f"Y{j}")
        r.parameters["timeout"].int64_param = int(rng.integers(0, 2**40))
        fields = []
        for field, value in r.ListFields():
            one = pb.ModelInferRequest()
            if isinstance(value, (str, bytes, int, float)):
                setattr(one, field.name, value)
            else:  # (repeated fields and the parameters' map)
                getattr(one, field.name).MergeFrom(value)
            fields.append(one.SerializeToString())
        if rng.random() < 0.5:  # (repeated fields split into several runs)
            fields.append(pb.ModelInferRequest(raw_input_contents=[b"more"] if raw else []).SerializeToString())
            r.raw_input_contents.extend([b"more"] if raw else [])
        order = rng.permutation(len(fields))
        yield r, b"".join(fields[k] for k in order), order


def test_grpc_messages_are_split_as_protobuf_reads_them():
    """The split that reads raw contents in place: the rest parses to the message without them, the
    raw contents are the message's, in order; a truncated or malformed message is refused where
    protobuf refuses it."""
    serving_grpc = pytest.importorskip("lik_cupy.serving.grpc")
    from google.protobuf.message import DecodeError
    from tritonclient.grpc import service_pb2 as pb

    rng = np.random.default_rng(42)
    for r, data, _ in _model_infer_requests(rng):
        rest, raw, head = serving_grpc._split(data)
        whole = pb.ModelInferRequest.FromString(data)
        assert [bytes(x) for x in raw] == list(whole.raw_input_contents)
        without = pb.ModelInferRequest()
        without.CopyFrom(whole)
        del without.raw_input_contents[:]
        assert pb.ModelInferRequest.FromString(rest) == without
        named = pb.ModelInferRequest.FromString(head)
        assert (named.model_name, named.model_version) == (whole.model_name, whole.model_version)
        for cut in rng.integers(1, len(data), 3) if len(data) > 1 else ():
            try:
                pb.ModelInferRequest.FromString(data[:cut])
                refused = False
            except DecodeError:
                refused = True
            try:
                rest, _, head = serving_grpc._split(data[:cut])
                pb.ModelInferRequest.FromString(rest)
                ours = False
            except (ValueError, DecodeError):
                ours = True
            assert ours == refused, (r, cut)
    for bad in (b"\x0b", b"\x00\x01", b"\x3a\x05ab", b"\x3a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"):
        with pytest.raises(ValueError):
            serving_grpc._split(bad)


def test_grpc_raw_contents_are_read_in_place():
    """``list(request.raw_input_contents)`` copied each raw input out of the message (about the
    message again, 128 MiB here, counted nowhere); the inputs are views of the message's bytes now."""
    import tracemalloc

    serving_grpc = pytest.importorskip("lik_cupy.serving.grpc")
    from tritonclient.grpc import service_pb2 as pb

    q = np.random.default_rng(43).standard_normal((8, 4096, DIM)).astype(np.float32)
    r = pb.ModelInferRequest(model_name="score", raw_input_contents=[q.tobytes()])
    r.inputs.add(name="Q", datatype="FP32", shape=list(q.shape))
    data = r.SerializeToString()
    tracemalloc.start()
    try:
        rest, raw, _ = serving_grpc._split(data)
        _, inputs, _, _ = serving_grpc._read(rest, raw, ("SCORES",))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(inputs["Q"], q)
    assert peak < len(data) / 16


def test_a_large_answer_is_sent_in_slices_of_its_arrays_uncopied(shard):
    """A binary answer was copied out of its array (tobytes) and joined with its header (another
    copy) on the event loop, then written at once: a 189 MB one held every other client 0.17 s.
    It goes now as slices (1 MiB at most) of views of its arrays, under a Content-Length that is
    their sum, each slice sent once the connection has taken the last."""
    import tracemalloc

    from lik_cupy.serving import _service, _tensors, http

    scores = np.random.default_rng(44).standard_normal((300, 10_000)).astype(np.float32)  # (12 MB)
    tracemalloc.start()
    try:
        pieces, n = _tensors.write_response({"model_name": "score"}, [("SCORES", scores)], {"SCORES"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < scores.nbytes / 16

    sent, held = [], []
    svc = _service.Service(load=None)

    async def send(message):
        sent.append(message)
        held.append(svc.held)
        await asyncio.sleep(0)

    asyncio.run(http._send(send, 200, pieces, (), svc, {}))
    assert held[1:] == [n + scores.nbytes] * (len(sent) - 1) and svc.held == 0  # (the answer, until sent)
    start, *bodies = sent
    length = int(dict(start["headers"])[b"content-length"])
    assert length == sum(len(b["body"]) for b in bodies) == n + scores.nbytes
    assert len(bodies) > 10 and all(len(b["body"]) <= 1 << 20 for b in bodies)
    assert all(b.get("more_body") for b in bodies[:-1]) and not bodies[-1].get("more_body")
    body = b"".join(bytes(b["body"]) for b in bodies)
    assert json.loads(body[:n])["outputs"][0]["parameters"] == {"binary_data_size": scores.nbytes}
    assert body[n:] == scores.tobytes()


def test_a_client_that_stops_taking_a_large_answer_is_dropped(tmp_path):
    """A client that asked for a large answer and read none of it held that answer in the server's
    memory (out of its budget), and kept SIGTERM from stopping it, for as long as it stayed
    connected. An answer must be taken as a body must arrive (--body-timeout, --body-min-rate): the
    connection is dropped past them, counted (beside the answer's 200), and the server stops."""
    rng = np.random.default_rng(46)
    wide = tmp_path / "wide"
    shards.pack_arrays(list(rng.standard_normal((20_000, 1, DIM)).astype(np.float32)), wide)
    q = rng.standard_normal((700, 1, DIM)).astype(np.float32)  # (56 MB of scores: more than sockets hold)
    header = json.dumps({"inputs": [{"name": "Q", "shape": list(q.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": q.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()
    server = Server(wide, "--devices", "cpu", "--body-timeout", 1)
    c = socket.create_connection(("127.0.0.1", server.port))
    try:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        c.sendall(b"POST /v2/models/score/infer HTTP/1.1\r\nHost: lik\r\nInference-Header-Content-Length: %d\r\n"
                  b"Content-Length: %d\r\n\r\n" % (len(header), len(header) + q.nbytes) + header + q.tobytes())
        c.settimeout(60)
        assert c.recv(15) == b"HTTP/1.1 200 OK"  # (and no more read)
        server.wait_line("the client stopped taking its answer: nothing for 1 s", timeout=60)
        assert server.metric("lik_serve_rejected_total", model="score", reason="answer_timeout") == 1
        assert server.metric("lik_serve_responses_total", model="score", code="200") == 1
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
        got = 15
        try:
            while chunk := c.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        assert got < q.shape[0] * 20_000 * 4  # (dropped before the whole answer)
    finally:
        c.close()
        log = server.stop()
    assert server.proc.returncode == 0 and "answered 1 of 1 accepted requests" in log, log


def test_a_large_binary_answer_arrives_whole_over_http(shard):
    """The same answer from a real server, read by a client: its Content-Length and bytes, while
    small requests are answered on other connections."""
    import lik_cupy

    local = lik_cupy.Corpus.from_shards(shard, device="cpu")
    q = np.random.default_rng(45).standard_normal((3000, 2, DIM)).astype(np.float32)  # (1.2 MB of scores)
    header = json.dumps({"inputs": [{"name": "Q", "shape": list(q.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": q.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()
    server = Server(shard, "--devices", "cpu")
    try:
        status, head, body = server.request("POST", "/v2/models/score/infer", header + q.tobytes(),
                                            {"Inference-Header-Content-Length": str(len(header))})
        assert status == 200 and int(head["content-length"]) == len(body)
        n = int(head["inference-header-content-length"])
        assert np.array_equal(np.frombuffer(body[n:], "<f4").reshape(3000, -1), local.score(q))
        assert server.infer("score", _SMALL)[0] == 200
    finally:
        server.stop()


def test_body_clock_rules():
    """In process: a body that stops is refused for its gap, one that trickles for its rate, and
    the reading task's cancellation count is back at 0 (Python 3.11+); one cancelled from elsewhere
    stays cancelled; what was held is given back."""
    from lik_cupy.serving import _service, http

    async def read(pieces, pause, rate):
        svc = _service.Service(load=None, max_body_bytes=1 << 20, body_timeout=0.2, body_min_rate=rate)
        async def receive():
            if not pieces:
                await asyncio.Event().wait()
            await asyncio.sleep(pause)
            return {"type": "http.request", "body": pieces.pop(0), "more_body": True}

        held = _service.Held(svc)
        try:
            with pytest.raises(_service.Refused) as e:
                await _service.arrival(svc, lambda clock: http._body(receive, svc.max_body, held, clock))
            task = asyncio.current_task()
            return e.value, task.cancelling() if hasattr(task, "cancelling") else 0
        finally:
            held.release()
            assert svc.held == 0 and not svc.reading

    e, cancelling = asyncio.run(read([b"x" * 10], 0, 0))
    assert e.status == 408 and e.close and cancelling == 0
    assert str(e) == "the request's body stopped arriving: nothing for 0.2 s, after 10 bytes"
    e, cancelling = asyncio.run(read([b"x"] * 100, 0.05, 1000))
    assert e.status == 408 and cancelling == 0 and "arrives too slowly: " in str(e)
    svc = _service.Service(load=None, max_body_bytes=1 << 20, body_timeout=0.2)

    async def cancelled_from_outside():
        async def never():
            await asyncio.Event().wait()

        held = _service.Held(svc)
        inner = asyncio.create_task(_service.arrival(svc, lambda clock: http._body(never, svc.max_body, held, clock)))
        await asyncio.sleep(0.01)
        inner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await inner
        assert not svc.reading

    asyncio.run(cancelled_from_outside())
