"""Streaming top-k retrieval: the k best documents per query over a corpus of any size.

The corpus is scored in chunks of documents. Each chunk's ``[Nq, C]`` scores
are merged on the device into a running top-k (``cuda_src/topk.cu``), so
``[Nq, Nd]`` never exists for the whole corpus. A corpus on the GPU is read in
place; a corpus in host memory (NumPy, memory-mapped ``.npy``) is streamed
through two pinned staging buffers: while the GPU scores chunk c, host
threads fill the other buffer with chunk c+1 and a copy stream uploads it, so
the GPU's memory use stays flat however large the corpus grows. Tokens (and
INT8 scales) that are page-locked already (``lik_cupy.pin_host``, torch's
``pin_memory()``) skip the staging copy: the copy stream uploads straight from
them, at the host-to-device DMA rate instead of the host's copy rate.

INT8 corpora (int8 tokens with one float32 scale per token, as
``lik_cupy.quantize`` makes them and INT8 shards store them) are scored on INT8
tensor cores: float queries are quantized once per call (on the device, or with
NumPy on the CPU path), the scales travel beside the tokens (staged with them for
host corpora), and a score is the MaxSim of the dequantized tokens. A corpus is
all INT8 or all float; mixing them in one call is refused.

GPU memory used by one call (bytes), with C documents per chunk::

    Q + Nq * C * 4 * (1 + S)             chunk scores; S = ceil(Lq / 32) partial sums
                                         when Lq > 32 (long queries split over tiles)
      + 2 * Nq * k * 12                  running top-k, ping-pong
      + Nq * (C / 4096 + 1) * k * 12     slice winners of the merge, when k <= 1024 and
                                         C > 4096 (``lik_cupy._runtime.topk``)
      + 2 * C * Ld * (d * e + s + 1)     staging, host corpora only (e = 1, 2 or 4 bytes;
                                         s = 4 for an INT8 scale, else 0; + C * 4 for
                                         lengths or mask spans; packed: tokens of C documents)
      + C * 4                            mask spans, masked corpora on the GPU (masks.py)

Q is its int8 copy plus ``Nq * Lq * 4`` bytes of scales for an INT8 corpus.
``max_gpu_bytes`` bounds that sum (C is derived from it); the default is
1 GiB for host corpora and 256 MiB of chunk scores for device corpora.

If the GPU still runs out of memory (other work holds some of it), the chunk
is halved, down to one document, and scoring resumes at the first document not
yet merged; one RuntimeWarning names the old and the new chunk size. When one
document per chunk does not fit either, MemoryError names the allocation and
what to do.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import _dispatch as dispatch
from . import _interop as interop
from ._dispatch.backend import check_backend, scoring_on_gpu
from ._dispatch.precision import fp32_accurate
from ._runtime.topk import MAX_K
from ._streaming.cpu import CpuTopK
from ._streaming.gpu import GpuTopK
from ._streaming.parts import corpus_parts, query_problem, same_kind

__all__ = ["retrieve", "MAX_K"]


def retrieve(Q, D, k, q_mask=None, *, q_lengths=None, q_scales=None, d_offsets=None, d_mask=None, d_lengths=None,
             d_scales=None, max_gpu_bytes=None, backend="auto", precision=None):
    """Top-k documents per query by MaxSim score, streamed over the corpus.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` query tokens (float16, bfloat16 or float32, any
            framework; float64 on the CPU only, as in :func:`lik_cupy.maxsim`); or int8 with
            ``q_scales`` (INT8 corpora only).
        D: the corpus, one of
            - padded ``[Nd, Ld, d]`` (with ``d_mask [Nd, Ld]`` or ``d_lengths [Nd]``),
            - packed tokens ``[T, d]`` with ``d_offsets [Nd + 1]`` (int32/int64, from 0 to T),
            - an iterable of shards, each a padded array or a ``(tokens, offsets)`` tuple;
              document indices then run on across shards.
            On the GPU (CuPy, PyTorch, JAX: read in place, on Q's GPU; host queries are scored on
            the GPU of D's first device shard, where D is one array or a list or tuple, else on the
            current GPU) or in host memory (NumPy or
            memory-mapped ``.npy``: streamed; page-locked by :func:`lik_cupy.pin_host` or
            torch's ``pin_memory()``: streamed without a staging copy). Host bfloat16 must be NumPy with dtype
            ``ml_dtypes.bfloat16``. Same dtype and dim as Q.

            INT8 corpora: int8 tokens, each with one float32 scale (token = int8 values *
            scale, as :func:`lik_cupy.quantize_int8` makes them): a single array D with
            ``d_scales`` (``[Nd, Ld]`` padded, ``[T]`` packed), or shards given as
            ``(docs [n, L, d], scales [n, L])`` (padded, every row valid) or
            ``(tokens [T, d], offsets [n + 1], scales [T])`` (packed). Scales (float32) live
            where their tokens live. A float Q of any float dtype is quantized per token once per
            call; scores are the MaxSim of the dequantized queries and documents. A corpus
            is all INT8 or all float (TypeError otherwise). The GPU scores INT8 for d a
            multiple of 16 up to 4096 (``ElemSpec.dim_rule`` in ``lik_cupy/_dispatch/elements.py``).
        k: documents to return per query, 1 .. 4096.
        q_mask / q_lengths: valid query tokens, as in :func:`lik_cupy.maxsim`: device lengths are not
            read back, and a query whose length is outside ``[0, Lq]`` scores NaN against every
            document (host lengths, or ``LIK_VALIDATE=1``, raise ``ValueError``). The corpus's
            device lengths and offsets follow the same contract (a document with an invalid
            length, or offsets that are negative, decrease or pass T, scores NaN for every
            query; offsets that do not run from 0 to T, every document), with no host wait;
            host ones, and ``LIK_VALIDATE=1``, raise.
        q_scales: float32 ``Q.shape[:-1]``, the scales of an int8 Q (same framework and device),
            each >= 0: a negative or NaN one makes its query's scores NaN (as in
            :func:`lik_cupy.maxsim_int8`).
        d_offsets / d_mask / d_lengths / d_scales: go with a single array D (see above).
        max_gpu_bytes: bound on the GPU memory this call allocates (see the module
            docstring for the formula); it sets the chunk size. If the GPU runs out of
            memory anyway, the chunk is halved (one RuntimeWarning) down to one document,
            then MemoryError.
        backend: "auto", "gpu" or "cpu" (the NumPy path of :func:`lik_cupy.maxsim`; for INT8
            the kernels' arithmetic: exact integer dot products, scaled in float32). "auto" keeps
            host arrays on the CPU where the GPU's kernels lack their dim (an INT8 corpus's, for
            float queries too; a corpus given as an iterator other than a list or tuple is seen
            only as it is read, so its INT8 dim raises ValueError on the GPU instead).
        precision: float32 corpora on the GPU, "fp32" or "tf32", as in :func:`lik_cupy.maxsim`.

    Returns:
        ``(scores, indices)``: float32 (float64 for a float64 Q and corpus) and int64
        ``[Nq, min(k, Nd)]`` (``[min(k, Nd)]`` for a
        2-D Q), best first: score descending, ties to the lower document index, NaN scores
        last. In Q's framework and on Q's device (NumPy Q: NumPy results). A query token
        holding NaN or inf makes its scores against an INT8 corpus NaN (so does a float64 value
        beyond float32's range: float64 queries are quantised in float32, where it is inf).
    Example::

        >>> import numpy as np, lik_cupy
        >>> Q = np.array([[[1, 0]]], np.float32)
        >>> D = np.array([[[0.5, 0]], [[2, 0]], [[1, 0]], [[2, 0]]], np.float32)
        >>> lik_cupy.retrieve(Q, D, k=3, backend="cpu")  # ties go to the lower index
        (array([[2., 2., 1.]], dtype=float32), array([[1, 3, 2]]))
    """
    check_backend(backend)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_K:
        raise ValueError(f"k must be an integer in [1, {MAX_K}], got {k!r}")
    if max_gpu_bytes is not None and (isinstance(max_gpu_bytes, bool) or not isinstance(max_gpu_bytes, (int, np.integer))
                                      or max_gpu_bytes <= 0):
        raise ValueError(f"max_gpu_bytes must be a positive integer, got {max_gpu_bytes!r}")
    parts = corpus_parts(D, d_offsets, d_mask, d_lengths, d_scales)
    qp = query_problem(Q, q_mask, q_lengths, q_scales)
    where = qp
    if isinstance(parts, list):  # known up front: refuse a mixed corpus before scoring any of it
        kind = None
        for part in parts:
            kind = same_kind(kind, interop.describe(part.docs).dtype, part)
        if kind is not None and dispatch.scaled_dtype(kind) and not dispatch.scaled_dtype(qp.dtype):
            # Float queries against INT8 documents run the INT8 kernels, whose dims decide where
            # "auto" scores (as for int8 queries); a float64 Q still stays on the host.
            where = replace(qp, dtype=kind)
    squeeze = len(interop.describe(Q).shape) == 2
    x3 = fp32_accurate(precision, qp.framework, qp.dtype)
    if scoring_on_gpu(where, backend, float64=qp.dtype == "float64"):
        import cupy

        try:
            with interop.GpuCall(qp, _corpus_device(qp, parts)) as g:
                r = GpuTopK(Q, q_mask, q_lengths, q_scales, qp, int(k), max_gpu_bytes, g.device, x3)
                for part in parts:
                    r.add(part)
                s, i = r.result()
        except cupy.cuda.memory.OutOfMemoryError as e:  # outside the chunks, which shrink instead
            raise MemoryError(f"lik_cupy.retrieve: out of GPU memory outside the document chunks ({e}): the "
                              "queries, their masks or scales, or a shard's offsets or lengths do not fit. Score fewer "
                              "queries per call or free GPU memory held elsewhere") from e
    else:
        r = CpuTopK(Q, q_mask, q_lengths, q_scales, qp, int(k))
        for part in parts:
            r.add(part)
        s, i = r.result()
    return (s[0], i[0]) if squeeze else (s, i)


def _corpus_device(qp, parts) -> int | None:
    """The GPU a call of host queries scores on: that of the corpus's first device shard where the
    shards are known up front (a list), so that host queries go to the corpus; None (the current
    GPU) otherwise, and for device queries (their own GPU)."""
    if qp.device is not None or not isinstance(parts, list):
        return None
    return next((d for d in (interop.describe(part.docs).device for part in parts) if d is not None), None)
