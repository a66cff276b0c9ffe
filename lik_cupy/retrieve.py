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
                                         C > 4096 (see _merge)
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

import os
import sys
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from . import _cpu as cpu
from . import _dispatch as dispatch
from . import _interop as interop
from .precision import _resolve as _fp32_accurate
from ._dispatch.backend import check_backend, scoring_on_gpu
from ._interop import device_array, host_array
from ._ranking import merge_ranked
from ._runtime.launch import launch
from ._runtime.device_checks import Marks, call_checks, strict
from ._runtime.operands import (check_scales_of_valid, device_offsets, device_valid, host_metadata, host_offsets,
                                valid_host)
from ._runtime.pinned import span_page_locked
from ._validate import (Problem, check_call, check_length_values, check_scales, check_valid, check_varlen,
                        offsets_count)
from .errors import DeviceMemoryError

__all__ = ["retrieve", "MAX_K"]

MAX_K = 4096  # the merge kernel ranks up to this many candidates in shared memory
# Scores per CTA in the first of a long chunk's two merge launches (one CTA per query spent
# 0.34 ms on 32 x 100,000 scores on an H100, against 8.4 ms for the scoring itself), taken
# while k is at most a quarter of it (the winners then stay a fraction of the chunk).
_MERGE_SLICE = 4096
_MERGE_CACHE = 4096  # candidates of a row whose keys the merge kernel keeps in shared memory
_MAX_CHUNK_DOCS = 2**31 - 1 - MAX_K  # the merge kernel counts running + chunk candidates in an int
_DEFAULT_HOST_BUDGET = 1 << 30
_DEFAULT_SCORE_BYTES = 256 << 20
_CPU_STEP_BYTES = 64 << 20
_COPY_THREADS = max(1, min(16, os.cpu_count() or 1))
_BUDGET_SLACK = 0.97  # allocator rounding and small per-chunk buffers stay inside max_gpu_bytes


@dataclass
class _Part:
    """One shard of the corpus: padded ``docs [n, L, d]`` (mask or lengths) or packed ``tokens [T, d]`` + offsets;
    int8 tokens with their float32 ``scales`` (``[n, L]`` or ``[T]``). ``index``: the shard's position in an
    iterable corpus, None for a single array D."""

    docs: object
    offsets: object = None
    mask: object = None
    lengths: object = None
    scales: object = None
    index: int | None = None

    @property
    def packed(self) -> bool:
        return self.offsets is not None

    @property
    def name(self) -> str:
        return "the corpus" if self.index is None else f"shard {self.index}"


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
            On the GPU (CuPy, PyTorch, JAX: read in place) or in host memory (NumPy or
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
            multiple of 16 up to ``dispatch.MAX_DIM_INT8`` (4096).
        k: documents to return per query, 1 .. 4096.
        q_mask / q_lengths: valid query tokens, as in :func:`lik_cupy.maxsim`: device lengths are not
            read back, and a query whose length is outside ``[0, Lq]`` scores NaN against every
            document (host lengths, or ``LIK_VALIDATE=1``, raise ``ValueError``). The corpus's
            device lengths and offsets follow the same contract (a document with an invalid
            length, or offsets that are negative, decrease or pass T, scores NaN for every
            query; offsets that do not run from 0 to T, every document), with no host wait;
            host ones, and ``LIK_VALIDATE=1``, raise.
        q_scales: float32 ``Q.shape[:-1]``, the scales of an int8 Q (same framework and device),
            each >= 0 (checked: one small reduction).
        d_offsets / d_mask / d_lengths / d_scales: go with a single array D (see above).
        max_gpu_bytes: bound on the GPU memory this call allocates (see the module
            docstring for the formula); it sets the chunk size. If the GPU runs out of
            memory anyway, the chunk is halved (one RuntimeWarning) down to one document,
            then MemoryError.
        backend: "auto", "gpu" or "cpu" (the NumPy path of :func:`lik_cupy.maxsim`; for INT8
            the kernels' arithmetic: exact integer dot products, scaled in float32).
        precision: float32 corpora on the GPU, "fp32" or "tf32", as in :func:`lik_cupy.maxsim`.

    Returns:
        ``(scores, indices)``: float32 (float64 for a float64 Q and corpus) and int64
        ``[Nq, min(k, Nd)]`` (``[min(k, Nd)]`` for a
        2-D Q), best first: score descending, ties to the lower document index, NaN scores
        last. In Q's framework and on Q's device (NumPy Q: NumPy results). A query token
        holding NaN or inf makes its scores against an INT8 corpus NaN.
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
    if max_gpu_bytes is not None and (not isinstance(max_gpu_bytes, (int, np.integer)) or max_gpu_bytes <= 0):
        raise ValueError(f"max_gpu_bytes must be a positive integer, got {max_gpu_bytes!r}")
    parts = _parts(D, d_offsets, d_mask, d_lengths, d_scales)
    qp = _query_problem(Q, q_mask, q_lengths, q_scales)
    if isinstance(parts, list):  # known up front: refuse a mixed corpus before scoring any of it
        kind = None
        for part in parts:
            kind = _same_kind(kind, interop.describe(part.docs).dtype, part)
    squeeze = len(interop.describe(Q).shape) == 2
    x3 = _fp32_accurate(precision, qp.framework, qp.dtype)
    if scoring_on_gpu(qp, backend):
        import cupy

        device = qp.device if qp.device is not None else cupy.cuda.runtime.getDevice()
        try:
            with interop.caller_stream(qp.framework, device):
                r = _Gpu(Q, q_mask, q_lengths, q_scales, qp, int(k), max_gpu_bytes, device, x3)
                for part in parts:
                    r.add(part)
                s, i = r.result()
        except cupy.cuda.memory.OutOfMemoryError as e:  # outside the chunks, which shrink instead
            raise MemoryError(f"lik_cupy.retrieve: out of GPU memory outside the document chunks ({e}): the "
                              "queries, their masks or scales, or a shard's offsets or lengths do not fit. Score fewer "
                              "queries per call or free GPU memory held elsewhere") from e
    else:
        r = _Cpu(Q, q_mask, q_lengths, q_scales, qp, int(k))
        for part in parts:
            r.add(part)
        s, i = r.result()
    return (s[0], i[0]) if squeeze else (s, i)


def _parts(D, d_offsets, d_mask, d_lengths, d_scales) -> Iterable[_Part]:
    """The corpus as parts: a list when D is one array or a list/tuple of shards, else a generator."""
    if _is_array(D):
        return [_Part(D, d_offsets, d_mask, d_lengths, d_scales)]
    if d_offsets is not None or d_mask is not None or d_lengths is not None or d_scales is not None:
        raise TypeError("d_offsets, d_mask, d_lengths and d_scales go with a single array D; give each shard as "
                        "(tokens, offsets), or for INT8 as (tokens, offsets, scales) or (docs, scales)")
    if isinstance(D, (str, bytes)) or not isinstance(D, Iterable):
        raise TypeError(f"D must be an array or an iterable of shards, got {type(D).__name__}")
    shards = (_shard(i, s) for i, s in enumerate(D))
    return list(shards) if isinstance(D, (list, tuple)) else shards


def _shard(i: int, s) -> _Part:
    if _is_array(s):
        return _Part(s, index=i)
    if isinstance(s, tuple) and len(s) in (2, 3) and all(_is_array(x) for x in s):
        if len(s) == 3:
            return _Part(s[0], s[1], scales=s[2], index=i)
        first = interop.describe(s[0])
        if first.dtype == "int8" and len(first.shape) == 3:  # padded INT8 docs and their scales
            return _Part(s[0], scales=s[1], index=i)
        return _Part(s[0], s[1], index=i)
    raise TypeError(f"shard {i} must be a padded array [n, L, d], a (tokens [T, d], offsets [n + 1]) tuple, or for "
                    f"INT8 a (tokens [T, d], offsets [n + 1], scales [T]) or (docs [n, L, d], scales [n, L]) tuple; "
                    f"got {type(s).__name__}")


def _is_array(x) -> bool:
    try:
        interop.framework_of(x)
        return not isinstance(x, (list, tuple))
    except TypeError:
        return False


def _query_problem(Q, q_mask, q_lengths, q_scales) -> Problem:
    """Check the queries on their own: float Q as :func:`lik_cupy.maxsim` checks it, or int8 Q with q_scales."""
    try:
        info = interop.describe(Q)
    except TypeError as e:
        raise TypeError(f"Q: {e}") from None
    if info.dtype != "int8":
        if q_scales is not None:
            raise ValueError(f"q_scales goes with an int8 Q, but Q is {info.dtype} (it is quantised on the fly)")
        return check_call(Q, Q, q_mask, None, q_lengths, None, pairs=False)
    if q_scales is None:
        raise TypeError("Q is int8 but q_scales is missing: pass its float32 per-token scales (Q's shape without the "
                        "last axis), or pass float Q, which is quantized per call")
    if len(info.shape) not in (2, 3):
        raise ValueError(f"Q must be [Nq, Lq, d] or [Lq, d]; got shape {list(info.shape)}")
    if info.shape[-1] < 1:
        raise ValueError("Q has embedding dim 0; expected at least 1")
    check_scales("q_scales", q_scales, info, tuple(info.shape[:-1]), "one per query token")
    q_valid = check_valid("q", q_mask, q_lengths, info, info.shape[:-1], info.shape[:-2])
    nq, lq = (info.shape[0], info.shape[1]) if len(info.shape) == 3 else (1, info.shape[0])
    return Problem(framework=info.framework, device=info.device, dtype="int8", nq=nq, lq=lq, nd=0, ld=0,
                   dim=info.shape[-1], candidates=False, scores_shape=(nq, 0), argmax_shape=(nq, 0, lq),
                   q_valid=q_valid, d_valid=None)


def _same_kind(kind: str | None, dtype: str, part: _Part) -> str:
    """The corpus's kind ("int8" or the float dtype seen first) after ``part``; TypeError when INT8 and float mix."""
    if kind is None or (kind == "int8") == (dtype == "int8"):
        return kind or dtype
    raise TypeError(f"{part.name} has dtype {dtype} but earlier shards are {kind}: a corpus is all INT8 or all float; "
                    "quantize the float shards (lik_cupy.quantize_int8, `lik pack --int8`) or score the two "
                    "kinds in separate calls")


def _part_problem(qp: Problem, part: _Part) -> Problem:
    """Check one shard against the queries (before any of it is read) and describe one
    scoring call of Q against the whole shard. Frameworks may differ: a host corpus
    streams to device queries."""
    info = interop.describe(part.docs)
    if info.dtype != "int8" and part.scales is None:
        if qp.dtype == "int8":
            raise TypeError(f"Q is int8 but {part.name} has dtype {info.dtype}: int8 queries score INT8 corpora only; "
                            "pass float Q")
        if info.dtype != qp.dtype:
            raise TypeError(f"corpus has dtype {info.dtype} but Q has {qp.dtype}: cast one so both match")
    return _with_queries(qp, _doc_problem(part, info))


def _doc_problem(part: _Part, info: interop.Info) -> Problem:
    """Check one shard on its own (``info``: its tokens' description): layout, shapes, dtypes, validity
    and INT8 scales, before any of it is read. The Problem describes its documents (no queries yet:
    ``_with_queries`` adds them)."""
    if info.dtype == "int8" or part.scales is not None:
        return _int8_doc_problem(part, info)
    if part.packed:
        if len(info.shape) != 2:
            raise ValueError(f"packed corpus tokens must be [T, d]; got shape {list(info.shape)}")
        return check_varlen(part.docs[:0], part.docs, part.offsets, None, None, None)
    if len(info.shape) != 3:
        raise ValueError(f"a padded corpus must be [Nd, Ld, d]; got shape {list(info.shape)}")
    return check_call(part.docs[:0, :1], part.docs, None, part.mask, None, part.lengths, pairs=False)


def _with_queries(qp: Problem, p: Problem) -> Problem:
    """One scoring call of the queries ``qp`` against the documents ``p`` (``_doc_problem``), whose
    dtype the caller has matched to the queries'."""
    if p.dim != qp.dim:
        raise ValueError(f"corpus has dim {p.dim} but Q has dim {qp.dim}")
    return replace(p, framework=qp.framework, device=qp.device, nq=qp.nq, lq=qp.lq, scores_shape=(qp.nq, p.nd),
                   argmax_shape=(qp.nq, p.nd, qp.lq), q_valid=qp.q_valid)


def _int8_doc_problem(part: _Part, info: interop.Info) -> Problem:
    scales_name = "d_scales" if part.index is None else f"shard {part.index} scales"
    if info.dtype != "int8":
        raise TypeError(f"{scales_name} go with int8 tokens, but {part.name} has dtype {info.dtype}")
    if part.scales is None:
        raise TypeError(f"{part.name} is int8 but has no scales: pass d_scales (float32, D's shape without its last "
                        "axis; [T] for packed tokens), or give INT8 shards as (tokens, offsets, scales) or "
                        "(docs, scales)")
    if part.packed:
        if len(info.shape) != 2:
            raise ValueError(f"packed corpus tokens must be [T, d]; got shape {list(info.shape)}")
        nd, ld, ntok, d_valid = offsets_count("d_offsets", part.offsets, info), 0, info.shape[0], "offsets"
    else:
        if len(info.shape) != 3:
            raise ValueError(f"a padded corpus must be [Nd, Ld, d]; got shape {list(info.shape)}")
        d_valid = check_valid("d", part.mask, part.lengths, info, info.shape[:-1], info.shape[:-2])
        nd, ld, ntok = info.shape[0], info.shape[1], 0
    if info.shape[-1] < 1:
        raise ValueError(f"{part.name} has embedding dim 0; expected at least 1")
    check_scales(scales_name, part.scales, info, tuple(info.shape[:-1]), "one per document token",
                 f"{part.name}'s tokens")
    return Problem(framework=info.framework, device=info.device, dtype="int8", nq=0, lq=0, nd=nd, ld=ld,
                   dim=info.shape[-1], candidates=False, scores_shape=(0, nd), argmax_shape=(0, nd, 0), q_valid=None,
                   d_valid=d_valid, d_packed=part.packed, ntok=ntok)


@dataclass
class _HostDocs:
    """A shard's documents on the host, checked, as the NumPy path reads them: packed ``tokens [T, d]``
    with int64 ``offsets``, or padded ``tokens [Nd, Ld, d]`` with a bool ``mask`` or range-checked
    ``lengths`` (or neither); float32 INT8 ``scales`` shaped like the tokens without their last axis."""

    tokens: np.ndarray
    offsets: np.ndarray | None = None
    mask: np.ndarray | None = None
    lengths: np.ndarray | None = None
    scales: np.ndarray | None = None

    def valid(self, rows) -> np.ndarray:
        """bool ``[n, Ld]``: the valid tokens of the padded documents ``rows`` (a slice or an index array)."""
        if self.mask is not None:
            return self.mask[rows].astype(bool, copy=False)
        n = len(range(*rows.indices(self.tokens.shape[0]))) if isinstance(rows, slice) else len(rows)
        if self.lengths is not None:
            return np.arange(self.tokens.shape[1])[None, :] < self.lengths[rows].reshape(n, 1)
        return np.ones((n, self.tokens.shape[1]), bool)


def _host_docs(part: _Part, p: Problem) -> _HostDocs:
    """``part`` (checked by ``_doc_problem``) on the host, its offsets, lengths and INT8 scales value-checked."""
    fw = interop.framework_of(part.docs)
    scales = None if p.dtype != "int8" else np.asarray(host_array(part.scales, fw), np.float32)
    scales_name = "d_scales" if part.index is None else f"shard {part.index} scales"
    if part.packed:
        docs = _HostDocs(host_array(part.docs, fw), offsets=host_offsets(host_array(part.offsets, fw), p.ntok,
                                                                         "d_offsets"), scales=scales)
        if scales is not None:  # offsets from 0 to T: every token is a document's
            check_scales_of_valid(scales.reshape(p.ntok), None, scales_name)
        return docs
    lens = None
    if part.lengths is not None:
        lens = np.asarray(host_array(part.lengths, fw)).reshape(p.nd)
        if lens.size:  # on the values as given, as valid_host checks them
            check_length_values("d_lengths", int(lens.min()), int(lens.max()), p.ld)
        lens = lens.astype(np.int64, copy=False)
    mask = None if part.mask is None else host_array(part.mask, fw)
    docs = _HostDocs(host_array(part.docs, fw), mask=mask, lengths=lens, scales=scales)
    if scales is not None:
        check_scales_of_valid(scales.reshape(p.nd, p.ld), docs.valid(slice(None)), scales_name)
    return docs


def _staged_source(docs: _HostDocs, p: Problem) -> dict:
    """The host arrays a streamed shard's chunks are staged from (``_Gpu._stream``): "docs" (bfloat16
    as its 16-bit patterns), and "off" (packed), "mask" / "lens" (padded), "scales" (INT8)."""
    src = {"docs": docs.tokens.view(np.uint16) if p.dtype == "bfloat16" else docs.tokens}
    for name, a in (("off", docs.offsets), ("mask", docs.mask), ("lens", docs.lengths), ("scales", docs.scales)):
        if a is not None:
            src[name] = a
    return src


@dataclass
class _DeviceDocs:
    """A shard's documents on the device, checked, as the kernels read them: ``tokens`` (bfloat16 as its
    uint16 bits) packed ``[T, d]`` with device ``offsets``, or padded ``[Nd, Ld, d]`` with a uint8
    ``mask`` and / or int32 ``lengths`` (beside a mask: its spans, ``_runtime/masks.py``); INT8
    ``scales`` float32, flat ([T] or [Nd * Ld])."""

    tokens: object
    offsets: object = None
    mask: object = None
    lengths: object = None
    scales: object = None


def _device_docs(part: _Part, p: Problem, verify: bool = True) -> _DeviceDocs:
    """``part`` (on the current device, checked by ``_doc_problem``) in the kernels' form, its offsets
    and lengths value-checked on the device (``verify``: with a host wait, raising; else left to
    the caller's NaN pass)."""
    import cupy

    fw = interop.framework_of(part.docs)
    d = interop.to_cupy(part.docs, fw)
    if p.dtype == "bfloat16":  # the corpus's dtype: a bfloat16 Q may score an INT8 corpus
        d = d.view(cupy.uint16)
    # INT8 scales, flat as the kernel reads them: [T] packed, [nd * ld] padded.
    ds = None if p.dtype != "int8" else interop.to_cupy(part.scales, fw).reshape(-1)
    if part.packed:
        return _DeviceDocs(d, offsets=device_offsets(device_array(part.offsets, fw, False), p.ntok, "d_offsets",
                                                     check=verify), scales=ds)
    dm, dl = device_valid(part.mask, part.lengths, p.nd, p.ld, "d_lengths", fw, False,
                          None if verify else call_checks(False))
    return _DeviceDocs(d, mask=dm, lengths=dl, scales=ds)


class _Cpu:
    def __init__(self, Q, q_mask, q_lengths, q_scales, qp: Problem, k: int):
        fw = qp.framework
        self.qp, self.k = qp, k
        self.q = host_array(Q, fw).reshape(qp.nq, qp.lq, qp.dim)
        self.qv = valid_host(q_mask, q_lengths, qp.nq, qp.lq, "q_lengths", fw)
        self.qs = None
        if q_scales is not None:
            self.qs = host_array(q_scales, fw).reshape(qp.nq, qp.lq)
        self.kind = None
        self.s = np.empty((qp.nq, 0), np.float64 if qp.dtype == "float64" else np.float32)
        self.i = np.empty((qp.nq, 0), np.int64)
        self.base = 0

    def _int8_queries(self) -> dict:
        """The int8 queries' scales for the NumPy path; float queries are quantized on the first call."""
        if self.qs is None:
            from ._cpu import quantize_numpy

            # A token holding NaN or inf gets scale NaN (its scores are NaN), as on the device.
            self.q, self.qs = quantize_numpy(self.q, strict=False)
        return {"q_scale": self.qs}

    def add(self, part: _Part):
        p = _part_problem(self.qp, part)
        self.kind = _same_kind(self.kind, p.dtype, part)
        self.add_docs(p, _host_docs(part, p))

    def add_docs(self, p: Problem, docs: _HostDocs):
        """Merge the scores of checked documents ``docs`` (problem ``p``, as ``_with_queries`` makes it)
        into the running top-k."""
        self.kind = self.kind or p.dtype
        int8 = p.dtype == "int8"
        q8 = self._int8_queries() if int8 else {}
        # Documents per NumPy call: 4096, fewer where their scores [Nq, step] or (padded) validity
        # mask [step, Ld] would pass _CPU_STEP_BYTES, so that many queries or very long documents
        # cost bytes, not a count of tokens.
        step = max(1, min(4096, _CPU_STEP_BYTES // max(1, 4 * self.qp.nq + (0 if p.d_packed else p.ld))))
        if p.d_packed:
            for a in range(0, p.nd, step):
                b = min(p.nd, a + step)
                kw = {**q8, "d_scale": docs.scales} if int8 else {}  # [T]: read with the same offsets as the tokens
                s, _ = cpu.maxsim_packed_numpy(self.q, self.qv, docs.tokens, docs.offsets[a:b + 1],
                                               return_argmax=False, **kw)
                self._merge(s)
        else:
            for a in range(0, p.nd, step):
                b = min(p.nd, a + step)
                kw = {**q8, "d_scale": docs.scales[a:b]} if int8 else {}
                s, _ = cpu.maxsim_numpy(self.q, docs.tokens[a:b], self.qv, docs.valid(slice(a, b)), candidates=False,
                                        nd=b - a, return_argmax=False, **kw)
                self._merge(s)

    def _merge(self, s):
        pos = self.base + np.broadcast_to(np.arange(s.shape[1], dtype=np.int64), s.shape)
        self.s, self.i = merge_ranked(self.s, self.i, s, pos, self.k)
        self.base += s.shape[1]

    def result(self):
        fw = self.qp.framework
        if self.kind == "int8":  # INT8 scores are float32 whatever the queries were
            self.s = self.s.astype(np.float32, copy=False)
        if self.qp.device is None:
            return interop.from_numpy(self.s, fw), interop.from_numpy(self.i, fw)
        import cupy

        with cupy.cuda.Device(self.qp.device):
            return (interop.from_cupy(cupy.asarray(self.s), fw, on_host=False),
                    interop.from_cupy(cupy.asarray(self.i), fw, on_host=False))


class _Chunking:
    """How many documents a chunk may hold in one call, shrunk when the GPU runs out of memory.

    ``halve`` caps the chunk at half the size that failed (MemoryError when that was one
    document); ``succeeded``, called after each chunk is merged, warns once per call, at the
    first chunk that fits after a halving, naming the size that failed and the one in use.
    ``held`` gives the bytes the call holds whatever the chunk (queries, running top-k).
    """

    def __init__(self, held: Callable[[], int]):
        self.cap = None
        self._held = held
        self._failed = None  # the chunk size that ran out of memory, until reported
        self._warned = False

    def limit(self, docs: int) -> int:
        return docs if self.cap is None else max(1, min(docs, self.cap))

    def halve(self, docs: int, err: BaseException) -> None:
        if docs <= 1:
            size = getattr(err, "_size", getattr(err, "nbytes", None))  # CuPy's error / DeviceMemoryError
            what = f"allocating {size:,} bytes" if isinstance(size, int) else f"({err})"
            raise MemoryError(
                f"lik_cupy.retrieve: out of GPU memory {what} with one document per chunk, while the queries and "
                f"the running top-k hold {self._held():,} bytes. Score fewer queries (or a smaller k) per call, "
                "free GPU memory held elsewhere, or pass max_gpu_bytes no larger than the free GPU memory") from err
        if self._failed is None and not self._warned:
            self._failed = docs
        self.cap = docs // 2

    def succeeded(self) -> None:
        if self._failed is not None:
            warnings.warn(f"lik_cupy.retrieve: out of GPU memory with {self._failed} documents per chunk; continuing "
                          f"with {self.cap} per chunk (pass max_gpu_bytes to plan smaller chunks from the start)",
                          RuntimeWarning, stacklevel=_outside_stacklevel())
            self._failed, self._warned = None, True


def _outside_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised from here at the first caller outside lik_cupy."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    return level


def _drive(total: int, docs: int, run: Callable[[int, int], None], done: Callable[[], int], chunking: _Chunking,
           oom: type | tuple, on_oom: Callable[[], None] = lambda: None) -> None:
    """Score documents ``0..total-1`` of one shard, halving the chunk when the GPU runs out of memory.

    ``run(start, c)`` scores documents ``start..total-1`` in chunks of at most ``c``
    documents, merging each into the running top-k as it goes; ``done()`` counts the
    documents merged so far. When ``run`` raises ``oom`` the merged chunks stay merged,
    ``on_oom`` drops cached buffers, the chunk halves (MemoryError below one document)
    and scoring resumes at the first document not merged.
    """
    while True:
        c = chunking.limit(min(docs, total))  # a plan larger than the shard allocates (and reports) the shard
        try:
            run(done(), c)
            return
        except oom as e:
            on_oom()
            chunking.halve(c, e)
        if done() >= total:  # the failure came after the last chunk was merged
            return


class _Gpu:
    """Runs inside the caller's stream context (``interop.caller_stream``). ``k`` None: no top-k, every
    score goes to ``[Nq, nd]`` (``keep_every``) instead."""

    def __init__(self, Q, q_mask, q_lengths, q_scales, qp: Problem, k: int | None, max_gpu_bytes, device: int,
                 x3: bool):
        import cupy

        fw = qp.framework
        self.qp, self.k, self.budget, self.device, self.x3 = qp, k, max_gpu_bytes, device, x3
        self.on_host_q = qp.device is None
        q = device_array(Q, fw, self.on_host_q)
        if qp.dtype == "bfloat16":
            q = q.view(cupy.uint16)
        self.q = q.reshape(qp.nq, qp.lq, qp.dim)
        self.qs = None  # float32 [nq * lq] scales of int8 queries
        if q_scales is not None:
            self.qs = cupy.ascontiguousarray(device_array(q_scales, fw, self.on_host_q), dtype=cupy.float32).reshape(-1)
        # Device query lengths: the NaN contract, no host wait (a query with an invalid length scores
        # NaN against every document, ranked last); host ones, and strict mode, raise here.
        self.checks = call_checks(True if self.on_host_q or host_metadata(q_lengths) else None)
        # Device corpora: their lengths and offsets follow the NaN contract too (each chunk's
        # documents marked after its kernel), unless strict mode raises.
        self.mark_docs = not strict(None)
        self.qm, self.ql = device_valid(q_mask, q_lengths, qp.nq, qp.lq, "q_lengths", fw, self.on_host_q, self.checks)
        self.checks.verify()
        self.kind = None
        self.s = cupy.empty((qp.nq, 0), cupy.float32)
        self.i = cupy.empty((qp.nq, 0), cupy.int64)
        self.base = 0
        self.scores = None  # chunk score buffer, grown on demand
        self.every = None  # k None: float32 [Nq, nd], every score (keep_every)
        self.chunking = _Chunking(self._held_bytes)

    def keep_every(self, nd: int, caller: str) -> None:
        """Keep every score of the ``nd`` documents to come, ``[Nq, nd]``, instead of a top-k (``k`` None)."""
        from ._runtime.device import empty

        self.every = empty((self.qp.nq, nd), np.float32, f"{caller}: scores", "score fewer queries per call")

    def _split_merge(self) -> bool:
        """Whether chunks of more than _MERGE_SLICE documents take the two-launch merge."""
        return self.k is not None and 4 * self.k <= _MERGE_SLICE

    def _held_bytes(self) -> int:
        """GPU bytes held whatever the chunk size: queries (and their scales), running top-k ping-pong
        (and one slice's winners, the rounding up of the two-launch merge's), or every score."""
        held = self.q.nbytes + (0 if self.qs is None else self.qs.nbytes) + 2 * self.qp.nq * (self.k or 0) * 12
        held += 0 if self.every is None else self.every.nbytes
        return held + (self.qp.nq * self.k * 12 if self._split_merge() else 0)

    def _int8_queries(self) -> None:
        """Quantize float queries on the device, once per call (an int8 Q came with its scales)."""
        if self.qs is None:
            from ._runtime.quantize import quantize_cupy

            q8, qs = quantize_cupy(self.q, self.qp.dtype)
            self.q, self.qs = q8, qs.reshape(-1)  # the float queries are no longer needed: corpora do not mix

    # ------------------------------------------------------------ chunking

    def _chunk_docs(self, doc_bytes: float, staged: bool, spans: bool = False) -> int:
        """Documents per chunk from the memory formula in the module docstring (``spans``: a masked
        corpus on the GPU, whose chunks take the mask spans of masks.py)."""
        nq, lq = self.qp.nq, self.qp.lq
        fixed = self._held_bytes()
        split = -(-lq // 32) if lq > 32 else 0  # partial scores of a query split over tiles
        winners = nq * 12 * self.k / _MERGE_SLICE if self._split_merge() else 0
        per_doc = max(1, nq * 4 * (1 + split) + winners + (2 * doc_bytes if staged else 0)  # Nq = 0: no scores
                      + (4 if spans else 0))
        if self.budget is not None:
            room = self.budget * _BUDGET_SLACK - fixed
            if room < per_doc:
                raise ValueError(f"max_gpu_bytes={self.budget} leaves no room for one document "
                                 f"(queries and top-k take {fixed} bytes, each document {per_doc:.0f}); raise it")
            return min(_MAX_CHUNK_DOCS, max(1, int(room // per_doc)))
        return min(_MAX_CHUNK_DOCS, max(1, int((_DEFAULT_HOST_BUDGET if staged else _DEFAULT_SCORE_BYTES) // per_doc)))

    def _chunked(self, nd: int, docs: int, run: Callable[[int, int], None]) -> None:
        """``_drive`` over one shard of ``nd`` documents: ``run(start, c)`` scores from document ``start`` on."""
        import cupy

        first = self.base

        def drop_cache():
            self.scores = None

        _drive(nd, docs, run, lambda: self.base - first, self.chunking, (cupy.cuda.memory.OutOfMemoryError, DeviceMemoryError),
               drop_cache)

    # ------------------------------------------------------------ scoring

    def add(self, part: _Part):
        info = interop.describe(part.docs)
        p = _part_problem(self.qp, part)
        self.kind = _same_kind(self.kind, p.dtype, part)
        if p.dtype == "int8" and not dispatch.int8_dim_ok(p.dim):
            raise ValueError(f"INT8 scoring on the GPU needs dim a multiple of 16 up to {dispatch.MAX_DIM_INT8}; "
                             f"got dim {p.dim} (backend='cpu' scores any dim)")
        if p.nd == 0:  # no document to score, but offsets that cannot be right still raise
            if part.packed and info.device is None:  # host offsets are checked on the host, as the CPU path does
                host_offsets(host_array(part.offsets, info.framework), p.ntok, "d_offsets")
            elif part.packed:
                device_offsets(device_array(part.offsets, info.framework, False), p.ntok, "d_offsets")
            if p.dtype == "int8":
                self._int8_queries()
            return
        if info.device is None:
            self.add_staged(p, _staged_source(_host_docs(part, p), p))
            return
        if info.device != self.device:
            raise ValueError(f"corpus is on cuda:{info.device} but Q is on cuda:{self.device}")
        self.add_device(p, _device_docs(part, p, verify=not self.mark_docs), marked=self.mark_docs)

    def add_device(self, p: Problem, docs: _DeviceDocs, marked: bool = False):
        """Score documents on this device (``docs``, checked, or with ``marked`` not: their lengths
        and offsets are then marked NaN chunk by chunk; problem ``p`` as ``_with_queries`` makes it)
        in chunks, merging each into the top-k."""
        if p.dtype == "int8":
            self._int8_queries()
        if p.nd == 0:
            return
        d, ds, dm, dl = docs.tokens, docs.scales, docs.mask, docs.lengths
        c = self._chunk_docs(0, staged=False, spans=dm is not None and dl is None)
        marked = marked and dm is None  # (lengths beside a mask are its spans, made valid)
        if docs.offsets is not None:
            off = docs.offsets
            ld_hint = -(-p.ntok // p.nd)

            def run(start, c):
                for a in range(start, p.nd, c):
                    b = min(p.nd, a + c)
                    self._score(replace(p, nd=b - a), d, None, None, off[a:b + 1], ld_hint, ds,
                                d_off_whole=a == 0 and b == p.nd, off_all=off if marked else None)
        else:
            def run(start, c):
                for a in range(start, p.nd, c):
                    b = min(p.nd, a + c)
                    self._score(replace(p, nd=b - a), d[a:b], None if dm is None else dm[a:b],
                                None if dl is None else dl[a:b], None, None,
                                None if ds is None else ds[a * p.ld : b * p.ld], marked=marked)
        self._chunked(p.nd, c, run)

    def _score(self, p: Problem, d, dm, dl, d_off, ld_hint, d_scale=None, d_off_whole=False, off_all=None,
               marked=False):
        """Score one chunk of p.nd documents into the chunk buffer and merge it into the top-k (or keep it).

        INT8 chunks (``p.dtype == "int8"``) take ``d_scale``: float32 contiguous, [rows * ld] or [T].
        Unchecked documents are marked NaN where invalid: padded ones' lengths ``dl`` (``marked``),
        packed ones' offsets ``d_off``, a slice of the part's offsets ``off_all`` (given)."""
        import cupy

        n = p.nq * p.nd
        if self.scores is None or self.scores.size < n:
            self.scores = None  # hand the smaller buffer back before the larger one is allocated
            self.scores = cupy.empty(n, cupy.float32)
        kw = {"q_scale": self.qs, "d_scale": d_scale} if p.dtype == "int8" else {}
        s, _ = launch(p, self.q, d, self.qm, dm, self.ql, dl, False, self.device, d_off=d_off, ld_hint=ld_hint,
                      d_off_whole=d_off_whole, caller="retrieve", out=self.scores[:n], x3=self.x3, **kw)
        marks = self.checks
        if (marked and dl is not None) or off_all is not None:
            marks = self.checks.chunk() if isinstance(self.checks, Marks) else Marks()  # (host queries: raised)
            if marked and dl is not None:
                marks.lengths(dl, p.ld, "d_lengths")
            if off_all is not None:
                marks.offsets(d_off, p.ntok, "d_offsets", whole=off_all)
        marks.apply(p, s, None, self.device)  # NaN where a query's or a document's length is invalid
        if self.every is not None:
            self.every[:, self.base:self.base + p.nd] = s
            self.base += p.nd
        else:
            self._merge(s, p.nd)
        self.chunking.succeeded()

    def _merge(self, s, nd: int):
        import cupy

        from ._runtime.nvrtc import get_function

        nq, k_run = self.qp.nq, self.s.shape[1]
        k_out = min(self.k, k_run + nd)
        out_s = cupy.empty((nq, k_out), cupy.float32)
        out_i = cupy.empty((nq, k_out), cupy.int64)
        if nq:
            kern = get_function("topk.cu", "lik_topk_merge", self.device)
            null = np.uint64(0)

            def merge_kernel(rows, run_s, run_i, k_run, chunk, chunk_i, stride, n, groups, slice_, base, o_s, o_i, k):
                kp = 1 << max(0, (k - 1).bit_length())
                cache = k_run + min(n, slice_) <= _MERGE_CACHE  # every row's keys fit the kernel's cache
                smem = kp * 12 + (_MERGE_CACHE * 4 if cache else 0)
                if smem > 40 * 1024:
                    kern.max_dynamic_shared_size_bytes = smem
                kern((rows,), (1024,), (run_s, run_i, np.int32(k_run), chunk, chunk_i, np.int64(stride), np.int32(n),
                                        np.int32(groups), np.int32(slice_), np.int64(base), o_s, o_i, np.int32(k),
                                        np.int32(kp), np.int32(_MERGE_CACHE if cache else 0)), shared_mem=smem)

            groups = -(-nd // _MERGE_SLICE)
            if groups > 1 and self._split_merge():
                # One CTA per query walks the whole chunk several times; first rank each slice's
                # best k on its own CTA, then merge the running list with the slice winners.
                k1 = self.k
                win_s = cupy.empty((nq * groups, k1), cupy.float32)
                win_i = cupy.empty((nq * groups, k1), cupy.int64)
                merge_kernel(nq * groups, null, null, 0, s, null, nd, nd, groups, _MERGE_SLICE, self.base, win_s, win_i, k1)
                merge_kernel(nq, self.s, self.i, k_run, win_s, win_i, groups * k1, groups * k1, 1, groups * k1, 0, out_s,
                       out_i, k_out)
            else:
                merge_kernel(nq, self.s, self.i, k_run, s, null, nd, nd, 1, nd, self.base, out_s, out_i, k_out)
        self.s, self.i = out_s, out_i
        self.base += nd

    # ------------------------------------------------------------ host corpora

    def add_staged(self, p: Problem, src: dict):
        """Stream a host shard (``src``, from ``_staged_source``): host threads fill pinned buffers, a
        copy stream uploads, the caller's stream scores."""
        if p.dtype == "int8":
            self._int8_queries()
        if p.nd == 0:
            return
        esize = {"float32": 4, "int8": 1}.get(p.dtype, 2)
        sbytes = 4 if p.dtype == "int8" else 0  # a float32 scale per token
        if "off" in src:
            c = self._chunk_docs(p.ntok / p.nd * (p.dim * esize + sbytes) + 8, staged=True)
        else:
            c = self._chunk_docs(p.ld * (p.dim * esize + sbytes + (1 if "mask" in src else 0)) + 4, staged=True)
        self._chunked(p.nd, c, lambda start, c: self._stream(p, src, start, c))

    def _stream(self, p: Problem, src: dict, start: int, c: int):
        """Stream documents ``start..p.nd-1`` of a host shard in chunks of at most ``c`` documents.

        ``src``: the host arrays: "docs", and "off" (packed), "mask"/"lens" (padded),
        "scales" (INT8). Staging buffers are sized for this ``c``, so a retry after running
        out of memory allocates smaller ones.
        """
        import cupy
        import cupyx

        docs = src["docs"]
        off, mask, lens, scales = src.get("off"), src.get("mask"), src.get("lens"), src.get("scales")
        packed = off is not None
        if packed:
            bounds = [(a + start, b + start) for a, b in _packed_chunks(off[start:] - off[start], c)]
        else:
            bounds = [(a, min(p.nd, a + c)) for a in range(start, p.nd, c)]
        # Largest chunk, in elements, of each staged array.
        if packed:
            cap_tok = max(max(int(off[b] - off[a]) for a, b in bounds), 1)
            shapes = {"docs": (cap_tok, p.dim), "off": (max(b - a for a, b in bounds) + 1,)}
            dtypes = {"docs": docs.dtype, "off": np.int64}
            if scales is not None:
                shapes["scales"], dtypes["scales"] = (cap_tok,), np.float32
        else:
            cap = max(b - a for a, b in bounds)
            shapes = {"docs": (cap, p.ld, p.dim)}
            dtypes = {"docs": docs.dtype}
            if mask is not None:
                shapes["mask"], dtypes["mask"] = (cap, p.ld), np.uint8
            if lens is not None:
                shapes["lens"], dtypes["lens"] = (cap,), np.int32
            if scales is not None:
                shapes["scales"], dtypes["scales"] = (cap, p.ld), np.float32
        # Tokens and scales already page-locked (pin_host, torch pin_memory) upload from where
        # they lie; everything else goes through pinned staging buffers that host threads fill.
        direct = {n for n in ("docs", "scales") if n in src and span_page_locked(src[n])}
        dev = [{n: cupy.empty(shapes[n], dtypes[n]) for n in shapes} for _ in range(2)]
        pinned = [{n: cupyx.empty_pinned(shapes[n], dtypes[n]) for n in shapes if n not in direct} for _ in range(2)]
        compute = cupy.cuda.get_current_stream()
        copy = cupy.cuda.Stream(non_blocking=True)
        uploaded = [None, None]  # event: chunk slot s's uploads finished (pinned[s] free again)
        consumed = [None, None]  # event: the scoring that reads dev[s] finished
        pool = ThreadPoolExecutor(_COPY_THREADS)

        def stage(host: dict, n: str, rows: np.ndarray) -> np.ndarray:
            """The host array a chunk's ``rows`` of array ``n`` upload from."""
            if n in direct:
                return rows
            _parallel_copy(pool, host[n][: rows.shape[0]], rows)
            return host[n][: rows.shape[0]]

        try:
            for ci, (a, b) in enumerate(bounds):
                slot = ci % 2
                if uploaded[slot] is not None and pinned[slot]:
                    uploaded[slot].synchronize()  # pinned[slot] is free again
                host = pinned[slot]
                if packed:
                    t0, t1 = int(off[a]), int(off[b])
                    host["off"][: b - a + 1] = off[a:b + 1] - t0
                    up = {"docs": stage(host, "docs", docs[t0:t1]), "off": host["off"][: b - a + 1]}
                    if scales is not None:
                        up["scales"] = stage(host, "scales", scales[t0:t1])
                else:
                    up = {"docs": stage(host, "docs", docs[a:b])}
                    if mask is not None:
                        host["mask"][: b - a] = mask[a:b]
                        up["mask"] = host["mask"][: b - a]
                    if lens is not None:
                        host["lens"][: b - a] = lens[a:b]
                        up["lens"] = host["lens"][: b - a]
                    if scales is not None:
                        up["scales"] = stage(host, "scales", scales[a:b])
                if consumed[slot] is not None:
                    copy.wait_event(consumed[slot])  # dev[slot] no longer read
                for n, arr in up.items():
                    if arr.nbytes:
                        cupy.cuda.runtime.memcpyAsync(dev[slot][n].data.ptr, arr.ctypes.data, arr.nbytes,
                                                      cupy.cuda.runtime.memcpyHostToDevice, copy.ptr)
                uploaded[slot] = copy.record()
                compute.wait_event(uploaded[slot])
                dv = dev[slot]
                d = dv["docs"]
                nd = b - a
                if packed:
                    t = up["docs"].shape[0]
                    self._score(replace(p, nd=nd, ntok=t), d[:t], None, None, dv["off"][: nd + 1],
                                -(-t // max(1, nd)), None if scales is None else dv["scales"][:t], d_off_whole=True)
                else:
                    self._score(replace(p, nd=nd), d[:nd], None if mask is None else dv["mask"][:nd],
                                None if lens is None else dv["lens"][:nd], None, None,
                                None if scales is None else dv["scales"][:nd].reshape(-1))
                consumed[slot] = compute.record()
        except BaseException:
            # The staging buffers are freed on the way out, and a retry (after running out of
            # memory) reuses their memory: no copy or kernel may still use them. A sync that
            # fails too (a sticky CUDA error) must not hide the original error.
            try:
                _wait(uploaded + consumed)
                compute.synchronize()  # a chunk's kernel queued before the failure may still read them
            except Exception:
                pass
            raise
        else:
            _wait(uploaded + consumed)  # the staging buffers are freed on return
        finally:
            pool.shutdown(wait=True)

    def result(self):
        fw = self.qp.framework
        return interop.from_cupy(self.s, fw, self.on_host_q), interop.from_cupy(self.i, fw, self.on_host_q)


def _wait(events) -> None:
    for e in events:
        if e is not None:
            e.synchronize()


def _packed_chunks(off: np.ndarray, max_docs: int) -> list[tuple[int, int]]:
    """Document ranges of at most ``max_docs`` documents and about max_docs * mean tokens each."""
    nd = off.size - 1
    per_tok = max(1, int(off[-1] * max_docs / max(nd, 1)))
    out, a = [], 0
    while a < nd:
        b = int(np.searchsorted(off, off[a] + per_tok, side="right")) - 1
        b = min(nd, max(a + 1, min(b, a + max_docs)))
        out.append((a, b))
        a = b
    return out


def _parallel_copy(pool: ThreadPoolExecutor, dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src, split over threads (NumPy releases the GIL; memory-mapped pages fault in parallel)."""
    n = dst.shape[0]
    if n == 0:
        return
    parts = min(_COPY_THREADS, n)
    step = -(-n // parts)
    futs = [pool.submit(np.copyto, dst[i:i + step], src[i:i + step]) for i in range(0, n, step)]
    for f in futs:
        f.result()
