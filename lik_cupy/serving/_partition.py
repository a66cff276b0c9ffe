"""A corpus split over devices, for :class:`lik_cupy.serving.Batcher`: when one copy of the documents
does not fit each GPU, each GPU holds consecutive shards and a call runs on every part at once.

A :class:`Partition` answers ``search``, ``rerank`` and ``score`` with packed queries as one
:class:`lik_cupy.Corpus` over all the documents does:

- ``score``: each part's columns, side by side.
- ``search``: each part's top k, merged exactly: score descending, ties to the lower global
  position, NaN last (``Corpus.search``'s order), then the shards' ids.
- ``rerank``: each candidate goes to the part that holds it; a part scores only its candidates
  (its rows padded to its longest, the padding dropped).

Scores: on the CPU path a document's score does not depend on the rest of the call, so a partition
answers bitwise as the whole corpus does (``tests/test_serve.py``). On GPUs each part's call takes
the kernels its own size selects, whose scores agree to float rounding.

A batch queued for GPU parts (``_queue.scored``) takes :meth:`Partition.staged`: each part's share
of it moves by a :class:`Staging` of its own, in one copy each way, as a GPU replica's batch does,
instead of the packed host path of the calls above.

The parts' calls run at once, a thread each, where an operation's parts take long enough for their
GPU work to overlap; an operation whose parts' last calls were short (``SEQUENTIAL_MAX_S``) runs
them one after another in the calling thread instead, since short calls are mostly Python, which
the threads would only take turns at under the GIL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..corpus import Corpus
from ._staging import Staging, stageable

__all__ = ["Partition", "split_shards", "devices_per_part", "SEQUENTIAL_MAX_S"]

# An operation whose slowest part took at most this on its last call runs its parts in sequence in the
# calling thread. Two H200s, 100,000 documents a part (bench/results/archive/serve_partition_nvidia-h200/):
# a rerank of 1,000 ids took 0.31 ms on one part alone and 1.31 ms over both parts in threads (each
# part's call 0.80-0.82 ms there, the two taking turns at the GIL); staged (Partition.staged), 0.52 ms
# in threads and 0.29 in sequence, a search 1.63 in threads and 2.29 in sequence.
SEQUENTIAL_MAX_S = 0.6e-3


class Partition:
    """Consecutive parts of one corpus, each a :class:`Corpus` on its own device (see the module
    docstring). ``parts``: corpora of one dtype and dim, without ids, in document order; ``ids``:
    the external ids of all their documents, or None."""

    def __init__(self, parts: list[Corpus], ids: np.ndarray | None = None):
        if len(parts) < 2:
            raise ValueError("a partition needs at least two parts")
        first = parts[0]
        for p in parts[1:]:
            if (p.dim, p.dtype) != (first.dim, first.dtype):
                raise ValueError(f"partition parts differ: {p!r} against {first!r}")
        if any(p.ids is not None for p in parts):
            raise ValueError("partition parts must have no ids of their own; give the partition's ids")
        self.parts = list(parts)
        self.starts = np.cumsum([0] + [len(p) for p in parts], dtype=np.int64)
        if ids is not None and len(ids) != self.starts[-1]:
            raise ValueError(f"ids has {len(ids)} entries for {self.starts[-1]} documents")
        self._ids = ids
        self.dim, self.dtype = first.dim, first.dtype
        self.device = None  # the parts keep their own devices; a queue over a partition makes no context
        self._pool = ThreadPoolExecutor(len(parts), thread_name_prefix="lik-serve-part")
        self._local = threading.local()  # per thread: a stream per device, a Staging per part
        self._part_s: dict[str, float] = {}  # operation -> its slowest part's last call, seconds

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def ids(self) -> np.ndarray | None:
        return self._ids

    @property
    def part_devices(self) -> list[int | None]:
        return [p.device for p in self.parts]

    def __repr__(self) -> str:
        where = ", ".join("host memory" if p.device is None else f"cuda:{p.device}" for p in self.parts)
        return f"Partition({len(self)} documents in {len(self.parts)} parts, dim {self.dim}, {self.dtype}; {where})"

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------ calls (Corpus's, with packed queries)

    def score(self, Q, *, q_offsets, precision=None) -> np.ndarray:
        cols = self._each("score", lambda p, _: p.score(Q, q_offsets=q_offsets, precision=precision))
        return np.concatenate(cols, axis=1)

    def search(self, Q, k: int, *, q_offsets, precision=None) -> tuple[np.ndarray, np.ndarray]:
        return self._merged(self._each("search", lambda p, _: p.search(Q, k, q_offsets=q_offsets, precision=precision)), k)

    def rerank(self, Q, candidates, *, q_offsets, precision=None) -> np.ndarray:
        cand = np.asarray(candidates, np.int64)
        shares = self._shares(cand)

        def part(p, n):
            if shares[n] is not None:
                return p.rerank(Q, shares[n][2], q_offsets=q_offsets, precision=precision)

        return self._placed(cand.shape, shares, self._each("rerank", part))

    # ------------------------------------------------------------ a queued batch on GPU parts

    def stageable(self, dtype: np.dtype) -> bool:
        """Whether a batch of queries of ``dtype`` takes :meth:`staged`: every part resident on a GPU."""
        return all(stageable(p, dtype) for p in self.parts)

    def staged(self, op: str, requests: list, precision) -> tuple[np.ndarray, ...]:
        """``op`` for a batch of queued requests (each ``.Q`` [n, lq, d]; ``.arg``: search's k, or
        rerank's global candidates [n, K]) on GPU parts, each part's share moved by a :class:`Staging`
        of the running thread's for that part. Returns the batch's rows in order, as
        ``Staging.call`` does: search ``(scores, ids)``, rerank and score ``(scores,)``."""
        shares = None
        if op == "rerank":
            cand = np.concatenate([r.arg for r in requests]) if len(requests) > 1 else requests[0].arg
            shares = self._shares(cand)

        def part(p, n):
            reqs = requests
            if shares is not None:
                if shares[n] is None:
                    return None
                local, at, reqs = shares[n][2], 0, []
                for r in requests:
                    reqs.append(dataclasses.replace(r, arg=local[at:at + r.n]))
                    at += r.n
            by_part = self._local.__dict__.setdefault("staging", {})
            out = by_part.setdefault(n, Staging()).call(p, op, reqs, precision)
            return tuple(np.array(a) for a in out)  # (views of the Staging's buffers until its next call)

        found = self._each(op, part)
        if op == "search":
            return self._merged(found, requests[0].arg)
        if op == "score":
            return (np.concatenate([f[0] for f in found], axis=1),)
        return (self._placed(cand.shape, shares, [None if f is None else f[0] for f in found]),)

    def _merged(self, found: list, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each part's top k (scores, part positions) merged into the partition's: score descending, ties
        to the lower global position, NaN last; positions as the shards' ids where there are ids."""
        scores = np.concatenate([s for s, _ in found], axis=1)
        pos = np.concatenate([i.astype(np.int64) + self.starts[n] for n, (_, i) in enumerate(found)], axis=1)
        nan = np.isnan(scores)
        order = np.lexsort((pos, -np.where(nan, 0, scores), nan), axis=1)[:, :min(k, len(self))]
        scores, pos = np.take_along_axis(scores, order, 1), np.take_along_axis(pos, order, 1)
        return scores, (pos if self._ids is None else self._ids[pos])

    def _shares(self, cand: np.ndarray) -> list:
        """Per part, None where no candidate of ``cand`` [nq, K] is its, else ``(rank, keep, local)``:
        each row's candidates of the part first (stable: in the row's order) as their columns in
        ``cand``, which of them are the part's, and their positions in the part, padded with 0."""
        owner = np.searchsorted(self.starts, cand, side="right") - 1
        shares = []
        for n in range(len(self.parts)):
            mine = owner == n
            width = int(mine.sum(axis=1).max(initial=0))
            if width == 0:
                shares.append(None)
                continue
            rank = np.argsort(~mine, axis=1, kind="stable")[:, :width]
            local = np.take_along_axis(cand, rank, 1) - self.starts[n]
            keep = np.take_along_axis(mine, rank, 1)
            local[~keep] = 0
            shares.append((rank, keep, local))
        return shares

    @staticmethod
    def _placed(shape: tuple, shares: list, scores: list) -> np.ndarray:
        """The parts' rerank scores (None: a part without candidates) put back in the candidates' places."""
        out = np.empty(shape, np.float32)
        for share, s in zip(shares, scores):
            if share is not None:
                rank, keep, _ = share
                rows = np.nonzero(keep)
                out[rows[0], rank[rows]] = s[rows]
        return out

    def _each(self, op: str, call) -> list:
        """``call(part, n)`` on every part, each on its part's device and a stream of the running
        thread's: at once in the pool's threads (the parts' calls overlap across GPUs), or in sequence
        in this thread where ``op``'s slowest part took at most ``SEQUENTIAL_MAX_S`` last time."""
        took = [0.0] * len(self.parts)

        def run(n):
            p = self.parts[n]
            t0 = time.perf_counter()
            with self._device(p):
                r = call(p, n)
            took[n] = time.perf_counter() - t0
            return r

        if self._part_s.get(op, float("inf")) <= SEQUENTIAL_MAX_S:
            out = [run(n) for n in range(len(self.parts))]
        else:
            out = list(self._pool.map(run, range(len(self.parts))))
        self._part_s[op] = max(took)
        return out

    def _device(self, part: Corpus):
        if part.device is None:
            return contextlib.nullcontext()
        import cupy

        streams = self._local.__dict__.setdefault("by_device", {})
        if part.device not in streams:
            with cupy.cuda.Device(part.device):
                streams[part.device] = cupy.cuda.Stream(non_blocking=True)
        stack = contextlib.ExitStack()
        stack.enter_context(cupy.cuda.Device(part.device))
        stack.enter_context(streams[part.device])
        return stack


def devices_per_part(devices: list) -> list:
    """The devices a partition over ``devices`` (CUDA ordinals or "cpu") takes a part on: each GPU once,
    in order; every "cpu" entry a host-memory part of its own."""
    return [d for i, d in enumerate(devices) if d == "cpu" or d not in devices[:i]]


def split_shards(paths: list, counts: list[int], parts: int) -> list[list]:
    """``paths`` (shards of ``counts`` documents) cut into ``parts`` runs of consecutive shards with
    document counts as even as whole shards allow; every run holds a shard at least."""
    if parts > len(paths):
        raise ValueError(f"{len(paths)} shards cannot be split over {parts} devices; give a shard per device at least")
    ends = np.cumsum(counts)
    total, cuts, at = int(ends[-1]), [], 0
    for n in range(1, parts):
        # the shard boundary nearest to the n-th even share, leaving a shard for each later run
        target = total * n / parts
        j = int(np.argmin(np.abs(ends[at:len(paths) - (parts - n)] - target))) + at + 1
        cuts.append(j)
        at = j
    bounds = [0, *cuts, len(paths)]
    return [list(paths[a:b]) for a, b in zip(bounds, bounds[1:])]
