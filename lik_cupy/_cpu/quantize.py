"""The NumPy INT8 quantiser (the rule is in ``lik_cupy.quantize``'s docstring; the device kernel,
``cuda_src/quantize.cu``, does the same IEEE float32 operations and gives the same bytes)."""

from __future__ import annotations

import numpy as np

__all__ = ["quantize_numpy"]

_BLOCK_ROWS = 1 << 16  # tokens per block, so float32 temporaries stay small


def quantize_numpy(x: np.ndarray, *, strict: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy quantiser: ``x [..., d]`` (any float dtype, ml_dtypes bfloat16 included)
    -> int8 ``[..., d]`` and float32 ``[...]``. A token with NaN or inf raises ValueError, or
    with ``strict=False`` gets scale NaN and q 0, as on the device."""
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"X has shape {list(x.shape)}; expected [..., d] with an embedding dim d >= 1")
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    q = np.empty(flat.shape, np.int8)
    s = np.empty(flat.shape[0], np.float32)
    for r0 in range(0, flat.shape[0], _BLOCK_ROWS):
        blk = flat[r0 : r0 + _BLOCK_ROWS].astype(np.float32)
        finite = np.isfinite(blk).all(axis=1)
        if strict and not finite.all():
            bad = r0 + int(np.argmin(finite))
            where = np.unravel_index(bad, x.shape[:-1]) if x.ndim > 1 else ()
            raise ValueError(f"X holds NaN or inf in token {tuple(int(i) for i in where)}; "
                             "INT8 quantisation needs finite values")
        amax = np.abs(blk).max(axis=1)
        sc = np.where(finite, amax / np.float32(127), np.float32(np.nan))
        div = np.where(sc > 0, sc, np.float32(1))
        with np.errstate(invalid="ignore"):
            q[r0 : r0 + _BLOCK_ROWS] = np.where(finite[:, None], np.clip(np.rint(blk / div[:, None]), -127, 127), 0)
        s[r0 : r0 + _BLOCK_ROWS] = sc
    return q.reshape(x.shape), s.reshape(x.shape[:-1])
