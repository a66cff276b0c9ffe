"""PLAID residual documents on the CPU: decompression and exact MaxSim, with bounded memory.

A token is a centroid code and ``nbits`` bits per dim (``unpack_buckets`` says how they are
packed); its embedding is ``centroids[code] + bucket_weights[bucket]`` per dim, scaled to unit
length when ``normalize`` (as ``torch.nn.functional.normalize``: divided by ``max(norm, 1e-12)``),
computed in float64 and rounded to float32: the values ``decompress_residuals`` returns.

Scoring decompresses the documents a call scores in blocks of whole documents and scores each
block with ``maxsim_packed_numpy``, the exact CPU path: the scores and argmax are those of
``lik_cupy.maxsim_varlen`` over the decompressed float32 embeddings, bit for bit whatever the
blocks (the argmax float64's, each score its winners' float64 dot products).

Candidate sets (one per query): a block holds distinct documents of the union of every query's
candidates, in id order, each decompressed once however many queries name it. The queries that
name some of a block's documents score all of them together (several queries to one GEMM) where
that costs at most ``_SHARED_WASTE`` times the (query, document) pairs they need; otherwise each
query scores only its own documents, gathered from the block.

Where Numba is installed (the ``cpu`` extra), each token is decompressed in one compiled pass
(``residual_kernels.py``: the same bits, checked against NumPy at the first build), the tokens shared
by the chunk threads; ``LIK_DISABLE_NUMBA`` keeps NumPy's passes, as for the fold.

Memory: ``block_bytes`` (default 64 MiB) in all, beside the call's results, its ids (a few int64
per candidate) and at most one copy of the queries (a group of them gathered): 3/16 for a block's
float32 tokens and their rows, then 1/8 for decompressing them in float64 pieces (compiled: three
rows of float64 a thread); while scoring, 3/16 for one query's gathered documents and 1/2 for
``maxsim_packed_numpy`` (9/16 of ``block_bytes`` by its bound), or 1/16 for a shared block's scores
and argmax and 5/8 for ``maxsim_packed_numpy`` (45/64 by its bound). One document whose tokens alone
pass their share is decompressed whole, and ``maxsim_packed_numpy``'s own exceptions hold here
too: a block holds one query token against one document token at least, a long document's queries'
maxima and winners so far (16 bytes a query token) and NumPy's casting buffers come on top. So a
small budget can be passed by those (a few hundred KB; the default 64 MiB only by queries of
millions of tokens).
"""

from __future__ import annotations

import bisect
import threading
import warnings

import numpy as np

from . import cores, fold
from .maxsim import even_cuts, maxsim_packed_numpy, packed_rows
from .refine import dot64

__all__ = ["unpack_buckets", "decompress", "decompress_into", "Tokens", "residual_maxsim_numpy"]

_BLOCK_BYTES = 64 << 20
_SHARED_WASTE = 2  # a shared block's pairs scored per pair needed, at most
_DECOMPRESS_BYTES = 32  # temporary bytes per token and dim while decompressing (float64 values, weights, buckets)
_SHARED_TOKENS = 4096  # tokens from which the compiled decompression is shared by the chunk threads
_lock = threading.Lock()
_kernels = None  # residual_kernels once built and checked, False once that failed, None before the first try


def unpack_buckets(residuals: np.ndarray, nbits: int, dim: int) -> np.ndarray:
    """uint8 ``[n, dim * nbits / 8]`` -> uint8 bucket indices ``[n, dim]``.

    The bits of a row form one stream, each byte filled from its most significant bit
    (``np.packbits``' order); dim ``j``'s bucket is stream bits ``j * nbits .. j * nbits + nbits - 1``,
    least significant first. That is how ColBERTv2 (``ResidualCodec.binarize``) and fast-plaid
    (``packbits`` in its index builder) write them.
    """
    bits = np.unpackbits(residuals.reshape(residuals.shape[0], dim * nbits // 8), axis=1)
    bits = bits.reshape(-1, dim, nbits)
    out = bits[..., 0].copy()
    for b in range(1, nbits):
        out |= bits[..., b] << b
    return out


def _per_byte(weights: np.ndarray, nbits: int) -> np.ndarray:
    """float64 ``[256, 8 / nbits]``: each residual byte's weights, looked up whole (no bit unpacking per token)."""
    return weights.astype(np.float64)[unpack_buckets(np.arange(256, dtype=np.uint8)[:, None], nbits, 8 // nbits)]


def decompress(codes: np.ndarray, residuals: np.ndarray, centroids: np.ndarray, weights: np.ndarray, nbits: int,
               normalize: bool) -> np.ndarray:
    """float64 ``[n, dim]`` embeddings of ``n`` tokens (codes ``[n]``, residuals ``[n, dim * nbits / 8]``): the
    centroid plus its buckets' weights, in float64; with ``normalize``, divided by the larger of its norm
    and 1e-12, the sum of squares by ``refine.dot64`` (NumPy's pairwise order, which ``residual_kernels``
    reproduces)."""
    dim = centroids.shape[1]
    x = centroids[codes.astype(np.intp, copy=False)].astype(np.float64)
    x += _per_byte(weights, nbits)[residuals.reshape(codes.size, dim * nbits // 8)].reshape(codes.size, dim)
    if normalize:
        x /= np.maximum(np.sqrt(dot64(x, x)), 1e-12)[:, None]
    return x


def decompress_into(out: np.ndarray, rows: np.ndarray | None, codes: np.ndarray, residuals: np.ndarray,
                    centroids: np.ndarray, weights: np.ndarray, nbits: int, normalize: bool,
                    scratch_bytes: int) -> None:
    """Tokens ``rows`` (int64 indices into ``codes [T]`` and ``residuals [T, R]``; None: every token) as
    :func:`decompress` computes them, rounded to float32, into ``out [n, dim]``. Compiled and shared by
    the chunk threads where Numba is (the ``cpu`` extra: the same bits); else NumPy in pieces of
    ``scratch_bytes`` of temporaries (one token at least)."""
    n, dim = out.shape
    kernels = _compiled()
    if kernels is None:
        step = max(1, scratch_bytes // (_DECOMPRESS_BYTES * max(dim, 1)))
        for s in range(0, n, step):
            r = slice(s, s + step) if rows is None else rows[s:s + step]
            out[s:s + step] = decompress(codes[r], residuals[r], centroids, weights, nbits, normalize)
        return
    rows = np.arange(n, dtype=np.int64) if rows is None else rows
    run = _kernel(kernels, centroids, weights, nbits, normalize)
    threads = cores.chunk_threads() if n >= _SHARED_TOKENS else 1
    cuts = np.linspace(0, n, threads + 1).astype(np.int64)

    def work(_, parts):
        for a, b in parts:
            run(rows[a:b], codes, residuals, out[a:b])
    cores.run_chunks(list(zip(cuts[:-1], cuts[1:])), work, threads, blas_threads=False)


def _kernel(kernels, centroids: np.ndarray, weights: np.ndarray, nbits: int, normalize: bool):
    """``run(rows, codes, residuals, out)``: the compiled decompression for this codec (float16 centroids
    read by their bits through the widening table)."""
    per_byte = _per_byte(weights, nbits)
    if centroids.dtype == np.float16:
        bits, table = centroids.view(np.uint16), fold.widening_table(np.float16)
        return lambda rows, codes, res, out: kernels.rows16(rows, codes, res, bits, table, per_byte, normalize, out)
    return lambda rows, codes, res, out: kernels.rows32(rows, codes, res, centroids, per_byte, normalize, out)


def _compiled():
    """``residual_kernels`` where the compiled fold runs (``fold.available``) and the kernels agree with
    :func:`decompress` on a probe, else None (one warning says why)."""
    global _kernels
    if not fold.available():
        return None
    if _kernels is None:
        with _lock:
            if _kernels is None:
                _kernels = _first_build()
    return _kernels or None


def _first_build():
    try:
        from . import residual_kernels as kernels

        rng = np.random.default_rng(0x5eed)
        for nbits, dim, cdt in ((1, 8, np.float16), (2, 128, np.float16), (4, 96, np.float32), (2, 200, np.float16)):
            cen = (rng.standard_normal((5, dim)) * np.exp2(rng.integers(-20, 4, (5, dim)))).astype(cdt)
            w = rng.standard_normal(1 << nbits).astype(np.float32)
            codes = rng.integers(0, 5, 9)
            res = rng.integers(0, 256, (9, dim * nbits // 8), dtype=np.uint8)
            for normalize in (True, False):
                want = decompress(codes, res, cen, w, nbits, normalize).astype(np.float32)
                got = np.empty_like(want)
                _kernel(kernels, cen, w, nbits, normalize)(np.arange(9, dtype=np.int64), codes, res, got)
                if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
                    raise ArithmeticError("its decompressed tokens differ from NumPy's")
        return kernels
    except Exception as e:  # noqa: BLE001 (any failure of an optional accelerator leaves NumPy's decompression)
        warnings.warn(f"numba is installed but the compiled PLAID decompression is not used ({type(e).__name__}: "
                      f"{e}); NumPy's runs instead", RuntimeWarning, stacklevel=3)
        return False


class Tokens:
    """Where each document's tokens lie in the flat codes ``[T]`` and residuals ``[T, R]``:
    ``starts[j]`` and ``lens[j]`` for the documents a call scores (int64)."""

    def __init__(self, codes, residuals, centroids, weights, nbits, normalize, starts, lens):
        self.codes, self.residuals, self.centroids, self.weights = codes, residuals, centroids, weights
        self.nbits, self.normalize = nbits, normalize
        self.starts, self.lens = starts, lens

    def decompressed(self, docs: np.ndarray, scratch_bytes: int):
        """Documents ``docs`` (indices into starts/lens) decompressed and packed: float32 ``[n, d]``
        and int64 offsets ``[docs.size + 1]``, computed in pieces of at most ``scratch_bytes`` of
        temporaries (one token at least)."""
        rows, off = packed_rows(self.starts[docs], self.lens[docs])
        out = np.empty((rows.size, self.centroids.shape[1]), np.float32)
        decompress_into(out, rows, self.codes, self.residuals, self.centroids, self.weights, self.nbits,
                        self.normalize, scratch_bytes)
        return out, off


def _blocks(lens: np.ndarray, token_room: int, per_token: int, doc_room: int, per_doc: int):
    """Consecutive runs ``(j0, j1)`` of documents (``lens`` int64 [N]) whose tokens take at most
    ``token_room`` bytes (``per_token`` each) and whose outputs at most ``doc_room`` (``per_doc`` each);
    one document at least. As few runs as fit, evened out in tokens (``maxsim._even``: a short last
    run would be scored alone on BLAS's threads)."""
    tok = np.cumsum(lens * per_token)
    n, j0 = lens.size, 0
    most = max(1, doc_room // max(1, per_doc))
    cuts = even_cuts(tok, max(-(-int(tok[-1]) // max(1, token_room)), -(-n // most)) if n else 1)
    while j0 < n:
        spent = int(tok[j0 - 1]) if j0 else 0
        cut = cuts[bisect.bisect_right(cuts, j0)]
        j1 = min(cut, j0 + most, int(np.searchsorted(tok, spent + token_room, side="right")))
        j1 = max(j0 + 1, j1)
        yield j0, j1
        j0 = j1


def residual_maxsim_numpy(Q: np.ndarray, q_valid: np.ndarray, tokens: Tokens, sets: np.ndarray | None, *,
                          return_argmax: bool, block_bytes: int | None = None):
    """MaxSim of padded queries ``Q [Nq, Lq, d]`` (float16, bfloat16 or float32) against residual
    documents (module docstring: the arithmetic and the memory bound).

    ``sets``: None when every query scores every document of ``tokens`` (scores ``[Nq, Nd]``), or
    int64 ``[Nq, K]``, the documents query ``i`` scores (scores ``[Nq, K]``). Returns float32
    scores and, if asked, int32 argmax ``scores.shape + (Lq,)``.
    """
    budget = block_bytes or _BLOCK_BYTES
    nq, lq, dim = Q.shape
    out_per_doc = 4 + (4 * lq if return_argmax else 0)  # a document's score and argmax, for one query
    if sets is None:
        docs = np.arange(tokens.lens.size, dtype=np.int64)
        scores = np.empty((nq, docs.size), np.float32)
    else:
        docs, inverse = np.unique(sets, return_inverse=True)
        order = np.argsort(inverse.reshape(-1), kind="stable")  # the (query, candidate) pairs by document
        at = inverse.reshape(-1)[order]
        scores = np.empty(sets.shape, np.float32)
    amax = np.empty(scores.shape + (lq,), np.int32) if return_argmax else None
    own_bytes = budget // 2  # maxsim_packed_numpy's, beside a query's gathered documents (3/16)
    shared_bytes = budget * 5 // 8  # and beside a shared block's scores (1/16): the 1/8 the gathered ones leave
    for u0, u1 in _blocks(tokens.lens[docs], budget * 3 // 16, 4 * dim + 8, budget // 16, out_per_doc):
        T, off = tokens.decompressed(docs[u0:u1], budget // 8)
        if sets is None:
            for i0, i1, s, a in _shared(Q, q_valid, np.arange(nq), T, off, budget // 16, out_per_doc,
                                        return_argmax, shared_bytes):
                scores[i0:i1, u0:u1] = s
                if amax is not None:
                    amax[i0:i1, u0:u1] = a
            continue
        # the block's (query, candidate) pairs, by query and then document
        p0, p1 = np.searchsorted(at, [u0, u1])
        nb = u1 - u0
        pair = order[p0:p1]
        by_query = np.argsort(pair // sets.shape[1] * nb + (at[p0:p1] - u0), kind="stable")
        pair = pair[by_query]
        qi, ki, uj = pair // sets.shape[1], pair % sets.shape[1], at[p0:p1][by_query] - u0
        queries, first = np.unique(qi, return_index=True)
        ends = np.r_[first[1:], qi.size]
        lens = np.diff(off)
        distinct = np.r_[True, (qi[1:] != qi[:-1]) | (uj[1:] != uj[:-1])]  # each (query, document) once
        if queries.size * int(off[-1]) <= _SHARED_WASTE * int(lens[uj[distinct]].sum()):
            for i0, i1, s, a in _shared(Q, q_valid, queries, T, off, budget // 16, out_per_doc, return_argmax,
                                        shared_bytes):
                g = slice(int(first[i0]), int(ends[i1 - 1]))
                row = np.searchsorted(queries[i0:i1], qi[g])
                scores[qi[g], ki[g]] = s[row, uj[g]]
                if amax is not None:
                    amax[qi[g], ki[g]] = a[row, uj[g]]
            continue
        for q, g0, g1 in zip(queries.tolist(), first.tolist(), ends.tolist()):
            g = slice(g0, g1)
            own = uj[g][distinct[g]]  # this query's documents in the block, in order
            rows, o = packed_rows(off[own], lens[own])
            s, a = maxsim_packed_numpy(Q[q:q + 1], q_valid[q:q + 1], T[rows], o, return_argmax=return_argmax,
                                       block_bytes=own_bytes)
            del rows
            col = np.searchsorted(own, uj[g])
            scores[q, ki[g]] = s[0, col]
            if amax is not None:
                amax[q, ki[g]] = a[0, col]
        del T
    return scores, amax


def _shared(Q, q_valid, queries: np.ndarray, T: np.ndarray, off: np.ndarray, room: int, out_per_doc: int,
            return_argmax: bool, score_bytes: int):
    """Queries ``queries`` (indices into Q) against every document of a block (``T``, ``off``), in
    groups whose scores and argmax fit ``room`` bytes: ``(i0, i1, scores, argmax)`` for queries
    ``queries[i0:i1]``."""
    nb = off.size - 1
    group = max(1, room // max(1, nb * out_per_doc))
    for i0 in range(0, queries.size, group):
        i1 = min(queries.size, i0 + group)
        q = queries[i0:i1]
        if q[-1] - q[0] == q.size - 1:
            q = slice(int(q[0]), int(q[-1]) + 1)  # (consecutive queries: views, not copies)
        s, a = maxsim_packed_numpy(Q[q], q_valid[q], T, off, return_argmax=return_argmax, block_bytes=score_bytes)
        yield i0, i1, s, a
