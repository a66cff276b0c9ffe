"""MaxSim on the CPU with NumPy, with the same semantics as the GPU kernels.

Similarities come from one BLAS GEMM per query and block of documents (multithreaded as NumPy's
BLAS is). The arithmetic:

- float16, bfloat16 and float32 inputs: a float32 GEMM (float16 and bfloat16 blocks are upcast to
  float32 first, exactly); float64 inputs: a float64 GEMM, and float64 scores.
- Scores: each query token's max similarity over a document, summed over the valid query tokens in
  float64 and rounded to float32 (float64 for float64 inputs). The max is the GEMM's, so it differs
  from the float64 MaxSim's by at most the rounding of one dot product, ``gamma_d * ||q|| *
  max_t ||t||`` (``gamma_d`` = ``d * 2**-24 / (1 - d * 2**-24)`` in float32; products that overflow
  float32, past 3e38, are outside any such bound): the accuracy of the plain NumPy matmul loop.
  BLAS rounds a product differently depending on where it falls in its blocking, so the last
  bits of a score can depend on the other documents of its block and on the query's length (two
  identical documents may score a rounding apart); they do not depend on the other queries of
  the call. A max that comes out NaN or infinite is recomputed in float64 (``refine.py``), so NaN
  and inf scores are exactly those of float64.
- Argmax: exactly the argmax of the float64 similarities, the lowest index on ties (``refine.py``
  says how: only documents whose top two GEMM similarities lie within rounding of each other are
  recomputed, in float64, over the columns within that margin).
- INT8 (``q_scale`` / ``d_scale``): the integer dot products are exact in the float32 GEMM (no
  partial sum of int8 products passes 2**24 for ``d <= 1024``; a float64 GEMM beyond), each times
  its document token's scale in float32: the kernels' arithmetic, bit for bit, whatever the blocks.

Memory: the temporaries of one block (similarities, the argmax test's boolean, document tokens
converted for the GEMM, their norms, the per-document maxima) stay under ``block_bytes`` (default
64 MiB), whatever the corpus size, except that a block holds at least one query against one
document. The float64 refinement works through its candidates in chunks of what the block leaves
of that bound, an eighth of it at least: ``9/8 * block_bytes`` in all (plus NumPy's own casting
buffers, a fixed few hundred kilobytes). Blocks hold as many documents as the bound allows: few,
large BLAS calls, which keep BLAS's threads busy (small candidate sets go several queries to one
batched ``matmul``, still one GEMM per query).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .refine import margin, norm_bound, refine
from .runs import Runs

__all__ = ["maxsim_numpy", "maxsim_packed_numpy", "unpack", "BLOCK_BYTES"]

BLOCK_BYTES = 64 << 20
_INT8_EXACT_DIM = 1024  # d * 128 * 128 <= 2**24: every partial sum of int8 products is exact in float32
_PER_MAX = 128  # bytes per (query token, document): its max, threshold, margin, masks, score terms, refined groups


@dataclass(frozen=True)
class _Arith:
    """How a call computes: the GEMM's dtype, whether its similarities are exact (INT8: nothing to
    refine) and the scores' dtype."""

    gemm: np.dtype
    exact: bool
    out: np.dtype

    @staticmethod
    def of(dtype, dim: int, int8: bool) -> _Arith:
        if int8:
            return _Arith(np.dtype(np.float32 if dim <= _INT8_EXACT_DIM else np.float64), True, np.dtype(np.float32))
        if np.dtype(dtype) == np.float64:
            return _Arith(np.dtype(np.float64), False, np.dtype(np.float64))
        return _Arith(np.dtype(np.float32), False, np.dtype(np.float32))

    def element_bytes(self, argmax: bool, packed: bool) -> int:
        """Temporary bytes per similarity: the block itself (and its float32 copy after a float64 INT8
        GEMM), and for the argmax the boolean test plus, for packed documents, the per-column
        thresholds and first-hit codes."""
        n = self.gemm.itemsize + (4 if self.exact and self.gemm.itemsize == 8 else 0)
        if argmax:
            n += 1 + (self.gemm.itemsize + 4 if packed else 0)
        return n


@dataclass(frozen=True)
class _Budget:
    """How one call's blocks fit ``block_bytes``: the temporary bytes held per query (its tokens in the
    GEMM's dtype, their norms), per document token (its similarities with the query's tokens and the
    argmax test; its copy in the GEMM's dtype where it needs converting, and its norm) and per
    document (the query's per-document maxima, thresholds and masks)."""

    fixed: int
    per_token: int
    per_doc: int

    @staticmethod
    def of(lq: int, dim: int, dtype, ar: _Arith, argmax: bool, *, packed: bool) -> _Budget:
        g = ar.gemm.itemsize
        converted = dim * g if np.dtype(dtype) != ar.gemm else 0
        return _Budget(lq * (dim * g + 16), lq * ar.element_bytes(argmax, packed) + converted + g + 1, lq * _PER_MAX)


def maxsim_numpy(Q: np.ndarray, D: np.ndarray, q_valid: np.ndarray, d_valid: np.ndarray, *, candidates: bool,
                 nd: int, return_argmax: bool, block_bytes: int = BLOCK_BYTES, q_scale: np.ndarray | None = None,
                 d_scale: np.ndarray | None = None):
    """Canonical-shape MaxSim (module docstring: the arithmetic and the memory bound).

    Q: [Nq, Lq, d]; D: [Nd, Ld, d] shared by all queries, or [Nq * nd, Ld, d]
    when ``candidates`` (query i scores documents i*nd .. i*nd+nd-1). float16, bfloat16, float32 or
    float64 (both alike), or int8 with scales.
    q_valid: bool [Nq, Lq]; d_valid: bool [D.shape[0], Ld].
    q_scale / d_scale: float32 [Nq, Lq] / [D.shape[0], Ld] for int8 Q and D. The similarity is
    then the exact integer dot product times the document token's scale, rounded to float32,
    and the query token's scale multiplies the max (a negative or NaN one gives NaN, since
    only a non-negative scale commutes with the max): the kernel's arithmetic, so the argmax
    matches the GPU's exactly.
    Returns scores float32 [Nq, nd] (float64 for float64 inputs) and, if asked, argmax int32 [Nq, nd, Lq].
    """
    nq, lq, dim = Q.shape
    ld = D.shape[1]
    ar = _Arith.of(D.dtype, dim, d_scale is not None)
    scores = np.empty((nq, nd), ar.out)
    amax = np.empty((nq, nd, lq), np.int32) if return_argmax else None
    b = _Budget.of(lq, dim, D.dtype, ar, return_argmax, packed=False)
    per_doc = ld * b.per_token + b.per_doc
    docs_per_block = max(1, (block_bytes - b.fixed) // max(1, per_doc))
    out: dict = {}
    if candidates and docs_per_block >= nd:  # whole candidate sets fit: several queries' sets per block
        sets = max(1, min(nq, block_bytes // max(1, b.fixed + nd * per_doc)))
        for i0 in range(0, nq, sets):
            i1 = min(nq, i0 + sets)
            rows = slice(i0 * nd, i1 * nd)
            blk = _DocBlock(_tokens(D[rows], ar, i1 - i0), Runs.padded(nd, ld, d_valid[rows].reshape(i1 - i0, -1)),
                            None if d_scale is None else d_scale[rows].reshape(i1 - i0, -1), out)
            s, a = _score_block(Q[i0:i1], q_valid[i0:i1], blk, ar, return_argmax, block_bytes,
                                None if q_scale is None else q_scale[i0:i1])
            scores[i0:i1] = s
            if amax is not None:
                amax[i0:i1] = a
        return scores, amax
    sets = [(i * nd, range(i, i + 1)) for i in range(nq)] if candidates else [(0, range(nq))]
    for base, queries in sets:  # (the first row of a document set in D, the queries that score it)
        for j0 in range(0, nd, docs_per_block):  # each block's tokens are converted once for all its queries
            j1 = min(nd, j0 + docs_per_block)
            rows = slice(base + j0, base + j1)
            blk = _DocBlock(_tokens(D[rows], ar, 1), Runs.padded(j1 - j0, ld, d_valid[rows].reshape(1, -1)),
                            None if d_scale is None else d_scale[rows].reshape(1, -1), out)
            for i in queries:  # one GEMM per query
                s, a = _score_block(Q[i:i + 1], q_valid[i:i + 1], blk, ar, return_argmax, block_bytes,
                                    None if q_scale is None else q_scale[i:i + 1])
                scores[i, j0:j1] = s[0]
                if amax is not None:
                    amax[i, j0:j1] = a[0]
            del blk
    return scores, amax


def maxsim_packed_numpy(Q: np.ndarray, q_valid: np.ndarray, tokens: np.ndarray, offsets: np.ndarray, *,
                        return_argmax: bool, block_bytes: int = BLOCK_BYTES, q_scale: np.ndarray | None = None,
                        d_scale: np.ndarray | None = None):
    """MaxSim of padded queries against packed documents (``offsets`` int64 [Nd + 1], checked), with
    the arithmetic and memory bound of :func:`maxsim_numpy`.

    Documents go in runs of whole documents whose temporaries fit ``block_bytes`` (one document at
    least), never padded. int8 inputs take ``q_scale`` [Nq, Lq] and ``d_scale`` [T] as in
    :func:`maxsim_numpy`.
    """
    nq, lq, dim = Q.shape
    nd = offsets.size - 1
    ar = _Arith.of(tokens.dtype, dim, d_scale is not None)
    scores = np.empty((nq, nd), ar.out)
    amax = np.empty((nq, nd, lq), np.int32) if return_argmax else None
    b = _Budget.of(lq, dim, tokens.dtype, ar, return_argmax, packed=True)
    cost = np.cumsum(np.diff(offsets) * b.per_token + b.per_doc)  # bytes of documents 0 .. j
    room = block_bytes - b.fixed
    out: dict = {}
    j0 = 0
    while j0 < nd:
        spent = int(cost[j0 - 1]) if j0 else 0
        j1 = min(nd, max(j0 + 1, int(np.searchsorted(cost, spent + room, side="right"))))
        t0, t1 = int(offsets[j0]), int(offsets[j1])
        blk = _DocBlock(_tokens(tokens[t0:t1], ar, 1), Runs.packed(offsets[j0:j1 + 1]),
                        None if d_scale is None else d_scale[None, t0:t1], out)
        for i in range(nq):  # one GEMM per query
            s, a = _score_block(Q[i:i + 1], q_valid[i:i + 1], blk, ar, return_argmax, block_bytes,
                                None if q_scale is None else q_scale[i:i + 1])
            scores[i, j0:j1] = s[0]
            if amax is not None:
                amax[i, j0:j1] = a[0]
        del blk
        j0 = j1
    return scores, amax


def unpack(tokens: np.ndarray, offsets: np.ndarray):
    """Packed rows [T, d] with int64 offsets [N + 1] -> padded [N, Lmax, d] and bool valid [N, Lmax]."""
    lens = np.diff(offsets)
    n, lmax = lens.size, int(lens.max()) if lens.size else 0
    valid = np.arange(lmax)[None, :] < lens[:, None]
    out = np.zeros((n, lmax, tokens.shape[1]), tokens.dtype)
    out[valid] = tokens[offsets[0]:offsets[-1]]
    return out, valid


def _tokens(x: np.ndarray, ar: _Arith, sets: int) -> np.ndarray:
    """Document tokens [..., d] as ``sets`` sets of GEMM rows [sets, n, d] (a view when they already are)."""
    return np.ascontiguousarray(x.reshape(sets, -1, x.shape[-1]), dtype=ar.gemm)


class _DocBlock:
    """One block of documents: ``T [sets, N, d]`` in the GEMM's dtype (one set shared by every query,
    or one candidate set per query), their ``runs`` (the same columns in every set), INT8 scales
    ``d_scale [sets, N]`` (or None), and, computed once for all the queries that read the block, a
    bound on each document's largest valid token norm. ``out`` is the call's similarity buffer, which
    every block's GEMM writes into: a fresh tens-of-megabytes array per GEMM would cost its page
    faults every time."""

    def __init__(self, T: np.ndarray, runs: Runs, d_scale: np.ndarray | None, out: dict):
        self.T, self.runs, self.d_scale, self._out = T, runs, d_scale, out

    def similarities(self, A: np.ndarray) -> np.ndarray:
        """``A [G, Lq, d]`` against the block (G = sets, or any G for one shared set) -> ``[G * Lq, N]``
        in the call's buffer (valid until the next call): one GEMM per query."""
        g, lq, _ = A.shape
        n = self.T.shape[1]
        buf = self._out.get("S")
        if buf is None or buf.size < g * lq * n:
            buf = self._out["S"] = np.empty(g * lq * n, A.dtype)
        S = buf[:g * lq * n].reshape(g, lq, n)
        np.matmul(A, self.T.transpose(0, 2, 1), out=S)
        return S.reshape(g * lq, n)

    @functools.cached_property
    def norms(self) -> np.ndarray:
        """[sets, nb]: an upper bound on the norm of each document's valid tokens."""
        sets, n, dim = self.T.shape
        tn = norm_bound(self.T.reshape(-1, dim)).reshape(sets, n)
        if self.runs.valid is not None:
            tn[~self.runs.valid] = 0
        return np.maximum(self.runs.max(tn), 0)


def _score_block(Q: np.ndarray, q_valid: np.ndarray, blk: _DocBlock, ar: _Arith, want_argmax: bool, budget: int,
                 q_scale: np.ndarray | None):
    """Queries Q [G, Lq, d] against a block of documents (G = 1, or one query per candidate set) ->
    scores float64 [G, nb] and the argmax int32 [G, nb, Lq] (or None)."""
    runs = blk.runs
    g, lq, _ = Q.shape
    A = np.ascontiguousarray(Q, dtype=ar.gemm)
    row_set = np.repeat(np.arange(g), lq) if blk.T.shape[0] > 1 else np.zeros(g * lq, np.intp)
    row_valid = q_valid.reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        S = blk.similarities(A)  # [G * Lq, N]
        if blk.d_scale is not None:  # INT8: the exact integer dot product times the document token's scale, in float32
            S = S.astype(np.float32, copy=False)
            S.reshape(blk.d_scale.shape[0], lq * g // blk.d_scale.shape[0], S.shape[1])[...] *= blk.d_scale[:, None, :]
        runs.mask_invalid(S, row_set)
        if want_argmax and runs.width is not None:
            first, best = runs.argmax(S)  # the max and where it is, in one pass
        else:
            first, best = None, runs.max(S)  # [G * Lq, nb]
        live = row_valid[:, None] & runs.nonempty[row_set]
        bad = live & ~np.isfinite(best)  # NaN or infinite: recomputed whole in float64
        A = A.reshape(g * lq, A.shape[2])
        idx = _argmax(S, best, first, live & ~bad, A, row_set, blk, ar, budget) if want_argmax else None
        if bad.any():
            r, j = np.nonzero(bad)
            loc, val = refine(S, runs, r, j, row_set, None, None if ar.exact else A, None if ar.exact else blk.T,
                              max(budget - S.nbytes, budget // 8))
            best[r, j] = val
            if idx is not None:
                idx[r, j] = loc
        if q_scale is not None:  # an empty document's -inf stays -inf against a zero scale
            qs = np.where(q_scale >= 0, q_scale, np.float32(np.nan)).reshape(-1, 1)
            best = np.where(best == -np.inf, best, best * qs)
        best = np.where(row_valid[:, None], best, 0).reshape(g, lq, runs.count)
        scores = best.sum(axis=1, dtype=np.float64)
    return scores, (None if idx is None else idx.reshape(g, lq, runs.count).transpose(0, 2, 1).astype(np.int32))


def _argmax(S: np.ndarray, best: np.ndarray, first: np.ndarray | None, ok: np.ndarray, A: np.ndarray,
            row_set: np.ndarray, blk: _DocBlock, ar: _Arith, budget: int) -> np.ndarray:
    """The argmax [M, nb] (local columns; -1 outside ``ok``) of the finite maxima ``ok`` marks: the
    GEMM's own where no other column lies within rounding of its max, else ``refine``'s. ``first``:
    the first column of each max, where the caller has it (padded documents)."""
    runs = blk.runs
    if ar.exact and first is not None:
        return np.where(ok, first, -1)  # exact similarities: the first maximum is the answer
    thr = best if ar.exact else best - margin(norm_bound(A), blk.norms[row_set], A.shape[1], ar.gemm)
    hit = runs.compare(S, np.where(ok, thr, np.nan))  # NaN: no column passes
    if first is None:
        first = runs.first_hit(hit)  # (exact similarities: the first maximum)
    idx = np.where(ok, first, -1)
    if not ar.exact:  # where another column is within rounding of the max, float64 decides
        r, j = runs.second_hits(hit, first, ok, budget // 4)
        del hit
        if r.size:
            idx[r, j] = refine(S, runs, r, j, row_set, thr, A, blk.T, max(budget - S.nbytes, budget // 8))[0]
    return idx
