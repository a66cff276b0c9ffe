"""The compiled decompression of ``residual.py`` (Numba, ``nopython``, the GIL released, cached on disk
beside this file or in Numba's user cache). Imported by ``residual.py`` at its first use, never with the
package; ``residual.decompress`` says what it computes, and these compute the same bits: the same float64
additions, the sum of squares in NumPy's pairwise order (``fold_kernels.dot``), one division and one
rounding to float32 per value."""

from __future__ import annotations

import numba
import numpy as np

from .fold_kernels import dot

__all__ = ["rows16", "rows32"]


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _token(x, crow, res, per_byte, normalize, out, i, prod, frames, vals):  # pragma: no cover (compiled)
    """Token ``i`` of ``out``: its centroid ``crow`` (float64) plus the weights of its residual bytes
    ``res`` (``per_byte [256, 8 / nbits]``), scaled to unit length when ``normalize``."""
    per = per_byte.shape[1]
    for b in range(res.size):
        w = per_byte[res[b]]
        for k in range(per):
            x[b * per + k] = crow[b * per + k] + w[k]
    if normalize:
        m = np.sqrt(dot(x, x, prod, frames, vals))
        if m < 1e-12:  # np.maximum(m, 1e-12): a NaN stays
            m = 1e-12
        for j in range(x.size):
            out[i, j] = np.float32(x[j] / m)
    else:
        for j in range(x.size):
            out[i, j] = np.float32(x[j])


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _scratch(d):  # pragma: no cover (compiled): a token's float64 values, its centroid, and dot's scratch
    return np.empty(d), np.empty(d), np.empty(d), np.empty((64, 3), np.int64), np.empty(64)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def rows16(rows, codes, residuals, bits, table, per_byte, normalize, out):  # pragma: no cover (compiled)
    """Tokens ``rows`` (int64, indices into ``codes [T]`` and ``residuals [T, R]``) into ``out [rows.size,
    d]`` (float32), float16 centroids given as their bits ``[C, d]`` (uint16) and ``table``, the float32
    of every float16 bit pattern."""
    x, crow, prod, frames, vals = _scratch(out.shape[1])
    for i in range(rows.size):
        t = rows[i]
        c = bits[codes[t]]
        for j in range(crow.size):
            crow[j] = table[c[j]]
        _token(x, crow, residuals[t], per_byte, normalize, out, i, prod, frames, vals)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def rows32(rows, codes, residuals, centroids, per_byte, normalize, out):  # pragma: no cover (compiled)
    """:func:`rows16` for float32 ``centroids [C, d]``."""
    x, crow, prod, frames, vals = _scratch(out.shape[1])
    for i in range(rows.size):
        t = rows[i]
        crow[:] = centroids[codes[t]]
        _token(x, crow, residuals[t], per_byte, normalize, out, i, prod, frames, vals)
