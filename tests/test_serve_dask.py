"""``lik serve --scheduler``: the server in front of a :class:`lik_cupy.distributed.DistributedCorpus`.

A module-wide ``LocalCluster`` of two worker processes on the NumPy path, started by the test; the
Batcher over a ``ClusterCorpus`` in process (batches of queries of several lengths, string ids), and
``lik serve --scheduler ADDRESS`` as a real process on a loopback port answering tritonclient:
search, rerank and score bitwise the in-process ``Corpus`` calls, a bad request refused with a 400
while the server keeps serving, and the workers' shards dropped as the server stops (while it still
loads them too). Also the flags
``--scheduler`` does not take, and that importing the serving package imports no Dask.

With a cluster of their own (one worker in this process, over TCP): the server not ready while its
scheduler is gone, and ready again once one answers; ``--cluster-timeout`` answering a stuck
batch 504 after one cluster call. With clusters of worker processes closed and made again at one
address (a restarted scheduler): the server reloading its corpus onto the new one, through a new
client where its own closed for good, not ready meanwhile and then answering as before; SIGTERM
during that reload. The watch that heals a ClusterCorpus, over a stand-in corpus.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

import lik_cupy  # noqa: E402
from lik_cupy import shards  # noqa: E402
from lik_cupy.serving import Batcher, Observer  # noqa: E402
from lik_command import run_lik  # noqa: E402
from served import Server  # noqa: E402
from threads import run_threads  # noqa: E402

DIM = 16


def _docs(rng, n, hi=24):
    return [rng.standard_normal((int(L), DIM)).astype(np.float32) for L in rng.integers(1, hi, n)]


def _queries(rng, n, lo=1, hi=40):
    return [rng.standard_normal((int(L), DIM)).astype(np.float32) for L in rng.integers(lo, hi, n)]


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0",
                                  silence_logs=logging.ERROR) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with distributed.Client(cluster) as c:
        yield c


def _write(base, ids_of):
    """Three shards of 40, 7 and 50 documents, ids ``ids_of(first, stop)``; shard 2 repeats shard 0's
    first documents, so search meets exact ties across workers (the lower position must win)."""
    rng = np.random.default_rng(41)
    docs = _docs(rng, 97)
    docs[47:57] = docs[0:10]
    paths = []
    for n, (a, b) in enumerate([(0, 40), (40, 47), (47, 97)]):
        paths.append(str(base / f"shard{n}"))
        shards.pack_arrays(docs[a:b], paths[-1], ids=ids_of(a, b))
    return paths, docs


@pytest.fixture(scope="module")
def int_ids(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("served-dask"), lambda a, b: np.arange(a, b) * 10 + 3)


def _shards_held(client) -> set:
    """The corpora that any worker of ``client``'s cluster holds (their plugins' names)."""
    return {n for names in client.run(lambda dask_worker: list(dask_worker.plugins)).values() for n in names
            if n.startswith("lik-cupy-corpus-")}


def test_a_batcher_over_a_cluster_corpus_answers_bitwise_as_one_corpus(client, tmp_path):
    """Concurrent requests of several query lengths, batched (packed queries padded to the longest,
    with their lengths), string ids: each answer is bitwise the in-process Corpus call's. A request's
    precision is refused (it cannot reach the workers); closing the batcher drops the shards."""
    from lik_cupy.serving._cluster import load

    paths, docs = _write(tmp_path, lambda a, b: np.array([f"doc-{j}" for j in range(a, b)]))
    whole = lik_cupy.Corpus.from_shards(paths, device="cpu")
    rng = np.random.default_rng(42)
    qs = [*_queries(rng, 14), docs[3]]  # docs[3] ties with its copy, docs[50]
    cands = [rng.integers(0, len(whole), 25) for _ in qs]
    before = _shards_held(client)
    replica = load(client, paths, [shards.open_input(p) for p in paths], backend="cpu")
    with Batcher(replica, max_batch=6, max_delay_us=20_000) as b:
        assert b.devices == ["dask:0"] and len(b.corpus) == 97 and b.corpus.ids[0] == "doc-0"

        def call(j):
            q = qs[j]
            s, i = b.search(q, 9)
            s1, i1 = whole.search(q, 9)
            assert np.array_equal(s.view(np.uint32), s1.view(np.uint32)) and i.tolist() == i1.tolist()
            assert np.array_equal(b.rerank(q, cands[j]).view(np.uint32), whole.rerank(q, cands[j]).view(np.uint32))
            assert np.array_equal(b.score(q[None]).view(np.uint32), whole.score(q[None]).view(np.uint32))

        run_threads(len(qs), call)
        s, i = b.search(docs[3], 2)
        assert s[0] == s[1] and i.tolist() == ["doc-3", "doc-50"]
        with pytest.raises(ValueError, match="precision='fp32': the corpus is on a Dask cluster, whose workers score "
                                             "at their own precision"):
            b.search(qs[0], 3, precision="fp32")
        assert len(_shards_held(client)) == len(before) + 1
    assert _shards_held(client) == before
    # One batch for certain: the worker waits (30 s at most) until max_batch queries are queued.
    seen = _Batches()
    replica = load(client, paths, [shards.open_input(p) for p in paths], backend="cpu")
    with Batcher(replica, max_batch=4, max_delay_us=30_000_000, observer=seen) as b:
        short = [q[:n] for q, n in zip(qs, (3, 17, 30, 9))]
        for op, arg in (("search", 7), ("rerank", None), ("score", None)):
            futures = [b.submit(op, q, cands[j][:5] if op == "rerank" else arg) for j, q in enumerate(short)]
            for j, (f, q) in enumerate(zip(futures, short)):
                want = whole.search(q, 7) if op == "search" else \
                    (whole.rerank(q, cands[j][:5]) if op == "rerank" else whole.score(q),)
                got = f.result() if op == "search" else (f.result(),)
                assert all(np.array_equal(np.asarray(g).view(np.uint32) if g.dtype == np.float32 else g,
                                          np.asarray(w).view(np.uint32) if w.dtype == np.float32 else w)
                           for g, w in zip(got, want)), (op, j)
    assert seen.batches == [("dask:0", "search", 4), ("dask:0", "rerank", 4), ("dask:0", "score", 4)]


class _Batches(Observer):
    def __init__(self):
        self.batches = []

    def batch(self, device, op, requests, queries, compute_s):
        self.batches.append((device, op, queries))


@pytest.fixture(scope="module")
def served(cluster, int_ids):
    s = Server(*int_ids[0], "--scheduler", cluster.scheduler_address, "--max-batch", "8", "--max-delay-us", "2000")
    yield s
    s.stop()


def test_lik_serve_scheduler_answers_tritonclient_as_in_process(served, int_ids):
    th = pytest.importorskip("tritonclient.http")
    whole = lik_cupy.Corpus.from_shards(int_ids[0], device="cpu")
    rng = np.random.default_rng(43)
    c = th.InferenceServerClient(f"127.0.0.1:{served.port}")
    assert c.is_server_ready() and c.is_model_ready("rerank")
    assert c.get_model_config("score")["instance_group"] == [{"count": 1, "kind": "KIND_CPU"}]
    assert any("lik serve: ready: ClusterCorpus(DistributedCorpus(3 shards, 97 docs" in line and "dask:0" in line
               for line in served.lines)
    q = np.stack([q[:12] for q in _queries(rng, 3, lo=12)])
    Q = th.InferInput("Q", list(q.shape), "FP32")
    Q.set_data_from_numpy(q, binary_data=True)
    K = th.InferInput("K", [1], "INT32")
    K.set_data_from_numpy(np.array([10], np.int32))
    r = c.infer("search", [Q, K])
    s, i = whole.search(q, 10)
    assert np.array_equal(r.as_numpy("SCORES").view(np.uint32), s.view(np.uint32))
    assert np.array_equal(r.as_numpy("IDS"), i)
    positions = rng.integers(0, 97, (3, 30))
    ids = th.InferInput("IDS", list(positions.shape), "INT64")
    ids.set_data_from_numpy(positions * 10 + 3)
    r = c.infer("rerank", [Q, ids])
    assert np.array_equal(r.as_numpy("SCORES").view(np.uint32), whole.rerank(q, positions).view(np.uint32))
    r = c.infer("score", [Q])
    assert np.array_equal(r.as_numpy("SCORES").view(np.uint32), whole.score(q).view(np.uint32))


def test_lik_serve_scheduler_refuses_a_bad_request_with_a_400_and_keeps_serving(served, int_ids):
    q = np.ones((2, DIM), np.float32)
    Q = {"name": "Q", "shape": list(q.shape), "datatype": "FP32", "data": q.reshape(-1).tolist()}
    status, _, body = served.infer("rerank", {"inputs": [Q, {"name": "IDS", "shape": [2], "datatype": "INT64",
                                                            "data": [3, 971]}]})
    assert status == 400 and json.loads(body)["error"] == "unknown ids [971]", body
    status, _, body = served.infer("score", {"inputs": [Q], "parameters": {"precision": "tf32"}})
    assert status == 400 and "the corpus is on a Dask cluster" in json.loads(body)["error"], body
    status, _, body = served.infer("rerank", {"inputs": [Q, {"name": "IDS", "shape": [2], "datatype": "INT64",
                                                            "data": [3, 963]}]})
    whole = lik_cupy.Corpus.from_shards(int_ids[0], device="cpu")
    assert status == 200 and np.array_equal(np.float32(json.loads(body)["outputs"][0]["data"]),
                                            whole.rerank(q, [0, 96]))


def test_the_servers_shards_leave_the_workers_as_it_stops(cluster, client, int_ids):
    before = _shards_held(client)
    server = Server(*int_ids[0], "--scheduler", cluster.scheduler_address)
    try:
        assert len(_shards_held(client)) == len(before) + 1
    finally:
        err = server.stop()
    assert server.proc.returncode == 0, err
    assert _shards_held(client) == before


def _slow_loads(started: str, go_on: str):
    """A worker plugin: each shard load on the workers first creates the file ``started``, then waits
    until the file ``go_on`` exists (60 s at most). It wraps the workers' ``_load`` (the task runs it
    by name), so the task waits, not the worker's event loop; its teardown puts the real one back."""

    class SlowLoads(distributed.WorkerPlugin):
        def setup(self, worker):
            import os
            import time

            import lik_cupy.distributed as dist

            self.real = real = dist._load

            def _load(*args):
                open(started, "a").close()
                deadline = time.monotonic() + 60
                while not os.path.exists(go_on) and time.monotonic() < deadline:
                    time.sleep(0.05)
                return real(*args)

            dist._load = _load

        def teardown(self, worker):
            import lik_cupy.distributed as dist

            dist._load = self.real

    return SlowLoads()


def test_a_server_stopped_while_the_corpus_loads_leaves_no_shards_on_the_workers(cluster, client, int_ids, tmp_path):
    """SIGTERM while `lik serve --scheduler` still loaded the corpus onto the cluster: the server
    exited and left the corpus (its worker plugin, and every shard loaded so far) on the workers for
    the cluster's life, since the client closed before anything dropped it. Stopping during the load
    now closes the corpus before the server exits, and exits 0 as any stop does."""
    import os
    import signal
    import time
    from pathlib import Path

    from lik_command import child_pythonpath

    started, go_on = tmp_path / "started", tmp_path / "go-on"
    before = _shards_held(client)
    client.register_plugin(_slow_loads(str(started), str(go_on)), name="lik-test-slow-loads")
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "lik_cupy", "serve", *int_ids[0], "--scheduler",
                                 cluster.scheduler_address, "--port", "0"], stderr=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parents[1],
                                env={**os.environ, "PYTHONPATH": child_pythonpath()})
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the corpus never began to load"
            time.sleep(0.05)
        assert len(_shards_held(client)) == len(before) + 1  # the corpus is on the workers, still loading
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=60)[1]
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err
        assert _shards_held(client) == before, err
    finally:
        go_on.touch()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(60)
        client.unregister_worker_plugin("lik-test-slow-loads")


def test_scheduler_refuses_the_flags_that_place_the_corpus_here(int_ids):
    for extra, named in ((["--devices", "cpu"], "--devices"), (["--partition"], "--partition"),
                         (["--replicate", "--processes", "2"], "--processes, --replicate")):
        r = run_lik("serve", int_ids[0][0], "--scheduler", "tcp://127.0.0.1:1", *extra)
        assert r.exit_code == 2, r.output
        assert r.stderr == (f"lik: error: --scheduler: serves the corpus from the cluster's workers, which hold the "
                            f"shards; drop {named}\n")
    pytest.importorskip("starlette")
    from lik_cupy.serving.http import serve

    for placed in ({"devices": ["cpu"]}, {"partition": False}, {"processes": 2}):  # (checked before anything opens)
        with pytest.raises(ValueError, match="client serves the corpus from the Dask cluster's workers; devices, "
                                             "partition and processes place it in this server"):
            serve(int_ids[0], client=object(), **placed)
    # a scheme Dask cannot use as it is configured: refused before listening, exit 2
    r = run_lik("serve", int_ids[0][0], "--scheduler", "tls://127.0.0.1:1")
    assert r.exit_code == 2 and r.stderr.startswith("lik: error: --scheduler: cannot reach a Dask scheduler at "
                                                    "tls://127.0.0.1:1: "), r.stderr


def test_importing_the_serving_package_imports_no_dask():
    pytest.importorskip("starlette")
    code = ("import sys, lik_cupy.serving, lik_cupy.serving.http, lik_cupy.serving._cluster; "
            "print(sorted(m for m in ('dask', 'distributed', 'lik_cupy.distributed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _until(check, what: str, timeout: float = 30.0):
    """Poll ``check()`` until it returns something true (returned); AssertionError naming ``what``
    after ``timeout`` seconds (a bound on a wait, not a timing assertion)."""
    import time

    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return got


def _local(port: int | None = None, threads: int = 1):
    """A LocalCluster of one worker thread pool in this process (quick to start and to close);
    ``port``: its scheduler's."""
    return distributed.LocalCluster(n_workers=1, processes=False, threads_per_worker=threads, dashboard_address=":0",
                                    protocol="tcp://", scheduler_port=port or 0, host="127.0.0.1",
                                    silence_logs=logging.CRITICAL)


def test_lik_serve_scheduler_is_not_ready_while_its_scheduler_is_gone(int_ids):
    """The cluster closed under `lik serve --scheduler`: /v2/health/ready stayed 200 and every
    request failed with a 500. Now ready answers 503 while the client has no scheduler, an
    inference request is refused 503 with Retry-After naming the lost scheduler, and ready turns
    200 again once a scheduler answers at the address (Dask's client reconnects)."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    cluster = _local(port)
    server = None
    try:
        server = Server(*int_ids[0], "--scheduler", address)
        q = np.ones((2, DIM), np.float32)
        Q = {"name": "Q", "shape": list(q.shape), "datatype": "FP32", "data": q.reshape(-1).tolist()}
        assert server.infer("score", {"inputs": [Q]})[0] == 200
        cluster.close()
        _until(lambda: server.get("/v2/health/ready")[0] == 503, "ready stayed 200 with the scheduler gone")
        assert server.get("/v2/models/score/ready")[0] == 503
        status, head, body = server.infer("score", {"inputs": [Q]})
        assert status == 503 and "retry-after" in head, (status, body)
        error = json.loads(body)["error"]
        assert f"lost the connection to the Dask scheduler at {address}" in error, error
        cluster = _local(port)  # a scheduler at the address again: the client reconnects
        _until(lambda: server.get("/v2/health/ready")[0] == 200, "ready stayed 503 with a scheduler back")
    finally:
        if server is not None:
            server.stop()
        cluster.close()


def _restarted(port: int, n_workers: int = 1):
    """A LocalCluster of worker processes whose scheduler (in this process) listens on ``port``.
    Closed and made again, it is a scheduler restarted at the address with workers of its own: a
    Dask worker exits when its scheduler goes, so a restarted ``dask scheduler`` meets new workers."""
    return distributed.LocalCluster(n_workers=n_workers, processes=True, threads_per_worker=1, dashboard_address=":0",
                                    protocol="tcp://", scheduler_port=port, host="127.0.0.1",
                                    silence_logs=logging.CRITICAL)


def _search_and_rerank(server) -> list:
    """A search (top 10) and a rerank (30 ids each) of three 12-token queries: each answer's outputs,
    as the server sent them (JSON: float32 scores written exactly)."""
    rng = np.random.default_rng(44)
    q = np.stack([q[:12] for q in _queries(rng, 3, lo=12)])
    Q = {"name": "Q", "shape": list(q.shape), "datatype": "FP32", "data": q.reshape(-1).tolist()}
    ids = rng.integers(0, 97, (3, 30)) * 10 + 3
    answers = []
    for model, extra in (("search", {"name": "K", "shape": [1], "datatype": "INT32", "data": [10]}),
                         ("rerank", {"name": "IDS", "shape": list(ids.shape), "datatype": "INT64",
                                     "data": ids.reshape(-1).tolist()})):
        status, _, body = server.infer(model, {"inputs": [Q, extra]})
        assert status == 200, (model, status, body)
        answers.append(json.loads(body)["outputs"])
    return answers


def _ready(server) -> int:
    return server.get("/v2/health/ready")[0]


def test_lik_serve_scheduler_reloads_the_corpus_onto_a_restarted_scheduler(int_ids):
    """A scheduler restarted at the address under `lik serve --scheduler` (a new one, its workers
    new too): the server's client reconnected, ready turned 200, and every request failed with a
    500 (the workers had no corpus) until the server was restarted. Now the server sees the new
    scheduler, stays not ready (503) while it reloads the corpus onto the new workers, turns ready
    by itself, and a search and a rerank answer bitwise as before the restart."""
    port = _free_port()
    cluster = _restarted(port)
    server = None
    try:
        server = Server(*int_ids[0], "--scheduler", f"tcp://127.0.0.1:{port}")
        before = _search_and_rerank(server)
        cluster.close()
        _until(lambda: _ready(server) == 503, "ready stayed 200 with the scheduler gone")
        cluster = _restarted(port)
        _until(lambda: _ready(server) == 200, "ready stayed 503 with a new scheduler at the address")
        assert _search_and_rerank(server) == before
        server.wait_line("lik serve: ready again: the corpus is loaded on the Dask cluster at tcp://127.0.0.1:")
    finally:
        if server is not None:
            server.stop()
        cluster.close()
    assert server.proc.returncode == 0, "".join(server.lines)


def test_lik_serve_scheduler_recovers_once_its_closed_client_is_replaced(int_ids):
    """The scheduler gone past Dask's reconnect window (its connect timeout, shortened here): the
    server's client closed for good, and the server stayed not ready for ever, its liveness still
    200, so nothing restarted it. Now it connects a new client to the address, retrying (each
    failed attempt said on stderr) while no scheduler answers, the requests meanwhile refused 503
    with Retry-After naming the scheduler; once one answers it reloads the corpus and turns ready,
    answering bitwise as before."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    cluster = _restarted(port)
    server = None
    try:
        server = Server(*int_ids[0], "--scheduler", address,
                        env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"})
        before = _search_and_rerank(server)
        cluster.close()
        server.wait_line(f"lik serve: reloading the corpus onto the Dask cluster at {address} failed (attempt 1)")
        assert server.get("/v2/health/live")[0] == 200
        status, head, body = server.infer("score", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32",
                                                                "data": [1.0] * DIM}]})
        assert status == 503 and "retry-after" in head, (status, body)
        assert f"the Dask client of the scheduler at {address} closed" in json.loads(body)["error"], body
        cluster = _restarted(port)
        _until(lambda: _ready(server) == 200, "ready stayed 503 with a scheduler back at the address")
        assert _search_and_rerank(server) == before
    finally:
        if server is not None:
            server.stop()
        cluster.close()
    assert server.proc.returncode == 0, "".join(server.lines)


def test_a_server_stopped_while_it_reloads_the_corpus_exits_0_and_leaves_no_shards(int_ids, tmp_path):
    """SIGTERM while the server reloads its corpus onto a restarted scheduler's workers (each load
    held by a plugin until the test lets go): the server drops what it loaded, and exits 0."""
    port = _free_port()
    cluster = _restarted(port)
    server = new = None
    started, go_on = tmp_path / "started", tmp_path / "go-on"
    try:
        server = Server(*int_ids[0], "--scheduler", f"tcp://127.0.0.1:{port}")
        cluster.close()
        _until(lambda: _ready(server) == 503, "ready stayed 200 with the scheduler gone")
        cluster = _restarted(port, n_workers=0)
        new = distributed.Client(cluster)
        new.register_plugin(_slow_loads(str(started), str(go_on)), name="lik-test-slow-loads")
        cluster.scale(1)  # (its worker takes the plugin as it joins)
        _until(started.exists, "the corpus never began to reload")
        assert _ready(server) == 503 and len(_shards_held(new)) == 1
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
        err = "".join(server.lines)
        assert server.proc.returncode == 0, err
        assert "Traceback" not in err, err
        assert _shards_held(new) == set(), err
    finally:
        go_on.touch()
        if server is not None:
            server.stop()
        if new is not None:
            new.close()
        cluster.close()


def test_a_cluster_replica_is_unavailable_until_its_scheduler_is_known_and_heals_itself(capsys):
    """ClusterCorpus reads its client's status (no round trip): unavailable while it is not
    'running', and once it is again until the watch has asked whether the scheduler is still the
    corpus's (a restarted one would not be); the watch then reloads a lost corpus, each failed
    attempt said on stderr, unavailable meanwhile (a call refused with ConnectionError, which the
    server answers 503), available once it is back. A Corpus replica is always available."""
    from lik_cupy.serving._cluster import ClusterCorpus

    fake = _FakeDistributed()
    replica = ClusterCorpus(fake)
    with Batcher(replica) as b:
        assert replica.unavailable() is None and b.unavailable() is None
        fake.client.status = "connecting"
        assert replica.unavailable() == b.unavailable()
        assert b.unavailable().startswith("lost the connection to the Dask scheduler at tcp://10.0.0.1:8786 (its "
                                          "client is 'connecting': Dask reconnects")
        fake.client.status = "running"
        assert b.unavailable() == ("reconnected to the Dask scheduler at tcp://10.0.0.1:8786, not yet known to be the "
                                   "one holding the corpus")
        fake.lost_why = "it restarted"
        fake.failures = [TimeoutError("no worker joined")]  # the first reload's; the second waits for `go`
        replica.watch()
        _until(lambda: fake.reloads == 2, "the watch did not reload the lost corpus again")
        why = "reloading the corpus onto the Dask cluster at tcp://10.0.0.1:8786: it restarted"
        assert b.unavailable() == why
        with pytest.raises(ConnectionError, match=why):
            b.search(np.ones((3, DIM), np.float32), 2)
        fake.go.set()
        _until(lambda: b.unavailable() is None, "unavailable once the corpus reloaded")
    err = capsys.readouterr().err
    assert ("lik serve: reloading the corpus onto the Dask cluster at tcp://10.0.0.1:8786 failed (attempt 1): "
            "TimeoutError: no worker joined; trying again in 0.5 s\n") in err, err
    assert "lik serve: ready again: the corpus is loaded on the Dask cluster at tcp://10.0.0.1:8786 (attempt 2)\n" \
        in err, err
    with Batcher(lik_cupy.Corpus(np.ones((3, 4, DIM), np.float32), device="cpu")) as b:
        assert b.unavailable() is None


def test_a_cluster_replica_turns_ready_only_on_the_scheduler_it_reloaded_onto(capsys):
    """A reload that ended with the scheduler again a new one (one restarting twice in a row; the
    corpus loaded onto the scheduler in between): the replica said "ready again" and turned
    available at once, until the watch's next question 2 s later, every request meanwhile
    reaching a scheduler without the corpus. It now asks once the reload is done, and reloads
    again, unavailable meanwhile."""
    from lik_cupy.serving._cluster import ClusterCorpus

    class Again(_FakeDistributed):
        def reload(self):
            self.reloads += 1
            if self.reloads == 1:  # loaded, but by then the scheduler is a new one again
                self.lost_why = "it restarted again"
                return
            self.go.wait(60)
            self.lost_why = None

    fake = Again()
    fake.lost_why = "it restarted"
    replica = ClusterCorpus(fake)
    try:
        replica.watch()
        _until(lambda: fake.reloads == 2, "the watch did not reload the corpus again")
        assert replica.unavailable() == "reloading the corpus onto the Dask cluster at tcp://10.0.0.1:8786: it restarted"
        err = capsys.readouterr().err
        assert "ready again" not in err, err
        assert ("lik serve: reloading the corpus onto the Dask cluster at tcp://10.0.0.1:8786 failed (attempt 1): "
                "ConnectionError: the shards loaded, but it restarted again; trying again in 0.5 s\n") in err, err
        fake.go.set()
        _until(lambda: replica.unavailable() is None, "unavailable once the corpus reloaded")
    finally:
        replica.close()
    err = capsys.readouterr().err
    assert "lik serve: ready again: the corpus is loaded on the Dask cluster at tcp://10.0.0.1:8786 (attempt 2)\n" \
        in err, err


def test_a_call_that_fails_across_a_reload_is_refused_as_the_cluster_s_not_the_request_s():
    """A batch that began before its scheduler restarted and failed only once the corpus had been
    reloaded onto the new one: asked then, the cluster held the corpus again, so the failure
    ("worker ... has no corpus") went out as the request's own (500). A call that fails while a
    reload begun since it started is under way or done is now a ConnectionError (503: retry)."""
    from lik_cupy.serving._cluster import ClusterCorpus

    entered, leave = threading.Event(), threading.Event()

    class Slow(_FakeDistributed):
        def search(self, Q, k, q_lengths):
            entered.set()
            leave.wait(60)
            raise RuntimeError("lik_cupy.distributed: worker tcp://10.0.0.2:4000 has no corpus lik-cupy-corpus-0")

    fake = Slow()
    replica = ClusterCorpus(fake)
    got = []

    def call():
        try:
            replica.search(np.ones((3, DIM), np.float32), 2, q_offsets=np.array([0, 3]))
        except Exception as e:  # noqa: BLE001 - the test's to check
            got.append(e)

    t = threading.Thread(target=call)
    try:
        t.start()
        assert entered.wait(30)
        fake.lost_why = "it restarted"
        replica.watch()
        _until(lambda: fake.reloads == 1, "the watch did not reload the lost corpus")
        fake.go.set()
        _until(lambda: replica.unavailable() is None, "unavailable once the corpus reloaded")
        leave.set()
        t.join(30)
    finally:
        leave.set()
        replica.close()
    assert len(got) == 1 and isinstance(got[0], ConnectionError), got
    assert "reloaded onto the Dask cluster at tcp://10.0.0.1:8786 while the call ran" in str(got[0]), got


class _FakeDistributed:
    """A stand-in for a DistributedCorpus of 5 documents: its client's ``status`` is the test's to
    set; each call counts itself and raises ``error`` (TimeoutError, as a stuck cluster's).
    ``lost()`` says ``lost_why``; ``reload()`` counts itself, raises the next of ``failures``, or
    waits for ``go`` (60 s at most) and has the corpus back."""

    def __init__(self, error=None):
        import types

        self.client = types.SimpleNamespace(status="running",
                                            scheduler=types.SimpleNamespace(address="tcp://10.0.0.1:8786"))
        self.num_docs, self.dim, self.dtype = 5, DIM, "float32"
        self.error, self.calls = error, 0
        self.lost_why, self.failures, self.reloads, self.go = None, [], 0, threading.Event()

    def search(self, Q, k, q_lengths):
        self.calls += 1
        raise self.error

    rerank = score = search

    def lost(self):
        return self.lost_why

    def reload(self):
        self.reloads += 1
        if self.failures:
            raise self.failures.pop(0)
        self.go.wait(60)
        self.lost_why = None

    def close(self):
        pass


def test_a_batch_the_cluster_timed_out_fails_whole_without_retrying_each_request():
    """A batch whose cluster call timed out was retried one request at a time, each waiting the
    whole timeout again: a batch of n requests took n + 1 timeouts. A TimeoutError (and a lost
    connection) is no fault of one request: the whole batch now fails with it at once."""
    from lik_cupy.serving._cluster import ClusterCorpus

    for error in (TimeoutError("lik_cupy.distributed: the query batch did not finish within 1 s (timeout=)"),
                  ConnectionError("lik_cupy.distributed: the Dask client is closed")):
        fake = _FakeDistributed(error)
        with Batcher(ClusterCorpus(fake), max_batch=4, max_delay_us=30_000_000) as b:
            futures = [b.submit("search", np.ones((3, DIM), np.float32), 2) for _ in range(4)]
            for f in futures:
                with pytest.raises(type(error), match="lik_cupy.distributed"):
                    f.result(60)
        assert fake.calls == 1, (error, fake.calls)


class _Stuck:
    """lik_cupy.distributed's search task, held until ``release`` is set (60 s at most); ``started``
    counts its calls. (At module level: Dask pickles the task's function by name, and a closure
    holding the event would not pickle.)"""

    started: list = []
    release = threading.Event()
    real = None

    @staticmethod
    def top_k(*args, **kwargs):
        _Stuck.started.append(1)
        _Stuck.release.wait(60)
        return _Stuck.real(*args, **kwargs)


def test_lik_serve_cluster_timeout_answers_a_stuck_batch_504_at_once(int_ids, monkeypatch):
    """--cluster-timeout reaches the DistributedCorpus: a batch of three requests on a cluster whose
    query tasks hang is answered 504 for each, naming the timeout, after one cluster call (its
    workers began one task, not one more for each request alone)."""
    import lik_cupy.distributed as dist

    started, release = _Stuck.started, _Stuck.release
    started.clear()
    release.clear()
    monkeypatch.setattr(_Stuck, "real", dist._top_k)
    monkeypatch.setattr(dist, "_top_k", _Stuck.top_k)  # (the worker runs in this process, and finds it by name)
    cluster = _local(threads=8)
    server = None
    try:
        server = Server(*int_ids[0], "--scheduler", cluster.scheduler_address, "--cluster-timeout", "1",
                        "--max-batch", "3", "--max-delay-us", "30000000")
        q = np.ones((2, DIM), np.float32)
        body = {"inputs": [{"name": "Q", "shape": list(q.shape), "datatype": "FP32", "data": q.reshape(-1).tolist()},
                           {"name": "K", "shape": [1], "datatype": "INT32", "data": [3]}]}
        answers = [None] * 3
        run_threads(3, lambda j: answers.__setitem__(j, server.infer("search", body)))
        for status, _, text in answers:
            assert status == 504, text
            assert "within 1 s (timeout=)" in json.loads(text)["error"], text
        assert len(started) == 1, (len(started), answers)
    finally:
        release.set()
        if server is not None:
            server.stop()
        cluster.close()


def test_cluster_timeout_needs_the_scheduler_and_seconds(int_ids):
    r = run_lik("serve", int_ids[0][0], "--cluster-timeout", "5")
    assert r.exit_code == 2 and r.stderr == ("lik: error: --cluster-timeout: bounds each wait on the Dask cluster of "
                                             "--scheduler; give --scheduler too\n"), r.stderr
    for bad in ("0", "-1", "nan", "inf"):
        r = run_lik("serve", int_ids[0][0], "--scheduler", "tcp://127.0.0.1:1", "--cluster-timeout", bad)
        assert r.exit_code == 2 and "--cluster-timeout" in r.stderr and "positive number of seconds" in r.stderr, \
            r.stderr
    pytest.importorskip("starlette")
    from lik_cupy.serving.http import serve

    with pytest.raises(ValueError, match="cluster_timeout bounds the waits on the cluster of client; give client"):
        serve(int_ids[0], cluster_timeout=5.0)
