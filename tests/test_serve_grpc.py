"""``lik serve --grpc-port`` on the CPU path: a real server on loopback and an unmodified
tritonclient gRPC client (the binary ``raw_input_contents`` it sends) and grpcio's own stub (typed
``contents``): answers bitwise those of in-process Corpus calls, concurrent clients, model metadata,
configuration and statistics, bad requests named with the right status code while the server keeps
serving, model versions, the size limit, deadlines and cancellations in the metrics, a port that is
taken, and SIGTERM."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import numpy as np
import pytest

import lik_cupy
import http2
from served import ROOT, Server, random_shard
from threads import run_threads

grpcclient = pytest.importorskip("tritonclient.grpc")
grpc = pytest.importorskip("grpc")
pytest.importorskip("lik_cupy.serving.grpc")

DIM = 12


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    return random_shard(tmp_path_factory.mktemp("serve_grpc") / "shard0", 21, 150, DIM, ids=np.arange(150) * 2 + 7)


@pytest.fixture(scope="module")
def served(shard):
    s = Server(shard, "--devices", "cpu,cpu", "--max-batch", "8", "--max-delay-us", "2000", "--grpc-port", "0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local(shard):
    return lik_cupy.Corpus.from_shards(shard, device="cpu")


@pytest.fixture()
def client(served):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    yield c
    c.close()


def _input(name, a, datatype):
    t = grpcclient.InferInput(name, list(a.shape), datatype)
    t.set_data_from_numpy(a)
    return t


def test_health_metadata_config_and_statistics(served, client):
    assert served.grpc_port and client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("search") and client.get_server_metadata().name == "lik-cupy"
    meta = client.get_model_metadata("rerank", as_json=True)
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == \
        [("Q", "FP32", ["-1", "-1", str(DIM)]), ("IDS", "INT64", ["-1", "-1"])]
    config = client.get_model_config("search", as_json=True)["config"]
    assert config["name"] == "search" and [i["name"] for i in config["input"]] == ["Q", "K"]
    assert config["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
    with pytest.raises(grpcclient.InferenceServerException, match="unknown model 'nope'"):
        client.get_model_metadata("nope")


def test_requests_equal_in_process_calls(client, local):
    rng = np.random.default_rng(22)
    q = rng.standard_normal((17, DIM)).astype(np.float32)
    r = client.infer("search", [_input("Q", q, "FP32"), _input("K", np.array([9], np.int32), "INT32")])
    s, i = local.search(q, 9)
    assert np.array_equal(r.as_numpy("SCORES"), s) and np.array_equal(r.as_numpy("IDS"), i)
    assert r.get_response().parameters["batch_queries"].int64_param >= 1
    Q3 = rng.standard_normal((2, 5, DIM)).astype(np.float32)
    ids = np.array([[7, 9, 305], [11, 7, 13]])
    r = client.infer("rerank", [_input("Q", Q3, "FP32"), _input("IDS", ids, "INT64")],
                     outputs=[grpcclient.InferRequestedOutput("SCORES")], timeout=10_000_000, client_timeout=60)
    assert np.array_equal(r.as_numpy("SCORES"), local.rerank(Q3, (ids - 7) // 2))
    r = client.infer("score", [_input("Q", q, "FP32")])
    assert np.array_equal(r.as_numpy("SCORES"), local.score(q))
    stats = client.get_inference_statistics("score", as_json=True)["model_stats"][0]
    assert int(stats["inference_count"]) >= 1 and int(stats["inference_stats"]["success"]["count"]) >= 1


def test_typed_contents_from_grpcio_stub(served, local):
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    rng = np.random.default_rng(23)
    q = rng.standard_normal((4, DIM)).astype(np.float32)
    req = pb.ModelInferRequest(model_name="search", id="r-1")
    t = req.inputs.add(name="Q", datatype="FP32", shape=list(q.shape))
    t.contents.fp32_contents.extend(q.reshape(-1).tolist())
    k = req.inputs.add(name="K", datatype="INT32", shape=[1])
    k.contents.int_contents.append(5)
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        stub = rpc.GRPCInferenceServiceStub(channel)
        r = stub.ModelInfer(req, timeout=60)
        assert r.id == "r-1" and [o.name for o in r.outputs] == ["SCORES", "IDS"]
        s, i = local.search(q, 5)
        assert np.array_equal(np.frombuffer(r.raw_output_contents[0], "<f4"), s)
        assert np.array_equal(np.frombuffer(r.raw_output_contents[1], "<i8"), i)
        del req.inputs[1]
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "missing K" in e.value.details()
        half = pb.ModelInferRequest(model_name="score")
        half.inputs.add(name="Q", datatype="FP16", shape=[2, DIM])
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(half, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "FP16 data must come as raw_input_contents" in e.value.details()


@pytest.mark.parametrize("model, inputs, code, message", [
    ("search", [("Q", np.zeros((3, DIM + 1), np.float32), "FP32"), ("K", np.array([3], np.int32), "INT32")],
     "INVALID_ARGUMENT", f"dim {DIM + 1}"),
    ("search", [("Q", np.zeros((3, DIM), np.float32), "FP32"), ("K", np.array([3.0], np.float32), "FP32")],
     "INVALID_ARGUMENT", "K must hold one INT32"),
    ("rerank", [("Q", np.zeros((3, DIM), np.float32), "FP32"), ("IDS", np.array([7, 8]), "INT64")],
     "INVALID_ARGUMENT", "8"),
    ("score", [("Q", np.zeros((3, DIM), np.int32), "INT32")], "INVALID_ARGUMENT", "Q must be FP16, BF16 or FP32"),
    ("score", [("Q", np.zeros((3, DIM), np.float16), "FP16")], "INVALID_ARGUMENT", "send float32 queries"),
    ("nope", [("Q", np.zeros((3, DIM), np.float32), "FP32")], "NOT_FOUND", "unknown model 'nope'"),
    ("rerank", [("Q", np.zeros(DIM, np.float32), "FP32"), ("IDS", np.array(7), "INT64")], "INVALID_ARGUMENT",
     f"Q has shape [{DIM}]; expected [Lq, d] (one query) or [Nq, Lq, d]"),
])
def test_bad_requests_get_a_named_error_and_the_server_keeps_serving(client, local, model, inputs, code, message):
    with pytest.raises(grpcclient.InferenceServerException) as e:
        client.infer(model, [_input(*x) for x in inputs])
    assert e.value.status() == f"StatusCode.{code}" and message in e.value.message(), e.value
    q = np.ones((2, DIM), np.float32)
    assert np.array_equal(client.infer("score", [_input("Q", q, "FP32")]).as_numpy("SCORES"), local.score(q))


def test_refusals_are_counted_with_their_reasons(served, client):
    """Each refused call is counted with why, as over HTTP: a bad request, an unknown version, and an
    unknown model (counted nowhere before: its name is the client's), under no model."""
    q = np.ones((2, DIM), np.float32)
    reasons = (("score", "invalid"), ("score", "not_found"), ("", "not_found"))
    before = [served.metric("lik_serve_rejected_total", model=m, reason=r) for m, r in reasons]
    for model, inputs, version in (("score", [_input("Q", q.astype(np.int32), "INT32")], ""),
                                   ("score", [_input("Q", q, "FP32")], "7"), ("nope", [_input("Q", q, "FP32")], "")):
        with pytest.raises(grpcclient.InferenceServerException):
            client.infer(model, inputs, model_version=version)
    assert [served.metric("lik_serve_rejected_total", model=m, reason=r) for m, r in reasons] == [b + 1 for b in before]


def test_a_timeout_of_infinity_is_refused_as_over_http(served):
    """A call's deadline bounded an infinite ``timeout`` parameter, which HTTP refuses: it was scored."""
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    req = pb.ModelInferRequest(model_name="score")
    req.inputs.add(name="Q", datatype="FP32", shape=[1, DIM]).contents.fp32_contents.extend([0.5] * DIM)
    req.parameters["timeout"].double_param = float("inf")
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as e:
            rpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert e.value.details() == "parameter timeout must be a positive number of microseconds, got inf"


def test_only_version_1_of_a_model_exists(client):
    q = np.ones((2, DIM), np.float32)
    calls = [lambda v: client.is_model_ready("score", v), lambda v: client.get_model_metadata("score", v),
             lambda v: client.get_model_config("score", v), lambda v: client.get_inference_statistics("score", v),
             lambda v: client.infer("score", [_input("Q", q, "FP32")], model_version=v)]
    for call in calls:
        assert call("1")
        with pytest.raises(grpcclient.InferenceServerException) as e:
            call("7")
        assert e.value.status() == "StatusCode.NOT_FOUND", e.value
        assert e.value.message() == "model 'score' has no version '7'; its versions are 1", e.value


def test_a_message_over_the_body_limit_is_refused_and_counted_as_http_413(served):
    """gRPC takes what HTTP takes: a message over the body limit (64 MiB) is RESOURCE_EXHAUSTED, and
    counted as HTTP's 413."""
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    from lik_cupy.serving._service import MAX_BODY

    req = pb.ModelInferRequest(model_name="score")
    req.inputs.add(name="Q", datatype="FP32", shape=[1, DIM])
    req.raw_input_contents.append(bytes(MAX_BODY))  # with the rest of the message, just over the limit
    before = served.metric("lik_serve_responses_total", model="score", code="413")
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as e:
            rpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    assert f"over the limit of {MAX_BODY}" in e.value.details(), e.value
    assert served.metric("lik_serve_responses_total", model="score", code="413") == before + 1


def test_deadlines_and_cancellations_are_counted_and_dropped(shard):
    """A call whose deadline passes in the queue, and one its client cancels there, are counted as
    HTTP's 504s and disconnects are (responses by status, rejects by reason), and never scored; the
    first leaves the queue at its deadline."""
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    # A window of 10 s: each call stays queued while the test acts on it (the first call's deadline, 1 s,
    # passes there), and the last one, alone, waits out the window before it is scored.
    s = Server(shard, "--devices", "cpu", "--grpc-port", "0", "--max-batch", "2", "--max-delay-us", "10000000")
    req = pb.ModelInferRequest(model_name="score", raw_input_contents=[np.ones((4, DIM), np.float32).tobytes()])
    req.inputs.add(name="Q", datatype="FP32", shape=[4, DIM])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}") as channel:
            stub = rpc.GRPCInferenceServiceStub(channel)
            expiring = stub.ModelInfer.future(req, timeout=1.0)
            s.wait_metric("lik_serve_queue_depth", 1.0, device="cpu:0")  # (the worker waits for 2 queries)
            with pytest.raises(grpc.RpcError) as e:
                expiring.result()
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            s.wait_metric("lik_serve_responses_total", 1.0, model="score", code="504")
            s.wait_metric("lik_serve_rejected_total", 1.0, model="score", reason="deadline")
            call = stub.ModelInfer.future(req)
            s.wait_metric("lik_serve_queue_depth", 1.0, device="cpu:0")  # (the expired call's request left)
            call.cancel()
            s.wait_metric("lik_serve_responses_total", 1.0, model="score", code="499")
            s.wait_metric("lik_serve_rejected_total", 1.0, model="score", reason="cancelled")
            r = stub.ModelInfer(req, timeout=60)  # the second query: the worker takes the queue
            assert r.parameters["batch_queries"].int64_param == 1  # scored alone
        assert s.metric("lik_serve_rejected_total", model="score", reason="deadline") == 1.0
        assert s.metric("lik_serve_responses_total", model="score", code="504") == 1.0
    finally:
        log = s.stop()
    # The expired call: answered by the server's timer, or given up (grpcio cancelled it at its
    # deadline) a moment before; the cancelled one dropped.
    assert re.search(r"answered (1 of 3 accepted requests; 2|2 of 3 accepted requests; 1) dropped", log), log


def test_a_call_cancelled_before_its_message_arrived_is_counted(served):
    """A call that ended before its message, which names the model, arrived was counted nowhere (and
    one its client cancelled was taken for a call without a message: grpcio ends the read first). It
    is counted as HTTP counts a client that leaves before its body arrived (499 and ``cancelled``),
    under no model."""
    import threading

    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    before = (served.metric("lik_serve_responses_total", model="", code="499"),
              served.metric("lik_serve_rejected_total", model="", reason="cancelled"))
    sent = threading.Event()

    def messages():  # (none until the call is cancelled)
        sent.wait(60)
        return
        yield

    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        call = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=pb.ModelInferRequest.SerializeToString,
                                    response_deserializer=pb.ModelInferResponse.FromString).future(messages(), timeout=60)
        # (the server took the call before this one, on the same connection: its handler waits for the message)
        assert rpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=60).live
        call.cancel()
        sent.set()
    served.wait_metric("lik_serve_responses_total", before[0] + 1, model="", code="499")
    served.wait_metric("lik_serve_rejected_total", before[1] + 1, model="", reason="cancelled")


def test_deadlines_behind_a_long_batch_are_answered_at_them_and_never_scored():
    """Calls whose deadlines (the timeout parameter, or the call's gRPC deadline) pass while a batch
    runs are answered DEADLINE_EXCEEDED at those deadlines, not once the worker is free (2 s here),
    counted once each, and never scored; the calls without deadlines get their results."""
    import time

    from slow_served import DIM as D, documents
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    def request(n, timeout_us=None):
        q = np.random.default_rng(n).standard_normal((n, 4, D)).astype(np.float32)
        req = pb.ModelInferRequest(model_name="score", raw_input_contents=[q.tobytes()])
        req.inputs.add(name="Q", datatype="FP32", shape=list(q.shape))
        if timeout_us is not None:
            req.parameters["timeout"].int64_param = timeout_us
        return req, q

    tokens, offsets = documents()
    local = lik_cupy.Corpus(tokens, d_offsets=offsets, device="cpu")
    s = Server("2.0", "--grpc-port", "0", script=ROOT / "tests" / "slow_served.py")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}") as channel:
            stub = rpc.GRPCInferenceServiceStub(channel)
            (ra, qa), (rc, qc) = request(1), request(2)
            a = stub.ModelInfer.future(ra, timeout=60)
            until = time.monotonic() + 30
            while not any("slow_served: score of 1 queries" in line for line in s.lines):  # the 2 s call runs
                assert time.monotonic() < until, "".join(s.lines)
                time.sleep(0.01)
            c = stub.ModelInfer.future(rc, timeout=60)
            s.wait_metric("lik_serve_queue_depth", 1.0, device="cpu:0")
            for req, timeout in ((request(3, timeout_us=100_000)[0], 60), (request(4)[0], 0.1)):
                start = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    stub.ModelInfer(req, timeout=timeout)
                waited = time.monotonic() - start
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value
                assert waited < 1.0 and not a.done(), waited
            for call, q in ((a, qa), (c, qc)):
                r = call.result()
                got = np.frombuffer(r.raw_output_contents[0], np.float32).reshape(len(q), -1)
                assert np.array_equal(got, local.score(q))
        s.wait_metric("lik_serve_rejected_total", 2.0, model="score", reason="deadline")
        s.wait_metric("lik_serve_responses_total", 2.0, model="score", code="504")
        s.wait_metric("lik_serve_responses_total", 2.0, model="score", code="200")
    finally:
        log = s.stop()
    calls = [line.strip() for line in s.lines if line.startswith("slow_served:")]
    assert calls == ["slow_served: score of 1 queries", "slow_served: score of 2 queries"], log


def test_calls_over_a_connections_stream_cap_are_refused(served, shard):
    """grpc core took any number of calls on one connection (grpc.max_concurrent_streams unset): a
    client could open calls without end, each holding a handler and what arrives of its message.
    The server announces a cap (--grpc-max-streams, 100 unless told) and refuses a call over it
    (RST_STREAM REFUSED_STREAM) before any handler runs; the calls within it are served."""
    default = http2.Connection(served.grpc_port)
    try:
        assert default.settings().get(http2.MAX_CONCURRENT_STREAMS) == 100
    finally:
        default.close()
    server = Server(shard, "--devices", "cpu", "--grpc-port", "0", "--grpc-max-streams", "2")
    c = http2.Connection(server.grpc_port)
    try:
        assert c.settings().get(http2.MAX_CONCURRENT_STREAMS) == 2
        c.send(*(http2.frame(http2.HEADERS, http2.END_HEADERS, s, http2.call_headers("ModelInfer")) for s in (1, 3, 5, 7)))
        refused = {}
        while len(refused) < 2:
            f = c.read()
            assert f is not None, f"the server closed the connection; refused so far: {refused}"
            if f[0] == http2.RST_STREAM:
                refused[f[2]] = int.from_bytes(f[3], "big")
        assert refused == {5: http2.REFUSED_STREAM, 7: http2.REFUSED_STREAM}
        c.send(http2.frame(http2.DATA, http2.END_STREAM, 1))  # (a call ended without its message: answered)
        while (f := c.read()) is not None and not (f[0] == http2.HEADERS and f[2] == 1 and f[1] & http2.END_STREAM):
            assert not (f[0] == http2.RST_STREAM and f[2] == 1), f
        assert f is not None, "the server closed the connection instead of answering the call within the cap"
    finally:
        c.close()
        server.stop()


def test_a_client_over_the_stream_cap_waits_its_turn():
    """A client of the protocol (grpcio's, as tritonclient's) keeps the calls over the server's cap
    waiting until one ends, rather than failing them: six calls over one channel are all answered,
    and the server never holds more than two of them at once (its batches: two queries at most).
    One call goes first: until the server's HTTP/2 settings (its cap) reach the client, a new channel
    may open more streams than the cap, and the server refuses those (RST_STREAM, REFUSED_STREAM),
    which grpcio reported as UNAVAILABLE in one CI run."""
    from slow_served import DIM as D, documents

    tokens, offsets = documents()
    local = lik_cupy.Corpus(tokens, d_offsets=offsets, device="cpu")
    qs = [np.random.default_rng(n).standard_normal((3, D)).astype(np.float32) for n in range(6)]
    s = Server("0.3", "--grpc-port", "0", "--grpc-max-streams", "2", script=ROOT / "tests" / "slow_served.py")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
    try:
        def call(i):
            r = client.infer("score", [_input("Q", qs[i], "FP32")], client_timeout=60)
            assert np.array_equal(r.as_numpy("SCORES"), local.score(qs[i]))

        call(0)
        run_threads(6, call)
    finally:
        client.close()
        log = s.stop()
    batches = [int(m.group(1)) for line in s.lines if (m := re.match(r"slow_served: score of (\d+) queries", line))]
    assert sum(batches) == 7 and max(batches) <= 2, log


def test_many_concurrent_clients_each_get_their_own_rows(served, local):
    rng = np.random.default_rng(24)
    qs = [rng.standard_normal((int(n), DIM)).astype(np.float32) for n in rng.integers(1, 30, 32)]

    def one_client(t):  # 8 clients, 4 requests each, over one channel each
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
        try:
            for q in qs[t::8]:
                r = c.infer("search", [_input("Q", q, "FP32"), _input("K", np.array([4], np.int32), "INT32")])
                s, i = local.search(q, 4)
                assert np.array_equal(r.as_numpy("SCORES"), s) and np.array_equal(r.as_numpy("IDS"), i)
        finally:
            c.close()

    run_threads(8, one_client)


def test_a_grpc_port_in_use_is_exit_2_naming_it(shard):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "lik_cupy", "serve", str(shard), "--port", "0", "--devices", "cpu",
                            "--grpc-port", str(port)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and f"127.0.0.1:{port}: cannot listen there for gRPC" in r.stderr, r.stderr


def test_sigterm_answers_what_was_accepted(shard):
    s = Server(shard, "--devices", "cpu", "--grpc-port", "0")
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
    try:
        assert c.infer("score", [_input("Q", np.ones((3, DIM), np.float32), "FP32")]).as_numpy("SCORES").shape == (150,)
    finally:
        c.close()
        err = s.stop()
    assert s.proc.returncode == 0 and "answered 1 of 1 accepted requests" in err, err


def test_sigterm_answers_a_call_still_in_the_queue(shard, local):
    """A gRPC call accepted and waiting in the queue when SIGTERM comes is answered, not cancelled."""
    import threading

    s = Server(shard, "--devices", "cpu", "--grpc-port", "0", "--max-delay-us", "30000000")
    q = np.random.default_rng(23).standard_normal((2, 5, DIM)).astype(np.float32)
    got = {}

    def call():
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc_port}")
        try:
            got["scores"] = c.infer("score", [_input("Q", q, "FP32")]).as_numpy("SCORES")
        except Exception as e:  # noqa: BLE001
            got["error"] = e
        finally:
            c.close()

    t = threading.Thread(target=call)
    try:
        t.start()
        while 'lik_serve_queue_depth{device="cpu:0"} 1.0' not in s.get("/metrics")[2].decode():
            assert t.is_alive(), got
    finally:
        err = s.stop()
        t.join(60)
    assert "error" not in got, got
    assert np.array_equal(got["scores"], local.score(q))
    assert s.proc.returncode == 0 and "answered 1 of 1 accepted requests" in err, err


def test_processes_share_the_grpc_port(shard, local):
    server = Server(shard, "--devices", "cpu", "--processes", "2", "--grpc-port", "0")
    try:
        assert server.grpc_port is not None
        q = np.random.default_rng(22).standard_normal((1, 7, DIM)).astype(np.float32)
        for _ in range(4):  # new channels: the kernel spreads them over the processes
            c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
            try:
                assert c.is_server_ready()
                r = c.infer("score", [_input("Q", q, "FP32")])
                assert np.array_equal(r.as_numpy("SCORES"), local.score(q))
                with pytest.raises(grpcclient.InferenceServerException):
                    c.infer("nope", [_input("Q", q, "FP32")])
            finally:
                c.close()
        # (the processes' counts summed: prometheus-client's multiprocess mode)
        assert server.metric("lik_serve_rejected_total", model="", reason="not_found") == 4
        assert server.metric("lik_serve_responses_total", model="score", code="200") == 4
    finally:
        log = server.stop()
    assert server.proc.returncode == 0, log



def test_a_body_limit_of_a_gibibyte_or_more_still_starts():
    """grpc core's message limit is a C int: twice a 1 GiB body limit overflowed it and the server
    did not start (OverflowError)."""
    import asyncio

    from lik_cupy.serving import grpc as lik_grpc
    from lik_cupy.serving._service import Service

    async def main():
        server = await lik_grpc.start_server(Service(lambda observer: None, 1 << 30), "127.0.0.1:0")
        await server.stop(None)

    asyncio.run(main())


def test_a_call_that_alone_takes_more_than_the_budget_is_resource_exhausted(capsys):
    """As over HTTP (tests/test_serve.py): a call whose outputs, with its message, are more than the
    server's whole budget of request bytes was refused UNAVAILABLE (HTTP's 503: retry later), which
    no retry could pass. It is refused RESOURCE_EXHAUSTED (413); a call that fits is answered."""
    import asyncio

    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    from lik_cupy.serving import Batcher
    from lik_cupy.serving._service import Service

    nd = 2000  # (one-token documents: a score answers 4 * nd bytes a query)
    corpus = lik_cupy.Corpus(np.random.default_rng(50).standard_normal((nd, DIM)).astype(np.float32),
                             d_offsets=np.arange(nd + 1), device="cpu")
    svc = Service(lambda observer: Batcher(corpus, observer=observer), max_body_bytes=4000)
    assert svc.max_held == 8 * 4 * nd

    async def main():
        server, port = await _in_process_server(svc, capsys)
        got = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rpc.GRPCInferenceServiceStub(channel)
                for nq in (7, 8, 9):
                    req = pb.ModelInferRequest(model_name="score", raw_input_contents=[bytes(nq * DIM * 4)])
                    req.inputs.add(name="Q", datatype="FP32", shape=[nq, 1, DIM])
                    try:
                        r = await stub.ModelInfer(req, timeout=60)
                        got.append((grpc.StatusCode.OK, list(r.outputs[0].shape)))
                    except grpc.aio.AioRpcError as e:
                        got.append((e.code(), e.details()))
        finally:
            await server.stop(None)
        return got

    try:
        (code, shape), *refused = asyncio.run(main())
    finally:
        svc.stop()
    assert code == grpc.StatusCode.OK and shape == [7, nd]
    for code, details in refused:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        assert re.search(r"outputs take \d+ bytes and the request itself \d+: over the 64000 that the server "
                         r"holds", details), details
    assert svc.held == 0


def _in_process_server(svc, capsys):
    """(the gRPC server of ``svc`` on a free port, started in the running event loop, its port) once
    ``svc`` is ready (a coroutine)."""
    import asyncio

    from lik_cupy.serving import grpc as lik_grpc

    async def start():
        svc.start()
        while not svc.ready:
            assert svc.failure is None
            await asyncio.sleep(0.01)
        server = await lik_grpc.start_server(svc, "127.0.0.1:0")
        return server, int(re.search(r"listening on grpc://127\.0\.0\.1:(\d+)", capsys.readouterr().err).group(1))

    return start()


async def _until(condition, what: str, timeout: float = 30.0) -> None:
    import asyncio
    import time

    until = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < until, f"{what} within {timeout} s"
        await asyncio.sleep(0.01)


def test_a_call_given_up_while_its_answer_is_written_counts_as_answered(capsys):
    """A call whose answer holds more string ids than the event loop writes (INLINE_WRITE_VALUES) is
    written on the parse thread; one whose client cancelled meanwhile, once scored, was counted 499
    and rejected as cancelled, where HTTP counts the same (its client gone while its answer is
    written) 200, as the shutdown's count of answers does. It counts 200 now, as over HTTP."""
    import asyncio
    import threading

    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    from lik_cupy.serving import Batcher
    from lik_cupy.serving._service import INLINE_WRITE_VALUES, Service

    nd = INLINE_WRITE_VALUES + 52
    rng = np.random.default_rng(51)
    corpus = lik_cupy.Corpus(rng.standard_normal((nd, DIM)).astype(np.float32), d_offsets=np.arange(nd + 1),
                             ids=np.array([f"doc{i}" for i in range(nd)]), device="cpu")
    svc = Service(lambda observer: Batcher(corpus, observer=observer))
    busy = threading.Event()
    req = pb.ModelInferRequest(model_name="search", raw_input_contents=[np.ones((2, DIM), np.float32).tobytes(),
                                                                         np.array([nd], np.int32).tobytes()])
    req.inputs.add(name="Q", datatype="FP32", shape=[2, DIM])
    req.inputs.add(name="K", datatype="INT32", shape=[1])

    def count(code):
        return svc.metrics.registry.get_sample_value("lik_serve_responses_total", {"model": "search", "code": code})

    async def main():
        server, port = await _in_process_server(svc, capsys)
        svc.parser.submit(busy.wait)  # (the parse thread is busy: the answer waits there to be written)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = rpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=60)
                await _until(lambda: svc.answered == 1, "the call scored")
                call.cancel()
                await _until(lambda: (count("200") or 0) + (count("499") or 0) == 1, "the call counted")
        finally:
            busy.set()
            await server.stop(None)

    try:
        asyncio.run(main())
    finally:
        svc.stop()
    assert count("200") == 1 and count("499") is None
    assert svc.metrics.registry.get_sample_value("lik_serve_rejected_total",
                                                 {"model": "search", "reason": "cancelled"}) is None


def test_a_large_answer_is_held_against_the_budget_until_sent(capsys):
    """HTTP holds an answer of over 256 KiB against the server's budget until it is sent: gRPC's was
    given back as its handler returned, grpcio still holding the message and its serialized bytes
    for as long as the client took to read them. It is held until the call ends: here a client
    that takes none past HTTP/2's first window (64 KiB), until it closes the connection."""
    import asyncio

    from tritonclient.grpc import service_pb2 as pb

    from lik_cupy.serving import Batcher
    from lik_cupy.serving._service import Service

    nd, nq = 2000, 40  # (one-token documents: a score answers 4 * nd bytes a query, 320,000 in all)
    corpus = lik_cupy.Corpus(np.random.default_rng(52).standard_normal((nd, DIM)).astype(np.float32),
                             d_offsets=np.arange(nd + 1), device="cpu")
    svc = Service(lambda observer: Batcher(corpus, observer=observer))
    req = pb.ModelInferRequest(model_name="score", raw_input_contents=[np.ones((nq, 1, DIM), np.float32).tobytes()])
    req.inputs.add(name="Q", datatype="FP32", shape=[nq, 1, DIM])
    message = req.SerializeToString()

    async def main():
        server, port = await _in_process_server(svc, capsys)
        run = asyncio.get_running_loop().run_in_executor
        c = await run(None, http2.Connection, port)
        try:
            await run(None, c.settings)
            c.send(http2.frame(http2.HEADERS, http2.END_HEADERS, 1, http2.call_headers("ModelInfer")),
                   http2.frame(http2.DATA, http2.END_STREAM, 1, b"\0" + len(message).to_bytes(4, "big") + message))
            # (scored: its handler has returned, the event loop running it from its answer on without a pause)
            await _until(lambda: svc.answered == 1, "the call answered")
            held = svc.held
        finally:
            c.close()
        await _until(lambda: svc.held == 0, "the answer given back")
        await server.stop(None)
        return held

    try:
        held = asyncio.run(main())
    finally:
        svc.stop()
    assert held >= 2 * 4 * nq * nd, held
