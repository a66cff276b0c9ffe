"""MaxSim gradients on the CPU from the forward's argmax, in float64, in blocks bounded in bytes.

``dQ[i, s] = sum_j g[i, j] * D[row(i, j, s)]`` and ``dD[r] = sum of g[i, j] * Q[i, s]`` over the
entries whose argmax row is ``r``. The argmax already holds the forward's tie-breaking (the lowest
index among equal similarities), so nothing here compares similarities. Each block of (query,
document) pairs gathers its winning document rows once: dQ is a dense weighted sum over the block's
documents (``einsum``), dD a sorted segment sum (``np.add.reduceat``) per distinct row, so both are
summed in a fixed order and the result does not depend on the machine's threads.
"""

from __future__ import annotations

import numpy as np

from .maxsim import BLOCK_BYTES

__all__ = ["maxsim_backward_numpy"]


@np.errstate(over="ignore", under="ignore", invalid="ignore")  # float64's arithmetic: inf, 0, NaN
def maxsim_backward_numpy(g: np.ndarray, Q: np.ndarray, D: np.ndarray, amax: np.ndarray, doc_start: np.ndarray, *,
                          block_bytes: int = BLOCK_BYTES):
    """Gradients from the argmax, accumulated in float64.

    g: [Nq, nd] score gradients (any float dtype); Q: [Nq, Lq, d]; D: [R, d] document rows;
    amax: int [Nq, nd, Lq], document-local token indices (-1: contributes nothing); doc_start:
    int64 [Nq, nd], the row of D where document j of query i starts (entries are checked by the
    caller to stay inside their documents).
    Returns float64 dQ [Nq, Lq, d] and dD [R, d] (inf, 0 and NaN as float64 makes them, whatever the
    caller's ``np.seterr``). Temporaries stay within about ``block_bytes``
    beyond those two (a block holds one query's entries against one document at least).
    """
    nq, nd, lq = amax.shape
    dim = Q.shape[-1]
    dQ = np.zeros((nq, lq, dim))
    dD = np.zeros((D.shape[0], dim))
    per_entry = 32 * dim + 128  # its gathered document row; its float64 query row, its row sum and its dD row; indices
    jb = max(1, min(nd, block_bytes // max(1, lq * per_entry)))
    qb = max(1, min(nq, block_bytes // max(1, jb * lq * per_entry)))
    for i0 in range(0, nq, qb):
        i1 = min(nq, i0 + qb)
        for j0 in range(0, nd, jb):
            j1 = min(nd, j0 + jb)
            a = amax[i0:i1, j0:j1]
            ok = a >= 0
            if not ok.any():
                continue
            w = np.where(ok, g[i0:i1, j0:j1, None].astype(np.float64), 0.0)  # [qb, jb, Lq]
            rows = np.where(ok, doc_start[i0:i1, j0:j1, None] + a, 0)
            won = D[rows]
            won[~ok] = 0  # row 0 stood in for entries without a winner: padding the forward never read (NaN * 0 is NaN)
            dQ[i0:i1] += np.einsum("ijs,ijsk->isk", w, won, dtype=np.float64)
            i, j, s = np.nonzero(ok)
            r = rows[i, j, s]
            order = np.argsort(r, kind="stable")  # (i, j, s) order within a row: a fixed summation order
            r, i, s, wo = r[order], i[order], s[order], w[i[order], j[order], s[order]]
            vals = Q[i0 + i, s].astype(np.float64)
            vals *= wo[:, None]
            starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
            dD[r[starts]] += np.add.reduceat(vals, starts, axis=0)
    return dQ, dD
