"""lik_cupy.serving on the CPU path: the Batcher in process (bitwise equality with the unbatched calls,
its caps, backpressure, deadlines, shutdown), and ``lik serve`` as a real process on a loopback port
with real clients (tritonclient's binary protocol and plain JSON): answers equal to in-process
Corpus calls, concurrent clients, bad requests, 503 and 504, a client that disconnects, model
versions and metadata shapes, and SIGTERM under load; and its HTTP connection on a transport that
keeps each write (an answer in one write, a lost connection dropping its queued request).
The GPU side: tests/test_serve_gpu.py."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import lik_cupy
from lik_cupy import cli, shards
from lik_cupy.serving import Batcher, DeadlineExceeded, Observer, Overloaded, ShuttingDown
from lik_cupy.serving._ids import IdIndex
from lik_command import child_pythonpath, installed, run_lik
from served import Server
from threads import run_threads

ROOT = Path(__file__).resolve().parents[1]
DIM = 16


def _docs(rng, n=300, hi=24):
    return [rng.standard_normal((int(L), DIM)).astype(np.float32) for L in rng.integers(1, hi, n)]


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(7)
    docs = _docs(rng)
    off = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    return lik_cupy.Corpus(np.concatenate(docs), d_offsets=off, ids=np.arange(len(docs)) * 3 + 5, device="cpu")


def _queries(rng, n, lo=1, hi=40):
    return [rng.standard_normal((int(L), DIM)).astype(np.float32) for L in rng.integers(lo, hi, n)]


class _Record(Observer):
    def __init__(self):
        self.batches, self.rejects, self.lock = [], [], threading.Lock()

    def batch(self, device, op, requests, queries, compute_s):
        with self.lock:
            self.batches.append((device, requests, queries))

    def rejected(self, op, reason):
        with self.lock:
            self.rejects.append(reason)


# ---------------------------------------------------------------- the Batcher in process


def test_concurrent_requests_are_batched_and_bitwise_the_unbatched_calls(corpus):
    rng = np.random.default_rng(2)
    qs = _queries(rng, 96)
    cands = [rng.integers(0, len(corpus), 20) for _ in qs]
    seen = _Record()
    with Batcher([corpus, corpus], max_batch=8, max_tokens=8 * 40, max_delay_us=20_000, observer=seen) as b:
        def client(t):  # 16 threads, 6 requests each
            for j in range(t, len(qs), 16):
                q = qs[j]
                if j % 3 == 0:
                    s, i = b.search(q, 10)
                    s1, i1 = corpus.search(q, 10)
                    assert np.array_equal(s, s1) and np.array_equal(i, i1)
                elif j % 3 == 1:
                    assert np.array_equal(b.rerank(q, cands[j]), corpus.rerank(q, cands[j]))
                else:
                    assert np.array_equal(b.score(q[None]), corpus.score(q[None]))

        run_threads(16, client)
    assert {d for d, _, _ in seen.batches} <= {"cpu:0", "cpu:1"}
    assert sum(n for _, _, n in seen.batches) == len(qs)
    assert max(n for _, _, n in seen.batches) <= 8


def test_a_free_worker_takes_up_to_max_batch_queries_of_one_group(corpus):
    rng = np.random.default_rng(3)
    seen = _Record()
    with Batcher(corpus, max_batch=4, max_delay_us=30_000_000, observer=seen) as b:
        # the worker waits (30 s at most) until max_batch queries are queued, then takes them
        futures = [b.submit("score", q) for q in _queries(rng, 8, hi=33)]  # one length class
        for f in futures:
            f.result()
    assert [(r, n) for _, r, n in seen.batches] == [(4, 4), (4, 4)]
    assert [f.timing.batch_queries for f in futures] == [4] * 8


def test_batches_never_mix_operations_k_or_length_classes(corpus):
    rng = np.random.default_rng(4)
    seen = _Record()
    with Batcher(corpus, max_batch=64, max_delay_us=30_000_000, observer=seen) as b:
        qs = [rng.standard_normal((n, DIM)).astype(np.float32) for n in (7, 20, 9, 32, 33, 64, 31)]
        futures = [b.submit("search", qs[0], 5), b.submit("search", qs[1], 6), b.submit("score", qs[2]),
                   b.submit("search", qs[3], 5), b.submit("search", qs[4], 5), b.submit("search", qs[5], 5),
                   b.submit("search", qs[6], 5)]
    # close() cut the wait; in arrival order of each group's head: [search k=5, up to 32 tokens: 7, 32,
    # 31], [search k=6], [score], [search k=5, 33 to 64 tokens: 33, 64]
    assert [(r, n) for _, r, n in seen.batches] == [(3, 3), (1, 1), (1, 1), (2, 2)]
    for f, q in zip(futures, qs):
        if f is not futures[2]:
            assert np.array_equal(f.result()[1], corpus.search(q, 5 if f is not futures[1] else 6)[1])


async def _gather(b, qs):
    return await asyncio.gather(*(asyncio.wrap_future(b.submit("search", q, 3)) for q in qs))


def test_asyncio_callers(corpus):
    qs = _queries(np.random.default_rng(5), 12)
    with Batcher(corpus, max_batch=16, max_delay_us=5_000) as b:
        got = asyncio.run(_gather(b, qs))
    for (s, i), q in zip(got, qs):
        assert np.array_equal(i, corpus.search(q, 3)[1])


def test_inline_scores_a_lone_request_in_the_calling_thread_as_the_worker_would(corpus, monkeypatch):
    from lik_cupy.serving import _queue

    monkeypatch.setattr(_queue, "INLINE_MAX_S", 60.0)  # (host calls take milliseconds)
    rng = np.random.default_rng(9)
    q, cand = _queries(rng, 1, 3, 30)[0], rng.choice(len(corpus), 40, replace=False)
    seen = _Record()
    with Batcher(corpus, observer=seen) as b:
        for op, arg in (("search", 7), ("rerank", cand), ("score", None)):
            queued = b.submit(op, q, arg).result()
            f = b.submit(op, q, arg, inline=True)
            assert f.done() and f.timing.batch_queries == 1  # scored before submit returned
            got, want = (f.result(), queued) if op == "search" else ((f.result(),), (queued,))
            assert all(np.array_equal(x, y) for x, y in zip(got, want))
        assert len(seen.batches) == 6
        monkeypatch.setattr(_queue, "INLINE_MAX_S", 0.0)  # an operation whose last call took longer: queued
        assert not b.can_inline("score")
        f = b.submit("score", q, inline=True)
        assert np.array_equal(f.result(), corpus.score(q)) and len(seen.batches) == 7
    with Batcher(corpus, max_delay_us=1000) as b:  # a delay waits for companions: queued
        assert not b.can_inline("score")
        assert np.array_equal(b.submit("score", q, inline=True).result(), corpus.score(q))


def test_inline_never_overlaps_the_worker_and_waits_behind_it(monkeypatch):
    """A request submitted inline while the worker scores is queued; while one is scored inline, the
    worker takes nothing (they share its buffers), and then takes what was queued meanwhile."""
    import time

    from lik_cupy.serving import _queue

    monkeypatch.setattr(_queue, "INLINE_MAX_S", 60.0)

    calls, lock = [], threading.Lock()

    class Timed(lik_cupy.Corpus):
        def score(self, *a, **k):
            if k.get("q_offsets") is None:  # (the calls per length group inside the batcher's)
                return super().score(*a, **k)
            start = time.monotonic()
            time.sleep(0.2)
            out = super().score(*a, **k)
            with lock:
                calls.append((start, time.monotonic(), threading.current_thread().name))
            return out

    rng = np.random.default_rng(10)
    docs = _docs(rng, 50)
    slow = Timed(np.concatenate(docs), d_offsets=np.concatenate([[0], np.cumsum([len(d) for d in docs])]),
                 device="cpu")
    q = _queries(rng, 3, 2, 20)
    with Batcher(slow) as b:
        inline = threading.Thread(target=lambda: b.submit("score", q[0], inline=True).result(), name="inline")
        inline.start()
        while not calls and b.can_inline("score"):  # until the inline call holds the replica
            time.sleep(0.001)
        queued = [b.submit("score", x) for x in q[1:]]
        assert not b.submit("score", q[0], inline=True).done()  # the replica is busy: queued
        inline.join()
        got = [f.result() for f in queued]
    calls.sort()
    assert [c[2] for c in calls] == ["inline"] + ["lik-serve-cpu:0"] * (len(calls) - 1)
    assert all(a[1] <= b[0] for a, b in zip(calls, calls[1:]))  # one call at a time
    assert all(np.array_equal(g, slow.score(x)) for g, x in zip(got, q[1:]))


def test_inline_never_overlaps_a_batch_of_zero_queries():
    """The worker's batch of zero-query requests (an Nq = 0 request is answered, empty) set the
    replica's running count to 0 while its call ran, which is what told score_now the worker was
    idle: a request submitted inline was then scored on the worker's stream and buffers during the
    worker's call. It is queued behind it now, as behind any batch."""
    rng = np.random.default_rng(47)
    corpus = _slow_calls(0.5, rng)
    none, q = np.zeros((0, 5, DIM), np.float32), rng.standard_normal((4, DIM)).astype(np.float32)
    with Batcher(corpus) as b:
        empty = b.submit("score", none)
        assert corpus.started.wait(30)  # the worker is in the zero-query call
        assert not b.can_inline("score")
        f = b.submit("score", q, inline=True)
        assert not f.done()  # queued behind the batch, not scored in this thread meanwhile
        assert empty.result(timeout=30).shape == (0, len(corpus))
        assert np.array_equal(f.result(timeout=30), lik_cupy.Corpus.score(corpus, q))
    assert corpus.calls == [0, 1]


def _traced_service(rng, n_docs):
    """A started, ready Service over a host corpus of ``n_docs`` random documents that records the
    thread of each batcher call (those with q_offsets, not the calls per length group inside them):
    (service, corpus, the threads' names)."""
    from lik_cupy.serving import _service

    threads = []

    class Traced(lik_cupy.Corpus):
        def score(self, *a, **k):
            if k.get("q_offsets") is not None:
                threads.append(threading.current_thread().name)
            return super().score(*a, **k)

    docs = _docs(rng, n_docs)
    corpus = Traced(np.concatenate(docs), d_offsets=np.concatenate([[0], np.cumsum([len(d) for d in docs])]),
                    device="cpu")
    svc = _service.Service(lambda observer: Batcher(corpus, observer=observer))
    svc.start()
    while not svc.ready:
        assert svc.failure is None
        threading.Event().wait(0.01)
    return svc, corpus, threads


def test_the_service_scores_a_lone_request_inline_and_queues_those_that_arrive_together(monkeypatch):
    from lik_cupy.serving import _queue, _service

    monkeypatch.setattr(_queue, "INLINE_MAX_S", 60.0)
    rng = np.random.default_rng(11)
    svc, corpus, threads = _traced_service(rng, 60)
    assert not svc.inline  # host replicas: every request goes to the worker
    svc.inline = True  # (as where every replica is on a GPU)
    qs = [q[:5] for q in _queries(rng, 4, 5, 20)]

    async def main():
        alone = await _service.infer(svc, "score", {"Q": qs[0]}, {})
        together = await asyncio.gather(*(_service.infer(svc, "score", {"Q": q}, {}) for q in qs))
        return alone, together

    try:
        (out, params), together = asyncio.run(main())
    finally:
        svc.stop()
    # the lone request on the loop's thread; those that arrived together queued for the worker
    assert threads[0] == threading.current_thread().name and set(threads[1:]) == {"lik-serve-cpu:0"}
    assert params["batch_queries"] == 1 and np.array_equal(out["SCORES"], corpus.score(qs[0]))
    assert all(np.array_equal(o["SCORES"], corpus.score(q)) for (o, _), q in zip(together, qs))


def test_a_quiet_service_scores_long_calls_inline_until_requests_find_company(monkeypatch):
    """Calls longer than INLINE_MAX_S go inline only while few recent arrivals found another request
    in flight (QUIET_SHARE): one client at a time keeps the server quiet; a burst of concurrent
    requests ends it (they are batched by the worker), and lone requests bring it back."""
    from lik_cupy.serving import _queue, _service

    monkeypatch.setattr(_queue, "INLINE_MAX_S", 0.0)  # every call counts as long
    rng = np.random.default_rng(12)
    svc, corpus, threads = _traced_service(rng, 40)
    svc.inline = True  # (as where every replica is on a GPU)
    qs = [q[:5] for q in _queries(rng, 8, 5, 20)]
    here = threading.current_thread().name

    async def lone(n):
        for j in range(n):
            out, _ = await _service.infer(svc, "score", {"Q": qs[j % len(qs)]}, {})
            assert np.array_equal(out["SCORES"], corpus.score(qs[j % len(qs)]))

    async def burst():
        got = await asyncio.gather(*(_service.infer(svc, "score", {"Q": q}, {}) for q in qs))
        assert all(np.array_equal(o["SCORES"], corpus.score(q)) for (o, _), q in zip(got, qs))

    try:
        asyncio.run(lone(3))
        assert threads == [here] * 3 and svc.company == 0.0  # each alone, though its last call was "long"
        del threads[:]
        asyncio.run(burst())
        assert svc.company > _service.QUIET_SHARE and here not in threads[1:]  # batched by the worker
        del threads[:]
        asyncio.run(lone(1))
        assert threads == ["lik-serve-cpu:0"]  # no longer quiet: a long call goes to the worker
        asyncio.run(lone(60))  # lone arrivals bring the share back under QUIET_SHARE
        assert svc.company <= _service.QUIET_SHARE
        while not svc.batcher.can_inline("score", True):  # (the worker's bookkeeping after its last answer)
            time.sleep(0.001)
        asyncio.run(lone(1))
        assert threads[-1] == here
    finally:
        svc.stop()


def test_a_server_stopped_while_its_kernels_warm_never_turns_ready(corpus, capsys):
    """Service.stop() during Batcher.warm() (the kernels compiling on a GPU: SIGTERM soon after start)
    closed the batcher, and then the warm-up ended and set the server ready: it answered ready (gRPC's
    ServerReady, and the peers' count under --processes) and printed "lik serve: ready" after it had
    stopped. A server stopped while it warms stays not ready."""
    from lik_cupy.serving import _service

    warming, go = threading.Event(), threading.Event()

    class Warming(Batcher):
        def warm(self, lq=32):
            warming.set()
            assert go.wait(30)

    svc = _service.Service(lambda observer: Warming(corpus, observer=observer))
    before = set(threading.enumerate())
    svc.start()
    (loading,) = [t for t in set(threading.enumerate()) - before if t.name == "lik-serve-load"]
    assert warming.wait(30)
    svc.stop()  # (the batcher is closed; its warm-up goes on)
    assert not svc.ready
    go.set()
    loading.join(30)
    assert not loading.is_alive() and svc.failure is None
    assert not svc.ready and "lik serve: ready" not in capsys.readouterr().err


def test_a_full_queue_is_overloaded_and_close_drains_it(corpus):
    qs = _queries(np.random.default_rng(6), 3)
    seen = _Record()
    b = Batcher(corpus, max_batch=64, max_queue=2, max_delay_us=30_000_000, observer=seen)
    held = [b.submit("score", q) for q in qs[:2]]
    with pytest.raises(Overloaded, match="queues are full"):
        b.submit("score", qs[2])
    assert seen.rejects == ["overloaded"]
    b.close()
    for f, q in zip(held, qs):
        assert np.array_equal(f.result(), corpus.score(q))
    with pytest.raises(ShuttingDown):
        b.submit("score", qs[0])


def test_a_request_past_its_deadline_in_the_queue_is_never_scored(corpus):
    qs = _queries(np.random.default_rng(8), 2)
    seen = _Record()
    with Batcher(corpus, max_batch=64, max_delay_us=300_000, observer=seen) as b:
        late = b.submit("score", qs[0], timeout=1e-4)
        on_time = b.submit("score", qs[1])
        with pytest.raises(DeadlineExceeded, match="deadline passed"):
            late.result()
        assert np.array_equal(on_time.result(), corpus.score(qs[1]))
    assert seen.rejects == ["deadline"]
    assert [(r, n) for _, r, n in seen.batches] == [(1, 1)]


class _SlowCalls(lik_cupy.Corpus):
    """A host corpus whose batched score calls (those with q_offsets) sleep ``seconds``; ``calls``
    holds each one's query count, ``started`` is set as one starts."""

    seconds = 0.0

    def score(self, Q, *args, **kwargs):
        if kwargs.get("q_offsets") is not None:
            self.calls.append(len(kwargs["q_offsets"]) - 1)
            self.started.set()
            time.sleep(self.seconds)
        return super().score(Q, *args, **kwargs)


def _slow_calls(seconds, rng):
    docs = np.concatenate(_docs(rng, 40))
    corpus = _SlowCalls(docs, d_offsets=np.linspace(0, len(docs), 41).astype(np.int64), device="cpu")
    corpus.seconds, corpus.calls, corpus.started = seconds, [], threading.Event()
    return corpus


def test_a_deadline_passing_behind_a_long_batch_is_answered_at_it_and_never_scored():
    """A request whose deadline passed in the queue was answered only when the worker next took from
    the queue: behind a long batch, up to that batch's time late. It is answered at its deadline,
    while the batch runs, and never scored; the requests without deadlines get their results."""
    rng = np.random.default_rng(42)
    corpus = _slow_calls(1.5, rng)
    q1, q2, q3 = (rng.standard_normal((n, 5, DIM)).astype(np.float32) for n in (1, 2, 3))
    seen = _Record()
    with Batcher(corpus, max_batch=64, observer=seen) as b:
        busy = b.submit("score", q1)
        assert corpus.started.wait(30)  # the worker is in its 1.5 s call
        start = time.monotonic()
        late = b.submit("score", q3, timeout=0.1)
        after = b.submit("score", q2)
        with pytest.raises(DeadlineExceeded, match="deadline passed"):
            late.result(timeout=30)
        waited = time.monotonic() - start
        assert 0.1 <= waited < 0.9 and not busy.done(), waited  # (the call ends 1.5 s after it began)
        assert b.queue_depths() == {"cpu:0": 1}  # `after` waits, `late` left the queue
        assert np.array_equal(busy.result(timeout=30), lik_cupy.Corpus.score(corpus, q1))
        assert np.array_equal(after.result(timeout=30), lik_cupy.Corpus.score(corpus, q2))
    assert corpus.calls == [1, 2] and seen.rejects == ["deadline"]
    assert [(r, n) for _, r, n in seen.batches] == [(1, 1), (1, 2)]


class _SlowLongQueries(lik_cupy.Corpus):
    """A host corpus whose batched score calls of more than 100 query tokens sleep 3 s (``started``
    is set as one starts)."""

    def score(self, Q, *args, **kwargs):
        if kwargs.get("q_offsets") is not None and len(Q) > 100:
            self.started.set()
            time.sleep(3.0)
        return super().score(Q, *args, **kwargs)


def test_requests_are_routed_by_their_tokens_away_from_a_long_call():
    """Routing counted queries: a replica scoring one long query (a 60 MiB request of a million
    tokens took 100 s on the host) weighed 1, so with two replicas every other concurrent request
    queued behind that call while the other replica idled."""
    rng = np.random.default_rng(43)
    docs = np.concatenate(_docs(rng, 40))
    corpus = _SlowLongQueries(docs, d_offsets=np.linspace(0, len(docs), 41).astype(np.int64), device="cpu")
    corpus.started = threading.Event()
    seen = _Record()
    with Batcher([corpus, corpus], max_batch=64, observer=seen) as b:
        long = b.submit("score", rng.standard_normal((1, 400, DIM)).astype(np.float32))
        assert corpus.started.wait(30)  # cpu:0 is in its 3 s call
        start = time.monotonic()
        short = [rng.standard_normal((1, 5, DIM)).astype(np.float32) for _ in range(6)]
        futures = [b.submit("score", q) for q in short]  # at once: each finds cpu:1 loaded too
        for f, q in zip(futures, short):
            assert np.array_equal(f.result(timeout=30), lik_cupy.Corpus.score(corpus, q))
        assert time.monotonic() - start < 2.5 and not long.done()
        long.result(timeout=30)
    assert [d for d, _, _ in seen.batches].count("cpu:0") == 1  # the long call alone


def _waiting_batcher(seed: int, n: int):
    """A host corpus that scores at once, ``n`` queries of 5 tokens, an observer, and a Batcher whose
    worker waits 30 s for companions (a request's deadline, not the worker, must answer it)."""
    rng = np.random.default_rng(seed)
    corpus = _slow_calls(0.0, rng)
    qs = [rng.standard_normal((5, DIM)).astype(np.float32) for _ in range(n)]
    seen = _Record()
    return corpus, qs, seen, Batcher(corpus, max_batch=64, max_delay_us=30_000_000, observer=seen)


def test_a_deadline_sooner_than_max_delay_is_answered_at_it():
    """A worker waiting out max_delay for companions answered an expired request only once it took
    from the queue (30 s here); the timer answers it at its deadline."""
    corpus, qs, seen, b = _waiting_batcher(43, 2)
    try:
        start = time.monotonic()
        kept, late = b.submit("score", qs[0]), b.submit("score", qs[1], timeout=0.05)
        with pytest.raises(DeadlineExceeded, match="deadline passed"):
            late.result(timeout=20)
        assert time.monotonic() - start < 5 and not kept.done()
        until = time.monotonic() + 5  # (the timer counts the reject just after it answers the request)
        while not seen.rejects and time.monotonic() < until:
            time.sleep(0.001)
        assert seen.rejects == ["deadline"] and b.queue_depths() == {"cpu:0": 1}
    finally:
        b.close()  # (cuts the worker's wait: `kept` is scored alone)
    assert np.array_equal(kept.result(timeout=30), lik_cupy.Corpus.score(corpus, qs[0]))
    assert corpus.calls == [1] and seen.rejects == ["deadline"]


def test_deadlines_racing_the_worker_are_answered_once_each(caplog):
    """Deadlines that pass as the worker takes requests: each request is either scored or expired,
    once (a request answered twice would fail its batch, logged), and each expiry is counted once."""
    rng = np.random.default_rng(44)
    corpus = _slow_calls(0.002, rng)
    qs = [rng.standard_normal((int(n), DIM)).astype(np.float32) for n in rng.integers(1, 30, 400)]
    timeouts = [None if j % 5 == 0 else t for j, t in enumerate(rng.uniform(0.0005, 0.01, len(qs)))]  # (some scored)

    class Counted(_Record):
        def __init__(self):
            super().__init__()
            self.answered_n = 0

        def answered(self, device, op, queue_s, compute_s):
            with self.lock:
                self.answered_n += 1

    seen = Counted()
    with Batcher(corpus, max_batch=4, observer=seen) as b:
        futures = []

        def client(t):
            for j in range(t, len(qs), 4):
                futures.append((j, b.submit("score", qs[j], timeout=timeouts[j])))
                if j % 3 == 0:
                    time.sleep(0.001)

        run_threads(4, client)
        expired = scored = 0
        for j, f in futures:
            try:
                assert np.array_equal(f.result(timeout=60), lik_cupy.Corpus.score(corpus, qs[j]))
                scored += 1
            except DeadlineExceeded:
                expired += 1
    assert scored + expired == len(qs) and expired > 0 and scored > 0, (scored, expired)
    assert seen.rejects == ["deadline"] * expired and seen.answered_n == scored
    assert sum(n for _, _, n in seen.batches) == scored == sum(corpus.calls)
    assert not [r for r in caplog.records if "failed a batch" in r.getMessage()]


def test_a_deadline_or_delay_past_the_waits_range_keeps_the_timer_and_worker_alive():
    """A deadline further off than a thread wait can take (threading.TIMEOUT_MAX, about 292 years:
    an HTTP ``timeout`` of 1e16 us) raised OverflowError in the timer thread, which died: no deadline
    of that replica was answered at its time again. A max_delay_us as far off killed the worker, and
    every request of its queue hung. Both wait in steps now."""
    corpus, qs, seen, b = _waiting_batcher(46, 4)
    try:
        far = b.submit("score", qs[0], timeout=1e10)
        time.sleep(0.2)  # (the timer computes its wait)
        late = b.submit("score", qs[1], timeout=0.05)
        with pytest.raises(DeadlineExceeded, match="deadline passed"):
            late.result(timeout=10)  # (a dead timer: the worker's 30 s max_delay)
        assert not far.done() and b.queue_depths() == {"cpu:0": 1}
    finally:
        b.close()
    assert np.array_equal(far.result(timeout=30), lik_cupy.Corpus.score(corpus, qs[0]))
    # A worker waiting 1e10 s for companions, which a second request brings (max_batch 2)
    with Batcher(corpus, max_batch=2, max_delay_us=10**16) as b:
        first = b.submit("score", qs[2])
        time.sleep(0.2)  # (the worker is in its wait)
        second = b.submit("score", qs[3])
        for f, q in ((first, qs[2]), (second, qs[3])):
            assert np.array_equal(f.result(timeout=10), lik_cupy.Corpus.score(corpus, q))


def test_a_timer_thread_that_cannot_start_fails_neither_the_request_nor_close(monkeypatch, caplog):
    """The timer thread is started by the first request with a deadline, inside put, after the request
    was queued: where it could not start (RuntimeError: can't start new thread), submit raised for a
    request that stayed queued (scored later for no one), the queue kept the unstarted thread as its
    timer (none was ever started again), and close raised joining it. The request is queued, the next
    deadline starts the timer, and close joins it."""
    from lik_cupy.serving import _queue

    corpus, qs, seen, b = _waiting_batcher(48, 2)
    refused = []

    class Scarce(threading.Thread):
        def start(self):
            if self.name.endswith("-timer") and not refused:
                refused.append(self.name)
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(_queue.threading, "Thread", Scarce)
    try:
        first = b.submit("score", qs[0], timeout=0.01)  # (its timer cannot start)
        second = b.submit("score", qs[1], timeout=0.05)  # (this one's can)
        for f in (first, second):
            with pytest.raises(DeadlineExceeded, match="deadline passed"):
                f.result(timeout=10)  # by the timer (the worker waits 30 s for companions)
    finally:
        b.close()
    assert refused == ["lik-serve-cpu:0-timer"] and seen.rejects == ["deadline"] * 2 and corpus.calls == []


def test_a_request_cancelled_in_the_queue_is_dropped(corpus):
    """A cancelled request (its client went away) leaves the queue as it is cancelled: it holds no
    place there, and a batch the worker waits to fill does not count it; it is never scored."""
    qs = _queries(np.random.default_rng(9), 3)
    seen = _Record()
    with Batcher(corpus, max_batch=2, max_delay_us=30_000_000, observer=seen) as b:
        gone, kept = b.submit("score", qs[0]), b.submit("score", qs[1])
        assert gone.cancel()
        assert sum(b.queue_depths().values()) == 1  # at once, not when the worker next looks
        third = b.submit("score", qs[2])  # fills the batch of two: the worker goes without waiting 30 s
        for f, q in ((kept, qs[1]), (third, qs[2])):
            assert np.array_equal(f.result(timeout=10), corpus.score(q))
    assert [(r, n) for _, r, n in seen.batches] == [(2, 2)]


class _FailsOnNaN(lik_cupy.Corpus):
    """A corpus whose score raises for a call with a NaN query token."""

    def score(self, Q, *args, **kwargs):
        if np.isnan(np.asarray(Q, np.float32)).any():
            raise FloatingPointError("a NaN query token")
        return super().score(Q, *args, **kwargs)


def test_an_answer_is_freed_once_its_caller_lets_it_go(corpus):
    """A queued request and its future referred to each other (its cancellation callback), and the
    worker kept its last batch while it waited for the next: an answer stayed in memory after it
    was sent (189 MB for a large score) until the garbage collector's next full pass. With the
    collector off, it is freed once its caller lets it go."""
    import gc
    import weakref

    q = _queries(np.random.default_rng(19), 3)
    with Batcher(corpus) as b:
        gc.disable()
        try:
            future = b.submit("score", q[0])
            ref = weakref.ref(future.result(60))
            del future
            until = time.monotonic() + 10
            while ref() is not None and time.monotonic() < until:  # (until the worker has gone back to wait)
                time.sleep(0.01)
            assert ref() is None
        finally:
            gc.enable()


def test_a_failing_call_fails_only_the_request_at_fault():
    rng = np.random.default_rng(10)
    docs = np.concatenate(_docs(rng, 20))
    corpus = _FailsOnNaN(docs, d_offsets=np.array([0, len(docs) // 2, len(docs)]), device="cpu")
    good, bad = _queries(rng, 2, hi=20)
    bad[0, 0] = np.nan
    with Batcher(corpus, max_batch=64, max_delay_us=30_000_000) as b:
        failing, fine = b.submit("score", bad), b.submit("score", good)
    with pytest.raises(FloatingPointError, match="NaN query token"):
        failing.result()
    assert np.array_equal(fine.result(), corpus.score(good))


@pytest.mark.parametrize("op,Q,arg,error,match", [
    ("search", np.zeros((4, DIM + 1), np.float32), 3, ValueError, "Q has dim 17 but the corpus has dim 16"),
    ("search", np.zeros((4, DIM), np.float16), 3, TypeError, "corpus has dtype float32 but Q has float16"),
    ("search", np.zeros(DIM, np.float32), 3, ValueError, r"Q has shape \[16\]"),
    ("search", np.zeros((4, DIM), np.float32), 0, ValueError, r"k must be an integer in \[1, 4096\]"),
    ("search", np.zeros((4, DIM), np.float32), 5000, ValueError, r"k must be an integer in \[1, 4096\]"),
    ("rerank", np.zeros((4, DIM), np.float32), [0, 300], ValueError, r"candidate 300 is outside"),
    ("rerank", np.zeros((4, DIM), np.float32), [[0, 1]], ValueError, r"candidates has shape \[1, 2\]"),
    ("rerank", np.zeros((4, DIM), np.float32), [0.5], TypeError, "integer document indices"),
    ("score", np.zeros((4, DIM), np.float32), 3, ValueError, "score takes no argument"),
    ("count", np.zeros((4, DIM), np.float32), None, ValueError, "op must be one of"),
])
def test_bad_requests_raise_before_they_are_queued(corpus, op, Q, arg, error, match):
    with Batcher(corpus) as b:
        with pytest.raises(error, match=match):
            b.submit(op, Q, arg)
        assert b.queue_depths() == {"cpu:0": 0}


def test_id_index():
    idx = IdIndex(np.array(["b", "a", "c", "a"]), 4)
    assert idx.positions(np.array([["a", "c"]])).tolist() == [[1, 2]]
    with pytest.raises(ValueError, match=r"unknown ids \['z'\]"):
        idx.positions(np.array(["a", "z"]))
    with pytest.raises(TypeError, match="ids must be strings"):
        idx.positions(np.array([1]))
    plain = IdIndex(None, 3)
    assert plain.positions(np.array([2, 0])).tolist() == [2, 0]
    with pytest.raises(ValueError, match=r"unknown ids \[3\]"):
        plain.positions(np.array([3]))


def test_byte_string_ids_are_answered_and_found_as_text(tmp_path):
    """A shard's ids may be byte strings (ids.npy of dtype S): search answered their repr ("b'b'") in
    JSON and binary, and rerank refused every id ("unknown ids ['b']"). They are UTF-8 text, as lik's
    results show them."""
    rng = np.random.default_rng(41)
    shards.pack_arrays(_docs(rng, 4), tmp_path / "s", ids=np.array([b"b", b"a", "\u00e9".encode(), b"d"]))
    corpus = lik_cupy.Corpus.from_shards(tmp_path / "s", device="cpu")
    assert corpus.ids.dtype.kind == "S"
    idx = IdIndex(corpus.ids, len(corpus))
    assert idx.kind == "string" and idx.positions(np.array([["a", "\u00e9", "b"]])).tolist() == [[1, 2, 0]]
    with pytest.raises(ValueError, match=r"unknown ids \['z'\]"):
        idx.positions(np.array(["a", "z"]))
    ids = corpus.search(rng.standard_normal((2, DIM)).astype(np.float32), 4)[1]
    text = [x.decode() for x in ids]
    body, _ = _written({}, [("IDS", ids)], set())
    assert json.loads(body)["outputs"][0]["data"] == text
    body, n = _written({}, [("IDS", ids)], {"IDS"})
    assert body[n:] == b"".join(len(t.encode()).to_bytes(4, "little") + t.encode() for t in text)


# ---------------------------------------------------------------- lik serve, a real process

# ---------------------------------------------------------------- a corpus split over devices


@pytest.fixture(scope="module")
def split_shards_dir(tmp_path_factory):
    """(three shards of 40, 7 and 90 documents with ids, the documents); shard 2 repeats shard 0's
    first documents, so search meets exact ties across parts (the lower position must win)."""
    rng = np.random.default_rng(31)
    docs = _docs(rng, 137)
    docs[47:57] = docs[0:10]
    base = tmp_path_factory.mktemp("split")
    paths = []
    for n, (a, b) in enumerate([(0, 40), (40, 47), (47, 137)]):
        paths.append(base / f"shard{n}")
        shards.pack_arrays(docs[a:b], paths[-1], ids=np.arange(a, b) * 10 + 3)
    return paths, docs


def test_a_partition_answers_bitwise_as_the_whole_corpus(split_shards_dir):
    paths, docs = split_shards_dir
    whole = lik_cupy.Corpus.from_shards(paths, device="cpu")
    rng = np.random.default_rng(32)
    with Batcher.from_shards(paths, ["cpu", "cpu", "cpu"], partition=True, max_batch=8) as b:
        assert b.devices == ["cpu:0x3"] and len(b.corpus) == 137 and b.corpus.part_devices == [None] * 3
        assert [len(p) for p in b.corpus.parts] == [40, 7, 90]
        for q in [*_queries(rng, 6), docs[3], docs[42]]:  # docs[3] ties with its copy, docs[50]
            for k in (1, 5, 60, 500):
                s, i = b.search(q, k)
                s1, i1 = whole.search(q, k)
                assert np.array_equal(s, s1) and np.array_equal(i, i1), k
            cand = rng.integers(0, 137, 30)
            assert np.array_equal(b.rerank(q, cand), whole.rerank(q, cand))
            assert np.array_equal(b.score(q), whole.score(q))
        s, i = b.search(docs[3], 2)
        assert s[0] == s[1] and i.tolist() == [33, 503]  # positions 3 and 50: the lower first
        Q3 = np.stack([q[:5] for q in _queries(rng, 4, lo=5)])
        cand = rng.integers(0, 47, (4, 9))  # every candidate in the first two parts: the third scores none
        assert np.array_equal(b.rerank(Q3, cand), whole.rerank(Q3, cand))


def test_a_partition_runs_short_calls_in_the_calling_thread_and_long_ones_at_once(split_shards_dir, monkeypatch):
    """Two H200s: a rerank over two parts in threads took 1.31 ms where each part alone took 0.31
    (the threads took turns at the GIL); short calls now run their parts in sequence in the caller's
    thread, and calls whose parts take long still run them at once, with the same answers."""
    from lik_cupy.serving import _partition

    paths, docs = split_shards_dir
    whole = lik_cupy.Corpus.from_shards(paths, device="cpu")
    runs = []

    class Timed(lik_cupy.Corpus):
        delay = 0.0

        def rerank(self, *a, **k):
            if k.get("q_offsets") is not None:  # (the partition's call, not the one per query length)
                runs.append(threading.current_thread())
                time.sleep(self.delay)
            return super().rerank(*a, **k)

    monkeypatch.setattr(_partition, "SEQUENTIAL_MAX_S", 0.05)
    runs_of = [shards.open_input(p) for p in paths]
    parts = [Timed.from_shards(run, device="cpu", ids=False) for run in _partition.split_shards(runs_of, [40, 7, 90], 2)]
    P = _partition.Partition(parts, whole.ids)
    try:
        q = _queries(np.random.default_rng(35), 1)[0]
        cand = np.arange(0, 137, 3)[None]
        off = np.array([0, len(q)])
        expect = whole.rerank(q, cand[0])
        for delay, threaded in ((0.0, True), (0.0, False), (0.0, False), (0.2, False), (0.2, True), (0.0, True),
                                (0.0, False)):
            Timed.delay = delay
            runs.clear()
            assert np.array_equal(P.rerank(q, cand, q_offsets=off)[0], expect)
            me = threading.current_thread()
            assert len(runs) == 2 and all((t is not me) == threaded for t in runs), (delay, threaded, runs)
    finally:
        P.close()


def test_a_partition_takes_the_shards_ids_as_the_whole_corpus_does(tmp_path):
    """A partition joined its shards' ids with np.concatenate alone: integer ids beside string ids
    came back as strings ('0', b'0') where Corpus.from_shards refuses them, and UTF-8 byte-string
    ids beside text ids failed with UnicodeDecodeError where the whole corpus reads them as UTF-8."""
    rng = np.random.default_rng(33)
    made = {}
    for name, ids in (("text", np.array(["a1", "a2", "a3"])), ("bytes", np.array(["é1".encode(), b"b2", b"b3"])),
                      ("ints", np.arange(3) * 10)):
        made[name] = tmp_path / name
        shards.pack_arrays(_docs(rng, 3), made[name], ids=ids)
    q = _queries(rng, 1)[0]
    paths = [made["text"], made["bytes"]]
    whole = lik_cupy.Corpus.from_shards(paths, device="cpu")
    with Batcher.from_shards(paths, ["cpu", "cpu"], partition=True) as b:
        s, i = b.search(q, 6)
        s1, i1 = whole.search(q, 6)
        assert np.array_equal(s, s1) and i.tolist() == i1.tolist() and "é1" in i.tolist()
    for mixed in ([made["text"], made["ints"]], [made["ints"], made["bytes"]]):
        with pytest.raises(ValueError, match="the shards mix integer and string ids; use one kind in every shard"):
            Batcher.from_shards(mixed, ["cpu", "cpu"], partition=True)


def test_a_replica_that_does_not_fit_each_gpu_partitions_by_default(split_shards_dir, monkeypatch):
    from lik_cupy.serving import batcher

    paths, _ = split_shards_dir
    opened = [shards.open_input(p) for p in paths]
    need = sum(int(a.nbytes) for s in opened for a in (s.tokens, s.scales, s.offsets) if a is not None)
    free = {0: 2 * need, 1: 2 * need}
    assert batcher._replica_fits(opened, [0, 1], free.get)
    free[1] = need  # 3/4 of it is too little
    assert not batcher._replica_fits(opened, [0, 1], free.get)
    made = []

    class Partitioned(Exception):
        pass

    def partition_of(opened, parts):  # where loading the parts would need the GPUs
        made.append(parts)
        raise Partitioned

    monkeypatch.setattr(batcher, "_free_gpu_bytes", free.get)
    monkeypatch.setattr(batcher, "_partition_of", partition_of)
    with pytest.raises(Partitioned):
        Batcher.from_shards(paths, [0, 0, 1, 1])
    assert made == [[0, 1]]  # each GPU once


def test_split_shards_keeps_order_and_evens_documents():
    from lik_cupy.serving._partition import split_shards

    assert split_shards(list("abcd"), [10, 10, 10, 10], 2) == [["a", "b"], ["c", "d"]]
    assert split_shards(list("abcd"), [100, 1, 1, 1], 2) == [["a"], ["b", "c", "d"]]
    assert split_shards(list("abc"), [1, 1, 100], 3) == [["a"], ["b"], ["c"]]
    with pytest.raises(ValueError, match="3 shards cannot be split over 4 devices"):
        split_shards(list("abc"), [1, 1, 1], 4)
    with pytest.raises(ValueError, match="a partition needs two devices at least"):
        Batcher.from_shards(["x"], ["cpu"], partition=True)


def test_an_empty_outputs_list_and_zero_queries_are_answered_as_in_process(served, local):
    """"outputs": [] sent no output over HTTP (gRPC cannot tell it from none named: all); a rerank
    of zero queries was a 400 from NumPy's reshape."""
    q = np.ones((2, DIM), np.float32)
    status, _, body = served.infer("score", {"inputs": [_json_q(q)], "outputs": []})
    assert status == 200 and [o["name"] for o in json.loads(body)["outputs"]] == ["SCORES"]
    status, _, body = served.infer("rerank", {"inputs": [_json_q(np.ones((0, 3, DIM), np.float32)),
                                                         {"name": "IDS", "shape": [0, 2], "datatype": "INT64",
                                                          "data": []}]})
    assert status == 200, body
    out = json.loads(body)["outputs"][0]
    assert out["shape"] == [0, 2] and out["data"] == []


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    rng = np.random.default_rng(11)
    path = tmp_path_factory.mktemp("serve") / "shard0"
    shards.pack_arrays(_docs(rng, 200), path, ids=np.arange(200) * 3 + 5)
    return path


@pytest.fixture(scope="module")
def served(shard):
    s = Server(shard, "--devices", "cpu,cpu", "--max-batch", "8", "--max-delay-us", "2000")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local(shard):
    return lik_cupy.Corpus.from_shards(shard, device="cpu")


def _written(header, outputs, binary) -> tuple[bytes, int | None]:
    """write_response's body, joined, and its JSON header's length."""
    from lik_cupy.serving import _tensors

    pieces, n = _tensors.write_response(header, outputs, binary)
    return b"".join(pieces), n


def _json_q(q, name="Q"):
    return {"name": name, "shape": list(q.shape), "datatype": "FP32", "data": q.reshape(-1).tolist()}


def test_serve_help(shard):
    r = run_lik("serve", "--help")
    assert r.exit_code == 0 and "Open Inference Protocol" in r.output and "--max-delay-us" in r.output
    assert all(o in r.output for o in ("--header-timeout", "--body-timeout", "--body-min-rate", "--grpc-max-streams"))
    for value in ("0", "-1", "nan", "inf"):  # (click's float range lets nan and inf by)
        r = run_lik("serve", str(shard), "--body-timeout", value)
        assert r.exit_code == 2 and "expected a positive number of seconds" in r.output, r.output
    r = run_lik("serve", str(shard), "--grpc-max-streams", "0")
    assert r.exit_code == 2 and "--grpc-max-streams" in r.output, r.output


def test_the_uvicorn_internals_a_connection_uses_are_there():
    """lik serve's HTTP connections extend uvicorn's httptools protocol and read its internals,
    which any release may change: a uvicorn without them failed only as connections came. The
    [serve] extra takes the releases tested here, and importing the connection names what it
    misses of any other."""
    pytest.importorskip("uvicorn")
    tomllib = pytest.importorskip("tomllib")
    specifiers = pytest.importorskip("packaging.specifiers")
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from lik_cupy.serving import _connection

    assert _connection.missing_internals() == []
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    assert f"uvicorn{_connection.UVICORN}" in extra, extra
    tested = specifiers.SpecifierSet(_connection.UVICORN)
    assert uvicorn.__version__ in tested and any(s.operator == "<" for s in tested), (uvicorn.__version__, tested)

    class Changed(HttpToolsProtocol):  # (a release that renamed two of them)
        on_response_complete = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            del self.pipeline

    assert _connection.missing_internals(Changed) == ["Changed.on_response_complete", "Changed.pipeline"]
    with pytest.raises(ImportError) as e:
        _connection.check_internals(Changed)
    assert str(e.value) == (f"lik serve's HTTP connections extend uvicorn's httptools protocol, and uvicorn "
                            f"{uvicorn.__version__}'s lacks Changed.on_response_complete, Changed.pipeline; "
                            f"lik-cupy is tested with uvicorn{_connection.UVICORN}")


@pytest.mark.parametrize("devices", ["0,x", "", " ", "0,,1", ",", "-1", "0,-1", "+1", "1_0", "a", "CPU"])
def test_serve_refuses_bad_devices_before_serving(shard, devices, monkeypatch):
    """--devices "" took the default devices (every GPU, else cpu); -1 failed only once the server was
    listening, as the corpus loaded."""
    def started(*a, **k):
        raise AssertionError(f"lik serve started with --devices {devices!r}")

    monkeypatch.setitem(sys.modules, "lik_cupy.serving.http", types.SimpleNamespace(serve=started))
    r = run_lik("serve", shard, "--devices", devices)
    assert r.exit_code == 2, r.output
    assert r.stderr == ("lik: error: --devices: expected GPU indices (0 or more) and/or cpu, comma-separated "
                        f"(0,1 or cpu); got {devices!r}\n")


def test_serve_devices_take_indices_and_cpu_in_order():
    assert cli._serve_devices(" 1, cpu,0 ,1") == [1, "cpu", 0, 1]


def _mismatched_shards(tmp_path, shard) -> list[str]:
    """Two shards that each open but do not make one corpus (dims 16 and 8): a failure of the load."""
    other = tmp_path / "dim8"
    shards.pack_arrays([np.ones((3, 8), np.float32)], other)
    return [str(shard), str(other)]


def test_a_missing_shard_is_refused_before_the_server_listens(tmp_path, shard):
    """It used to be found by the load thread, once the server had said "listening on" and answered
    /v2/health/live."""
    for m in ("starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(m)
    for extra in ([], ["--processes", "2"]):
        r = subprocess.run([sys.executable, "-m", "lik_cupy", "serve", str(shard), str(tmp_path / "missing"),
                            "--port", "0", *extra], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 2 and f"lik: error: {tmp_path / 'missing'}:" in r.stderr, r.stderr
        assert "listening on" not in r.stderr, r.stderr


def test_a_corpus_that_fails_to_load_stops_the_server_with_exit_2(tmp_path, shard):
    for m in ("starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(m)
    r = subprocess.run([sys.executable, "-m", "lik_cupy", "serve", *_mismatched_shards(tmp_path, shard), "--port", "0"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "lik: error: lik serve: loading the corpus failed:" in r.stderr, r.stderr
    assert "dim" in r.stderr, r.stderr


def test_processes_that_cannot_start_stop_the_server_with_exit_2(tmp_path, shard):
    """A corpus that fails to load in the processes stops them all; a taken port (HTTP or gRPC) is
    refused before any process starts. Nothing is left behind (the metrics directory)."""
    for m in ("starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(m)
    import glob
    import importlib
    import socket
    import tempfile

    before = set(glob.glob(f"{tempfile.gettempdir()}/lik-serve-metrics-*"))
    r = subprocess.run([sys.executable, "-m", "lik_cupy", "serve", *_mismatched_shards(tmp_path, shard), "--port",
                        "0", "--processes", "2"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "loading the corpus failed" in r.stderr, r.stderr
    assert "lik: error: lik serve: server process lik-serve-" in r.stderr and "stopped" in r.stderr, r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = [["--port", port]]
        try:
            importlib.import_module("lik_cupy.serving.grpc")  # (the [serve-grpc] extra)
            cases.append(["--port", "0", "--grpc-port", port])
        except ImportError:
            pass
        for args in cases:
            r = subprocess.run([sys.executable, "-m", "lik_cupy", "serve", str(shard), "--processes", "2", *args],
                               capture_output=True, text=True, cwd=ROOT, timeout=120)
            assert r.returncode == 2 and f"127.0.0.1:{port}: cannot listen there" in r.stderr, r.stderr
    assert set(glob.glob(f"{tempfile.gettempdir()}/lik-serve-metrics-*")) == before


def test_health_metadata_and_metrics(served):
    assert served.get("/v2/health/live")[0] == 200
    assert served.get("/v2/models/rerank/ready")[0] == 200
    status, _, body = served.get("/v2/models/search")
    meta = json.loads(body)
    assert status == 200 and [i["name"] for i in meta["inputs"]] == ["Q", "K"]
    assert meta["inputs"][0] == {"name": "Q", "datatype": "FP32", "shape": [-1, -1, DIM]}
    assert [o["name"] for o in meta["outputs"]] == ["SCORES", "IDS"]
    assert served.get("/v2/models/nope")[0] == 404
    config = json.loads(served.get("/v2/models/rerank/config")[2])
    assert config["max_batch_size"] == 0 and config["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
    assert config["input"] == [{"name": "Q", "data_type": "TYPE_FP32", "dims": [-1, -1, DIM]},
                               {"name": "IDS", "data_type": "TYPE_INT64", "dims": [-1, -1]}]
    stats = json.loads(served.get("/v2/models/stats")[2])["model_stats"]
    assert [m["name"] for m in stats] == ["search", "rerank", "score"]
    status, _, body = served.get("/metrics")
    text = body.decode()
    for name in ("lik_serve_queue_seconds", "lik_serve_compute_seconds", "lik_serve_request_seconds",
                 "lik_serve_batch_queries", "lik_serve_rejected", "lik_serve_queue_depth"):
        assert name in text


def test_metadata_shapes_are_those_requests_take(served):
    """The protocol's metadata holds one shape per tensor: the batched form, -1 for each dimension a
    request chooses ([Lq, d] is taken too). A request of those shapes, with its -1s filled, is
    answered with outputs of the shapes advertised."""
    specs = {"search": ([("Q", [-1, -1, DIM]), ("K", [1])], [("SCORES", [-1, -1]), ("IDS", [-1, -1])]),
             "rerank": ([("Q", [-1, -1, DIM]), ("IDS", [-1, -1])], [("SCORES", [-1, -1])]),
             "score": ([("Q", [-1, -1, DIM])], [("SCORES", [-1, -1])])}
    chosen = {"Q": [2, 5], "IDS": [2, 3]}  # Nq, Lq; Nq, K
    values = {"Q": lambda n: [0.5] * n, "K": lambda n: [4], "IDS": lambda n: list(range(5, 5 + 3 * n, 3))}
    for model, (inputs, outputs) in specs.items():
        meta = json.loads(served.get(f"/v2/models/{model}")[2])
        assert [(t["name"], t["shape"]) for t in meta["inputs"]] == inputs
        assert [(t["name"], t["shape"]) for t in meta["outputs"]] == outputs
        config = json.loads(served.get(f"/v2/models/{model}/config")[2])
        assert [t["dims"] for t in config["input"]] == [s for _, s in inputs]
        tensors = []
        for t in meta["inputs"]:
            fill = iter(chosen.get(t["name"], []))
            shape = [next(fill) if n == -1 else n for n in t["shape"]]
            tensors.append({"name": t["name"], "shape": shape, "datatype": t["datatype"],
                            "data": values[t["name"]](int(np.prod(shape)))})
        status, _, body = served.infer(model, {"inputs": tensors})
        assert status == 200, body
        for got, (name, shape) in zip(json.loads(body)["outputs"], outputs):
            assert got["name"] == name and len(got["shape"]) == len(shape) and got["shape"][0] == 2


def test_only_version_1_of_a_model_exists(served):
    q = json.dumps({"inputs": [_json_q(np.ones((2, DIM), np.float32))]}).encode()
    for suffix in ("", "/ready", "/config", "/stats"):
        assert served.get(f"/v2/models/score/versions/1{suffix}")[0] == 200, suffix
        status, _, body = served.get(f"/v2/models/score/versions/7{suffix}")
        assert status == 404 and json.loads(body)["error"] == "model 'score' has no version '7'; its versions are 1"
    assert served.request("POST", "/v2/models/score/versions/1/infer", q)[0] == 200
    status, _, body = served.request("POST", "/v2/models/score/versions/7/infer", q)
    assert status == 404 and json.loads(body)["error"] == "model 'score' has no version '7'; its versions are 1"


def test_unknown_paths_and_wrong_methods_answer_json_errors(served):
    """They were starlette's plain-text "Not Found" and "Method Not Allowed" (and GET of an infer path a 404)."""
    for method, path in (("GET", "/nope"), ("POST", "/v2/models"), ("GET", "/v2/models/score/infer/x")):
        status, head, body = served.request(method, path)
        assert status == 404 and head["content-type"] == "application/json", (path, body)
        assert json.loads(body)["error"].startswith(f"no endpoint at {path}; the endpoints are /v2, /v2/health/live")
    for method, path, allow in (("POST", "/v2/health/live", "GET, HEAD"), ("DELETE", "/v2/models/search", "GET, HEAD"),
                                ("GET", "/v2/models/score/infer", "POST"),
                                ("PUT", "/v2/models/score/versions/1/infer", "POST")):
        status, head, body = served.request(method, path)
        assert status == 405 and head["content-type"] == "application/json", (path, body)
        assert sorted(head["allow"].split(", ")) == sorted(allow.split(", "))
        assert json.loads(body) == {"error": f"{path} does not take {method}; it takes {head['allow']}"}


class _Transport(asyncio.Transport):
    """A connection's transport that keeps what is written to it, each write apart."""

    def __init__(self):
        super().__init__()
        self.writes, self.closing, self.reading = [], False, True

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data):
        self.writes.append(bytes(data))

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    abort = close

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True


def _connected(app) -> tuple:
    """(lik serve's HTTP protocol on a connection to ``app``, its :class:`_Transport`, the server's
    state, whose ``tasks`` are the requests' tasks); in a running event loop."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from lik_cupy.serving._connection import connection_class

    config = Config(app, log_level="warning", access_log=False, http=connection_class(10.0))
    config.load()
    state = ServerState()
    protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
    transport = _Transport()
    protocol.connection_made(transport)
    return protocol, transport, state


def _writes(*requests: bytes) -> list[list[bytes]]:
    """The transport's writes for each of ``requests``, sent one after another on one connection of
    lik serve's HTTP protocol (a server whose corpus never loads)."""
    from lik_cupy.serving.http import make_app

    async def main():
        protocol, transport, state = _connected(make_app(lambda observer: None))
        out = []
        for r in requests:
            n = len(transport.writes)
            protocol.data_received(r)
            await asyncio.gather(*list(state.tasks))
            out.append(transport.writes[n:])
        protocol.connection_lost(None)
        return out

    return asyncio.run(main())


def test_an_inference_answer_goes_out_in_one_write():
    """uvicorn writes a response's status line and headers, then its body, each at once: two sends
    for one small answer, which its client woke for twice (about 15 us of a search at one client on
    the CPU path). An inference answer goes out in one write now; other responses as before, and a
    HEAD's headers, which no body follows, too."""
    head = b"Host: lik\r\n\r\n"
    infer = b"POST /v2/models/nope/infer HTTP/1.1\r\nHost: lik\r\nContent-Length: 2\r\n\r\n{}"
    got = _writes(infer, b"GET /v2/models/score/infer HTTP/1.1\r\n" + head, b"GET /v2/health/live HTTP/1.1\r\n" + head,
                  b"HEAD /v2/health/live HTTP/1.1\r\n" + head, infer)
    for writes, status in zip(got, (b"404", b"405", b"200", b"200", b"404")):
        answer = b"".join(writes)
        assert answer.startswith(b"HTTP/1.1 " + status), answer
        length = int(re.search(rb"content-length: (\d+)", answer).group(1))
        assert len(answer.partition(b"\r\n\r\n")[2]) == (0 if writes is got[3] else length)
    assert [len(w) for w in got[:2]] == [1, 1] and len(got[4]) == 1  # (the inference path's answers)
    assert json.loads(got[0][0].partition(b"\r\n\r\n")[2])["error"].startswith("unknown model 'nope'")


def test_a_queued_request_whose_connection_is_lost_is_dropped_with_no_task_watching_it():
    """The handler watched a queued request's connection with a task of its own, waiting for
    ``http.disconnect``: about 15 us of a search at one client on the CPU path, the worker's wake-up
    among them (it waited for the event loop to start that task). The connection now calls the
    handler back when it is lost; reading, which a body of over 64 KiB leaves paused, goes on while
    it waits (a client's leaving is seen by reading)."""
    from lik_cupy.serving.http import make_app

    rng = np.random.default_rng(48)
    docs = _docs(rng, 30)
    corpus = lik_cupy.Corpus(np.concatenate(docs), d_offsets=np.concatenate([[0], np.cumsum([len(d) for d in docs])]),
                             device="cpu")
    app = make_app(lambda observer: Batcher(corpus, max_batch=2, max_delay_us=30_000_000, observer=observer))
    svc = app.state.service
    body, length = _binary_body([("Q", rng.standard_normal((2400, DIM)).astype(np.float32), "FP32")])  # (150 KiB)

    async def main():
        svc.start()
        while not svc.ready:
            assert svc.failure is None
            await asyncio.sleep(0.01)
        protocol, transport, state = _connected(app)
        protocol.data_received(b"POST /v2/models/score/infer HTTP/1.1\r\nHost: lik\r\nContent-Length: %d\r\n"
                               b"Inference-Header-Content-Length: %s\r\n\r\n" % (len(body), length.encode()))
        protocol.data_received(body[:-70_000])
        await asyncio.sleep(0.01)  # (the handler reads it and waits for the rest)
        protocol.data_received(body[-70_000:])
        assert not transport.reading  # (uvicorn pauses past 64 KiB of body)
        while svc.batcher.queue_depths()["cpu:0"] == 0:  # (queued: the worker waits for a second query)
            await asyncio.sleep(0.001)
        assert asyncio.all_tasks() - {asyncio.current_task()} == state.tasks  # the request's task alone
        assert transport.reading
        protocol.connection_lost(None)
        await asyncio.gather(*list(state.tasks))
        return transport.writes, svc.batcher.queue_depths()

    try:
        writes, depths = asyncio.run(main())
    finally:
        svc.stop()
    assert writes == [] and depths == {"cpu:0": 0} and (svc.accepted, svc.answered, svc.dropped) == (1, 0, 1)


def test_lik_serve_partition_answers_as_the_whole_corpus(split_shards_dir):
    paths, docs = split_shards_dir
    whole = lik_cupy.Corpus.from_shards(paths, device="cpu")
    server = Server(*paths, "--devices", "cpu,cpu", "--partition")
    try:
        q = docs[3]
        status, _, body = server.infer("search", {"inputs": [
            _json_q(q), {"name": "K", "shape": [1], "datatype": "INT32", "data": [7]}]})
        out = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
        s, i = whole.search(q, 7)
        assert status == 200 and out["IDS"] == i.tolist() and np.array_equal(np.float32(out["SCORES"]), s)
        status, _, body = server.infer("rerank", {"inputs": [
            _json_q(q), {"name": "IDS", "shape": [3], "datatype": "INT64", "data": [1363, 3, 403]}]})
        assert status == 200
        assert np.array_equal(np.float32(json.loads(body)["outputs"][0]["data"]), whole.rerank(q, [136, 0, 40]))
        assert json.loads(server.get("/v2/models/score/config")[2])["instance_group"] == [{"count": 1,
                                                                                         "kind": "KIND_CPU"}]
    finally:
        server.stop()


def test_json_requests_equal_in_process_calls(served, local):
    rng = np.random.default_rng(12)
    q = rng.standard_normal((9, DIM)).astype(np.float32)
    status, _, body = served.infer("search", {"id": "r1", "inputs": [
        _json_q(q), {"name": "K", "shape": [1], "datatype": "INT32", "data": [4]}]})
    out = {o["name"]: o for o in json.loads(body)["outputs"]}
    s, i = local.search(q, 4)
    assert status == 200 and json.loads(body)["id"] == "r1"
    timing = json.loads(body)["parameters"]
    assert timing["batch_queries"] >= 1 and timing["queue_us"] >= 0 and timing["compute_us"] >= 0
    assert out["IDS"]["data"] == i.tolist() and out["IDS"]["datatype"] == "INT64"
    assert np.array_equal(np.array(out["SCORES"]["data"], np.float32), s)
    ids = np.array([[8, 5, 602]])
    status, _, body = served.infer("rerank", {"inputs": [
        _json_q(q[None]), {"name": "IDS", "shape": [1, 3], "datatype": "INT64", "data": ids.tolist()}]})
    out = json.loads(body)["outputs"][0]
    assert status == 200 and out["shape"] == [1, 3]
    assert np.array_equal(np.array(out["data"], np.float32), local.rerank(q[None], (ids - 5) // 3)[0])


def test_tritonclient_binary_requests_equal_in_process_calls(served, local):
    th = pytest.importorskip("tritonclient.http")
    rng = np.random.default_rng(13)
    client = th.InferenceServerClient(f"127.0.0.1:{served.port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("search")
    q = rng.standard_normal((1, 20, DIM)).astype(np.float32)
    Q = th.InferInput("Q", list(q.shape), "FP32")
    Q.set_data_from_numpy(q, binary_data=True)
    K = th.InferInput("K", [1], "INT32")
    K.set_data_from_numpy(np.array([10], np.int32))
    r = client.infer("search", [Q, K])  # binary outputs too
    s, i = local.search(q, 10)
    assert np.array_equal(r.as_numpy("SCORES"), s) and np.array_equal(r.as_numpy("IDS"), i)
    ids = th.InferInput("IDS", [1, 4], "INT64")
    ids.set_data_from_numpy(np.array([[5, 8, 11, 602]]))
    r = client.infer("rerank", [Q, ids], outputs=[th.InferRequestedOutput("SCORES", binary_data=False)],
                     request_compression_algorithm="gzip")
    assert np.array_equal(r.as_numpy("SCORES"), local.rerank(q, [[0, 1, 2, 199]]))
    r = client.infer("score", [Q], timeout=10_000_000)
    assert np.array_equal(r.as_numpy("SCORES"), local.score(q))
    assert client.get_model_config("score")["name"] == "score"
    stats = client.get_inference_statistics("score")["model_stats"][0]
    assert stats["inference_count"] >= 1 and stats["inference_stats"]["success"]["count"] >= 1


def test_many_concurrent_clients_each_get_their_own_rows(served, local):
    rng = np.random.default_rng(14)
    qs = _queries(rng, 48, hi=33)

    def client(t):  # 16 clients, 3 requests each
        for j in range(t, len(qs), 16):
            q, k = qs[j], 3 + j % 4
            status, _, body = served.infer("search", {"inputs": [
                _json_q(q), {"name": "K", "shape": [1], "datatype": "INT32", "data": [k]}]})
            out = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
            s, i = local.search(q, k)
            assert status == 200 and out["IDS"] == i.tolist() and np.array_equal(np.float32(out["SCORES"]), s)

    run_threads(16, client)


@pytest.mark.parametrize("model,payload,headers,match", [
    ("search", {"inputs": [{"name": "Q", "shape": [DIM], "datatype": "FP32", "data": [0.0] * DIM},
                           {"name": "K", "shape": [1], "datatype": "INT32", "data": [3]}]}, None,
     r"Q has shape \[16\]"),
    ("search", {"inputs": [{"name": "Q", "shape": [2, DIM], "datatype": "FP16", "data": [0.0] * 2 * DIM},
                           {"name": "K", "shape": [1], "datatype": "INT32", "data": [3]}]}, None,
     "corpus has dtype float32 but Q has float16"),
    ("search", {"inputs": [{"name": "Q", "shape": [2, DIM], "datatype": "INT32", "data": [0] * 2 * DIM},
                           {"name": "K", "shape": [1], "datatype": "INT32", "data": [3]}]}, None,
     "Q must be FP16, BF16 or FP32"),
    ("search", {"inputs": [{"name": "Q", "shape": [2, DIM], "datatype": "FP32", "data": [0.0] * 2 * DIM},
                           {"name": "K", "shape": [1], "datatype": "INT32", "data": [0]}]}, None,
     "k must be an integer"),
    ("search", {"inputs": [{"name": "Q", "shape": [2, DIM], "datatype": "FP32", "data": [0.0] * 2 * DIM},
                           {"name": "K", "shape": [2], "datatype": "INT32", "data": [1, 2]}]}, None,
     "K must hold one INT32"),
    ("rerank", {"inputs": [{"name": "Q", "shape": [2, DIM], "datatype": "FP32", "data": [0.0] * 2 * DIM},
                           {"name": "IDS", "shape": [2], "datatype": "INT64", "data": [5, 6]}]}, None,
     r"unknown ids \[6\]"),
    ("score", {"inputs": [{"name": "Q", "shape": [2, DIM], "datatype": "FP32", "data": [0.0] * 3}]}, None,
     "needs 32 values, got 3"),
    ("score", b'{"inputs": [{"name": "Q", "shape": [2, 16], "datatype": "FP32", '
              b'"parameters": {"binary_data_size": 128}}]}' + bytes(64), None, "runs past the 64 bytes"),
    ("score", b'{"inputs": [{"name": "Q", "shape": [1, 16], "datatype": "FP32", '
              b'"parameters": {"binary_data_size": 64}}]}' + bytes(64), {"Inference-Header-Content-Length": "999"},
     "Inference-Header-Content-Length is 999"),
    ("score", b'{"inputs": [', None, "the request header is not JSON"),
    ("score", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32", "data": [0.0] * DIM}],
               "outputs": [{"name": "IDS"}]}, None, "unknown output 'IDS'"),
    ("score", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32", "data": [0.0] * DIM}],
               "parameters": {"timeout": -1}}, None, "timeout must be a positive number"),
    ("score", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32", "data": [0.0] * DIM}],
               "parameters": {"timeout": 10**400}}, None, "timeout is out of range"),
    ("score", b'{"inputs": [{"name": "Q", "shape": [1], "datatype": "FP32", "data": ' + b"[" * 5000 + b"1"
     + b"]" * 5000 + b"}]}", {}, r"nests its JSON too deeply|Q has shape \[1\]"),  # (Python 3.12 parses 5,000 levels)
    ("score", {"inputs": [{"name": "Q", "shape": [1000000, 0, DIM], "datatype": "FP32", "data": []}]}, None,
     r"Q has shape \[1000000, 0, 16\]: a query needs at least one token"),
    ("score", {"inputs": [{"name": "Q", "shape": [0, DIM], "datatype": "FP32", "data": []}]}, None,
     "a query needs at least one token"),
    ("score", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32", "data": [0.0] * DIM},
                          {"name": "IDS", "shape": [16385], "datatype": "BYTES", "data": ["x" * 16384] + [""] * 16384}]},
     None, "16385 BYTES elements of up to 16384 characters take 1073807360 bytes"),
    ("score", b'{"inputs": [{"name": "Q", "shape": [1, 16], "datatype": "FP32", '
              b'"parameters": {"binary_data_size": 64}}]}' + bytes(64), {"Inference-Header-Content-Length": "+76"},
     "Inference-Header-Content-Length must be an integer"),
    # JSON values the datatype does not hold (each was coerced: an id of 5.9 scored document 5)
    ("rerank", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32", "data": [0.0] * DIM},
                           {"name": "IDS", "shape": [1], "datatype": "INT64", "data": [5.9]}]}, None,
     "INT64 data must be integers"),
    ("search", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32", "data": [0.0] * DIM},
                           {"name": "K", "shape": [1], "datatype": "INT32", "data": [True]}]}, None,
     "INT32 data must be integers"),
    ("score", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32", "data": [True] * DIM}]}, None,
     "FP32 data must be numbers"),
    ("rerank", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32", "data": [0.0] * DIM},
                           {"name": "IDS", "shape": [1], "datatype": "BYTES", "data": ["5\u0000"]}]}, None,
     "a BYTES element holds a NUL"),
    ("score", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32", "data": [0.0] * DIM}],
               "parameters": {"binary_data_output": "false"}}, None,
     "parameter 'binary_data_output' must be true or false, got 'false'"),
    # a Q of neither [Lq, d] nor [Nq, Lq, d] with ids of no axis (sizing the scores read IDS' last axis: a 500)
    ("rerank", {"inputs": [{"name": "Q", "shape": [DIM], "datatype": "FP32", "data": [0.0] * DIM},
                           {"name": "IDS", "shape": [], "datatype": "INT64", "data": [5]}]}, None,
     r"Q has shape \[16\]; expected \[Lq, d\] \(one query\) or \[Nq, Lq, d\]"),
    ("rerank", {"inputs": [{"name": "Q", "shape": [1, 1, 1, DIM], "datatype": "FP32", "data": [0.0] * DIM},
                           {"name": "IDS", "shape": [], "datatype": "INT64", "data": [5]}]}, None,
     r"Q has shape \[1, 1, 1, 16\]; expected"),
    ("score", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": ["FP32"], "data": [0.0] * DIM}]}, None,
     r"input Q has datatype \['FP32'\]; expected one of BOOL, .* or BYTES"),  # (a 500: unhashable type)
    ("score", b'{"inputs": [{"name": "Q", "shape": [1, 16], "datatype": "FP32", "data": [' + b", ".join([b"0.5"] * DIM)
     + b']}], "parameters": {"timeout": Infinity}}', {},
     "parameter timeout must be a positive number of microseconds, got inf"),  # (was "of seconds")
    # errors that named neither the input nor the header at fault (Python's and NumPy's words)
    ("score", b'{"inputs": []}', {"Inference-Header-Content-Length": "9" * 5000},
     "Inference-Header-Content-Length has 5000 digits but the body has 14 bytes"),
    ("rerank", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "FP32", "data": [0.0] * DIM},
                           {"name": "IDS", "shape": [2], "datatype": "BYTES", "data": ["5", "\ud800"]}]}, None,
     r"input IDS: BYTES element 1 is not text: it holds a lone surrogate \(\\ud800\)"),
    ("score", {"inputs": [{"name": "Q", "shape": [1] * 70, "datatype": "FP32", "data": [0.0]}]}, None,
     "input Q: shape has 70 dimensions; at most 32"),
    # an integer past int64's range as BF16 (ml_dtypes' TypeError was a 500)
    ("score", {"inputs": [{"name": "Q", "shape": [1, DIM], "datatype": "BF16", "data": [10**30] + [0] * (DIM - 1)}]},
     None, "corpus has dtype float32 but Q has bfloat16"),
])
def test_bad_requests_get_a_400_naming_the_problem_and_the_server_keeps_serving(served, model, payload, headers,
                                                                               match):
    if isinstance(payload, bytes) and headers is None and payload.startswith(b'{"inputs": [{'):
        headers = {"Inference-Header-Content-Length": str(payload.index(b"}]}") + 3)}
    status, _, body = served.infer(model, payload, headers)
    assert status == 400, body
    assert re.search(match, json.loads(body)["error"]), body
    q = np.ones((2, DIM), np.float32)
    status, _, _ = served.infer("score", {"inputs": [_json_q(q)]})
    assert status == 200


def test_every_refusal_is_counted_with_its_reason(served):
    """lik_serve_rejected_total counted three reasons (overloaded, deadline, cancelled): the other
    refusals were counted by their status alone, and an unknown model's not at all (its name is the
    client's). Each is counted with its reason now, an unknown model's under no model."""
    import gzip

    reasons = (("score", "invalid"), ("score", "not_found"), ("", "not_found"), ("score", "too_large"))
    before = [served.metric("lik_serve_rejected_total", model=m, reason=r) for m, r in reasons]
    unnamed = served.metric("lik_serve_responses_total", model="", code="404")
    good = json.dumps({"inputs": [_json_q(np.ones((2, DIM), np.float32))]}).encode()
    assert served.infer("score", {"inputs": [_json_q(np.ones((2, DIM + 1), np.float32))]})[0] == 400
    assert served.request("POST", "/v2/models/score/versions/7/infer", good)[0] == 404
    assert served.infer("nope", good)[0] == 404
    assert served.infer("score", gzip.compress(bytes(65 << 20)), {"Content-Encoding": "gzip"})[0] == 413
    assert [served.metric("lik_serve_rejected_total", model=m, reason=r) for m, r in reasons] == [b + 1 for b in before]
    assert served.metric("lik_serve_responses_total", model="", code="404") == unnamed + 1


def test_refusals_name_why_the_server_is_not_ready():
    """A 503 was one status for a full queue, a full budget, a server not ready and one stopping:
    each names its reason, for the metrics."""
    from lik_cupy.serving import _service

    svc = _service.Service(load=None, max_body_bytes=100)
    for step in ("loading", "stopped", "stopping"):
        if step == "stopped":
            svc.stop()
        if step == "stopping":
            svc = _service.Service(load=None)
            svc.stop_reading()
        with pytest.raises(_service.Refused) as e:
            _service.check_ready(svc)
        assert (e.value.status, e.value.reason) == (503, "not_ready" if step == "loading" else "stopping"), step
    with pytest.raises(_service.Refused) as e:
        asyncio.run(_service.arrival(svc, lambda clock: asyncio.sleep(0)))
    assert (e.value.status, e.value.reason) == (503, "stopping")
    with pytest.raises(_service.Refused) as e:
        _service.Service(load=None, max_body_bytes=100).hold(1601)
    assert (e.value.status, e.value.reason) == (503, "budget")


def test_the_docs_list_every_series_and_label_value():
    """docs/serving.md's table of metrics lists every series the server exposes, each reason a
    request is rejected for, and each status an answer is counted under."""
    from lik_cupy.serving import _service

    text = (ROOT / "docs" / "serving.md").read_text()
    table = text[text.index("**Metrics.**"):]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(lik_serve_\w+)` \|(.*)$", table, re.M)}
    exposed = {m.name for m in _service.Service(load=None).metrics.registry.collect()}
    assert {name.removesuffix("_total") for name in rows} == exposed
    reasons = set(re.findall(r"`(\w+)`", rows["lik_serve_rejected_total"]))
    assert set(_service.REASONS) <= reasons, set(_service.REASONS) - reasons
    codes = set(re.findall(r"`(\d{3})`", rows["lik_serve_responses_total"]))
    assert {str(c) for c in _service.REASONS.values()} <= codes, {str(c) for c in _service.REASONS.values()} - codes


def test_json_bf16_values_are_read_as_floats():
    """BF16 JSON data took no integer past int64's range (ml_dtypes raised TypeError: a 500)."""
    from lik_cupy._shard_format import numpy_dtype
    from lik_cupy.serving import _tensors

    bf16 = numpy_dtype("bfloat16")
    got = _tensors.tensor_from_values("Q", [[10**30, -2**64], [1.5, 3]], (2, 2), "BF16")
    assert got.dtype == bf16 and np.array_equal(got, np.array([[1e30, -2.0**64], [1.5, 3]]).astype(bf16))
    with pytest.raises(ValueError, match="input Q: a value does not fit BF16"):
        _tensors.tensor_from_values("Q", [10**400], (1,), "BF16")


def test_compressed_bodies_are_bounded_after_inflating(served):
    import gzip

    bomb = gzip.compress(bytes(65 << 20))  # 64 MiB is the most a body may hold
    status, _, body = served.infer("score", bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "over 67108864 bytes" in json.loads(body)["error"]
    status, _, body = served.infer("score", gzip.compress(b'{"inputs": []}')[:-9], {"Content-Encoding": "gzip"})
    assert status == 400 and "not valid gzip data" in json.loads(body)["error"]
    status, _, body = served.infer("score", b"{}", {"Content-Encoding": "br"})
    assert status == 400 and "Content-Encoding 'br' is not supported" in json.loads(body)["error"]
    # gzip's members one after another, and a coding's name in any case
    text = json.dumps({"inputs": [_json_q(np.ones((2, DIM), np.float32))]}).encode()
    status, _, body = served.infer("score", gzip.compress(text[:40]) + gzip.compress(text[40:]),
                                   {"Content-Encoding": "GZip"})
    assert status == 200, body
    status, _, body = served.infer("score", gzip.compress(text) + b"junk", {"Content-Encoding": "gzip"})
    assert status == 400 and "not valid gzip data" in json.loads(body)["error"]


def test_many_small_gzip_members_inflate_in_linear_time(served):
    """Each gzip member's end copied the rest of the body (zlib's unused_data): 160,000 empty members
    (3 MB) held the event loop, and every other request, for 6 s, a 64 MiB body of them for most of
    an hour."""
    import gzip

    members = gzip.compress(b"") * 400_000  # 8 MB, nothing inside: not JSON
    start = time.monotonic()
    status, _, body = served.infer("score", members, {"Content-Encoding": "gzip"})
    assert status == 400 and "the request header is not JSON" in json.loads(body)["error"], body
    assert time.monotonic() - start < 10
    text = json.dumps({"inputs": [_json_q(np.ones((2, DIM), np.float32))]}).encode()
    status, _, body = served.infer("score", b"".join(gzip.compress(text[i:i + 7]) for i in range(0, len(text), 7))
                                   + gzip.compress(b"") * 1000, {"Content-Encoding": "gzip"})
    assert status == 200, body


def test_backpressure_503_and_deadline_504(shard):
    # One request waits in a queue of one, its worker waiting 30 s for companions, and expires there
    # at its deadline (timeout 1 s), not when the worker takes it; meanwhile a second finds the queue full.
    server = Server(shard, "--devices", "cpu", "--max-queue", "1", "--max-delay-us", "30000000", "--max-batch", "8")
    try:
        payload = {"inputs": [_json_q(np.ones((2, DIM), np.float32))], "parameters": {"timeout": 1_000_000}}
        late = {}
        start = time.monotonic()
        t = threading.Thread(target=lambda: late.update(r=server.infer("score", payload), at=time.monotonic()))
        t.start()
        while 'lik_serve_queue_depth{device="cpu:0"} 1.0' not in server.get("/metrics")[2].decode():
            assert t.is_alive(), late
        status, headers, body = server.infer("score", {"inputs": [_json_q(np.ones((2, DIM), np.float32))]})
        assert status == 503 and headers["retry-after"] == "1" and "queues are full" in json.loads(body)["error"]
        t.join()
        assert late["r"][0] == 504 and "deadline passed" in json.loads(late["r"][2])["error"]
        assert 1.0 <= late["at"] - start < 10, late["at"] - start  # at its deadline, long before the 30 s
        text = server.get("/metrics")[2].decode()
        assert 'lik_serve_rejected_total{model="score",reason="overloaded"} 1.0' in text
        assert 'lik_serve_rejected_total{model="score",reason="deadline"} 1.0' in text
    finally:
        server.stop()


def test_a_deadline_behind_a_long_batch_is_answered_504_at_it_and_never_scored():
    """A request whose deadline passed while a batch ran was answered 504 only once the worker was
    free again (2 s here). It is answered at its deadline while the batch still runs, is never
    scored, and is counted once; the requests without deadlines get their results."""
    from slow_served import DIM as D, documents

    tokens, offsets = documents()
    local = lik_cupy.Corpus(tokens, d_offsets=offsets, device="cpu")
    rng = np.random.default_rng(45)
    qa, qb, qc = (rng.standard_normal((n, 4, D)).astype(np.float32) for n in (1, 3, 2))
    server = Server("2.0", script=ROOT / "tests" / "slow_served.py")
    answers = {}

    def send(name, q):
        answers[name] = (server.infer("score", {"inputs": [_json_q(q)]}), time.monotonic())

    try:
        first = threading.Thread(target=send, args=("a", qa))
        first.start()
        server.wait_line("slow_served: score of 1 queries")  # the worker is in its 2 s call
        then = threading.Thread(target=send, args=("c", qc))
        then.start()
        server.wait_metric("lik_serve_queue_depth", 1.0, device="cpu:0")
        start = time.monotonic()
        status, _, body = server.infer("score", {"inputs": [_json_q(qb)], "parameters": {"timeout": 100_000}})
        answered = time.monotonic()
        assert status == 504 and "deadline passed" in json.loads(body)["error"], body
        assert 0.1 <= answered - start < 1.0, answered - start
        first.join(60)
        then.join(60)
        assert answers["a"][1] > answered  # (the batch ran on)
        for name, q in (("a", qa), ("c", qc)):
            (status, _, body), _ = answers[name]
            assert status == 200, body
            assert np.array_equal(np.float32(json.loads(body)["outputs"][0]["data"]).reshape(len(q), -1),
                                  local.score(q))
        assert server.metric("lik_serve_rejected_total", model="score", reason="deadline") == 1.0
        assert server.metric("lik_serve_responses_total", model="score", code="504") == 1.0
        assert server.metric("lik_serve_responses_total", model="score", code="200") == 2.0
    finally:
        log = server.stop()
    calls = [line.strip() for line in server.lines if line.startswith("slow_served:")]
    assert calls == ["slow_served: score of 1 queries", "slow_served: score of 2 queries"], log
    assert "answered 3 of 3 accepted requests" in log, log


def test_a_request_whose_client_disconnects_is_dropped_unscored_and_counted(shard, local):
    """A client that goes away while its request waits in the queue: the worker skips the request,
    the metrics count it as gRPC's cancelled calls (499, rejected as cancelled), and a connected
    client's request is answered as before."""
    # A window of 10 s: the first request stays queued while the test acts on it, and the last one,
    # alone, waits out the window before it is scored.
    server = Server(shard, "--devices", "cpu", "--max-batch", "2", "--max-delay-us", "10000000")
    try:
        q = np.ones((3, DIM), np.float32)
        body = json.dumps({"inputs": [_json_q(q)]}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as gone:
            gone.sendall(b"POST /v2/models/score/infer HTTP/1.1\r\nHost: lik\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            server.wait_metric("lik_serve_queue_depth", 1.0, device="cpu:0")  # (the worker waits for 2 queries)
        server.wait_metric("lik_serve_rejected_total", 1.0, model="score", reason="cancelled")
        server.wait_metric("lik_serve_responses_total", 1.0, model="score", code="499")
        status, _, out = server.infer("score", body)  # the second query: the worker takes the queue
        assert status == 200 and json.loads(out)["parameters"]["batch_queries"] == 1  # scored alone
        assert np.array_equal(np.float32(json.loads(out)["outputs"][0]["data"]), local.score(q))
    finally:
        log = server.stop()
    assert "answered 1 of 2 accepted requests; 1 dropped" in log, log


def test_sigterm_under_load_answers_every_accepted_request(shard, local):
    server = Server(shard, "--devices", "cpu", "--max-batch", "4", "--max-delay-us", "20000")
    rng = np.random.default_rng(15)
    qs = _queries(rng, 16, hi=33)
    ok, wrong, done = [], [], threading.Event()

    def client(j):
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = json.dumps({"inputs": [_json_q(qs[j])]}).encode()
        want = local.score(qs[j])
        while True:
            try:
                c.request("POST", "/v2/models/score/infer", body=body)
                r = c.getresponse()
                data = r.read()
            except (OSError, http.client.HTTPException):
                return  # the server closed the connection: this request was never accepted
            if r.status != 200:
                return
            same = np.array_equal(np.float32(json.loads(data)["outputs"][0]["data"]), want)
            (ok if same else wrong).append(j)
            if len(ok) >= 40:
                done.set()

    threads = [threading.Thread(target=client, args=(j,)) for j in range(len(qs))]
    for t in threads:
        t.start()
    assert done.wait(60)
    log = server.stop()
    for t in threads:
        t.join(60)
    m = re.search(r"answered (\d+) of (\d+) accepted requests", log)
    assert m, log
    answered, accepted = int(m.group(1)), int(m.group(2))
    assert server.proc.returncode == 0 and not wrong
    assert answered == accepted == len(ok)


def test_sigterm_refuses_a_request_whose_body_has_not_all_arrived(shard):
    """A client that had sent part of a body and no more kept the server from stopping on SIGTERM
    for as long as it stayed connected (uvicorn waits for every request it has begun). It gets a 503
    now, and the server stops."""
    server = Server(shard, "--devices", "cpu")
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as c:
            c.sendall(b"POST /v2/models/score/infer HTTP/1.1\r\nHost: lik\r\nContent-Length: 100\r\n\r\n{\"inputs\"")
            assert server.get("/v2/health/ready")[0] == 200  # (by then the server reads that body)
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(60)
            r = http.client.HTTPResponse(c)
            r.begin()
            assert r.status == 503 and "the request's body had not all arrived" in json.loads(r.read())["error"]
    finally:
        log = server.stop()
    assert server.proc.returncode == 0 and "stopped; answered 0 of 0 accepted requests" in log, log


def test_processes_share_the_port_answer_alike_and_sum_their_metrics(shard, local):
    server = Server(shard, "--devices", "cpu", "--processes", "2", "--max-batch", "4")
    try:
        qs = _queries(np.random.default_rng(16), 24, hi=33)

        def client(t):  # each request on a new connection: the kernel spreads them over the processes
            for j in range(t, len(qs), 6):
                status, _, body = server.infer("score", {"inputs": [_json_q(qs[j])]})
                assert status == 200
                assert np.array_equal(np.float32(json.loads(body)["outputs"][0]["data"]), local.score(qs[j]))

        run_threads(6, client)
        for _ in range(4):  # refused, each on a new connection: in the application, and before it (431)
            assert server.infer("nope", {"inputs": []})[0] == 404
            with socket.create_connection(("127.0.0.1", server.port)) as c:
                line = b"GET /v2/health/live HTTP/1.1\r\nX-Pad: "
                c.sendall(line + b"a" * (65536 + 1 - len(line)))  # (one byte over, unfinished: all read)
                c.settimeout(60)
                assert c.recv(12) == b"HTTP/1.1 431"
        text = server.get("/metrics")[2].decode()
        assert sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith("lik_serve_request_seconds_count")) == len(qs) + 4  # both processes' requests
        assert server.metric("lik_serve_rejected_total", model="", reason="not_found") == 4
        assert server.metric("lik_serve_rejected_total", model="", reason="header_size") == 4
        assert server.metric("lik_serve_responses_total", model="", code="431") == 4
        assert sum("lik serve: ready:" in line for line in server.lines) == 2
    finally:
        log = server.stop()
    assert server.proc.returncode == 0, log
    answered = [(int(a), int(b)) for a, b in re.findall(r"answered (\d+) of (\d+) accepted requests", log)]
    assert len(answered) == 2 and all(a == b for a, b in answered) and sum(a for a, _ in answered) == len(qs), log


def test_processes_each_keep_one_gpus_replicas_where_their_count_divides():
    """With replicas on k GPUs, server process i of n (n a multiple of k) keeps GPU i mod k's entries,
    so that each process batches all its requests in one queue; otherwise every process keeps all."""
    from lik_cupy.serving._processes import process_share

    assert [process_share([0, 1], i, 4) for i in range(4)] == [[0], [1], [0], [1]]
    assert [process_share([0, 0, 1, 1], i, 2) for i in range(2)] == [[0, 0], [1, 1]]  # two workers a GPU stay two
    assert process_share([0, 1], 0, 3) == [0, 1]  # 3 processes over 2 GPUs: one GPU would take twice the load
    assert process_share([0, 1], 1, 1) == [0, 1]
    assert process_share([0], 2, 4) == [0] and process_share(["cpu", "cpu"], 1, 2) == ["cpu", "cpu"]
    assert process_share([1, 0, "cpu"], 1, 2) == [0]


def test_processes_refuse_a_port_another_server_listens_on_and_one_port_for_both(shard):
    """SO_REUSEPORT would let a second `lik serve --processes` join the first's port and split its
    traffic; and HTTP and gRPC cannot share one port."""
    first = Server(shard, "--devices", "cpu", "--processes", "2")
    grpc = installed("grpc", "tritonclient.grpc")  # the [serve-grpc] extra
    try:
        for extra in (["--port", str(first.port)], ["--port", str(first.port), "--grpc-port", str(first.port)])[:1 + grpc]:
            r = subprocess.run([sys.executable, "-m", "lik_cupy", "serve", str(shard), "--devices", "cpu",
                                "--processes", "2", *extra], capture_output=True, text=True, cwd=ROOT, timeout=120)
            assert r.returncode == 2, r.stderr
            assert "cannot listen there" in r.stderr or "must differ from the HTTP port" in r.stderr, r.stderr
        if grpc:
            r = subprocess.run([sys.executable, "-m", "lik_cupy", "serve", str(shard), "--devices", "cpu", "--port",
                                "18731", "--grpc-port", "18731"], capture_output=True, text=True, cwd=ROOT, timeout=120)
            assert r.returncode == 2 and "the gRPC port must differ from the HTTP port, both are 18731" in r.stderr, \
                r.stderr
    finally:
        log = first.stop()
    assert first.proc.returncode == 0, log


def test_sigterm_while_processes_start_is_a_clean_stop(shard):
    for m in ("starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(m)
    import os
    import signal

    p = subprocess.Popen([sys.executable, "-m", "lik_cupy", "serve", str(shard), "--devices", "cpu", "--processes",
                          "2", "--port", "0"], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": child_pythonpath()})
    for line in p.stderr:
        if "listening on" in line:
            break
    p.send_signal(signal.SIGTERM)  # the children are still starting
    err = p.stderr.read()
    assert p.wait(120) == 0, err


_SIGNAL_BEFORE_UVICORN = """
import os, signal, sys
import uvicorn
from lik_cupy import Corpus
from lik_cupy.serving import Batcher, http

started = uvicorn.Server.run


def run(self, sockets=None):
    os.kill(os.getpid(), signal.SIGTERM)  # after _serve_on's handlers, before uvicorn's own
    started(self, sockets)


uvicorn.Server.run = run
corpus = Corpus.from_shards(sys.argv[1], device="cpu")
http._serve_on(http.make_app(lambda observer: Batcher(corpus, observer=observer)), http._listening("127.0.0.1", 0))
print("stopped")
"""


_SIGNAL_AT_ANNOUNCE = """
import os, signal, sys
from lik_cupy import Corpus
from lik_cupy.serving import Batcher, http

said = http._announce


def announce(sock):
    said(sock)
    os.kill(os.getpid(), signal.SIGTERM)  # as soon as "listening on" is out, before uvicorn starts


http._announce = announce
corpus = Corpus.from_shards(sys.argv[1], device="cpu")
http.run(http.make_app(lambda observer: Batcher(corpus, observer=observer)), port=0)
print("stopped")
"""


@pytest.mark.parametrize("script", [_SIGNAL_BEFORE_UVICORN, _SIGNAL_AT_ANNOUNCE], ids=["process", "announced"])
def test_a_signal_before_uvicorn_handles_signals_still_stops_the_server(shard, script):
    # A process of --processes that SIGTERM reaches while it starts, or a server stopped as soon as it
    # says "listening on": the signal must neither be lost before uvicorn installs its handlers (the
    # process then served until the parent's grace period killed it) nor kill the process outright.
    for m in ("starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(m)
    import os

    r = subprocess.run([sys.executable, "-c", script, str(shard)], capture_output=True, text=True,
                       cwd=ROOT, timeout=60, env={**os.environ, "PYTHONPATH": child_pythonpath()})
    assert r.returncode == 0 and r.stdout.strip() == "stopped", r.stderr


def test_a_failing_observer_neither_kills_the_worker_nor_loses_a_request(corpus):
    class Failing(Observer):
        calls = 0

        def batch(self, device, op, requests, queries, compute_s):
            Failing.calls += 1
            raise OSError(28, "No space left on device")

        def answered(self, device, op, queue_s, compute_s):
            raise RuntimeError("a metrics backend that fails")

    rng = np.random.default_rng(19)
    qs = _queries(rng, 3)
    with Batcher(corpus, observer=Failing()) as b:
        for q in qs:  # (a dead worker would leave the future pending: the timeout fails the test instead)
            assert np.array_equal(b.submit("score", q[None]).result(timeout=60), corpus.score(q[None]))
    assert Failing.calls == 3


def test_request_bytes_are_held_against_the_servers_budget():
    from lik_cupy.serving import _service, http

    svc = _service.Service(load=None, max_body_bytes=100)
    assert svc.max_held == _service.HELD_BODIES * 100
    svc.hold(1500)
    with pytest.raises(_service.Refused, match="holds 1500 bytes of requests, its limit is 1600") as e:
        svc.hold(101)
    assert e.value.status == 503 and e.value.retry and e.value.reason == "budget" and svc.held == 1500

    async def read(chunks):
        messages = iter({"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)}
                        for i, c in enumerate(chunks))
        held = _service.Held(svc)
        try:
            body = await _service.arrival(svc, lambda clock: http._body(lambda: _next(messages), 100, held, clock))
            return body, held.n
        finally:
            held.release()

    async def _next(it):
        return next(it)

    svc.release(1500)
    assert asyncio.run(read([b"x" * 40, b"y" * 50])) == (b"x" * 40 + b"y" * 50, 180)  # the chunks, then the body
    assert svc.held == 0
    svc.hold(1550)
    with pytest.raises(_service.Refused):
        asyncio.run(read([b"x" * 40, b"y" * 50]))
    assert svc.held == 1550  # what the refused request held is given back


def _wide_corpus(nd: int = 2000) -> lik_cupy.Corpus:
    """``nd`` one-token documents: a score answers 4 * nd bytes a query of 64 bytes (float32, DIM)."""
    tokens = np.random.default_rng(49).standard_normal((nd, DIM)).astype(np.float32)
    return lik_cupy.Corpus(tokens, d_offsets=np.arange(nd + 1), device="cpu")


def test_a_request_that_alone_takes_more_than_the_budget_is_413_never_503():
    """A request whose outputs, with what it holds already (its body, what reading it takes), are
    more than the server's whole budget of request bytes was refused 503 with Retry-After, which no
    retry could pass: 64,000 bytes of scores against a budget of 64,000 (make_app's max_body_bytes
    4,000); with lik serve's defaults, a score of up to 1 GiB of outputs (MAX_OUTPUT, the budget) and
    its body. It is refused 413, as a request whose reading alone takes more; a request that fits
    is answered."""
    from lik_cupy.serving.http import make_app

    corpus = _wide_corpus()
    app = make_app(lambda observer: Batcher(corpus, observer=observer), max_body_bytes=4000)
    svc = app.state.service
    per_query = 4 * len(corpus)
    assert svc.max_held == 8 * per_query  # (8 queries' scores are the whole budget)

    async def answer(protocol, transport, state, nq):
        body, length = _binary_body([("Q", np.ones((nq, 1, DIM), np.float32), "FP32")])
        n = len(transport.writes)
        protocol.data_received(b"POST /v2/models/score/infer HTTP/1.1\r\nHost: lik\r\nContent-Length: %d\r\n"
                               b"Inference-Header-Content-Length: %s\r\n\r\n%s" % (len(body), length.encode(), body))
        await asyncio.gather(*list(state.tasks))
        head, _, text = b"".join(transport.writes[n:]).partition(b"\r\n\r\n")
        return int(head.split()[1]), head.lower(), text

    async def main():
        svc.start()
        while not svc.ready:
            assert svc.failure is None
            await asyncio.sleep(0.01)
        connection = _connected(app)
        return [await answer(*connection, nq) for nq in (7, 8, 9)]

    try:
        (ok, _, _), *refused = asyncio.run(main())
    finally:
        svc.stop()
    assert ok == 200
    for status, head, text in refused:  # 8: its scores and its body; 9: its scores alone
        assert status == 413 and b"retry-after" not in head, (status, head, text)
        assert re.search(r"outputs take \d+ bytes and the request itself \d+: over the 64000 that the server "
                         r"holds for all its requests", json.loads(text)["error"]), text
    assert svc.held == 0


def test_what_a_request_holds_already_counts_towards_its_413():
    """Reading a request past what the server holds for all its requests is a 413; it was a 503 with
    Retry-After where each hold was under the budget but the request's holds together were not."""
    from lik_cupy.serving import _service

    svc = _service.Service(load=None, max_body_bytes=100)
    held = _service.Held(svc)
    held.add(svc.max_held - 100)
    with pytest.raises(_service.Refused, match=r"reading the request takes about 200 bytes .* over the 1600 that the "
                                               r"server holds for all its requests; send it binary") as e:
        held.reading("send it binary")(200)
    assert e.value.status == 413 and not e.value.retry
    held.reading("send it binary")(100)  # (what fits is held)
    assert svc.held == held.n == svc.max_held
    held.release()
    assert svc.held == 0


def _binary_body(inputs: list[tuple[str, np.ndarray, str]]) -> tuple[bytes, str]:
    header = json.dumps({"inputs": [{"name": n, "shape": list(a.shape), "datatype": t,
                                     "parameters": {"binary_data_size": a.nbytes}} for n, a, t in inputs]}).encode()
    return header + b"".join(a.tobytes() for _, a, _ in inputs), str(len(header))


def test_a_repeated_binary_header_reads_each_bodys_own_data_and_checks_its_length(rng):
    """Parsed headers are kept by their bytes; a request with the same header still reads its own
    tensors, and one whose binary data does not match the header is refused as before."""
    from lik_cupy.serving import _tensors

    bodies = []
    for _ in range(3):
        q = rng.standard_normal((4, 8)).astype(np.float16)
        ids = rng.integers(0, 100, 5)
        bodies.append((_binary_body([("Q", q, "FP16"), ("IDS", ids, "INT64")]), q, ids))
    headers = []
    for (body, length), q, ids in bodies:
        header, inputs = _tensors.read_request(body, length)
        np.testing.assert_array_equal(inputs["Q"], q)
        np.testing.assert_array_equal(inputs["IDS"], ids)
        assert inputs["Q"].dtype == np.float16 and inputs["IDS"].shape == (5,)
        headers.append(header)
    assert headers[0] is headers[1] is headers[2]  # (the same header bytes: parsed once)
    (body, length), _, _ = bodies[0]
    with pytest.raises(ValueError, match="IDS: binary_data_size 40 runs past the 96 bytes"):
        _tensors.read_request(body[:-8], length)
    with pytest.raises(ValueError, match="8 bytes of binary data that no input"):
        _tensors.read_request(body + bytes(8), length)
    for k in range(_tensors._PLANS_MAX + 10):  # distinct headers: the cache stays bounded
        _tensors.read_request(*_binary_body([("Q", np.zeros((1, k + 1), np.float32), "FP32")]))
    assert len(_tensors._PLANS) <= _tensors._PLANS_MAX


def test_binary_bytes_past_the_shapes_elements_are_refused_without_reading_each(monkeypatch):
    """A BYTES input's binary data is read for the shape's elements only: a body of 4-byte empty
    elements behind shape [1] was walked element by element (16M for a 64 MiB body) before its
    count was compared."""
    import struct

    from lik_cupy.serving import _tensors

    calls = []

    def unpack_from(fmt, buf, at):
        calls.append(at)
        return struct.unpack_from(fmt, buf, at)

    monkeypatch.setattr(_tensors, "struct", types.SimpleNamespace(unpack_from=unpack_from))
    raw = memoryview(struct.pack("<I", 2) + b"d1" + bytes(4 * 100_000))
    with pytest.raises(ValueError, match=r"IDS: shape \[1\] needs 1 BYTES elements, but 400000 more bytes"):
        _tensors.tensor_from_bytes("IDS", raw, (1,), "BYTES")
    assert len(calls) == 1
    calls.clear()
    got = _tensors.tensor_from_bytes("IDS", raw[:10], (2,), "BYTES")  # (an empty element: 4 bytes)
    assert got.tolist() == ["d1", ""] and len(calls) == 2
    with pytest.raises(ValueError, match="needs 3 BYTES elements, got 2"):
        _tensors.tensor_from_bytes("IDS", raw[:10], (3,), "BYTES")


def test_binary_responses_are_the_json_the_generic_path_writes(rng):
    from lik_cupy.serving import _tensors

    scores = rng.standard_normal((2, 7)).astype(np.float32)
    ids = np.array([["a", "bc"], ["d", ""]])
    head = {"model_name": "search", "model_version": "1", "id": 'q"1', "parameters": {"queue_us": 3}}
    for outputs, binary in (([("SCORES", scores)], {"SCORES"}), ([("SCORES", scores), ("IDS", ids)], {"SCORES", "IDS"}),
                            ([("SCORES", scores), ("IDS", ids)], {"SCORES"})):
        for _ in range(2):  # (written, then from the kept outputs' JSON)
            body, n = _written(head, outputs, binary)
            tensors = []
            for name, a in outputs:
                t = {"name": name, "datatype": "BYTES" if a.dtype.kind == "U" else "FP32", "shape": list(a.shape)}
                if name in binary:
                    t["parameters"] = {"binary_data_size": len(_tensors.tensor_bytes(a))}
                else:
                    t["data"] = a.reshape(-1).tolist()
                tensors.append(t)
            assert json.loads(body[:n]) == {**head, "outputs": tensors}
            assert body[n:] == b"".join(_tensors.tensor_bytes(a) for name, a in outputs if name in binary)
    body, n = _written({}, [("SCORES", scores)], {"SCORES"})
    assert json.loads(body[:n])["outputs"][0]["shape"] == [2, 7]


def test_an_outputs_binary_data_overrides_binary_data_output():
    """The binary extension: binary_data_output asks for every output in binary "unless overridden by
    "binary_data" on a specific output" (SCORES with binary_data false was sent binary)."""
    from lik_cupy.serving import _tensors

    names = ("SCORES", "IDS")
    for every, flags, want in ((True, {"SCORES": False}, {"IDS"}), (True, {"SCORES": True}, {"SCORES", "IDS"}),
                               (False, {"SCORES": True}, {"SCORES"}), (True, {}, {"SCORES", "IDS"})):
        outputs = [{"name": n, **({"parameters": {"binary_data": flags[n]}} if n in flags else {})} for n in names]
        header = {"parameters": {"binary_data_output": every}, "outputs": outputs}
        assert _tensors.binary_outputs(header, names) == (list(names), want), (every, flags)


def test_outputs_past_the_limit_are_refused(corpus):
    from lik_cupy.serving import _service

    class Svc:
        batcher = Batcher(corpus)
        ids = IdIndex(None, len(corpus))

    try:
        q = np.zeros((3, 2, DIM), np.float32)
        assert _service._output_bytes(Svc, "score", q, None) == 3 * len(corpus) * 4
        assert _service._output_bytes(Svc, "search", q, 10) == 3 * 10 * 12
        # (search answers min(k, Nd) results a query: k = 4096 over 300 documents was counted as 4096)
        assert _service._output_bytes(Svc, "search", q, 4096) == 3 * len(corpus) * 12
        assert _service._output_bytes(Svc, "rerank", q, np.zeros((3, 7), np.int64)) == 3 * 7 * 4
        big = np.zeros((_service.MAX_OUTPUT // (4 * len(corpus)) + 1, 1, DIM), np.float32)
        with pytest.raises(ValueError, match=f"queries of {len(corpus)} documents' scores take .* at most"):
            _service._output_bytes(Svc, "score", big, None)
        with pytest.raises(ValueError, match=f"queries of {len(corpus)} results .* at most"):
            _service._output_bytes(Svc, "search", np.zeros((_service.MAX_OUTPUT // (12 * len(corpus)) + 1, 1, DIM),
                                                           np.float32), 4000)
        # Outputs sent as JSON values are bounded by what writing them takes; what is held is their arrays.
        assert _service._output_bytes(Svc, "score", q, None, ("SCORES",)) == 3 * len(corpus) * 4
        assert _service._output_bytes(Svc, "search", q, 10, ("IDS",)) == 3 * 10 * 12
        json_big = np.zeros((_service.MAX_OUTPUT // (_service.JSON_VALUE_BYTES * len(corpus)) + 1, 1, DIM), np.float32)
        assert _service._output_bytes(Svc, "score", json_big, None) == json_big.shape[0] * len(corpus) * 4
        with pytest.raises(ValueError, match=f"queries of {len(corpus)} documents' scores take .* bytes to write as "
                                             f"JSON; at most {_service.MAX_OUTPUT} a request"):
            _service._output_bytes(Svc, "score", json_big, None, ("SCORES",))
    finally:
        Svc.batcher.close()


def test_json_outputs_take_at_most_what_the_limit_counts_to_write(rng):
    """A JSON response's values are written through Python objects and text: a score of 1 GiB of
    outputs (the limit) sent as JSON took about 20 GiB. The limit counts JSON_VALUE_BYTES a value."""
    import tracemalloc

    from lik_cupy.serving import _service, _tensors

    n = 200_000  # (json's encoder joins its text every 100,000 values: a few MB more below that)
    scores = rng.standard_normal(n).astype(np.float32) * np.float32(1e-30)  # (the longest text: 1.2345678e-30)
    for outputs in ([("SCORES", scores)], [("SCORES", scores), ("IDS", rng.integers(-2**63, 2**63 - 1, n))]):
        tracemalloc.start()
        try:
            _tensors.write_response({"model_name": "search", "model_version": "1"}, outputs, set())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= n * len(outputs) * _service.JSON_VALUE_BYTES, (peak / (n * len(outputs)), outputs[-1][0])


def test_string_ids_are_counted_as_what_writing_them_takes(rng):
    """Search's string ids are written element by element, as BYTES or JSON: a search of 21,846
    one-token queries for 4,096 ids each passed the 1 GiB limit at 8 bytes an id, and ids of 64
    characters take about 400 bytes each to write."""
    import tracemalloc

    from lik_cupy.serving import _service, _tensors

    n = 200_000
    for ids in (np.array([f"d{i:03d}"[:4] for i in range(n)]), np.array([f"doc-{i:060d}" for i in range(n)]),
                np.array([f"d{i:013d}" for i in range(n)], dtype="S14")):
        svc = types.SimpleNamespace(ids=IdIndex(ids, n), batcher=types.SimpleNamespace(corpus=ids))  # (n documents)
        for as_json in (False, True):
            size, write = _service._value_bytes(svc, "IDS", as_json)
            assert size == ids.dtype.itemsize
            tracemalloc.start()
            try:
                _tensors.write_response({"model_name": "search"}, [("IDS", ids)], set() if as_json else {"IDS"})
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak <= n * write, (peak / n, ids.dtype, as_json)
        k, write = 4096, _service._value_bytes(svc, "IDS", False)[1]
        fits = _service.MAX_OUTPUT // (k * (4 + write))
        assert _service._output_bytes(svc, "search", np.zeros((fits, 1, DIM), np.float32), k) == \
            fits * k * (4 + ids.dtype.itemsize)
        with pytest.raises(ValueError, match=f"{fits + 1} queries of {k} results .* to write; at most"):
            _service._output_bytes(svc, "search", np.zeros((fits + 1, 1, DIM), np.float32), k)


def test_json_outputs_past_the_limit_are_refused_before_they_are_scored(served):
    from lik_cupy.serving import _service

    nq = _service.MAX_OUTPUT // (_service.JSON_VALUE_BYTES * 200) + 1  # (the served corpus has 200 documents)
    body, length = _binary_body([("Q", np.zeros((nq, 1, DIM), np.float32), "FP32")])
    status, _, answer = served.infer("score", body, {"Inference-Header-Content-Length": length})
    assert status == 400, answer[:200]
    assert re.search(r"take \d+ bytes to write as JSON; at most 1073741824 a request .*binary_data_output",
                     json.loads(answer)["error"]), answer


@pytest.mark.parametrize("partition", [False, True], ids=["replica", "partition"])
def test_bench_serve_smoke_run(tmp_path, partition):
    for m in ("starlette", "uvicorn", "prometheus_client"):
        pytest.importorskip(m)
    script = ROOT / "bench" / "suites" / "bench_serve.py"
    subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)] + ["--partition"] * partition,
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    res = json.loads((tmp_path / "serve_cpu.json").read_text())
    assert res["args"]["partition"] is partition and res["args"]["devices"] == ("cpu,cpu" if partition else "cpu")
    assert res["gpu"] == "cpu" and [w["workload"] for w in res["workloads"]] == ["search", "rerank"]
    for w in res["workloads"]:
        assert w["inprocess_qps"] > 0 and set(w["servers"]) == {"batched", "unbatched"}
        for server in w["servers"].values():
            assert [r["clients"] for r in server["closed"]] == [1, 4]
            assert all(r["qps"] > 0 and r["errors"] == 0 and r["histogram"] for r in server["closed"])
        assert all(r["mean_batch"] == 1 for r in w["servers"]["unbatched"]["closed"])


def test_a_request_expired_in_the_queue_then_given_up_is_rejected_once():
    """The worker expires a request (counted rejected, deadline) and its transport gives up on it
    before the event loop has seen that (grpcio's deadline cancels the task): it was counted twice."""
    import asyncio
    import time

    from prometheus_client import generate_latest

    from lik_cupy.serving import _service

    rng = np.random.default_rng(0)
    tokens = rng.standard_normal((100, 16)).astype(np.float32)

    class Slow(lik_cupy.Corpus):
        def score(self, *a, **k):
            time.sleep(0.4 if k.get("q_offsets") is not None else 0)  # (the batcher's call, not the one per group)
            return super().score(*a, **k)

    corpus = Slow(tokens, d_offsets=np.arange(0, 101, 5), device="cpu")
    svc = _service.Service(lambda observer: Batcher(corpus, max_batch=1, observer=observer))
    svc.start()
    deadline = time.monotonic() + 30
    while not svc.ready and time.monotonic() < deadline:
        time.sleep(0.02)
    q = {"Q": np.ones((2, 16), np.float32)}

    async def main():
        # holds the worker 0.4 s (submitted from a thread: a request alone on the loop would be scored on it)
        busy = asyncio.get_running_loop().run_in_executor(None, svc.batcher.score, q["Q"])
        await asyncio.sleep(0.05)

        async def handler():  # as the gRPC transport's: a call with 50 ms of its deadline left
            start = time.perf_counter()
            try:
                await _service.infer(svc, "score", q, {}, deadline_s=0.05)
            except asyncio.CancelledError:
                _service.abandoned(svc, "score", start, expired=True)
                raise

        late = asyncio.create_task(handler())
        await asyncio.sleep(0.01)
        time.sleep(0.6)  # the loop is busy while the worker expires `late`
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        await busy

    asyncio.run(main())
    text = generate_latest(svc.metrics.registry).decode()
    rejected = [line for line in text.splitlines() if line.startswith("lik_serve_rejected_total{")]
    assert rejected == ['lik_serve_rejected_total{model="score",reason="deadline"} 1.0'], rejected
    svc.batcher.close()


def test_a_disconnect_is_taken_back_as_the_watcher_cancellation_it_was():
    """The HTTP handler's watch cancels its task when the client goes away and raises _Disconnected
    instead; the task's count of cancellations (Python 3.11+) must be back at 0, and a cancellation
    from elsewhere must still be one."""
    import asyncio

    from lik_cupy.serving import http

    def gone(callback):  # (the connection's extension LOST, of a connection lost already)
        if callback is not None:
            asyncio.get_running_loop().call_soon(callback)

    def never(callback):
        pass

    async def queued(watch):
        watch()
        await asyncio.sleep(10)

    async def disconnected():
        with pytest.raises(http._Disconnected):
            await http._unless_disconnected(queued, gone)
        task = asyncio.current_task()
        return task.cancelling() if hasattr(task, "cancelling") else 0

    assert asyncio.run(disconnected()) == 0

    async def cancelled_from_outside():
        inner = asyncio.create_task(http._unless_disconnected(queued, never))
        await asyncio.sleep(0.01)
        inner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await inner

    asyncio.run(cancelled_from_outside())

    # A request scored without waiting (no watch()) never watches the connection.
    watches = []

    def counted(callback):
        watches.append(callback)
        gone(callback)

    async def at_once(watch):
        await asyncio.sleep(0)
        return "answer"

    assert asyncio.run(http._unless_disconnected(at_once, counted)) == "answer"
    assert watches == [None]


def test_serve_opens_each_shard_once(split_shards_dir, monkeypatch):
    """lik serve opened each shard before listening, then again as it loaded the corpus (and again
    for each replica or part: each Corpus.from_shards opened them); the load now reads the shards
    opened then."""
    from lik_cupy.serving import http

    paths, _ = split_shards_dir
    whole = lik_cupy.Corpus.from_shards(paths, device="cpu")
    opened, batchers = [], []
    open_input = shards.open_input
    monkeypatch.setattr(shards, "open_input", lambda p, *a, **k: opened.append(str(p)) or open_input(p, *a, **k))
    monkeypatch.setattr(http, "run", lambda app, **kw: batchers.append(app.state.service.load(Observer())))
    for devices, partition in ((["cpu"], None), (["cpu", "cpu"], True)):
        opened.clear()
        http.serve(paths, devices=devices, partition=partition)
        assert opened == [str(p) for p in paths]
        q = np.random.default_rng(16).standard_normal((5, DIM)).astype(np.float32)
        with batchers.pop() as b:
            assert np.array_equal(b.score(q), whole.score(q))
