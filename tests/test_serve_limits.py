"""``lik serve``'s server-wide caps (CPU path, a real server on loopback): the HTTP connections
(``--max-connections``) and the gRPC calls (``--grpc-max-calls``) one server process serves at
once. Over them a request is refused (HTTP 503, gRPC RESOURCE_EXHAUSTED), counted in the metrics,
and the server serves again once some have ended."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from lik_command import run_lik
from served import Server, random_shard

DIM = 16


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    return random_shard(tmp_path_factory.mktemp("serve_limits") / "shard0", 43, 50, DIM)


def _get(c: http.client.HTTPConnection, path: str = "/v2/health/live") -> int:
    return _response(c, path)[0]


def _response(c: http.client.HTTPConnection, path: str) -> tuple[int, dict, bytes]:
    c.request("GET", path)
    r = c.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def _sample(text: str, name: str, **labels) -> float:
    """The value of the sample ``name{labels}`` in the Prometheus ``text``; 0.0 where it has none
    (as ``Server.metric`` reads it, from a connection of the caller's)."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        got, _, rest = sample.partition("{")
        if got == name and set(rest.rstrip("}").split(",")) == want:
            return float(value)
    return 0.0


def _until(condition, what: str, timeout: float = 30.0):
    """Wait until ``condition()`` is neither None nor False (its value); AssertionError naming ``what``
    after ``timeout`` s."""
    until = time.monotonic() + timeout
    while (got := condition()) is None or got is False:  # (a grpc.RpcError is false)
        assert time.monotonic() < until, f"{what} within {timeout} s"
        time.sleep(0.05)
    return got


def test_http_connections_over_the_cap_are_refused_503(shard):
    """uvicorn serves any number of connections unless told (limit_concurrency unset), each holding a
    protocol, its buffers and a request's task. With --max-connections N, a request that comes while
    more than N are open is answered 503 (closing its connection); the N are served, and the server
    serves a new one once the count is back within the cap. uvicorn's refusal (limit_concurrency)
    was plain text, and counted nowhere: it is the protocol's JSON error now, counted under no model."""
    server = Server(shard, "--devices", "cpu", "--max-connections", 2)
    a, b, c = (http.client.HTTPConnection("127.0.0.1", server.port, timeout=60) for _ in range(3))
    try:
        assert _get(a) == 200 and _get(b) == 200  # (two connections open, kept alive)
        status, head, body = _response(c, "/v2/health/live")  # (a third)
        assert status == 503
        assert head["connection"] == "close" and head["retry-after"] == "1", head
        assert json.loads(body) == {"error": "the server serves 2 connections at once, and more are open; retry later"}
        c.close()
        a.close()
        refused = [1]  # (the 503s seen: each new connection below is refused until the server has seen c close)

        def served() -> bool:
            status = server.get("/v2/health/ready")[0]
            refused[0] += status == 503
            return status == 200

        _until(served, "a new connection served once the 503 closed its own")  # (b and it: two again)
        status, _, text = _response(b, "/metrics")
        assert status == 200
        assert _sample(text.decode(), "lik_serve_rejected_total", model="", reason="max_connections") == refused[0]
        assert _sample(text.decode(), "lik_serve_responses_total", model="", code="503") == refused[0]
        b.close()
        # (a new connection, once the server has seen b close: the cap holds open connections)
        _until(lambda: server.get("/v2/health/ready")[0] == 200, "a new connection served")
    finally:
        for x in (a, b, c):
            x.close()
        log = server.stop()
    assert server.proc.returncode == 0, log


def test_grpc_calls_over_the_cap_are_refused_resource_exhausted(shard):
    """grpcio serves any number of calls at once unless told (maximum_concurrent_rpcs unset): a
    connection's cap (--grpc-max-streams) times connections without end. With --grpc-max-calls N, a
    call that comes while N are in progress is refused RESOURCE_EXHAUSTED, and served once one ends.
    grpcio's refusal (maximum_concurrent_rpcs) came before any handler and was counted nowhere: each
    is counted now, under no model (its message, which names one, unread)."""
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("lik_cupy.serving.grpc")
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    server = Server(shard, "--devices", "cpu", "--grpc-port", 0, "--grpc-max-calls", 2)
    sent = threading.Event()

    def nothing():  # (a call's message, never sent until `sent`)
        sent.wait(120)
        return
        yield

    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    live = rpc.GRPCInferenceServiceStub(channel).ServerLive
    waiting = channel.stream_unary("/inference.GRPCInferenceService/ServerReady",
                                   request_serializer=pb.ServerReadyRequest.SerializeToString,
                                   response_deserializer=pb.ServerReadyResponse.FromString)
    refusals = 0
    try:
        held = [waiting.future(nothing(), timeout=120) for _ in range(2)]

        def refused():
            nonlocal refusals
            for i, call in enumerate(held):  # (one refused while a probe was in progress: again)
                if call.done():
                    assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, call.exception()
                    refusals += 1
                    held[i] = waiting.future(nothing(), timeout=120)
            try:
                live(pb.ServerLiveRequest(), timeout=30)
            except grpc.RpcError as e:
                refusals += 1
                return e
            return None

        e = _until(refused, "a call over the cap refused")
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        server.wait_metric("lik_serve_rejected_total", refusals, model="", reason="max_calls")
        server.wait_metric("lik_serve_responses_total", refusals, model="", code="503")
        assert e.details() == "the server serves 2 gRPC calls at once, and as many are in progress; retry later"
        sent.set()  # (the two calls end, without a message: INVALID_ARGUMENT)
        for call in held:
            with pytest.raises(grpc.RpcError) as ended:
                call.result(60)
            assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ended.value
        assert live(pb.ServerLiveRequest(), timeout=30).live
    finally:
        sent.set()
        channel.close()
        log = server.stop()
    assert server.proc.returncode == 0, log


def test_the_caps_are_checked(shard):
    r = run_lik("serve", "--help")
    assert "--max-connections" in r.output and "--grpc-max-calls" in r.output, r.output
    for option in ("--max-connections", "--grpc-max-calls"):
        r = run_lik("serve", str(shard), option, "0")
        assert r.exit_code == 2 and option in r.output, r.output
    from lik_cupy.serving import _service

    with pytest.raises(ValueError, match="max_connections"):
        _service.check_limits(10.0, 30.0, 0, max_connections=0)
    with pytest.raises(ValueError, match="grpc_max_calls"):
        _service.check_limits(10.0, 30.0, 0, grpc_max_calls=True)


def test_the_default_caps_admit_a_full_queue():
    """A cap below what the batcher queues would refuse requests that it takes: the defaults admit a
    full queue of --max-queue on every worker (eight where the devices are not named)."""
    pytest.importorskip("uvicorn")
    from lik_cupy.serving import http

    assert http._caps(None, None, 1024, None) == (8192, 8192)
    assert http._caps(None, None, 4096, ["cpu", "cpu"]) == (8192, 8192)
    assert http._caps(None, None, 1024, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]) == (10240, 10240)
    assert http._caps(5, 7, 1 << 20, None) == (5, 7)

