"""Spans of boolean document masks (``cuda_src/masks.cu``).

A padded corpus with ``d_mask`` gives the forward kernel, beside the mask, each document's span:
how far its valid tokens reach, and whether they are a prefix. The kernel then stages no tile
past a document's last valid token and reads no mask for a document whose valid tokens come
first, so a mask costs what the same lengths cost (one small kernel more, reading the mask once).
"""

from __future__ import annotations

import numpy as np

_THREADS = 256


def mask_spans(mask, device: int):
    """int32 ``[rows]`` spans of a C-contiguous uint8 mask ``[rows, L]`` on ``device`` (the current
    CuPy stream): ``n`` when a row's valid tokens are exactly its first ``n``, else ``~n`` (negative),
    ``n`` one past its last valid token."""
    import cupy

    from .nvrtc import get_function

    rows, length = mask.shape
    out = cupy.empty(rows, cupy.int32)
    if rows:
        warps_per_block = _THREADS // 32
        blocks = min(-(-rows // warps_per_block), 65535)
        kern = get_function("masks.cu", "lik_mask_spans", device)
        kern((blocks,), (_THREADS,), (mask, np.int64(rows), np.int32(length), out))
    return out
