"""Exact MaxSim on the CPU with NumPy, with the same semantics as the GPU kernels.

Memory is bounded by bytes, whatever the corpus: documents are processed in blocks so that
the float64 copy of a block's tokens and its similarities stay under ``block_bytes``
(default 64 MiB), counting the embedding dim; a document too long for that alone is
processed in runs of its tokens, whose maxima combine exactly (the max of the runs' maxima,
the first index of a tie or NaN as ``argmax`` gives it). Packed documents are padded
``_RUN_BYTES`` at a time. Dot products are taken in float64: BLAS rounds a row differently
depending on where it falls in its blocking, so in float32 two identical document tokens
could get different similarities and break the lowest-index tie rule; in float64
fp16/bf16 products are summed exactly for practical inputs.
"""

from __future__ import annotations

import numpy as np

_BLOCK_BYTES = 64 << 20
_RUN_BYTES = 16 << 20  # packed documents padded at a time, as stored (maxsim_numpy blocks them again)


def maxsim_numpy(Q: np.ndarray, D: np.ndarray, q_valid: np.ndarray, d_valid: np.ndarray, *, candidates: bool,
                 nd: int, return_argmax: bool, block_bytes: int = _BLOCK_BYTES, q_scale: np.ndarray | None = None,
                 d_scale: np.ndarray | None = None):
    """Canonical-shape MaxSim.

    Q: [Nq, Lq, d]; D: [Nd, Ld, d] shared by all queries, or [Nq * nd, Ld, d]
    when ``candidates`` (query i scores documents i*nd .. i*nd+nd-1).
    q_valid: bool [Nq, Lq]; d_valid: bool [D.shape[0], Ld].
    q_scale / d_scale: float32 [Nq, Lq] / [D.shape[0], Ld] for int8 Q and D. The similarity is
    then the exact integer dot product times the document token's scale, rounded to float32,
    and the query token's scale multiplies the max (a negative or NaN one gives NaN, since
    only a non-negative scale commutes with the max): the kernel's arithmetic, so the argmax
    matches the GPU's exactly.
    Returns scores float32 [Nq, nd] and, if asked, argmax int32 [Nq, nd, Lq].
    """
    nq, lq, dim = Q.shape
    ld = D.shape[1]
    scores = np.empty((nq, nd), np.float32)
    amax = np.empty((nq, nd, lq), np.int32) if return_argmax else None
    # Bytes one document token costs in a block: its float64 copy and its similarities (and their argmax).
    per_token = 8 * dim + 8 * lq * (2 if return_argmax else 1)
    run = max(1, min(ld, block_bytes // per_token))  # tokens of a document taken at once
    per = max(1, block_bytes // max(1, ld * per_token)) if run >= ld else 1
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(nq):
            qi = Q[i].astype(np.float64)
            qv = q_valid[i]
            base = i * nd if candidates else 0
            for j0 in range(0, nd, per):
                j1 = min(nd, j0 + per)
                rows = slice(base + j0, base + j1)
                best = idx = None
                for t0 in range(0, max(ld, 1), run):
                    t1 = min(ld, t0 + run)
                    scale = None if d_scale is None else d_scale[rows, t0:t1]
                    b, a = _block_max(D[rows, t0:t1], d_valid[rows, t0:t1], qi, scale, amax is not None)
                    if best is None:
                        best, idx = b, a
                        continue
                    # Later tokens win only by more, or with the first NaN (np.max / np.argmax over the whole).
                    take = (b > best) | (np.isnan(b) & ~np.isnan(best))
                    best = np.where(take, b, best)
                    if idx is not None:
                        idx = np.where(take, a + np.int32(t0), idx)
                if q_scale is not None:  # an empty document's -inf stays -inf against a zero scale
                    qs = np.where(q_scale[i] >= 0, q_scale[i], np.float32(np.nan))
                    best = np.where(best == -np.inf, best, best * qs)
                scores[i, j0:j1] = np.where(qv, best, 0.0).sum(axis=1, dtype=np.float64)
                if amax is not None:
                    idx[~d_valid[rows].any(axis=1)] = -1  # empty document
                    idx[:, ~qv] = -1  # masked query token
                    amax[i, j0:j1] = idx
    return scores, amax


def _block_max(blk: np.ndarray, dv: np.ndarray, qi: np.ndarray, d_scale: np.ndarray | None, want_idx: bool):
    """Over the tokens of a block of documents [n, t, d]: each query token's best similarity [n, Lq]
    and, if asked, the first token giving it (int32 [n, Lq]; 0 for a block without tokens)."""
    n, t = blk.shape[:2]
    if t == 0:
        return np.full((n, qi.shape[0]), -np.inf), (np.zeros((n, qi.shape[0]), np.int32) if want_idx else None)
    sim = np.matmul(blk.astype(np.float64), qi.T)  # [n, t, Lq]
    if d_scale is not None:
        sim = sim.astype(np.float32) * d_scale[:, :, None]
    sim[~dv] = -np.inf  # masked document tokens never win
    best = sim.max(axis=1)  # NaN propagates
    return best, (sim.argmax(axis=1).astype(np.int32) if want_idx else None)


def unpack(tokens: np.ndarray, offsets: np.ndarray):
    """Packed rows [T, d] with int64 offsets [N + 1] -> padded [N, Lmax, d] and bool valid [N, Lmax]."""
    lens = np.diff(offsets)
    n, lmax = lens.size, int(lens.max()) if lens.size else 0
    valid = np.arange(lmax)[None, :] < lens[:, None]
    out = np.zeros((n, lmax, tokens.shape[1]), tokens.dtype)
    out[valid] = tokens[offsets[0]:offsets[-1]]
    return out, valid


def maxsim_packed_numpy(Q: np.ndarray, q_valid: np.ndarray, tokens: np.ndarray, offsets: np.ndarray, *,
                        return_argmax: bool, run_bytes: int = _RUN_BYTES, q_scale: np.ndarray | None = None,
                        d_scale: np.ndarray | None = None):
    """MaxSim of padded queries against packed documents (``offsets`` int64 [Nd + 1], checked).

    Documents go in runs padded only to their own longest document, each run at most
    ``run_bytes`` once padded (one document at least, which is then not copied at all), so
    memory stays bounded by bytes for any corpus, however long one document is. int8
    inputs take ``q_scale`` [Nq, Lq] and ``d_scale`` [T] as in :func:`maxsim_numpy`.
    """
    nq, lq, _ = Q.shape
    nd = offsets.size - 1
    scores = np.empty((nq, nd), np.float32)
    amax = np.empty((nq, nd, lq), np.int32) if return_argmax else None
    lens = np.diff(offsets)
    row = max(1, tokens.shape[1] * tokens.dtype.itemsize + (4 if d_scale is not None else 0))
    j0 = 0
    while j0 < nd:
        j1 = _run_end(lens, j0, max(1, run_bytes // row))
        o0, o1 = int(offsets[j0]), int(offsets[j1])
        if j1 == j0 + 1:  # one document: a view of its rows, nothing padded
            blk, dv = tokens[o0:o1][None], np.ones((1, o1 - o0), bool)
            sblk = None if d_scale is None else d_scale[o0:o1][None]
        else:
            blk, dv = unpack(tokens, offsets[j0:j1 + 1])
            sblk = None if d_scale is None else unpack(d_scale.reshape(-1, 1), offsets[j0:j1 + 1])[0][..., 0]
        s, a = maxsim_numpy(Q, blk, q_valid, dv, candidates=False, nd=j1 - j0, return_argmax=return_argmax,
                            q_scale=q_scale, d_scale=sblk)
        scores[:, j0:j1] = s
        if amax is not None:
            amax[:, j0:j1] = a
        j0 = j1
    return scores, amax


def _run_end(lens: np.ndarray, j0: int, rows: int) -> int:
    """The end of the run of documents starting at ``j0`` whose padded size (documents times the
    longest) stays within ``rows`` token rows; one document at least. Looks ahead only as far as
    needed, doubling, so a corpus costs time in proportion to its documents."""
    nd, ahead = lens.size, 64
    while True:
        window = lens[j0 : j0 + ahead]
        padded = np.arange(1, window.size + 1) * np.maximum.accumulate(window)
        n = max(1, int(np.searchsorted(padded, rows, side="right")))
        if n < window.size or j0 + window.size >= nd:
            return j0 + min(n, window.size)
        ahead *= 2


def maxsim_backward_numpy(g: np.ndarray, Q: np.ndarray, D: np.ndarray, amax: np.ndarray, rows: np.ndarray):
    """Gradients from the argmax, in float64.

    g: [Nq, nd] score gradients; Q: [Nq, Lq, d]; D: [R, d] document rows; amax:
    int32 [Nq, nd, Lq]; rows: int64 [Nq, nd, Lq], the row of D each argmax entry
    points at (-1: contributes nothing). Returns dQ [Nq, Lq, d] and dD [R, d].
    """
    g64 = g.astype(np.float64)
    q64 = Q.astype(np.float64)
    d64 = D.astype(np.float64)
    ok = (amax >= 0) & (rows >= 0)
    i, j, s = np.nonzero(ok)
    r = rows[i, j, s]
    w = g64[i, j][:, None]
    dQ = np.zeros(q64.shape)
    np.add.at(dQ, (i, s), w * d64[r])
    dD = np.zeros(d64.shape)
    np.add.at(dD, r, w * q64[i, s])
    return dQ, dD
