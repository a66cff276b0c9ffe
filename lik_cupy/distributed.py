"""Scale out on Dask: one corpus of shards kept resident over many workers (GPUs, machines), its
top-k merged exactly.

    from distributed import Client
    from dask_cuda import LocalCUDACluster            # one worker process per GPU of this machine
    from lik_cupy.distributed import DistributedCorpus

    with LocalCUDACluster() as cluster, Client(cluster) as client:
        with DistributedCorpus(client, ["shard0", "shard1"]) as corpus:
            scores, ids = corpus.search(Q, 100)   # bitwise lik_cupy.retrieve(Q, [both shards], 100)

Everything runs on Dask's own machinery (a worker plugin, tasks pinned to workers, scatter,
the scheduler's worker list); this module schedules nothing itself. Requires the
``[distributed]`` extra (``[distributed-gpu]`` adds dask-cuda); ``import lik_cupy`` never
imports Dask, this module does.

- **Residency.** A worker plugin (``_Store``) holds each worker's shards. A task pinned to the
  worker (``workers=[address]``) loads each shard once, packed. It goes onto the worker's GPU
  when the worker has one and the shard fits in ``device_memory_fraction`` of the GPU's memory,
  else into page-locked host memory (streamed through the GPU by each query), or into host
  memory on a worker without a GPU. Resident shards are not Dask data, so Dask never spills,
  moves or copies them.
- **Placement** (``_place``). Shards go to workers by size, largest first, each to the worker
  whose share of its capacity stays lowest. Each call first asks the scheduler which workers are
  alive: the shards of a worker that left go to the others the same way, and shards move to a
  worker that joined while that evens the shares out. Moved shards load on their new worker
  before the old one drops them.
- **A query batch** (``search``). The client sends Q straight to the workers holding shards (each
  its own copy up to ``_DIRECT_MAX`` workers; beyond, one copy that Dask copies on from worker to
  worker), so the scheduler carries no data. Every such worker runs one task: one ``retrieve``
  over its resident shards in corpus order, positions mapped to global ones. A tree of tasks
  merges those partial rankings ``_FAN_IN`` at a time with ``merge_rankings``, down to ``_FAN_IN``
  at most, which the client fetches in one direct gather and merges in one pass: the root of
  the tree. Its order is total (score descending, lower position first, NaN last), so every
  merge tree gives exactly the single-process ranking. Each batch's stage times (worker-side
  ``retrieve``, shipping, the scheduler's round trips, gathering, merging) land in
  ``DistributedCorpus.last_search``. ``score`` returns the full matrix, fetched shard piece by
  shard piece. ``rerank`` sends each worker that holds candidates the queries that have some there,
  with those candidates (their shards and indices in them); one task per such worker scores just
  them, and the client writes each worker's scores back in place.
- **Faults.** While it waits, the client polls the scheduler's worker list. When a worker
  holding shards leaves mid-call, the call's tasks are dropped, the shards reload on the
  remaining workers, the call runs again (still exact), and a RuntimeWarning says what happened;
  so does a call whose tasks the scheduler cancelled with no worker missing (a worker restarted
  under its own address, ``client.restart()``), and one whose own connection to a worker the
  scheduler still lists failed (one restarting, not yet listening again, or one on its way out).
  An unreadable shard raises :class:`lik_cupy.ShardError` naming the file, and so does a shard
  that changed on disk since the corpus was built on it: every load compares the shard with the
  fingerprint taken then (``_Fingerprint``: counts, each file's size and modification time, a hash
  of the document lengths and ids), since a reload of other contents would return wrong ids.
  Every wait is bounded by ``timeout``, and a TimeoutError says what did not finish. A call that
  fails releases its futures as it raises (its queries leave the workers then). A scheduler
  restarted at the address (its workers new, without the corpus) or a client closed for good
  (its scheduler away past Dask's connect timeout) loses the whole corpus: ``lost()`` says which,
  and ``reload()`` loads it again (through a new client of the address where the old one closed).

docs/distributed.md has the recipes (one host, many nodes) and the cost model: bytes per query
batch and merge depth against the number of workers.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import inspect
import os
import threading
import time
import traceback
import uuid
import warnings
import weakref
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

import numpy as np

try:
    import distributed
except ImportError as e:
    raise ImportError("lik_cupy.distributed needs Dask's distributed scheduler: pip install 'lik-cupy[distributed]' "
                      "(or 'lik-cupy[distributed-gpu]', which adds dask-cuda for one worker per GPU)") from e

from . import _shard_format as fmt
from . import shards
from ._base.device import gpu_available
from ._cpu import gathered_rows
from ._dispatch.backend import check_backend
from ._ranking import merge_rankings
from ._runtime.topk import MAX_K
from ._streaming.gpu import outside_stacklevel
from ._validate import check_flag, check_id_values, check_timeout, host_ints
from .retrieval import retrieve

__all__ = ["DistributedCorpus"]

# Partial rankings merged per reduction task. Each merge moves FAN_IN - 1 rankings onto the
# worker that holds one of them already, so depth and bytes trade off (docs/distributed.md).
_FAN_IN = 4
_POLL = 0.25  # seconds between looks at the scheduler's worker list while a call waits
# close() waits this long for a client that lost its scheduler to get it back, not Dask's
# reconnect timeout (30 s by default): a cluster that went away closes at once.
_CLOSE_GRACE = 2.0
_ATTEMPTS = 4  # a call runs at most this often when workers keep leaving mid-call
_PIECE_BYTES = 64 << 20  # float32 scores per task of score(): bounds worker and client memory
_PIECES_PER_WORKER = 2  # score() tasks queued per worker: one runs while the other's result is fetched
# Up to this many workers the client sends each its own copy of Q at once (one hop); beyond, one
# copy, which Dask copies on from worker to worker, so the client's upload stays one copy.
_DIRECT_MAX = 8
# close()'s check-and-set of a corpus's state: close may come from another thread while the
# constructor runs (lik serve stopping as the corpus loads), before the corpus has a lock of its own.
_CLOSING = threading.Lock()
# lost() asks the scheduler only its id: where Client.scheduler_info takes n_workers (newer Dask),
# 0 leaves every worker's details out of the answer.
_ID_ONLY = {"n_workers": 0} if "n_workers" in inspect.signature(distributed.Client.scheduler_info).parameters else {}


# --------------------------------------------------------------------------- placement


def _place(sizes: dict[int, int], weights: dict[str, float], current: dict[int, str]) -> dict[int, str]:
    """Decide which worker holds each shard.

    Args:
        sizes: bytes of each shard, by shard index.
        weights: the living workers' capacities in bytes. A worker's share of the corpus
            grows with its weight.
        current: where shards are resident now, on living workers. They stay there unless
            the rebalance below moves them.

    Returns:
        shard index -> worker address. The shards not in ``current`` (all of them the first
        time) go largest first to the worker whose load / weight stays lowest. Then shards move
        one at a time from the fullest worker to the emptiest while a move lowers
        sum(load**2 / weight). A worker that joined fills up that way, and the loop ends
        because that sum only falls. Deterministic: ties are broken by shard index and address.
    """
    workers = sorted(weights)
    w = {a: max(float(weights[a]), 1.0) for a in workers}
    placement = {i: a for i, a in current.items() if a in w and i in sizes}
    load = dict.fromkeys(workers, 0)
    for i, a in placement.items():
        load[a] += sizes[i]
    for i in sorted((i for i in sizes if i not in placement), key=lambda i: (-sizes[i], i)):
        a = min(workers, key=lambda a: ((load[a] + sizes[i]) / w[a], a))
        placement[i] = a
        load[a] += sizes[i]
    # Each worker's nonempty shards as (size, -index), ascending: the move below looks them up by
    # bisection (a scan of every shard for each move took time growing as the shards squared:
    # 1.5 s for 4,000 shards on one worker when a second joined).
    held: dict[str, list] = {a: [] for a in workers}
    for i, a in placement.items():
        if sizes[i] > 0:
            held[a].append((sizes[i], -i))
    for entries in held.values():
        entries.sort()
    for _ in range(len(sizes) * len(workers)):  # a bound only: the potential falls with each move
        hi = max(workers, key=lambda a: (load[a] / w[a], a))
        lo = min(workers, key=lambda a: (load[a] / w[a], a))
        # Moving s bytes from hi to lo lowers the potential iff (2 lo + s) / w_lo < (2 hi - s) / w_hi,
        # which holds for every size below some bound: the largest such shard (the lowest index of
        # that size) moves.
        entries = held[hi]
        k = bisect.bisect_left(entries, True,
                               key=lambda e: (2 * load[lo] + e[0]) / w[lo] >= (2 * load[hi] - e[0]) / w[hi])
        if not k:
            break
        s, i = entries.pop(k - 1)
        i = -i
        bisect.insort(held[lo], (s, -i))
        placement[i] = lo
        load[hi] -= s
        load[lo] += s
    return placement


# --------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class _Fingerprint:
    """What a shard was when the corpus was built on it: every reload must find the same, or the
    ids it returns would name other documents."""

    counts: tuple  # (documents, tokens, dim, dtype)
    files: tuple  # (name, size, modification time in ns) of each of its files
    digest: str  # a hash of its document lengths and ids

    def changes(self, built: _Fingerprint) -> str:
        """What differs from ``built``, in words."""
        if self.counts != built.counts:
            names = ("documents", "tokens", "dim", "dtype")
            return ", ".join(f"{n} {a} -> {b}" for n, a, b in zip(names, built.counts, self.counts) if a != b)
        if self.files != built.files:
            old, new = {f[0]: f[1:] for f in built.files}, {f[0]: f[1:] for f in self.files}
            return "rewritten: " + ", ".join(sorted(n for n in old.keys() | new.keys() if old.get(n) != new.get(n)))
        return "its document lengths or ids differ"


def _changed(source: tuple[str, str | None], now: _Fingerprint, built: _Fingerprint) -> shards.ShardError:
    """The error of a shard that is no longer what the corpus was built on: reloaded, its ids would
    name other documents."""
    return shards.ShardError(source[0], f"changed since the DistributedCorpus was built on it ({now.changes(built)}); "
                                        "its ids would name other documents: build a new corpus to serve the new "
                                        "contents")


def _fingerprint(shard: shards.Shard, source: tuple[str, str | None]) -> _Fingerprint:
    path, lengths = source
    if shard.manifest is not None:  # the files the shard is read from, not whatever else its directory holds
        names = [fmt.MANIFEST, *(shard.manifest["files"][k] for k in ("tokens", "offsets", "ids", "scales")
                                 if k in shard.manifest["files"])]
        files = [(n, os.path.join(path, n)) for n in names]
    else:
        files = [(os.path.basename(f), f) for f in [path] + ([] if lengths is None else [lengths])]
    stats = tuple((n, st.st_size, st.st_mtime_ns) for n, f in files for st in [os.stat(f)])
    doc_lengths = np.ascontiguousarray(shard.doc_lengths(), np.int64)
    h = hashlib.blake2b(doc_lengths.tobytes(), digest_size=16)
    if shard.ids is not None:
        h.update(np.ascontiguousarray(shard.ids).tobytes())
    return _Fingerprint((shard.num_docs, int(doc_lengths.sum()), shard.dim, shard.dtype), stats, h.hexdigest())


@dataclass(frozen=True)
class _Info:
    """What the client needs to know of a shard before loading it."""

    num_docs: int
    nbytes: int  # what residency costs: tokens (valid rows only), scales, offsets
    dim: int
    dtype: str  # one of fmt.SHARD_DTYPES
    fingerprint: _Fingerprint


def _describe(source: tuple[str, str | None], bf16_bits: bool) -> _Info:
    shard = shards.open_input(source[0], source[1], bf16_bits=bf16_bits)
    nbytes = int(shard.doc_lengths().sum()) * shard.bytes_per_token + 8 * (shard.num_docs + 1)
    return _Info(shard.num_docs, nbytes, shard.dim, shard.dtype, _fingerprint(shard, source))


@dataclass
class _Resident:
    """One shard held by a worker, packed whatever its layout on disk (a padded input keeps its valid rows).

    ``part``: ``(tokens [T, d], offsets int64 [N + 1])``, plus float32 ``scales [T]`` for int8
    tokens: a shard as :func:`lik_cupy.retrieve` takes it, CuPy arrays when ``where == "GPU"``,
    NumPy arrays otherwise. ``offsets``: a host copy of the offsets, to slice pieces in :meth:`scores`.
    """

    part: tuple
    offsets: np.ndarray
    where: str  # "GPU", "pinned host memory" or "host memory"
    nbytes: int
    pinned: object = None  # the PinnedHost that page-locks host arrays, released with the shard
    users: int = 0  # tasks using it now (``_Store.holding``; under the store's lock)
    dropped: bool = False  # dropped while in use: released when the last of them ends

    @property
    def num_docs(self) -> int:
        return self.offsets.shape[0] - 1

    def scores(self, Q: np.ndarray, q_lengths, start: int, stop: int, backend: str) -> np.ndarray:
        """float32 ``[Nq, stop - start]``: the MaxSim of every query against documents ``start..stop-1``."""
        from .forward import maxsim_varlen
        from .int8 import maxsim_int8_varlen

        t0, t1 = int(self.offsets[start]), int(self.offsets[stop])
        offsets = self.offsets[start : stop + 1] - t0
        on_gpu = self.where == "GPU"
        if on_gpu:  # the documents are CuPy arrays: queries and offsets go to the same device
            import cupy

            Q, offsets = cupy.asarray(Q), cupy.asarray(offsets)
            q_lengths = None if q_lengths is None else cupy.asarray(q_lengths)
        tokens = self.part[0][t0:t1]
        if len(self.part) == 3:
            S = maxsim_int8_varlen(Q, tokens, self.part[2][t0:t1], offsets, q_lengths=q_lengths, backend=backend)
        else:
            S = maxsim_varlen(Q, tokens, offsets, q_lengths=q_lengths, backend=backend)
        return S.get() if on_gpu else np.asarray(S, np.float32)

    def rerank(self, Q: np.ndarray, q_lengths, rows: np.ndarray, docs: np.ndarray, backend: str) -> np.ndarray:
        """float32 ``[m]``: the MaxSim of query ``rows[j]`` of Q against this shard's document ``docs[j]``,
        for each j (``rows`` ascending). Each query's documents are gathered, packed, in runs of at
        most ``_PIECE_BYTES`` of tokens (a longer document alone, read in place), and scored by one
        ``maxsim_varlen`` of that query: as ``Corpus.rerank`` scores candidates on the NumPy path."""
        from .forward import maxsim_varlen
        from .int8 import maxsim_int8_varlen

        on_gpu = self.where == "GPU"
        xp = np
        if on_gpu:  # the documents are CuPy arrays: queries, lengths, offsets and row indices go to the same device
            import cupy as xp
        Q = xp.asarray(Q)
        q_lengths = None if q_lengths is None else xp.asarray(q_lengths)
        tokens, scales = self.part[0], self.part[2] if len(self.part) == 3 else None
        run = max(1, _PIECE_BYTES // (tokens.shape[1] * tokens.dtype.itemsize + (4 if scales is not None else 0)))
        starts = self.offsets[docs]
        lens = self.offsets[docs + 1] - starts
        pieces = []
        cuts = np.flatnonzero(np.diff(rows)) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), rows.size]):  # one query's documents
            r = int(rows[a])
            q, ql = Q[r : r + 1], None if q_lengths is None else q_lengths[r : r + 1]
            ends = np.cumsum(lens[a:b])
            j = a
            while j < b:
                spent = int(ends[j - a - 1]) if j > a else 0
                e = max(j + 1, a + int(np.searchsorted(ends, spent + run, side="right")))
                at, off = gathered_rows(starts[j:e], lens[j:e])  # (one document: a slice, no copy)
                if not isinstance(at, slice):
                    at = xp.asarray(at)
                if scales is not None:
                    S = maxsim_int8_varlen(q, tokens[at], scales[at], xp.asarray(off), q_lengths=ql, backend=backend)
                else:
                    S = maxsim_varlen(q, tokens[at], xp.asarray(off), q_lengths=ql, backend=backend)
                pieces.append(S[0])
                j = e
        if not pieces:
            return np.zeros(0, np.float32)
        S = xp.concatenate(pieces)
        return S.get() if on_gpu else np.asarray(S, np.float32)

    def release(self) -> None:
        if self.pinned is not None:
            self.pinned.release()
        self.part = ()


def _make_resident(shard: shards.Shard, dtype: str | None, gpu_room: float | None) -> _Resident:
    """Hold ``shard`` in memory: on the GPU when ``gpu_room`` (bytes; None: no GPU) takes it, else in host memory."""
    tokens, offsets = shard.read_chunk(0, shard.num_docs)
    if dtype is not None:
        tokens = tokens.astype(fmt.numpy_dtype(dtype), copy=False)
    arrays = [tokens, offsets] + ([shard.read_scales(0, shard.num_docs)] if shard.scales is not None else [])
    nbytes = sum(a.nbytes for a in arrays)
    host_offsets = np.array(offsets, np.int64)
    # CuPy has no bfloat16 dtype: such shards stay in host memory and stream through the GPU.
    if gpu_room is not None and nbytes <= gpu_room and tokens.dtype.name != "bfloat16":
        import cupy

        try:
            return _Resident(tuple(cupy.asarray(a) for a in arrays), host_offsets, "GPU", nbytes)
        except cupy.cuda.memory.OutOfMemoryError:
            cupy.get_default_memory_pool().free_all_blocks()  # other work holds the memory: stream instead
    host = tuple(np.array(a) for a in arrays)  # read once: later queries never touch the files
    if gpu_room is None:
        return _Resident(host, host_offsets, "host memory", nbytes)
    from ._runtime.pinned import pin_host

    try:
        pinned = pin_host(host[0], *host[2:])  # tokens and scales, which retrieve uploads as they lie
    except RuntimeError:  # the driver refused to lock that much (ulimit -l): pageable memory still streams
        return _Resident(host, host_offsets, "host memory", nbytes)
    return _Resident(host, host_offsets, "pinned host memory", nbytes, pinned)


class _Store(distributed.WorkerPlugin):
    """The shards one worker holds for one corpus: a Dask worker plugin, set up on every worker
    (workers that join later too) and torn down when the corpus closes or the worker stops."""

    def __init__(self, fraction: float, backend: str, dtype: str | None, bf16_bits: bool):
        self.fraction, self.backend, self.dtype, self.bf16_bits = fraction, backend, dtype, bf16_bits

    def setup(self, worker) -> None:
        self.resident: dict[int, _Resident] = {}
        # Shards a move took to another worker. A task queued here before the move (another thread's
        # call) scores such a shard from a copy of its own, released as it ends: kept, it would be a
        # second copy the corpus does not know of, holding this worker's memory until close.
        self.moved: set[int] = set()
        # Bytes of shards on this GPU while they live: resident ones, a task's own copy of a moved
        # shard, and a dropped shard until the last task using it ends (each load is offered the rest).
        self.gpu_bytes = 0
        self.lock = threading.RLock()  # a worker with several threads may load and search at once

    def teardown(self, worker) -> None:
        self.drop(list(self.resident))

    def gpu(self) -> bool:
        return self.backend != "cpu" and gpu_available()

    def capacity(self) -> float:
        """Bytes of shards this worker should hold: ``fraction`` of its GPU's memory, or its host memory limit."""
        if self.gpu():
            import cupy

            return self.fraction * cupy.cuda.runtime.memGetInfo()[1]
        limit = distributed.get_worker().memory_manager.memory_limit
        if not limit:  # a worker started without a limit
            import psutil

            limit = psutil.virtual_memory().total
        return float(limit)

    def get(self, index: int, ref: tuple) -> _Resident:
        """Shard ``index``, loaded first if this worker does not hold it (a worker restarted under
        the same address comes back empty), and kept: see :meth:`_open`."""
        with self.lock:
            self.moved.discard(index)
            r = self.resident.get(index)
            if r is None:
                r = self.resident[index] = self._open(index, ref)
            return r

    def _open(self, index: int, ref: tuple) -> _Resident:
        """Shard ``index`` read from ``ref`` = (source, the fingerprint the corpus was built on), its
        GPU bytes counted until :meth:`_release`: a ShardError if the shard there changed since."""
        source, built = ref
        shard = shards.open_input(source[0], source[1], bf16_bits=self.bf16_bits)
        now = _fingerprint(shard, source)
        if now != built:
            raise _changed(source, now, built)
        room = self.capacity() - self.gpu_bytes if self.gpu() else None
        r = _make_resident(shard, self.dtype, room)
        self.gpu_bytes += r.nbytes if r.where == "GPU" else 0
        return r

    def _release(self, r: _Resident) -> None:
        """Free shard ``r``'s memory, and take its bytes off the GPU's count (under the lock)."""
        r.release()
        self.gpu_bytes -= r.nbytes if r.where == "GPU" else 0

    @contextlib.contextmanager
    def holding(self, items):
        """The shards ``items`` = [(index, ref)] (:meth:`get`), none of them released while the caller
        uses them: one dropped meanwhile (a move's ``_drop``, on another of the worker's threads) is
        released as the last task using it ends (released at once, it would leave such a task an
        emptied shard, or page-locked memory unlocked under its copies). A shard moved away before
        the task began is read into a copy of the task's own (``moved``), released the same way."""
        with self.lock:
            held = []
            try:
                for index, ref in items:
                    if index in self.moved and index not in self.resident:
                        held.append(self._open(index, ref))
                        held[-1].dropped = True
                    else:
                        held.append(self.get(index, ref))
            except BaseException:  # (a shard that failed to load): the copies read for this task go
                for r in held:
                    if r.dropped:
                        self._release(r)
                raise
            for r in held:
                r.users += 1
        try:
            yield held
        finally:
            with self.lock:
                for r in held:
                    r.users -= 1
                    if r.dropped and not r.users:
                        self._release(r)

    def drop(self, indices, moved: bool = False) -> None:
        """Release shards ``indices`` (``moved``: a move took them to another worker)."""
        with self.lock:
            for i in indices:
                r = self.resident.pop(i, None)
                if moved:
                    self.moved.add(i)
                if r is not None:
                    if r.users:  # released (and uncounted) as the last task using it ends
                        r.dropped = True
                    else:
                        self._release(r)
            if self.gpu():  # hand the memory back to the device, for other processes
                import cupy

                cupy.get_default_memory_pool().free_all_blocks()


def _store(name: str) -> _Store:
    worker = distributed.get_worker()
    try:
        return worker.plugins[name]
    except KeyError:
        raise RuntimeError(f"lik_cupy.distributed: worker {worker.address} has no corpus {name}; it was closed, "
                           "the worker missed the plugin's registration, or the scheduler restarted since the corpus "
                           "loaded (DistributedCorpus.reload puts it back)") from None


# Task bodies. They run on the workers; each takes the corpus's plugin name.


def _probe(name: str) -> float:
    """This worker's capacity in bytes (its weight in the placement)."""
    return _store(name).capacity()


def _load(name: str, work: list[tuple[int, tuple]]) -> list[tuple[int, str]]:
    """Load the shards ``work`` = [(index, ref)] (``_Store.get``); returns where each is held."""
    store = _store(name)
    return [(index, store.get(index, ref).where) for index, ref in work]


def _drop(name: str, indices: list[int]) -> None:
    """Drop the old copies of shards a move loaded on another worker."""
    _store(name).drop(indices, moved=True)


def _top_k(name: str, query: tuple, k: int, work: list[tuple[int, int, tuple]]):
    """This worker's ranking of its shards ``work`` = [(index, first global position, ref)], in
    index order: float32 scores and int64 global positions ``[Nq, <= k]``, and ``[stage]``: what
    the task spent, timed here (``DistributedCorpus.last_search`` lists the keys).

    One ``retrieve`` over the shards, as a single process would call it: the device merges the
    chunks, and positions count on across the shards. The worker's shards are in corpus order, so
    mapping a position to its shard's global range keeps every tie in the same order.
    """
    started, t0 = time.time(), time.perf_counter()
    Q, q_lengths = query
    store = _store(name)
    with store.holding([(index, ref) for index, _, ref in work]) as held:
        t1 = time.perf_counter()
        scores, local = retrieve(Q, [r.part for r in held], k, q_lengths=q_lengths, backend=store.backend)
    t2 = time.perf_counter()
    ends = np.cumsum([r.num_docs for r in held])
    shard = np.searchsorted(ends, local, side="right")  # the shard each local position falls in
    offset = np.array([first for _, first, _ in work], np.int64) - (ends - [r.num_docs for r in held])
    positions = local + offset[shard]
    t3 = time.perf_counter()
    stage = {"worker": distributed.get_worker().address, "started": started, "ended": started + (t3 - t0),
             "task_s": t3 - t0, "retrieve_s": t2 - t1, "positions_s": t3 - t2}
    return scores, positions, [stage]


def _merge_parts(k: int, parts) -> tuple:
    """One ranking of partial rankings ``(scores, positions, stages)``: their top ``k`` and their stages."""
    scores, positions = merge_rankings([(s, i) for s, i, _ in parts], k)
    return scores, positions, [stage for _, _, stages in parts for stage in stages]


def _merge(k: int, *parts):
    """A merge task of the reduction tree: ``_merge_parts``, its own time added to the stages."""
    t0 = time.perf_counter()
    scores, positions, stages = _merge_parts(k, parts)
    merged = {"worker": distributed.get_worker().address, "merge_s": time.perf_counter() - t0}
    return scores, positions, stages + [merged]


def _piece(name: str, query: tuple, index: int, ref: tuple, start: int, stop: int) -> np.ndarray:
    Q, q_lengths = query
    store = _store(name)
    with store.holding([(index, ref)]) as (held,):
        return held.scores(Q, q_lengths, start, stop, store.backend)


def _rerank(name: str, job: tuple, work: list[tuple[int, tuple]]) -> np.ndarray:
    """This worker's part of a rerank: ``job`` = (Q ``[n, Lq, d]``, q_lengths ``[n]`` or None, and for
    each candidate, in the call's row-major order: its query's row of Q, its shard, its index in the
    shard); ``work`` = [(index, ref)], the shards they fall in. float32 ``[m]``, in the job's order."""
    Q, q_lengths, rows, shard, docs = job
    store = _store(name)
    out = np.empty(rows.shape[0], np.float32)
    with store.holding(work) as held:
        for (index, _), r in zip(work, held):
            mine = np.flatnonzero(shard == index)
            out[mine] = r.rerank(Q, q_lengths, rows[mine], docs[mine], store.backend)
    return out


# --------------------------------------------------------------------------- client side


class _Departed(Exception):
    """Workers that a pending call depends on left the cluster (the message lists them)."""


class _Cancelled(_Departed):
    """The scheduler cancelled a pending call's tasks, no worker it depends on missing: a worker
    restarted under its own address (its copy of the queries gone with its process), or
    ``client.restart()``. The message is Dask's reason. Like a departure, the call runs again."""


def _cancelled(error: Exception) -> _Cancelled:
    """The _Cancelled of Dask's CancelledError ``error``, with the scheduler's reason (which its
    FutureCancelledError carries)."""
    return _Cancelled(getattr(error, "reason", None) or str(error) or "no reason given")


class _Unreachable(_Departed):
    """A connection of the client's own to a worker that the scheduler still lists failed (the queries
    sent to it, results gathered from it): a worker restarting under its own address is listed before
    it listens again, and one on its way out is listed still. The message is Dask's error. Like a
    departure, the call runs again (with a RuntimeWarning: the worker list shows no change)."""


def _unreachable(error: OSError) -> _Unreachable:
    return _Unreachable(f"{type(error).__name__}: {error}")


def _release(futures: list) -> None:
    """Release ``futures`` (their keys: the data they name leaves the workers) and forget them."""
    for f in futures:
        f.release()
    futures.clear()


def _forget_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames on the tracebacks of ``error`` and of the errors it
    chains: a caller that keeps the error keeps no futures (nor queries) of the call alive."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # (a frame still running is left as it is)
        todo += [e.__cause__, e.__context__]


class _GaveUp(Exception):
    """A call's ``give_up`` said to stop waiting for it."""


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _source(s, i: int) -> tuple[str, str | None]:
    """(path, lengths path or None), absolute: a relative path means the client's working directory,
    never the one each worker happens to run in."""
    if isinstance(s, (str, os.PathLike)):
        return os.path.abspath(s), None
    if (isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], (str, os.PathLike))
            and (s[1] is None or isinstance(s[1], (str, os.PathLike)))):
        return os.path.abspath(s[0]), None if s[1] is None else os.path.abspath(s[1])
    raise TypeError(f"shard_paths[{i}] must be a path (a shard directory, or a padded [N, L, d] .npy) or a "
                    f"(.npy path, lengths path) tuple; got {s!r}")


def _abandoned(client, name: str) -> None:
    """The finalizer of a corpus collected without close(): a ResourceWarning, as an unclosed file
    gives, and the corpus's plugin (with it every worker's shards) removed without waiting for
    the scheduler, since a finalizer may run on any thread, the client's event loop's too."""
    warnings.warn(f"lik_cupy.distributed: a DistributedCorpus ({name}) was garbage-collected without close(); its "
                  "shards are dropped from the workers now. Call close() (or use a with block) to free them when "
                  "you are done", ResourceWarning, stacklevel=2)
    if client.status != "running":  # closed, or without its scheduler: nothing can reach the workers
        return

    async def unregister():
        with contextlib.suppress(Exception):  # the cluster went away meanwhile: nothing to drop
            await client.scheduler.unregister_worker_plugin(name=name)

    with contextlib.suppress(Exception):  # (a loop closing as the client does)
        client.loop.add_callback(unregister)


class DistributedCorpus:
    """A corpus of shards kept resident on the workers of a Dask cluster, searched there.

    Args:
        client: a ``distributed.Client``. Every worker (and the scheduler, which unpickles the
            tasks) needs lik-cupy installed, and must read the shard paths under the same names
            (a shared file system; relative paths are made absolute on the client).
        shard_paths: the corpus, in order. Each item is a shard directory, a padded
            ``[N, L, d]`` ``.npy``, or a ``(.npy path, lengths path)`` tuple: whatever
            :func:`lik_cupy.shards.open_input` reads. Document positions run on across the
            shards, as in :func:`lik_cupy.retrieve`.
        device_memory_fraction: the share of each worker GPU's memory that resident shards may
            take; the rest is left for scoring. A shard that does not fit stays in page-locked
            host memory and streams through the GPU with each query. Workers' shares of the
            corpus follow these capacities (host memory limits on workers without a GPU).
        dtype: cast float shards to this dtype ("float16", "float32", "bfloat16") as they
            load; None keeps each shard's dtype, which must then be the same for all of them.
        bf16_bits: True or False: read uint16 ``.npy`` inputs as bfloat16 bit patterns.
        backend: "auto", "gpu" or "cpu", for :func:`lik_cupy.retrieve` on the workers.
        timeout: seconds any one wait may take: a scheduler call, loading the shards, a query
            batch, one piece of :meth:`score`. Past it, TimeoutError says what was pending.

    Raises:
        ShardError: a shard cannot be read (the message names the file).
        TimeoutError: no worker joined, or loading did not finish, within ``timeout``.
        ConnectionError: ``client`` is closed (here or in any later call).

    The corpus holds the workers' memory until :meth:`close` (or the end of a ``with`` block); one
    garbage-collected without it drops its shards too, with a ResourceWarning. :meth:`close` from
    another thread while the constructor still runs (an object made by ``__new__`` and handed on
    first, as ``lik serve --scheduler`` does to stop during the load) drops what loaded so far,
    and the constructor raises RuntimeError at its next wait. A cluster that no longer holds the
    corpus (a restarted scheduler, a client closed for good: :meth:`lost`) gets it back with
    :meth:`reload`.

    Threads may share it: their :meth:`search`, :meth:`score` and :meth:`rerank` calls run side by side (a worker
    with several threads runs their tasks at once, and a shard a move drops meanwhile stays until
    the tasks using it end; a task queued before the move reads it into a copy of its own, released
    as it ends); re-placing shards after workers left or joined goes one call at a time.
    ``last_search`` is then the stages of whichever search ended last.

    After each :meth:`search`, ``last_search`` holds where that batch's time went (seconds; the
    stages of the last attempt when workers left mid-call):

    - ``placement_s``: asking the scheduler for the living workers, re-placing shards if any left
      or joined; ``ship_s``: the queries sent to the workers holding shards; ``submit_s``: the
      tasks handed to the scheduler; ``wait_s``: from then until the last ranking was ready;
      ``gather_s``: fetching the (at most ``_FAN_IN``) rankings; ``merge_s``: the client's merge;
      ``total_s``: the whole call.
    - ``tasks``: one dict per worker, timed on the worker: ``task_s`` (the task), ``retrieve_s``
      (``retrieve`` over its shards, the device's top-k and the copy to the host included),
      ``positions_s`` (mapping positions to global ones), ``started``/``ended`` (the worker's
      ``time.time()``), ``dispatch_s`` (from the client's submit to the task's start) and
      ``notice_s`` (from the task's end until the client saw the batch done). The last two
      compare two clocks: exact on one host, off by the clock offset across machines.
    - ``slowest_task_s``, and ``round_trip_s`` = ``wait_s - slowest_task_s``: the scheduler's
      share of the wait (tasks dispatched, completions reported, and any merge tasks).
    - ``merge_tasks``: ``{"worker", "merge_s"}`` per merge task on the workers (more than
      ``_FAN_IN`` workers); ``rankings_to_client`` (what the client fetched and merged);
      ``workers``, ``queries``, ``k``.
    """

    _closed = True  # until the plugin is registered: close() then has nothing to undo
    _close_asked = False  # close() was called: a constructor running in another thread stops
    _built = None  # a reload's corpus: the fingerprints of the corpus it replaces, which every shard must match
    _reloading = None  # the corpus a reload() running in another thread is loading (close() stops it)
    _made = None  # a client reload() made (the corpus's own one had closed): closed with the corpus

    def __init__(self, client, shard_paths, *, device_memory_fraction: float = 0.8, dtype: str | None = None,
                 bf16_bits: bool = False, backend: str = "auto", timeout: float = 300.0):
        if isinstance(shard_paths, (str, os.PathLike)):
            raise TypeError("shard_paths must be a list of paths (a corpus is one or more shards), got one path; "
                            "wrap it in a list")
        self._sources = [_source(s, i) for i, s in enumerate(shard_paths)]
        if not self._sources:
            raise ValueError("shard_paths is empty; give at least one shard")
        if not _is_number(device_memory_fraction):
            raise TypeError(f"device_memory_fraction must be a number in (0, 1], got {device_memory_fraction!r}")
        if not 0 < device_memory_fraction <= 1:
            raise ValueError(f"device_memory_fraction must be in (0, 1], got {device_memory_fraction!r}")
        if isinstance(dtype, np.dtype):  # (its name: the workers cast to it, messages and repr show it)
            dtype = dtype.name
        if dtype is not None and not (isinstance(dtype, str) and dtype in fmt.DTYPES):  # (an array of names is no name)
            raise ValueError(f"dtype must be None or one of {', '.join(fmt.DTYPES)}, got {dtype!r}")
        bf16_bits = check_flag("bf16_bits", bf16_bits)  # (the workers read any truthy value as True)
        check_backend(backend)  # retrieve's check and words, here before any worker is asked
        check_timeout(timeout)
        if not isinstance(client, distributed.Client):
            raise TypeError(f"client must be a distributed.Client (Client(cluster), Client('tcp://host:8786')), got "
                            f"{type(client).__module__}.{type(client).__name__}")
        self.client, self.timeout = client, float(timeout)
        # what reload() loads again with
        self._options = dict(device_memory_fraction=float(device_memory_fraction), dtype=dtype, bf16_bits=bf16_bits,
                             backend=backend, timeout=self.timeout)
        # A closed client forgets its scheduler: kept for the messages that name it
        self._scheduler_address = getattr(client.scheduler, "address", None)
        self._name = f"lik-cupy-corpus-{uuid.uuid4().hex[:12]}"
        self._weights: dict[str, float] = {}  # known living workers -> capacity in bytes
        self._placement: dict[int, str] = {}  # shard -> the worker that should hold it
        self._resident: dict[int, str] = {}  # shard -> the worker that holds it (loaded and confirmed)
        self._where: dict[int, str] = {}  # shard -> "GPU", "pinned host memory", "host memory"
        self._ready_s = 0.0  # seconds the last call's placement check took
        # Calls from several threads re-place shards one at a time: two at once both moved a shard
        # to a worker that joined, and the second then dropped it there as the "old copy".
        self._placing = threading.Lock()
        self.last_search: dict | None = None
        self._live()  # at least one worker, or TimeoutError
        # The scheduler the plugin registers with (asked first: one that restarts in between is told apart)
        self._scheduler_id = self._scheduler_identity()
        self._call("registering the corpus with the workers", client.register_plugin,
                   _Store(float(device_memory_fraction), backend, dtype, bf16_bits), name=self._name)
        # Collected without close(): the shards are dropped all the same (not at interpreter exit,
        # when the client's event loop may already be gone)
        self._finalizer = weakref.finalize(self, _abandoned, client, self._name)
        self._finalizer.atexit = False
        self._closed = False
        try:
            if self._close_asked:  # (by another thread, while the plugin registered)
                raise self._closed_meanwhile("registering the corpus with the workers")
            infos = self._results([client.submit(_describe, s, bf16_bits, pure=False, key=f"lik-cupy-describe-{i}-"
                                                 f"{uuid.uuid4().hex[:8]}") for i, s in enumerate(self._sources)],
                                  set(), "reading the shards' manifests")
            self.dim, self.dtype = self._check(infos, dtype)
            if self._built is not None:  # a reload: each shard as the corpus was built on it
                for (source, built), info in zip(self._built, infos):
                    if info.fingerprint != built:
                        raise _changed(source, info.fingerprint, built)
            self._sizes = {i: info.nbytes for i, info in enumerate(infos)}
            # what each load gets: the shard's source and the fingerprint every reload must match
            self._refs = [(source, info.fingerprint) for source, info in zip(self._sources, infos)]
            self._docs = [info.num_docs for info in infos]
            self._first = np.concatenate([[0], np.cumsum(self._docs)]).astype(np.int64)
            self._ready("while the corpus loaded")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ public

    @property
    def num_docs(self) -> int:
        return int(self._first[-1])

    @property
    def placement(self) -> dict[int, tuple[str, str]]:
        """shard index -> (worker address, "GPU" | "pinned host memory" | "host memory")."""
        return {i: (w, self._where[i]) for i, w in sorted(self._resident.items())}

    def search(self, Q: np.ndarray, k: int, *, q_lengths=None):
        """Top-k documents per query, as :func:`lik_cupy.retrieve` over all shards in one process.

        Args:
            Q: NumPy ``[Nq, Lq, d]`` or ``[Lq, d]`` query tokens, of the corpus's dtype (any float
                dtype for an INT8 corpus: quantized on the workers).
            k: documents per query, 1 .. 4096.
            q_lengths: optional int ``[Nq]`` valid tokens per query (``Q``'s leading rows).

        Returns:
            ``(scores, positions)``: float32 and int64 ``[Nq, min(k, num_docs)]`` (``[min(k,
            num_docs)]`` for a 2-D Q), best first: score descending, ties to the lower global
            position, NaN last. Bitwise the single-process result when the workers score as one
            process would (the same backend and residency: ``retrieve`` over the same arrays).
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_K:
            raise ValueError(f"k must be an integer in [1, {MAX_K}], got {k!r}")
        Q, q_lengths, squeeze = self._queries(Q, q_lengths)
        t0 = time.perf_counter()
        s, i, stages = self._rerun("during a search", lambda owned: self._search(Q, q_lengths, int(k), owned))
        self.last_search = {**stages, "placement_s": self._ready_s, "total_s": time.perf_counter() - t0}
        return (s[0], i[0]) if squeeze else (s, i)

    def score(self, Q: np.ndarray, *, q_lengths=None, out: np.ndarray | None = None, write=None) -> np.ndarray | None:
        """Every score: float32 ``[Nq, num_docs]`` (``[num_docs]`` for a 2-D Q), columns in corpus order.

        The workers score pieces of at most 64 MiB of scores; the client writes each into ``out``
        (a writeable float32 NumPy array of the shape returned, else ValueError; None: a new array) as
        it arrives and returns it. Or, with ``write`` (and no ``out``), hands each piece to
        ``write(first_doc, scores [Nq, n])`` as it arrives and returns None: a result larger than
        memory goes to a file that way (``lik score --full-matrix`` writes each piece in place).
        """
        Q, q_lengths, squeeze = self._queries(Q, q_lengths)
        shape = (self.num_docs,) if squeeze else (Q.shape[0], self.num_docs)
        # checked before any task: a bad out or write would only fail once the first piece came back
        if write is not None:
            if out is not None:
                raise ValueError("give out or write, not both: with write, every piece goes to write and score "
                                 "returns None")
            if not callable(write):
                raise TypeError(f"write must be a callable write(first_doc, scores), got {type(write).__name__}")
        elif out is None:
            out = np.empty(shape, np.float32)
        elif not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != np.float32:
            raise ValueError(f"out must be a float32 NumPy array of shape {list(shape)} (the scores of this Q), got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {list(getattr(out, 'shape', []))}")
        elif not out.flags.writeable:
            raise ValueError(f"out is read-only; give a writeable float32 array of shape {list(shape)}")
        rows = None if out is None else out[None] if squeeze else out  # [Nq, num_docs], as the pieces come
        per = max(1, _PIECE_BYTES // max(1, 4 * Q.shape[0]))
        todo = {(i, a, min(n, a + per)): None for i, n in enumerate(self._docs) for a in range(0, n, per)}
        def into_out(first: int, S: np.ndarray) -> None:
            rows[:, first : first + S.shape[1]] = S

        sink = write if write is not None else into_out
        self._rerun("while scoring", lambda owned: self._fill(Q, q_lengths, todo, sink, owned))
        return out

    def rerank(self, Q: np.ndarray, candidates, *, q_lengths=None) -> np.ndarray:
        """MaxSim of each query against its own candidate documents, as ``Corpus.from_shards(shard_paths,
        ids=False).rerank`` in one process.

        Args:
            Q, q_lengths: as in :meth:`search`.
            candidates: integer ``[Nq, K]`` (``[K]`` for a 2-D Q) global document positions (as
                :meth:`search` returns them), a NumPy array or a list; one outside ``[0, num_docs)``
                raises ValueError naming it, before any task.

        Returns:
            float32 ``[Nq, K]`` (``[K]`` for a 2-D Q), in the candidates' order: -inf for a document
            without tokens, 0 for a query without any. Each worker holding candidates gets the queries
            that have some there and scores only those (one task; each query's candidates gathered
            from its resident shards, as the single-process NumPy path gathers them); on the NumPy
            path bitwise the single-process result.
        """
        Q, q_lengths, squeeze = self._queries(Q, q_lengths)
        cand = self._candidates(candidates, Q.shape[0], squeeze)
        out = np.empty(cand.shape, np.float32)
        if cand.size:
            self._rerun("during a rerank", lambda owned: self._rerank_batch(Q, q_lengths, cand, out, owned))
        return out[0] if squeeze else out

    def close(self) -> None:
        """Drop the shards from every worker (GPU memory included). Idempotent.

        A client that has lost its scheduler (the cluster went away) gets ``_CLOSE_GRACE`` (2 s) to
        get it back, not Dask's reconnect timeout: close then returns with a RuntimeWarning that
        nothing could be dropped, and never raises for a cluster that is gone; so does close on a
        client that is closed already. A scheduler that is connected but does not answer within
        ``timeout`` raises TimeoutError, as any call does.
        """
        self._close_asked = True
        with _CLOSING:
            reloading = self._reloading
        if reloading is not None:  # a reload running in another thread: it stops, and what it loaded leaves
            reloading.close()
        self._close(warn=True)

    def lost(self) -> str | None:
        """Why the cluster no longer holds the corpus, in words; None while, as far as the client can
        tell, it does (and for a closed corpus).

        Either the client is closed (Dask closes one whose scheduler stayed away past its connect
        timeout, ``distributed.comm.timeouts.connect``, 30 s unless configured), or its scheduler is
        not the one the corpus was loaded through: one restarted at the address, which the client
        reconnected to, knows nothing of the corpus, and its workers hold none of it (a Dask worker
        exits when its scheduler goes). :meth:`reload` puts the corpus back. A connected client
        costs one round trip (the scheduler's id, within ``timeout``); while the client is
        reconnecting this says None: which scheduler will answer is not known yet.
        """
        if self._closed:
            return None
        status = self.client.status
        if status in ("closing", "closed"):
            return (f"the Dask client of the scheduler at {self._address()} closed (status {status!r}; Dask closes "
                    "one whose scheduler stays away past its connect timeout)")
        if status != "running":
            return None
        # (a client that loses its scheduler during the call answers with the id it knew: None, not a false alarm)
        now = self._scheduler_identity()
        if now == self._scheduler_id:
            return None
        return (f"the scheduler at {self._address()} is not the one the corpus was loaded through "
                f"({self._scheduler_id} then, {now} now: it restarted), and its workers hold none of the corpus")

    def reload(self, client=None) -> None:
        """Load the corpus again, as the constructor does: its plugin registered anew and every shard
        placed and loaded, through ``client`` (a ``distributed.Client``; None: the corpus's own, or,
        when that one is closed, a new ``Client`` of the same address with its ``security``, which the
        corpus then owns and closes with itself). For a cluster that no longer holds the corpus
        (:meth:`lost`): a restarted scheduler, or a client closed for good.

        Each shard must still be what the corpus was built on: ShardError naming it otherwise (its
        positions and ids would name other documents). Calls keep using the corpus as it was until
        every shard has loaded (one running across the switch may fail, as on a lost cluster, and
        can be made again); then what the corpus held before is dropped where its scheduler can
        still be reached. Raises what the constructor raises (TimeoutError, ShardError, ...), and
        ConnectionError or TimeoutError when a new client cannot reach the address within
        ``timeout``; the corpus is then as it was, and a later reload may succeed. :meth:`close`
        from another thread stops a reload (RuntimeError here) and drops what it loaded.
        """
        if self._closed:
            raise RuntimeError("this DistributedCorpus is closed; open a new one")
        if client is not None and not isinstance(client, distributed.Client):
            raise TypeError(f"client must be a distributed.Client or None (the corpus's own), got "
                            f"{type(client).__module__}.{type(client).__name__}")
        fresh = DistributedCorpus.__new__(DistributedCorpus)
        fresh._built = self._refs
        with _CLOSING:
            if self._reloading is not None:
                raise RuntimeError("lik_cupy.distributed: this DistributedCorpus is already reloading (in another "
                                   "thread); one reload at a time")
            self._reloading = fresh  # (close() from now on stops it)
        made = old = None
        try:
            if client is None:
                client = self.client
                if client.status in ("closing", "closed"):
                    client = made = self._new_client()
            if self._close_asked:
                raise self._closed_meanwhile("reloading")
            fresh.__init__(client, [source for source, _ in self._refs], **self._options)
            with self._placing, _CLOSING:  # (no call of this corpus is placing shards as it switches)
                if not self._close_asked:  # (a client made by an earlier reload stays the corpus's to close)
                    old = self._take(fresh, made or (self._made if client is self._made else None))
            if old is None:
                fresh.close()
                raise self._closed_meanwhile("reloading")
        except BaseException:
            if made is not None:
                with contextlib.suppress(Exception):
                    made.close()
            raise
        finally:
            with _CLOSING:
                self._reloading = None
        old_client, old_name, old_finalizer, old_made = old
        old_finalizer.detach()
        if old_client.status in ("running", "connecting"):  # (a closed one's scheduler went, and its workers)
            try:
                self._unregister(old_client, old_name, warn=True)
            except Exception as e:  # noqa: BLE001 - the reload stands; what the old corpus held is the cluster's
                self._not_dropped(f"{type(e).__name__}: {e}")
        if old_made is not None and old_made is not self.client:
            with contextlib.suppress(Exception):
                old_made.close()

    def _take(self, fresh: DistributedCorpus, made) -> tuple:
        """Serve from ``fresh``, a reload's corpus: its client (``made``: when this corpus made it), its
        plugin and where its shards are. Returns what this corpus held: (client, plugin name,
        finalizer, the client it had made or None). Called under ``_placing`` and ``_CLOSING``."""
        old = (self.client, self._name, self._finalizer, self._made)
        fresh._finalizer.detach()
        fresh._closed = True  # (its plugin is this corpus's now)
        for a in ("client", "_scheduler_address", "_scheduler_id", "_name", "_weights", "_placement", "_resident",
                  "_where"):
            setattr(self, a, getattr(fresh, a))
        self._made = made
        self._finalizer = weakref.finalize(self, _abandoned, self.client, self._name)
        self._finalizer.atexit = False
        return old

    def _new_client(self):
        """A new ``distributed.Client`` of the scheduler at the corpus's address, made as the closed
        one was (its ``security``), with Dask's connect timeout (at most ``timeout``), which bounds
        the TCP connect but not the handshake after it: so it is made on a daemon thread, given up
        on past ``timeout`` or once close() is called, and a client that connects after that is closed."""
        import dask.config
        import dask.utils

        address, security = self._address(), self.client.security
        connect_s = min(self.timeout, dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"),
                                                                 default="s"))
        lock, box = threading.Lock(), {}

        def connect():
            c = distributed.Client.__new__(distributed.Client)
            try:
                c.__init__(address, security=security, timeout=connect_s, set_as_default=False)
            except BaseException:
                # Dask leaves a client that failed to connect with its IO loop thread running: one
                # thread more per attempt, for a reload tried again while the scheduler stays away
                with contextlib.suppress(Exception):
                    c._loop_runner.stop()
                raise
            with lock:
                if not box.get("late"):
                    box["client"] = c
                    return
            c.close()

        done = False
        try:
            self._call(f"connecting a new client to the scheduler at {address}", connect,
                       give_up=lambda: self._close_asked, needs_client=False)
            done = True
        except _GaveUp:
            raise self._closed_meanwhile("connecting a new client") from None
        except TimeoutError:  # (an OSError too) ours: the handshake did not end within timeout
            raise
        except OSError as e:  # Dask's: nothing answered within its connect timeout
            raise ConnectionError(f"lik_cupy.distributed: could not connect a new client to the scheduler at "
                                  f"{address} ({type(e).__name__}: {e})") from None
        finally:
            with lock:
                box["late"] = True
                made = box.pop("client", None)
            if made is not None and not done:
                with contextlib.suppress(Exception):
                    made.close()
        return made

    def _closed_meanwhile(self, what: str) -> RuntimeError:
        return RuntimeError(f"lik_cupy.distributed: the DistributedCorpus was closed (from another thread) while "
                            f"{what}; nothing of it stays on the workers")

    def _close(self, warn: bool) -> None:
        """close(); ``warn``: the RuntimeWarning for a lost scheduler (not when an error that says
        more is ending a ``with`` block)."""
        with _CLOSING:
            if self._closed:
                return
            self._closed = True
        self._finalizer.detach()
        try:
            self._unregister(self.client, self._name, warn)
        finally:
            if self._made is not None:  # (a client of its own, which reload made)
                with contextlib.suppress(Exception):
                    self._made.close()

    def _unregister(self, client, name: str, warn: bool) -> None:
        """Remove the plugin ``name`` (with it every worker's shards) through ``client``: close()'s
        drop, and a reload's of what the corpus held before. ``warn``: as :meth:`_close`'s."""
        if client.status not in ("running", "connecting"):  # closed: no call can reach the workers
            if warn:
                self._not_dropped(f"the Dask client is closed (status {client.status!r}); the scheduler at "
                                  f"{self._address()} cannot be reached through it")
            return
        lost_since = None

        def lost() -> bool:  # the client has been without its scheduler for _CLOSE_GRACE
            nonlocal lost_since
            if client.status == "running":
                lost_since = None
                return False
            lost_since = lost_since or time.monotonic()
            return time.monotonic() - lost_since >= _CLOSE_GRACE

        try:
            self._call("removing the corpus from the workers", client.unregister_worker_plugin, name, give_up=lost)
        except ValueError:  # the scheduler has no such plugin: it restarted since, and its workers hold none of it
            pass
        except (_GaveUp, OSError) as e:
            if not (isinstance(e, (_GaveUp, distributed.comm.CommClosedError)) or client.status != "running"):
                raise  # the scheduler is there but did not answer (TimeoutError), or refused
            if warn:
                self._not_dropped(f"the client has no connection to the scheduler at {self._address()} (status "
                                  f"{client.status!r})")

    @staticmethod
    def _not_dropped(why: str) -> None:
        warnings.warn(f"lik_cupy.distributed: close() could not drop the corpus's shards: {why}; workers that "
                      "outlive it hold them until they exit", RuntimeWarning, stacklevel=outside_stacklevel())

    def __enter__(self) -> DistributedCorpus:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            self._close(warn=exc_type is None)
        except OSError:  # the scheduler is gone as well: the error that ended the block says more
            if exc_type is None:
                raise

    def __repr__(self) -> str:
        per = defaultdict(list)
        for i, w in sorted(self._resident.items()):
            per[w].append(i)
        where = "; ".join(f"{w}: shards {', '.join(map(str, ix))}" for w, ix in sorted(per.items()))
        state = "closed" if self._closed else f"on {len(per)} workers ({where})"
        return (f"DistributedCorpus({len(self._sources)} shards, {self.num_docs} docs, {self.dtype}, d={self.dim}, "
                f"{state})")

    # ------------------------------------------------------------ checks

    def _check(self, infos: list[_Info], dtype: str | None) -> tuple[int, str]:
        """(d, the dtype the workers hold) for shards of one dim and kind; else the error retrieve would give."""
        first = infos[0]
        for (path, _), info in zip(self._sources, infos):
            if info.dim != first.dim:
                raise ValueError(f"{path} has d={info.dim} but {self._sources[0][0]} has d={first.dim}; every shard "
                                 "needs the same embedding dim")
            if (info.dtype == fmt.INT8) != (first.dtype == fmt.INT8):
                raise TypeError(f"{path} holds {info.dtype} tokens but {self._sources[0][0]} holds {first.dtype}: a "
                                "corpus is all INT8 or all float (`lik pack --int8` quantizes a shard)")
            if dtype is None and info.dtype != first.dtype:
                raise ValueError(f"{path} holds {info.dtype} tokens but {self._sources[0][0]} holds {first.dtype}; "
                                 "pass dtype= to cast every shard to one dtype as it loads")
        if dtype is not None and first.dtype == fmt.INT8:
            raise ValueError(f"dtype={dtype!r} casts float shards, but the corpus is INT8; leave dtype=None")
        return first.dim, dtype or first.dtype

    def _queries(self, Q, q_lengths):
        """(Q as contiguous [Nq, Lq, d], q_lengths as [Nq] or None, whether Q was 2-D)."""
        if self._closed:
            raise RuntimeError("this DistributedCorpus is closed; open a new one")
        if not isinstance(Q, np.ndarray):
            raise TypeError(f"Q must be a NumPy array (it is sent to the workers), got {type(Q).__module__}."
                            f"{type(Q).__name__}; copy it to the host first")
        if Q.ndim not in (2, 3) or Q.shape[-1] != self.dim:
            raise ValueError(f"Q must be [Nq, Lq, d] or [Lq, d] with d={self.dim} (the corpus's dim); got shape "
                             f"{list(Q.shape)}")
        if not Q.dtype.isnative:  # retrieve takes the other byte order too: the same values, in native order
            Q = Q.astype(Q.dtype.newbyteorder("="))
        if self.dtype == fmt.INT8:
            if Q.dtype.kind != "f" and Q.dtype.name != "bfloat16":
                raise TypeError(f"Q must hold float tokens (quantized on the workers) for an INT8 corpus; got "
                                f"{Q.dtype}")
        elif Q.dtype != fmt.numpy_dtype(self.dtype):
            raise TypeError(f"Q is {Q.dtype} but the corpus holds {self.dtype}; cast Q (Q.astype(...)) to it")
        squeeze = Q.ndim == 2
        Q = np.ascontiguousarray(Q[None] if squeeze else Q)
        if q_lengths is not None:  # checked here, before any task is sent
            lengths = np.asarray(q_lengths)
            nq, lq = Q.shape[0], Q.shape[1]
            want = () if squeeze else (nq,)  # retrieve's rule: a scalar for a 2-D Q, [Nq] for a 3-D one
            if lengths.shape != want:
                raise ValueError(f"q_lengths has shape {list(lengths.shape)}; expected {list(want)} (one per query)")
            if lengths.dtype.kind not in "iu":
                raise TypeError(f"q_lengths must be integers, got dtype {lengths.dtype}")
            if lengths.size and (lengths.min() < 0 or lengths.max() > lq):
                bad = int(lengths.min()) if lengths.min() < 0 else int(lengths.max())
                raise ValueError(f"q_lengths has {bad}, outside [0, {lq}] (Q's Lq)")
            q_lengths = np.ascontiguousarray(lengths.reshape(nq))
        return Q, q_lengths, squeeze

    def _candidates(self, candidates, nq: int, squeeze: bool) -> np.ndarray:
        """Rerank ``candidates`` of ``nq`` queries as int64 ``[nq, K]``, checked here, before any task."""
        expected = "[K] (Q is one query)" if squeeze else f"[Nq, K] with Nq = {nq}"
        if isinstance(candidates, (list, tuple)):
            candidates = host_ints("candidates", candidates, f"{expected}: K positions for every query")
            if candidates.size == 0:  # (NumPy makes [] float64)
                candidates = candidates.astype(np.int64)
        if not isinstance(candidates, np.ndarray):
            raise TypeError(f"candidates must be a NumPy array or a list of document positions (they are sent to the "
                            f"workers), got {type(candidates).__module__}.{type(candidates).__name__}; copy it to the "
                            "host first")
        if candidates.dtype.kind not in "iu":
            raise TypeError(f"candidates must be integer document positions, got dtype {candidates.dtype}")
        if candidates.ndim != (1 if squeeze else 2) or (not squeeze and candidates.shape[0] != nq):
            raise ValueError(f"candidates has shape {list(candidates.shape)}; expected {expected}")
        if candidates.size:
            check_id_values("candidates", int(candidates.min()), int(candidates.max()), self.num_docs,
                            f"global positions of the corpus's {self.num_docs} documents")
        return np.ascontiguousarray(candidates.reshape(nq, candidates.shape[-1]), np.int64)  # (nq = 0: no -1)

    # ------------------------------------------------------------ waiting

    def _call(self, what: str, fn, *args, give_up=None, needs_client: bool = True, **kwargs):
        """``fn(*args, **kwargs)``, a blocking Dask call without a timeout of its own, bounded by ``timeout``;
        and by ``give_up()``, when given, asked every ``_POLL`` seconds: _GaveUp when it says True
        (the call goes on in its daemon thread until Dask gives up on it). ``needs_client``: the
        call goes through the corpus's client (ConnectionError when that one is closed)."""
        if needs_client and self.client.status in ("closing", "closed"):
            raise self._client_closed(what)
        box = {}

        def run():
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # handed to the caller below
                box["error"] = e

        t = threading.Thread(target=run, name="lik-cupy-dask-call", daemon=True)
        t.start()
        deadline = time.monotonic() + self.timeout
        t.join(self.timeout if give_up is None else min(_POLL, self.timeout))
        while t.is_alive() and give_up is not None and time.monotonic() < deadline:
            if give_up():
                raise _GaveUp(what)
            t.join(min(_POLL, max(0.0, deadline - time.monotonic())))
        if t.is_alive():
            raise TimeoutError(f"lik_cupy.distributed: {what}: the scheduler at {self._address()} did not answer "
                               f"within {self.timeout:g} s (timeout=)")
        if "error" in box:
            # (Dask's error is then an AttributeError of its own)
            if needs_client and self.client.status in ("closing", "closed"):
                raise self._client_closed(what) from box["error"]
            raise box["error"]
        return box.get("value")

    def _client_closed(self, what: str) -> ConnectionError:
        return ConnectionError(f"lik_cupy.distributed: {what}: the Dask client is closed (status "
                               f"{self.client.status!r}); the scheduler at {self._address()} cannot be reached through "
                               "it: open a new Client (a corpus's reload() does, and loads the corpus again)")

    def _scheduler_identity(self) -> str:
        """The id of the scheduler the client is connected to (one round trip): a restarted one's differs."""
        return self._call("asking the scheduler its id", self.client.scheduler_info, **_ID_ONLY)["id"]

    def _address(self) -> str:
        return getattr(self.client.scheduler, "address", None) or self._scheduler_address or "(unknown address)"

    def _live(self) -> set[str]:
        """The workers connected to the scheduler now; waits for one when there is none."""
        workers = self._call("listing the workers", self.client.nthreads)
        if not workers:
            try:
                self._call("waiting for a worker", self.client.wait_for_workers, 1, timeout=self.timeout)
            except (TimeoutError, distributed.TimeoutError):
                raise TimeoutError(f"lik_cupy.distributed: no Dask worker is connected to the scheduler at "
                                   f"{self._address()}, and none joined within {self.timeout:g} s (timeout=); start "
                                   "workers (`dask worker ADDRESS`, or `dask cuda worker ADDRESS` for one per GPU)"
                                   ) from None
            workers = self._call("listing the workers", self.client.nthreads)
        return set(workers)

    def _wait(self, futures: list, workers: set[str], what: str, any_done: bool = False) -> set:
        """The done futures, once all (or, with ``any_done``, at least one) of ``futures`` are done.

        Raises the first failed task's own error; _Departed when one of ``workers`` (those the
        pending tasks are pinned to) left, or the scheduler cancelled a task (_Cancelled);
        TimeoutError when nothing finished within ``timeout``.
        """
        deadline = time.monotonic() + self.timeout
        while True:
            if self._closed:  # (by another thread: its shards are gone from the workers)
                raise self._closed_meanwhile(what)
            left = deadline - time.monotonic()
            if left <= 0:
                busy = f" on {', '.join(sorted(workers))}" if workers else ""
                raise TimeoutError(f"lik_cupy.distributed: {what} did not finish within {self.timeout:g} s "
                                   f"(timeout=){busy}; the workers may be overloaded or stuck (see the Dask "
                                   "dashboard), or the work needs a larger timeout")
            try:
                with self.client.as_current():
                    distributed.wait(futures, timeout=min(_POLL, left),
                                     return_when="FIRST_COMPLETED" if any_done else "ALL_COMPLETED")
            except (TimeoutError, distributed.TimeoutError):
                pass
            except distributed.CancelledError:  # a task whose input (the queries) left with a worker: below
                pass
            failed = [f for f in futures if f.status in ("error", "cancelled")]
            if failed:
                gone = workers - self._live()
                if gone:  # the scheduler forgot the tasks that needed the queries a departed worker held
                    raise _Departed(", ".join(sorted(gone)))
                for f in failed:
                    if f.status == "error":
                        f.result()  # raises the task's exception (ShardError, ValueError, ...)
                # Cancelled, every worker there: one restarted under its address (its process, its
                # copy of the queries and its shards gone), or the scheduler restarted
                try:
                    failed[0].result()
                except distributed.CancelledError as e:
                    raise _cancelled(e) from None
            done = {f for f in futures if f.status == "finished"}
            if len(done) == len(futures) or (any_done and done):
                return done
            gone = workers - self._live()
            if gone:
                raise _Departed(", ".join(sorted(gone)))

    def _results(self, futures: list, workers: set[str], what: str) -> list:
        """The results of ``futures`` once all are done, fetched from their workers at once."""
        self._wait(futures, workers, what)
        # direct: straight from the workers, all at once, not relayed one by one through the scheduler
        return self._fetch(f"fetching the results of {what}", workers, self.client.gather, futures, direct=True)

    def _fetch(self, what: str, workers: set[str], fn, *args, **kwargs):
        """``self._call(what, fn, ...)`` for a fetch of finished tasks' results from ``workers``: a
        worker that left after its task finished took the result (and, for a task that needed the
        shipped queries, the scheduler forgot it): then ``_Departed``, so the call runs again; so
        does a result the scheduler cancelled meanwhile (``_Cancelled``: see ``_wait``)."""
        try:
            return self._call(what, fn, *args, **kwargs)
        except TimeoutError:  # (an OSError too) the scheduler did not answer: as it is
            raise
        except (distributed.CancelledError, OSError) as e:
            gone = workers - self._live()
            if gone:
                raise _Departed(", ".join(sorted(gone))) from None
            if isinstance(e, distributed.CancelledError):
                raise _cancelled(e) from None
            if workers:  # a connection to one of them failed, every one of them listed still
                raise _unreachable(e) from None
            raise

    def _rerun(self, during: str, run):
        """``run(owned)``, again after re-placing shards whenever workers left while it ran, the
        scheduler cancelled its tasks, or a worker still listed could not be reached (those two with a
        RuntimeWarning saying why). ``run`` puts every future it makes in the list ``owned``; they
        are released as it returns or raises (an error that leaves the call holds none of them)."""
        context, cancelled, unreachable = "since the last call", [], []
        for _ in range(_ATTEMPTS):
            t0 = time.perf_counter()
            self._ready(context)
            self._ready_s = time.perf_counter() - t0  # the search's stage times report it
            owned = []
            try:
                result = run(owned)
            except _Cancelled as e:
                cancelled.append(str(e))
                context = f"{during}, which then ran again"
                continue
            except _Unreachable as e:
                unreachable.append(str(e))
                context = f"{during}, which then ran again"
                continue
            except _Departed:
                context = f"{during}, which then ran again"
                continue
            except BaseException as e:  # (a timeout, a task's error): the queries leave the workers now,
                _release(owned)         # not once the caller lets go of the error
                _forget_frames(e)
                raise
            finally:
                _release(owned)
            what = during.removeprefix("during ").removeprefix("while ")
            if cancelled:
                warnings.warn(f"lik_cupy.distributed: the scheduler cancelled the tasks of {what} though no worker "
                              f"they needed was missing (Dask's reason: {'; '.join(dict.fromkeys(cancelled))}), as "
                              "it does when a worker restarts under its own address or the cluster restarts; the "
                              "call then ran again. The results are exact", RuntimeWarning,
                              stacklevel=outside_stacklevel())
            if unreachable:
                warnings.warn(f"lik_cupy.distributed: could not reach a worker that the scheduler still listed "
                              f"{during} ({'; '.join(dict.fromkeys(unreachable))}), as when a worker restarts under "
                              "its own address or is leaving; the call then ran again. The results are exact",
                              RuntimeWarning, stacklevel=outside_stacklevel())
            return result
        why = "; ".join([*([f"tasks cancelled: {'; '.join(dict.fromkeys(cancelled))}"] if cancelled else []),
                         *([f"workers unreachable: {'; '.join(dict.fromkeys(unreachable))}"] if unreachable else [])])
        why = f" ({why})" if why else ""
        raise RuntimeError(f"lik_cupy.distributed: workers left or restarted {during} {_ATTEMPTS} times in a "
                           f"row{why}; the cluster is losing workers faster than the shards reload")

    # ------------------------------------------------------------ placement

    def _ready(self, context: str) -> None:
        """Make every shard resident on the worker the placement gives it, after workers left or joined."""
        with self._placing:
            lost: dict[str, list[int]] = {}  # departed worker -> the shards it held
            for _ in range(_ATTEMPTS):
                live = self._live()
                for w in [w for w in self._weights if w not in live]:
                    lost[w] = sorted(i for i, x in self._resident.items() if x == w)
                    del self._weights[w]
                self._resident = {i: w for i, w in self._resident.items() if w in live}
                try:
                    joined = sorted(live - set(self._weights))
                    if joined:
                        probes = [self.client.submit(_probe, self._name, workers=[w], allow_other_workers=False,
                                                     pure=False, key=f"lik-cupy-probe-{uuid.uuid4().hex[:8]}")
                                  for w in joined]
                        self._weights.update(zip(joined, self._results(probes, set(joined), "probing the workers")))
                    self._placement = _place(self._sizes, self._weights, self._resident)
                    self._move({i: w for i, w in self._placement.items() if self._resident.get(i) != w})
                except _Departed:
                    continue  # the next round drops the departed workers too
                moved = {w: ix for w, ix in lost.items() if ix}
                if moved:
                    warnings.warn(self._story(moved, context), RuntimeWarning, stacklevel=outside_stacklevel())
                return
            raise RuntimeError(f"lik_cupy.distributed: workers kept leaving while shards reloaded ({_ATTEMPTS} "
                               "rounds); the cluster is losing workers faster than the shards load")

    def _move(self, moves: dict[int, str]) -> None:
        """Load shards on their new workers, then drop them where they were."""
        if not moves:
            return
        work = defaultdict(list)
        for i, w in sorted(moves.items()):
            work[w].append((i, self._refs[i]))
        futures = [self.client.submit(_load, self._name, items, workers=[w], allow_other_workers=False, pure=False,
                                      key=f"lik-cupy-load-{uuid.uuid4().hex[:8]}") for w, items in work.items()]
        names = ", ".join(self._sources[i][0] for i in sorted(moves))
        try:
            self._wait(futures, set(work), f"loading {names}")
        except Exception:  # what did load is resident there all the same, and its old copy is dropped
            with contextlib.suppress(Exception):
                self._drop_copies(self._record_loads(work, futures))
            raise
        self._drop_copies(self._record_loads(work, futures))

    def _record_loads(self, work: dict, futures: list) -> dict[str, list[int]]:
        """Note where the finished loads of ``_move`` put their shards; returns the copies they
        replaced, by worker."""
        stale = defaultdict(list)
        for w, f in zip(work, futures):
            for i, where in f.result() if f.status == "finished" else ():
                if i in self._resident:
                    stale[self._resident[i]].append(i)
                self._resident[i], self._where[i] = w, where
        return stale

    def _drop_copies(self, stale: dict[str, list[int]]) -> None:
        """Drop moved shards' old copies on the workers that held them."""
        drops = [self.client.submit(_drop, self._name, ix, workers=[w], allow_other_workers=False, pure=False,
                                    key=f"lik-cupy-drop-{uuid.uuid4().hex[:8]}") for w, ix in stale.items()]
        try:
            self._results(drops, set(stale), "dropping moved shards")
        except _Departed:
            pass  # a worker that left holds nothing anymore

    def _story(self, lost: dict[str, list[int]], context: str) -> str:
        parts = []
        for w, ix in sorted(lost.items()):
            homes = "; ".join(f"{self._sources[i][0]} -> {self._resident[i]}" for i in ix)
            parts.append(f"worker {w} left {context}; its shards reloaded elsewhere ({homes})")
        return "lik_cupy.distributed: " + ". ".join(parts) + ". The results are exact"

    # ------------------------------------------------------------ queries

    def _ship(self, query: tuple, workers: list[str]) -> dict:
        """``query`` on each of ``workers``: worker -> the future of the copy it holds.

        The client sends the copies straight to the workers, not through the scheduler. Up to
        ``_DIRECT_MAX`` workers, each gets its own copy at once, one hop (:meth:`_send`). Beyond,
        one worker gets one copy and Dask copies it on from worker to worker in a tree
        (``replicate``), so what the client uploads does not grow with the cluster.
        """
        if len(workers) <= _DIRECT_MAX:
            return self._send(dict.fromkeys(workers, query))

        def broadcast():
            [future] = self.client.scatter([query], workers=workers, broadcast=True, direct=True, hash=False,
                                           timeout=self.timeout)
            return dict.fromkeys(workers, future)

        return self._sending(workers, broadcast)

    def _send(self, payloads: dict) -> dict:
        """Each worker's own payload (``payloads``: worker -> object), sent straight to it, all at once
        (one hop): worker -> the future of what it holds."""
        async def each():
            return await asyncio.gather(*(self.client.scatter(
                [payload], workers=[w], direct=True, hash=False, timeout=self.timeout, asynchronous=True)
                for w, payload in payloads.items()))

        return self._sending(list(payloads), lambda: {w: copy for w, [copy] in zip(
            payloads, self.client.sync(each, callback_timeout=self.timeout))})

    def _sending(self, workers: list[str], send) -> dict:
        """``send()``, a scatter to ``workers``: TimeoutError past ``timeout``; _Departed when a
        connection closed because one of them left."""
        try:
            return send()
        except (TimeoutError, distributed.TimeoutError):
            raise TimeoutError(f"lik_cupy.distributed: sending the queries to the workers did not finish within "
                               f"{self.timeout:g} s (timeout=)") from None
        except OSError as e:  # a connection to a worker failed: one that left or restarts is the corpus's to handle
            gone = set(workers) - self._live()
            if gone:
                raise _Departed(", ".join(sorted(gone))) from None
            raise _unreachable(e) from None

    def _search(self, Q: np.ndarray, q_lengths, k: int, owned: list):
        """(scores, positions, the batch's stage times: see ``last_search``); the futures made go in ``owned``."""
        clock = time.perf_counter
        work = defaultdict(list)
        for i, w in sorted(self._placement.items()):
            work[w].append((i, int(self._first[i]), self._refs[i]))
        t0 = clock()
        copies = self._ship((Q, q_lengths), list(work))
        owned += copies.values()
        t1, submitted = clock(), time.time()
        tag = uuid.uuid4().hex[:8]
        parts = [self.client.submit(_top_k, self._name, copies[w], k, items, workers=[w], allow_other_workers=False,
                                    pure=False, key=f"lik-cupy-top-k-{tag}-{n}")
                 for n, (w, items) in enumerate(work.items())]
        owned += parts
        level = 0
        while len(parts) > _FAN_IN:  # the reduction tree; a lone leftover goes up a level as it is
            parts = [self.client.submit(_merge, k, *group, pure=False, key=f"lik-cupy-merge-{tag}-{level}-{j}")
                     if len(group) > 1 else group[0]
                     for j, group in enumerate(parts[n : n + _FAN_IN] for n in range(0, len(parts), _FAN_IN))]
            owned += parts
            level += 1
        t2 = clock()
        self._wait(parts, set(work), "a search batch")
        t3, done = clock(), time.time()
        # The root merges here: fetching its (at most _FAN_IN) inputs costs one round trip less
        # than a merge task on a worker and fetching that.
        got = self._fetch("fetching the rankings of a search batch", set(work), self.client.gather, parts, direct=True)
        t4 = clock()
        scores, positions, stages = _merge_parts(k, got)
        t5 = clock()
        tasks = [dict(st, dispatch_s=st["started"] - submitted, notice_s=done - st["ended"])
                 for st in stages if "task_s" in st]
        slowest = max(st["task_s"] for st in tasks)
        return scores, positions, {
            "workers": len(work), "queries": int(Q.shape[0]), "k": k, "rankings_to_client": len(parts),
            "ship_s": t1 - t0, "submit_s": t2 - t1, "wait_s": t3 - t2, "gather_s": t4 - t3, "merge_s": t5 - t4,
            "slowest_task_s": slowest, "round_trip_s": t3 - t2 - slowest,
            "tasks": tasks, "merge_tasks": [st for st in stages if "merge_s" in st],
        }

    def _fill(self, Q: np.ndarray, q_lengths, todo: dict, sink, owned: list) -> None:
        """Score the pieces ``todo`` ((shard, start, stop) -> None), handing each to ``sink(first_doc, scores)``
        and removing it once written; the futures made go in ``owned``."""
        copies = self._ship((Q, q_lengths), sorted({self._placement[piece[0]] for piece in todo}))
        owned += copies.values()
        queues = defaultdict(deque)
        for piece in todo:
            queues[self._placement[piece[0]]].append(piece)
        running: dict = {}  # future -> piece
        busy = Counter()  # worker -> its pieces in flight
        while queues or running:
            for w in list(queues):
                while queues[w] and busy[w] < _PIECES_PER_WORKER:
                    i, a, b = piece = queues[w].popleft()
                    f = self.client.submit(_piece, self._name, copies[w], i, self._refs[i], a, b, workers=[w],
                                           allow_other_workers=False, pure=False,
                                           key=f"lik-cupy-score-{uuid.uuid4().hex[:8]}")
                    owned.append(f)
                    running[f] = (w, piece)
                    busy[w] += 1
                if not queues[w]:
                    del queues[w]
            for f in self._wait(list(running), {w for w, _ in running.values()}, "a piece of score()", any_done=True):
                w, (i, a, b) = running.pop(f)
                busy[w] -= 1
                sink(self._first[i] + a, self._fetch("fetching a piece of score()", {w}, f.result))
                del todo[(i, a, b)]
                f.release()  # (its piece is written: the worker may drop it)

    def _rerank_batch(self, Q: np.ndarray, q_lengths, cand: np.ndarray, out: np.ndarray, owned: list) -> None:
        """Score the checked candidates ``cand`` (int64 [Nq, K]) into ``out``: each worker holding
        some of them gets the queries that have candidates there and, for each candidate in
        row-major order, its query's row among those, its shard and its index in the shard; one
        task per such worker scores them; the client writes each worker's scores back in place. The
        futures made go in ``owned``."""
        flat = cand.reshape(-1)
        shard = np.searchsorted(self._first, flat, side="right") - 1  # (an empty shard never: its start repeats)
        docs = flat - self._first[shard]
        rows = np.repeat(np.arange(cand.shape[0]), cand.shape[1])
        holders = sorted({self._placement[i] for i in np.unique(shard).tolist()})
        number = {w: n for n, w in enumerate(holders)}
        who = np.array([number.get(self._placement[i], -1) for i in range(len(self._sources))])[shard]
        jobs, picks, work = {}, {}, {}
        for n, w in enumerate(holders):
            pick = picks[w] = np.flatnonzero(who == n)
            need = np.unique(rows[pick])  # the queries with candidates on w, ascending
            jobs[w] = (Q[need], None if q_lengths is None else q_lengths[need], np.searchsorted(need, rows[pick]),
                       shard[pick], docs[pick])
            work[w] = [(i, self._refs[i]) for i in np.unique(shard[pick]).tolist()]
        copies = self._send(jobs)
        owned += copies.values()
        tag = uuid.uuid4().hex[:8]
        tasks = [self.client.submit(_rerank, self._name, copies[w], work[w], workers=[w], allow_other_workers=False,
                                    pure=False, key=f"lik-cupy-rerank-{tag}-{n}") for n, w in enumerate(holders)]
        owned += tasks
        got = self._results(tasks, set(holders), "a rerank batch")
        into = out.reshape(-1)
        for w, scores in zip(holders, got):
            into[picks[w]] = scores
