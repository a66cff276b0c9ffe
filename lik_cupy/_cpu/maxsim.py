"""MaxSim on the CPU with NumPy, with the same semantics as the GPU kernels.

Similarities come from BLAS GEMMs (multithreaded as NumPy's BLAS is), several queries' tokens to one
GEMM where documents are shared. The arithmetic:

- float16, bfloat16 and float32 inputs: a float32 GEMM (float16 and bfloat16 blocks are upcast to
  float32 first, exactly); float64 inputs: a float64 GEMM, and float64 scores.
- The winner of each query token in each document is exactly the argmax of the *reference
  similarity* (``refine.py``: the float64 dot product of the two vectors, summed in one fixed
  order, a function of the two vectors alone), the lowest index on ties. The GEMM only points at
  it: where no other column lies within the GEMM's rounding of a document's max (a margin from a
  bound on the query token's and the document tokens' norms), the max's column is the winner; the
  pairs where one does (near ties, identical tokens), and those whose max comes out NaN or
  infinite, are decided in float64 (``refine.Pending``).
- Scores: each valid query token's winner similarity, recomputed as the reference similarity (one
  dot product per query token and document: ``1 / Ld`` of the GEMM's products), summed in float64
  in query-token order and rounded to float32 (float64 for float64 inputs). So a score depends on
  the query and the document alone, never on the blocks, the other documents or queries of the
  call, the query's padding, the layout (padded, packed, candidates) or BLAS's threads: bit for bit
  the same however a corpus is split over calls, processes or machines (for one NumPy build). It
  lies within float64 rounding of the float64 MaxSim (float32 inputs' products are exact in
  float64); NaN and inf scores are exactly those of float64.
- INT8 (``q_scale`` / ``d_scale``): the integer dot products are exact in the float32 GEMM (no
  partial sum of int8 products passes 2**24 for ``d <= 1024``; a float64 GEMM beyond), each times
  its document token's scale in float32: the kernels' arithmetic, bit for bit, whatever the blocks
  (nothing to refine or recompute).
- FP8 e4m3 (ml_dtypes ``float8_e4m3fn`` Q and D, with scales as INT8's): a float64 GEMM of the
  exactly dequantised values, whose dot products are exact (every product is a multiple of 2**-18
  below 2**18, so every partial sum is exact for ``d < 2**17``), rounded to float32 and then as
  INT8's. The kernels' float32 tensor-core sums may round where this does not.

Speed: a block goes through the GEMM in chunks of documents whose similarities and tokens fit
``_CACHE_BYTES``, each chunk's GEMM in pieces whose tokens are read once for their norm bound just
before; everything after the GEMM (argmax, second max, the winners' dot products) reads from the
cache. A large block's chunks are shared by a thread per core (``cores.py``), each running its
chunks' GEMMs single-threaded and every pass after them, so that the NumPy passes use every core
too; a block too small to share runs its GEMMs on one thread as well (BLAS's own threads would not
pay for their hand-over). With Numba (the ``cpu`` extra, ``fold.py``), a block of one document set and
inexact similarities runs its GEMMs with the document tokens as rows, any number of query rows, and
each piece is folded as soon as it is filled: the argmax, the second max and the winners' reference
similarities in one compiled pass, while the piece's tokens are in the cache. Without it, a float32
GEMM of few query rows runs with the document tokens as its rows into a small scratch per chunk
thread taken out of ``block_bytes``, copied transposed into the similarities (``_TOKENS_FIRST_ROWS``),
and NumPy's passes follow; the results are the same bits either way. The norm bound and the
winners' dot products are what exactness costs over a plain GEMM and max: a pass over the tokens and
``Lq * Nd`` dot products, most visible with few short queries (``docs/benchmarks.md``).

Memory: the temporaries of one block (similarities, document tokens converted for the GEMM, their
norm bounds, the per-document maxima, thresholds and winners) stay under ``block_bytes`` (default
64 MiB), whatever the corpus size and however long one document or query is. A block the compiled
fold scores never holds its similarities whole, only each chunk thread's buffer of one chunk: its
budget counts those buffers instead of a similarity per query row and token wherever that fits
more documents into a block (few chunk threads and a large call: 32 queries of 32 tokens against
1,000 documents of 180 went from 14 blocks to 3 on two cores). A document that passes the bound
with one query (its tokens, or the query's) is scored in runs of its tokens against blocks of the
query's rows, whose winners combine exactly (the larger reference similarity, the earlier run on
ties, the first NaN). The winners' dot products and the float64 decisions work through their pairs
in pieces of an eighth of that bound (all chunk threads together): ``9/8 * block_bytes`` in all (plus
NumPy's own casting buffers, a fixed few hundred kilobytes), except that a block holds one query token
against one document token at least. Beside it, as the results are: while such a document is scored,
its queries' maxima and winners so far (16 bytes a query token).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import cores, fold
from .refine import Pending, bound_norms, dot64, margin, norm_bound
from .runs import Runs

__all__ = ["maxsim_numpy", "maxsim_packed_numpy", "unpack", "packed_rows", "gathered_rows", "query_groups",
           "even_cuts", "BLOCK_BYTES", "QUERY_CHUNK"]

BLOCK_BYTES = 64 << 20
QUERY_CHUNK = 16 << 20  # bytes of padded queries a group of packed queries may take however ragged (query_groups)
_WIDENED = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))  # 16-bit floats fold.float32_tokens widens
_INT8_EXACT_DIM = 1024  # d * 128 * 128 <= 2**24: every partial sum of int8 products is exact in float32
_PER_MAX = 128  # bytes per (query token, document): its max, threshold, margin, masks, winner, reference value
_DOT_CHUNK = 2 << 20  # bytes the winners' dot products gather and convert at a time (cache-sized)
_GROUP_DOCS = 32  # documents a block holds at least before queries share its GEMM
_NORM_TOKENS = 16  # consecutive document tokens whose norm is bounded together (the margin's looseness: its sqrt)
_CACHE_BYTES = 8 << 20  # a chunk's similarities and tokens at most: what follows its GEMM reads them from cache
_PIECE_COLUMNS = 2048  # columns of a chunk's GEMM at a time (a multiple of _NORM_TOKENS), read first for their norm bounds
# With the compiled fold, a piece's tokens and similarities in about this many bytes (the cache holds them
# for the fold, which reads both after the GEMM), and this many columns at least (each GEMM call packs the
# query rows again: 1,024 query rows in pieces of 512 columns took 1.03x the time of 1,024; AMD EPYC,
# OpenBLAS 0.3.31; one 32-token query, 2 MiB against 1 MiB: 0.92-0.97x whole calls, 512 KiB 1.02x)
_FOLD_PIECE_BYTES = 2 << 20
_FOLD_PIECE_MIN = 1024
_SPLIT_MACS = 1 << 24  # multiply-adds of a block's GEMM per thread at least, for its chunks to be shared
# A float32 GEMM of this many query rows per set or fewer runs with the document tokens as its rows, into
# a scratch of _TOKENS_FIRST_BYTES per chunk thread (out of the call's block_bytes), and is copied
# transposed into the similarity block: OpenBLAS's sgemm of 32 rows against many columns took 0.81x the
# time the other way round, copy included (AMD EPYC, OpenBLAS 0.3.31; 16 rows 0.71x, 64 rows 0.86x, 128
# rows and float64 slower: docs/benchmarks.md, "CPU"). Blocks under 16 scratches keep the plain GEMM.
_TOKENS_FIRST_ROWS = 64
_TOKENS_FIRST_BYTES = 256 << 10


@dataclass(frozen=True)
class _Arith:
    """How a call computes: the GEMM's dtype, whether its similarities are exact (scaled types, INT8
    and FP8: nothing to refine or recompute) and the scores' dtype."""

    gemm: np.dtype
    exact: bool
    out: np.dtype

    @staticmethod
    def of(dtype, dim: int, scaled: bool) -> _Arith:
        if scaled and np.dtype(dtype) == np.int8:
            return _Arith(np.dtype(np.float32 if dim <= _INT8_EXACT_DIM else np.float64), True, np.dtype(np.float32))
        if scaled:  # FP8: exact in float64 (the module's docstring)
            return _Arith(np.dtype(np.float64), True, np.dtype(np.float32))
        if np.dtype(dtype) == np.float64:
            return _Arith(np.dtype(np.float64), False, np.dtype(np.float64))
        return _Arith(np.dtype(np.float32), False, np.dtype(np.float32))

    def element_bytes(self, argmax: bool, packed: bool) -> int:
        """Temporary bytes per similarity: the block itself (and its float32 copy after a float64 INT8
        GEMM), and where a winner is looked for in packed documents, the boolean test beside either the
        thresholds repeated over the columns (``Runs.compare``: float32, float64 against float64
        similarities) or, after them, the first-hit codes (``Runs.first_hit``: int32, int64 past 2**31
        columns), never both. Inexact similarities always look for the winner (the scores are its
        reference similarity)."""
        n = self.gemm.itemsize + (4 if self.exact and self.gemm.itemsize == 8 else 0)
        if packed and (argmax or not self.exact):
            n += 1 + 8
        return n


@dataclass(frozen=True)
class _Budget:
    """How one call's blocks fit ``block_bytes``: the temporary bytes held per query (its tokens in the
    GEMM's dtype and, where the winners' dot products need them, in float64; their norms), per
    document token (its similarities with the query's tokens and the argmax test; its copy in the
    GEMM's dtype where it needs converting, and its norm) and per document (the query's
    per-document maxima, thresholds, winners and masks)."""

    fixed: int
    per_token: int
    per_doc: int

    @staticmethod
    def of(lq: int, dim: int, dtype, ar: _Arith, argmax: bool, *, packed: bool, folded: int | None = None) -> _Budget:
        """``folded``: for a block the compiled fold scores, the call's longest document (tokens). Its
        similarities are then counted as what they are there, each chunk thread's buffer of one chunk
        (``_chunk_plan``: ``_CACHE_BYTES`` of similarities and tokens, or one document), held through
        the block, in place of every token's."""
        g = ar.gemm.itemsize
        converted = dim * g if np.dtype(dtype) != ar.gemm else 0
        packed = g if ar.gemm == np.float32 and not ar.exact else 0  # where the fold may run: its GEMM's copy of A
        rows = dim * (g + (0 if ar.exact else 8) + packed)  # (_block_maxima's A and A64, and that copy)
        fixed = lq * (rows + 16) + fold.GEMM_PAD_ROWS * dim * packed  # (the copy's rows padded to whole tiles)
        if folded is None:
            return _Budget(fixed, lq * ar.element_bytes(argmax, packed) + converted + g + 1, lq * _PER_MAX)
        buffers = cores.chunk_threads() * max(_CACHE_BYTES, lq * max(folded, 1) * g)
        return _Budget(fixed + buffers, converted + g + 1, lq * _PER_MAX)

    def run_tokens(self, block_bytes: int) -> int:
        """Tokens of one document a block may hold (one at least)."""
        return max(1, (block_bytes - self.fixed - self.per_doc) // max(1, self.per_token))


def _fewer_blocks(plain: _Budget, folded: _Budget, tokens: int, docs: int, block_bytes: int) -> _Budget:
    """Of two budgets that each bound a block of the compiled fold, the one that fits ``tokens`` document
    tokens in ``docs`` documents into fewer blocks of ``block_bytes``: the folded one once its
    buffers are small beside the similarities they replace (few chunk threads, a large call), the
    plain one otherwise (a small call, or a machine of many cores)."""
    def blocks(b: _Budget) -> float:
        room = block_bytes - b.fixed
        return (tokens * b.per_token + docs * b.per_doc) / room if room > 0 else float("inf")

    return folded if blocks(folded) < blocks(plain) else plain


def maxsim_numpy(Q: np.ndarray, D: np.ndarray, q_valid: np.ndarray, d_valid: np.ndarray, *, candidates: bool,
                 nd: int, return_argmax: bool, block_bytes: int = BLOCK_BYTES, q_scale: np.ndarray | None = None,
                 d_scale: np.ndarray | None = None, zero_pad: np.ndarray | None = None):
    """Canonical-shape MaxSim (module docstring: the arithmetic and the memory bound).

    Q: [Nq, Lq, d]; D: [Nd, Ld, d] shared by all queries, or [Nq * nd, Ld, d]
    when ``candidates`` (query i scores documents i*nd .. i*nd+nd-1). float16, bfloat16, float32 or
    float64 (both alike), or int8 or ml_dtypes float8_e4m3fn with scales.
    q_valid: bool [Nq, Lq]; d_valid: bool [D.shape[0], Ld].
    q_scale / d_scale: float32 [Nq, Lq] / [D.shape[0], Ld] for int8 or float8_e4m3fn Q and D. The similarity is
    then the exact dot product rounded to float32, times the document token's scale in float32,
    and the query token's scale multiplies the max (a negative or NaN one gives NaN, since
    only a non-negative scale commutes with the max): the kernel's arithmetic, so the argmax
    matches the GPU's exactly.
    zero_pad: bool [D.shape[0]] or None: the documents with zero-vector padding (``_zero_floor``).
    Returns scores float32 [Nq, nd] (float64 for float64 inputs) and, if asked, argmax int32 [Nq, nd, Lq].
    """
    nq, lq, dim = Q.shape
    ld = D.shape[1]
    zp = None if zero_pad is None else zero_pad.reshape(nq if candidates else 1, nd)
    ar = _Arith.of(D.dtype, dim, d_scale is not None)
    scores = np.empty((nq, nd), ar.out)
    amax = np.empty((nq, nd, lq), np.int32) if return_argmax else None
    out = _Buffers(ar, block_bytes)
    block_bytes -= out.reserved
    b = _Budget.of(lq, dim, D.dtype, ar, return_argmax, packed=False)
    per_doc = ld * b.per_token + b.per_doc

    def put(i0: int, i1: int, j0: int, j1: int, res: tuple) -> None:
        if zp is not None:
            res = _zero_floor(*res, zp[i0:i1, j0:j1] if candidates else zp[:, j0:j1], lq)
        scores[i0:i1, j0:j1] = _scores(res[0], q_valid[i0:i1], None if q_scale is None else q_scale[i0:i1],
                                       ar.out)
        if amax is not None:
            amax[i0:i1, j0:j1] = _argmax_out(res[1], i1 - i0, lq)

    if b.fixed + per_doc > block_bytes:  # one document passes the bound: each in runs of its tokens
        for i0, rows, queries in _document_sets(nq, nd, candidates):
            for j in range(nd):
                res = _long_document(Q, q_valid, queries, D[rows.start + j], d_valid[rows.start + j],
                                     None if d_scale is None else d_scale[rows.start + j], ar, return_argmax,
                                     block_bytes, out)
                for k, i in enumerate(queries):
                    put(i, i + 1, j, j + 1, (res[0][k][:, None], None if res[1] is None else res[1][k][:, None]))
        return scores, amax
    docs_per_block = max(1, (block_bytes - b.fixed) // max(1, per_doc))
    if candidates and docs_per_block >= nd:  # whole candidate sets fit: several queries' sets per block
        sets = max(1, min(nq, block_bytes // max(1, b.fixed + nd * per_doc)))
        for i0 in range(0, nq, sets):
            i1 = min(nq, i0 + sets)
            rows = slice(i0 * nd, i1 * nd)
            blk = _DocBlock(_tokens(D[rows], ar, i1 - i0), Runs.padded(nd, ld, d_valid[rows].reshape(i1 - i0, -1)),
                            None if d_scale is None else d_scale[rows].reshape(i1 - i0, -1), out)
            put(i0, i1, 0, nd, _block_maxima(Q[i0:i1], q_valid[i0:i1], blk, ar, return_argmax, block_bytes))
            del blk  # (its converted tokens, before the next block's are made)
        return scores, amax
    if candidates:
        docs_per_block = _even(nd, docs_per_block)
        for i in range(nq):
            for j0 in range(0, nd, docs_per_block):
                j1 = min(nd, j0 + docs_per_block)
                sl = slice(i * nd + j0, i * nd + j1)
                blk = _DocBlock(_tokens(D[sl], ar, 1), Runs.padded(j1 - j0, ld, d_valid[sl].reshape(1, -1)),
                                None if d_scale is None else d_scale[sl].reshape(1, -1), out)
                put(i, i + 1, j0, j1, _block_maxima(Q[i:i + 1], q_valid[i:i + 1], blk, ar, return_argmax, block_bytes))
                del blk
        return scores, amax
    # Documents shared by every query: several queries to one GEMM (the more rows, the better BLAS does),
    # as many as leave a block room for a few dozen documents.
    group = max(1, min(nq, (block_bytes // 2) // max(1, b.fixed + min(nd, _GROUP_DOCS) * per_doc)))
    bg = _Budget.of(group * lq, dim, D.dtype, ar, return_argmax, packed=False)
    if _folded(ar, 1):
        bg = _fewer_blocks(bg, _Budget.of(group * lq, dim, D.dtype, ar, return_argmax, packed=False, folded=ld),
                           nd * ld, nd, block_bytes)
    docs_per_block = _even(nd, max(1, (block_bytes - bg.fixed) // max(1, ld * bg.per_token + bg.per_doc)))
    for j0 in range(0, nd, docs_per_block):  # each block's tokens are converted once for all its queries
        j1 = min(nd, j0 + docs_per_block)
        blk = _DocBlock(_tokens(D[j0:j1], ar, 1), Runs.padded(j1 - j0, ld, d_valid[j0:j1].reshape(1, -1)),
                        None if d_scale is None else d_scale[j0:j1].reshape(1, -1), out)
        for i0 in range(0, nq, group):
            i1 = min(nq, i0 + group)
            put(i0, i1, j0, j1, _block_maxima(Q[i0:i1], q_valid[i0:i1], blk, ar, return_argmax, block_bytes))
        del blk
    return scores, amax


def _even(n: int, most: int) -> int:
    """Documents per block for ``n`` documents in blocks of at most ``most``: as few blocks, evened out.
    A last block of a few documents would run alone, too short to share between the chunk threads,
    with BLAS's own threads instead; those then spin for a while after it, and slowed the next
    call's chunk threads by up to 2.3x on a 2-core machine (a call of 15 documents, then 1)."""
    return -(-n // -(-n // most)) if n else most


def even_cuts(cost: np.ndarray, parts: int) -> list[int]:
    """Where ``parts`` consecutive runs of items whose costs sum cumulatively to ``cost`` (``[N]``,
    nondecreasing) end at the latest, for even shares of the total: ascending, the last one ``N``.
    Callers end a run at the next cut or sooner (at their bound), so a short last run is rare (``_even``)."""
    n = cost.size
    if parts <= 1 or not n:
        return [n]
    cuts = np.searchsorted(cost, cost[-1] * np.arange(1, parts + 1) / parts, side="right").tolist()
    cuts[-1] = n
    return cuts


def _document_sets(nq: int, nd: int, candidates: bool):
    """(first query, rows of D, the queries that score them): one set shared by every query, or one
    candidate set per query."""
    if candidates:
        return [(i, slice(i * nd, (i + 1) * nd), range(i, i + 1)) for i in range(nq)]
    return [(0, slice(0, nd), range(nq))]


def maxsim_packed_numpy(Q: np.ndarray, q_valid: np.ndarray, tokens: np.ndarray, offsets: np.ndarray, *,
                        return_argmax: bool, block_bytes: int = BLOCK_BYTES, q_scale: np.ndarray | None = None,
                        d_scale: np.ndarray | None = None, zero_pad: np.ndarray | None = None):
    """MaxSim of padded queries against packed documents (``offsets`` int64 [Nd + 1], checked), with
    the arithmetic and memory bound of :func:`maxsim_numpy`.

    Documents go in runs of whole documents whose temporaries fit ``block_bytes``, never padded; a
    document that passes the bound alone goes in runs of its tokens. int8 inputs take ``q_scale``
    [Nq, Lq] and ``d_scale`` [T] as in :func:`maxsim_numpy`; ``zero_pad`` bool [Nd] as there.
    """
    nq, lq, dim = Q.shape
    nd = offsets.size - 1
    ar = _Arith.of(tokens.dtype, dim, d_scale is not None)
    scores = np.empty((nq, nd), ar.out)
    amax = np.empty((nq, nd, lq), np.int32) if return_argmax else None
    lens = np.diff(offsets)
    out = _Buffers(ar, block_bytes)
    block_bytes -= out.reserved
    passes = not _folded(ar, 1)  # (the compiled fold finds the winners itself: no tests or codes to hold)
    b1 = _Budget.of(lq, dim, tokens.dtype, ar, return_argmax, packed=passes)
    mean = max(1, -(-int(offsets[-1] - offsets[0]) // max(1, nd)))
    group = max(1, min(nq, (block_bytes // 2) // max(1, b1.fixed + _GROUP_DOCS * (mean * b1.per_token + b1.per_doc))))
    b = _Budget.of(group * lq, dim, tokens.dtype, ar, return_argmax, packed=passes)
    if not passes and nd:
        b = _fewer_blocks(b, _Budget.of(group * lq, dim, tokens.dtype, ar, return_argmax, packed=False,
                                        folded=int(lens.max())), int(lens.sum()), nd, block_bytes)
    cost = np.cumsum(lens * b.per_token + b.per_doc)  # bytes of documents 0 .. j, with a group of queries
    room = block_bytes - b.fixed
    # as few blocks as fit, evened out in bytes (_even)
    cuts = even_cuts(cost, -(-int(cost[-1]) // room) if nd and room > 0 else 1)
    j0 = 0
    while j0 < nd:
        spent = int(cost[j0 - 1]) if j0 else 0
        cut = cuts[bisect.bisect_right(cuts, j0)]
        j1 = max(j0 + 1, min(cut, int(np.searchsorted(cost, spent + room, side="right"))))
        t0, t1 = int(offsets[j0]), int(offsets[j1])
        if j1 == j0 + 1 and b1.fixed + (t1 - t0) * b1.per_token + b1.per_doc > block_bytes:
            # one document passes the bound alone, with one query's rows (a long query too): in runs of
            # its tokens and blocks of the query's rows
            vals, idxs = _long_document(Q, q_valid, range(nq), tokens[t0:t1], None,
                                        None if d_scale is None else d_scale[t0:t1], ar, return_argmax, block_bytes,
                                        out)
            for i in range(nq):
                qs = None if q_scale is None else q_scale[i:i + 1]
                val, idx = vals[i][:, None], None if idxs is None else idxs[i][:, None]
                if zero_pad is not None:
                    val, idx = _zero_floor(val, idx, zero_pad[None, j0:j1], lq)
                scores[i, j0] = _scores(val, q_valid[i:i + 1], qs, ar.out)[0, 0]
                if amax is not None:
                    amax[i, j0] = idx[:, 0]
            j0 = j1
            continue
        blk = _DocBlock(_tokens(tokens[t0:t1], ar, 1), Runs.packed(offsets[j0:j1 + 1]),
                        None if d_scale is None else d_scale[None, t0:t1], out)
        g = group if int(cost[j1 - 1]) - spent <= room else 1  # (one document too large for a group's rows)
        for i0 in range(0, nq, g):  # several queries to one GEMM
            i1 = min(nq, i0 + g)
            val, idx = _block_maxima(Q[i0:i1], q_valid[i0:i1], blk, ar, return_argmax, block_bytes)
            if zero_pad is not None:
                val, idx = _zero_floor(val, idx, zero_pad[None, j0:j1], lq)
            scores[i0:i1, j0:j1] = _scores(val, q_valid[i0:i1], None if q_scale is None else q_scale[i0:i1], ar.out)
            if amax is not None:
                amax[i0:i1, j0:j1] = _argmax_out(idx, i1 - i0, lq)
            del val, idx  # (not alive through the next block's maxima)
        del blk
        j0 = j1
    return scores, amax


def packed_rows(starts: np.ndarray, lens: np.ndarray):
    """The rows of runs ``starts[j] .. starts[j] + lens[j]`` (int64 ``[n]`` each) back to back (int64
    ``[sum(lens)]``), and where each run begins among them (int64 ``[n + 1]``): whole-array steps, none
    per run."""
    off = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    rows = np.repeat(starts - off[:-1], lens)
    rows += np.arange(rows.size)
    return rows, off


def gathered_rows(starts: np.ndarray, lens: np.ndarray):
    """:func:`packed_rows`, but one run's rows as a slice: a single document is then read where it lies,
    not copied by a gather."""
    if starts.size == 1:
        return slice(int(starts[0]), int(starts[0] + lens[0])), np.array([0, lens[0]], np.int64)
    return packed_rows(starts, lens)


def unpack(tokens: np.ndarray, offsets: np.ndarray, rows: np.ndarray | None = None):
    """Packed rows [T, d] with int64 offsets [N + 1] -> padded [N, Lmax, d] (zeros past each length) and
    bool valid [N, Lmax]; with ``rows`` (indices of segments), those segments only, in that order, padded
    to the longest of them."""
    starts, lens = offsets[:-1], np.diff(offsets)
    if rows is not None:
        starts, lens = starts[rows], lens[rows]
    n, lmax = lens.size, int(lens.max()) if lens.size else 0
    valid = np.arange(lmax)[None, :] < lens[:, None]
    out = np.zeros((n, lmax, tokens.shape[1]), tokens.dtype)
    out[valid] = tokens[offsets[0]:offsets[-1]] if rows is None else tokens[(starts[:, None] + np.arange(lmax))[valid]]
    return out, valid


def query_groups(lengths: np.ndarray, row_bytes: int) -> list[np.ndarray]:
    """Packed queries of ``lengths`` tokens (``row_bytes`` each) in groups to pad and score one at a time,
    each padded to its own longest, so that a group's padded queries take at most twice its tokens'
    bytes or ``QUERY_CHUNK``: padded to the longest of the call, one long query among many short ones
    took memory growing as their number times its length. All of them in the caller's order where the
    whole call keeps that bound (one group: one padded call, as before); else classes of lengths
    within a factor of two (empty queries apart), shortest first, neighbours merged while the bound
    holds. A group is its queries' indices. Each query's scores and argmax on the NumPy path are its
    own whatever its group (the module docstring)."""
    n = lengths.size

    def fits(count: int, longest: int, tokens: int) -> bool:
        return count * longest * row_bytes <= max(2 * tokens * row_bytes, QUERY_CHUNK)

    if fits(n, int(lengths.max()) if n else 0, int(lengths.sum())):
        return [np.arange(n)]
    cls = np.where(lengths > 0, np.frexp(np.maximum(lengths - 1, 0))[1], -1)  # class k: lengths in (2**(k-1), 2**k]
    order = np.argsort(cls, kind="stable")
    groups: list[np.ndarray] = []
    for part in np.split(order, np.flatnonzero(np.diff(cls[order])) + 1):
        both = np.concatenate([groups[-1], part]) if groups else None
        if both is not None and fits(both.size, int(lengths[part].max()), int(lengths[both].sum())):
            groups[-1] = both
        else:
            groups.append(part)
    return groups


def _tokens(x: np.ndarray, ar: _Arith, sets: int) -> np.ndarray:
    """Document tokens [..., d] as ``sets`` sets of GEMM rows [sets, n, d] (a view when they already are;
    float16 and bfloat16 widened by the compiled table on the chunk threads where Numba is installed:
    NumPy's float16 cast alone took 3x as long)."""
    x = x.reshape(sets, -1, x.shape[-1])
    if x.dtype in _WIDENED and ar.gemm == np.float32 and x.flags.c_contiguous and fold.available():
        return fold.float32_tokens(x)  # (a strided x takes NumPy's cast, which needs no contiguous copy first)
    return np.ascontiguousarray(x, dtype=ar.gemm)


def _scores(val: np.ndarray, q_valid: np.ndarray, q_scale: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """Scores [G, nb] in ``dtype`` from each query token's max ``val [G * Lq, nb]``: INT8 maxima times the
    query token's scale, then the valid tokens' terms summed in float64 in query-token order, so that a
    score depends on the terms alone (not on the number of documents beside it, nor on the query's
    padding: a masked token adds -0.0, which changes no sum; the + 0.0 makes an all -0.0 sum +0.0), and
    rounded once to ``dtype``. Over- and underflow are that rounding's (inf, 0), whatever the caller's
    ``np.seterr``."""
    g, lq = q_valid.shape
    if lq == 0:
        return np.zeros((g, val.shape[1]), dtype)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        if q_scale is not None:  # an empty document's -inf stays -inf against a zero scale
            qs = np.where(q_scale >= 0, q_scale, np.float32(np.nan)).reshape(-1, 1)
            val = np.where(val == -np.inf, val, val * qs)
        terms = np.where(q_valid.reshape(-1, 1), val, -0.0).reshape(g, lq, -1)
        return (np.add.accumulate(terms, axis=1, dtype=np.float64)[:, -1] + 0.0).astype(dtype, copy=False)


def _zero_floor(val: np.ndarray, idx: np.ndarray | None, flags: np.ndarray, lq: int):
    """Zero-vector padding, as the kernels apply it: each query token's max ``val [G * Lq, nb]`` over a
    flagged document (``flags`` bool [G or 1, nb]) floored at 0, the padding's similarity (NaN kept),
    and its winner ``idx`` (or None) -1 where 0 wins."""
    g, nb = val.shape[0] // max(1, lq), val.shape[1]
    with np.errstate(invalid="ignore"):
        floor = (flags[:, None, :] & (val.reshape(g, lq, nb) < 0)).reshape(val.shape)
    return np.where(floor, 0, val).astype(val.dtype, copy=False), None if idx is None else np.where(floor, -1, idx)


def _argmax_out(idx: np.ndarray, g: int, lq: int) -> np.ndarray:
    """int32 [G, nb, Lq] from local winners [G * Lq, nb] (-1: masked query token or empty document)."""
    return idx.reshape(g, lq, idx.shape[1]).transpose(0, 2, 1).astype(np.int32)


def _long_document(Q: np.ndarray, q_valid: np.ndarray, queries, tokens: np.ndarray, valid: np.ndarray | None,
                   d_scale: np.ndarray | None, ar: _Arith, want_argmax: bool, budget: int, out: _Buffers):
    """The queries ``queries`` against one document ``tokens [L, d]`` (``valid`` bool [L] or None,
    ``d_scale`` [L] for INT8) in blocks of a run of its tokens against a block of a query's rows
    (``_row_blocks``: all of them unless the query is the longer side or alone passes the bound),
    within ``budget`` bytes beside the queries' maxima and winners so far (16 bytes a query token, on
    top: taken out of the budget, a long query against a small one left blocks of a few rows). Each
    query token's max over a run and its winner depend on that token alone, and the runs' combine
    exactly into the whole document's: a later run's winner replaces the one so far only with a
    larger value, or with the first NaN (as ``argmax`` over the whole document), or where the
    document had no valid token so far. Returns, per query, its maxima [Lq] and winners [Lq] (or
    None)."""
    n, lq, dim = tokens.shape[0], Q.shape[1], Q.shape[2]
    want_idx = want_argmax or not ar.exact
    vals = [np.full(lq, -np.inf, np.float32 if ar.exact else np.float64) for _ in queries]
    idxs = [np.full(lq, -1, np.int64) if want_idx else None for _ in queries]
    rows, run = _row_blocks(lq, n, dim, tokens.dtype, ar, want_argmax, budget)
    for t0 in range(0, max(n, 1), run):
        t1 = min(n, t0 + run)
        v = np.ones((1, t1 - t0), bool) if valid is None else valid[None, t0:t1]
        blk = _DocBlock(_tokens(tokens[t0:t1], ar, 1), Runs.padded(1, t1 - t0, v),
                        None if d_scale is None else d_scale[None, t0:t1], out)
        for k, i in enumerate(queries):
            for r0 in range(0, max(lq, 1), rows):
                r = slice(r0, min(lq, r0 + rows))
                val, idx = _block_maxima(Q[i:i + 1, r], q_valid[i:i + 1, r], blk, ar, want_argmax, budget)
                val, cur = val[:, 0], vals[k][r]
                take = (val > cur) | (np.isnan(val) & ~np.isnan(cur))
                if idx is not None:
                    idx = np.where(idx[:, 0] >= 0, idx[:, 0] + t0, -1)
                    take |= (idxs[k][r] < 0) & (idx >= 0)
                    np.copyto(idxs[k][r], idx, where=take)
                np.copyto(cur, val, where=take)
                del val, idx, take
        del blk
    return vals, (idxs if want_argmax else None)


def _row_blocks(lq: int, n: int, dim: int, dtype, ar: _Arith, argmax: bool, budget: int) -> tuple[int, int]:
    """(query rows, document tokens) a block of one long document of ``n`` tokens takes within
    ``budget``: all ``lq`` rows and the most tokens they leave room for, unless the query is the longer
    side or its rows alone pass the bound. Each block costs work on each of its rows (their norms,
    float64 copy, maxima and winners) and on each of its tokens, so a long query against a short run
    paid its rows' work once per few tokens, and the call grew with Lq squared (one query of 512k tokens
    against 80 documents of 40 took 74 s against 2.2 s at 128k). Rows are then the most that still
    leave a run as long as them (or the whole document), as a square block spreads both sides' work;
    one row and one token at least."""
    def fits(r: int) -> bool:
        b = _Budget.of(r, dim, dtype, ar, argmax, packed=False)
        return budget - b.fixed - b.per_doc >= min(n, r) * b.per_token

    def run(r: int) -> int:
        return _Budget.of(r, dim, dtype, ar, argmax, packed=False).run_tokens(budget)

    if lq <= 1 or fits(lq):
        return max(lq, 1), run(max(lq, 1))
    lo, hi = 1, lq - 1  # the most rows r whose run still reaches min(n, r); a run shortens as rows grow
    while lo < hi:
        r = (lo + hi + 1) // 2
        if fits(r):
            lo = r
        else:
            hi = r - 1
    return lo, min(max(n, 1), run(lo))


class _Buffers:
    """A call's buffers, kept over its blocks (a fresh array per GEMM would cost its page faults every
    time): each chunk thread's similarity block, which every GEMM writes into, and, where the call
    takes tokens-first GEMMs (``tokens_first``: float32, and a block of 16 scratches per chunk thread
    or more), each chunk thread's scratch of ``_TOKENS_FIRST_BYTES`` for them, ``reserved`` out of
    the call's ``block_bytes``. A block's budget counts its own similarities, so a thread's buffer
    larger than them is let go as the block begins (:meth:`new_block`): kept, a long document's
    block of many rows held it while the next block, of fewer tokens and more rows, spent the
    difference on its rows, 1.17x the bound (one query of 2,743 tokens against three packed
    documents)."""

    def __init__(self, ar: _Arith, block_bytes: int):
        threads = cores.chunk_threads()
        self.tokens_first = ar.gemm == np.float32 and block_bytes >= 16 * threads * _TOKENS_FIRST_BYTES
        self.reserved = threads * _TOKENS_FIRST_BYTES if self.tokens_first else 0
        self._sims: dict = {}
        self._scratch: dict = {}

    def new_block(self, similarities: int) -> None:
        """A block of ``similarities`` elements begins: the buffers larger than that are let go."""
        for thread, buf in list(self._sims.items()):
            if buf.size > similarities:
                del self._sims[thread]

    def similarities(self, thread: int, size: int, dtype) -> np.ndarray:
        """Chunk thread ``thread``'s similarity buffer of ``size`` elements or more."""
        buf = self._sims.get(thread)
        if buf is None or buf.size < size or buf.dtype != dtype:
            self._sims.pop(thread, None)
            del buf  # the old one goes before the new one comes (a block after a smaller one held both)
            buf = self._sims[thread] = np.empty(size, dtype)
        return buf

    def scratch(self, thread: int) -> np.ndarray:
        """Chunk thread ``thread``'s float32 scratch for a tokens-first GEMM."""
        buf = self._scratch.get(thread)
        if buf is None:
            buf = self._scratch[thread] = np.empty(_TOKENS_FIRST_BYTES // 4, np.float32)
        return buf


class _DocBlock:
    """One block of documents: ``T [sets, N, d]`` in the GEMM's dtype (one set shared by every query,
    or one candidate set per query), their ``runs`` (the same columns in every set) and INT8 scales
    ``d_scale [sets, N]`` (or None); ``out``: the call's buffers."""

    def __init__(self, T: np.ndarray, runs: Runs, d_scale: np.ndarray | None, out: _Buffers):
        self.T, self.runs, self.d_scale, self.out = T, runs, d_scale, out

    def similarities(self, A: np.ndarray, c0: int, c1: int, thread: int = 0, runs: Runs | None = None,
                     tokens_first: bool = False, folding: fold.DocumentFold | None = None, gemm=None):
        """``A [G, Lq, d]`` against the block's columns ``c0 .. c1`` (G = sets, or any G for one shared
        set) -> ``[G * Lq, c1 - c0]`` in chunk thread ``thread``'s buffer (valid until its next call):
        one GEMM per set, every query's rows in it; and, given the documents ``runs`` of those columns,
        their norm bounds (``_doc_norms``), else None. The GEMM goes in pieces of ``_PIECE_COLUMNS``,
        each piece's tokens read for their norm bounds just before: the GEMM then reads them from
        the cache; ``tokens_first``: with the tokens as its rows (``_TOKENS_FIRST_ROWS``), copied
        transposed; ``folding`` (one set, any rows): with the tokens as its rows into the buffer itself,
        ``[n, G * Lq]``, each piece handed to ``folding`` as soon as it is filled (its tokens still in
        the cache), and returned as the buffer's transposed view, the GEMM being ``gemm``
        (``fold.tokens_first_gemm`` of ``A``'s rows, built once a block). (Called with NumPy's over- and
        underflow ignored.)"""
        g, lq, dim = A.shape
        sets = self.T.shape[0]
        n = c1 - c0
        buf = self.out.similarities(thread, g * lq * n, A.dtype)[:g * lq * n]
        S = buf.reshape(n, g * lq).T[None] if folding else buf.reshape(sets, g * lq // sets, n)
        A = A.reshape(sets, g * lq // sets, dim)
        rows = g * lq // sets
        if folding:  # pieces small enough for their tokens and similarities to stay in the cache
            St = buf.reshape(n, rows)
            step = max(_FOLD_PIECE_MIN, _FOLD_PIECE_BYTES // ((rows + dim) * A.itemsize))
            for p0 in range(0, max(n, 1), step):  # (a chunk of empty documents: one piece 0 .. 0)
                p1 = min(n, p0 + step)
                gemm(self.T[0, c0 + p0:c0 + p1], St[p0:p1])
                folding.piece(St, p0, p1)
            return S.reshape(g * lq, n), folding.norms[None].astype(np.float64)
        k = _NORM_TOKENS
        squares = None if runs is None else np.empty((sets, -(-n // k)), self.T.dtype)
        scratch = self.out.scratch(thread) if tokens_first and rows else None
        for p0 in range(0, n, _PIECE_COLUMNS):
            p1 = min(n, p0 + _PIECE_COLUMNS)
            piece = self.T[:, c0 + p0:c0 + p1]
            if squares is not None and runs.valid is not None:  # masked tokens (any values) left out of the bound
                sq = np.vecdot(piece, piece)  # each token's sum of squares
                np.copyto(sq, 0, where=~runs.valid[:, p0:p1])
                squares[:, p0 // k:-(-p1 // k)] = np.maximum.reduceat(sq, np.arange(0, p1 - p0, k), axis=1)
            elif squares is not None:  # each run of k tokens' sum of squares: one dot product (a short last run)
                whole = (p1 - p0) // k * k
                if whole:
                    runs_of_k = piece[:, :whole].reshape(sets, -1, k * dim)
                    np.vecdot(runs_of_k, runs_of_k, out=squares[:, p0 // k:(p0 + whole) // k])
                if whole < p1 - p0:
                    last = piece[:, whole:].reshape(sets, 1, -1)
                    np.vecdot(last, last, out=squares[:, -1:])
            if scratch is None:
                np.matmul(A, piece.transpose(0, 2, 1), out=S[:, :, p0:p1])
                continue
            step = max(1, scratch.size // (sets * rows))
            for a in range(p0, p1, step):
                b = min(p1, a + step)
                St = scratch[:sets * (b - a) * rows].reshape(sets, b - a, rows)
                np.matmul(self.T[:, c0 + a:c0 + b], A.transpose(0, 2, 1), out=St)
                np.copyto(S[:, :, a:b], St.transpose(0, 2, 1))
        if runs is None:
            return S.reshape(g * lq, n), None
        per = dim if runs.valid is not None else k * dim  # elements a sum of squares holds
        return S.reshape(g * lq, n), _doc_norms(bound_norms(squares, per), runs)


def _doc_norms(groups: np.ndarray, runs: Runs) -> np.ndarray:
    """float64 [sets, nb]: an upper bound on the norm of each document's tokens (documents ``runs``),
    the largest of the norm bounds ``groups [sets, ceil(N / _NORM_TOKENS)]`` of the runs of
    ``_NORM_TOKENS`` consecutive columns it overlaps (a run's norm bounds each of its valid tokens'; NaN
    or inf where there is none). Without masks, one dot product per run rather than a reduction per
    token; with them, the largest of its valid tokens' sums of squares, since masked padding may hold
    anything (a NaN or a huge value made the margin infinite or huge, and every pair of its documents
    went to float64)."""
    out = np.zeros((groups.shape[0], runs.count))
    some = runs.length > 0
    if not groups.shape[1] or not some.any():
        return out
    g = groups.astype(np.float64)
    lo = runs.start[some] // _NORM_TOKENS
    hi = (runs.start[some] + runs.length[some] - 1) // _NORM_TOKENS
    out[:, some] = np.maximum(np.maximum.reduceat(g, lo, axis=1), g[:, hi])
    return out


def _folded(ar: _Arith, sets: int) -> bool:
    """Whether a block of ``sets`` document sets runs the compiled fold: one set of inexact similarities,
    any number of rows (a tokens-first GEMM, read where it left them), where ``fold.available``."""
    return sets == 1 and not ar.exact and fold.available()


def _block_maxima(Q: np.ndarray, q_valid: np.ndarray, blk: _DocBlock, ar: _Arith, want_argmax: bool,
                  budget: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Queries Q [G, Lq, d] against a block of documents (G = 1, or one query per candidate set) ->
    each query token's max over each document, ``[G * Lq, nb]`` (the reference similarity of its
    winner, float64; INT8: the exact similarity, float32), and its winner, the local column (int64
    ``[G * Lq, nb]``, -1 for masked query tokens and empty documents), or None when not asked
    (INT8 only: inexact similarities always need the winner).

    The block goes through the GEMM in chunks of documents whose similarities and tokens fit
    ``_CACHE_BYTES``: each chunk's passes (norms, then GEMM, argmax, second max, the winners' dot
    products) read from the cache. The chunks are shared by the threads of ``cores`` where the
    block is large enough; each thread collects the pairs float64 must decide over its chunks and
    decides them together. A chunk's results are its own documents' whatever the thread."""
    runs = blk.runs
    g, lq, dim = Q.shape
    m = g * lq
    sets = blk.T.shape[0]
    A = np.ascontiguousarray(Q, dtype=ar.gemm).reshape(m, dim)
    row_set = np.repeat(np.arange(g), lq) if sets > 1 else np.zeros(m, np.intp)
    live = q_valid.reshape(-1, 1) & runs.nonempty[row_set]
    want_idx = want_argmax or not ar.exact
    val = np.full((m, runs.count), -np.inf, np.float32 if ar.exact else np.float64)
    idx = np.full((m, runs.count), -1, np.int64) if want_idx else None
    winners = idx if want_idx else np.empty((m, runs.count), np.int64)
    qn = None if ar.exact else norm_bound(A)
    with np.errstate(invalid="ignore"):  # (a signalling NaN warns as it converts: it is a NaN like any other)
        A64 = None if ar.exact else A.astype(np.float64)  # (once: the winners' dot products take it in every chunk)
    chunks, threads, blas_threads = _chunk_plan(runs, m, sets, dim, blk.T.shape[1], ar.gemm.itemsize)
    blk.out.new_block(m * blk.T.shape[1])
    # (few rows a set, and one token's rows of every set within the scratch: many candidate sets keep the plain GEMM)
    tokens_first = blk.out.tokens_first and m // sets <= _TOKENS_FIRST_ROWS and m <= _TOKENS_FIRST_BYTES // 4
    folded = _folded(ar, sets)
    gemm = fold.tokens_first_gemm(A, threads == 1 and blas_threads) if folded else None
    part = budget // threads  # each thread's share of the bound's pieces

    def work(thread: int, claims) -> None:
        pending = Pending(None if ar.exact else A, blk.T, row_set, runs.start, winners, val, part // 8)
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            for j0, j1, c0, c1, sub in claims:
                folding = fold.DocumentFold(sub.start, sub.length, None if sub.valid is None else sub.valid[0], A64,
                                            blk.T[0, c0:c1], ar.gemm) if folded else None
                S, dn = blk.similarities(A.reshape(g, lq, dim), c0, c1, thread, None if ar.exact else sub,
                                         tokens_first, folding, gemm)
                dn = None if dn is None else dn[row_set]
                if blk.d_scale is not None:  # scaled: the exact dot product times the token's scale, in float32
                    S = S.astype(np.float32, copy=False)
                    S.reshape(sets, m // sets, c1 - c0)[...] *= blk.d_scale[:, None, c0:c1]
                lv = live[:, j0:j1]
                second = None  # (inexact padded runs take it from S below)
                if folding:  # the max, where it is, the second max and the winner's reference similarity
                    first, best, second = folding.first, folding.best, folding.second
                else:
                    sub.mask_invalid(S, row_set)
                    if sub.width is not None and want_idx:
                        first, best = sub.argmax(S)  # the max and where it is, in one pass
                    else:
                        first, best = None, sub.max(S)
                bad = lv & ~np.isfinite(best)  # NaN or infinite: every valid column decided in float64
                if ar.exact:
                    val[:, j0:j1] = best
                    if want_idx:
                        if first is None:
                            first = sub.first_hit(sub.compare(S, np.where(lv & ~bad, best, np.nan)))
                        idx[:, j0:j1] = np.where(lv, first, -1)
                    pending.add(S, sub, c0, j0, *np.nonzero(bad), None)
                    continue
                thr = best - margin(qn, dn, dim, ar.gemm)  # float64: compared with S exactly
                thr[~lv | bad] = np.nan
                if second is None and sub.width is not None:
                    second = sub.second_max(S, first)
                if second is not None:  # another column within the margin of the max: float64 decides
                    r, j = np.nonzero(second >= thr)
                else:
                    hit = sub.compare(S, thr)  # NaN: no column passes
                    first, r, j = sub.hits(hit, lv & ~bad, part // 4)  # the max's, unless another column passes
                    del hit
                idx[:, j0:j1] = np.where(lv, first, -1)
                if folding:
                    val[:, j0:j1] = np.where(lv, folding.win, -np.inf)
                else:
                    val[:, j0:j1] = _winner_similarities(A64, blk.T[:, c0:c1], row_set, sub.start + first, lv,
                                                         part // 8)
                pending.add(S, sub, c0, j0, r, j, thr)
                pending.add(S, sub, c0, j0, *np.nonzero(bad), None)
        pending.flush()

    cores.run_chunks(chunks, work, threads, blas_threads=blas_threads)
    return val, idx


def _chunk_plan(runs: Runs, m: int, sets: int, dim: int, n: int, itemsize: int):
    """A block's chunks (``Runs.chunks``: ``m`` query rows against ``n`` columns in ``sets`` sets), the
    threads that share them and whether, on one thread, BLAS keeps its own. A chunk's similarities
    and tokens fit ``_CACHE_BYTES``; with several threads, no chunk holds more than an equal share of
    the columns either, so that the threads' buffers together hold no more than the block's
    similarities. A thread for each ``_SPLIT_MACS`` of the block's GEMM at most: a shorter share
    does not pay for the hand-over, neither between chunk threads nor between BLAS's."""
    columns = max(1, _CACHE_BYTES // ((m // sets + dim) * sets * itemsize))
    macs = m * n * dim
    small = macs < 2 * _SPLIT_MACS
    threads = 1 if small else min(cores.chunk_threads(), macs // _SPLIT_MACS)
    if threads > 1:
        chunks = list(runs.chunks(min(columns, n // threads)))
        if len(chunks) >= threads and max(c[3] - c[2] for c in chunks) * threads <= n:
            return chunks, threads, True
    return runs.chunks(columns), 1, not small


def _winner_similarities(A64: np.ndarray, T: np.ndarray, row_set: np.ndarray, cols: np.ndarray, live: np.ndarray,
                         budget: int) -> np.ndarray:
    """The reference similarity (``refine.dot64``) of query row ``A64[r]`` (float64) and token
    ``T[row_set[r], cols[r, j]]`` for every ``live`` pair, float64 ``[M, nb]`` (-inf elsewhere): one
    dot product per query token and document. Takes the pairs in chunks of about ``_DOT_CHUNK``
    bytes (``budget`` at most, one pair at least)."""
    m, nb = cols.shape
    dim = A64.shape[1]
    val = np.full((m, nb), -np.inf)
    rows = np.flatnonzero(live.any(axis=1))
    if not rows.size or not nb:
        return val
    cols = np.minimum(cols, T.shape[1] - 1)  # (an empty document may start past the last column)
    room = min(_DOT_CHUNK, budget)
    pairs = max(1, room // (dim * (8 + T.itemsize)))  # a pair's token gathered and in float64
    # Whole rows of pairs also gather their query rows in float64 (the rows of valid query tokens are
    # not consecutive under a mask): they took 1.7x the piece's share of the bound with one document.
    per_rows, per_docs = (max(1, room // (dim * ((8 + T.itemsize) * nb + 8))), nb) if pairs >= nb else (1, pairs)
    one_set = T.shape[0] == 1
    for r0 in range(0, rows.size, per_rows):
        rr = rows[r0:r0 + per_rows]
        if rr[-1] - rr[0] == rr.size - 1:
            rr = slice(int(rr[0]), int(rr[-1]) + 1)  # (consecutive rows: views, not copies)
        for j0 in range(0, nb, per_docs):
            j1 = min(nb, j0 + per_docs)
            c = cols[rr, j0:j1]
            W = np.take(T[0], c, axis=0) if one_set else T[row_set[rr][:, None], c]  # [rows, docs, d]
            val[rr, j0:j1] = dot64(A64[rr][:, None, :], W)
    val[~live] = -np.inf
    return val
