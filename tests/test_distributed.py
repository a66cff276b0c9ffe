"""lik_cupy.distributed on a real Dask cluster: results bitwise those of single-process ``retrieve``.

CPU (CI): one module-wide ``LocalCluster`` of two worker processes on the NumPy path. Covers
ties, NaN and empty documents, rerank (bitwise single-process ``Corpus.rerank``), a worker killed
in the middle of a query or a rerank (its shards reload, the batch reruns, a RuntimeWarning says so), a worker restarted under its own address and
``client.restart()`` mid-query (the batch reruns), a worker joining (shards move to it), threads
sharing a corpus, a corrupt shard, timeouts (and what a timed-out call leaves on the workers), a listed
worker the client cannot reach, what close (or collection) leaves on the workers, a scheduler
restarted or a client closed for good (``lost``, ``reload``), and ``lik score --scheduler``. Clusters of 1 and 4 workers in threads check the ranking
and the stage times of a search, with the queries sent to each worker or copied on by Dask, and
with merge tasks on the workers. GPU (marked ``gpu``; needs two GPUs and dask-cuda; uses up to
four): the same checks on a ``LocalCUDACluster``, shards resident on the GPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import threading
import time
import warnings

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

from lik_command import run_lik  # noqa: E402
from threads import run_threads  # noqa: E402

from lik_cupy import _shard_format as fmt  # noqa: E402
from lik_cupy import maxsim_varlen, retrieve, shards  # noqa: E402
from lik_cupy.distributed import DistributedCorpus, _place  # noqa: E402
from lik_cupy.errors import ShardError  # noqa: E402

DIM = 16
# Documents per shard: a shard without documents, and one far larger than the rest.
SHARD_DOCS = (23, 0, 9, 41, 17, 30)


def _make_corpus(root, rng, dtype=np.float32):
    """Random shards with exact ties (documents repeated across shards), NaN tokens and empty
    documents. Returns (shard paths, [(tokens, offsets)])."""
    parts = []
    for n in SHARD_DOCS:
        lens = rng.integers(1, 9, n)
        lens[rng.random(n) < 0.15] = 0  # empty documents score -inf
        if n:  # at least one in every shard that has documents, away from the ends the ties replace
            lens[n // 2] = 0
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        tok = rng.standard_normal((int(off[-1]), DIM)).astype(dtype)
        parts.append([tok, off])
    # Ties: shard 3 ends with copies of shard 0's first documents, shard 5 with shard 2's.
    for (dst, src, m) in ((3, 0, 6), (5, 2, 5)):
        tok, off = parts[dst]
        stok, soff = parts[src]
        lens = np.concatenate([np.diff(off)[:-m], np.diff(soff)[:m]])
        tok = np.concatenate([tok[: off[-m - 1]], stok[: soff[m]]])
        parts[dst] = [tok, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)]
    for j in (0, 4):  # NaN: a token of one document in shards 0 and 4
        tok, off = parts[j]
        doc = int(np.flatnonzero(np.diff(off) > 0)[1])
        tok[off[doc], 3] = np.nan
    paths = []
    for j, (tok, off) in enumerate(parts):
        paths.append(str(root / f"shard{j}"))
        shards.write_shard(paths[-1], tok, off)
    return paths, [tuple(p) for p in parts]


def _queries(rng, nq=5, lq=6, dtype=np.float32):
    Q = rng.standard_normal((nq, lq, DIM)).astype(dtype)
    q_lengths = rng.integers(1, lq + 1, nq)
    q_lengths[1] = 0  # a query without tokens scores 0 against every document: all ties
    return Q, q_lengths


def _same(got, expected):
    """Bitwise equal rankings: scores (NaN included) and positions."""
    (s, i), (es, ei) = got, expected
    assert s.dtype == np.float32 and i.dtype == np.int64 and s.shape == es.shape
    np.testing.assert_array_equal(i, ei)
    np.testing.assert_array_equal(s.view(np.uint32), np.asarray(es, np.float32).view(np.uint32))


# --------------------------------------------------------------------------- placement (no cluster)


def test_place_balances_by_size_and_keeps_shards_where_they_are():
    sizes = {0: 80, 1: 20, 2: 40, 3: 40, 4: 20}
    first = _place(sizes, {"a": 1, "b": 1}, {})
    load = {w: sum(sizes[i] for i, x in first.items() if x == w) for w in "ab"}
    assert sorted(load.values()) == [100, 100]
    assert _place(sizes, {"a": 1, "b": 1}, first) == first  # nothing moves without a reason
    # A worker joins: shards move to it until the shares are as even as single moves make them.
    third = _place(sizes, {"a": 1, "b": 1, "c": 1}, first)
    moved = [i for i in sizes if third[i] != first[i]]
    assert moved and all(third[i] == "c" for i in moved)
    assert max(sum(sizes[i] for i, x in third.items() if x == w) for w in "abc") <= 80
    # A worker leaves: its shards go to the others; the survivors keep theirs.
    survivors = {i: w for i, w in first.items() if w == "a"}
    after = _place(sizes, {"a": 1, "c": 1}, survivors)
    assert all(after[i] == "a" for i in survivors) and set(after) == set(sizes)
    # Capacities weigh the shares: a worker with three times the memory takes about three quarters.
    big = _place({i: 10 for i in range(8)}, {"small": 1, "big": 3}, {})
    assert sum(w == "big" for w in big.values()) == 6


def test_place_moves_shards_to_a_joining_worker_without_scanning_every_shard_per_move():
    # Every shard on one worker, a second joins: half of them move. Each move scanned every shard,
    # so the call grew with the shards squared (1.5 s for 4,000); count the size lookups instead.
    class Sizes(dict):
        reads = 0

        def __getitem__(self, i):
            Sizes.reads += 1
            return super().__getitem__(i)

    n = 2000
    sizes = Sizes({i: 1000 + (i * 7919) % 5000 for i in range(n)})
    placed = _place(sizes, {"a": 1e9, "b": 1e9}, dict.fromkeys(range(n), "a"))
    load = {w: sum(dict.__getitem__(sizes, i) for i, x in placed.items() if x == w) for w in "ab"}
    assert abs(load["a"] - load["b"]) <= 6000  # even up to a shard
    assert Sizes.reads <= 10 * n


class _Clock:
    """``time`` for the distributed module, calling ``hook()`` at its ``at``-th ``perf_counter`` call."""

    def __init__(self, at: int, hook):
        self.calls, self.at, self.hook = 0, at, hook
        self.time = time.time

    def perf_counter(self) -> float:
        self.calls += 1
        if self.calls == self.at:
            self.hook()
        return time.perf_counter()


def _one_worker_store(tmp_path, rng, monkeypatch):
    """lik_cupy.distributed, a worker's store of this process (its tasks run here, in this thread), the
    parts of a corpus made for it and their refs (the source and the fingerprint each task takes)."""
    import lik_cupy.distributed as dist

    paths, parts = _make_corpus(tmp_path, rng)
    store = dist._Store(1.0, "cpu", None, False)
    store.setup(None)
    monkeypatch.setattr(dist, "_store", lambda name: store)
    monkeypatch.setattr(distributed, "get_worker", lambda: dataclasses.make_dataclass("W", ["address"])("w"))
    return dist, store, parts, [((p, None), dist._describe((p, None), False).fingerprint) for p in paths]


def test_a_shard_dropped_while_a_search_uses_it_is_released_when_the_search_ends(tmp_path, rng, monkeypatch):
    """A worker with several threads: a move's ``_drop`` lands between a search task taking its shards
    and scoring them (there, at its second clock reading). The task scores them whole; the shards
    are released once it ends."""
    dist, store, parts, refs = _one_worker_store(tmp_path, rng, monkeypatch)
    work = [(0, 0, refs[0]), (2, 23, refs[2]), (3, 32, refs[3])]  # (shards 0 and 2: 23 and 9 documents)
    Q, q_lengths = _queries(rng)
    want = retrieve(Q, [parts[i] for i in (0, 2, 3)], 7, q_lengths=q_lengths, backend="cpu")
    held = []

    def drop():
        held.extend(store.resident.values())
        store.drop([0, 2, 3])

    monkeypatch.setattr(dist, "time", _Clock(2, drop))
    scores, local, _ = dist._top_k("corpus", (Q, q_lengths), 7, work)
    _same((scores, local), want)
    assert len(held) == 3 and not store.resident
    assert all(r.part == () for r in held)  # released as the task ended


def test_a_search_queued_before_a_move_does_not_load_the_moved_shard_back_for_good(tmp_path, rng, monkeypatch):
    """Threads: one thread's search task was queued on the worker a shard then moved away from (another
    thread's call re-placed it, and the move's _drop landed first). The task loaded the shard again and
    the worker kept it for good, a second copy the corpus did not know of (its memory never handed
    back until close). The task now scores such a shard from a copy released as it ends."""
    dist, store, parts, refs = _one_worker_store(tmp_path, rng, monkeypatch)
    assert dist._load("corpus", [(0, refs[0]), (2, refs[2])]) == [(0, "host memory"), (2, "host memory")]
    dist._drop("corpus", [0])  # shard 0 moved to another worker
    Q, q_lengths = _queries(rng)
    got = dist._top_k("corpus", (Q, q_lengths), 7, [(0, 0, refs[0]), (2, 23, refs[2])])
    _same(got[:2], retrieve(Q, [parts[0], parts[2]], 7, q_lengths=q_lengths, backend="cpu"))
    assert sorted(store.resident) == [2]
    S = dist._piece("corpus", (Q, q_lengths), 0, refs[0], 3, 9)
    np.testing.assert_array_equal(S, maxsim_varlen(Q, *parts[0], q_lengths=q_lengths, backend="cpu")[:, 3:9])
    assert sorted(store.resident) == [2]
    made, make = [], dist._make_resident  # a task whose other shard fails to load: its copy released too
    monkeypatch.setattr(dist, "_make_resident", lambda *args: made.append(make(*args)) or made[-1])
    with pytest.raises(ShardError, match="changed since the DistributedCorpus was built on it"):
        dist._top_k("corpus", (Q, q_lengths), 7, [(0, 0, refs[0]), (3, 32, (refs[3][0], refs[2][1]))])
    assert len(made) == 1 and made[0].part == () and sorted(store.resident) == [2]
    dist._load("corpus", [(0, refs[0])])  # moved back here: held again
    assert sorted(store.resident) == [0, 2]
    # A worker restarted empty (a store set up afresh) still loads what its tasks ask for, and keeps it.
    store.setup(None)
    dist._top_k("corpus", (Q, q_lengths), 7, [(0, 0, refs[0])])
    assert sorted(store.resident) == [0]


def test_a_tasks_own_copy_of_a_moved_shard_counts_against_the_gpu_room_while_it_lives(tmp_path, rng, monkeypatch):
    """A task queued before a move reads the moved shard into a copy of its own. That copy was not
    counted in the store's GPU bytes, so a load meanwhile was offered the room it took (and could
    overfill the GPU); nor was a shard dropped while a task used it, from the drop until its release.
    Both count now until they are released. (Host arrays stand in for the GPU's, counted as its.)"""
    import sys
    import types

    dist, store, parts, refs = _one_worker_store(tmp_path, rng, monkeypatch)
    capacity = 1 << 30
    monkeypatch.setattr(store, "gpu", lambda: True)
    monkeypatch.setattr(store, "capacity", lambda: capacity)
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool))
    rooms, make = [], dist._make_resident

    def on_gpu(shard, dtype, room):
        rooms.append(room)
        return dataclasses.replace(make(shard, dtype, None), where="GPU")

    monkeypatch.setattr(dist, "_make_resident", on_gpu)
    dist._load("corpus", [(0, refs[0]), (2, refs[2])])
    size = {i: r.nbytes for i, r in store.resident.items()}
    assert store.gpu_bytes == size[0] + size[2]
    dist._drop("corpus", [0])  # shard 0 moved to another worker
    assert store.gpu_bytes == size[2]
    with store.holding([(0, refs[0]), (2, refs[2])]) as held:  # a task queued before the move
        assert sorted(store.resident) == [2] and store.gpu_bytes == size[0] + size[2]
        dist._load("corpus", [(3, refs[3])])
        assert rooms[-1] == capacity - size[0] - size[2]
        size[3] = store.resident[3].nbytes
        dist._drop("corpus", [2])  # dropped while the task uses it: its memory is still taken
        assert store.gpu_bytes == size[0] + size[2] + size[3]
    assert store.gpu_bytes == size[3] and sorted(store.resident) == [3] and all(r.part == () for r in held)


@pytest.mark.parametrize("int8", [False, True])
def test_a_rerank_task_scores_its_candidates_as_the_single_process_rerank(tmp_path, rng, monkeypatch, int8):
    """The worker's side of a rerank, in this process: a query's candidates over two shards, in runs
    bounded by _PIECE_BYTES (shrunk here to a few documents' tokens, and below one document's, which is
    then read in place), repeated and empty documents, a query without tokens; float and INT8 shards.
    Bitwise Corpus.from_shards(...).rerank of the same queries and positions."""
    from lik_cupy import Corpus, quantize_int8

    dist, store, parts, refs = _one_worker_store(tmp_path, rng, monkeypatch)
    if int8:  # the same documents (NaN made 0), quantized into shards of their own
        for j in (0, 2):
            path = str(tmp_path / f"int8-{j}")
            tokens, scales = quantize_int8(np.nan_to_num(parts[j][0]))
            shards.write_shard(path, tokens, parts[j][1], scales=scales)
            refs[j] = ((path, None), dist._describe((path, None), False).fingerprint)
    whole = Corpus.from_shards([refs[0][0][0], refs[2][0][0]], device="cpu", ids=False)
    Q, q_lengths = _queries(rng)
    cand = rng.integers(0, 32, (Q.shape[0], 12))  # shard 0: positions 0..22, shard 2: 23..31
    cand[0, :3] = cand[0, 3]  # repeated
    cand[2, :2] = [np.flatnonzero(np.diff(parts[0][1]) == 0)[0], 23 + np.flatnonzero(np.diff(parts[2][1]) == 0)[0]]
    want = whole.rerank(Q, cand, q_lengths=q_lengths)
    rows = np.repeat(np.arange(Q.shape[0]), cand.shape[1])
    shard = np.where(cand.reshape(-1) < 23, 0, 2)
    docs = cand.reshape(-1) - np.where(shard == 0, 0, 23)
    for piece in (dist._PIECE_BYTES, 40 * 4 * DIM, 4):
        monkeypatch.setattr(dist, "_PIECE_BYTES", piece)
        got = dist._rerank("corpus", (Q, q_lengths, rows, shard, docs), [(0, refs[0]), (2, refs[2])])
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want.reshape(-1).view(np.uint32))
    assert np.isneginf(want).any() and (want[1] == 0).all()  # empty documents; query 1 has no tokens
    assert dist._rerank("corpus", (Q, q_lengths, rows[:0], shard[:0], docs[:0]), []).shape == (0,)


# --------------------------------------------------------------------------- CPU cluster


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0",
                                  silence_logs=logging.ERROR) as cluster, distributed.Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    rng = np.random.default_rng(31)
    return _make_corpus(tmp_path_factory.mktemp("distributed"), rng)


@pytest.fixture(scope="module")
def corpus(client, corpus_files):
    with DistributedCorpus(client, corpus_files[0], backend="cpu") as c:
        yield c


def test_query_lengths_are_checked_before_any_task(corpus, rng):
    Q, _ = _queries(rng)
    with pytest.raises(ValueError, match=rf"q_lengths has shape \[2\]; expected \[{Q.shape[0]}\]"):
        corpus.search(Q, 3, q_lengths=[1, 2])
    with pytest.raises(ValueError, match=rf"q_lengths has {Q.shape[1] + 1}, outside \[0, {Q.shape[1]}\]"):
        corpus.search(Q, 3, q_lengths=np.full(Q.shape[0], Q.shape[1] + 1))
    with pytest.raises(TypeError, match="q_lengths must be integers"):
        corpus.score(Q, q_lengths=np.ones(Q.shape[0]))
    # retrieve's shapes exactly: a scalar for a 2-D Q, [Nq] for a 3-D one (not any array of Nq values)
    with pytest.raises(ValueError, match=r"q_lengths has shape \[1\]; expected \[\] \(one per query\)"):
        corpus.search(Q[0], 3, q_lengths=[2])
    with pytest.raises(ValueError, match=rf"q_lengths has shape \[{Q.shape[0]}, 1\]; expected \[{Q.shape[0]}\]"):
        corpus.score(Q, q_lengths=np.ones((Q.shape[0], 1), np.int64))


def test_search_is_retrieve_bitwise(corpus, corpus_files, rng):
    parts = corpus_files[1]
    assert corpus.num_docs == sum(SHARD_DOCS) and corpus.dtype == "float32" and corpus.dim == DIM
    assert {w for w, _ in corpus.placement.values()} == set(corpus.client.nthreads())  # both workers hold shards
    assert {where for _, where in corpus.placement.values()} == {"host memory"}
    Q, q_lengths = _queries(rng)
    for k in (1, 7, 200):  # 200 > the corpus's 120 documents: every document, ranked
        _same(corpus.search(Q, k, q_lengths=q_lengths), retrieve(Q, parts, k, q_lengths=q_lengths, backend="cpu"))
    got = corpus.search(Q, 200, q_lengths=q_lengths)
    assert np.isnan(got[0]).any() and np.isneginf(got[0]).any()  # NaN and empty documents took part
    _same(corpus.search(Q[2], 9), retrieve(Q[2], parts, 9, backend="cpu"))  # one query, [Lq, d]


STAGES = ("placement_s", "ship_s", "submit_s", "wait_s", "slowest_task_s", "round_trip_s", "gather_s", "merge_s",
          "total_s")


@pytest.mark.parametrize("n, direct_max, fan_in", [(1, 8, 4), (4, 8, 4), (4, 1, 2)])
def test_one_and_four_workers_rank_identically_and_time_each_stage(corpus_files, rng, monkeypatch, n, direct_max,
                                                                   fan_in):
    """1 and 4 workers (threads of this process) rank as retrieve does, and every search records its
    stages. Also with the queries sent once and copied on by Dask (direct_max=1), and with merge
    tasks on the workers (fan_in=2: 4 rankings become 2 before the client's merge)."""
    import lik_cupy.distributed as dist

    monkeypatch.setattr(dist, "_DIRECT_MAX", direct_max)
    monkeypatch.setattr(dist, "_FAN_IN", fan_in)
    Q, q_lengths = _queries(rng)
    with distributed.LocalCluster(n_workers=n, processes=False, threads_per_worker=1, dashboard_address=":0",
                                  silence_logs=logging.ERROR) as cluster, distributed.Client(cluster) as c, \
            DistributedCorpus(c, corpus_files[0], backend="cpu") as corpus:
        assert corpus.last_search is None
        holders = {w for w, _ in corpus.placement.values()}
        assert len(holders) == n
        for k in (7, 200):
            _same(corpus.search(Q, k, q_lengths=q_lengths), retrieve(Q, corpus_files[1], k, q_lengths=q_lengths,
                                                                     backend="cpu"))
        stages = corpus.last_search
    assert all(stages[name] >= 0 for name in STAGES if name != "round_trip_s")
    assert (stages["workers"], stages["queries"], stages["k"]) == (n, Q.shape[0], 200)
    assert {t["worker"] for t in stages["tasks"]} == holders
    for t in stages["tasks"]:
        assert t["task_s"] >= t["retrieve_s"] + t["positions_s"] >= 0 and t["ended"] >= t["started"]
    assert stages["slowest_task_s"] == max(t["task_s"] for t in stages["tasks"])
    assert len(stages["merge_tasks"]) == (2 if fan_in == 2 else 0)  # 4 rankings -> 2 merge tasks of 2


def test_threads_sharing_a_corpus_each_get_their_own_exact_result(corpus, corpus_files, rng):
    """Six threads at once, each a few searches (its own queries and k) and a score: every call
    returns what the single-process call returns for its own arguments, and no Dask future
    outlives the calls."""
    parts = corpus_files[1]
    calls = [_queries(rng, nq=2 + j) + (3 + 5 * j,) for j in range(6)]
    want = [(retrieve(Q, parts, k, q_lengths=ql, backend="cpu"),
             np.concatenate([maxsim_varlen(Q, t, o, q_lengths=ql, backend="cpu") for t, o in parts], axis=1))
            for Q, ql, k in calls]

    def work(j):
        Q, ql, k = calls[j]
        for _ in range(3):
            _same(corpus.search(Q, k, q_lengths=ql), want[j][0])
        np.testing.assert_array_equal(corpus.score(Q, q_lengths=ql).view(np.uint32), want[j][1].view(np.uint32))

    run_threads(len(calls), work)
    deadline = time.monotonic() + 30  # (a released future leaves the client on its event loop, soon after)
    while corpus.client.futures:
        assert time.monotonic() < deadline, f"futures outlived the calls: {sorted(corpus.client.futures)}"
        time.sleep(0.05)


def test_score_is_the_full_matrix(corpus, corpus_files, rng):
    Q, q_lengths = _queries(rng)
    expected = np.concatenate([maxsim_varlen(Q, t, o, q_lengths=q_lengths, backend="cpu") for t, o in corpus_files[1]],
                              axis=1)
    got = corpus.score(Q, q_lengths=q_lengths)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_score_fills_an_out_of_the_shape_it_returns(corpus, rng):
    """A 2-D Q (one query) returns [num_docs], but out had to be [1, num_docs]."""
    Q, _ = _queries(rng, nq=2)
    expected = corpus.score(Q)
    for q, want in ((Q, expected), (Q[1], expected[1])):
        out = np.full(want.shape, 7.0, np.float32)
        assert corpus.score(q, out=out) is out
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    n = corpus.num_docs
    for q, bad in ((Q[1], np.empty((1, n), np.float32)), (Q, np.empty(n, np.float32)),
                   (Q[1], np.empty(n, np.float64)), (Q[1], [0.0] * n)):
        with pytest.raises(ValueError, match=re.escape(f"out must be a float32 NumPy array of shape "
                                                       f"{list(q.shape[:-2]) + [n]} (the scores of this Q), got")):
            corpus.score(q, out=bad)


def test_score_checks_out_and_write_before_any_task(corpus, rng):
    """score(Q, out=a, write=f) handed the pieces to f and left a as it was, unfilled and unsaid; a
    read-only out and a write that cannot be called failed only once the first piece came back
    (NumPy's 'assignment destination is read-only', "'int' object is not callable")."""
    Q, _ = _queries(rng, nq=2)
    out = np.zeros((2, corpus.num_docs), np.float32)
    with pytest.raises(ValueError, match="give out or write, not both"):
        corpus.score(Q, out=out, write=lambda first, S: None)
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"out is read-only; give a writeable float32 array of shape \[2, "):
        corpus.score(Q, out=out)
    with pytest.raises(TypeError, match=r"write must be a callable write\(first_doc, scores\), got int"):
        corpus.score(Q, write=3)


def test_rerank_is_the_single_process_rerank_bitwise(corpus, corpus_files, rng):
    """Candidates in every shard (ties, NaN and empty documents among them), some repeated, a query
    without tokens, rows whose candidates all lie on one worker: each score is bitwise what
    Corpus.from_shards(...).rerank gives in one process, and the column of the full matrix."""
    from lik_cupy import Corpus

    whole = Corpus.from_shards(corpus_files[0], device="cpu", ids=False)
    Q, q_lengths = _queries(rng)
    n = corpus.num_docs
    cand = rng.integers(0, n, (Q.shape[0], 40))
    cand[2] = np.arange(n)[:40]  # shards 0 and 2 (and the empty shard's place between them)
    cand[3, :5] = n - 1
    want = whole.rerank(Q, cand, q_lengths=q_lengths)
    got = corpus.rerank(Q, cand, q_lengths=q_lengths)
    assert got.dtype == np.float32 and got.shape == cand.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    matrix = corpus.score(Q, q_lengths=q_lengths)
    np.testing.assert_array_equal(got.view(np.uint32), np.take_along_axis(matrix, cand, 1).view(np.uint32))
    assert np.isnan(corpus.rerank(Q, np.arange(n)[None].repeat(Q.shape[0], 0), q_lengths=q_lengths)).any()
    for c in (cand[0, :7], cand[0, :7].tolist(), cand[0, :7].astype(np.uint16)):  # one query, [Lq, d]; list; uint
        np.testing.assert_array_equal(corpus.rerank(Q[0], c).view(np.uint32),
                                      whole.rerank(Q[0], cand[0, :7]).view(np.uint32))
    assert corpus.rerank(Q, cand[:, :0]).shape == (Q.shape[0], 0)
    assert corpus.rerank(Q[:0], np.zeros((0, 3), np.int64)).shape == (0, 3)
    assert corpus.rerank(Q[0], []).shape == (0,)


def test_rerank_candidates_are_checked_before_any_task(corpus, rng):
    Q, _ = _queries(rng)
    n = corpus.num_docs
    for bad, value in ((-1, -1), (n, n)):
        cand = np.zeros((Q.shape[0], 3), np.int64)
        cand[1, 2] = bad
        with pytest.raises(ValueError, match=re.escape(f"candidates holds {value}; every entry must be in [0, {n - 1}] "
                                                       f"(global positions of the corpus's {n} documents)")):
            corpus.rerank(Q, cand)
    with pytest.raises(ValueError, match=re.escape(f"candidates has shape [3]; expected [Nq, K] with Nq = "
                                                   f"{Q.shape[0]}")):
        corpus.rerank(Q, [1, 2, 3])
    with pytest.raises(ValueError, match=re.escape("candidates has shape [1, 3]; expected [K] (Q is one query)")):
        corpus.rerank(Q[0], [[1, 2, 3]])
    with pytest.raises(TypeError, match="candidates must be integer document positions, got dtype float64"):
        corpus.rerank(Q[0], np.array([1.0]))
    with pytest.raises(TypeError, match="candidates must be a NumPy array or a list of document positions"):
        corpus.rerank(Q[0], "12")
    with pytest.raises(ValueError, match="candidates is a ragged list"):
        corpus.rerank(Q[:2], [[1, 2], [3]])
    with pytest.raises(ValueError, match=r"q_lengths has shape \[2\]; expected"):
        corpus.rerank(Q, np.zeros((Q.shape[0], 1), np.int64), q_lengths=[1, 2])


def test_bad_queries_are_refused_on_the_client(corpus, rng):
    Q, _ = _queries(rng)
    with pytest.raises(ValueError, match="k must be an integer in"):
        corpus.search(Q, 0)
    with pytest.raises(ValueError, match=f"d={DIM}"):
        corpus.search(Q[..., :3].copy(), 5)
    with pytest.raises(TypeError, match="Q is float16 but the corpus holds float32"):
        corpus.search(Q.astype(np.float16), 5)


def test_backend_and_dtype_are_checked_as_the_single_process_call_checks_them(client, corpus_files):
    """backend (and dtype) went through a membership test of a tuple: a NumPy array of names failed
    with NumPy's 'The truth value of an array with more than one element is ambiguous', where
    retrieve names the argument (lik_cupy._dispatch.backend.check_backend, the one check every
    public function shares). Now the same check and words; a NumPy dtype still means its name."""
    paths = corpus_files[0][:2]
    for bad in (np.array(["cpu", "gpu"]), ("cpu",), ["cpu"], None, "CPU"):
        with pytest.raises(ValueError, match=re.escape(f"backend must be one of ('auto', 'gpu', 'cpu'), got {bad!r}")):
            retrieve(np.zeros((1, DIM), np.float32), [corpus_files[1][0]], 1, backend=bad)
        with pytest.raises(ValueError, match=re.escape(f"backend must be one of ('auto', 'gpu', 'cpu'), got {bad!r}")):
            DistributedCorpus(client, paths, backend=bad)
    for bad in (np.array(["float16", "float32"]), ("float16",), np.float16, "f2"):
        with pytest.raises(ValueError, match=re.escape(f"dtype must be None or one of float16, float32, bfloat16, got "
                                                       f"{bad!r}")):
            DistributedCorpus(client, paths, backend="cpu", dtype=bad)
    with DistributedCorpus(client, paths, backend="cpu", dtype=np.dtype("float16")) as corpus:
        assert corpus.dtype == "float16" and isinstance(corpus.dtype, str)


def test_queries_in_the_other_byte_order_score_as_retrieve(corpus, corpus_files, rng):
    """retrieve takes big-endian float32 queries; the corpus refused them with 'Q is >f4 but the
    corpus holds float32'. They are now the same queries, in native order, bit for bit."""
    Q, q_lengths = _queries(rng)
    big = Q.astype(Q.dtype.newbyteorder(">"))
    want = retrieve(big, corpus_files[1], 7, q_lengths=q_lengths, backend="cpu")
    _same(want, retrieve(Q, corpus_files[1], 7, q_lengths=q_lengths, backend="cpu"))
    _same(corpus.search(big, 7, q_lengths=q_lengths), want)
    np.testing.assert_array_equal(corpus.score(big[1]).view(np.uint32), corpus.score(Q[1]).view(np.uint32))
    with pytest.raises(TypeError, match="Q is float16 but the corpus holds float32"):
        corpus.search(Q.astype(">f2"), 5)


def test_edge_inputs_give_the_single_process_result(corpus, client, corpus_files, tmp_path, rng):
    """No queries, queries without tokens, k past the corpus and a corpus of empty shards each give
    what retrieve and maxsim_varlen give in one process."""
    parts = corpus_files[1]
    for nq, lq in ((0, 6), (3, 0), (0, 0)):
        Q = rng.standard_normal((nq, lq, DIM)).astype(np.float32)
        _same(corpus.search(Q, 9), retrieve(Q, parts, 9, backend="cpu"))
        assert corpus.score(Q).shape == (nq, corpus.num_docs)
    _same(corpus.search(np.zeros((0, DIM), np.float32), 500), retrieve(np.zeros((0, DIM), np.float32), parts, 500,
                                                                       backend="cpu"))
    empty = [corpus_files[0][1], str(tmp_path / "empty")]
    shards.write_shard(empty[1], np.zeros((0, DIM), np.float32), [0])
    Q, q_lengths = _queries(rng)
    with DistributedCorpus(client, empty, backend="cpu") as nothing:
        _same(nothing.search(Q, 5, q_lengths=q_lengths), retrieve(Q, [parts[1], parts[1]], 5, q_lengths=q_lengths,
                                                                   backend="cpu"))
        assert nothing.num_docs == 0 and nothing.score(Q).shape == (Q.shape[0], 0)


def test_shards_that_do_not_make_one_corpus_are_named_and_leave_nothing_on_the_workers(client, corpus_files, tmp_path,
                                                                                       rng):
    """Shards of other dims, of float and INT8 tokens, or of two float dtypes without dtype= are each
    refused naming both shards; the workers keep nothing of the corpus that failed."""
    from lik_cupy import quantize_int8

    tok = rng.standard_normal((6, DIM)).astype(np.float32)
    made = {}
    for name, t, scales in (("wide", np.concatenate([tok, tok], axis=1), None), ("half", tok.astype(np.float16), None),
                            ("int8", *quantize_int8(tok))):
        made[name] = str(tmp_path / name)
        shards.write_shard(made[name], t, [0, 2, 6], scales=scales)
    first = corpus_files[0][0]

    def corpora():  # the corpora each worker holds
        return client.run(lambda dask_worker: sorted(n for n in dask_worker.plugins if n.startswith("lik-cupy-corpus-")))

    before = corpora()
    for paths, error, words in (
            ([first, made["wide"]], ValueError, f"{made['wide']} has d={2 * DIM} but {first} has d={DIM}; every shard "
                                                "needs the same embedding dim"),
            ([first, made["int8"]], TypeError, f"{made['int8']} holds int8 tokens but {first} holds float32: a corpus "
                                               "is all INT8 or all float"),
            ([first, made["half"]], ValueError, f"{made['half']} holds float16 tokens but {first} holds float32; pass "
                                                "dtype= to cast every shard"),
            ([made["int8"]], ValueError, "dtype='float16' casts float shards, but the corpus is INT8")):
        with pytest.raises(error, match=re.escape(words)):
            DistributedCorpus(client, paths, backend="cpu", dtype="float16" if len(paths) == 1 else None)
    assert corpora() == before


def test_timeout_and_memory_fraction_are_checked_numbers(client, corpus_files):
    """timeout=inf (no limit, as a caller may mean it), or any past threading.TIMEOUT_MAX, failed on
    the first wait with OverflowError ('timestamp out of range for platform time_t'), and a timeout
    or device_memory_fraction given as a string or None with a bare comparison TypeError ("'>' not
    supported between instances of 'str' and 'int')."""
    paths = corpus_files[0][:2]
    for bad in (float("inf"), 1e10):  # past threading.TIMEOUT_MAX (9.2e9 s) too
        with pytest.raises(ValueError, match=r"timeout must be a positive, finite number of seconds \(at most "
                                             rf"9.22e\+09\), got {bad!r}"):
            DistributedCorpus(client, paths, backend="cpu", timeout=bad)
    for bad in ("5", None):
        with pytest.raises(TypeError, match=rf"timeout must be a number of seconds, got {bad!r}"):
            DistributedCorpus(client, paths, backend="cpu", timeout=bad)
    with pytest.raises(TypeError, match=r"device_memory_fraction must be a number in \(0, 1\], got '0.5'"):
        DistributedCorpus(client, paths, backend="cpu", device_memory_fraction="0.5")
    with DistributedCorpus(client, paths, backend="cpu", timeout=np.float32(60), device_memory_fraction=np.float64(.5)):
        pass


def test_bf16_bits_is_checked_as_a_flag(client, corpus_files):
    """bf16_bits went to the workers unchecked, where any truthy value (the string "no", a list)
    read uint16 files as bfloat16 bits and anything falsy (None, 0) did not. Now it is True or False
    (NumPy's bools too), checked on the client before any worker is asked, as every on/off argument
    of the package is (lik_cupy._validate.check_flag)."""
    paths = corpus_files[0][:2]
    for bad in ("no", "False", None, 1, 0, [True]):
        with pytest.raises(TypeError, match=re.escape(f"bf16_bits must be True or False, got {bad!r}")):
            DistributedCorpus(client, paths, backend="cpu", bf16_bits=bad)
    with DistributedCorpus(client, paths, backend="cpu", bf16_bits=np.True_) as corpus:
        assert corpus.num_docs == sum(off.size - 1 for _, off in corpus_files[1][:2])


def test_a_corrupt_or_missing_shard_fails_naming_the_file(client, corpus_files, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(corpus_files[0][0], bad)
    tokens = bad / fmt.TOKENS
    tokens.write_bytes(tokens.read_bytes()[:-40])
    with pytest.raises(ShardError, match="truncated .npy file") as e:
        DistributedCorpus(client, [corpus_files[0][2], str(bad)], backend="cpu")
    assert e.value.path == str(tokens) and "\n" not in str(e.value)
    with pytest.raises(ShardError, match="missing: no such file"):
        DistributedCorpus(client, [str(tmp_path / "missing")], backend="cpu")


def test_waits_time_out_with_a_clear_message(corpus, corpus_files, rng):
    Q, _ = _queries(rng)
    corpus.client.register_plugin(_staller(1.5), name="lik-test-staller")
    corpus.timeout = 0.5
    try:
        with pytest.raises(TimeoutError, match=r"a search batch did not finish within 0.5 s \(timeout=\) on tcp://"):
            corpus.search(Q, 3)
        corpus.client.run(lambda: None)  # (once the stalled search's workers answer again: the stall is in their loop)
        with pytest.raises(TimeoutError, match=r"a rerank batch did not finish within 0.5 s \(timeout=\) on tcp://"):
            corpus.rerank(Q, np.zeros((Q.shape[0], 2), np.int64))
    finally:
        corpus.timeout = 300.0
        corpus.client.unregister_worker_plugin("lik-test-staller")
    with distributed.LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as empty, \
            distributed.Client(empty) as c:
        with pytest.raises(TimeoutError, match="no Dask worker is connected to the scheduler at .* within 0.5 s"):
            DistributedCorpus(c, corpus_files[0], timeout=0.5)


def _frame_futures(error: BaseException) -> list:
    """The Dask futures that the frames of ``error``'s traceback hold (as locals, or in a list, tuple
    or dict local)."""
    found, tb = [], error.__traceback__
    while tb is not None:
        for v in tb.tb_frame.f_locals.values():
            items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
            found += [x for x in items if isinstance(x, distributed.Future)]
        tb = tb.tb_next
    return found


def test_a_timed_out_call_leaves_no_query_copies_on_the_workers(corpus, rng):
    """A search or rerank that timed out left its queries (and its tasks' results, once they ended)
    on the workers for as long as the caller held the TimeoutError: its traceback's frames held
    their futures. They are released as the call raises, and the error holds none of them."""
    Q, _ = _queries(rng)
    client = corpus.client

    def data():  # the queries (scattered tuples) and task results of calls that the workers hold
        # (an earlier call's may be on their way out: only what comes after counts)
        held = client.run(lambda dask_worker: [str(k) for k in dask_worker.data])
        return sorted(k for keys in held.values() for k in keys if k.startswith(("tuple-", "lik-cupy-top-k",
                                                                                 "lik-cupy-rerank")))

    before = data()
    client.register_plugin(_staller(1.5), name="lik-test-staller")
    corpus.timeout = 0.5
    errors = []
    try:
        for call in (lambda: corpus.search(Q, 3), lambda: corpus.rerank(Q, np.zeros((Q.shape[0], 2), np.int64))):
            with pytest.raises(TimeoutError, match="did not finish within 0.5 s") as e:
                call()
            errors.append(e.value)
            client.run(lambda: None)  # (once the stalled workers answer again)
    finally:
        corpus.timeout = 300.0
        client.unregister_worker_plugin("lik-test-staller")
    deadline = time.monotonic() + 30
    while set(data()) - set(before):  # (the stalled tasks end on the workers, their results dropped)
        assert time.monotonic() < deadline, f"the workers hold {data()}, {before} before the calls"
        time.sleep(0.1)
    assert len(errors) == 2 and not [f for e in errors for f in _frame_futures(e)]  # (held until here)


@pytest.mark.parametrize("call, method", [("search", "scatter"), ("search", "gather"), ("rerank", "scatter")])
def test_a_listed_worker_that_cannot_be_reached_is_handled_as_one_that_left(corpus, rng, monkeypatch, call, method):
    """A worker restarting under its own address is listed by the scheduler before it listens again
    (and one on its way out is listed still): the client's own connection to it, to send it the
    queries or to gather the rankings from it, failed with Dask's OSError, and that escaped the call.
    Such a call now runs again, exact, with a RuntimeWarning, as when a worker left."""
    Q, q_lengths = _queries(rng)
    cand = np.tile(np.arange(0, corpus.num_docs, 5), (Q.shape[0], 1))
    run = {"search": lambda: corpus.search(Q, 9, q_lengths=q_lengths),
           "rerank": lambda: (corpus.rerank(Q, cand, q_lengths=q_lengths),)}[call]
    want = run()
    w = min(w for w, _ in corpus.placement.values())
    real, failed = getattr(corpus.client, method), []

    def once(*args, **kwargs):
        if not failed:
            failed.append(method)
            if method == "gather":
                raise distributed.comm.CommClosedError(f"in <TCP (closed) ConnectionPool.gather "
                                                       f"local=tcp://127.0.0.1:1 remote={w}>: Stream is closed")
            raise OSError(f"Timed out trying to connect to {w} after 30 s")
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus.client, method, once)
    with pytest.warns(RuntimeWarning, match=f"could not reach a worker that the scheduler still listed during a "
                                            f"{call} \\(.*{w}.*\\).*the call then ran again. The results are exact"):
        got = run()
    assert failed == [method]
    for g, e in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint32) if g.dtype == np.float32 else g,
                                      e.view(np.uint32) if e.dtype == np.float32 else e)


def _staller(seconds: float):
    """A worker plugin that holds each search and rerank task ``seconds`` before it runs."""

    class Staller(distributed.WorkerPlugin):
        def transition(self, key, start, finish, **kwargs):
            if finish == "executing" and str(key).startswith(("lik-cupy-top-k", "lik-cupy-rerank")):
                import time

                time.sleep(seconds)

    return Staller()


def test_lik_score_on_a_scheduler(client, corpus_files, tmp_path, rng):
    """`lik score --scheduler` writes what `lik score --cpu` writes in one process: top-k and the full
    matrix, over shard directories and a padded .npy input with its lengths."""
    Q, q_lengths = _queries(rng)
    np.save(tmp_path / "q.npy", Q)
    np.save(tmp_path / "ql.npy", q_lengths)
    tok, off = corpus_files[1][0]
    lens = np.diff(off)
    padded = np.zeros((len(lens), int(lens.max()), DIM), np.float32)
    padded[np.arange(padded.shape[1])[None, :] < lens[:, None]] = tok
    np.save(tmp_path / "padded.npy", padded)
    np.save(tmp_path / "lens.npy", lens)
    address = client.scheduler.address
    base = ["score", "-q", tmp_path / "q.npy", "--q-lengths", tmp_path / "ql.npy", "-d", *corpus_files[0],
            tmp_path / "padded.npy", "--d-lengths", tmp_path / "lens.npy", "--cpu"]
    for suffix, extra in ((".tsv", ["-k", 9]), (".npy", ["--full-matrix"])):
        here, there = tmp_path / f"here{suffix}", tmp_path / f"there{suffix}"
        assert run_lik(*base, *extra, "-o", here).exit_code == 0
        r = run_lik(*base, *extra, "-o", there, "--scheduler", address)
        assert r.exit_code == 0, r.stderr
        assert there.read_bytes() == here.read_bytes()
    r = run_lik(*base, "-o", tmp_path / "x.tsv", "--scheduler", "tcp://127.0.0.1:1", "--devices", "0,1")
    assert r.exit_code == 2 and "lik: error: --scheduler: scores on the cluster's workers" in r.stderr
    # A scheme Dask cannot use without configuration was an "internal error", exit 1.
    r = run_lik(*base, "-o", tmp_path / "x.tsv", "--scheduler", "tls://127.0.0.1:1")
    assert r.exit_code == 2 and r.stderr.startswith("lik: error: --scheduler: cannot reach a Dask scheduler at "
                                                    "tls://127.0.0.1:1: "), r.stderr
    assert not (tmp_path / "x.tsv").exists()


def test_relative_paths_are_the_clients_not_the_workers(client, corpus_files, tmp_path, rng, monkeypatch):
    """Relative shard paths were handed to the workers as they were, so each worker looked them up in
    its own working directory: `lik score --scheduler` over shards that were right there failed with
    "no such file". They now mean the client's working directory."""
    root = tmp_path / "here"
    root.mkdir()
    for i in (0, 2):
        shutil.copytree(corpus_files[0][i], root / f"shard{i}")
    Q, q_lengths = _queries(rng)
    np.save(root / "q.npy", Q)
    monkeypatch.chdir(root)  # the workers started elsewhere, and stay there
    with DistributedCorpus(client, ["shard0", "shard2"], backend="cpu") as corpus:
        _same(corpus.search(Q, 7, q_lengths=q_lengths),
              retrieve(Q, [corpus_files[1][0], corpus_files[1][2]], 7, q_lengths=q_lengths, backend="cpu"))
    base = ["score", "-q", "q.npy", "-d", "shard0", "shard2", "-k", 5, "--cpu"]
    assert run_lik(*base, "-o", "here.tsv").exit_code == 0
    r = run_lik(*base, "-o", "there.tsv", "--scheduler", client.scheduler.address)
    assert r.exit_code == 0, r.stderr
    assert (root / "there.tsv").read_bytes() == (root / "here.tsv").read_bytes()


def test_a_worker_killed_mid_query_reloads_its_shards_and_the_query_reruns(client, corpus_files, rng):
    """A worker plugin kills one worker's process as its search task starts. The shards it held
    reload on the other worker, the batch reruns, and the result is still exact. The nanny then
    restarts the worker, and the next search moves shards back to it (a worker joining)."""
    Q, q_lengths = _queries(rng)
    expected = retrieve(Q, corpus_files[1], 11, q_lengths=q_lengths, backend="cpu")
    with DistributedCorpus(client, corpus_files[0], backend="cpu") as corpus:
        victim = corpus.placement[3][0]
        client.register_plugin(_killer(victim), name="lik-test-killer")
        try:
            with pytest.warns(RuntimeWarning, match=f"worker {victim} left during a search, which then ran again"):
                got = corpus.search(Q, 11, q_lengths=q_lengths)
        finally:
            client.unregister_worker_plugin("lik-test-killer")
        _same(got, expected)
        assert victim not in {w for w, _ in corpus.placement.values()}
        client.wait_for_workers(2, timeout=60)  # the nanny's new process, under a new address
        _same(corpus.search(Q, 11, q_lengths=q_lengths), expected)
        assert {w for w, _ in corpus.placement.values()} == set(client.nthreads())
        # A rerank too: its candidates' worker killed as its task starts; the batch reruns, exact.
        cand = np.tile(np.arange(0, corpus.num_docs, 3), (Q.shape[0], 1))
        want = corpus.rerank(Q, cand, q_lengths=q_lengths)
        victim = corpus.placement[3][0]
        client.register_plugin(_killer(victim, "lik-cupy-rerank"), name="lik-test-killer")
        try:
            with pytest.warns(RuntimeWarning, match=f"worker {victim} left during a rerank, which then ran again"):
                got = corpus.rerank(Q, cand, q_lengths=q_lengths)
        finally:
            client.unregister_worker_plugin("lik-test-killer")
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        client.wait_for_workers(2, timeout=60)


def test_a_worker_restarted_under_its_address_mid_call_reruns_the_call(corpus_files, tmp_path, rng):
    """A worker whose nanny restarts it under the same address (a fixed --worker-port) mid-search,
    and a client.restart() mid-search: the scheduler cancels the call's tasks ('already forgotten',
    'scheduler-restart') while no worker it knew of is missing, and Dask's FutureCancelledError
    escaped the call. The call now runs again, exact, with a RuntimeWarning saying why."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    Q, q_lengths = _queries(rng)
    expected = retrieve(Q, corpus_files[1], 11, q_lengths=q_lengths, backend="cpu")
    with distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1, host="127.0.0.1",
                                  worker_port=port, dashboard_address=":0", silence_logs=logging.CRITICAL) as cluster, \
            distributed.Client(cluster) as c, \
            DistributedCorpus(c, corpus_files[0], backend="cpu", timeout=60) as corpus:
        [address] = c.nthreads()
        killed = str(tmp_path / "killed")
        c.register_plugin(_once(killed, "kill"), name="lik-test-once-kill")
        with pytest.warns(RuntimeWarning, match="the scheduler cancelled the tasks of a search though no worker they "
                                                "needed was missing .Dask's reason: [^)]*already forgotten.*the call "
                                                "then ran again"):
            _same(corpus.search(Q, 11, q_lengths=q_lengths), expected)
        assert os.path.exists(killed) and list(c.nthreads()) == [address]  # the same address, a new process
        c.unregister_worker_plugin("lik-test-once-kill")

        stalled = str(tmp_path / "stalled")
        c.register_plugin(_once(stalled, "stall"), name="lik-test-once-stall")

        def restart():  # once the search task waits (bounded, daemon: a failed search leaves no thread behind)
            deadline = time.monotonic() + 60
            while not os.path.exists(stalled) and time.monotonic() < deadline:
                time.sleep(0.05)
            c.restart()

        t = threading.Thread(target=restart, daemon=True)
        t.start()
        try:
            with pytest.warns(RuntimeWarning, match="the scheduler cancelled the tasks of a search .*Dask's reason: "
                                                    "[^)]*scheduler-restart"):
                _same(corpus.search(Q, 11, q_lengths=q_lengths), expected)
        finally:
            t.join(60)


def _once(marker: str, action: str):
    """A worker plugin: the first search task on any of the cluster's worker processes (the one that
    creates the file ``marker``) ends its process ("kill") or sleeps until something ends it
    ("stall"). It wraps the workers' ``retrieve``, so the task, not the worker's event loop, waits."""

    class Once(distributed.WorkerPlugin):
        def setup(self, worker):
            import lik_cupy.distributed as dist

            real = dist.retrieve

            def retrieve(*args, **kwargs):
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    return real(*args, **kwargs)
                if action == "kill":
                    os._exit(1)
                time.sleep(60)
                return real(*args, **kwargs)

            dist.retrieve = retrieve

    return Once()


def test_a_result_lost_with_its_worker_after_the_task_finished_reruns(corpus, monkeypatch):
    """A worker that left after its task finished, before its result was fetched: the fetch raised
    Dask's FutureCancelledError out of the call. It is a departure now (the call runs again); with
    every worker still there (one restarted under its address), a cancellation, which reruns too."""
    from distributed.client import FutureCancelledError

    from lik_cupy.distributed import _Cancelled, _Departed, _Unreachable

    def lost():
        raise FutureCancelledError("lik-cupy-top-k-x", reason="already forgotten")

    # One of the corpus's own workers; "still there" adds it back explicitly, since a worker of an
    # earlier test may still be leaving the cluster between two reads of the scheduler's list.
    w = min(w for w, _ in corpus.placement.values())
    monkeypatch.setattr(corpus, "_live", lambda: _client_workers(corpus) - {w})
    with pytest.raises(_Departed, match=w):
        corpus._fetch("fetching", {w}, lost)
    monkeypatch.setattr(corpus, "_live", lambda: _client_workers(corpus) | {w})
    with pytest.raises(_Cancelled, match="already forgotten"):
        corpus._fetch("fetching", {w}, lost)

    def refused():
        raise ConnectionRefusedError("no worker here")

    with pytest.raises(_Unreachable, match="ConnectionRefusedError: no worker here"):  # every worker listed still
        corpus._fetch("fetching", {w}, refused)

    def other():
        raise ValueError("not a connection's")

    with pytest.raises(ValueError):  # any other error: as it is
        corpus._fetch("fetching", {w}, other)

    def cancelled(owned):
        raise _Cancelled("scheduler-restart")

    monkeypatch.setattr(corpus, "_ready", lambda context: None)
    with pytest.raises(RuntimeError, match=r"workers left or restarted during a search 4 times in a row \(tasks "
                                           r"cancelled: scheduler-restart\); the cluster is losing workers"):
        corpus._rerun("during a search", cancelled)


def _client_workers(corpus) -> set[str]:
    return set(corpus.client.scheduler_info()["workers"])


def test_a_move_cut_short_still_drops_the_old_copies(client, corpus_files, monkeypatch):
    """Shards loaded on their new worker stayed on the old one too when another part of the move
    failed (a worker leaving, a shard error): the drops were never sent."""
    from lik_cupy.distributed import _Departed

    with DistributedCorpus(client, corpus_files[0], backend="cpu") as corpus:
        (i, (old, _)), *_ = corpus.placement.items()
        new = next(w for w in _client_workers(corpus) if w != old)
        real = corpus._wait

        def wait(futures, workers, what, **kw):
            done = real(futures, workers, what, **kw)
            if what.startswith("loading"):
                raise _Departed("another worker")
            return done

        monkeypatch.setattr(corpus, "_wait", wait)
        with pytest.raises(_Departed):
            corpus._move({i: new})
        monkeypatch.setattr(corpus, "_wait", real)
        held = client.run(lambda dask_worker, name=corpus._name: sorted(dask_worker.plugins[name].resident))
        assert corpus.placement[i][0] == new and i in held[new] and i not in held[old], held


def test_two_threads_placing_shards_at_once_drop_none_from_its_new_worker(client, corpus_files, monkeypatch):
    """Two threads' calls find a worker joined at once (each held inside its loads onto that worker
    until the other gets there, or 3 s pass): both moved the same shards there, and the second then
    dropped them from it as the "old copies". Re-placing goes one call at a time."""
    from lik_cupy.distributed import DistributedCorpus as DC

    workers = sorted(client.nthreads())
    real_live = DC._live
    monkeypatch.setattr(DC, "_live", lambda self: real_live(self) - {workers[1]})  # every shard on workers[0]
    with DistributedCorpus(client, corpus_files[0], backend="cpu") as corpus:
        monkeypatch.setattr(DC, "_live", real_live)  # workers[1] joins
        both, real_wait, drops = threading.Barrier(2, timeout=3), corpus._wait, []

        def wait(futures, workers, what, **kw):
            if what.startswith("loading"):
                with contextlib.suppress(threading.BrokenBarrierError):
                    both.wait()
            return real_wait(futures, workers, what, **kw)

        real_drop = corpus._drop_copies
        monkeypatch.setattr(corpus, "_wait", wait)
        monkeypatch.setattr(corpus, "_drop_copies", lambda stale: drops.append(dict(stale)) or real_drop(stale))
        run_threads(2, lambda k: corpus._ready("test"))
        moved = {i for i, (w, _) in corpus.placement.items() if w == workers[1]}
        assert moved and [set(d) for d in drops] == [{workers[0]}], drops
        held = client.run(lambda dask_worker, name=corpus._name: sorted(dask_worker.plugins[name].resident))
        assert set(held[workers[1]]) == moved and not moved & set(held[workers[0]]), held


def test_a_shard_changed_on_disk_is_refused_when_it_reloads(client, corpus_files, tmp_path, rng):
    """Repacked under the corpus (`lik pack --force`, more documents) and then reloaded after its
    worker was killed, a shard gave wrong ids and num_docs kept the old count. Every load now checks
    the fingerprint the corpus was built on (counts, files' sizes and times, a hash of lengths and ids)."""
    paths = []
    for i, src in enumerate(corpus_files[0]):
        paths.append(str(tmp_path / f"shard{i}"))
        shutil.copytree(src, paths[-1])
    Q, q_lengths = _queries(rng)
    with DistributedCorpus(client, paths, backend="cpu") as corpus:
        victim = corpus.placement[3][0]
        tok, off = corpus_files[1][3]
        more = np.concatenate([off, off[-1] + np.cumsum(np.diff(off)[:10])])
        r = run_lik("pack", "--force", "--out", paths[3], "--lengths", _lengths_file(tmp_path, np.diff(more)),
                    _tokens_file(tmp_path, np.concatenate([tok, tok[: off[10]]])))
        assert r.exit_code == 0, r.stderr
        client.register_plugin(_killer(victim), name="lik-test-killer")
        try:
            with pytest.raises(ShardError, match=r"changed since the DistributedCorpus was built on it \(documents "
                                                 r"41 -> 51, tokens [0-9]+ -> [0-9]+\); its ids would name other "
                                                 "documents") as e:
                corpus.search(Q, 11, q_lengths=q_lengths)
        finally:
            client.unregister_worker_plugin("lik-test-killer")
        assert e.value.path == paths[3]
        client.wait_for_workers(2, timeout=60)


def test_a_shard_rewritten_with_the_same_counts_has_another_fingerprint(tmp_path, rng):
    from lik_cupy.distributed import _fingerprint

    tok = rng.standard_normal((12, DIM)).astype(np.float32)
    path = str(tmp_path / "s")
    shards.write_shard(path, tok, [0, 5, 12])
    built = _fingerprint(shards.open_shard(path), (path, None))
    assert _fingerprint(shards.open_shard(path), (path, None)) == built
    shards.write_shard(path, tok[::-1].copy(), [0, 5, 12], overwrite=True)  # same counts and sizes
    now = _fingerprint(shards.open_shard(path), (path, None))
    assert now != built and now.changes(built).startswith("rewritten: ")
    shards.write_shard(path, tok, [0, 7, 12], overwrite=True)
    assert "lengths or ids differ" in dataclasses.replace(_fingerprint(shards.open_shard(path), (path, None)),
                                                          files=built.files).changes(built)


def test_the_fingerprint_is_the_shards_own_files(client, corpus_files, tmp_path, rng):
    """The fingerprint took every entry of a shard's directory: a dangling symbolic link beside the
    shard's files (which lik score and open_shard ignore) failed the corpus with a bare
    FileNotFoundError naming it, and an edited note made a reload refuse an unchanged shard. It now
    takes the manifest and the files the manifest names."""
    from lik_cupy.distributed import _fingerprint

    path = tmp_path / "shard2"
    shutil.copytree(corpus_files[0][2], path)
    (path / "notes").symlink_to(tmp_path / "missing")
    Q, q_lengths = _queries(rng)
    with DistributedCorpus(client, [str(path)], backend="cpu") as corpus:
        _same(corpus.search(Q, 4, q_lengths=q_lengths), retrieve(Q, [corpus_files[1][2]], 4, q_lengths=q_lengths,
                                                                 backend="cpu"))
    built = _fingerprint(shards.open_shard(str(path)), (str(path), None))
    (path / "notes").unlink()
    (path / "notes").write_text("edited")
    assert _fingerprint(shards.open_shard(str(path)), (str(path), None)) == built


def _tokens_file(root, tokens):
    np.save(root / "flat.npy", tokens)
    return root / "flat.npy"


def _lengths_file(root, lengths):
    np.save(root / "lengths.npy", lengths.astype(np.int64))
    return root / "lengths.npy"


def _held(client, name: str) -> dict[str, bool]:
    """Whether each worker holds the corpus ``name`` (its plugin)."""
    return client.run(lambda dask_worker, name=name: name in dask_worker.plugins)


def test_close_releases_the_workers_shards_and_a_collected_corpus_drops_them_too(client, corpus_files):
    """close() releases every shard's arrays on the workers (a second close does nothing). A corpus
    dropped without close() (no with block; a notebook's variable reassigned) left its plugin and
    every shard resident on the workers for the cluster's life. Collected, it now drops them, without
    waiting (a finalizer may run on any thread), with a ResourceWarning as an unclosed file gives."""
    import gc

    def watch(dask_worker, name):  # weak references to the worker's resident tokens
        import weakref

        dask_worker._lik_test_refs = [weakref.ref(r.part[0]) for r in dask_worker.plugins[name].resident.values()]
        return len(dask_worker._lik_test_refs)

    def alive(dask_worker):
        import gc

        gc.collect()
        return sum(ref() is not None for ref in dask_worker._lik_test_refs)

    def released(name):
        deadline = time.monotonic() + 30
        while any(_held(client, name).values()) or any(client.run(alive).values()):
            assert time.monotonic() < deadline, "the corpus's shards stayed on the workers"
            time.sleep(0.05)

    corpus = DistributedCorpus(client, corpus_files[0], backend="cpu")
    assert sum(client.run(watch, name=corpus._name).values()) == len(corpus_files[0])
    corpus.close()
    assert not any(_held(client, corpus._name).values()) and not any(client.run(alive).values())
    corpus.close()

    corpus = DistributedCorpus(client, corpus_files[0], backend="cpu")
    name = corpus._name
    assert sum(client.run(watch, name=name).values()) == len(corpus_files[0])
    with pytest.warns(ResourceWarning, match=rf"a DistributedCorpus \({name}\) was garbage-collected without "
                                             r"close\(\)"):
        del corpus
        gc.collect()
    released(name)


@pytest.mark.parametrize("how", ["closed", "killed"])
def test_close_returns_at_once_when_the_scheduler_is_gone(corpus_files, tmp_path, how):
    """close() waited out Dask's reconnect timeout (29.6 s for a cluster closed, 30.0 s for a
    scheduler killed) and then raised the client's connection error. It now gives the client
    _CLOSE_GRACE (2 s) to get its scheduler back, then returns with a RuntimeWarning; a with
    block that an error ends closes as fast, without the warning. On a live cluster close still
    drops the shards from the workers, without a warning, and it stays idempotent."""
    import json
    import signal
    import subprocess
    import sys
    import time
    import warnings

    from lik_command import child_pythonpath

    procs, cluster = [], None
    if how == "closed":  # a LocalCluster: the scheduler runs in this process, its worker in its own
        cluster = distributed.LocalCluster(n_workers=1, processes=True, threads_per_worker=1, dashboard_address=":0",
                                           silence_logs=logging.ERROR)
        address = cluster.scheduler_address
    else:  # a scheduler process, ended by SIGKILL
        env = dict(os.environ, PYTHONPATH=child_pythonpath())
        file = tmp_path / "scheduler.json"
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                       "--port", "0", "--dashboard-address", ":0", "--scheduler-file", str(file)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while not file.exists() or not file.read_text().strip().endswith("}"):
            assert time.monotonic() < deadline and procs[0].poll() is None, "the scheduler did not start"
            time.sleep(0.1)
        address = json.loads(file.read_text())["address"]
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads",
                                       "1", "--no-dashboard", "--no-nanny"], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    client = distributed.Client(address)
    try:
        live = DistributedCorpus(client, corpus_files[0][:2], backend="cpu")
        gone = DistributedCorpus(client, corpus_files[0][2:4], backend="cpu")
        ended = DistributedCorpus(client, corpus_files[0][4:], backend="cpu")
        assert all(_held(client, live._name).values()) and all(_held(client, gone._name).values())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning on a live cluster
            live.close()
        assert not any(_held(client, live._name).values()) and all(_held(client, gone._name).values())

        if how == "closed":
            cluster.close()  # its workers, then its scheduler: the client (of its own) is left reconnecting
        else:
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(30)
        t = time.monotonic()
        with pytest.warns(RuntimeWarning, match="close\\(\\) could not drop the corpus's shards: the client has no "
                                                "connection to the scheduler at tcp://"):
            gone.close()
        assert time.monotonic() - t < 10
        t = time.monotonic()
        with pytest.raises(KeyError, match="the block's own"), warnings.catch_warnings():
            warnings.simplefilter("error")  # the error ending a with block says more: no warning
            with ended:
                raise KeyError("the block's own error")
        assert time.monotonic() - t < 10
        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as m:
            warnings.simplefilter("error")
            for c in (gone, live):  # closed already: idempotent, asking the cluster nothing
                m.setattr(c, "_call", lambda what, *a, **k: pytest.fail(f"a closed corpus's close() called {what!r}"))
            gone.close()
            live.close()
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
        with contextlib.suppress(Exception):
            client.close(timeout=5)
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.close(timeout=10)


def test_a_closed_client_or_no_client_is_named(corpus_files, rng):
    """A closed client (closed by its user, or by the LocalCluster it was made of when that closed)
    failed every call with Dask's AttributeError ('NoneType' object has no attribute 'ncores'), and
    so did a LocalCluster or an address passed as the client. The first is now a ConnectionError
    naming the scheduler the client had, the second a TypeError."""
    Q, _ = _queries(rng)
    with distributed.LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address=":0",
                                  silence_logs=logging.ERROR) as cluster:
        for wrong in (cluster, cluster.scheduler_address):
            name = type(wrong).__name__
            with pytest.raises(TypeError, match=rf"client must be a distributed.Client .*got .*\.{name}$"):
                DistributedCorpus(wrong, corpus_files[0][:2], backend="cpu")
        c = distributed.Client(cluster)
        address = c.scheduler.address
        corpus = DistributedCorpus(c, corpus_files[0][:2], backend="cpu")
        c.close()
        closed = re.escape(f"the Dask client is closed (status 'closed'); the scheduler at {address} cannot be reached "
                           "through it")
        with pytest.raises(ConnectionError, match=closed):
            corpus.search(Q, 3)
        with pytest.raises(ConnectionError, match=closed):
            corpus.score(Q)
        with pytest.raises(ConnectionError, match="the Dask client is closed"):
            DistributedCorpus(c, corpus_files[0][:2], backend="cpu")
        # close() returned silently, its shards still resident on the live cluster's worker
        with pytest.warns(RuntimeWarning, match=re.escape("close() could not drop the corpus's shards: the Dask "
                                                          f"client is closed (status 'closed'); the scheduler at "
                                                          f"{address}")):
            corpus.close()
        with distributed.Client(cluster) as other:
            assert all(_held(other, corpus._name).values())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            corpus.close()  # (idempotent: nothing more to say)


def _at(port: int):
    """A LocalCluster of one worker (threads, in this process) whose scheduler listens on ``port``:
    closed and made again, a scheduler restarted at the address, with new workers."""
    return distributed.LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address=":0",
                                    protocol="tcp://", host="127.0.0.1", scheduler_port=port,
                                    silence_logs=logging.CRITICAL)


def _until(check, what: str, timeout: float = 30.0):
    """Poll ``check()`` until it is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_reload_puts_the_corpus_back_after_its_scheduler_restarted_or_its_client_closed(corpus_files, tmp_path, rng):
    """A scheduler restarted at the corpus's address (new workers too, as a Dask worker exits with
    its scheduler): the client reconnected, and every call failed (no worker had the corpus) for
    the corpus's life; a client closed for good (its scheduler away past its timeout) left it no
    way back. lost() now says which, and reload() registers the corpus anew and loads every shard,
    through a new client of the same address where the old one closed (the corpus's own, closed
    with it): the results are bitwise the same. On a live cluster reload() drops what the corpus
    held; a shard changed on disk since the corpus was built is refused (ShardError), the corpus
    serving on as it was."""
    import socket

    import dask.config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    paths = []
    for i, src in enumerate(corpus_files[0][:4]):
        paths.append(str(tmp_path / f"shard{i}"))
        shutil.copytree(src, paths[-1])
    Q, q_lengths = _queries(rng)
    cluster, client = _at(port), None
    # Dask's connect timeout: how long a client tries to get its scheduler back, and a new one to connect
    with dask.config.set({"distributed.comm.timeouts.connect": "2s"}):
        try:
            client = distributed.Client(address)
            corpus = DistributedCorpus(client, paths, backend="cpu")
            want = corpus.search(Q, 9, q_lengths=q_lengths)
            assert corpus.lost() is None
            cluster.close()
            cluster = _at(port)
            _until(lambda: client.status == "running" and corpus.lost() is not None, "the restart went unnoticed")
            assert corpus.lost().startswith(f"the scheduler at {address} is not the one the corpus was loaded through")
            with pytest.raises(RuntimeError, match="has no corpus .* or the scheduler restarted since the corpus "
                                                   "loaded"):
                corpus.search(Q, 9, q_lengths=q_lengths)
            corpus.reload()
            assert corpus.lost() is None
            _same(corpus.search(Q, 9, q_lengths=q_lengths), want)

            cluster.close()
            _until(lambda: client.status == "closed", "the client did not close past its timeout")
            assert corpus.lost() == (f"the Dask client of the scheduler at {address} closed (status 'closed'; Dask "
                                     "closes one whose scheduler stays away past its connect timeout)")
            with pytest.raises(ConnectionError, match=f"could not connect a new client to the scheduler at {address}"):
                corpus.reload()
            cluster = _at(port)
            corpus.reload()
            made = corpus.client
            assert made is not client and made.status == "running" and corpus.lost() is None
            _same(corpus.search(Q, 9, q_lengths=q_lengths), want)

            before = corpus._name
            corpus.reload()  # a live cluster: what the corpus held is dropped
            assert corpus.client is made and corpus._name != before
            assert not any(_held(made, before).values()) and all(_held(made, corpus._name).values())
            tok, off = corpus_files[1][3]
            r = run_lik("pack", "--force", "--out", paths[3], "--lengths", _lengths_file(tmp_path, np.diff(off[:5])),
                        _tokens_file(tmp_path, tok[: off[4]]))
            assert r.exit_code == 0, r.stderr
            with pytest.raises(ShardError, match=r"changed since the DistributedCorpus was built on it \(documents "
                                                 r"41 -> 4, "):
                corpus.reload()
            _same(corpus.search(Q, 9, q_lengths=q_lengths), want)  # (its shards as they loaded)
            assert [n for n in made.run(lambda dask_worker: list(dask_worker.plugins)).popitem()[1]
                    if n.startswith("lik-cupy-corpus-")] == [corpus._name]
            corpus.close()
            assert made.status == "closed"
        finally:
            if client is not None:
                client.close()
            cluster.close()


def test_a_reload_that_cannot_connect_leaves_no_thread_behind(corpus_files):
    """reload() of a corpus whose client closed for good, with no scheduler at its address: Dask left
    the IO loop thread of each new Client that failed to connect running, so a reload tried again
    for as long as the scheduler stayed away (as ``lik serve --scheduler`` does) gained a thread per
    attempt, for the life of the process. The failed client's loop now stops with it."""
    import socket

    import dask.config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster, client = _at(port), None

    def loops() -> int:
        return sum(t.name == "IO loop" for t in threading.enumerate())

    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        try:
            client = distributed.Client(f"tcp://127.0.0.1:{port}")
            corpus = DistributedCorpus(client, corpus_files[0][:2], backend="cpu")
            cluster.close()
            _until(lambda: client.status == "closed", "the client did not close past its timeout")
            before = loops()
            for _ in range(3):
                with pytest.raises(ConnectionError, match="could not connect a new client to the scheduler at"):
                    corpus.reload()
            assert loops() == before
            corpus.close()
        finally:
            if client is not None:
                client.close()
            cluster.close()


def test_lik_score_names_a_scheduler_whose_client_closed(client, corpus_files, tmp_path, rng, monkeypatch):
    """A run whose client closed mid-run (Dask closes it when its scheduler stays away past the
    reconnect timeout, 30 s) ended in an internal error: the handler of the lost connection read
    the address from the closed client (None). It is the one-line error, exit status 2."""
    Q, _ = _queries(rng)
    np.save(tmp_path / "q.npy", Q)
    search = DistributedCorpus.search

    def closing(self, *args, **kwargs):
        self.client.close()
        return search(self, *args, **kwargs)

    monkeypatch.setattr(DistributedCorpus, "search", closing)
    address = client.scheduler.address
    r = run_lik("score", "-q", tmp_path / "q.npy", "-d", *corpus_files[0][:2], "-k", 3, "--cpu", "-o",
                tmp_path / "top.tsv", "--scheduler", address)
    assert r.exit_code == 2 and r.stderr.startswith(f"lik: error: --scheduler: lost the connection to the Dask "
                                                    f"scheduler at {address}: "), r.stderr
    assert "the Dask client is closed" in r.stderr and not (tmp_path / "top.tsv").exists()


def _killer(address: str, task: str = "lik-cupy-top-k"):
    """A worker plugin that ends the process of worker ``address`` when a task whose key starts with
    ``task`` (a search's, by default) starts there (defined in a function so that cloudpickle ships it
    by value to the workers)."""

    class Killer(distributed.WorkerPlugin):
        def setup(self, worker):
            self.worker = worker

        def transition(self, key, start, finish, **kwargs):
            if finish == "executing" and str(key).startswith(task) and self.worker.address == address:
                os._exit(1)

    return Killer()


# --------------------------------------------------------------------------- two GPUs


@pytest.fixture(scope="module")
def gpu_client():
    dask_cuda = pytest.importorskip("dask_cuda")
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if count < 2:
        pytest.skip("needs two GPUs")
    devices = ",".join(map(str, range(min(count, 4))))  # up to 4 workers, one per GPU
    with dask_cuda.LocalCUDACluster(CUDA_VISIBLE_DEVICES=devices, threads_per_worker=1, dashboard_address=":0",
                                    silence_logs=logging.ERROR) as cluster, distributed.Client(cluster) as c:
        yield c


@pytest.mark.gpu
def test_gpu_search_is_in_process_retrieve_bitwise(gpu_client, tmp_path, rng):
    """Shards resident on two to four GPUs rank exactly as ``retrieve`` over the same shards on one
    GPU, also when a worker dies mid-query; every worker reports its stage times."""
    import cupy

    paths, parts = _make_corpus(tmp_path, rng, np.float16)
    Q, q_lengths = _queries(rng, dtype=np.float16)
    with cupy.cuda.Device(0):
        resident = [(cupy.asarray(t), cupy.asarray(o)) for t, o in parts]
        expected = {k: retrieve(Q, resident, k, q_lengths=q_lengths) for k in (1, 7, 200)}
    with DistributedCorpus(gpu_client, paths) as corpus:
        assert {where for _, where in corpus.placement.values()} == {"GPU"}
        holders = {w for w, _ in corpus.placement.values()}
        assert holders == set(gpu_client.nthreads()) and len(holders) >= 2
        for k, e in expected.items():
            _same(corpus.search(Q, k, q_lengths=q_lengths), e)
            assert {t["worker"] for t in corpus.last_search["tasks"]} == holders
        victim = corpus.placement[3][0]
        gpu_client.register_plugin(_killer(victim), name="lik-test-killer")
        try:
            with pytest.warns(RuntimeWarning, match=f"worker {victim} left during a search"):
                _same(corpus.search(Q, 7, q_lengths=q_lengths), expected[7])
        finally:
            gpu_client.unregister_worker_plugin("lik-test-killer")
        gpu_client.wait_for_workers(2, timeout=120)
        _same(corpus.search(Q, 7, q_lengths=q_lengths), expected[7])
    bad = tmp_path / "bad"
    shutil.copytree(paths[0], bad)
    (bad / fmt.TOKENS).write_bytes((bad / fmt.TOKENS).read_bytes()[:-40])
    with pytest.raises(ShardError, match="truncated .npy file"):
        DistributedCorpus(gpu_client, [paths[2], str(bad)])


@pytest.mark.gpu
def test_gpu_rerank_is_maxsim_varlen_of_the_candidates(gpu_client, tmp_path, rng):
    """Rerank on shards resident on two to four GPUs: every score within float32 rounding of
    maxsim_varlen over the same candidate documents on the CPU path (the kernels a GPU call selects
    follow its documents' lengths, so scores are not bitwise across groupings), NaN, -inf (empty
    documents) and 0 (a query without tokens) exactly where it has them."""
    paths, parts = _make_corpus(tmp_path, rng, np.float16)
    Q, q_lengths = _queries(rng, dtype=np.float16)
    tokens = np.concatenate([t for t, _ in parts])
    lens = np.concatenate([np.diff(o) for _, o in parts])
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    cand = rng.integers(0, lens.size, (Q.shape[0], 30))
    cand[2, :4] = cand[2, 4]  # repeated
    nan_docs = [j for j in range(lens.size) if np.isnan(tokens[starts[j]:starts[j] + lens[j]]).any()]
    cand[0, :3] = [nan_docs[0], nan_docs[-1], int(np.flatnonzero(lens == 0)[0])]  # NaN in shards 0 and 4; empty
    want = np.empty(cand.shape, np.float32)
    for i, c in enumerate(cand):
        rows = np.concatenate([np.arange(starts[j], starts[j] + lens[j]) for j in c]).astype(np.int64)
        off = np.concatenate([[0], np.cumsum(lens[c])])
        want[i] = maxsim_varlen(Q[i:i + 1], tokens[rows], off, q_lengths=q_lengths[i:i + 1], backend="cpu")[0]
    with DistributedCorpus(gpu_client, paths) as corpus:
        assert {where for _, where in corpus.placement.values()} == {"GPU"}
        got = corpus.rerank(Q, cand, q_lengths=q_lengths)
    assert got.dtype == np.float32 and got.shape == cand.shape
    for special in (np.isnan, np.isneginf, lambda x: x == 0):
        np.testing.assert_array_equal(special(got), special(want))
    assert np.isnan(want).any() and np.isneginf(want).any()
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
def test_gpu_lik_score_devices_starts_a_local_cuda_cluster(tmp_path, rng):
    """`lik score --devices 0,1` (dask-cuda installed) ranks as retrieve over the GPU-resident shards."""
    pytest.importorskip("dask_cuda")
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    paths, parts = _make_corpus(tmp_path, rng, np.float16)
    Q, q_lengths = _queries(rng, dtype=np.float16)
    np.save(tmp_path / "q.npy", Q)
    np.save(tmp_path / "ql.npy", q_lengths)
    out = tmp_path / "top.npy"
    r = run_lik("score", "-q", tmp_path / "q.npy", "--q-lengths", tmp_path / "ql.npy", "-d", *paths, "-k", 7, "-o", out,
             "--devices", "0,1")
    assert r.exit_code == 0, r.stderr
    with cupy.cuda.Device(0):
        _, expected = retrieve(Q, [(cupy.asarray(t), cupy.asarray(o)) for t, o in parts], 7, q_lengths=q_lengths)
    np.testing.assert_array_equal(np.load(out), expected)
