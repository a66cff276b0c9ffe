"""One server's state and its inference step, apart from the transport: HTTP (``http.py``) and gRPC
(``grpc.py``) decode a request into named NumPy inputs and parameters, call :func:`infer`, and
encode what it returns or the :class:`Refused` it raises.

:class:`Refused` carries the HTTP status of the outcome (400 a bad request, 404 an unknown model or
version, 408 its body too slow to arrive, 413 too large, 503 overloaded / not ready / stopping /
its cluster's scheduler lost, 504 deadline passed in the queue or the corpus's cluster did not answer
within its timeout, 500 the corpus call failed) and its reason (:data:`REASONS`); the gRPC transport
maps it to a status code, and the metrics count it by that status and reason whichever transport
answered (:func:`refused`). A request its transport gives up on (its task cancelled:
the client went away, or a gRPC deadline passed) is dropped from the queue if still there, and
counted by :func:`abandoned`. A request whose deadline passes while it is queued is answered 504 at
that deadline, by the batcher's timer, even while the worker is busy with a batch.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._dispatch.elements import scaled_dtype
from . import _tensors
from ._ids import IdIndex
from ._metrics import Metrics
from .batcher import OPERATIONS, Batcher
from .errors import DeadlineExceeded, Overloaded, ShuttingDown

MODELS = OPERATIONS
VERSIONS = ("1",)  # every model's versions
OUTPUTS = {"search": ("SCORES", "IDS"), "rerank": ("SCORES",), "score": ("SCORES",)}
INPUTS = {"search": ("Q", "K"), "rerank": ("Q", "IDS"), "score": ("Q",)}
MAX_BODY = 64 << 20
# Set in the task of a request the batcher expired (and counted rejected) just before its transport
# gave up on it: abandoned() then counts the response only, not a second reject.
_expired_in_queue = contextvars.ContextVar("lik_serve_expired_in_queue", default=False)
# A request's outputs at most, in bytes: a query costs its tokens' bytes to send, but a score
# answers it with a float for every document.
MAX_OUTPUT = 1 << 30
# What writing one output value as JSON takes at its peak (its Python object, its place in a list,
# its text: about 80 bytes for a score or an integer id), counted against MAX_OUTPUT for outputs
# sent as JSON: the JSON answer of a score of 1 GiB of outputs took about 20 GiB.
JSON_VALUE_BYTES = 96
_VALUE_BYTES = {"SCORES": 4, "IDS": 8}  # an output's values in its array (string ids: their width)
# What writing one string id takes at its peak beside its array, as BYTES or as JSON (its Python
# objects and their parts): about 260 bytes and 2 a character as BYTES, 75 and 3 a character as JSON.
STRING_ID_BYTES, STRING_ID_CHAR_BYTES = 288, 3
# Request bytes one server holds at once (bodies being read, inflated and queued), as a multiple of
# its body limit: past it, requests are refused with 503 and Retry-After until some are answered.
HELD_BODIES = 16
# A request whose parse (and inflating) takes more than this many bytes of work (JSON text, BYTES
# elements, gRPC's typed values), or an answer that writes more than INLINE_WRITE_VALUES a Python
# step each (JSON values, BYTES elements), is read or written on the server's parse thread
# (off_loop), the event loop serving the others meanwhile; smaller ones on the event loop, sparing
# them the hand-over there and back (about 0.1 ms). At these sizes the work takes about 1 ms, so a
# request done inline holds the other clients that long at most, and the hand-over costs one done
# off the loop under a tenth of its work.
INLINE_PARSE_BYTES = 64 << 10
INLINE_WRITE_VALUES = 2048
# A request arriving while no other is in flight may be scored on the event loop however long its
# call (a search of 100,000 documents: about 1.2 ms on an H200), sparing it the hand-over to the
# worker and back, where lately at most QUIET_SHARE of the arrivals found another request in flight
# (an exponential average over about QUIET_ARRIVALS arrivals). One client at a time never finds
# one; under Poisson arrivals the share is about the rate times a request's time in the server, so a
# server stays quiet below about 30 searches a second, where a request that arrives during such a
# call (1 in 20 at most) waits it out before it is read. A burst ends it within two arrivals.
QUIET_SHARE = 0.05
QUIET_ARRIVALS = 32
# How slowly a client may send a request (lik serve --header-timeout, --body-timeout,
# --body-min-rate): its headers within HEADER_TIMEOUT_S; its body with no gap longer than
# BODY_TIMEOUT_S and, once it has taken that long, at BODY_MIN_RATE bytes a second on average. A
# body being read holds what has arrived of it against the budget, and a client that stopped
# sending held its share for as long as it stayed connected: 16 of them refused every other request.
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
BODY_MIN_RATE = 1 << 20
# The gRPC calls one connection may have at once (lik serve --grpc-max-streams; HTTP/2's
# SETTINGS_MAX_CONCURRENT_STREAMS): a client of the protocol keeps those over it waiting, and the
# server refuses any that one opens anyway. grpc core takes any number unless told, each holding a
# handler and what has arrived of its message. 100 is the least RFC 9113 recommends, and Kestrel's
# default; above --max-batch's default (64 queries a call), so that one client's calls can fill a batch.
GRPC_MAX_STREAMS = 100
# The HTTP connections, and the gRPC calls, one server process serves at once (lik serve
# --max-connections, --grpc-max-calls): over them a request is refused (503, RESOURCE_EXHAUSTED).
# uvicorn and grpcio take any number unless told, so connections times --grpc-max-streams was the
# only bound, each holding a task and its buffers. A queued request holds one of each, so a cap must
# admit a full queue: 8192 is --max-queue's default (1024) on each of eight workers, one per GPU of
# an eight-GPU host (lik serve takes more where its --max-queue and --devices queue more), and 32
# times the 256 clients of the load benchmark (bench/suites/bench_serve.py).
MAX_CONNECTIONS = GRPC_MAX_CALLS = 8192
# The model label of a gRPC call counted before its message, which names the model, had arrived (or
# one that named none): Prometheus reads an empty label as none.
UNNAMED = ""


# Why a request was refused or given up, as the metrics label it (lik_serve_rejected_total's
# ``reason``), and the HTTP status it is answered with (gRPC: the same outcome's); docs/serving.md
# lists them. A status that one reason alone gives is that reason's where a Refused names none.
REASONS = {
    "invalid": 400,          # a bad request (the error names the problem), or a gRPC call ended without a message
    "not_found": 404,        # an unknown model or version
    "too_large": 413,        # a body over the limit, or a request that alone takes more than the budget
    "header_timeout": 408,   # its line and headers did not all arrive within --header-timeout
    "body_timeout": 408,     # its body (gRPC: message) arrived too slowly (--body-timeout, --body-min-rate)
    "header_size": 431,      # its line and headers take over 64 KiB
    "overloaded": 503,       # every queue full
    "budget": 503,           # the server holds its limit of request bytes
    "not_ready": 503,        # loading, a peer process still loading, or a replica unreachable (--scheduler)
    "stopping": 503,         # the server is stopping
    "max_connections": 503,  # more HTTP connections open than --max-connections
    "max_calls": 503,        # as many gRPC calls in progress as --grpc-max-calls (RESOURCE_EXHAUSTED)
    "deadline": 504,         # its deadline passed in the queue (or, gRPC's, anywhere)
    "cluster_timeout": 504,  # the corpus's cluster did not answer within --cluster-timeout
    "error": 500,            # the corpus call failed, or the server did
    "cancelled": 499,        # its client went away before it was scored
    "answer_timeout": 200,   # answered, and dropped: its client took the answer too slowly
}
_STATUS_REASON = {400: "invalid", 404: "not_found", 413: "too_large", 500: "error"}


class Refused(Exception):
    """A request answered with an error: ``status`` is its HTTP status; ``retry``: the client may
    retry later (503 with ``Retry-After``); ``close``: the connection closes after the answer (the
    rest of the request is not read); ``reason``: why, as :data:`REASONS` names it (given where the
    status has several); ``counted``: the batcher has counted it rejected already."""

    def __init__(self, status: int, message: str, retry: bool = False, close: bool = False,
                 reason: str | None = None, counted: bool = False):
        super().__init__(message)
        self.status, self.retry, self.close, self.counted = status, retry, close, counted
        self.reason = _STATUS_REASON[status] if reason is None else reason


def check_limits(header_timeout: float, body_timeout: float, body_min_rate: int,
                 grpc_max_streams: int = GRPC_MAX_STREAMS, max_connections: int = MAX_CONNECTIONS,
                 grpc_max_calls: int = GRPC_MAX_CALLS) -> None:
    """ValueError naming a limit on how slowly a client may send a request, or how many gRPC calls
    one connection may have at once, or how many connections and calls the server serves at once,
    that is not one (:class:`Service`)."""
    for name, value in (("header_timeout", header_timeout), ("body_timeout", body_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if isinstance(body_min_rate, bool) or not isinstance(body_min_rate, int) or body_min_rate < 0:
        raise ValueError(f"body_min_rate must be an integer >= 0 (bytes a second; 0: any rate), got {body_min_rate!r}")
    if isinstance(grpc_max_streams, bool) or not isinstance(grpc_max_streams, int) \
            or not 1 <= grpc_max_streams < 2**31:  # (grpc core takes a C int)
        raise ValueError(f"grpc_max_streams must be an integer in [1, 2**31 - 1] (calls a connection may have at "
                         f"once), got {grpc_max_streams!r}")
    for name, value, what in (("max_connections", max_connections, "HTTP connections"),
                              ("grpc_max_calls", grpc_max_calls, "gRPC calls")):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31 - 1:
            raise ValueError(f"{name} must be an integer in [1, 2**31 - 2] ({what} the server serves at once), "
                             f"got {value!r}")


class Service:
    """One server's state: the batcher (once loaded and warm), the id index, the metrics.
    ``load(observer)`` returns the :class:`Batcher`; :meth:`start` runs it in a thread. A ``load``
    with a ``cancel()`` method (``lik serve --scheduler``'s) is cut short by :meth:`stop` while it
    runs: what it loaded is dropped before stop returns.
    ``header_timeout``, ``body_timeout`` (seconds) and ``body_min_rate`` (bytes a second, 0: none):
    how slowly a client may send a request (:data:`HEADER_TIMEOUT_S`); ``grpc_max_streams``: the
    gRPC calls one connection may have at once (:data:`GRPC_MAX_STREAMS`); ``max_connections``,
    ``grpc_max_calls``: the HTTP connections and gRPC calls it serves at once (:data:`MAX_CONNECTIONS`)."""

    def __init__(self, load, max_body_bytes: int = MAX_BODY, peers=None, header_timeout: float = HEADER_TIMEOUT_S,
                 body_timeout: float = BODY_TIMEOUT_S, body_min_rate: int = BODY_MIN_RATE,
                 grpc_max_streams: int = GRPC_MAX_STREAMS, max_connections: int = MAX_CONNECTIONS,
                 grpc_max_calls: int = GRPC_MAX_CALLS):
        check_limits(header_timeout, body_timeout, body_min_rate, grpc_max_streams, max_connections, grpc_max_calls)
        self.load, self.max_body = load, max_body_bytes
        self.header_timeout, self.body_timeout, self.body_min_rate = header_timeout, body_timeout, body_min_rate
        self.grpc_max_streams, self.max_connections, self.grpc_max_calls = grpc_max_streams, max_connections, \
            grpc_max_calls
        self.batcher: Batcher | None = None
        self.ids: IdIndex | None = None
        self._ready = False
        self._peers = peers  # (a shared count of the processes that are ready, how many there are), or None
        self.failure: BaseException | None = None
        self.on_failure = None  # called (from the loading thread) when loading fails
        self.metrics = Metrics(lambda: self.batcher)
        self.accepted = self.answered = self.dropped = 0  # requests queued; answered; given up unanswered
        self.arriving = 0  # requests on the event loop deciding whether they are alone (infer)
        self.company = 0.0  # the share of recent arrivals that found another request in flight (infer)
        # Whether a request alone is scored on the event loop's thread (infer): where every replica is
        # on a GPU. On the host path that thread, the process's main one, took 1.6x a worker's time
        # for a small rerank on a 2-core machine (glibc gives the main heap's freed memory back after
        # every call).
        self.inline = False
        self._count = threading.Lock()
        self.held, self.max_held = 0, HELD_BODIES * max_body_bytes  # request bytes held (hold, release)
        # One thread reads the large requests and writes the large answers (off_loop), one at a time
        # as the event loop did: the GIL lets no two run at once anyway, and a parse holds several
        # times its body in Python objects while it runs. (It starts with the first large request.)
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="lik-serve-parse")
        self.reading: set = set()  # the BodyClocks of requests waiting for more of their bodies (gRPC: messages)
        self.stopping = False  # the server stops: a request still to read its body (gRPC: message) is refused
        # gRPC calls whose message has arrived, neither queued nor answered yet: as the server stops, its
        # queues close once there are none (all_queued). uvicorn waits for HTTP's requests itself.
        self.unqueued = 0
        self.grpc_calls = 0  # gRPC calls in progress, until each has ended (answer sent): --grpc-max-calls
        self._stopped = False  # stop() was called: a load that ends after it closes what it made
        self._loading = threading.Lock()  # (stop() against the load's hand-over of its batcher, and its turning ready)
        self._cancel_load = None

    def start(self) -> None:
        self._cancel_load = getattr(self.load, "cancel", None)

        def run():
            try:
                b, self.load = self.load(self.metrics), None  # (nor what it holds: lik serve's shards, mapped)
                with self._loading:  # (handed over here, or stop() would find neither load nor batcher)
                    self._cancel_load = None
                    late = self._stopped
                    if not late:
                        self.ids = IdIndex(b.corpus.ids, len(b.corpus))
                        self.inline = all(d.startswith("cuda") for d in b.devices)
                        self.batcher = b
                if late:  # the server stopped while it loaded: it serves nothing
                    b.close()
                    return
                b.warm()
                with self._loading:  # (a server stopped while it warmed stays not ready)
                    if self._stopped:
                        return
                    self._ready = True
                if self._peers is not None:
                    with self._peers[0].get_lock():
                        self._peers[0].value += 1
                print(f"lik serve: ready: {b.corpus!r} on {', '.join(b.devices)}", file=sys.stderr, flush=True)
            except BaseException as e:  # noqa: BLE001 - the runner reports it once the server has stopped
                if not self._stopped:  # (else a load cut short by stop(), no failure)
                    self.fail(e)

        threading.Thread(target=run, name="lik-serve-load", daemon=True).start()

    @property
    def ready(self) -> bool:
        """This process's corpus is resident and warm, and so are its peers' (``lik serve --processes``):
        a client that sees ready may land on any of them; and every replica can be reached
        (:meth:`not_ready`)."""
        return self.not_ready() is None

    def not_ready(self) -> str | None:
        """Why the server is not ready (None: it is): loading, or stopping; or a replica it cannot
        reach now (``lik serve --scheduler``'s cluster, its scheduler lost: ``Batcher.unavailable``),
        which turns ready again as the replica comes back. Cheap: asked on every request."""
        if not self._ready or (self._peers is not None and self._peers[0].value < self._peers[1]):
            return "the server is not ready (loading the corpus, or stopping)"
        why = self.batcher.unavailable()
        return None if why is None else f"the server is not ready: {why}; retry later"

    def fail(self, error: BaseException) -> None:
        """Starting failed: remember why, and have the server stop."""
        self.failure = error
        if self.on_failure is not None:
            self.on_failure()

    def stop_reading(self) -> None:
        """Refuse (503) the requests whose bodies (or gRPC messages) have not all arrived, as the
        server begins to stop: it waits for every request, and a client that had sent part of a
        body and no more kept it from stopping for as long as it stayed connected."""
        self.stopping = True
        for clock in list(self.reading):
            clock.cancel(Refused(503, STOPPING, reason="stopping"))

    def stop(self) -> None:
        """Take no new requests and answer those queued (blocks until they are scored); a load still
        running is cancelled where it can be (``load.cancel()``), and what it made is closed."""
        with self._loading:  # (against the load's hand-over of its batcher, and its turning ready)
            self._ready, self._stopped = False, True
            cancel = self._cancel_load
        if cancel is not None:  # (the load's corpus dropped here, while the process can still reach it)
            cancel()
        if self.batcher is not None:
            self.batcher.close()

    def report(self) -> None:
        """The shutdown's last line, once every transport has sent its answers."""
        dropped = f"; {self.dropped} dropped, their clients gone or their deadlines passed" if self.dropped else ""
        print(f"lik serve: stopped; answered {self.answered} of {self.accepted} accepted requests{dropped}",
              file=sys.stderr, flush=True)

    def count(self, field: str) -> None:
        with self._count:
            setattr(self, field, getattr(self, field) + 1)

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` more of request data held in memory; :class:`Refused` (503) past the
        server's budget, counting nothing. Each hold is given back with :meth:`release`."""
        with self._count:
            if self.held + nbytes > self.max_held:
                raise Refused(503, f"the server holds {self.held} bytes of requests, its limit is {self.max_held}; "
                                   f"retry later", retry=True, reason="budget")
            self.held += nbytes

    def keep(self, nbytes: int) -> None:
        """Count ``nbytes`` more held, past the budget too: what is already in memory and only waits
        for its client (an answer being sent). Given back with :meth:`release`."""
        with self._count:
            self.held += nbytes

    def release(self, nbytes: int) -> None:
        with self._count:
            self.held -= nbytes

    def grpc_call_ended(self, context) -> None:
        """A gRPC call counted in :attr:`grpc_calls` has ended (grpcio's done callback: from the event loop)."""
        self.grpc_calls -= 1


class Held:
    """The bytes of one request held against the server's budget (:meth:`Service.hold`), given back
    by :meth:`release` (what both transports hold of a request): at once, or, while the parse thread
    still reads the request (its handler gave up on it: the client left), once it is done, with
    what it held meanwhile."""

    def __init__(self, svc: Service):
        self.svc, self.n, self.parsing = svc, 0, None

    def add(self, n: int) -> None:
        """(From the event loop, or from the parse thread while the loop waits for it.)"""
        self.svc.hold(n)
        self.n += n

    def reading(self, binary: str):
        """``hold(nbytes)`` for what reading the request takes (:func:`_tensors.read_request`'s):
        :class:`Refused` 413 where that, with what the request holds already, is past the server's
        whole budget (``binary``: how the client can send the request instead), else as :meth:`add`."""
        def hold(nbytes: int) -> None:
            if self.n + nbytes > self.svc.max_held:  # (a 503 would have it retry what can never fit)
                beside = f" beside the {self.n} it holds already" if self.n else ""
                raise Refused(413, f"reading the request takes about {nbytes} bytes of memory (its JSON values, BYTES "
                                   f"elements or typed contents as Python objects){beside}, over the "
                                   f"{self.svc.max_held} that the server holds for all its requests; {binary}")
            self.add(nbytes)

        return hold

    def release(self) -> None:
        parsing, self.parsing = self.parsing, None
        if parsing is None:
            self._give_back()
        else:  # (at once where the parse is done, or was cancelled before it started)
            parsing.add_done_callback(lambda _: self._give_back())

    def _give_back(self) -> None:
        n, self.n = self.n, 0
        self.svc.release(n)


STOPPING = "the server is stopping, and the request's body had not all arrived; send it again"


class BodyClock:
    """One body's transfer against the server's limits: no gap longer than ``svc.body_timeout``
    between its pieces (or before the first), and once it has taken that long, ``svc.body_min_rate``
    bytes a second at least on average since it began; :meth:`got` for each piece. ``kind``: a
    request's ``"body"``; a gRPC ``"message"``, which arrives whole or not at all (grpc core shows no
    piece), within the time the largest body takes at that rate (``body_timeout`` at least; no
    limit where the rate is 0); an ``"answer"``, each piece counted once the client has taken the
    one before. Late, it cancels the task, ``why`` the :class:`Refused` (408) that :func:`arrival` or
    :func:`departure` raises instead. Its one timer fires at the soonest moment the body could be
    late, and re-arms itself while it is not."""

    def __init__(self, svc: Service, task: asyncio.Task, kind: str = "body"):
        self.loop, self.task, self.why, self.kind = asyncio.get_running_loop(), task, None, kind
        self.timeout, self.rate, self.limit = svc.body_timeout, svc.body_min_rate, svc.max_body
        self.start = self.last = self.loop.time()
        self.n = 0
        due = self._due()
        self.timer = None if due is None else self.loop.call_at(due, self._check)

    def got(self, n: int) -> None:
        self.n += n
        self.last = self.loop.time()

    def cancel(self, why: Refused) -> None:
        """Have the task raise ``why`` (the first reason given, once)."""
        if self.why is None:
            self.why = why
            self.task.cancel()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _due(self) -> float | None:
        if self.kind == "message":
            return None if not self.rate else self.start + max(self.timeout, self.limit / self.rate)
        due = self.last + self.timeout
        return due if not self.rate else min(due, self.start + max(self.timeout, self.n / self.rate))

    def _check(self) -> None:
        now, due = self.loop.time(), self._due()
        if now < due:
            self.timer = self.loop.call_at(due, self._check)
            return
        took = now - self.start
        if self.kind == "message":
            why = (f"the request message had not all arrived after {took:.0f} s: the server waits for one as long as "
                   f"the largest, {self.limit} bytes, takes at {self.rate} bytes a second, {self.timeout:g} s at least")
        else:
            stopped, moves, verb = _LATE[self.kind]
            why = (f"{stopped}: nothing for {self.timeout:g} s, after {self.n} bytes" if now >= self.last + self.timeout
                   else f"{moves} too slowly: {self.n} bytes in {took:.1f} s; after {self.timeout:g} s the server "
                        f"{verb} {self.rate} bytes a second at least")
        self.cancel(Refused(408, why, close=True,
                            reason="answer_timeout" if self.kind == "answer" else "body_timeout"))


_LATE = {"body": ("the request's body stopped arriving", "the request's body arrives", "takes"),
         "answer": ("the client stopped taking its answer", "the client takes its answer", "sends")}


async def arrival(svc: Service, read, whole: bool = False):
    """``await read(clock)`` (a coroutine function reading a request's body, calling ``clock.got(n)``
    for each piece: :class:`BodyClock`; ``whole``: a gRPC message), or :class:`Refused`: 408
    (closing the connection) when the body arrives too slowly, 503 when the server begins to stop
    first (:meth:`Service.stop_reading`)."""
    if svc.stopping:
        raise Refused(503, STOPPING, reason="stopping")
    return await _timed(svc, read, "message" if whole else "body", svc.reading)


async def departure(svc: Service, write):
    """``await write(clock)`` (a coroutine function sending an answer, calling ``clock.got(n)`` as
    the client takes each piece), or :class:`Refused` (408) when the client takes it too slowly."""
    return await _timed(svc, write, "answer", None)


async def _timed(svc: Service, transfer, kind: str, clocks: set | None):
    task = asyncio.current_task()
    clock = BodyClock(svc, task, kind)
    if clocks is not None:
        clocks.add(clock)
    try:
        return await transfer(clock)
    except asyncio.CancelledError:
        # Ours is taken back (Python 3.11+ counts a task's cancellations; asyncio.timeout and task
        # groups read the count); one from elsewhere at the same moment goes on as a cancellation.
        if clock.why is not None and (not hasattr(task, "uncancel") or task.uncancel() == 0):
            # (a new one: raising clock.why would tie it, through its traceback's frames, to this
            # clock and the transfer's body until the garbage collector came)
            why = clock.why
            raise Refused(why.status, str(why), why.retry, why.close, why.reason) from None
        raise
    finally:
        clock.stop()
        if clocks is not None:
            clocks.discard(clock)


async def all_queued(svc: Service) -> None:
    """Wait until every gRPC call whose message has arrived is queued or answered
    (``svc.unqueued``), as the server stops, before its queues close: no message arrives once
    :meth:`Service.stop_reading` has run, and one still being read as the queues closed was refused
    503 (not ready), where an HTTP request read as far was answered. A read ends soon (its parse)."""
    while svc.unqueued:
        await asyncio.sleep(_QUEUED_POLL_S)


_QUEUED_POLL_S = 0.005


async def off_loop(svc: Service, held: Held, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the server's parse thread, the event loop serving other requests
    meanwhile; ``held``: what the request holds of the budget, given back only once ``fn`` is done,
    even where the calling task is cancelled first (``fn`` is not: its result is thrown away)."""
    future = svc.parser.submit(fn, *args, **kwargs)
    held.parsing = future
    return await asyncio.wrap_future(future)


def check_model(model: str, version: str = "") -> None:
    """:class:`Refused` (404) for an unknown model, or a version of it not in :data:`VERSIONS` (""
    names none: the current one)."""
    if model not in MODELS:
        raise Refused(404, f"unknown model {model!r}; the models are {', '.join(MODELS)}")
    if version and version not in VERSIONS:
        raise Refused(404, f"model {model!r} has no version {version!r}; its versions are {', '.join(VERSIONS)}")


def check_ready(svc: Service) -> None:
    why = svc.not_ready()
    if why is not None:
        raise Refused(503, why, retry=True, reason=_unready(svc))


def _unready(svc: Service) -> str:
    """The reason of a refusal while ``svc`` is not ready (:data:`REASONS`)."""
    return "stopping" if svc.stopping or svc._stopped else "not_ready"


def tensor_specs(svc: Service, model: str, version: str = "") -> tuple[list, list]:
    """(inputs, outputs) of ``model``: (name, datatype, shape) each. Refused while the corpus loads.

    The protocol's metadata gives one shape per tensor, so these are the batched form, -1 for each
    dimension the request chooses: Q [Nq, Lq, d], IDS [Nq, K], SCORES and search's IDS [Nq, k] (or
    [Nq, Nd]). One query as Q [Lq, d] is taken too, answered without the Nq axis (perf_analyzer's
    ``--shape`` replaces a shape with -1s whole, of either rank)."""
    check_model(model, version)
    if svc.batcher is None:
        raise Refused(503, "the corpus is still loading", retry=True, reason="not_ready")
    c = svc.batcher.corpus
    qtype = "FP32" if scaled_dtype(c.dtype) else _tensors.DATATYPES[c.dtype]
    ids = "BYTES" if svc.ids.kind == "string" else "INT64"
    specs = {"Q": (qtype, [-1, -1, c.dim]), "K": ("INT32", [1]), "IDS": (ids, [-1, -1]), "SCORES": ("FP32", [-1, -1])}
    return ([(n, *specs[n]) for n in INPUTS[model]], [(n, *specs[n]) for n in OUTPUTS[model]])


def model_config(svc: Service, model: str, version: str = "") -> dict:
    """Triton's model configuration (perf_analyzer reads it): no batch axis of its own (each request
    holds its queries), one instance per replica."""
    inputs, outputs = ([{"name": n, "data_type": f"TYPE_{'STRING' if t == 'BYTES' else t}", "dims": s}
                        for n, t, s in part] for part in tensor_specs(svc, model, version))
    gpus = sum(d.startswith("cuda") for d in svc.batcher.devices)
    groups = [{"count": n, "kind": kind} for n, kind in ((gpus, "KIND_GPU"), (len(svc.batcher.devices) - gpus,
                                                                              "KIND_CPU")) if n]
    return {"name": model, "platform": "lik_cupy", "backend": "lik_cupy", "max_batch_size": 0,
            "input": inputs, "output": outputs, "instance_group": groups}


async def infer(svc: Service, model: str, inputs: dict[str, np.ndarray], params: dict,
                deadline_s: float | None = None, on_wait=None, json_outputs: tuple[str, ...] = (),
                held: Held | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """Score one request: (its outputs by name, the response's parameters ``queue_us``,
    ``compute_us``, ``batch_queries``). ``params``: the request's parameters (``timeout`` in
    microseconds, ``precision``; others are ignored); ``deadline_s``: seconds the transport allows
    (a gRPC deadline), the sooner of the two bounding the wait in the queue; ``on_wait``: called
    (no arguments) once the request is queued, before waiting for it, never for a request scored
    at once; ``json_outputs``: the outputs the transport will write as JSON values; ``held``: what
    the request holds of the server's budget already (its body, what reading it took), which with
    its outputs must fit the whole budget (else 413). Raises :class:`Refused`. When the calling
    task is cancelled (its transport gave up on the request), a request still queued is dropped
    unscored, and the cancellation goes on."""
    check_model(model)
    check_ready(svc)
    try:
        Q, arg = _arguments(svc, model, inputs)
        out_bytes = _output_bytes(svc, model, Q, arg, json_outputs)
        timeout, precision = _parameters(params)
        if deadline_s is not None:
            if deadline_s <= 0:
                raise Refused(504, "the request's deadline passed before it was queued", reason="deadline")
            timeout = deadline_s if timeout is None else min(timeout, deadline_s)
    except (ValueError, TypeError) as e:
        raise Refused(400, str(e)) from None
    own = 0 if held is None else held.n
    if own + out_bytes > svc.max_held:  # (never to fit: a 503 would have it retry for ever)
        raise Refused(413, f"the request's outputs take {out_bytes} bytes and the request itself {own}: over the "
                           f"{svc.max_held} that the server holds for all its requests; send fewer queries (or ask "
                           f"for fewer results) a request")
    svc.hold(out_bytes)  # its results, until answered
    try:
        alone = quiet = False
        if svc.inline:
            others = svc.accepted - svc.answered - svc.dropped + svc.arriving > 0  # (read unlocked: a hint)
            if svc.batcher.can_inline(model, not others and svc.company <= QUIET_SHARE):
                # A request alone on the server is scored in this thread, sparing it the hand-over to
                # the worker thread and back. Requests that arrived with it get to this point first
                # (their tasks run before this one resumes), so that they are queued together and
                # batched instead.
                svc.arriving += 1
                try:
                    await asyncio.sleep(0)
                    alone = svc.arriving == 1
                finally:
                    svc.arriving -= 1
                others = others or not alone
            svc.company += (others - svc.company) / QUIET_ARRIVALS
            quiet = svc.company <= QUIET_SHARE
        try:
            future = svc.batcher.submit(model, Q, arg, precision=precision, timeout=timeout, inline=alone,
                                        quiet=quiet)
        except (ValueError, TypeError) as e:
            raise Refused(400, str(e)) from None
        except Overloaded as e:  # (counted by the batcher)
            raise Refused(503, str(e), retry=True, reason="overloaded", counted=True) from None
        except ShuttingDown as e:
            raise Refused(503, str(e), reason="stopping") from None
        svc.count("accepted")
        gone = False
        try:
            if not future.done() and on_wait is not None:
                on_wait()
            result = future.result() if future.done() else await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            gone = True
            # The batcher drops a cancelled request (one being scored completes, unsent). One that it
            # expired a moment ago (its deadline passed), before this task saw it, was counted then;
            # it counts an expiry once the future holds it, and none for a request cancelled first.
            if not future.cancel() and future.done() and isinstance(future.exception(), DeadlineExceeded):
                _expired_in_queue.set(True)
            raise
        except DeadlineExceeded as e:  # (counted by the batcher's timer)
            raise Refused(504, str(e), reason="deadline", counted=True) from None
        except TimeoutError as e:  # the corpus's cluster did not answer in time: no fault of the request
            raise Refused(504, f"{type(e).__name__}: {e}", reason="cluster_timeout") from None
        except Exception as e:  # noqa: BLE001 - the corpus call failed: say so, keep serving
            why = svc.not_ready()  # (a replica lost meanwhile: the failure is its, a retry may succeed)
            if why is not None:
                raise Refused(503, why, retry=True, reason=_unready(svc)) from None
            raise Refused(500, f"{type(e).__name__}: {e}") from None
        finally:
            svc.count("dropped" if gone else "answered")
    finally:
        svc.release(out_bytes)
    t = future.timing
    return (dict(zip(OUTPUTS[model], result if model == "search" else (result,))),
            {"queue_us": round(t.queue_s * 1e6), "compute_us": round(t.compute_s * 1e6),
             "batch_queries": t.batch_queries})


def label(model: str) -> str:
    """The metrics' model label of a request of ``model``: :data:`UNNAMED` unless the server serves it
    (an unknown model's name would be a label of the client's choosing)."""
    return model if model in MODELS else UNNAMED


def responded(svc: Service, model: str, status: int, start: float) -> None:
    """Count an inference answer of ``status`` (HTTP's) for the metrics, timed from ``start``
    (perf_counter); under :data:`UNNAMED` where the request named no model that the server serves
    (a gRPC call's message had not arrived; an unknown model's name would be a label of the
    client's choosing)."""
    svc.metrics.responded(label(model), status, time.perf_counter() - start)


def refused(svc: Service, model: str, e: Refused, start: float) -> None:
    """Count a request of ``model`` answered with the :class:`Refused` ``e``: rejected for its
    reason (unless the batcher counted it), and its answer (:func:`responded`)."""
    if not e.counted:
        svc.metrics.rejected(label(model), e.reason)
    responded(svc, model, e.status, start)


def abandoned(svc: Service, model: str, start: float, expired: bool) -> None:
    """Count a request of ``model`` that its transport gave up on unanswered: its client went away
    (499, google.rpc.Code CANCELLED's HTTP status; rejected as ``cancelled``), or, ``expired``, its
    gRPC deadline passed (504 and ``deadline``, as an HTTP request's timeout that passes in the queue)."""
    if not _expired_in_queue.get():
        svc.metrics.rejected(model, "deadline" if expired else "cancelled")
    responded(svc, model, 504 if expired else 499, start)


def _arguments(svc: Service, model: str, inputs: dict) -> tuple[np.ndarray, object]:
    """(Q, the batcher's argument) from the request's inputs, checked by name and shape."""
    want = INPUTS[model]
    extra = sorted(set(inputs) - set(want))
    missing = [n for n in want if n not in inputs]
    if extra or missing:
        raise ValueError(f"model {model} takes inputs {', '.join(want)}"
                         + (f"; missing {', '.join(missing)}" if missing else "")
                         + (f"; unexpected {', '.join(extra)}" if extra else ""))
    Q = inputs["Q"]
    if Q.dtype.kind in "USiub":
        raise ValueError(f"Q must be FP16, BF16 or FP32 embeddings, got {_datatype(Q)}")
    if Q.ndim not in (2, 3):  # (before the other inputs' shapes are read against it)
        raise ValueError(f"Q has shape {list(Q.shape)}; expected [Lq, d] (one query) or [Nq, Lq, d]")
    if Q.shape[-2] == 0:  # (a query of no tokens costs no bytes, its answer does)
        raise ValueError(f"Q has shape {list(Q.shape)}: a query needs at least one token")
    if model == "search":
        K = inputs["K"]
        if K.dtype not in (np.int32, np.int64) or K.size != 1:
            raise ValueError(f"K must hold one INT32 (or INT64) value, got {_datatype(K)} of shape {list(K.shape)}")
        return Q, int(K.reshape(-1)[0])
    if model == "rerank":
        ids = inputs["IDS"]
        if Q.ndim == 2 and ids.ndim != 1 or Q.ndim == 3 and (ids.ndim != 2 or ids.shape[0] != Q.shape[0]):
            raise ValueError(f"IDS has shape {list(ids.shape)}; expected [K] for Q [Lq, d], or [Nq, K] for Q "
                             f"[Nq, Lq, d]")
        return Q, svc.ids.positions(ids)
    return Q, None


def _output_bytes(svc: Service, model: str, Q: np.ndarray, arg, json_outputs: tuple[str, ...] = ()) -> int:
    """The bytes of a request's outputs (ValueError past :data:`MAX_OUTPUT`, or where writing those
    named in ``json_outputs`` as JSON takes more: :data:`JSON_VALUE_BYTES` a value)."""
    nq = Q.shape[0] if Q.ndim == 3 else 1
    if model == "search":  # (k of the corpus's documents at most)
        per_query, what = min(arg, len(svc.batcher.corpus)), "results (a score and an id each)"
    elif model == "rerank":
        per_query, what = arg.shape[-1], "scores"
    else:
        per_query, what = len(svc.batcher.corpus), "documents' scores"
    values = nq * max(0, per_query)
    sizes = [_value_bytes(svc, o, o in json_outputs) for o in OUTPUTS[model]]
    n, written = values * sum(s for s, _ in sizes), values * sum(w for _, w in sizes)
    if n > MAX_OUTPUT:
        raise ValueError(f"{nq} queries of {per_query} {what} take {n} bytes; at most {MAX_OUTPUT} a request")
    if written > MAX_OUTPUT:
        binary = values * sum(_value_bytes(svc, o, False)[1] for o in OUTPUTS[model])
        raise ValueError(f"{nq} queries of {per_query} {what} take {written} bytes to write"
                         f"{' as JSON' if json_outputs else ''}; at most {MAX_OUTPUT} a request"
                         + (f" (binary outputs take {binary}: binary_data_output)" if binary <= MAX_OUTPUT else ""))
    return n


def _value_bytes(svc: Service, output: str, as_json: bool) -> tuple[int, int]:
    """(the bytes of one value of ``output`` in its array, the bytes writing it takes at its peak,
    its array's among them); ``as_json``: written as a JSON value, else as binary."""
    if output == "IDS" and svc.ids.kind == "string":
        size = svc.ids.dtype.itemsize
        chars = size // 4 if svc.ids.dtype.kind == "U" else size
        return size, size + STRING_ID_BYTES + STRING_ID_CHAR_BYTES * chars
    size = _VALUE_BYTES[output]
    return size, JSON_VALUE_BYTES if as_json else size


def _parameters(params: dict) -> tuple[float | None, str | None]:
    """(the queue timeout in seconds, the precision) from the request's parameters."""
    timeout = params.get("timeout")
    if timeout is not None:
        # (infinity too: the batcher refuses it, in seconds, and a gRPC deadline hid it)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"parameter timeout must be a positive number of microseconds, got {timeout!r}")
        try:
            timeout = float(timeout) * 1e-6
        except OverflowError:  # an integer past float's range
            raise ValueError(f"parameter timeout is out of range: {timeout}") from None
    precision = params.get("precision")
    if precision is not None and not isinstance(precision, str):
        raise ValueError(f"parameter precision must be a string, got {precision!r}")
    return timeout, precision


def _datatype(a: np.ndarray) -> str:
    return "BYTES" if a.dtype.kind in "US" else _tensors.DATATYPES.get(str(a.dtype), str(a.dtype))
