"""A GPU worker's batch moved in one copy each way.

Host queries cost a corpus call a synchronous copy per array (queries, lengths, candidates), and on
the packed (``q_offsets``) path a host unpack and a check of the lengths: a rerank of 1,000 ids for
one 32-token query took 0.40 ms from host arrays in a worker thread on an H200 (0.50 on the worker's
stream), against 0.065 ms from device arrays. :class:`Staging` writes the batch's queries, padded to
the longest, their lengths (only where they differ) and the rerank candidates into one page-locked
buffer, copies it to the device at once on the worker's stream, calls the corpus on device views of
it (the repeat path for rerank, score and, where the corpus's scores stream in one chunk, search),
and copies the results back into a second page-locked buffer, with one wait. Every request was
checked when it was queued, so the device arrays hold no value the host path would refuse.
"""

from __future__ import annotations

import numpy as np

from .._runtime.host_staging import fetch, layout

_MIN_BYTES = 1 << 20


def stageable(corpus, dtype: np.dtype) -> bool:
    """Whether a batch of queries of ``dtype`` for ``corpus`` takes :class:`Staging`: a corpus resident
    on a GPU and float16 or float32 queries (CuPy holds no bfloat16)."""
    return getattr(corpus, "where", None) == "GPU" and dtype in (np.float16, np.float32)


class Staging:
    """One worker's page-locked and device buffers, grown to the largest batch it has moved."""

    def __init__(self):
        self._in = self._out = self._dev = None

    def call(self, corpus, op: str, requests: list, precision) -> tuple[np.ndarray, ...]:
        """``corpus``'s ``op`` on the queries of ``requests`` (each ``.Q`` [n, lq, d], one dtype; its
        ``.arg``: search's k, the same in all, or rerank's int64 candidates [n, K]), on the current
        CuPy stream. Returns host arrays, views of this object's buffers until its next call:
        search ``(scores, ids)``, rerank and score ``(scores,)``."""
        import cupy

        nq = sum(r.n for r in requests)
        lq = max(r.lq for r in requests)
        dim, dtype = requests[0].Q.shape[2], requests[0].Q.dtype
        ragged = any(r.lq != lq for r in requests)
        k = requests[0].arg.shape[1] if op == "rerank" else 0  # candidates per query
        q_at, len_at, cand_at, size = layout(nq * lq * dim * dtype.itemsize, 4 * nq if ragged else 0, 8 * nq * k)
        host = self._in = _pinned(self._in, size)
        q = host[q_at:q_at + nq * lq * dim * dtype.itemsize].view(dtype).reshape(nq, lq, dim)
        cand = host[cand_at:cand_at + 8 * nq * k].view(np.int64).reshape(nq, k)
        at = 0
        for r in requests:
            q[at:at + r.n, :r.lq] = r.Q
            if r.lq < lq:
                q[at:at + r.n, r.lq:] = 0
            if k:
                cand[at:at + r.n] = r.arg
            at += r.n
        if ragged:
            host[len_at:len_at + 4 * nq].view(np.int32)[:] = np.repeat([r.lq for r in requests],
                                                                       [r.n for r in requests])
        if self._dev is None or self._dev.nbytes < size:
            self._dev = cupy.empty(max(size, _MIN_BYTES, 0 if self._dev is None else 2 * self._dev.nbytes), np.uint8)
        dev, stream = self._dev, cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, size, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream.ptr)
        Q = dev[q_at:q_at + q.nbytes].view(dtype).reshape(q.shape)
        lengths = dev[len_at:len_at + 4 * nq].view(np.int32) if ragged else None
        if op == "search":
            out = corpus.search(Q, requests[0].arg, q_lengths=lengths, precision=precision)
        elif op == "rerank":
            out = (corpus.rerank(Q, dev[cand_at:cand_at + cand.nbytes].view(np.int64).reshape(cand.shape),
                                 q_lengths=lengths, precision=precision),)
        else:
            out = (corpus.score(Q, q_lengths=lengths, precision=precision),)
        return fetch(out, stream, self._out_buffer)

    def _out_buffer(self, size: int) -> np.ndarray:
        self._out = _pinned(self._out, size)
        return self._out


def _pinned(buf: np.ndarray | None, size: int) -> np.ndarray:
    """``buf``, or a page-locked uint8 buffer of at least ``size`` bytes (doubling) when it is smaller."""
    if buf is not None and buf.nbytes >= size:
        return buf
    import cupyx

    return cupyx.empty_pinned(max(size, _MIN_BYTES, 0 if buf is None else 2 * buf.nbytes), np.uint8)
