"""Streaming top-k retrieval: the k best documents per query over a corpus of any size.

The corpus is scored in chunks of documents. Each chunk's ``[Nq, C]`` scores
are merged on the device into a running top-k (``cuda_src/topk.cu``), so
``[Nq, Nd]`` never exists for the whole corpus. A corpus on the GPU is read in
place; a corpus in host memory (NumPy, memory-mapped ``.npy``) is streamed
through two pinned staging buffers: while the GPU scores chunk c, host
threads fill the other buffer with chunk c+1 and a copy stream uploads it, so
the GPU's memory use stays flat however large the corpus grows.

GPU memory used by one call (bytes), with C documents per chunk::

    Q + Nq * C * 4 * (1 + S)             chunk scores; S = ceil(Lq / 32) partial sums
                                         when Lq > 32 (long queries split over tiles)
      + 2 * Nq * k * 12                  running top-k, ping-pong
      + 2 * C * Ld * (d * e + 1)         staging, host corpora only (e = 2 or 4 bytes;
                                         + C * 4 for lengths; packed: tokens of C documents)

``max_gpu_bytes`` bounds that sum (C is derived from it); the default is
1 GiB for host corpora and 256 MiB of chunk scores for device corpora.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from . import cpu, dispatch, interop
from .forward import (_BACKENDS, _dev_array, _host, _launch, _use_gpu, device_offsets, device_valid, host_offsets,
                      valid_host)
from .validate import Problem, check_call, check_length_values, check_varlen

MAX_K = 4096  # the merge kernel ranks up to this many candidates in shared memory
_DEFAULT_HOST_BUDGET = 1 << 30
_DEFAULT_SCORE_BYTES = 256 << 20
_COPY_THREADS = max(1, min(16, os.cpu_count() or 1))
_BUDGET_SLACK = 0.97  # allocator rounding and small per-chunk buffers stay inside max_gpu_bytes


@dataclass
class _Part:
    """One shard of the corpus: padded ``docs [n, L, d]`` (mask or lengths) or packed ``tokens [T, d]`` + offsets."""

    docs: object
    offsets: object = None
    mask: object = None
    lengths: object = None

    @property
    def packed(self) -> bool:
        return self.offsets is not None


def retrieve(Q, D, k, q_mask=None, *, q_lengths=None, d_offsets=None, d_mask=None, d_lengths=None,
             max_gpu_bytes=None, backend="auto"):
    """Top-k documents per query by MaxSim score, streamed over the corpus.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` query tokens (float16, bfloat16 or float32), any framework.
        D: the corpus, one of
            - padded ``[Nd, Ld, d]`` (with ``d_mask [Nd, Ld]`` or ``d_lengths [Nd]``),
            - packed tokens ``[T, d]`` with ``d_offsets [Nd + 1]`` (int32/int64, from 0 to T),
            - an iterable of shards, each a padded array or a ``(tokens, offsets)`` tuple;
              document indices then run on across shards.
            On the GPU (CuPy, PyTorch, JAX: read in place) or in host memory (NumPy or
            memory-mapped ``.npy``: streamed). Host bfloat16 must be NumPy with dtype
            ``ml_dtypes.bfloat16``. Same dtype and dim as Q.
        k: documents to return per query, 1 .. 4096.
        q_mask / q_lengths: valid query tokens, as in :func:`lik_cupy.maxsim`.
        max_gpu_bytes: bound on the GPU memory this call allocates (see the module
            docstring for the formula); it sets the chunk size.
        backend: "auto", "gpu" or "cpu" (exact NumPy path).

    Returns:
        ``(scores, indices)``: float32 and int64 ``[Nq, min(k, Nd)]`` (``[min(k, Nd)]`` for a
        2-D Q), best first: score descending, ties to the lower document index, NaN scores
        last. In Q's framework and on Q's device (NumPy Q: NumPy results).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_K:
        raise ValueError(f"k must be an integer in [1, {MAX_K}], got {k!r}")
    if max_gpu_bytes is not None and (not isinstance(max_gpu_bytes, (int, np.integer)) or max_gpu_bytes <= 0):
        raise ValueError(f"max_gpu_bytes must be a positive integer, got {max_gpu_bytes!r}")
    parts = _parts(D, d_offsets, d_mask, d_lengths)
    qp = check_call(Q, Q, q_mask, None, q_lengths, None, pairs=False)  # Q's own checks
    squeeze = len(interop.describe(Q).shape) == 2
    if _use_gpu(qp, backend):
        import cupy

        device = qp.device if qp.device is not None else cupy.cuda.runtime.getDevice()
        with interop.caller_stream(qp.framework, device):
            r = _Gpu(Q, q_mask, q_lengths, qp, int(k), max_gpu_bytes, device)
            for part in parts:
                r.add(part)
            s, i = r.result()
    else:
        r = _Cpu(Q, q_mask, q_lengths, qp, int(k))
        for part in parts:
            r.add(part)
        s, i = r.result()
    return (s[0], i[0]) if squeeze else (s, i)


def _parts(D, d_offsets, d_mask, d_lengths) -> Iterable[_Part]:
    if _is_array(D):
        return [_Part(D, d_offsets, d_mask, d_lengths)]
    if d_offsets is not None or d_mask is not None or d_lengths is not None:
        raise TypeError("d_offsets, d_mask and d_lengths go with a single array D; give each shard as (tokens, offsets)")
    if isinstance(D, (str, bytes)) or not isinstance(D, Iterable):
        raise TypeError(f"D must be an array or an iterable of shards, got {type(D).__name__}")
    return (_shard(i, s) for i, s in enumerate(D))


def _shard(i: int, s) -> _Part:
    if _is_array(s):
        return _Part(s)
    if isinstance(s, tuple) and len(s) == 2 and all(_is_array(x) for x in s):
        return _Part(s[0], s[1])
    raise TypeError(f"shard {i} must be a padded array [n, L, d] or a (tokens [T, d], offsets [n + 1]) tuple, "
                    f"got {type(s).__name__}")


def _is_array(x) -> bool:
    try:
        interop.framework_of(x)
        return not isinstance(x, (list, tuple))
    except TypeError:
        return False


def _part_problem(qp: Problem, part: _Part) -> Problem:
    """Check one shard against the queries (before any of it is read) and describe one
    scoring call of Q against the whole shard. Frameworks may differ: a host corpus
    streams to device queries."""
    info = interop.describe(part.docs)
    if info.dtype != qp.dtype:
        raise TypeError(f"corpus has dtype {info.dtype} but Q has {qp.dtype}: cast one so both match")
    if part.packed:
        if len(info.shape) != 2:
            raise ValueError(f"packed corpus tokens must be [T, d]; got shape {list(info.shape)}")
        p = check_varlen(part.docs[:0], part.docs, part.offsets, None, None, None)
    else:
        if len(info.shape) != 3:
            raise ValueError(f"a padded corpus must be [Nd, Ld, d]; got shape {list(info.shape)}")
        p = check_call(part.docs[:0, :1], part.docs, None, part.mask, None, part.lengths, pairs=False)
    if p.dim != qp.dim:
        raise ValueError(f"corpus has dim {p.dim} but Q has dim {qp.dim}")
    return replace(p, framework=qp.framework, device=qp.device, nq=qp.nq, lq=qp.lq, scores_shape=(qp.nq, p.nd),
                   argmax_shape=(qp.nq, p.nd, qp.lq), q_valid=qp.q_valid)


def _merge_host(run_s, run_i, s, base: int, k: int):
    """NumPy merge with the kernel's order: score descending, NaN last, lower index first."""
    idx = np.concatenate([run_i, base + np.broadcast_to(np.arange(s.shape[1], dtype=np.int64), s.shape)], axis=1)
    sc = np.concatenate([run_s, s], axis=1)
    nan = np.isnan(sc)
    order = np.lexsort((idx, -np.where(nan, 0, sc), nan), axis=1)[:, :k]
    return np.take_along_axis(sc, order, 1), np.take_along_axis(idx, order, 1)


class _Cpu:
    def __init__(self, Q, q_mask, q_lengths, qp: Problem, k: int):
        fw = qp.framework
        self.qp, self.k = qp, k
        self.q = _host(Q, fw).reshape(qp.nq, qp.lq, qp.dim)
        self.qv = valid_host(q_mask, q_lengths, qp.nq, qp.lq, "q_lengths", fw)
        self.s = np.empty((qp.nq, 0), np.float32)
        self.i = np.empty((qp.nq, 0), np.int64)
        self.base = 0

    def add(self, part: _Part):
        p = _part_problem(self.qp, part)
        fw = interop.framework_of(part.docs)
        step = 4096
        if part.packed:
            tokens = _host(part.docs, fw)
            off = host_offsets(_host(part.offsets, fw), p.ntok, "d_offsets")
            for a in range(0, p.nd, step):
                b = min(p.nd, a + step)
                s, _ = cpu.maxsim_packed_numpy(self.q, self.qv, tokens, off[a:b + 1], return_argmax=False)
                self._merge(s)
        else:
            docs = _host(part.docs, fw)
            mask = None if part.mask is None else _host(part.mask, fw)  # converted once, sliced per chunk
            lens = None if part.lengths is None else _host(part.lengths, fw)
            for a in range(0, p.nd, step):
                b = min(p.nd, a + step)
                dv = valid_host(None if mask is None else mask[a:b], None if lens is None else lens[a:b], b - a, p.ld,
                                "d_lengths", "numpy")
                s, _ = cpu.maxsim_numpy(self.q, docs[a:b], self.qv, dv, candidates=False, nd=b - a,
                                        return_argmax=False)
                self._merge(s)

    def _merge(self, s):
        self.s, self.i = _merge_host(self.s, self.i, s, self.base, self.k)
        self.base += s.shape[1]

    def result(self):
        fw = self.qp.framework
        if self.qp.device is None:
            return interop.from_numpy(self.s, fw), interop.from_numpy(self.i, fw)
        import cupy

        with cupy.cuda.Device(self.qp.device):
            return (interop.from_cupy(cupy.asarray(self.s), fw, on_host=False),
                    interop.from_cupy(cupy.asarray(self.i), fw, on_host=False))


class _Gpu:
    """Runs inside the caller's stream context (``interop.caller_stream``)."""

    def __init__(self, Q, q_mask, q_lengths, qp: Problem, k: int, max_gpu_bytes, device: int):
        import cupy

        fw = qp.framework
        self.qp, self.k, self.budget, self.device = qp, k, max_gpu_bytes, device
        self.on_host_q = qp.device is None
        q = _dev_array(Q, fw, self.on_host_q)
        if qp.dtype == "bfloat16":
            q = q.view(cupy.uint16)
        self.q = q.reshape(qp.nq, qp.lq, qp.dim)
        self.qm, self.ql = device_valid(q_mask, q_lengths, qp.nq, qp.lq, "q_lengths", fw, self.on_host_q)
        self.s = cupy.empty((qp.nq, 0), cupy.float32)
        self.i = cupy.empty((qp.nq, 0), cupy.int64)
        self.base = 0
        self.scores = None  # chunk score buffer, grown on demand

    # ------------------------------------------------------------ chunking

    def _chunk_docs(self, doc_bytes: float, staged: bool) -> int:
        """Documents per chunk from the memory formula in the module docstring."""
        nq, k, lq = self.qp.nq, self.k, self.qp.lq
        fixed = self.q.nbytes + 2 * nq * k * 12
        split = -(-lq // 32) if lq > 32 else 0  # partial scores of a query split over tiles
        per_doc = nq * 4 * (1 + split) + (2 * doc_bytes if staged else 0)
        if self.budget is not None:
            room = self.budget * _BUDGET_SLACK - fixed
            if room < per_doc:
                raise ValueError(f"max_gpu_bytes={self.budget} leaves no room for one document "
                                 f"(queries and top-k take {fixed} bytes, each document {per_doc:.0f}); raise it")
            return max(1, int(room // per_doc))
        return max(1, int((_DEFAULT_HOST_BUDGET if staged else _DEFAULT_SCORE_BYTES) // per_doc))

    # ------------------------------------------------------------ scoring

    def add(self, part: _Part):
        import cupy

        info = interop.describe(part.docs)
        p = _part_problem(self.qp, part)
        if p.nd == 0:
            return
        if info.device is None:
            self._add_host(part, p)
        else:
            if info.device != self.device:
                raise ValueError(f"corpus is on cuda:{info.device} but Q is on cuda:{self.device}")
            fw = info.framework
            d = interop.to_cupy(part.docs, fw)
            if self.qp.dtype == "bfloat16":
                d = d.view(cupy.uint16)
            if part.packed:
                off = device_offsets(_dev_array(part.offsets, fw, False), p.ntok, "d_offsets")
                ld_hint = -(-p.ntok // p.nd)
                c = self._chunk_docs(0, staged=False)
                for a in range(0, p.nd, c):
                    b = min(p.nd, a + c)
                    self._score(replace(p, nd=b - a), d, None, None, off[a:b + 1], ld_hint)
            else:
                dm, dl = device_valid(part.mask, part.lengths, p.nd, p.ld, "d_lengths", fw, False)
                c = self._chunk_docs(0, staged=False)
                for a in range(0, p.nd, c):
                    b = min(p.nd, a + c)
                    self._score(replace(p, nd=b - a), d[a:b], None if dm is None else dm[a:b],
                                None if dl is None else dl[a:b], None, None)

    def _score(self, p: Problem, d, dm, dl, d_off, ld_hint):
        """Score one chunk of p.nd documents into the chunk buffer and merge it into the top-k."""
        import cupy

        n = p.nq * p.nd
        if self.scores is None or self.scores.size < n:
            self.scores = cupy.empty(n, cupy.float32)
        s, _ = _launch(p, self.q, d, self.qm, dm, self.ql, dl, False, self.device, d_off=d_off, ld_hint=ld_hint,
                       out=self.scores[:n])
        self._merge(s, p.nd)

    def _merge(self, s, nd: int):
        import cupy

        from .compile import get_module
        from .device import device_properties

        nq = self.qp.nq
        k_out = min(self.k, self.s.shape[1] + nd)
        kp = 1 << max(0, (k_out - 1).bit_length())
        out_s = cupy.empty((nq, k_out), cupy.float32)
        out_i = cupy.empty((nq, k_out), cupy.int64)
        if nq:
            arch = dispatch.arch_of(device_properties(self.device).cc)
            kern = get_module("topk.cu", {}, arch, self.device, "lik_topk_merge").get_function("lik_topk_merge")
            smem = kp * 12
            if smem > 40 * 1024:
                kern.max_dynamic_shared_size_bytes = smem
            kern((nq,), (1024,), (self.s, self.i, np.int32(self.s.shape[1]), s, np.int64(nd), np.int32(nd),
                                  np.int64(self.base), out_s, out_i, np.int32(k_out), np.int32(kp)), shared_mem=smem)
        self.s, self.i = out_s, out_i
        self.base += nd

    # ------------------------------------------------------------ host corpora

    def _add_host(self, part: _Part, p: Problem):
        """Stream a host shard: host threads fill pinned buffers, a copy stream uploads, the caller's stream scores."""
        import cupy
        import cupyx

        fw = interop.framework_of(part.docs)
        docs = _host(part.docs, fw)
        if p.dtype == "bfloat16":  # staged and uploaded as raw 16-bit patterns
            docs = docs.view(np.uint16)
        esize = 4 if p.dtype == "float32" else 2
        if part.packed:
            off = host_offsets(_host(part.offsets, fw), p.ntok, "d_offsets")
            mean = p.ntok / p.nd
            c = self._chunk_docs(mean * p.dim * esize + 8, staged=True)
            bounds = _packed_chunks(off, c)
        else:
            off = None
            c = self._chunk_docs(p.ld * (p.dim * esize + (1 if part.mask is not None else 0)) + 4, staged=True)
            bounds = [(a, min(p.nd, a + c)) for a in range(0, p.nd, c)]
            mask = None if part.mask is None else _host(part.mask, fw)
            lens = None if part.lengths is None else np.asarray(_host(part.lengths, fw)).reshape(p.nd)
            if lens is not None and lens.size:
                check_length_values("d_lengths", int(lens.min()), int(lens.max()), p.ld)
        # Largest chunk, in elements, of each staged array.
        if part.packed:
            cap_tok = max(int(off[b] - off[a]) for a, b in bounds)
            shapes = {"docs": (max(cap_tok, 1), p.dim), "off": (max(b - a for a, b in bounds) + 1,)}
            dtypes = {"docs": docs.dtype, "off": np.int64}
        else:
            cap = max(b - a for a, b in bounds)
            shapes = {"docs": (cap, p.ld, p.dim)}
            dtypes = {"docs": docs.dtype}
            if mask is not None:
                shapes["mask"], dtypes["mask"] = (cap, p.ld), np.uint8
            if lens is not None:
                shapes["lens"], dtypes["lens"] = (cap,), np.int32
        pinned = [{n: cupyx.empty_pinned(shapes[n], dtypes[n]) for n in shapes} for _ in range(2)]
        dev = [{n: cupy.empty(shapes[n], dtypes[n]) for n in shapes} for _ in range(2)]
        compute = cupy.cuda.get_current_stream()
        copy = cupy.cuda.Stream(non_blocking=True)
        uploaded = [None, None]  # event: the H2D copy out of pinned[s] finished
        consumed = [None, None]  # event: the scoring that reads dev[s] finished
        pool = ThreadPoolExecutor(_COPY_THREADS)
        try:
            for ci, (a, b) in enumerate(bounds):
                slot = ci % 2
                if uploaded[slot] is not None:
                    uploaded[slot].synchronize()  # pinned[slot] is free again
                host = pinned[slot]
                if part.packed:
                    t0, t1 = int(off[a]), int(off[b])
                    _parallel_copy(pool, host["docs"][: t1 - t0], docs[t0:t1])
                    host["off"][: b - a + 1] = off[a:b + 1] - t0
                    views = {"docs": (t1 - t0,), "off": (b - a + 1,)}
                else:
                    _parallel_copy(pool, host["docs"][: b - a], docs[a:b])
                    views = {"docs": (b - a,)}
                    if mask is not None:
                        host["mask"][: b - a] = mask[a:b]
                        views["mask"] = (b - a,)
                    if lens is not None:
                        host["lens"][: b - a] = lens[a:b]
                        views["lens"] = (b - a,)
                if consumed[slot] is not None:
                    copy.wait_event(consumed[slot])  # dev[slot] no longer read
                for n, (rows,) in views.items():
                    src, dst = host[n], dev[slot][n]
                    nbytes = rows * (src.nbytes // src.shape[0])
                    if nbytes:
                        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, nbytes,
                                                      cupy.cuda.runtime.memcpyHostToDevice, copy.ptr)
                uploaded[slot] = copy.record()
                compute.wait_event(uploaded[slot])
                dv = dev[slot]
                d = dv["docs"]
                nd = b - a
                if part.packed:
                    t = views["docs"][0]
                    self._score(replace(p, nd=nd, ntok=t), d[:t], None, None, dv["off"][: nd + 1],
                                -(-t // max(1, nd)))
                else:
                    self._score(replace(p, nd=nd), d[:nd], None if mask is None else dv["mask"][:nd],
                                None if lens is None else dv["lens"][:nd], None, None)
                consumed[slot] = compute.record()
            for e in consumed:
                if e is not None:
                    e.synchronize()  # the staging buffers are freed on return
        finally:
            pool.shutdown(wait=True)

    def result(self):
        fw = self.qp.framework
        return interop.from_cupy(self.s, fw, self.on_host_q), interop.from_cupy(self.i, fw, self.on_host_q)


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
