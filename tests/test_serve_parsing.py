"""``lik serve`` parsing requests (CPU path, a real server on loopback, real clients): a large
request's parse leaves the event loop free for the others (HTTP and gRPC), a client that leaves
during it leaves nothing behind; and what a request's parse may hold or take before it is refused."""

from __future__ import annotations

import http.client
import json
import re
import select
import signal
import socket

import numpy as np
import pytest

import lik_cupy
from served import ROOT, Server, random_shard

DIM = 16
PARSE_SERVED = ROOT / "tests" / "parse_served.py"


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    return random_shard(tmp_path_factory.mktemp("serve_parsing") / "shard0", 31, 120, DIM, ids=np.arange(120) * 2 + 3)


@pytest.fixture(scope="module")
def local(shard):
    return lik_cupy.Corpus.from_shards(shard, device="cpu")


def _post(sock, model: str, body: bytes, headers: dict | None = None) -> None:
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: lik\r\nContent-Length: {len(body)}\r\n{head}\r\n"
                 .encode() + body)


def _response(sock) -> tuple[int, bytes]:
    r = http.client.HTTPResponse(sock)
    r.begin()
    return r.status, r.read()


def _large_json(q: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "Q", "shape": list(q.shape), "datatype": "FP32",
                                   "data": q.reshape(-1).tolist()}]}).encode()


def _small_binary(q: np.ndarray) -> tuple[bytes, dict]:
    header = json.dumps({"inputs": [{"name": "Q", "shape": list(q.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": q.nbytes}}]}).encode()
    return header + q.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether an answer's SCORES, flat, are ``want``, bit for bit."""
    return got.size == want.size and np.array_equal(got.reshape(want.shape), want)


def _json_scores(body: bytes) -> np.ndarray:
    return np.float32(json.loads(body)["outputs"][0]["data"])


@pytest.mark.parametrize("coding", [None, "gzip", "gzip members"])
def test_a_small_request_is_answered_while_a_large_json_one_is_parsed(shard, local, tmp_path, coding):
    """The body of a large JSON request was inflated and parsed on the event loop's thread: the
    server answered nothing else meanwhile (about 1 s for 58 MiB of floats on a 2-core host, 9 s for
    64 MiB of nested empty lists). Here the large request's inflating or parse is held until the
    small one is answered (tests/parse_served.py), which happens only if it leaves the event loop free."""
    import gzip

    rng = np.random.default_rng(32)
    large, small = rng.standard_normal((8, 2048, DIM)).astype(np.float32), np.ones((3, DIM), np.float32)
    body, headers = _large_json(large), {}
    if coding:  # (many empty members: 2 MiB that inflate to nothing, read a member at a time)
        extra = gzip.compress(b"") * (100_000 if coding == "gzip members" else 0)
        body, headers = gzip.compress(body) + extra, {"Content-Encoding": "gzip"}
    _small_answered_first(shard, local, tmp_path, (body, headers), "parsing", large, small,
                          "the large request was answered first: its parse held the event loop")


def test_a_small_request_is_answered_while_a_large_json_answer_is_written(shard, local, tmp_path):
    """A JSON answer was written on the event loop's thread: 10M scores held every other client
    for 4.3 s. Here the large answer's writing is held until the small request is answered."""
    rng = np.random.default_rng(37)
    large, small = rng.standard_normal((1000, 1, DIM)).astype(np.float32), np.ones((3, DIM), np.float32)
    _small_answered_first(shard, local, tmp_path, _small_binary(large), "writing", large, small,
                          "the large request was answered first: writing its answer held the event loop")


def _small_answered_first(shard, local, tmp_path, request: tuple, stage: str, large, small, why: str) -> None:
    """The large score ``request`` (body, headers) of queries ``large`` sent first, held at ``stage``
    of tests/parse_served.py until a small request of ``small`` is answered, which must come first
    (``why`` says what it means if not); both answers right."""
    go = tmp_path / "go"
    server = Server(go, shard, "--devices", "cpu", script=PARSE_SERVED)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as a, \
                socket.create_connection(("127.0.0.1", server.port)) as b:
            _post(a, "score", *request)
            server.wait_line(f"parse_served: {stage}")
            _post(b, "score", *_small_binary(small))
            first, _, _ = select.select([a, b], [], [], 120)
            go.touch()  # (the large request's parse or writing goes on)
            assert first == [b], why
            status, body = _response(b)
            assert status == 200 and _same(_json_scores(body), local.score(small)), body
            status, body = _response(a)
            assert status == 200 and _same(_json_scores(body), local.score(large)), body[:500]
    finally:
        server.stop()


def _written_before(header, outputs, binary):
    """write_response's JSON as it was written before it was written in pieces."""
    from lik_cupy.serving._tensors import _tensor_json, _text, tensor_bytes

    tensors, chunks = [], []
    for name, a in outputs:
        raw = tensor_bytes(a) if name in binary else None
        t = _tensor_json(name, a, raw)
        if raw is not None:
            chunks.append(raw)
        else:
            t["data"] = [_text(x) for x in a.reshape(-1)] if t["datatype"] == "BYTES" else a.reshape(-1).tolist()
        tensors.append(t)
    text = json.dumps({**header, "outputs": tensors}, allow_nan=True).encode()
    if not chunks:
        return text, None
    return b"".join([text, *chunks]), len(text)


def test_json_answers_written_in_pieces_are_the_text_written_before():
    from lik_cupy.serving import _tensors

    rng = np.random.default_rng(38)
    step = _tensors._CHUNK // 8
    for n in (0, 1, 7, step - 1, step, step + 1, 2 * step + 5):
        scores = rng.standard_normal(n).astype(np.float32)
        scores[rng.integers(0, max(n, 1), min(n, 3))] = [np.nan, np.inf, -0.0][:min(n, 3)]
        ids = np.array([f"é{i}😀" for i in range(n)]) if n % 2 else np.arange(n, dtype=np.int64) * 7
        raw_ids = np.array([f"d{i}".encode() for i in range(n)], dtype="S")
        for header in ({}, {"model_name": "search", "id": "r-\u00e9\ud83d", "parameters": {"queue_us": 3}}):
            for outputs in ([("SCORES", scores)], [("SCORES", scores.reshape(1, -1)), ("IDS", ids)],
                            [("IDS", raw_ids)]):
                names = [name for name, _ in outputs]
                for binary in (set(), {names[0]} if len(names) > 1 else set()):
                    pieces, n = _tensors.write_response(header, outputs, binary)
                    assert (b"".join(pieces), n) == _written_before(header, outputs, binary)


def test_a_small_grpc_call_is_answered_while_a_large_one_is_parsed(shard, local, tmp_path):
    """gRPC's typed contents were read into arrays on the event loop's thread (a Python step a value)."""
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("lik_cupy.serving.grpc")
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    rng = np.random.default_rng(33)
    large, small = rng.standard_normal((8, 4096, DIM)).astype(np.float32), np.ones((3, DIM), np.float32)
    big = pb.ModelInferRequest(model_name="score")
    big.inputs.add(name="Q", datatype="FP32", shape=list(large.shape)).contents.fp32_contents.extend(
        large.reshape(-1).tolist())
    little = pb.ModelInferRequest(model_name="score", raw_input_contents=[small.tobytes()])
    little.inputs.add(name="Q", datatype="FP32", shape=list(small.shape))
    go = tmp_path / "go"
    server = Server(go, shard, "--devices", "cpu", "--grpc-port", "0", script=PARSE_SERVED)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                   options=[("grpc.max_send_message_length", -1)]) as channel:
            stub = rpc.GRPCInferenceServiceStub(channel)
            order = []
            a = stub.ModelInfer.future(big, timeout=300)
            a.add_done_callback(lambda _: order.append("large"))
            server.wait_line("parse_served: parsing")
            b = stub.ModelInfer.future(little, timeout=300)
            b.add_done_callback(lambda _: order.append("small"))
            r = b.result()
            go.touch()
            assert _same(np.frombuffer(r.raw_output_contents[0], "<f4"), local.score(small))
            r = a.result()
            assert _same(np.frombuffer(r.raw_output_contents[0], "<f4"), local.score(large))
            assert order == ["small", "large"]
    finally:
        server.stop()


def test_a_grpc_call_whose_message_arrived_before_sigterm_is_answered(shard, local, tmp_path):
    """SIGTERM closed the queues as soon as the HTTP requests were answered, while a gRPC call whose
    message had arrived was still being read (a large one, on the parse thread): it was then refused
    UNAVAILABLE (the server not ready), where an HTTP request read as far was answered, and the docs
    say the gRPC calls accepted finish as the queues drain. The queues now close once every call
    whose message arrived has reached them."""
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("lik_cupy.serving.grpc")
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    large = np.random.default_rng(35).standard_normal((8, 4096, DIM)).astype(np.float32)
    big = pb.ModelInferRequest(model_name="score")
    big.inputs.add(name="Q", datatype="FP32", shape=list(large.shape)).contents.fp32_contents.extend(
        large.reshape(-1).tolist())
    go = tmp_path / "go"
    server = Server(go, shard, "--devices", "cpu", "--grpc-port", "0", script=PARSE_SERVED)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                   options=[("grpc.max_send_message_length", -1)]) as channel:
            call = rpc.GRPCInferenceServiceStub(channel).ModelInfer.future(big, timeout=300)
            server.wait_line("parse_served: parsing")  # (the whole message has arrived)
            server.proc.send_signal(signal.SIGTERM)
            try:  # (where the queues close at once, they do so before the parse is let go)
                server.wait_line("parse_served: stopping", timeout=2)
            except AssertionError:  # (they wait for the call)
                pass
            go.touch()
            r = call.result()
        assert _same(np.frombuffer(r.raw_output_contents[0], "<f4"), local.score(large))
        server.proc.wait(60)  # (its own exit: stop() would send a second SIGTERM to a server still exiting)
    finally:
        go.touch()
        log = server.stop()
    assert "parse_served: stopping while parsing" not in log, log
    assert server.proc.returncode == 0 and "answered 1 of 1 accepted requests" in log, log


def test_a_client_that_leaves_during_the_parse_is_counted_and_its_request_never_queued(shard, tmp_path):
    """A client gone while its large body was parsed: its request was still queued once parsed
    (and then dropped there). It is now given up as soon as the client leaves, counted as 499, and
    its parse's result thrown away."""
    rng = np.random.default_rng(34)
    large = rng.standard_normal((4, 2048, DIM)).astype(np.float32)
    go = tmp_path / "go"
    server = Server(go, shard, "--devices", "cpu", script=PARSE_SERVED)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as a:
            _post(a, "score", _large_json(large))
            server.wait_line("parse_served: parsing")
        server.wait_metric("lik_serve_responses_total", 1.0, model="score", code="499")
        go.touch()
        status, _ = _post_and_answer(server, "score", *_small_binary(np.ones((2, DIM), np.float32)))
        assert status == 200
        assert server.metric("lik_serve_rejected_total", model="score", reason="cancelled") == 1.0
    finally:
        log = server.stop()
    assert "answered 1 of 1 accepted requests\n" in log, log


@pytest.fixture(scope="module")
def served(shard):
    s = Server(shard, "--devices", "cpu", "--grpc-port", "0")
    yield s
    s.stop()


def test_a_json_body_that_takes_more_than_the_budget_to_read_is_refused_unread(served, local):
    """JSON's values as Python objects take many times their text (a list 80 bytes for the 3 of
    "[],"); the server held only the body's bytes against its budget, so that one 64 MiB body took
    2.2 GiB (and 9 s of the GIL) to read. What reading it takes is now counted first: past the
    whole budget (1 GiB), 413."""
    q = np.ones((2, DIM), np.float32)
    small = json.dumps({"inputs": [{"name": "Q", "shape": [2, DIM], "datatype": "FP32",
                                    "data": q.reshape(-1).tolist()}]}).encode()
    pad = b"[" + b",".join([b"{}"] * ((11 << 20) // 3)) + b"]"  # (11 MiB; 280 MiB as dicts)
    status, _, body = served.request("POST", "/v2/models/score/infer", small[:-1] + b', "pad": ' + pad + b"}")
    assert status == 413, body[:300]
    assert re.search(r"reading the request takes about \d+ bytes of memory .* over the 1073741824 that the server "
                     r"holds for all its requests; send fewer values or BYTES elements a request, or numbers as "
                     r"binary data \(binary_data_size\)", json.loads(body)["error"]), body
    status, _, body = served.request("POST", "/v2/models/score/infer", small)
    assert status == 200 and _same(_json_scores(body), local.score(q))


def test_binary_bytes_elements_that_take_more_than_the_budget_to_read_are_refused_unread(served):
    """A BYTES input's elements each became a bytes and a str object (about 130 bytes) before their
    count against the array's limit was read: 60 MiB of empty elements took 15M of each."""
    n = (60 << 20) // 4
    header = json.dumps({"inputs": [
        {"name": "Q", "shape": [2, DIM], "datatype": "FP32", "parameters": {"binary_data_size": 2 * DIM * 4}},
        {"name": "IDS", "shape": [n], "datatype": "BYTES", "parameters": {"binary_data_size": 4 * n}}]}).encode()
    status, _, body = served.request("POST", "/v2/models/rerank/infer",
                                     header + np.ones((2, DIM), np.float32).tobytes() + bytes(4 * n),
                                     {"Inference-Header-Content-Length": str(len(header))})
    assert status == 413 and "reading the request takes about" in json.loads(body)["error"], body[:300]


def test_grpc_bytes_contents_that_take_more_than_the_budget_to_read_are_refused_unread(served):
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("lik_cupy.serving.grpc")
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as rpc

    n = 12 << 20
    req = pb.ModelInferRequest(model_name="rerank")
    req.inputs.add(name="Q", datatype="FP32", shape=[2, DIM]).contents.fp32_contents.extend([0.5] * 2 * DIM)
    req.inputs.add(name="IDS", datatype="BYTES", shape=[n]).contents.bytes_contents.extend([b""] * n)
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}",
                               options=[("grpc.max_send_message_length", -1)]) as channel:
        with pytest.raises(grpc.RpcError) as e:
            rpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=120)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = e.value.details()
    assert "reading the request takes about" in details and "or numbers as raw_input_contents" in details


def test_grpc_typed_contents_are_read_without_a_list_of_them_all():
    """gRPC's typed contents were made one list of Python numbers (40 bytes each, 6 times their
    array's 8) before the array; a chunk of them at a time is."""
    import tracemalloc

    serving_grpc = pytest.importorskip("lik_cupy.serving.grpc")
    from tritonclient.grpc import service_pb2 as pb

    n = 1 << 20
    req = pb.ModelInferRequest(model_name="rerank")
    req.inputs.add(name="IDS", datatype="INT64", shape=[n]).contents.int64_contents.extend(range(1000, 1000 + n))
    tracemalloc.start()
    try:
        inputs, _, _ = serving_grpc._request(req, [], ("SCORES",))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(inputs["IDS"], np.arange(1000, 1000 + n))
    assert peak < 1.5 * n * 8


def _post_and_answer(server, model, body, headers):
    status, _, out = server.request("POST", f"/v2/models/{model}/infer", body, headers)
    return status, out


def test_a_parse_given_up_holds_its_bytes_until_the_parse_thread_is_done():
    """What a request holds of the server's budget stays held while the parse thread still reads
    it, though its handler gave up (its client left), and is given back in full, with what the
    parse held meanwhile, once the thread is done."""
    import asyncio
    import threading

    from lik_cupy.serving import _service

    svc = _service.Service(load=None, max_body_bytes=1000)
    go, started = threading.Event(), threading.Event()

    def read(hold):
        started.set()
        go.wait(60)
        hold(300)  # (what reading it takes, held by the thread after the handler has gone)
        return "parsed"

    async def handler():
        held = _service.Held(svc)
        held.add(100)
        task = asyncio.ensure_future(_service.off_loop(svc, held, read, held.reading("send it as binary")))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        held.release()
        return held

    asyncio.run(handler())
    assert svc.held == 100  # (the thread still reads the body)
    go.set()
    svc.parser.submit(lambda: None).result(60)  # (the parse thread is done with it)
    assert svc.held == 0


def test_what_reading_a_request_takes_is_held_and_refused_past_the_budget():
    """hold is called with what reading the JSON (and BYTES elements) will take, before it is read;
    past the server's whole budget the request is refused 413, naming how to send it instead."""
    from lik_cupy.serving import _service, _tensors

    svc = _service.Service(load=None, max_body_bytes=1 << 16)
    text = json.dumps({"inputs": [{"name": "IDS", "shape": [3], "datatype": "BYTES", "data": ["a", "bc", ""]}]})
    held = _service.Held(svc)
    calls = []

    def hold(n):
        calls.append(n)
        held.reading("send its tensors as binary data")(n)

    _, inputs = _tensors.read_request(text.encode(), None, hold=hold)
    assert inputs["IDS"].tolist() == ["a", "bc", ""]
    assert calls[0] == _tensors.json_bytes(text.encode()) and calls[1] == _tensors.string_bytes(3, 3)
    assert calls[2] == 3 * 2 * 4  # (the array: 3 elements of 2 characters)
    assert svc.held == sum(calls) == held.n
    held.release()
    pad = b"[" + b",".join([b"[[]]"] * (svc.max_held // 200)) + b"]"
    with pytest.raises(_service.Refused, match=r"reading the request takes about \d+ bytes of memory .* over the "
                                               r"1048576 that the server holds .*; send its tensors as binary") as e:
        _tensors.read_request(b'{"inputs": [], "pad": ' + pad + b"}", None, hold=held.reading(
            "send its tensors as binary data"))
    assert e.value.status == 413 and svc.held == 0


_JSON_SHAPES = [b"[]", b"[[]]", b"[[[]]]", b"{}", b'{"a":0}', b'{"a":[]}', b'{"a":0,"b":1}', b'{"k":"v"}', b'""',
                b'"ab"', b'"' + b"x" * 100 + b'"', '"é"'.encode(), b'"\\ud83d\\ude00abc"', '"😀abcdefgh"'.encode(),
                b"0", b"123456", b"0.5", b"-0.123456789", b"1e308", b"true", b"null", b"[0]", b"[0.5]"]


@pytest.mark.parametrize("item", _JSON_SHAPES, ids=lambda b: b.decode(errors="replace")[:12])
def test_json_bytes_covers_what_json_loads_takes(item):
    """An estimate from the text's punctuation, checked against what Python allocates (tracemalloc:
    the bytes asked for; pymalloc rounds them up by at most 15 each, which json_bytes counts in)."""
    import tracemalloc

    from lik_cupy.serving import _tensors

    text = b'{"inputs": [], "pad": [' + b",".join([item] * (200_000 // (len(item) + 1))) + b"]}"
    tracemalloc.start()
    try:
        value = _tensors._json(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert value["inputs"] == []
    assert _tensors.json_bytes(text) >= peak * 1.1


@pytest.mark.parametrize("datatype, values", [
    ("FP32", lambda rng, n: rng.standard_normal(n).tolist()),
    ("FP32", lambda rng, n: [0.5] * n),
    ("FP64", lambda rng, n: rng.standard_normal(n).tolist()),
    ("BF16", lambda rng, n: rng.standard_normal(n).tolist()),
    ("INT64", lambda rng, n: rng.integers(-10**12, 10**12, n).tolist()),
    ("INT8", lambda rng, n: rng.integers(-100, 100, n).tolist()),
    ("BOOL", lambda rng, n: (rng.random(n) < 0.5).tolist()),
    ("BYTES", lambda rng, n: [f"doc-{i}" for i in rng.integers(0, 10**6, n)]),
    ("BYTES", lambda rng, n: ["é😀"[i % 2] * (i % 4) for i in range(n)]),
])
@pytest.mark.parametrize("nested", [False, True])
def test_json_data_takes_what_json_loads_and_tensor_from_values_take(datatype, values, nested):
    """A JSON request's data takes, in Python objects, at most what json_bytes and string_bytes count."""
    import tracemalloc

    from lik_cupy.serving import _tensors

    rng = np.random.default_rng(35)
    data = values(rng, 60_000)
    shape = [6000, 10] if nested else [60_000]
    if nested:
        data = [data[i:i + 10] for i in range(0, len(data), 10)]
    text = json.dumps({"inputs": [{"name": "X", "shape": shape, "datatype": datatype, "data": data}]}).encode()
    held = []
    tracemalloc.start()
    try:
        _, inputs = _tensors.read_request(text, None, hold=held.append)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert inputs["X"].shape == tuple(shape)
    assert sum(held) >= peak * 1.1


def _before(name, data, shape, datatype):
    """tensor_from_values as it was before it checked the values' types as a set and read them in chunks."""
    from lik_cupy._shard_format import numpy_dtype
    from lik_cupy.serving import _tensors

    count = int(np.prod(shape))
    flat = _tensors._walk(data) if isinstance(data, list) else [data]  # (a Python step a value, as before)
    if len(flat) != count:
        raise ValueError(f"input {name}: shape {list(shape)} needs {count} values, got {len(flat)}")
    if datatype == "BYTES":
        if not all(isinstance(x, str) for x in flat):
            raise ValueError(f"input {name}: BYTES data must be strings")
        return _tensors._strings(name, [x.encode() for x in flat]).reshape(shape)
    if datatype == "BOOL":
        ok, what = all(isinstance(x, bool) for x in flat), "true or false"
    elif datatype.startswith(("INT", "UINT")):
        ok, what = all(isinstance(x, int) and not isinstance(x, bool) for x in flat), "integers"
    else:
        ok, what = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat), "numbers"
    if not ok:
        raise ValueError(f"input {name}: {datatype} data must be {what}")
    dt = numpy_dtype(_tensors.DTYPES[datatype])
    try:
        if datatype == "BF16":
            return np.asarray(flat, np.float64).astype(dt).reshape(shape)
        return np.asarray(flat, dtype=dt).reshape(shape)
    except OverflowError:
        raise ValueError(f"input {name}: a value does not fit {datatype}") from None


def test_tensor_from_values_takes_and_refuses_what_it_did_before():
    """Random nested lists of JSON's values (and their subclasses, as in-process callers might give)
    against each datatype: the same array, bit for bit, or the same error."""
    import warnings

    from lik_cupy.serving import _tensors

    class Int(int):
        pass

    class Float(float):
        pass

    rng = np.random.default_rng(36)
    pool = [0, 1, -1, 255, 256, -129, 2**31, 2**63, 2**64, 10**30, 0.5, -0.0, 1e308, float("nan"), float("inf"),
            16777217, 2**53 + 1, True, False, "a", "é😀", "", None, {}, Int(3), Float(2.5), np.float64(1.5)]
    datatypes = list(_tensors.DTYPES) + ["BYTES"]
    for _ in range(3000):
        n = int(rng.integers(0, 7))
        kinds = rng.choice(len(pool), int(rng.integers(1, 3)))
        flat = [pool[kinds[int(rng.integers(0, len(kinds)))]] for _ in range(n)]
        depth = int(rng.integers(0, 3))
        data, shape = flat, [n]
        if depth and n and n % 2 == 0:
            data, shape = [flat[i:i + 2] for i in range(0, n, 2)], [n // 2, 2]
            if depth == 2:
                data, shape = [data], [1, n // 2, 2]
        if rng.random() < 0.1 and data:  # (lists of uneven depth)
            data = [data[0], [data[1:]]]
        datatype = datatypes[int(rng.integers(0, len(datatypes)))]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (overflow in casts: inf)
            got, want = [], []
            for fn, out in ((_tensors.tensor_from_values, got), (_before, want)):
                try:
                    a = fn("X", data, tuple(shape), datatype)
                    out.append((a.dtype, a.shape, a.tobytes()))
                except (ValueError, TypeError) as e:
                    out.append((type(e), str(e)))
        assert got == want, (data, shape, datatype)
