"""A corpus kept resident for a search service: :class:`Corpus`.

A service scores query after query against one corpus. ``Corpus`` checks the documents once
(layout, shapes, dtype, offsets, lengths, INT8 scales) and keeps them where they stay:

- on the GPU, when they fit in ``max_gpu_bytes`` (or are there already);
- else in page-locked host memory: :meth:`Corpus.score` and :meth:`Corpus.search` stream them
  through the GPU as :func:`lik_cupy.retrieve` streams a host corpus (two staging buffers on the
  device, uploads straight from the locked pages), and :meth:`Corpus.rerank` reads its
  candidates' tokens where they lie, over the bus;
- on a machine without a GPU (or with ``device="cpu"``) in host memory, for the NumPy path.

Each call then checks only its queries, padded ``[Nq, Lq, d]`` or packed ``[Tq, d]`` with ``q_offsets``
(as :func:`lik_cupy.maxsim_varlen` takes them). On a GPU-resident corpus ``score`` and ``rerank`` are one
launch of the forward kernel on the already-checked device arrays, and ``search`` runs the
streaming top-k of :func:`lik_cupy.retrieve` over them; a search whose scores streamed in one chunk
(float corpus, no string ids) leaves a prepared search, which its repeats run instead (the scores'
prepared call, then the top-k merge: ``prepared_calls.PreparedSearch``). ``rerank`` scores each
query against its own candidate documents, given by index, in place: the forward kernel's
candidate-id tiles find each candidate's tokens in the packed or padded corpus, so no gathered copy
exists. NumPy queries (and candidates) of a GPU-resident corpus, without masks, lengths or offsets,
move in one page-locked copy each way when each way is at most 1 MiB
(``lik_cupy._runtime.host_staging``), and JAX ones on its GPU are shared through DLPack (``score``,
``rerank``, and ``search`` of a float corpus without string ids), for the CuPy call on the same
values (which, for a float corpus, takes the device arrays' repeat path where the call has one).
Scores follow :func:`lik_cupy.maxsim` (-inf for a document without valid tokens, 0 for a query
without one) and come back in the queries' framework and place.

Calls may come from many threads at once: the corpus is only read after construction, and each
call's work is its own (launches go to each thread's current CuPy or torch stream).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterable

import numpy as np

from . import _cpu as cpu
from . import _dispatch as dispatch
from . import _interop as interop
from . import shards
from dataclasses import replace

from ._base.device import check_ordinal, gpu_available, present
from ._dispatch.backend import use_gpu
from ._dispatch.precision import fp32_accurate
from ._interop import GpuCall, host_array, host_result
from ._runtime.operands import check_scales_of_valid, host_offsets, kernel_operands, unpack_queries, valid_host
from ._runtime.host_staging import fits, staged_call
from ._runtime.prepared_calls import call_key, find
from ._runtime.topk import MAX_K
from ._shard_format import check_id_kinds, joined_ids, mixed_id_kinds
from ._streaming.cpu import CpuTopK
from ._streaming.docs import DeviceDocs, HostDocs, device_docs, host_docs, staged_source
from ._streaming.gpu import GpuTopK
from ._streaming.parts import Part, doc_problem, query_problem, with_queries
from ._validate import Problem, check_flag, check_id_values, host_ints, offsets_count

__all__ = ["Corpus"]

_DTYPES = tuple(e.name for e in dispatch.ELEMS)
_GPU_SHARE = 0.75  # of the device's free memory a host corpus may take by default
_RERANK_BLOCK = 64 << 20  # bytes of gathered candidate tokens per NumPy rerank step
# Packed NumPy reranks: queries score their candidates' union together where that scores at most this many
# times the documents and tokens a call per query would. On 2 cores one call over the union took 0.22-0.69x
# the per-query calls' time when every query named the same documents (0.43x for a union 1.3 times a
# query's set), and broke even at 1.8 (Lq 128) to 3 (Lq 32) times their work (docs/benchmarks.md, "CPU").
_SHARED_WASTE = 1.5
_MAX_CALLS = 64  # repeat-path signatures kept per corpus


class Corpus:
    """Documents checked once and kept resident, scored by many calls (see the module docstring).

    Args:
        D: the documents, one of
            - padded ``[Nd, Ld, d]``, with ``d_mask`` (bool ``[Nd, Ld]``) or ``d_lengths``
              (integer ``[Nd]``) or neither;
            - packed tokens ``[T, d]`` with ``d_offsets`` (int32 / int64 ``[Nd + 1]``, from 0 to T);
            - either, int8 (``lik_cupy.quantize_int8``) with ``d_scales`` (float32, D's shape
              without its last axis).
            float16, bfloat16 (host arrays: ``ml_dtypes.bfloat16``), float32 or int8, in any
            framework; the other arguments in D's framework and place.
        ids: ``[Nd]`` integers or strings, each document's external id, which :meth:`search`
            returns instead of the document's index (a host array, or a list of one kind: TypeError
            for integers beside strings, which NumPy would make strings).
        device: the CUDA device to keep the corpus on (default: D's, or the current one); "cpu"
            keeps it in host memory for the NumPy path (the default without a GPU). ValueError
            for an ordinal that is no int >= 0 or names a GPU this machine lacks (RuntimeError on
            a machine without a GPU).
        max_gpu_bytes: the GPU memory a host D may take there (default: 3/4 of the device's free
            memory); a larger corpus stays in page-locked host memory. A D on the GPU stays there.

    Attributes: ``dim``, ``dtype`` (one of "float16", "bfloat16", "float32", "int8"), ``nbytes``
    (the resident documents: tokens, scales, masks, lengths and offsets), ``where`` ("GPU",
    "pinned host memory" or "host memory"), ``device`` (the CUDA ordinal, None in host memory);
    ``len()`` is the number of documents.

    Example::

        >>> import numpy as np, lik_cupy
        >>> D = np.array([[[1, 0], [0, 1]], [[2, 0], [0, 0]], [[0, 3], [0, 0]]], np.float32)
        >>> corpus = lik_cupy.Corpus(D, d_lengths=[2, 1, 1], ids=["a", "b", "c"], device="cpu")
        >>> Q = np.array([[[1, 0], [0, 1]]], np.float32)
        >>> corpus.score(Q)
        array([[2., 2., 3.]], dtype=float32)
        >>> corpus.search(Q, 2)
        (array([[3., 2.]], dtype=float32), array([['c', 'a']], dtype='<U1'))
        >>> corpus.rerank(Q, np.array([[1, 1, 2]]))
        array([[2., 2., 3.]], dtype=float32)
    """

    def __init__(self, D, *, d_mask=None, d_lengths=None, d_offsets=None, d_scales=None, ids=None, device=None,
                 max_gpu_bytes=None):
        info = interop.describe_named("D", D)
        if max_gpu_bytes is not None and (isinstance(max_gpu_bytes, bool)
                                          or not isinstance(max_gpu_bytes, (int, np.integer)) or max_gpu_bytes < 0):
            raise ValueError(f"max_gpu_bytes must be a non-negative integer, got {max_gpu_bytes!r}")
        if not (isinstance(device, str) and device == "cpu"):
            check_ordinal(device, ", 'cpu' or None")
        part = Part(D, d_offsets, d_mask, d_lengths, d_scales)
        p = doc_problem(part, info)
        if p.dtype not in _DTYPES:
            raise TypeError(f"D has dtype {p.dtype}; a Corpus holds float16, bfloat16, float32 or int8 tokens")
        self._p = p
        self._ids = _check_ids(ids, p.nd)
        self._ids_dev = None  # integer ids on the corpus's device
        self._host: HostDocs | None = None  # host memory (the NumPy path) or page-locked memory (streamed)
        self._dev: DeviceDocs | None = None  # the kernels' operands: device arrays, or views of the locked pages
        self._src: dict | None = None  # page-locked: the arrays score and search stream from
        self._calls: dict = {}  # call signature -> PreparedCall (score, rerank) or PreparedSearch: the repeat path
        self._calls_lock = threading.Lock()
        if device == "cpu" or (device is None and info.device is None and not gpu_available()):
            self._host = host_docs(part, p)
            self.where, self.device = "host memory", None
        else:
            self._resident(part, info, device, max_gpu_bytes)
        # Bytes held: the host arrays and the device ones (in page-locked memory the device reads the
        # host arrays themselves, through views that hold nothing of their own).
        held = _fields(self._host) + (_fields(self._dev) if self.where == "GPU" else
                                      [self._dev.offsets, self._dev.lengths] if self._dev is not None else [])
        self.nbytes = sum(int(a.nbytes) for a in held if a is not None)
        if self.device is not None:
            import cupy

            with cupy.cuda.Device(self.device):
                if self._ids is not None and self._ids.dtype.kind == "i":
                    self._ids_dev = cupy.asarray(self._ids)
                # Every copy and the mask spans were queued on this thread's stream; other threads call
                # on streams of their own, which do not wait for it.
                cupy.cuda.get_current_stream().synchronize()

    @classmethod
    def from_shards(cls, paths, device=None, *, max_gpu_bytes=None, ids: bool = True) -> Corpus:
        """A corpus of the documents of one or more shards (``lik_cupy.shards``: shard directories, or
        padded ``[N, L, d]`` ``.npy`` files), in order, as one packed corpus; document ids are the
        shards' ``ids.npy`` values (every shard has them, of one kind, or none does; byte-string ids
        beside text ids are read as UTF-8, as ``lik score`` shows them).

        Args:
            paths: a path or a sequence of paths; an entry may also be a :class:`lik_cupy.shards.Shard`
                already opened (``shards.open_input``), which is read as it is, not opened again.
            device, max_gpu_bytes: as for :class:`Corpus`.
            ids: False leaves the shards' ids out: :meth:`search` returns positions.
        """
        ids = check_flag("ids", ids)
        expected = ("from_shards' paths must be a path or a sequence of paths (str, bytes or os.PathLike, or "
                    "lik_cupy.shards.Shard opened already)")
        if isinstance(paths, (str, bytes, os.PathLike, shards.Shard)):
            paths = [paths]
        elif not isinstance(paths, Iterable):
            raise TypeError(f"{expected}, got {type(paths).__name__}")
        paths = list(paths)
        for i, p in enumerate(paths):
            if not isinstance(p, (str, bytes, os.PathLike, shards.Shard)):
                raise TypeError(f"{expected}; paths[{i}] is {type(p).__name__}")
        opened = [p if isinstance(p, shards.Shard) else shards.open_input(p) for p in paths]
        if not opened:
            raise ValueError("from_shards needs at least one shard path")
        first = opened[0]
        for s in opened[1:]:
            if s.dtype != first.dtype or s.dim != first.dim:
                raise ValueError(f"{s.path} holds {s.dtype} tokens of dim {s.dim} but {first.path} holds {first.dtype} "
                                 f"of dim {first.dim}; a corpus has one dtype and dim")
        check_id_kinds(opened)
        chunks = [s.read_chunk(0, s.num_docs) for s in opened]
        tokens = chunks[0][0] if len(chunks) == 1 else np.concatenate([t for t, _ in chunks])
        offsets = np.zeros(1 + sum(s.num_docs for s in opened), np.int64)
        at = 0
        for (_, off), s in zip(chunks, opened):
            offsets[at + 1:at + 1 + s.num_docs] = off[1:] + offsets[at]
            at += s.num_docs
        scales = None
        if first.scales is not None:
            parts = [s.read_scales(0, s.num_docs) for s in opened]
            scales = parts[0] if len(parts) == 1 else np.concatenate(parts)
        ids = joined_ids(opened) if ids else None
        return cls(tokens, d_offsets=offsets, d_scales=scales, ids=ids, device=device, max_gpu_bytes=max_gpu_bytes)

    def __len__(self) -> int:
        return self._p.nd

    @property
    def dim(self) -> int:
        return self._p.dim

    @property
    def dtype(self) -> str:
        return self._p.dtype

    @property
    def ids(self) -> np.ndarray | None:
        """The documents' external ids ``[Nd]`` (int64 or strings, on the host), or None."""
        return self._ids

    def __repr__(self) -> str:
        layout = f"packed, {self._p.ntok} tokens" if self._p.d_packed else f"padded to {self._p.ld} tokens"
        where = self.where if self.device is None else f"{self.where} of cuda:{self.device}"
        return (f"Corpus({len(self)} documents, {layout}, dim {self.dim}, {self.dtype}, {self.nbytes:,} bytes in "
                f"{where})")

    # ------------------------------------------------------------ calls

    def score(self, Q, q_mask=None, *, q_lengths=None, q_offsets=None, precision=None):
        """MaxSim of every query against every document.

        Args:
            Q: ``[Nq, Lq, d]`` or ``[Lq, d]``, or packed query tokens ``[Tq, d]`` with ``q_offsets``;
                the corpus's dtype (an INT8 corpus takes float Q, quantised per token on each call),
                in any framework; on the corpus's GPU or on the host.
            q_mask / q_lengths: valid query tokens, as in :func:`lik_cupy.maxsim`.
            q_offsets: int32 or int64 ``[Nq + 1]`` for packed queries, as in :func:`lik_cupy.maxsim_varlen`
                (read on the host): scored as the same queries padded, with their lengths, a group of
                similar lengths at a time (each padded to its own longest query, so that padding takes
                at most twice the queries' bytes, or 16 MiB).
            precision: float32 corpora on the GPU, "fp32" or "tf32", as in :func:`lik_cupy.maxsim`.

        Returns:
            float32 ``[Nq, Nd]`` (``[Nd]`` for a 2-D padded Q) in Q's framework and place.
        """
        fw = self._stand_in(Q, q_mask, q_lengths, q_offsets, 4 * len(self))
        if fw:
            p = _resolved(precision, fw, Q.dtype)
            return self._through_cupy(fw, (Q,), lambda q: (self.score(q, precision=p),))[0]
        if q_offsets is not None:
            return _by_length(Q, q_mask, q_lengths, q_offsets,
                              lambda q, n, rows, nq: (self.score(q, q_lengths=n, precision=precision),))[0]
        key = call_key("Corpus.score", (None, precision), Q, (q_mask, q_lengths))
        call = find(self._calls, key)
        if call is not None:
            return call(Q, None, q_mask, None, q_lengths, None, None)
        qp, p = self._problem(Q, q_mask, q_lengths)
        x3 = fp32_accurate(precision, qp.framework, qp.dtype)  # (checks precision on every path)
        if self.where == "host memory":
            s = self._host_scores(qp, Q, q_mask, q_lengths)
            return host_result(s.reshape(p.scores_shape), qp)
        if self.where == "pinned host memory":
            return self._streamed(qp, p, Q, q_mask, q_lengths, None, x3)
        return self._launch(qp, p, Q, q_mask, q_lengths, x3, "Corpus.score", key=key)

    def search(self, Q, k, q_mask=None, *, q_lengths=None, q_offsets=None, precision=None):
        """The ``k`` best documents of each query, as :func:`lik_cupy.retrieve` ranks them (a device
        query length outside ``[0, Lq]``: that query's scores NaN, ranked last).

        Args:
            Q, q_mask, q_lengths, q_offsets, precision: as in :meth:`score`.
            k: documents to return per query, 1 .. 4096.

        Returns:
            ``(scores, ids)``: float32 ``[Nq, min(k, Nd)]`` (``[min(k, Nd)]`` for a 2-D Q), best first
            (score descending, ties to the lower index, NaN last), in Q's framework and place;
            and the documents' ``ids`` (int64 indices without them), alike, except that string
            ids come as a NumPy array.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_K:
            raise ValueError(f"k must be an integer in [1, {MAX_K}], got {k!r}")
        fw = self._stand_in(Q, q_mask, q_lengths, q_offsets, 12 * min(int(k), len(self)))
        # (shared arrays gain only where the CuPy search has a repeat path: through a CuPy call without
        # one, as INT8 corpora and string ids have, a JAX search took 1.03-1.04x its plain path)
        if fw and (interop.ADAPTERS[fw].STAND_IN == "staged" or self._search_repeats):
            p = _resolved(precision, fw, Q.dtype)
            return self._through_cupy(fw, (Q,), lambda q: self.search(q, k, precision=p))
        if q_offsets is not None:
            return _by_length(Q, q_mask, q_lengths, q_offsets,
                              lambda q, n, rows, nq: self.search(q, k, q_lengths=n, precision=precision))
        key = call_key("Corpus.search", (None, int(k), precision), Q, (q_mask, q_lengths))
        call = find(self._calls, key)
        if call is not None:
            try:
                return call(Q, q_mask, q_lengths)
            except MemoryError:  # the whole corpus's scores at once: the streamed path below chunks them
                pass
        qp, p = self._problem(Q, q_mask, q_lengths)
        x3 = fp32_accurate(precision, qp.framework, qp.dtype)  # (checks precision on every path)
        if self.where == "host memory":
            r = CpuTopK(Q, q_mask, q_lengths, None, qp, int(k))
            r.add_docs(p, self._host)
            s, i = r.s.astype(np.float32, copy=False), r.i
            if self._ids is not None:
                i = self._ids[i]
            squeeze = len(p.scores_shape) == 1
            s, i = (s[0], i[0]) if squeeze else (s, i)
            return host_result(s, qp), (i if i.dtype.kind in "US" else host_result(i, qp))
        return self._streamed(qp, p, Q, q_mask, q_lengths, int(k), x3, key)

    def rerank(self, Q, candidates, q_mask=None, *, q_lengths=None, q_offsets=None, precision=None):
        """MaxSim of each query against its own candidate documents, read where they lie.

        Args:
            Q, q_mask, q_lengths, q_offsets, precision: as in :meth:`score`.
            candidates: integer ``[Nq, K]`` (``[K]`` for a 2-D Q) document indices (positions in
                the corpus, not ``ids``), in Q's framework and place, or a host array or list.
                Host indices are checked: one outside ``[0, Nd)`` raises ValueError. Indices on
                the GPU are not read back; one outside ``[0, Nd)`` scores NaN.

        Returns:
            float32 ``[Nq, K]`` (``[K]`` for a 2-D Q), in the candidates' order, in Q's framework and place.
        """
        fw = self._stand_in(Q, q_mask, q_lengths, q_offsets, 0)
        how = interop.ADAPTERS[fw].STAND_IN if fw else None
        if how == "staged" and isinstance(candidates, (np.ndarray, list, tuple)):
            one = Q.ndim == 2
            ids, _, shape = self._candidates(candidates, 1 if one else Q.shape[0], one_query=one)
            if ids.size and fits(Q.nbytes, ids.nbytes) and fits(4 * ids.size):
                p = _resolved(precision, fw, Q.dtype)
                return self._through_cupy(fw, (Q, ids.reshape(shape[1:] if one else shape)),
                                          lambda q, c: (self.rerank(q, c, precision=p),))[0]
        elif how == "shared" and _stand_in_framework(candidates) == fw \
                and interop.describe(candidates).device == self.device:  # (device ids: unread, as CuPy ones)
            p = _resolved(precision, fw, Q.dtype)
            return self._through_cupy(fw, (Q, candidates), lambda q, c: (self.rerank(q, c, precision=p),))[0]
        if q_offsets is not None:
            # (the whole candidates checked once, each group then taking its rows of them)
            checked = functools.cache(lambda nq: self._candidates(candidates, nq, one_query=False)[:2])
            return _by_length(Q, q_mask, q_lengths, q_offsets, lambda q, n, rows, nq: (self.rerank(
                q, candidates if rows is None else self._candidate_rows(*checked(nq), rows), q_lengths=n,
                precision=precision),))[0]
        key = call_key("Corpus.rerank", (None, precision), Q, (candidates, q_mask, q_lengths))
        call = find(self._calls, key)
        if call is not None:
            return call(Q, None, q_mask, None, q_lengths, None, None, cand=candidates)
        qp, p = self._problem(Q, q_mask, q_lengths)
        cand, on_device, shape = self._candidates(candidates, qp.nq, one_query=len(p.scores_shape) == 1)
        p = Problem(framework=qp.framework, device=qp.device, dtype=p.dtype, nq=qp.nq, lq=qp.lq, nd=shape[1],
                    ld=self._p.ld, dim=qp.dim, candidates=True, scores_shape=p.scores_shape[:-1] + (shape[1],),
                    argmax_shape=(), q_valid=qp.q_valid, d_valid=self._p.d_valid, d_packed=self._p.d_packed,
                    ntok=self._p.ntok)
        x3 = fp32_accurate(precision, qp.framework, qp.dtype)  # (checks precision on every path)
        if self.where == "host memory":
            s = self._host_rerank(qp, Q, q_mask, q_lengths, cand)
            return host_result(s.reshape(p.scores_shape), qp)
        import cupy

        from ._runtime.candidates import CandidateIds

        with GpuCall(qp, self.device):
            ids = cand if on_device else cupy.asarray(cand)
            ids = CandidateIds(ids.reshape(shape), self._p.nd)
            return self._launch(qp, p, Q, q_mask, q_lengths, x3, "Corpus.rerank", ids,
                                key=key if on_device else None)

    # ------------------------------------------------------------ residency

    def _resident(self, part: Part, info, device, max_gpu_bytes) -> None:
        """Keep the documents on a GPU: in place when they are there, else uploaded when they fit, else
        in page-locked host memory."""
        import cupy

        p = self._p
        if info.device is not None:
            if device is not None and device != info.device:
                raise ValueError(f"D is on cuda:{info.device} but device={device}; move D there, or pass device=None")
            device = info.device
        else:
            use_gpu("gpu", None)  # (a device asked for where none is visible: the error every entry point gives)
            device = cupy.cuda.runtime.getDevice() if device is None else present(device)
        self.device = int(device)
        dispatch.check_gpu_dim(p.dtype, p.dim, "device='cpu'")
        with cupy.cuda.Device(self.device):
            if info.device is not None:
                self._dev = _with_spans(device_docs(part, p), self.device)
                if dispatch.scaled_dtype(p.dtype):  # checked once, raising, as its lengths and offsets are
                    _check_device_scales(self._dev, p)
                self.where = "GPU"
                return
            host = host_docs(part, p)
            need = sum(int(a.nbytes) for a in (host.tokens, host.offsets, host.mask, host.scales) if a is not None)
            need += 4 * p.nd if not p.d_packed and (host.mask is not None or host.lengths is not None) else 0
            if max_gpu_bytes is None:
                free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
                max_gpu_bytes = int(_GPU_SHARE * free)
            if need <= max_gpu_bytes:
                try:
                    self._dev = _upload(host, p, self.device)
                    self.where = "GPU"
                    return
                except cupy.cuda.memory.OutOfMemoryError:  # other work holds the memory: page-locked host memory
                    self._dev = None
            self._lock_pages(host, p)

    def _lock_pages(self, host: HostDocs, p: Problem) -> None:
        """Copy the tokens, scales and mask into page-locked host memory (which the GPU reads by the host
        address); offsets and lengths go to the GPU as well, for the kernels."""
        import cupy
        import cupyx

        def locked(a):
            if a is None:
                return None
            a = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
            try:
                out = cupyx.empty_pinned(a.shape, a.dtype)
            except cupy.cuda.runtime.CUDARuntimeError as e:
                raise MemoryError(f"Corpus: cannot page-lock {a.nbytes:,} bytes of host memory for the documents "
                                  f"({e}); pass a smaller corpus, or raise max_gpu_bytes to keep it on the GPU") from e
            np.copyto(out, a)
            return out

        mask = None if host.mask is None else host.mask.view(np.uint8)
        self._host = HostDocs(locked(host.tokens), offsets=host.offsets, mask=locked(mask), lengths=host.lengths,
                               scales=None if host.scales is None else locked(host.scales.reshape(-1)))
        if not p.d_packed and self._host.scales is not None:
            self._host.scales = self._host.scales.reshape(p.nd, p.ld)
        self._src = staged_source(self._host, p)
        # The kernels' view of the same pages (unified addressing: page-locked memory is mapped at its
        # host address), beside device copies of the small arrays.
        mapped = [_mapped(a, self.device) for a in (self._host.tokens, self._host.mask, self._host.scales)]
        dev = DeviceDocs(mapped[0], mask=mapped[1], scales=None if mapped[2] is None else mapped[2].reshape(-1))
        dev.offsets = None if host.offsets is None else cupy.asarray(host.offsets)
        dev.lengths = None if host.lengths is None else cupy.asarray(host.lengths.astype(np.int32))
        self._dev = _with_spans(dev, self.device)
        self.where = "pinned host memory"

    # ------------------------------------------------------------ one call

    def _problem(self, Q, q_mask, q_lengths) -> tuple[Problem, Problem]:
        """The queries checked (and nothing of the corpus): (their problem, the call's)."""
        q = interop.describe_named("Q", Q)
        if dispatch.scaled_dtype(q.dtype):
            raise TypeError(f"Q is {q.dtype}; a Corpus takes float queries (an INT8 corpus quantises them per call)")
        qp = query_problem(Q, q_mask, q_lengths, None)
        if not dispatch.scaled_dtype(self.dtype) and qp.dtype != self.dtype:
            raise TypeError(f"corpus has dtype {self.dtype} but Q has {qp.dtype}: cast Q to {self.dtype}")
        if self.device is not None:
            if qp.device is not None and qp.device != self.device:
                raise ValueError(f"corpus is on cuda:{self.device} but Q is on cuda:{qp.device}")
            if qp.dtype == "float64":
                raise TypeError("Q is float64, which the GPU kernels do not take: cast it to float32 (an INT8 corpus "
                                "quantises float16, bfloat16 or float32 queries)")
        p = with_queries(qp, self._p)
        return qp, replace(p, scores_shape=(p.nd,)) if len(q.shape) == 2 else p

    def _stand_in(self, Q, q_mask, q_lengths, q_offsets, out_per_query: int) -> str | None:
        """The framework of a call that the CuPy call on the same values stands in for, to take the
        device arrays' repeat path, or None (the plain path, which checks everything): a GPU-resident
        corpus; float16 or float32 queries of its dtype (any float for a scaled corpus) and dim, with
        tokens, and no mask, lengths or offsets, of a framework whose adapter's ``STAND_IN`` says
        how: "staged" (host arrays, within ``host_staging.MAX_BYTES`` each way; ``out_per_query``:
        result bytes a query) or "shared" (device arrays, on the corpus's GPU)."""
        fw = _stand_in_framework(Q)
        if fw is None or self.where != "GPU" or q_mask is not None or q_lengths is not None or q_offsets is not None \
                or Q.ndim not in (2, 3) or Q.dtype.char not in self._stand_in_chars or not Q.dtype.isnative \
                or Q.shape[-1] != self.dim or Q.shape[-2] == 0 or not self._p.nd:
            return None
        if interop.ADAPTERS[fw].STAND_IN == "shared":
            return fw if interop.describe(Q).device == self.device else None
        nq = 1 if Q.ndim == 2 else Q.shape[0]
        return fw if Q.size and fits(Q.nbytes) and fits(nq * out_per_query) else None

    @functools.cached_property
    def _search_repeats(self) -> bool:
        """Whether a search of this corpus can keep a prepared call (``_prepared_search``): a float corpus
        (INT8 queries are quantised on each call) whose ids, if any, are integers (string ids come back
        through the host)."""
        return not dispatch.scaled_dtype(self.dtype) and (self._ids is None or self._ids_dev is not None)

    @functools.cached_property
    def _stand_in_chars(self) -> str:
        """Type characters of the queries ``_stand_in`` takes: float16 ("e") or float32 ("f")."""
        return "ef" if dispatch.scaled_dtype(self.dtype) else {"float16": "e", "float32": "f"}.get(self.dtype, "")

    def _through_cupy(self, framework: str, inputs: tuple, run):
        """``run`` on CuPy arrays of ``inputs`` on the corpus's device, its results handed back as the
        ``framework`` call's: staged ones moved by ``host_staging.staged_call``, shared ones through
        the adapter (DLPack), results as the plain path hands them over."""
        import cupy

        a = interop.ADAPTERS[framework]
        with cupy.cuda.Device(self.device):
            if a.STAND_IN == "staged":
                return staged_call(inputs, run)
            outs = run(*(a.to_cupy(x) for x in inputs))
            return tuple(o if isinstance(o, np.ndarray) else a.from_cupy(o, False) for o in outs)

    def _launch(self, qp: Problem, p: Problem, Q, q_mask, q_lengths, x3: bool, caller: str, cand=None, key=None):
        """One launch of the forward kernel on the resident operands (``cand``: candidate ids), and
        the repeat path's prepared call of its signature ``key`` (None: the call cannot take it)."""
        import cupy

        from ._runtime.device_checks import call_checks
        from ._runtime.launch import launch
        from ._runtime.operands import device_valid, host_metadata

        docs = self._dev
        # device query lengths: the NaN contract, with no host wait; host ones raise (lik_cupy.maxsim)
        with call_checks(True if host_metadata(q_lengths) else None) as checks:
            with GpuCall(qp, self.device) as g:
                q = g.array(Q).reshape(qp.nq, qp.lq, qp.dim)
                qm, ql = device_valid(q_mask, q_lengths, qp.nq, qp.lq, "q_lengths", g.framework, g.on_host, checks)
                kw = {}
                if dispatch.scaled_dtype(p.dtype):
                    from ._runtime.quantize import quantize_cupy

                    q, qs = quantize_cupy(q.view(cupy.uint16) if qp.dtype == "bfloat16" else q, qp.dtype)
                    kw = {"q_scale": qs.reshape(-1), "d_scale": docs.scales}
                else:
                    (q,) = kernel_operands(p.dtype, q)
                ld_hint = -(-p.ntok // max(1, self._p.nd)) if p.d_packed else None
                scores, _ = launch(p, q, docs.tokens, qm, docs.mask, ql, docs.lengths, False, self.device,
                                   d_off=docs.offsets, ld_hint=ld_hint, caller=caller, x3=x3, cand=cand, **kw)
                if cand is not None and (p.lq == 0 or docs.tokens.shape[0] == 0 or (not p.d_packed and p.ld == 0)):
                    # No kernel ran (launch's empty cases): ids outside the corpus still score NaN.
                    ok = (cand.ids >= 0) & (cand.ids < self._p.nd)
                    scores = cupy.where(ok.reshape(scores.shape), scores, np.float32(np.nan))
                checks.apply(p, scores, None, self.device)
                results, _ = g.results(p, scores, None)
                self._keep(key, self._prepared_scores(key, p, q, q_lengths, x3, caller, cand))
            checks.verify()
        return results

    def _keep(self, key, call) -> None:
        """Keep a prepared call (None: none) for the repeats of signature ``key``: a new signature
        takes the place of the oldest stored when ``_MAX_CALLS`` are kept; one kept already (a call
        made again after its prepared call went stale, or a search that fell back to streaming) is
        replaced where it is, evicting nothing."""
        if call is None:
            return
        with self._calls_lock:
            if key not in self._calls and len(self._calls) >= _MAX_CALLS:
                self._calls.pop(next(iter(self._calls)))
            self._calls[key] = call

    def _prepared_scores(self, key, p: Problem, q, q_lengths, x3: bool, caller: str, cand):
        """The :class:`PreparedCall` of ``key``, a call just launched on the current device, where its
        signature allows one (else None): float queries, ids, masks and lengths on the device in Q's
        framework, C-contiguous, and a problem with work (``lik_cupy._runtime.prepared_calls``)."""
        from ._runtime.launch import prepare, use_tma_for
        from ._runtime.prepared_calls import PreparedCall, ResidentDocs

        docs = self._dev
        if key is None or dispatch.scaled_dtype(p.dtype) or not (p.nq and p.nd and p.lq) or docs.tokens.shape[0] == 0 \
                or (not p.d_packed and p.ld == 0):
            return None
        if any(isinstance(k, tuple) and (k[2] < 0 or not k[4]) for k in key[2:]):
            return None
        if q_lengths is not None and q_lengths.dtype.itemsize not in (4, 8):
            return None  # narrowed by a copy on each call
        if cand is not None and cand.ids.dtype.itemsize != key[3][1].itemsize:
            return None  # ids of another width: CandidateIds copies them on each call
        d = docs.tokens
        esize = q.dtype.itemsize
        vec = (p.dim * esize) % 16 == 0 and key[2][3] and d.data.ptr % 16 == 0
        packed = docs.offsets is not None
        ld_hint = -(-p.ntok // max(1, self._p.nd)) if packed else None
        fwd = prepare(p, self.device, esize=esize, vec=vec, use_tma=use_tma_for(p, vec, d.size // p.dim),
                      argmax=False, packed=packed, off_wide=packed and docs.offsets.dtype == np.int64,
                      ld_hint=ld_hint, x3=x3, cand=cand is not None)
        wide = (q_lengths is not None and q_lengths.dtype.itemsize == 8, False,
                packed and docs.offsets.dtype.itemsize == 8)
        resident = ResidentDocs(d.data.ptr, _ptr(docs.mask), _ptr(docs.lengths), _ptr(docs.offsets), self._p.nd)
        return PreparedCall(p.framework, p, self.device, fwd, False, wide, mark=True, caller=caller, docs=resident,
                            cand_wide=cand is not None and cand.ids.dtype == np.int64)

    def _streamed(self, qp: Problem, p: Problem, Q, q_mask, q_lengths, k: int | None, x3: bool, key=None):
        """``score`` (``k`` None) or ``search`` through the streaming engine's chunks (``_streaming.gpu``): over the device arrays, or
        streamed from the page-locked ones. ``key``: a search's signature, whose repeats can be prepared."""
        import cupy

        with GpuCall(qp, self.device) as g:
            r = GpuTopK(Q, q_mask, q_lengths, None, qp, k, None, self.device, x3)
            if k is None:
                r.keep_every(self._p.nd, "Corpus.score")
            if self.where == "GPU":
                r.add_device(p, self._dev)
                if key is not None and r.one_chunk(self._p.nd, self._dev):
                    self._keep(key, self._prepared_search(key, p, r.q, q_lengths, x3, k))
            else:
                r.add_staged(p, self._src)
            if k is None:
                return g.result(r.every.reshape(p.scores_shape))
            s, i = r.s, r.i
            if len(p.scores_shape) == 1:
                s, i = s[0], i[0]
            if self._ids is not None and self._ids.dtype.kind in "US":
                return g.result(s), self._ids[cupy.asnumpy(i)]
            if self._ids_dev is not None:
                i = self._ids_dev[i]
            return g.result(s), g.result(i)

    def _prepared_search(self, key, p: Problem, q, q_lengths, x3: bool, k: int):
        """The repeat of a search just streamed in one chunk (signature ``key``): the scores' prepared
        call, then the top-k merge by kernel handle (``topk.PreparedTopK``); None where the scores' call
        cannot be prepared, or the ids are strings (which come back through the host)."""
        from ._runtime.prepared_calls import PreparedSearch
        from ._runtime.topk import PreparedTopK

        if not self._search_repeats:
            return None
        scores = self._prepared_scores(key, p, q, q_lengths, x3, "Corpus.search", None)
        if scores is None:
            return None
        top = PreparedTopK(self.device, p.nq, p.nd, k, self._ids_dev)
        return PreparedSearch(scores, top, squeeze=len(p.scores_shape) == 1)

    # ------------------------------------------------------------ the NumPy path

    def _host_queries(self, qp: Problem, Q, q_mask, q_lengths):
        """(queries [nq, lq, d], their valid tokens, INT8 scales or None) on the host."""
        q = host_array(Q, qp.framework).reshape(qp.nq, qp.lq, qp.dim)
        qv = valid_host(q_mask, q_lengths, qp.nq, qp.lq, "q_lengths", qp.framework)
        if not dispatch.scaled_dtype(self.dtype):
            return q, qv, None
        q, qs = cpu.quantize_numpy(q, strict=False)  # a NaN or inf token: scale NaN, as on the device
        return q, qv, qs

    def _host_scores(self, qp: Problem, Q, q_mask, q_lengths) -> np.ndarray:
        q, qv, qs = self._host_queries(qp, Q, q_mask, q_lengths)
        h, kw = self._host, {}
        if qs is not None:
            kw = {"q_scale": qs, "d_scale": h.scales}
        if self._p.d_packed:
            s, _ = cpu.maxsim_packed_numpy(q, qv, h.tokens, h.offsets, return_argmax=False, **kw)
        else:
            s, _ = cpu.maxsim_numpy(q, h.tokens, qv, h.valid(slice(None)), candidates=False, nd=self._p.nd,
                                    return_argmax=False, **kw)
        return s.astype(np.float32, copy=False)

    def _host_rerank(self, qp: Problem, Q, q_mask, q_lengths, cand: np.ndarray) -> np.ndarray:
        """Each query against its candidates, gathered (NumPy needs them side by side) in steps of about
        ``_RERANK_BLOCK`` bytes: a few queries' candidate sets at a time, or runs of one query's
        candidates (packed documents: a document past the bound alone, read in place; queries whose
        candidates overlap, their union at once, :meth:`_host_rerank_union`)."""
        q, qv, qs = self._host_queries(qp, Q, q_mask, q_lengths)
        h, (nq, k) = self._host, cand.shape
        out = np.empty((nq, k), np.float32)
        if self._p.d_packed:
            # Runs whose gathered tokens (and their row indices and scales) stay within _RERANK_BLOCK bytes;
            # a document past it alone is read where it lies.
            per_token = self.dim * h.tokens.dtype.itemsize + 8 + (4 if qs is not None else 0)
            if nq > 1 and self._host_rerank_union(q, qv, qs, cand, per_token, out):
                return out
            for i in range(nq):
                starts = h.offsets[cand[i]]
                lens = h.offsets[cand[i] + 1] - starts
                for a, b in _runs(lens * per_token, _RERANK_BLOCK):
                    rows, off = cpu.gathered_rows(starts[a:b], lens[a:b])
                    kw = {} if qs is None else {"q_scale": qs[i:i + 1], "d_scale": h.scales[rows]}
                    s, _ = cpu.maxsim_packed_numpy(q[i:i + 1], qv[i:i + 1], h.tokens[rows], off, return_argmax=False,
                                                   **kw)
                    out[i, a:b] = s[0]
            return out
        # Several queries' candidate sets at a time, or runs of one query's candidates when its set is larger.
        per_candidate = max(1, self._p.ld * (self.dim * h.tokens.dtype.itemsize + 1 + (4 if qs is not None else 0)))
        run = max(1, min(k, _RERANK_BLOCK // per_candidate))
        step = max(1, _RERANK_BLOCK // (run * per_candidate))
        for a in range(0, nq, step):
            b = min(nq, a + step)
            for c0 in range(0, k, run):
                c1 = min(k, c0 + run)
                sel = cand[a:b, c0:c1].reshape(-1)
                kw = {} if qs is None else {"q_scale": qs[a:b], "d_scale": h.scales[sel]}
                s, _ = cpu.maxsim_numpy(q[a:b], h.tokens[sel], qv[a:b], h.valid(sel), candidates=True, nd=c1 - c0,
                                        return_argmax=False, **kw)
                out[a:b, c0:c1] = s
        return out

    def _host_rerank_union(self, q, qv, qs, cand: np.ndarray, per_token: int, out: np.ndarray) -> bool:
        """Packed documents: every query against the union of the candidates ``cand [Nq, K]``, in one call
        per run of the union (``per_token`` bytes a gathered token, ``_RERANK_BLOCK`` a run), each score
        then put where its candidates name it, into ``out [Nq, K]``; a score depends on its query and
        document alone (``lik_cupy._cpu.maxsim``), so these are the per-query calls' bit for bit. Only
        where that scores at most ``_SHARED_WASTE`` times the documents and tokens the per-query calls
        would (so its scores too stay within that many times ``out``'s); returns whether it did."""
        h, (nq, k) = self._host, cand.shape
        u, inv = np.unique(cand, return_inverse=True)
        starts = h.offsets[u]
        lens = h.offsets[u + 1] - starts
        per_query = int((h.offsets[cand + 1] - h.offsets[cand]).sum())
        if nq * u.size > _SHARED_WASTE * cand.size or nq * int(lens.sum()) > _SHARED_WASTE * per_query:
            return False
        inv = inv.reshape(-1)
        pairs = np.argsort(inv, kind="stable")  # the (query, candidate) pairs, by their place in the union
        at = inv[pairs]
        for a, b in _runs(lens * per_token, _RERANK_BLOCK):
            rows, off = cpu.gathered_rows(starts[a:b], lens[a:b])
            kw = {} if qs is None else {"q_scale": qs, "d_scale": h.scales[rows]}
            s, _ = cpu.maxsim_packed_numpy(q, qv, h.tokens[rows], off, return_argmax=False, **kw)
            p0, p1 = np.searchsorted(at, [a, b])
            out.reshape(-1)[pairs[p0:p1]] = s[pairs[p0:p1] // k, at[p0:p1] - a]
            del s
        return True

    def _candidate_rows(self, ids, on_device: bool, rows: np.ndarray):
        """Rows ``rows`` of checked candidates ``ids`` (:meth:`_candidates`' int64 NumPy array, or CuPy
        array on the corpus's device where ``on_device``)."""
        if on_device:
            import cupy

            with cupy.cuda.Device(self.device):  # (the rows' index on the candidates' GPU, not the current one)
                return ids[cupy.asarray(rows)]
        return ids[rows]

    def _candidates(self, candidates, nq: int, one_query: bool):
        """(ids, whether they stay on the device, [Nq, K]) of ``nq`` queries: host ids as int64, checked
        against the corpus (as are device ids for a corpus in host memory); device ids as a CuPy array
        on the corpus's device, unread."""
        want = 1 if one_query else 2
        expected = f"[Nq, K] with Nq = {nq}" if want == 2 else "[K] (Q is one query)"
        if isinstance(candidates, (list, tuple)):
            candidates = host_ints("candidates", candidates, f"{expected}: K indices for every query")
            if candidates.size == 0:
                candidates = candidates.astype(np.int64)
        c = interop.describe_named("candidates", candidates)
        if c.dtype not in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
            raise TypeError(f"candidates must be integer document indices, got dtype {c.dtype}")
        if len(c.shape) != want or (want == 2 and c.shape[0] != nq):
            raise ValueError(f"candidates has shape {list(c.shape)}; expected {expected}")
        shape = (nq, c.shape[-1])
        if c.device is not None and self.device is not None:
            if c.device != self.device:
                raise ValueError(f"candidates are on cuda:{c.device} but the corpus is on cuda:{self.device}")
            return interop.to_cupy(candidates, c.framework), True, shape
        ids = np.asarray(host_array(candidates, c.framework)).reshape(shape)
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            check_id_values("candidates", lo, hi, self._p.nd, f"indices of the {self._p.nd} documents of the corpus")
        return ids.astype(np.int64, copy=False), False, shape


def _stand_in_framework(x) -> str | None:
    """The framework of ``x`` where its adapter has a ``STAND_IN``, else None (also for what is no array:
    the plain path says so)."""
    try:
        fw = interop.framework_of(x)
    except TypeError:
        return None
    return fw if interop.ADAPTERS[fw].STAND_IN else None


def _resolved(precision, framework: str, dtype: np.dtype):
    """The precision a ``framework`` call on ``dtype`` queries resolves to, spelled out for the CuPy call
    that stands in for it (each framework's adapter says its own default: CuPy's follows
    ``CUPY_TF32``, NumPy's nothing, JAX's ``jax_default_matmul_precision``)."""
    if dtype != np.float32:
        return precision
    return "fp32" if fp32_accurate(precision, framework, "float32") else "tf32"


def _by_length(Q, q_mask, q_lengths, q_offsets, call) -> tuple:
    """The results (a tuple) of packed queries, Q ``[Tq, d]`` with ``q_offsets``, as ``call(Q, q_lengths, rows,
    nq)`` gives them for the same queries padded, in Q's framework and place: a group of the ``nq`` at a
    time (``lik_cupy._cpu.query_groups``; ``rows``: the group's queries, None for a single group, every
    query in the caller's order), each padded to its own longest query, and scattered back into the
    queries' order. (Padded to the longest of the call, one long query among many short ones took
    memory growing as their number times its length.)"""
    if q_mask is not None or q_lengths is not None:
        raise ValueError("packed queries (q_offsets) take no q_mask or q_lengths: the offsets give the lengths")
    q = interop.describe_named("Q", Q)
    if len(q.shape) != 2:
        raise ValueError(f"with q_offsets, Q must be packed tokens [Tq, d]; got shape {list(q.shape)}")
    nq = offsets_count("q_offsets", q_offsets, q)
    off = host_offsets(host_array(q_offsets, q.framework), q.shape[0], "q_offsets")
    with contextlib.nullcontext() if q.device is None else GpuCall(q):  # (the caller's device and stream)
        tokens = host_array(Q, q.framework) if q.device is None else interop.to_cupy(Q, q.framework)
        groups = cpu.query_groups(np.diff(off), tokens.itemsize * q.shape[1])
        if len(groups) == 1:
            return call(*_padded(Q, q, tokens, off, None), None, nq)
        parts = [call(*_padded(Q, q, tokens, off, rows), rows, nq) for rows in groups]
        return _scattered(parts, groups, q.framework, q.device)


def _padded(Q, q: interop.Info, tokens, off: np.ndarray, rows):
    """Packed queries ``rows`` (indices; None: all) of Q (``q``: its description; ``tokens``: Q on the host,
    or on its device as CuPy) padded to their longest, and their lengths, in Q's framework and place."""
    fw = q.framework
    if q.device is None:
        padded, _ = cpu.unpack(tokens, off, rows)
        lengths = np.diff(off) if rows is None else np.diff(off)[rows]
        return interop.from_numpy(padded, fw), interop.from_numpy(lengths, fw)
    import cupy

    padded, lengths = unpack_queries(tokens, off, rows)
    padded = interop.bfloat16_from_bits(padded.view(cupy.uint16), fw, False, Q) if q.dtype == "bfloat16" else \
        interop.from_cupy(padded, fw, False)
    return padded, interop.from_cupy(lengths, fw, False)


def _scattered(parts: list, groups: list, fw: str, device) -> tuple:
    """The results of a call's query groups (``parts``: a tuple of results a group, of the queries ``groups``
    (indices), in framework ``fw`` on ``device`` or the host; string ids NumPy) in the queries' order."""
    inverse = np.argsort(np.concatenate(groups))
    out = []
    for xs in zip(*parts):
        if isinstance(xs[0], np.ndarray) and xs[0].dtype.kind in "US":  # string ids: NumPy in any framework
            out.append(np.concatenate(xs)[inverse])
        elif device is None:
            out.append(interop.from_numpy(np.concatenate([interop.to_numpy(x, fw) for x in xs])[inverse], fw))
        else:
            import cupy

            every = cupy.concatenate([interop.to_cupy(x, fw) for x in xs])
            out.append(interop.from_cupy(every[cupy.asarray(inverse)], fw, False))
    return tuple(out)


def _check_ids(ids, nd: int) -> np.ndarray | None:
    """External ids ``[nd]``: int64 or strings, on the host."""
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple, np.ndarray)):
        try:
            ids = interop.to_numpy(ids, interop.framework_of(ids))
        except TypeError:
            raise TypeError(f"ids must be an array or a list of integers or strings, got {type(ids).__name__}") \
                from None
    if isinstance(ids, (list, tuple)):
        mixed = mixed_id_kinds(ids)
        if mixed:
            raise TypeError(mixed)
        a = host_ints("ids", ids, f"[{nd}] (one per document)")
    else:
        a = np.asarray(ids)
    if a.size == 0 and a.dtype.kind == "f":  # (an empty list is float64 to NumPy)
        a = a.astype(np.int64)
    if a.ndim != 1 or a.shape[0] != nd:
        raise ValueError(f"ids has shape {list(a.shape)}; expected [{nd}] (one per document)")
    if a.dtype.kind in "iu":
        if a.size and a.dtype.kind == "u" and int(a.max()) >= 2**63:
            raise ValueError(f"ids holds {int(a.max())}; every entry must fit int64")
        return a.astype(np.int64)
    if a.dtype.kind in "US":
        return a
    raise TypeError(f"ids must be integers or strings, got dtype {a.dtype}")


def _runs(sizes: np.ndarray, budget: int):
    """``(a, b)``: consecutive items ``a .. b-1`` whose ``sizes`` sum to ``budget`` at most (one item at least)."""
    ends = np.cumsum(sizes)
    a = 0
    while a < sizes.size:
        spent = int(ends[a - 1]) if a else 0
        b = max(a + 1, int(np.searchsorted(ends, spent + budget, side="right")))
        yield a, b
        a = b


def _check_device_scales(dev: DeviceDocs, p: Problem) -> None:
    """Raise unless every scale of a valid token of the device documents ``dev`` is finite and >= 0."""
    import cupy

    if p.d_packed:
        check_scales_of_valid(dev.scales, None, "d_scales")
        return
    valid = (dev.mask.astype(bool) if dev.mask is not None else
             cupy.arange(p.ld)[None, :] < dev.lengths[:, None] if dev.lengths is not None else None)
    check_scales_of_valid(dev.scales.reshape(p.nd, p.ld), valid, "d_scales")


def _fields(docs) -> list:
    """The arrays of a ``HostDocs`` or ``DeviceDocs`` (none for None)."""
    return [] if docs is None else [docs.tokens, docs.offsets, docs.mask, docs.lengths, docs.scales]


def _with_spans(docs: DeviceDocs, device: int) -> DeviceDocs:
    """``docs`` with its mask's spans (``_runtime/masks.py``) as its lengths, made once for every call;
    int64 lengths (checked) narrowed once, as every tile reads int32 ones."""
    if docs.mask is not None and docs.lengths is None:
        from ._runtime.masks import mask_spans

        docs.lengths = mask_spans(docs.mask, device)
    elif docs.lengths is not None and docs.lengths.dtype != np.int32:
        docs.lengths = docs.lengths.astype(np.int32)
    return docs


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


def _upload(host: HostDocs, p: Problem, device: int) -> DeviceDocs:
    """Checked host documents copied to the current device, as the kernels read them."""
    import cupy

    def up(a):
        return None if a is None else cupy.asarray(np.ascontiguousarray(a))

    tokens = host.tokens.view(np.uint16) if p.dtype == "bfloat16" else host.tokens
    lengths = None if host.lengths is None else host.lengths.astype(np.int32)
    mask = None if host.mask is None else host.mask.view(np.uint8)
    scales = None if host.scales is None else host.scales.reshape(-1)
    dev = DeviceDocs(up(tokens), offsets=up(host.offsets), mask=up(mask), lengths=up(lengths), scales=up(scales))
    return _with_spans(dev, device)


def _mapped(a: np.ndarray | None, device: int):
    """A CuPy array over page-locked host memory ``a``, for kernels on ``device`` to read in place
    (unified addressing maps page-locked memory at its host address)."""
    if a is None:
        return None
    import cupy

    if a.nbytes == 0:
        return cupy.empty(a.shape, a.dtype)
    mem = cupy.cuda.UnownedMemory(a.ctypes.data, a.nbytes, a, device)
    return cupy.ndarray(a.shape, a.dtype, cupy.cuda.MemoryPointer(mem, 0))
