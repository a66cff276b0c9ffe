"""Concurrent MaxSim requests coalesced into multi-query calls on a resident corpus: :class:`Batcher`.

A service that forwards each request to :class:`lik_cupy.Corpus` as its own call pays one pass over
the corpus per query; queries that arrive together can share it. ``Batcher`` keeps one bounded queue
and one worker thread per corpus replica (one per GPU, or several over one corpus). Requests from
any number of threads (or from asyncio, through :meth:`Batcher.submit`'s future) are checked at
once, routed to the least loaded worker, and scored there in batches: when the worker frees it
takes what is queued (lik_cupy/serving/_queue.py says how), packs the queries ragged with
``q_offsets`` and makes one ``search``, ``rerank`` or ``score`` call. Each caller gets its own rows:
bitwise those of the unbatched call on the CPU path and for rerank on the GPU (GPU search and score
of several short queries run multi-query tiles, which sum a query's rows in another order:
docs/serving.md).
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future

import numpy as np

from .._dispatch.elements import scaled_dtype
from .._interop import FLOAT_DTYPES, dtype_name
from .._runtime.topk import MAX_K
from .._shard_format import joined_ids, numpy_dtype
from ..corpus import Corpus
from ..precision import PRECISIONS
from ..shards import Shard, open_input
from ._cluster import ClusterCorpus
from ._partition import Partition, devices_per_part, split_shards
from ._processes import process_share
from ._queue import DeviceQueue, Request, _observed, scored
from ._staging import Staging
from .errors import Overloaded, ShuttingDown

__all__ = ["Batcher", "Observer", "OPERATIONS"]

OPERATIONS = ("search", "rerank", "score")

# What a Batcher takes as a replica: a Corpus, or one of this package's corpus-likes, which answer
# Corpus's calls with packed queries (``q_offsets``) and which the batcher closes as it closes.
_OWNED = (Partition, ClusterCorpus)
_REPLICAS = (Corpus, *_OWNED)


class Observer:
    """What a :class:`Batcher` reports as it works (for metrics); these do nothing. ``device`` names
    the replica (``cuda:N``, ``cpu:N``), ``op`` the operation. Called from the worker threads
    (``batch``, ``answered``, ``rejected`` for a deadline), their timer threads (``rejected`` for
    a deadline) and from :meth:`Batcher.submit` (``rejected`` when overloaded; ``batch`` and
    ``answered`` for a request it scores inline): keep them short and thread-safe, and let them
    not raise."""

    def batch(self, device: str, op: str, requests: int, queries: int, compute_s: float) -> None:
        """One corpus call of ``requests`` requests, ``queries`` queries in all, took ``compute_s``."""

    def answered(self, device: str, op: str, queue_s: float, compute_s: float) -> None:
        """A request waited ``queue_s`` and was scored in a call of ``compute_s``."""

    def rejected(self, op: str, reason: str) -> None:
        """A request was refused: ``"overloaded"`` (every queue full) or ``"deadline"`` (expired in the queue)."""


class Batcher:
    """Batches concurrent requests on corpus replicas (see the module docstring).

    Args:
        replicas: a :class:`lik_cupy.Corpus` or a sequence of them holding the same documents, one
            worker each (a corpus may repeat: several workers over it); or this package's
            corpus-likes, which the batcher closes as it closes: a corpus split over devices
            (``Batcher.from_shards(..., partition=True)``), or one resident on a Dask cluster
            (``lik serve --scheduler``: ``_cluster.ClusterCorpus``, a replica named ``dask:N``).
        max_batch: queries per call, at most.
        max_tokens: padded query tokens per call (queries x the longest of them), at most; a
            request larger than either cap is scored alone.
        max_delay_us: how long a free worker waits, from the oldest request's arrival, for more
            requests before it scores what it has (0: never; Triton's ``max_queue_delay_microseconds``).
        max_queue: requests waiting per replica; beyond, :meth:`submit` raises :class:`Overloaded`.
        observer: an :class:`Observer` (metrics).

    Requests are host (NumPy) arrays; results are NumPy arrays, as ``Corpus`` returns them for host
    queries. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, replicas, *, max_batch: int = 64, max_tokens: int = 65536, max_delay_us: int = 0,
                 max_queue: int = 1024, observer: Observer | None = None):
        replicas = [replicas] if isinstance(replicas, _REPLICAS) else list(replicas)
        if not replicas or not all(isinstance(c, _REPLICAS) for c in replicas):
            raise TypeError("replicas must be a lik_cupy.Corpus or a non-empty sequence of them")
        first = replicas[0]
        for c in replicas[1:]:
            if (len(c), c.dim, c.dtype) != (len(first), first.dim, first.dtype):
                raise ValueError(f"replicas differ: {c!r} against {first!r}; every replica holds the same documents")
        for name, v, lo in (("max_batch", max_batch, 1), ("max_tokens", max_tokens, 1),
                            ("max_delay_us", max_delay_us, 0), ("max_queue", max_queue, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        self.corpus = first
        self.max_batch, self.max_tokens, self.max_queue = int(max_batch), int(max_tokens), int(max_queue)
        self._observer = observer or Observer()
        names, workers = [], {}
        for c in replicas:  # cpu:0, cpu:1, ...; cuda:0, then cuda:0#1 for a second worker on GPU 0; cuda:0+1; dask:0
            where = tuple(c.part_devices) if isinstance(c, Partition) else "dask" if isinstance(c, ClusterCorpus) \
                else c.device
            n = workers[where] = workers.get(where, -1) + 1
            if where == "dask":
                names.append(f"dask:{n}")
            elif isinstance(c, Partition) and where[0] is not None:
                names.append("cuda:" + "+".join(map(str, where)) + (f"#{n}" if n else ""))
            elif isinstance(c, Partition):
                names.append(f"cpu:{n}x{len(where)}")
            else:
                names.append(f"cpu:{n}" if c.device is None else f"cuda:{c.device}" + (f"#{n}" if n else ""))
        self._queues = [DeviceQueue(c, n, max_batch=self.max_batch, max_tokens=self.max_tokens,
                                    max_delay_s=max_delay_us * 1e-6, max_queue=self.max_queue, observer=self._observer)
                        for c, n in zip(replicas, names)]
        self._route_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_shards(cls, paths, devices=None, *, partition: bool | None = None,
                    process: tuple[int, int] | None = None, **kwargs) -> Batcher:
        """A batcher over the documents of shard paths (:meth:`lik_cupy.Corpus.from_shards`; each shard
        opened once, for every replica or part, and an entry that is a ``lik_cupy.shards.Shard``
        opened already not again), one worker per entry of ``devices``: CUDA ordinals, or ``"cpu"``;
        entries naming one device share its one corpus (a second worker on a GPU queues its call
        while the first one's runs). Default: every GPU, else one CPU worker.

        ``partition=True``: instead of a replica per entry, split the shards over the distinct
        entries of ``devices``, a part each (consecutive shards, documents as even as whole shards
        allow); one worker runs every call on all the parts at once (``"cpu"`` entries, which are
        never merged, make parts in host memory). ``None`` (the default) partitions over the distinct
        GPUs when there are two or more and a replica would not fit each of them (its shards' bytes
        over 3/4 of a GPU's free memory); ``False`` always replicates (a replica that
        does not fit stays in page-locked host memory). ``process=(i, n)``: this is server process
        ``i`` of ``n`` (``lik serve --processes``); where it replicates over ``k`` >= 2 GPUs and ``n`` is
        a multiple of ``k``, it keeps the entries of the ``i mod k``-th GPU only, so that each GPU
        serves ``n / k`` processes and each process batches its requests in one queue (two GPUs in
        every process split its requests into smaller batches, and its workers took turns under one
        GIL). ``kwargs``: as for the class."""
        if devices is None:
            from .._base.device import gpu_available

            if gpu_available():
                import cupy

                devices = list(range(cupy.cuda.runtime.getDeviceCount()))
            else:
                devices = ["cpu"]
        devices = list(devices)
        if not devices:
            raise ValueError("devices is empty; give CUDA ordinals or 'cpu'")
        paths = [paths] if isinstance(paths, (str, bytes, os.PathLike, Shard)) else list(paths)
        gpus = list(dict.fromkeys(d for d in devices if d != "cpu"))
        parts = devices_per_part(devices)
        if partition and len(parts) < 2:
            raise ValueError(f"a partition needs two devices at least (a part each); devices is {devices}")
        opened = [p if isinstance(p, Shard) else open_input(p) for p in paths]  # once, for every replica or part
        if partition is None and len(gpus) > 1:
            partition = not _replica_fits(opened, gpus, _free_gpu_bytes)
        if partition:
            return cls(_partition_of(opened, parts), **kwargs)
        if process is not None:
            devices = process_share(devices, *process)
        loaded = {}
        for d in devices:
            if d not in loaded:
                loaded[d] = Corpus.from_shards(opened, device=d)
        return cls([loaded[d] for d in devices], **kwargs)

    @property
    def devices(self) -> list[str]:
        """The replicas' names (``cuda:N``, ``cpu:N``), one per worker."""
        return [q.name for q in self._queues]

    def queue_depths(self) -> dict[str, int]:
        """Requests waiting, per replica."""
        return {q.name: q.depth for q in self._queues}

    def can_inline(self, op: str, quiet: bool = False) -> bool:
        """Whether a request of ``op`` submitted with ``inline=True`` would likely be scored at once:
        some replica has nothing queued or being scored, ``max_delay_us`` is 0, and ``op``'s last call
        of one request took at most ``_queue.INLINE_MAX_S``, or any time if ``quiet`` (a hint, read
        without locks)."""
        return any(q.can_score_now(op, quiet) for q in self._queues)

    # ------------------------------------------------------------ requests

    def submit(self, op: str, Q, arg=None, *, precision: str | None = None, timeout: float | None = None,
               inline: bool = False, quiet: bool = False) -> Future:
        """Queue one request; its future gives what the corpus call would.

        Args:
            op: ``"search"`` (``arg``: k, 1 .. 4096), ``"rerank"`` (``arg``: integer candidate
                document indices, ``[K]`` for a 2-D Q, ``[Nq, K]`` for a 3-D one) or ``"score"``.
            Q: ``[Lq, d]`` (one query) or ``[Nq, Lq, d]``, every token valid, a host array of the
                corpus's dtype (an INT8 corpus: float16, bfloat16 or float32).
            precision: float32 corpora on the GPU: "fp32" or "tf32", as in :func:`lik_cupy.maxsim`.
            timeout: seconds the request may wait in the queue. If it is still queued when they
                have passed, it leaves the queue unscored and its future raises
                :class:`DeadlineExceeded` then (the queue's timer thread answers it at its deadline,
                whether or not the worker is busy with a batch); once scoring has started, it
                completes.
            inline: where :meth:`can_inline` holds, score the request in this thread, as a batch
                of one on an idle replica's stream and buffers, and return its future done; this
                skips the hand-over to the worker thread and back. Otherwise it is queued. (The
                server asks this for a request it has no other to batch with, on GPU replicas.)
            quiet: with ``inline``, the caller has seen no concurrent requests lately, so an
                operation whose calls take longer than ``_queue.INLINE_MAX_S`` may be scored in
                this thread too (it holds the thread for the whole call).

        Returns:
            a ``concurrent.futures.Future`` (``asyncio.wrap_future`` awaits it) of ``(scores, ids)``
            for search (float32 and the corpus's ids, ``[k']`` or ``[Nq, k']``, k' = min(k, Nd)),
            float32 ``[K]`` / ``[Nq, K]`` for rerank, float32 ``[Nd]`` / ``[Nq, Nd]`` for score.
            Once scored, its ``timing`` attribute holds the request's queue and compute time and
            its batch's size (``queue_s``, ``compute_s``, ``batch_queries``).

        Raises:
            ValueError / TypeError: a bad request (nothing is queued); :class:`Overloaded`: every
            replica's queue is full; :class:`ShuttingDown`: after :meth:`close`.
        """
        arrival = time.monotonic()
        req = self._request(op, Q, arg, precision, timeout, arrival)
        if self._closed:
            raise ShuttingDown("the batcher is shutting down and takes no new requests")
        if inline:
            for q in sorted(self._queues, key=lambda q: q.load):
                if q.score_now(req, quiet):
                    return req.future
        with self._route_lock:
            for q in sorted(self._queues, key=lambda q: q.load):
                if q.put(req):
                    return req.future
        _observed(self._observer.rejected, op, "overloaded")
        raise Overloaded(f"all {len(self._queues)} replica queues are full ({self.max_queue} requests each); "
                         f"retry later")

    def search(self, Q, k: int, *, precision: str | None = None, timeout: float | None = None):
        """``Corpus.search(Q, k)``, batched with concurrent requests: ``(scores, ids)`` (see :meth:`submit`)."""
        return self.submit("search", Q, k, precision=precision, timeout=timeout).result()

    def rerank(self, Q, candidates, *, precision: str | None = None, timeout: float | None = None) -> np.ndarray:
        """``Corpus.rerank(Q, candidates)``, batched with concurrent requests (see :meth:`submit`)."""
        return self.submit("rerank", Q, candidates, precision=precision, timeout=timeout).result()

    def score(self, Q, *, precision: str | None = None, timeout: float | None = None) -> np.ndarray:
        """``Corpus.score(Q)``, batched with concurrent requests (see :meth:`submit`)."""
        return self.submit("score", Q, precision=precision, timeout=timeout).result()

    def warm(self, lq: int = 32) -> None:
        """Run each operation on every GPU replica, the way the workers call it, at the batch sizes
        whose kernels differ for queries of ``lq`` tokens (1 up to as many as share a 128-row tile,
        and ``max_batch``), so that those kernels are compiled before the first request.
        Host-memory replicas need nothing."""
        # (scaled corpora take float queries)
        dtype = numpy_dtype("float32" if scaled_dtype(self.corpus.dtype) else self.corpus.dtype)
        rng = np.random.default_rng(0)
        for queue in {id(q.corpus): q for q in self._queues}.values():
            c = queue.corpus
            if all(p.device is None for p in (c.parts if isinstance(c, Partition) else [c])):
                continue
            # As its worker calls it: on its GPU, with buffers of its own (one Staging for every
            # replica put GPU 1's queries in GPU 0's buffer, and `lik serve --devices 0,1` failed here).
            staging = Staging()
            with queue.own_stream():
                for n in sorted({*range(1, min(self.max_batch, max(1, 128 // lq)) + 1), self.max_batch}):
                    Q = rng.standard_normal((n, lq, c.dim)).astype(dtype)
                    cand = np.arange(n * min(len(c), 100), dtype=np.int64).reshape(n, -1) % max(1, len(c))
                    for op, arg in (("search", min(10, max(1, len(c)))), ("rerank", cand), ("score", None)):
                        scored(c, [Request(op, Q, arg, None, False, None, Future(), 0.0)], staging)

    def unavailable(self) -> str | None:
        """Why a replica cannot be reached now, the first such one's reason (None: every replica
        can): a corpus on a Dask cluster whose client lost its scheduler (``ClusterCorpus.unavailable``).
        A replica without an ``unavailable`` method (a ``Corpus`` here) always can. No round trip:
        the server asks on every request (``Service.ready``)."""
        for q in self._queues:
            why = getattr(q.corpus, "unavailable", None)
            if why is not None and (why := why()) is not None:
                return why
        return None

    def close(self, timeout: float | None = None) -> None:
        """Take no new requests, answer every queued one, and stop the workers (waits up to
        ``timeout`` seconds for each)."""
        self._closed = True
        for q in self._queues:
            q.close()
        for q in self._queues:
            q.join(timeout)
        for c in {id(q.corpus): q.corpus for q in self._queues}.values():
            if isinstance(c, _OWNED):
                c.close()

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, op, Q, arg, precision, timeout, arrival: float) -> Request:
        """The checked request (ValueError / TypeError naming what is wrong)."""
        c = self.corpus
        if op not in OPERATIONS:
            raise ValueError(f"op must be one of {', '.join(OPERATIONS)}; got {op!r}")
        try:
            Q = np.asarray(Q)
        except TypeError as e:
            raise TypeError(f"Q must be a host array: {e}") from None
        if Q.ndim not in (2, 3):
            raise ValueError(f"Q has shape {list(Q.shape)}; expected [Lq, d] (one query) or [Nq, Lq, d]")
        if Q.shape[-1] != c.dim:
            raise ValueError(f"Q has dim {Q.shape[-1]} but the corpus has dim {c.dim}")
        dt = dtype_name(Q.dtype)
        if scaled_dtype(c.dtype):
            if dt not in FLOAT_DTYPES:
                raise TypeError(f"Q has dtype {dt}; an {c.dtype} corpus takes float16, bfloat16 or float32 queries")
        elif dt != c.dtype:
            raise TypeError(f"corpus has dtype {c.dtype} but Q has {dt}: send {c.dtype} queries")
        squeeze = Q.ndim == 2
        Q = np.array(Q.reshape((1,) + Q.shape) if squeeze else Q, order="C")  # its own copy: callers may reuse theirs
        if op == "search":
            if isinstance(arg, bool) or not isinstance(arg, (int, np.integer)) or not 1 <= arg <= MAX_K:
                raise ValueError(f"k must be an integer in [1, {MAX_K}], got {arg!r}")
            arg = int(arg)
        elif op == "rerank":
            arg = _candidates(arg, Q.shape[0], squeeze, len(c))
        elif arg is not None:
            raise ValueError("score takes no argument beside Q")
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
        if precision is not None and getattr(c, "no_precision", None):  # (a replica that cannot take one says why)
            raise ValueError(f"precision={precision!r}: {c.no_precision}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0 or math.isinf(timeout)):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        deadline = None if timeout is None else arrival + timeout
        return Request(op, Q, arg, precision, squeeze, deadline, Future(), arrival)


# A replica may take this share of a GPU's free memory (Corpus's default for a host corpus).
_REPLICA_SHARE = 0.75


def _replica_fits(opened: list, gpus: list, free_bytes) -> bool:
    """Whether the shards (their tokens, scales and offsets) fit 3/4 of every GPU's
    free memory (``free_bytes(gpu)``)."""
    need = sum(int(a.nbytes) for s in opened for a in (s.tokens, s.scales, s.offsets) if a is not None)
    return all(need <= _REPLICA_SHARE * free_bytes(g) for g in gpus)


def _free_gpu_bytes(device: int) -> int:
    import cupy

    with cupy.cuda.Device(device):
        return int(cupy.cuda.runtime.memGetInfo()[0])


def _partition_of(opened: list, devices: list) -> Partition:
    """The shards ``opened`` split over ``devices`` (two or more), a part each."""
    ids = joined_ids(opened)  # the whole corpus's (Corpus.from_shards), checked before any part loads
    runs = split_shards(opened, [s.num_docs for s in opened], len(devices))
    parts = [Corpus.from_shards(run, device=d, ids=False) for run, d in zip(runs, devices)]
    return Partition(parts, ids)


def _candidates(candidates, nq: int, one_query: bool, nd: int) -> np.ndarray:
    """Rerank candidates as int64 ``[nq, K]``, each in ``[0, nd)``."""
    a = np.asarray(candidates)
    if a.size == 0 and a.dtype.kind == "f":
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"candidates must be integer document indices, got dtype {a.dtype}")
    if a.ndim != (1 if one_query else 2) or (not one_query and a.shape[0] != nq):
        raise ValueError(f"candidates has shape {list(a.shape)}; expected "
                         f"{'[K] (Q is one query)' if one_query else f'[{nq}, K] (one row per query)'}")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= nd):
        bad = int(a.min()) if int(a.min()) < 0 else int(a.max())
        raise ValueError(f"candidate {bad} is outside the corpus's {nd} documents [0, {nd})")
    return np.array(a.reshape(nq, a.shape[-1]), np.int64, order="C")  # (nq = 0: -1 cannot be inferred)
