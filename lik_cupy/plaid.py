"""Exact MaxSim of PLAID-compressed documents (fast-plaid, ColBERTv2), without decompressing them.

A PLAID index stores each document token as the id of its nearest centroid (``codes``) and
``nbits`` (1, 2 or 4) bits per dim of quantised residual (``residuals``, ``dim * nbits / 8``
bytes a token). The token's embedding is::

    e = centroids[code] + bucket_weights[bucket[j]]   for each dim j,   then e / max(|e|, 1e-12)

where ``bucket[j]`` reads the residual bytes as fast-plaid and ColBERTv2 write them (each byte
filled from its most significant bit, dim j's ``nbits`` bits least significant first). The
functions here score queries against such documents exactly: on the GPU the kernel's tile loader
gathers each token's centroid row and residual bits into shared memory and decompresses them
there, into the float16 (bfloat16 for bfloat16 queries) tile the tensor cores read, so no
decompressed copy exists in memory; the scores equal MaxSim over the decompressed embeddings up to
that float16 rounding. The NumPy path decompresses blocks of documents (bounded memory in bytes;
each distinct candidate once) to the float32 embeddings :func:`decompress_residuals` returns and
scores them as :func:`lik_cupy.maxsim_varlen` does, bit for bit (float64's argmax, scores within
float64 rounding of those embeddings' float64 MaxSim).

- :func:`maxsim_residual` - padded documents ``codes [Nd, Ld]`` (or a candidate set per query,
  ``[Nq, K, Ld]``);
- :func:`maxsim_residual_varlen` - packed documents ``codes [T]`` with offsets, all of them or, with
  ``candidates [Nq, K]``, each query's own candidates scored in place (a PLAID search's rerank);
- :func:`decompress_residuals` - the embeddings themselves (NumPy), to check against a tool's own;
- :class:`PlaidIndex` - a fast-plaid, ColBERTv2 or PyLate index directory, read for exact reranking by
  candidate ids.

Queries are used as given (ColBERT models emit unit-length query tokens). Unlike LIK 0.4.5's
``plaid.maxsim_residual*``, whose ``normalize`` scales queries too, ``normalize`` here is about the
decompressed documents only; and LIK reads each byte's codes from its low bits, which is not how
these tools pack them.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from ._base.device import check_ordinal, gpu_available, present
from ._cpu import packed_rows
from ._cpu.residual import Tokens, decompress_into, residual_maxsim_numpy
from ._dispatch.backend import check_backend, use_gpu
from ._dispatch.config import MAX_DIM_RESIDUAL
from ._interop import GpuCall, describe, host_array, host_result
from ._validate import (ResidualProblem, check_decompress, check_flag, check_id_values, check_index_rerank,
                        check_length_values, check_residual, host_ints)

__all__ = ["maxsim_residual", "maxsim_residual_varlen", "decompress_residuals", "PlaidIndex"]


def maxsim_residual(Q, codes, residuals, d_lengths, centroids, bucket_weights, nbits, q_mask=None, *, q_lengths=None,
                    normalize=True, return_argmax=False, backend="auto"):
    """MaxSim of queries against padded PLAID-compressed documents.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` query tokens, float16, bfloat16 or float32 (the GPU
            rounds float32 queries to float16), in any framework (all arguments share it and its
            device; lengths may be lists).
        codes: integer ``[Nd, Ld]`` centroid ids of the documents scored against every query ->
            scores ``[Nq, Nd]``; or ``[Nq, K, Ld]``, a candidate set per query -> ``[Nq, K]``.
        residuals: uint8 ``codes.shape + (d * nbits / 8,)``, the packed residual bits.
        d_lengths: integer ``codes.shape[:-1]``, each document's tokens (the first ones), or None
            (all ``Ld``).
        centroids: float16 ``[C, d]`` (float32 is accepted; the GPU rounds it to float16).
        bucket_weights: float16 or float32 ``[2**nbits]``, each bucket's value.
        nbits: 1, 2 or 4.
        q_mask, q_lengths: valid query tokens, as in :func:`lik_cupy.maxsim`.
        normalize: scale each decompressed token to unit length (as fast-plaid and ColBERTv2 do).
        return_argmax: also return int32 ``scores.shape + (Lq,)``: each query token's winning
            document token (-1 for masked query tokens and empty documents).
        backend: "auto", "gpu" or "cpu". On the GPU, d must be a multiple of 8, at most 512.

    Returns:
        float32 scores (and the argmax) in the caller's framework and device, with the semantics
        of :func:`lik_cupy.maxsim` (-inf for an empty document, 0 for a query with no valid token).
        Codes outside ``[0, C)`` are refused on the CPU; the GPU path does not read them back to
        check (they are the corpus) and scores them as centroid 0.
    Example::

        >>> import numpy as np, lik_cupy
        >>> rng = np.random.default_rng(0)
        >>> centroids = rng.standard_normal((16, 8)).astype(np.float16)
        >>> weights = np.array([-0.1, -0.03, 0.03, 0.1], np.float32)        # nbits = 2
        >>> codes = rng.integers(0, 16, (3, 5))                             # 3 documents of 5 tokens
        >>> bits = rng.integers(0, 256, (3, 5, 2), dtype=np.uint8)          # 8 dims x 2 bits
        >>> Q = rng.standard_normal((2, 4, 8)).astype(np.float32)
        >>> s = lik_cupy.maxsim_residual(Q, codes, bits, [5, 2, 0], centroids, weights, 2, backend="cpu")
        >>> D = lik_cupy.plaid.decompress_residuals(codes, bits, centroids, weights, 2)
        >>> exact = lik_cupy.maxsim(Q, D, d_lengths=[5, 2, 0], backend="cpu")
        >>> bool(np.allclose(s, exact, rtol=1e-5)), float(s[0, 2])                # document 2 is empty
        (True, -inf)
    """
    check_backend(backend)
    normalize, return_argmax = check_flag("normalize", normalize), check_flag("return_argmax", return_argmax)
    rp = check_residual(Q, codes, residuals, d_lengths, centroids, bucket_weights, nbits, q_mask, q_lengths,
                        packed=False)
    s, a = _score(rp, Q, codes, residuals, d_lengths, centroids, bucket_weights, q_mask, q_lengths, None, normalize,
                  return_argmax, backend, check_offsets=True, check_ids=True)
    return (s, a) if return_argmax else s


def maxsim_residual_varlen(Q, codes, residuals, d_offsets, centroids, bucket_weights, nbits, q_mask=None, *,
                           q_lengths=None, candidates=None, normalize=True, return_argmax=False, validate=True,
                           backend="auto"):
    """MaxSim of queries against packed PLAID-compressed documents: the layout of fast-plaid and
    ColBERTv2 indexes, read in place.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]``, as in :func:`maxsim_residual`.
        codes: integer ``[T]``, every document token's centroid id, documents back to back.
        residuals: uint8 ``[T, d * nbits / 8]``.
        d_offsets: int32 or int64 ``[N + 1]``: document j is tokens ``d_offsets[j]:d_offsets[j + 1]``
            (start at 0, never decrease, end at T).
        centroids, bucket_weights, nbits, normalize: as in :func:`maxsim_residual`.
        candidates: None (every query scores every document -> ``[Nq, N]``), or int32 / int64
            ``[Nq, K]`` (``[K]`` for a 2-D Q): the documents each query scores -> ``[Nq, K]``,
            read where they lie (the rerank of a PLAID search; no gathered copy is made).
        validate: check the offsets and candidate ids on the device (one small kernel each,
            beside the scoring kernel, as :func:`lik_cupy.maxsim_varlen` does; None: the default,
            True). False skips them; the kernel then clamps every read to the inputs, and an id outside ``[0, N)`` scores
            NaN.
        q_mask, q_lengths, return_argmax, backend: as in :func:`maxsim_residual`.

    Returns:
        float32 ``[Nq, N]`` or ``[Nq, K]`` (without the leading axis for a 2-D Q), and the int32
        argmax ``+ (Lq,)`` if asked (token indices within each document), in the caller's
        framework and device.
    Example::

        >>> import numpy as np, lik_cupy
        >>> rng = np.random.default_rng(1)
        >>> centroids = rng.standard_normal((32, 16)).astype(np.float16)
        >>> weights = np.array([-0.05, 0.05], np.float32)                   # nbits = 1
        >>> offsets = np.array([0, 7, 7, 19, 30])                           # 4 documents, one empty
        >>> codes = rng.integers(0, 32, 30)
        >>> bits = rng.integers(0, 256, (30, 2), dtype=np.uint8)            # 16 dims x 1 bit
        >>> Q = rng.standard_normal((2, 3, 16)).astype(np.float32)
        >>> every = lik_cupy.maxsim_residual_varlen(Q, codes, bits, offsets, centroids, weights, 1, backend="cpu")
        >>> picked = lik_cupy.maxsim_residual_varlen(Q, codes, bits, offsets, centroids, weights, 1,
        ...                                          candidates=np.array([[3, 0], [1, 3]]), backend="cpu")
        >>> bool(picked[0, 0] == every[0, 3] and picked[1, 1] == every[1, 3]), float(picked[1, 0])
        (True, -inf)
    """
    check_backend(backend)
    normalize, return_argmax = check_flag("normalize", normalize), check_flag("return_argmax", return_argmax)
    validate = check_flag("validate", validate, none=True) is not False  # (None: the default, True)
    rp = check_residual(Q, codes, residuals, d_offsets, centroids, bucket_weights, nbits, q_mask, q_lengths,
                        packed=True, candidates=candidates)
    s, a = _score(rp, Q, codes, residuals, d_offsets, centroids, bucket_weights, q_mask, q_lengths, candidates,
                  normalize, return_argmax, backend, check_offsets=validate, check_ids=validate)
    return (s, a) if return_argmax else s


def decompress_residuals(codes, residuals, centroids, bucket_weights, nbits, *, normalize=True):
    """The embeddings of PLAID-compressed tokens, computed on the CPU (NumPy, or compiled by Numba where
    the ``cpu`` extra is installed: the same bits).

    Args:
        codes: integer ``[...]`` centroid ids; residuals: uint8 ``codes.shape + (d * nbits / 8,)``;
        centroids, bucket_weights, nbits, normalize: as in :func:`maxsim_residual`.

    Returns:
        float32 ``codes.shape + (d,)`` (each value computed in float64, then rounded), in the
        framework and on the device of ``codes``.
    Example::

        >>> import numpy as np, lik_cupy
        >>> centroids = np.array([[1, 0, 0, 0, 0, 0, 0, 0]], np.float16)
        >>> weights = np.array([0.0, 1.0], np.float32)
        >>> bits = np.array([[0b01000000]], np.uint8)                       # dim 1's bit is set
        >>> lik_cupy.plaid.decompress_residuals(np.array([0]), bits, centroids, weights, 1).round(4)
        array([[0.7071, 0.7071, 0.    , 0.    , 0.    , 0.    , 0.    , 0.    ]], dtype=float32)
    """
    check_decompress(codes, residuals, centroids, bucket_weights, nbits)
    normalize = check_flag("normalize", normalize)
    c = describe(codes)
    fw = c.framework
    cen = np.asarray(host_array(centroids, fw))
    w = np.asarray(host_array(bucket_weights, fw))
    flat = np.asarray(host_array(codes, fw)).reshape(-1)
    r = np.asarray(host_array(residuals, fw)).reshape(flat.size, cen.shape[1] * nbits // 8)  # (no -1: zero tokens)
    _check_codes(flat, cen.shape[0])
    out = np.empty((flat.size, cen.shape[1]), np.float32)
    decompress_into(out, None, flat, r, cen, w, nbits, normalize, 64 << 20)
    return host_result(out.reshape(tuple(c.shape) + (cen.shape[1],)), c)


def _check_codes(codes: np.ndarray, n: int) -> None:
    if codes.size:
        check_id_values("codes", int(codes.min()), int(codes.max()), n, f"ids of the {n} centroids")


# ---------------------------------------------------------------- one call, CPU or GPU


def _score(rp: ResidualProblem, Q, codes, residuals, lens_or_offsets, centroids, weights, q_mask, q_lengths,
           candidates, normalize: bool, return_argmax: bool, backend: str, *, check_offsets: bool, check_ids: bool):
    p = rp.p
    if use_gpu(backend, p.device):
        _check_gpu_dim(p.dim, "Q")
        return _gpu(rp, Q, codes, residuals, lens_or_offsets, centroids, weights, q_mask, q_lengths, candidates,
                    normalize, return_argmax, check_offsets, check_ids)
    return _cpu(rp, Q, codes, residuals, lens_or_offsets, centroids, weights, q_mask, q_lengths, candidates,
                normalize, return_argmax)


def _check_gpu_dim(dim: int, what: str) -> None:
    """ValueError unless the residual kernels take embedding dim ``dim`` (of ``what``: "Q", "the index")."""
    if not (dim % 8 == 0 and dim <= MAX_DIM_RESIDUAL):
        raise ValueError(f"{what} has dim {dim}; the residual kernels need a multiple of 8 up to {MAX_DIM_RESIDUAL} "
                         f"(backend='cpu' takes any dim)")


def _cpu(rp: ResidualProblem, Q, codes, residuals, lens_or_offsets, centroids, weights, q_mask, q_lengths,
         candidates, normalize, return_argmax, checked=False):
    """``checked``: the codes and the candidate ids were checked already (``PlaidIndex.rerank``)."""
    from ._runtime.operands import host_offsets, valid_host

    p, fw = rp.p, rp.p.framework
    q = host_array(Q, fw).reshape(p.nq, p.lq, p.dim)
    qv = valid_host(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw)
    c = np.asarray(host_array(codes, fw)).reshape(-1)
    r = np.asarray(host_array(residuals, fw)).reshape(c.size, rp.rbytes)
    cen, w = np.asarray(host_array(centroids, fw)), np.asarray(host_array(weights, fw))
    if not checked:
        _check_codes(c, rp.n_centroids)
    sets = None
    if p.d_packed:
        # an index's offsets were checked when it was read: a call reads its candidates' alone
        off = np.asarray(lens_or_offsets) if checked else host_offsets(host_array(lens_or_offsets, fw), p.ntok,
                                                                       "d_offsets")
        if candidates is None:
            starts, lens = off[:-1], np.diff(off)
        else:
            sets = np.asarray(host_array(candidates, fw), np.int64).reshape(p.nq, p.nd)
            if sets.size and not checked:
                check_id_values("candidates", int(sets.min()), int(sets.max()), rp.n_docs,
                                f"ids of the {rp.n_docs} documents of d_offsets")
            # the candidates' documents only, in id order (every document's starts and lengths,
            # [N] each, grew with the index whatever the call scored)
            docs, sets = np.unique(sets, return_inverse=True)
            sets = sets.reshape(p.nq, p.nd)
            starts, lens = off[docs], off[docs + 1] - off[docs]
    else:
        rows = p.nq * p.nd if p.candidates else p.nd
        starts = np.arange(rows, dtype=np.int64) * p.ld
        if lens_or_offsets is None:
            lens = np.full(rows, p.ld, np.int64)
        else:
            lens = np.asarray(host_array(lens_or_offsets, fw), np.int64).reshape(rows)
            if lens.size:
                check_length_values("d_lengths", int(lens.min()), int(lens.max()), p.ld)
        if p.candidates:
            sets = np.arange(rows, dtype=np.int64).reshape(p.nq, p.nd)
    tokens = Tokens(c, r, cen, w, rp.nbits, normalize, starts, lens)
    s, a = residual_maxsim_numpy(q, qv, tokens, sets, return_argmax=return_argmax)
    return host_result(s.reshape(p.scores_shape), p), (host_result(a.reshape(p.argmax_shape), p)
                                                       if a is not None else None)


def _gpu(rp: ResidualProblem, Q, codes, residuals, lens_or_offsets, centroids, weights, q_mask, q_lengths,
         candidates, normalize, return_argmax, check_offsets, check_ids):
    import cupy

    from ._runtime.device_checks import DeviceChecks, queue_or_verify
    from ._runtime.candidates import CandidateIds
    from ._runtime.launch import launch
    from ._runtime.operands import device_offsets, device_valid
    from ._runtime.residual import residual_operands

    p = rp.p
    fn = "maxsim_residual_varlen" if p.d_packed else "maxsim_residual"
    with DeviceChecks() as checks:
        with GpuCall(p) as g:
            q = g.array(Q).reshape(p.nq, p.lq, p.dim)
            if rp.q_dtype == "bfloat16":
                q = q.view(cupy.uint16)
            elif rp.q_dtype == "float32":
                q = q.astype(cupy.float16)
            cand = None if candidates is None else CandidateIds(g.array(candidates), rp.n_docs)
            ops = residual_operands(g.array(codes), g.array(residuals), g.array(centroids), g.array(weights),
                                    nbits=rp.nbits, normalize=normalize)
            qm, ql = device_valid(q_mask, q_lengths, p.nq, p.lq, "q_lengths", g.framework, g.on_host, checks)
            if check_ids and cand is not None and cand.ids.size:
                queue_or_verify(checks, "ids", cand.ids, rp.n_docs, "candidates",
                                f"ids of the {rp.n_docs} documents of d_offsets")
            if p.d_packed:
                doff = device_offsets(g.array(lens_or_offsets), p.ntok, "d_offsets", check_offsets, checks)
                scores, amax = launch(p, q, ops.codes, qm, None, ql, None, return_argmax, g.device, d_off=doff,
                                      caller=fn, residual=ops, cand=cand)
            else:
                rows = p.nq * p.nd if p.candidates else p.nd
                _, dl = device_valid(None, lens_or_offsets, rows, p.ld, "d_lengths", g.framework, g.on_host, checks)
                scores, amax = launch(p, q, ops.codes.reshape(rows, p.ld), qm, None, ql, dl, return_argmax, g.device,
                                      caller=fn, residual=ops)
            results = g.results(p, scores, amax)
        checks.verify()  # last, while the scoring kernel runs (lik_cupy._runtime.device_checks)
    return results


# ---------------------------------------------------------------- index directories


class PlaidIndex:
    """A fast-plaid, ColBERTv2 or PyLate PLAID index, read for exact reranking by candidate ids.

    ``PlaidIndex.open(index_dir)`` reads the codec (centroids, bucket weights), every document's
    codes and packed residual bits (memory-mapped where the files allow) and the document
    offsets (``lik_cupy._plaid_files`` describes the layouts), checks that every code names a
    centroid, and decompresses nothing. Index files are read as hostile: anything missing,
    special, truncated, inconsistent across files or of the wrong type raises
    :class:`lik_cupy.errors.ShardError` naming the file. Bucket weights are rounded to float16,
    as both tools decompress with them on the GPU.

    Attributes: ``kind`` ("fast-plaid" or "colbertv2"), ``nbits``, ``dim``, ``centroids``
    (float16 ``[C, d]``), ``bucket_weights`` (float32 ``[2**nbits]``), ``codes`` (``[T]``),
    ``residual_bits`` (uint8 ``[T, d * nbits / 8]``), ``offsets`` (int64 ``[N + 1]``); ``len()``
    is the number of documents.

    The first GPU :meth:`rerank` on a device copies the compressed corpus there once (about
    ``T * (4 + d * nbits / 8)`` bytes; :meth:`to_device` does it ahead of time); each call then
    scores every query's candidates where they lie: device queries on their GPU, host queries on
    the GPU of the last :meth:`to_device` (else the current one).
    """

    def __init__(self, arrays):
        self.kind = arrays.kind
        self.nbits = arrays.nbits
        self.centroids = arrays.centroids
        self.bucket_weights = arrays.bucket_weights
        self.codes = arrays.codes
        self.residual_bits = arrays.residuals
        self.offsets = arrays.offsets
        self.dim = self.centroids.shape[1]
        self._device: dict[int, tuple] = {}
        self._home: int | None = None  # to_device's GPU: where host queries are scored

    @classmethod
    def open(cls, index_dir: str | os.PathLike) -> PlaidIndex:
        """Read the fast-plaid, ColBERTv2 or PyLate index in directory ``index_dir`` (ShardError naming
        the file for any file that is not what the layout says)."""
        from ._plaid_files import read_index

        return cls(read_index(index_dir))

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __repr__(self) -> str:
        return (f"PlaidIndex({self.kind}, {len(self)} documents, {int(self.offsets[-1])} tokens, dim {self.dim}, "
                f"nbits {self.nbits}, {self.centroids.shape[0]} centroids)")

    def _ids(self, doc_ids) -> np.ndarray:
        ids = (host_ints("doc_ids", doc_ids) if isinstance(doc_ids, (list, tuple)) else np.asarray(doc_ids)).reshape(-1)
        if not ids.size:
            return ids.astype(np.int64)
        if ids.dtype.kind not in "iu":  # a float or bool id would be truncated to another document's
            raise TypeError(f"doc_ids must be integer document ids, got dtype {ids.dtype}")
        check_id_values("doc_ids", int(ids.min()), int(ids.max()), len(self), f"ids of the {len(self)} documents")
        return ids.astype(np.int64)

    def residuals(self, doc_ids):
        """The compressed tokens of documents ``doc_ids``, packed in that order: (codes ``[n]``,
        residual bits uint8 ``[n, d * nbits / 8]``, int64 offsets ``[len(doc_ids) + 1]``), NumPy
        copies of those documents only."""
        ids = self._ids(doc_ids)
        starts = self.offsets[ids]
        rows, off = packed_rows(starts, self.offsets[ids + 1] - starts)
        return np.asarray(self.codes[rows]), np.asarray(self.residual_bits[rows]), off

    def embeddings(self, doc_ids) -> list:
        """Documents ``doc_ids`` decompressed (float32 ``[len_j, d]`` each, with NumPy): the values
        :meth:`rerank` scores, computed in float64 and rounded once. fast-plaid's ``get_embeddings``
        returns the same list, but computes each value in float16 arithmetic, so its values differ
        from these by that rounding (at most 2.6e-4 on tests/data/fast_plaid's unit-length tokens),
        not bit for bit."""
        codes, bits, off = self.residuals(doc_ids)
        flat = decompress_residuals(codes, bits, self.centroids, self.bucket_weights, self.nbits)
        return [flat[off[j]:off[j + 1]] for j in range(off.size - 1)]

    def to_device(self, device: int | None = None) -> PlaidIndex:
        """Copy the compressed corpus to GPU ``device`` (default: the current one), once, and score
        host queries there from now on (:meth:`rerank`; device queries stay on their own GPU). A
        ``device`` that is no int >= 0 raises ValueError, and so does one past this machine's
        GPUs (where it has any), or an index whose dim the residual kernels do not take (a
        multiple of 8 up to 512), before anything is copied; without a GPU (or CuPy), RuntimeError."""
        check_ordinal(device, " or None")
        if not gpu_available():  # (CUDA's own error named the driver, not the call)
            raise RuntimeError("PlaidIndex.to_device: no CUDA GPU is visible (CuPy could not find one, or is not "
                               "installed); rerank scores on the CPU without it")
        self._home, _ = self._on_device(None if device is None else present(device))
        return self

    def _on_device(self, device: int | None):
        _check_gpu_dim(self.dim, "the index")  # before the corpus is copied there for nothing
        import cupy

        if device is None:
            device = cupy.cuda.runtime.getDevice()
        if device not in self._device:
            with cupy.cuda.Device(device):
                self._device[device] = (
                    cupy.asarray(np.asarray(self.codes, np.int32)), cupy.asarray(np.asarray(self.residual_bits)),
                    cupy.asarray(self.offsets), cupy.asarray(self.centroids), cupy.asarray(self.bucket_weights))
        return device, self._device[device]

    def rerank(self, Q, candidate_ids, q_mask=None, *, q_lengths=None, return_argmax=False, backend="auto"):
        """Exact MaxSim of each query against its own candidate documents.

        Args:
            Q: ``[Nq, Lq, d]`` (or ``[Lq, d]``) query tokens, float16, bfloat16 or float32, in
                any framework.
            candidate_ids: int32 or int64 ``[Nq, K]`` (``[K]`` for a 2-D Q) document ids (other
                dtypes raise TypeError), in Q's framework and place, or a list of ints; they are
                checked against ``len(self)``.
            q_mask, q_lengths, return_argmax, backend: as in :func:`maxsim_residual_varlen`.

        Returns:
            float32 ``[Nq, K]`` scores (and the argmax), in Q's framework and device, in the
            candidates' order (sort them for a ranking). Device queries are scored on their GPU;
            host queries, on the GPU, on the device of the last :meth:`to_device` (else the
            current one), and their results come back on the host.
        """
        check_backend(backend)
        return_argmax = check_flag("return_argmax", return_argmax)
        if candidate_ids is None:
            raise TypeError("candidate_ids is None; expected integer document ids [Nq, K] (or [K] for a 2-D Q)")
        # Checked as given, before anything is copied (the index's own arrays were checked when it was
        # read); host ids on their values too, device ones by the scoring call.
        rp = check_index_rerank(Q, candidate_ids, q_mask, q_lengths, dim=self.dim, nbits=self.nbits,
                                n_centroids=self.centroids.shape[0], ntok=self.codes.shape[0], n_docs=len(self))
        q = rp.p
        fw = q.framework
        on_gpu = use_gpu(backend, q.device)
        ids = candidate_ids
        if not on_gpu or q.device is None or isinstance(ids, (list, tuple)):
            ids = np.asarray(host_array(ids, fw))
            if ids.size:
                check_id_values("candidate_ids", int(ids.min()), int(ids.max()), len(self),
                                f"ids of the {len(self)} documents of the index")
            ids = ids.astype(np.int64)  # int32 or int64 as checked (or an empty list's float64)
        if not on_gpu:
            host = [None if a is None else np.asarray(host_array(a, fw)) for a in (Q, q_mask, q_lengths)]
            hp = replace(rp, p=replace(q, framework="numpy", device=None))  # (the host copies')
            s, a = _cpu(hp, host[0], self.codes, self.residual_bits, self.offsets, self.centroids, self.bucket_weights,
                        host[1], host[2], ids, True, return_argmax, checked=True)
            s, a = host_result(s, q), None if a is None else host_result(a, q)
            return (s, a) if return_argmax else s
        where = self._home if q.device is None else q.device  # (host queries go where to_device put the index)
        device, (codes, bits, offsets, centroids, weights) = self._on_device(where)
        import cupy

        with GpuCall(q, device) as g:
            dq, dm, dl = [None if a is None else g.array(a) for a in (Q, q_mask, q_lengths)]
            host_ids = isinstance(ids, np.ndarray)
            dids = cupy.asarray(ids) if host_ids else g.array(ids)
            # The offsets were checked when the index was read; device ids are checked on the device.
            scores, amax = _gpu(replace(rp, p=replace(q, framework="cupy", device=device)), dq, codes, bits, offsets,
                                centroids, weights, dm, dl, dids, True, return_argmax, False, not host_ids)
            scores = g.result(scores)
            amax = None if amax is None else g.result(amax)
        return (scores, amax) if return_argmax else scores

