"""The one ranked merge: two rankings of (score, global position) into the best k, in the order
every top-k of lik-cupy returns (``retrieve``'s device merge kernel, ``cuda_src/topk.cu``,
sorts the same way): score descending, ties to the lower position, NaN last."""

from __future__ import annotations

import numpy as np

__all__ = ["merge_ranked"]

_SIGN = np.uint32(0x80000000)
_LAST = np.uint32(0xFFFFFFFF)


def merge_ranked(va: np.ndarray, ia: np.ndarray, vb: np.ndarray, ib: np.ndarray, k: int):
    """Merge rankings ``(va, ia)`` and ``(vb, ib)``, each ``[Nq, *]`` float32 scores and int64
    global positions, into the top ``k`` of each row: ``(scores [Nq, <=k], positions [Nq, <=k])``."""
    v = np.concatenate([va, vb], axis=1)
    i = np.concatenate([ia, ib], axis=1)
    if i.size and (i.min() < 0 or i.max() >= 1 << 32):  # positions past 32 bits: three sort keys
        nan = np.isnan(v)
        order = np.lexsort((i, -np.where(nan, 0, v), nan), axis=1)[:, :k]
    else:
        order = np.argsort(_order_keys(v, i), axis=1, kind="stable")[:, :k]
    return np.take_along_axis(v, order, axis=1), np.take_along_axis(i, order, axis=1)


def _order_keys(v: np.ndarray, i: np.ndarray) -> np.ndarray:
    """One uint64 per entry whose ascending order is the ranking's: the score's bits made to sort
    descending in the high word (-0.0 as 0.0; NaN after everything), the position in the low."""
    bits = (np.asarray(v, np.float32) + np.float32(0)).view(np.uint32)  # + 0 turns -0.0 into 0.0
    ascending = np.where(bits & _SIGN, ~bits, bits | _SIGN)  # float order as unsigned order
    high = np.where(np.isnan(v), _LAST, ~ascending).astype(np.uint64)
    return (high << np.uint64(32)) | i.astype(np.uint64)
