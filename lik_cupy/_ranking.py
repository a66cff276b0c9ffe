"""The one ranked merge: two rankings of (score, global position) into the best k, in the order
every top-k of lik-cupy returns (``retrieve``'s device merge kernel, ``cuda_src/topk.cu``,
sorts the same way): score descending, ties to the lower position, NaN last."""

from __future__ import annotations

import numpy as np

__all__ = ["merge_ranked", "merge_ranked_rows", "merge_rankings", "MERGE_BYTES"]

# Temporary bytes per candidate of a merge (scores and positions side by side, sort keys, order).
MERGE_BYTES = 48
_SIGN = np.uint32(0x80000000)
_LAST = np.uint32(0xFFFFFFFF)


def merge_ranked(va: np.ndarray, ia: np.ndarray, vb: np.ndarray, ib: np.ndarray, k: int):
    """Merge rankings ``(va, ia)`` and ``(vb, ib)``, each ``[Nq, *]`` float32 scores and int64
    global positions, into the top ``k`` of each row: ``(scores [Nq, <=k], positions [Nq, <=k])``."""
    return merge_rankings([(va, ia), (vb, ib)], k)


def merge_ranked_rows(va: np.ndarray, ia: np.ndarray, vb: np.ndarray, ib: np.ndarray, k: int, max_bytes: int):
    """:func:`merge_ranked`, a block of rows at a time whose temporaries (about ``MERGE_BYTES`` a
    candidate) stay within ``max_bytes``: the same result, without temporaries of many times its
    size when there are many rows."""
    nq, n = va.shape[0], va.shape[1] + vb.shape[1]
    rows = max(1, max_bytes // (MERGE_BYTES * max(1, n)))
    if rows >= nq:
        return merge_ranked(va, ia, vb, ib, k)
    out_v = np.empty((nq, min(k, n)), np.result_type(va, vb))
    out_i = np.empty(out_v.shape, np.int64)
    for a in range(0, nq, rows):
        b = a + rows
        out_v[a:b], out_i[a:b] = merge_ranked(va[a:b], ia[a:b], vb[a:b], ib[a:b], k)
    return out_v, out_i


def merge_rankings(parts, k: int):
    """Merge any number of rankings ``[(scores, positions)]``, each ``[Nq, *]`` float32 (or float64)
    scores and int64 global positions (no position twice in a row), into the top ``k`` of each row,
    in one pass: ``(scores [Nq, <=k], positions [Nq, <=k])``. The order is total, so the result is
    that of any sequence of pairwise merges."""
    if len(parts) == 1:  # a ranking already
        return parts[0][0][:, :k], parts[0][1][:, :k]
    v = np.concatenate([p[0] for p in parts], axis=1)
    i = np.concatenate([p[1] for p in parts], axis=1)
    k = min(k, v.shape[1])
    # Three sort keys where one uint64 cannot hold the order: float64 scores (the key holds a score's
    # float32 bits), positions past 32 bits.
    if v.dtype != np.float32 or (i.size and (i.min() < 0 or i.max() >= 1 << 32)):
        nan = np.isnan(v)
        order = np.lexsort((i, -np.where(nan, 0, v), nan), axis=1)[:, :k]
    elif k < v.shape[1]:
        # The keys are unique within a row, so selecting the k smallest and then sorting only them
        # is exact, and costs O(n) + O(k log k) per row instead of a sort of all n.
        keys = _order_keys(v, i)
        top = np.argpartition(keys, k - 1, axis=1)[:, :k]
        order = np.take_along_axis(top, np.argsort(np.take_along_axis(keys, top, axis=1), axis=1), axis=1)
    else:
        order = np.argsort(_order_keys(v, i), axis=1)
    return np.take_along_axis(v, order, axis=1), np.take_along_axis(i, order, axis=1)


def _order_keys(v: np.ndarray, i: np.ndarray) -> np.ndarray:
    """One uint64 per entry whose ascending order is the ranking's: the score's bits made to sort
    descending in the high word (-0.0 as 0.0; NaN after everything), the position in the low."""
    bits = (np.asarray(v, np.float32) + np.float32(0)).view(np.uint32)  # + 0 turns -0.0 into 0.0
    # Float order as unsigned order is bits ^ (all ones if negative, else the sign bit); its
    # complement sorts descending. The arithmetic shift spreads the sign over the word.
    flip = (bits.view(np.int32) >> 31).view(np.uint32) | _SIGN
    high = np.where(np.isnan(v), _LAST, bits ^ ~flip).astype(np.uint64)
    return (high << np.uint64(32)) | i.astype(np.uint64)
