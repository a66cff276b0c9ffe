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

The corpus heals itself (:meth:`ClusterCorpus.watch`, a thread of its own): when the cluster no
longer holds it (``DistributedCorpus.lost``: the client reconnected to a scheduler restarted at the
address, whose workers know nothing of the corpus; or the client closed, its scheduler away past
the reconnect window) it reloads the corpus (``DistributedCorpus.reload``, through a new client of
the same address where the old one closed), attempt after attempt with a bounded backoff, each
failure said once on stderr, and is unavailable until every shard is back. A scheduler seen lost
even for a moment keeps it unavailable until the one that answers is known to be the corpus's; a
call that fails asks at once.

This module imports no Dask: only :func:`load` does, through ``lik_cupy.distributed``.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

from .._cpu import unpack
from .._shard_format import joined_ids

__all__ = ["ClusterCorpus", "load"]

_WATCH_S = 0.1  # seconds between the watch's looks at the client's status (no round trip)
_CHECK_S = 2.0  # seconds between its questions to a connected scheduler: is it still the corpus's?
_BACKOFF_S = (0.5, 10.0)  # a failed reload's wait before the next attempt: the first, doubling up to the last


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
        # Why the corpus is being reloaded (None: it is not); set and cleared by the watch.
        self._reloading: str | None = None
        # The client was seen without its scheduler (by the watch, or a request): the scheduler that
        # answers since may be a new one, so the corpus stays unavailable until the watch has asked.
        self._doubted = False
        self._reloads = 0  # reloads begun: a call that fails after one began ran across it
        self._checking = threading.Lock()  # one question to the scheduler at a time (the watch, a failed call)
        self._stop = threading.Event()

    def __len__(self) -> int:
        return self._corpus.num_docs

    @property
    def ids(self) -> np.ndarray | None:
        return self._ids

    def __repr__(self) -> str:
        return f"ClusterCorpus({self._corpus!r})"

    def close(self) -> None:
        """Stop the watch and close the distributed corpus: a reload under way stops, and what it
        loaded leaves the workers; a client the reloads made closes with it."""
        self._stop.set()
        self._corpus.close()

    def unavailable(self) -> str | None:
        """Why no call can reach the corpus now (None: the client is connected to the scheduler
        that holds it). Reads what the watch found and the client's status, no round trip: cheap
        enough for every request."""
        if self._reloading is not None:
            return self._reloading
        status = self._corpus.client.status
        if status != "running":
            self._doubted = True
            return (f"lost the connection to the Dask scheduler at {self._scheduler} (its client is {status!r}: Dask "
                    f"reconnects while it is 'connecting', and gives up as it closes; the corpus then reloads)")
        if self._doubted:
            return (f"reconnected to the Dask scheduler at {self._scheduler}, not yet known to be the one holding the "
                    "corpus")
        return None

    # ------------------------------------------------------------ healing

    def watch(self) -> None:
        """Start the thread that heals the corpus (the module's docstring says how); :meth:`close`
        stops it."""
        threading.Thread(target=self._watch, name="lik-serve-cluster-watch", daemon=True).start()

    def _watch(self) -> None:
        asked = time.monotonic()
        while not self._stop.wait(_WATCH_S):
            status = self._corpus.client.status
            if status not in ("running", "closing", "closed"):  # reconnecting: to which scheduler, is not known yet
                self._doubted = True
                continue
            if status == "running" and not self._doubted and time.monotonic() - asked < _CHECK_S:
                continue
            why = self._lost()
            if why is not None:
                self._reload(why)
            asked = time.monotonic()

    def _lost(self) -> str | None:
        """``DistributedCorpus.lost``, clearing the doubt when the scheduler is the corpus's; None
        when it cannot tell (no scheduler to ask, or no answer)."""
        with self._checking:
            doubted = self._doubted
            try:
                why = self._corpus.lost()
            except Exception:  # noqa: BLE001 - no answer now: asked again
                return None
            if why is None and doubted and self._corpus.client.status == "running":
                self._doubted = False
            return why

    def _reload(self, why: str) -> None:
        """Reload the corpus until it is back on the scheduler the client is connected to (or the corpus
        closes), unavailable meanwhile."""
        self._reloads += 1
        self._reloading = f"reloading the corpus onto the Dask cluster at {self._scheduler}: {why}"
        print(f"lik serve: not ready: {self._reloading}", file=sys.stderr, flush=True)
        wait, attempt = _BACKOFF_S[0], 0
        while not self._stop.is_set():
            attempt += 1
            try:
                self._corpus.reload()
                # The scheduler may have changed again while the shards loaded (one restarting twice):
                # asked before turning available, not at the watch's next question
                self._doubted = True
                again = self._lost()
                if again is not None:
                    raise ConnectionError(f"the shards loaded, but {again}")
            except Exception as e:  # noqa: BLE001 - said, and tried again
                if self._stop.is_set():
                    return
                print(f"lik serve: reloading the corpus onto the Dask cluster at {self._scheduler} failed (attempt "
                      f"{attempt}): {type(e).__name__}: {e}; trying again in {wait:g} s", file=sys.stderr, flush=True)
                self._stop.wait(wait)
                wait = min(2 * wait, _BACKOFF_S[1])
                continue
            self._reloading = None
            print(f"lik serve: ready again: the corpus is loaded on the Dask cluster at {self._scheduler} (attempt "
                  f"{attempt})", file=sys.stderr, flush=True)
            return

    def _answered(self, call, *args, **kwargs):
        """``call(*args, **kwargs)``, a call of the distributed corpus. One that fails while the corpus
        is lost (asked then: a restart between two of the watch's questions), or once a reload has
        begun since it started (the corpus may be back by the time it fails), raises
        ConnectionError saying so, which the server answers 503 (the corpus unavailable), not as
        the request's fault."""
        reloads = self._reloads
        if self._reloading is not None:
            raise ConnectionError(self._reloading)
        try:
            return call(*args, **kwargs)
        except Exception as e:
            if isinstance(e, (TimeoutError, ConnectionError)):
                raise
            if self._reloading is not None or self._reloads != reloads:  # (lost() may say None: reloaded since)
                raise ConnectionError(f"the corpus was reloaded onto the Dask cluster at {self._scheduler} while the "
                                      f"call ran ({type(e).__name__}: {e})") from e
            if self._corpus.client.status == "running":
                why = self._lost()
                if why is not None:
                    self._doubted = True  # (the watch reloads)
                    raise ConnectionError(f"the corpus is lost from the Dask cluster at {self._scheduler}: {why}") \
                        from e
            raise

    # ------------------------------------------------------------ calls (Corpus's, with packed queries)

    def search(self, Q, k: int, *, q_offsets, precision=None) -> tuple[np.ndarray, np.ndarray]:
        Q, q_lengths = _padded(Q, q_offsets, precision)
        scores, positions = self._answered(self._corpus.search, Q, k, q_lengths=q_lengths)
        return scores, (positions if self._ids is None else self._ids[positions])

    def rerank(self, Q, candidates, *, q_offsets, precision=None) -> np.ndarray:
        Q, q_lengths = _padded(Q, q_offsets, precision)
        return self._answered(self._corpus.rerank, Q, candidates, q_lengths=q_lengths)

    def score(self, Q, *, q_offsets, precision=None) -> np.ndarray:
        Q, q_lengths = _padded(Q, q_offsets, precision)
        return self._answered(self._corpus.score, Q, q_lengths=q_lengths)


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
    replica = ClusterCorpus(corpus, ids)
    replica.watch()
    return replica
