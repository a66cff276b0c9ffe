"""The one ranked merge: two rankings of (score, global position) into the best k, in the order
every top-k of lik-cupy returns (``retrieve``'s device merge kernel, ``cuda_src/topk.cu``,
sorts the same way): score descending, ties to the lower position, NaN last."""

from __future__ import annotations

import numpy as np

__all__ = ["merge_ranked"]


def merge_ranked(va: np.ndarray, ia: np.ndarray, vb: np.ndarray, ib: np.ndarray, k: int):
    """Merge rankings ``(va, ia)`` and ``(vb, ib)``, each ``[Nq, *]`` float32 scores and int64
    global positions, into the top ``k`` of each row: ``(scores [Nq, <=k], positions [Nq, <=k])``."""
    v = np.concatenate([va, vb], axis=1)
    i = np.concatenate([ia, ib], axis=1)
    nan = np.isnan(v)
    order = np.lexsort((i, -np.where(nan, 0, v), nan), axis=1)[:, :k]
    return np.take_along_axis(v, order, axis=1), np.take_along_axis(i, order, axis=1)
