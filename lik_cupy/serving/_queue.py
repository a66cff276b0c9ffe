"""One device's bounded queue and the worker thread that batches it: the MaxSim-specific part of
serving.

The worker sleeps until a request arrives. When it is free it takes what is queued (after waiting up
to ``max_delay_s`` from the oldest request's arrival for more, unless ``max_batch`` queries are
already there): the oldest request's group (operation, k or candidate count, precision, query
dtype, query length class: up to 32, 64 or 128 tokens, then whole blocks of 128) and every later
request of that group that fits, in arrival order, capped by queries and by padded query tokens
(queries x the longest of them: the kernels read queries padded to the longest, so that is the
work). The batch goes to the corpus in one call: on a GPU, moved in one copy each way
(``_staging.py``); in host memory, its queries packed back to back with ``q_offsets``. Each request
gets copies of its own rows. Scores do not depend on the other queries of a call, so each result
is bitwise the unbatched call's (on the GPU, search and score of several short queries excepted:
docs/serving.md).

A request with a deadline is also entered in the queue's timer (a heap of deadlines, and one thread
per queue, started by the first such request): when its deadline passes while it still waits, the
timer takes it out of the queue and answers it (:class:`DeadlineExceeded`) then, whether or not the
worker is busy with a batch. The worker and the timer take requests out of the queue under one lock,
so a request is either batched or expired, never both; one whose deadline the worker finds passed
before the timer has woken is expired by the worker. Requests without a deadline never meet the
timer.

A request can also be scored at once in the thread that submits it (:meth:`DeviceQueue.score_now`),
where the replica is idle with nothing queued and ``max_delay_s`` is 0, and the operation's last call
of one request took at most ``INLINE_MAX_S``: the same call as a batch of one, on the worker's stream
and buffers, while the worker waits. It skips the hand-over to the worker thread and back, which a
request alone on the server would otherwise pay.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import logging
import math
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import numpy as np

from ._partition import Partition
from ._staging import Staging, stageable
from .errors import DeadlineExceeded, ShuttingDown

# score_now takes operations whose last call of one request took at most this, and longer ones only
# where the caller says it is quiet. The hand-over it saves is about 0.2 ms on an H200 host (a rerank
# of 1,000 ids: 0.59-0.64 ms from a client at low load, against 0.77-0.83 through the worker); a
# longer call holds the submitting thread (the server's event loop, which parses every request) for
# longer than it saves, which costs only where other requests arrive meanwhile: a search of 100,000
# documents takes about 1.2 ms.
INLINE_MAX_S = 0.5e-3
# The longest single wait of the worker and the timer: they wait in steps of at most this, then look
# again. A thread's wait takes at most threading.TIMEOUT_MAX (about 292 years) and raises
# OverflowError past it, which a deadline or max_delay that far off (an HTTP timeout of 1e16 us)
# reached, killing the thread.
_MAX_WAIT_S = 3600.0


@dataclass(frozen=True)
class Timing:
    """Where a scored request's time went: ``queue_s`` waiting, ``compute_s`` in its batched corpus
    call, which held ``batch_queries`` queries (set as its future's ``timing``)."""

    queue_s: float
    compute_s: float
    batch_queries: int


@dataclass(eq=False)
class Request:
    """One caller's queries ``Q`` [n, lq, d] (host, contiguous) and what to do with them."""

    op: str  # "search", "rerank" or "score"
    Q: np.ndarray
    arg: object  # search: k; rerank: int64 candidates [n, K]; score: None
    precision: str | None
    squeeze: bool  # one query given as [lq, d]: its rows come back without the query axis
    deadline: float | None  # time.monotonic() seconds
    future: Future
    arrival: float
    timer: int | None = None  # its key in its queue's timer while it waits there with a deadline

    @property
    def n(self) -> int:
        return self.Q.shape[0]

    @property
    def lq(self) -> int:
        return self.Q.shape[1]

    @property
    def tokens(self) -> int:
        return self.Q.shape[0] * self.Q.shape[1]

    @property
    def group(self) -> tuple:
        """Requests of one group can share a call."""
        width = self.arg if self.op == "search" else self.arg.shape[1] if self.op == "rerank" else 0
        return self.op, width, self.precision, self.Q.dtype.str, _length_class(self.lq)


class DeviceQueue:
    """The bounded queue of one corpus replica and its worker thread (see the module docstring)."""

    def __init__(self, corpus, name: str, *, max_batch: int, max_tokens: int, max_delay_s: float, max_queue: int,
                 observer):
        self.corpus, self.name = corpus, name
        self._max_batch, self._max_tokens, self._max_delay = max_batch, max_tokens, max_delay_s
        self._max_queue, self._observer = max_queue, observer
        self._pending: collections.deque[Request] = collections.deque()
        lock = threading.RLock()
        self._cv = threading.Condition(lock)  # the worker waits on it
        # The timer (_expire_due): the deadlines of waiting requests (a heap of (deadline, key), with
        # entries left behind by requests taken before their deadlines), the requests by key, and
        # when its thread wakes next (-inf: it is awake and looks again before it sleeps).
        self._timer = threading.Condition(lock)
        self._deadlines: list[tuple[float, int]] = []
        self._timed: dict[int, Request] = {}
        self._keys = 0
        self._wake = math.inf
        self._timer_thread: threading.Thread | None = None
        self._queued = 0  # queries waiting
        # Query tokens (a request's queries x its query length) waiting and being scored (by the worker or
        # by score_now): the routing load. Counted in queries, one request of a million tokens weighed
        # as one query, and with two replicas every other concurrent request queued behind its long call
        # while the other replica idled.
        self._queued_tokens = 0
        self._running = 0  # (tokens being scored)
        self._busy = False  # the worker is scoring a batch (of queries or not: a request may hold none)
        self._closing = False
        self._now = False  # a request is being scored by score_now, in the thread that submitted it
        self._staging = Staging()  # used by the worker, or by score_now while the worker waits
        self._stream = None  # the worker's CUDA stream, once it has made it (None: host memory)
        self._single_s: dict[str, float] = {}  # the last call of one request's time, per operation
        self._thread = threading.Thread(target=self._work, name=f"lik-serve-{name}", daemon=True)
        self._thread.start()

    @property
    def load(self) -> int:
        """Query tokens waiting or being scored (read without the lock: a routing hint)."""
        return self._queued_tokens + self._running

    @property
    def depth(self) -> int:
        """Requests waiting."""
        return len(self._pending)

    def can_score_now(self, op: str, quiet: bool = False) -> bool:
        """Nothing queued or being scored, no delay to wait for companions, and ``op``'s last call of one
        request took at most ``INLINE_MAX_S``, or took longer but ``quiet`` (the caller has seen no
        concurrent requests lately). Read without the lock: a hint; :meth:`score_now` decides under it."""
        return not (self._pending or self._busy or self._now or self._max_delay > 0) \
            and (quiet or self._single_s.get(op, 0.0) <= INLINE_MAX_S)

    def score_now(self, req: Request, quiet: bool = False) -> bool:
        """Score ``req`` in the calling thread if :meth:`can_score_now` (its future is then done), on the
        worker's stream and buffers while the worker waits; False, doing nothing, otherwise."""
        with self._cv:
            if self._closing or not self.can_score_now(req.op, quiet) \
                    or (self.corpus.device is not None and self._stream is None):
                return False
            self._now, self._running = True, req.tokens
        try:
            req.future.set_running_or_notify_cancel()
            with self.own_stream(self._stream):
                self._run([req])
        finally:
            with self._cv:
                self._now, self._running = False, 0
                self._cv.notify_all()
        return True

    def put(self, req: Request) -> bool:
        """Queue ``req``; False when the queue is full."""
        with self._cv:
            if self._closing:
                raise ShuttingDown("the batcher is shutting down and takes no new requests")
            if len(self._pending) >= self._max_queue:
                return False
            self._pending.append(req)
            self._queued += req.n
            self._queued_tokens += req.tokens
            if req.deadline is not None:
                self._time(req)
            self._cv.notify()
            # (the future only: a callback holding the request would tie the two in a cycle, and the
            # answer the future holds would wait for the garbage collector's pass once sent)
            req.future.add_done_callback(self._cancelled)
        return True

    def _cancelled(self, future: Future) -> None:
        """A queued request its caller cancelled (the client went away) leaves the queue at once: it
        no longer holds a place, nor counts towards a batch the worker waits to fill. (Called as the
        future completes, in the completing thread, outside the future's lock; a request the worker
        has taken meanwhile is dropped there, or is being scored: nothing to do.)"""
        if not future.cancelled():
            return
        with self._cv:
            gone = [r for r in self._pending if r.future is future]
            if gone:
                self._remove(gone)

    def _remove(self, requests: list[Request]) -> None:
        """Take ``requests``, each waiting in the queue, out of it: the deque, the queries counted and
        the timer (under the lock)."""
        gone = set(requests)
        self._pending = collections.deque(r for r in self._pending if r not in gone)
        self._queued -= sum(r.n for r in requests)
        self._queued_tokens -= sum(r.tokens for r in requests)
        for r in requests:
            self._untime(r)

    def close(self) -> None:
        """Take no more requests; the worker answers those queued, then ends (and so does the timer)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            self._timer.notify_all()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._timer_thread is not None:
            self._timer_thread.join(timeout)

    # ------------------------------------------------------------ the timer

    def _time(self, req: Request) -> None:
        """Enter queued ``req``'s deadline in the timer (under the lock)."""
        self._keys += 1
        req.timer = self._keys
        self._timed[self._keys] = req
        heapq.heappush(self._deadlines, (req.deadline, self._keys))
        if len(self._deadlines) > 2 * len(self._timed) + 64:  # mostly requests taken before their deadlines
            self._deadlines = [(r.deadline, key) for key, r in self._timed.items()]
            heapq.heapify(self._deadlines)
        if self._timer_thread is None:
            thread = threading.Thread(target=self._expire_due, name=f"lik-serve-{self.name}-timer", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # (no thread to be had: the worker expires what it takes, the next deadline retries)
                _log.exception("lik serve: queue %s could not start its timer thread", self.name)
            else:
                self._timer_thread = thread
        elif req.deadline < self._wake:
            self._timer.notify()

    def _untime(self, req: Request) -> None:
        """``req`` leaves the queue: out of the timer too (under the lock)."""
        if req.timer is not None:
            del self._timed[req.timer]
            req.timer = None

    def _expire_due(self) -> None:
        """The timer thread: sleeps until the next deadline of a waiting request, takes each request
        whose deadline has passed out of the queue and answers it; ends once the queue is closed and
        drained."""
        while True:
            with self._cv:
                while True:
                    now = time.monotonic()
                    expired = self._due(now)
                    if expired:
                        break
                    if self._closing and not self._pending:
                        return
                    self._wake = self._deadlines[0][0] if self._deadlines else math.inf
                    self._timer.wait(None if self._wake == math.inf else min(self._wake - now, _MAX_WAIT_S))
                self._wake = -math.inf
            self._expired(expired)

    def _due(self, now: float) -> list[Request]:
        """The waiting requests whose deadlines have passed by ``now``, taken out of the queue (under
        the lock)."""
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            r = self._timed.pop(heapq.heappop(self._deadlines)[1], None)
            if r is not None:  # (else it left the queue before its deadline)
                r.timer = None
                due.append(r)
        while self._deadlines and self._deadlines[0][1] not in self._timed:  # so as to sleep until a live one
            heapq.heappop(self._deadlines)
        if due:
            self._remove(due)
        return due

    def _expired(self, requests: list[Request]) -> None:
        """Answer ``requests``, taken out of the queue past their deadlines, with DeadlineExceeded
        (outside the lock), each counted rejected once: a request its caller cancelled first was
        counted by the caller (the server's transports), and is only dropped."""
        for r in requests:
            try:
                r.future.set_exception(DeadlineExceeded(f"the request's deadline passed after "
                                                        f"{time.monotonic() - r.arrival:.3f} s in the queue"))
            except InvalidStateError:  # cancelled a moment ago
                r.future.set_running_or_notify_cancel()  # (for concurrent.futures.wait's waiters)
                continue
            _observed(self._observer.rejected, r.op, "deadline")

    # ------------------------------------------------------------ the worker

    def _work(self) -> None:
        """The worker thread: :meth:`_serve` on the replica's device, in a stream of its own."""
        try:
            stream = self.own_stream()
            stream.__enter__()
            if self.corpus.device is not None:
                import cupy

                self._stream = cupy.cuda.get_current_stream()
        except Exception:  # noqa: BLE001 - the calls will say what is wrong with the device; a dead worker would hang them
            _log.exception("lik serve: worker %s has no stream of its own", self.name)
            stream = contextlib.nullcontext()
        try:
            self._serve()
        finally:
            stream.__exit__(None, None, None)

    def _serve(self) -> None:
        """Batches until the queue is closed and drained; whatever fails, each caller gets an answer."""
        while True:
            batch, expired = self._next()
            self._expired(expired)
            if batch is None:
                return
            if not batch:  # (only expired or cancelled requests: score_now may hold the replica by now)
                continue
            try:
                self._run(batch)
            except BaseException as e:  # noqa: BLE001 - the worker must live on, and every caller get an answer
                _log.exception("lik serve: worker %s failed a batch", self.name)
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
            batch = expired = None  # (not held, with their answers, while the worker waits for the next)
            with self._cv:
                self._running, self._busy = 0, False

    def own_stream(self, stream=None):
        """On a GPU, the corpus's device and a stream of this worker's own for its calls, so that
        workers sharing a GPU overlap (nothing on the host path); ``stream``: that one instead of a
        new one (:meth:`score_now` takes the worker's)."""
        if self.corpus.device is None:
            return contextlib.nullcontext()
        import cupy

        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(self.corpus.device))
        stack.enter_context(cupy.cuda.Stream(non_blocking=True) if stream is None else stream)
        return stack

    def _next(self) -> tuple[list[Request] | None, list[Request]]:
        """(the next batch, possibly empty when only expired or cancelled requests were queued, or
        None once closed and drained; the requests whose deadline passed)."""
        with self._cv:
            while True:
                while (not self._pending and not self._closing) or self._now:  # (score_now holds the buffers)
                    self._cv.wait()
                if not self._pending:
                    self._timer.notify()  # (closed and drained: the timer ends too)
                    return None, []
                if self._max_delay > 0:  # (from the oldest waiting: the timer may take requests meanwhile)
                    while self._pending and not self._closing and self._queued < self._max_batch:
                        left = self._pending[0].arrival + self._max_delay - time.monotonic()
                        if left <= 0:
                            break
                        self._cv.wait(min(left, _MAX_WAIT_S))
                    if not self._pending:
                        continue
                batch, expired = self._take()
                if batch:  # (its queries may number 0: _busy, not _running, says the replica is taken)
                    self._running, self._busy = sum(r.tokens for r in batch), True
                return batch, expired

    def _take(self) -> tuple[list[Request], list[Request]]:
        """The oldest live request's group, in arrival order, within the caps, and the requests
        whose deadlines passed before the timer took them, each out of the queue (under the lock)."""
        now = time.monotonic()
        batch, expired, keep = [], [], collections.deque()
        group, n, lq = None, 0, 0
        while self._pending:
            r = self._pending.popleft()
            if r.deadline is not None and r.deadline <= now:
                expired.append(r)  # (answered by _expired, which tells a cancelled one)
            elif group is not None and not (r.group == group and n + r.n <= self._max_batch
                                            and (n + r.n) * max(lq, r.lq) <= self._max_tokens):
                keep.append(r)
                continue
            elif r.future.set_running_or_notify_cancel():  # (False: cancelled by its caller: dropped)
                group, n, lq = r.group, n + r.n, max(lq, r.lq)
                batch.append(r)
            self._untime(r)
            self._queued -= r.n
            self._queued_tokens -= r.tokens
            if n >= self._max_batch:
                break
        keep.extend(self._pending)
        self._pending = keep
        return batch, expired

    def _run(self, batch: list[Request]) -> None:
        start = time.monotonic()
        try:
            results = scored(self.corpus, batch, self._staging)
        except Exception as e:  # noqa: BLE001 - handed to the callers
            if len(batch) == 1 or isinstance(e, _NOT_THE_REQUESTS):
                results = [e] * len(batch)
            else:  # one request at fault must not fail the others: each alone
                results = []
                for r in batch:
                    try:
                        results.append(scored(self.corpus, [r], self._staging)[0])
                    except Exception as e1:  # noqa: BLE001
                        results.append(e1)
        done = time.monotonic()
        if len(batch) == 1:
            self._single_s[batch[0].op] = done - start
        _observed(self._observer.batch, self.name, batch[0].op, len(batch), sum(r.n for r in batch), done - start)
        queries = sum(r.n for r in batch)
        for r, res in zip(batch, results):
            r.future.timing = Timing(start - r.arrival, done - start, queries)
            if isinstance(res, BaseException):
                r.future.set_exception(res)
            else:
                r.future.set_result(res)
            _observed(self._observer.answered, self.name, r.op, start - r.arrival, done - start)


_log = logging.getLogger("lik_cupy.serving")
# A batch's failure that no request of it caused: the replica did not answer in time or cannot be
# reached (a Dask cluster's TimeoutError, a lost scheduler). Each request alone would meet it again,
# a batch of n then waiting n + 1 timeouts, so the whole batch fails with it at once.
_NOT_THE_REQUESTS = (TimeoutError, ConnectionError)


def _observed(call, *args) -> None:
    """An observer's callback; what it raises is logged, and the worker goes on."""
    try:
        call(*args)
    except Exception:  # noqa: BLE001
        _log.exception("lik serve: an observer's %s failed", getattr(call, "__name__", "callback"))


def _length_class(lq: int) -> int:
    """Queries padded to the longest of their class take the kernel tile of their own length (the
    forward kernels' query tiles are sized for up to 32, 64 or 128 tokens, longer queries cut in
    blocks of 128), and padding stays under twice the tokens."""
    return 32 if lq <= 32 else 64 if lq <= 64 else 128 * -(-lq // 128)


def scored(corpus, batch: list[Request], staging: Staging) -> list:
    """One corpus call for ``batch`` (one group), split into each request's result. On a GPU the
    batch moves in one copy each way (``_staging.py``); elsewhere its queries go packed, with
    ``q_offsets``."""
    first = batch[0]
    if stageable(corpus, first.Q.dtype):
        out = staging.call(corpus, first.op, batch, first.precision)
    elif isinstance(corpus, Partition) and corpus.stageable(first.Q.dtype):
        out = corpus.staged(first.op, batch, first.precision)
    else:
        tokens = np.concatenate([r.Q.reshape(-1, r.Q.shape[2]) for r in batch]) if len(batch) > 1 else \
            first.Q.reshape(-1, first.Q.shape[2])
        lengths = np.repeat([r.lq for r in batch], [r.n for r in batch])
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if first.op == "search":
            out = corpus.search(tokens, first.arg, q_offsets=offsets, precision=first.precision)
        elif first.op == "rerank":
            cand = np.concatenate([r.arg for r in batch]) if len(batch) > 1 else first.arg
            out = (corpus.rerank(tokens, cand, q_offsets=offsets, precision=first.precision),)
        else:
            out = (corpus.score(tokens, q_offsets=offsets, precision=first.precision),)
    results, at = [], 0
    for r in batch:
        rows = tuple(np.array(a[at] if r.squeeze else a[at:at + r.n]) for a in out)  # its own copy
        results.append(rows if first.op == "search" else rows[0])
        at += r.n
    return results
