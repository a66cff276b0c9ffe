"""A corpus resident on a Dask cluster as a :class:`lik_cupy.serving.Batcher` replica: ``lik serve
--scheduler``.

:class:`ClusterCorpus` answers the batcher's calls (``search``, ``rerank`` and ``score`` of packed
queries, as :class:`lik_cupy.Corpus` takes them) through a
:class:`lik_cupy.distributed.DistributedCorpus`: the packed queries go padded to the longest, with
their lengths; search's global positions come back as the shards' ids. Each batch is one call of
the distributed corpus: its queries shipped to the workers holding shards (or, for rerank,
candidates), one task on each, the results gathered, the way ``DistributedCorpus`` makes every
call. On the NumPy path a query's scores do not depend on the rest of the call, so the answers are
bitwise those of one ``Corpus`` over the same shards (``tests/test_serve_dask.py``).

While its client has no scheduler (the cluster went away; Dask's client tries to reconnect for
its connect timeout, then closes) no call can succeed: :meth:`ClusterCorpus.unavailable` says so,
from the client's status alone, and the server reads it as not ready (:class:`lik_cupy.serving.Batcher`'s
``unavailable``).

This module imports no Dask: only :func:`load` does, through ``lik_cupy.distributed``.
"""

from __future__ import annotations

import numpy as np

from .._cpu import unpack
from .._shard_format import joined_ids

__all__ = ["ClusterCorpus", "load"]


class ClusterCorpus:
    """A :class:`lik_cupy.distributed.DistributedCorpus` (``corpus``) with ``ids``, the external ids of
    its documents (None: positions), answering as a ``Corpus`` with packed queries does; closing it
    closes the distributed corpus (the batcher does, as it closes). ``device`` is None: the batch
    runs on the cluster's workers, each on its own GPU or on the NumPy path."""

    # Why a request's precision is refused (by the batcher, as it is checked): it cannot reach the workers.
    no_precision = ("the corpus is on a Dask cluster, whose workers score at their own precision (LIK_PRECISION "
                    "where they run); leave it out")

    def __init__(self, corpus, ids: np.ndarray | None = None):
        if ids is not None and len(ids) != corpus.num_docs:
            raise ValueError(f"ids has {len(ids)} entries for {corpus.num_docs} documents")
        self._corpus, self._ids = corpus, ids
        self.dim, self.dtype = corpus.dim, corpus.dtype
        self.device = None
        # (read now: a client that closes, its scheduler gone, forgets the address)
        self._scheduler = getattr(corpus.client.scheduler, "address", None) or "(unknown address)"

    def __len__(self) -> int:
        return self._corpus.num_docs

    @property
    def ids(self) -> np.ndarray | None:
        return self._ids

    def __repr__(self) -> str:
        return f"ClusterCorpus({self._corpus!r})"

    def close(self) -> None:
        self._corpus.close()

    def unavailable(self) -> str | None:
        """Why no call can reach the cluster now (None: the client is connected to its scheduler).
        Reads the client's status, no round trip: cheap enough for every request."""
        status = self._corpus.client.status
        if status == "running":
            return None
        return (f"lost the connection to the Dask scheduler at {self._scheduler} (its client is {status!r}: Dask "
                f"reconnects while it is 'connecting', and has given up once it is 'closed')")

    # ------------------------------------------------------------ calls (Corpus's, with packed queries)

    def search(self, Q, k: int, *, q_offsets, precision=None) -> tuple[np.ndarray, np.ndarray]:
        Q, q_lengths = _padded(Q, q_offsets, precision)
        scores, positions = self._corpus.search(Q, k, q_lengths=q_lengths)
        return scores, (positions if self._ids is None else self._ids[positions])

    def rerank(self, Q, candidates, *, q_offsets, precision=None) -> np.ndarray:
        Q, q_lengths = _padded(Q, q_offsets, precision)
        return self._corpus.rerank(Q, candidates, q_lengths=q_lengths)

    def score(self, Q, *, q_offsets, precision=None) -> np.ndarray:
        Q, q_lengths = _padded(Q, q_offsets, precision)
        return self._corpus.score(Q, q_lengths=q_lengths)


def _padded(tokens: np.ndarray, q_offsets: np.ndarray, precision) -> tuple[np.ndarray, np.ndarray]:
    """Packed queries (``tokens`` ``[Tq, d]``, ``q_offsets`` int ``[Nq + 1]``) as ``[Nq, Lq, d]``, zero
    past each query's tokens (Lq: the longest), and their lengths int64 ``[Nq]``."""
    if precision is not None:
        raise ValueError(f"precision={precision!r}: {ClusterCorpus.no_precision}")
    offsets = np.asarray(q_offsets, np.int64)
    return unpack(tokens, offsets)[0], np.diff(offsets)


def load(client, paths: list, opened: list, started=None, **kwargs) -> ClusterCorpus:
    """The documents of shard ``paths`` (shard directories or padded ``.npy`` files, as ``lik serve``
    takes them) resident on the workers of ``client`` (a ``distributed.Client``), which read them
    under the same names; ``opened``: the same shards opened here (:func:`lik_cupy.shards.open_input`),
    whose ids this reads; ``kwargs`` go to ``DistributedCorpus``. Returns once every shard is loaded.
    ``started(corpus)``, when given, receives the ``DistributedCorpus`` before it loads: closing it
    from another thread then stops the load (RuntimeError here) and drops what loaded."""
    from ..distributed import DistributedCorpus

    ids = joined_ids(opened)  # (as Corpus.from_shards joins them; checked before any worker loads a shard)
    corpus = DistributedCorpus.__new__(DistributedCorpus)
    if started is not None:
        started(corpus)
    corpus.__init__(client, list(paths), **kwargs)
    return ClusterCorpus(corpus, ids)
