"""The GPU streaming top-k: chunks of documents scored and merged on the device, host corpora
streamed through page-locked staging buffers, chunks halved when the GPU runs out of memory
(the memory formula is in ``lik_cupy.retrieve``'s docstring)."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from .. import _dispatch as dispatch
from .. import _interop as interop
from .._interop import device_array, host_array
from .._runtime.launch import launch
from .._runtime.device_checks import Marks, call_checks, strict
from .._runtime.operands import device_offsets, device_valid, host_metadata, host_offsets
from .._runtime.pinned import span_page_locked
from .._runtime.topk import MAX_K, MERGE_SLICE, merge_topk, split_merge
from .._validate import Problem
from ..errors import DeviceMemoryError
from .docs import DeviceDocs, device_docs, host_docs, staged_source
from .parts import Part, part_problem, same_kind

__all__ = ["GpuTopK", "Chunking", "drive", "outside_stacklevel", "packed_chunks", "parallel_copy", "MAX_CHUNK_DOCS",
           "COPY_THREADS"]

MAX_CHUNK_DOCS = 2**31 - 1 - MAX_K  # the merge kernel counts running + chunk candidates in an int
_DEFAULT_HOST_BUDGET = 1 << 30
_DEFAULT_SCORE_BYTES = 256 << 20
COPY_THREADS = max(1, min(16, os.cpu_count() or 1))
_BUDGET_SLACK = 0.97  # allocator rounding and small per-chunk buffers stay inside max_gpu_bytes


class Chunking:
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
                          RuntimeWarning, stacklevel=outside_stacklevel())
            self._failed, self._warned = None, True


def outside_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised from here at the first caller outside lik_cupy."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def drive(total: int, docs: int, run: Callable[[int, int], None], done: Callable[[], int], chunking: Chunking,
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


class GpuTopK:
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
        self.chunking = Chunking(self._held_bytes)

    def keep_every(self, nd: int, caller: str) -> None:
        """Keep every score of the ``nd`` documents to come, ``[Nq, nd]``, instead of a top-k (``k`` None)."""
        from .._base.device import empty

        self.every = empty((self.qp.nq, nd), np.float32, f"{caller}: scores", "score fewer queries per call")

    def _split_merge(self) -> bool:
        """Whether chunks of more than MERGE_SLICE documents take the two-launch merge."""
        return self.k is not None and split_merge(self.k)

    def _held_bytes(self) -> int:
        """GPU bytes held whatever the chunk size: queries (and their scales), running top-k ping-pong
        (and one slice's winners, the rounding up of the two-launch merge's), or every score."""
        held = self.q.nbytes + (0 if self.qs is None else self.qs.nbytes) + 2 * self.qp.nq * (self.k or 0) * 12
        held += 0 if self.every is None else self.every.nbytes
        return held + (self.qp.nq * self.k * 12 if self._split_merge() else 0)

    def _int8_queries(self) -> None:
        """Quantize float queries on the device, once per call (an int8 Q came with its scales)."""
        if self.qs is None:
            from .._runtime.quantize import quantize_cupy

            q8, qs = quantize_cupy(self.q, self.qp.dtype)
            self.q, self.qs = q8, qs.reshape(-1)  # the float queries are no longer needed: corpora do not mix

    # ------------------------------------------------------------ chunking

    def _chunk_docs(self, doc_bytes: float, staged: bool, spans: bool = False) -> int:
        """Documents per chunk from the memory formula in the module docstring (``spans``: a masked
        corpus on the GPU, whose chunks take the mask spans of masks.py)."""
        nq, lq = self.qp.nq, self.qp.lq
        fixed = self._held_bytes()
        split = -(-lq // 32) if lq > 32 else 0  # partial scores of a query split over tiles
        winners = nq * 12 * self.k / MERGE_SLICE if self._split_merge() else 0
        per_doc = max(1, nq * 4 * (1 + split) + winners + (2 * doc_bytes if staged else 0)  # Nq = 0: no scores
                      + (4 if spans else 0))
        if self.budget is not None:
            room = self.budget * _BUDGET_SLACK - fixed
            if room < per_doc:
                raise ValueError(f"max_gpu_bytes={self.budget} leaves no room for one document "
                                 f"(queries and top-k take {fixed} bytes, each document {per_doc:.0f}); raise it")
            return min(MAX_CHUNK_DOCS, max(1, int(room // per_doc)))
        return min(MAX_CHUNK_DOCS, max(1, int((_DEFAULT_HOST_BUDGET if staged else _DEFAULT_SCORE_BYTES) // per_doc)))

    def _chunked(self, nd: int, docs: int, run: Callable[[int, int], None]) -> None:
        """``drive`` over one shard of ``nd`` documents: ``run(start, c)`` scores from document ``start`` on."""
        import cupy

        first = self.base

        def drop_cache():
            self.scores = None

        drive(nd, docs, run, lambda: self.base - first, self.chunking, (cupy.cuda.memory.OutOfMemoryError, DeviceMemoryError),
               drop_cache)

    # ------------------------------------------------------------ scoring

    def add(self, part: Part):
        info = interop.describe(part.docs)
        p = part_problem(self.qp, part)
        self.kind = same_kind(self.kind, p.dtype, part)
        dispatch.check_gpu_dim(p.dtype, p.dim)
        # (before anything of the shard is read: the checks of an empty one's offsets run on this GPU too)
        if info.device is not None and info.device != self.device:
            if self.on_host_q:
                raise ValueError(f"{part.name} is on cuda:{info.device} but this call scores on cuda:{self.device} "
                                 "(host queries go to the GPU of a list's first device shard, else the current one): "
                                 "put the device shards on one GPU")
            raise ValueError(f"{part.name} is on cuda:{info.device} but Q is on cuda:{self.device}: put them on one "
                             "device")
        if p.nd == 0:  # no document to score, but offsets that cannot be right still raise
            if part.packed and info.device is None:  # host offsets are checked on the host, as the CPU path does
                host_offsets(host_array(part.offsets, info.framework), p.ntok, part.arg("offsets"))
            elif part.packed:
                device_offsets(device_array(part.offsets, info.framework, False), p.ntok, part.arg("offsets"))
            if dispatch.scaled_dtype(p.dtype):
                self._int8_queries()
            return
        if info.device is None:
            self.add_staged(p, staged_source(host_docs(part, p), p))
            return
        self.add_device(p, device_docs(part, p, verify=not self.mark_docs), marked=self.mark_docs)

    def add_device(self, p: Problem, docs: DeviceDocs, marked: bool = False):
        """Score documents on this device (``docs``, checked, or with ``marked`` not: their lengths
        and offsets are then marked NaN chunk by chunk; problem ``p`` as ``with_queries`` makes it)
        in chunks, merging each into the top-k."""
        if dispatch.scaled_dtype(p.dtype):
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

    def one_chunk(self, nd: int, docs: DeviceDocs) -> bool:
        """Whether ``add_device`` scored ``docs`` (``nd`` of them) in one chunk, as planned: a repeat
        can then score them all at once (``Corpus.search``'s repeat path)."""
        spans = docs.mask is not None and docs.lengths is None
        return self.chunking.cap is None and self._chunk_docs(0, staged=False, spans=spans) >= nd

    def _score(self, p: Problem, d, dm, dl, d_off, ld_hint, d_scale=None, d_off_whole=False, off_all=None,
               marked=False):
        """Score one chunk of p.nd documents into the chunk buffer and merge it into the top-k (or keep it).

        Chunks of a scaled dtype (INT8) take ``d_scale``: float32 contiguous, [rows * ld] or [T].
        Unchecked documents are marked NaN where invalid: padded ones' lengths ``dl`` (``marked``),
        packed ones' offsets ``d_off``, a slice of the part's offsets ``off_all`` (given)."""
        import cupy

        n = p.nq * p.nd
        if self.scores is None or self.scores.size < n:
            self.scores = None  # hand the smaller buffer back before the larger one is allocated
            self.scores = cupy.empty(n, cupy.float32)
        kw = {"q_scale": self.qs, "d_scale": d_scale} if dispatch.scaled_dtype(p.dtype) else {}
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
        self.s, self.i = merge_topk(self.device, self.s, self.i, s, nd, self.base, self.k)
        self.base += nd

    # ------------------------------------------------------------ host corpora

    def add_staged(self, p: Problem, src: dict):
        """Stream a host shard (``src``, from ``staged_source``): host threads fill pinned buffers, a
        copy stream uploads, the caller's stream scores."""
        spec = dispatch.elem_spec(p.dtype)
        if spec.scaled:
            self._int8_queries()
        if p.nd == 0:
            return
        esize = spec.bytes
        sbytes = 4 if spec.scaled else 0  # a float32 scale per token
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
            bounds = [(a + start, b + start) for a, b in packed_chunks(off[start:] - off[start], c)]
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
        pool = ThreadPoolExecutor(COPY_THREADS)

        def stage(host: dict, n: str, rows: np.ndarray) -> np.ndarray:
            """The host array a chunk's ``rows`` of array ``n`` upload from."""
            if n in direct:
                return rows
            parallel_copy(pool, host[n][: rows.shape[0]], rows)
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


def packed_chunks(off: np.ndarray, max_docs: int) -> list[tuple[int, int]]:
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


def parallel_copy(pool: ThreadPoolExecutor, dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src, split over threads (NumPy releases the GIL; memory-mapped pages fault in parallel)."""
    n = dst.shape[0]
    if n == 0:
        return
    parts = min(COPY_THREADS, n)
    step = -(-n // parts)
    futs = [pool.submit(np.copyto, dst[i:i + step], src[i:i + step]) for i in range(0, n, step)]
    for f in futs:
        f.result()
