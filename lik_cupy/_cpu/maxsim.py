"""Exact MaxSim on the CPU with NumPy, with the same semantics as the GPU kernels.

Documents are processed in blocks so that the similarity block held at any
time stays under ``block_bytes`` (default 64 MiB), whatever the corpus size.
Dot products are taken in float64: BLAS rounds a row differently depending on
where it falls in its blocking, so in float32 two identical document tokens
could get different similarities and break the lowest-index tie rule; in
float64 fp16/bf16 products are summed exactly for practical inputs.
"""

from __future__ import annotations

import numpy as np

_BLOCK_BYTES = 64 << 20


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
    nq, lq, _ = Q.shape
    ld = D.shape[1]
    scores = np.empty((nq, nd), np.float32)
    amax = np.empty((nq, nd, lq), np.int32) if return_argmax else None
    per = max(1, block_bytes // max(1, lq * ld * 8 * (2 if return_argmax else 1)))
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(nq):
            qi = Q[i].astype(np.float64)
            qv = q_valid[i]
            base = i * nd if candidates else 0
            for j0 in range(0, nd, per):
                j1 = min(nd, j0 + per)
                blk = D[base + j0 : base + j1].astype(np.float64)
                dv = d_valid[base + j0 : base + j1]
                sim = np.matmul(blk, qi.T)  # [nb, Ld, Lq]
                if d_scale is not None:
                    sim = sim.astype(np.float32) * d_scale[base + j0 : base + j1, :, None]
                sim[~dv] = -np.inf  # masked document tokens never win
                best = sim.max(axis=1) if ld else np.full((j1 - j0, lq), -np.inf)  # NaN propagates
                if q_scale is not None:  # an empty document's -inf stays -inf against a zero scale
                    qs = np.where(q_scale[i] >= 0, q_scale[i], np.float32(np.nan))
                    best = np.where(best == -np.inf, best, best * qs)
                scores[i, j0:j1] = np.where(qv, best, 0.0).sum(axis=1, dtype=np.float64)
                if amax is not None:
                    idx = sim.argmax(axis=1).astype(np.int32) if ld else np.zeros((j1 - j0, lq), np.int32)
                    idx[~dv.any(axis=1)] = -1  # empty document
                    idx[:, ~qv] = -1  # masked query token
                    amax[i, j0:j1] = idx
    return scores, amax


def unpack(tokens: np.ndarray, offsets: np.ndarray):
    """Packed rows [T, d] with int64 offsets [N + 1] -> padded [N, Lmax, d] and bool valid [N, Lmax]."""
    lens = np.diff(offsets)
    n, lmax = lens.size, int(lens.max()) if lens.size else 0
    valid = np.arange(lmax)[None, :] < lens[:, None]
    out = np.zeros((n, lmax, tokens.shape[1]), tokens.dtype)
    out[valid] = tokens[offsets[0]:offsets[-1]]
    return out, valid


def maxsim_packed_numpy(Q: np.ndarray, q_valid: np.ndarray, tokens: np.ndarray, offsets: np.ndarray, *,
                        return_argmax: bool, block_tokens: int = 1 << 16, q_scale: np.ndarray | None = None,
                        d_scale: np.ndarray | None = None):
    """MaxSim of padded queries against packed documents (``offsets`` int64 [Nd + 1], checked).

    Documents go in runs of about ``block_tokens`` tokens, each padded only to
    its own longest document, so memory stays bounded for any corpus. int8 inputs take
    ``q_scale`` [Nq, Lq] and ``d_scale`` [T] as in :func:`maxsim_numpy`.
    """
    nq, lq, _ = Q.shape
    nd = offsets.size - 1
    scores = np.empty((nq, nd), np.float32)
    amax = np.empty((nq, nd, lq), np.int32) if return_argmax else None
    j0 = 0
    while j0 < nd:
        j1 = max(j0 + 1, int(np.searchsorted(offsets, offsets[j0] + block_tokens, side="right")) - 1)
        j1 = min(j1, nd)
        blk, dv = unpack(tokens, offsets[j0:j1 + 1])
        sblk = None if d_scale is None else unpack(d_scale.reshape(-1, 1), offsets[j0:j1 + 1])[0][..., 0]
        s, a = maxsim_numpy(Q, blk, q_valid, dv, candidates=False, nd=j1 - j0, return_argmax=return_argmax,
                            q_scale=q_scale, d_scale=sblk)
        scores[:, j0:j1] = s
        if amax is not None:
            amax[:, j0:j1] = a
        j0 = j1
    return scores, amax


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
