"""The NumPy INT8 and FP8 quantisers (the rules are in ``lik_cupy.quantize``'s docstring; the device
kernels, ``cuda_src/quantize.cu``, do the same IEEE float32 operations and give the same bytes)."""

from __future__ import annotations

import numpy as np

__all__ = ["quantize_numpy", "quantize_fp8_numpy", "non_finite_error", "INT8_WORK_BYTES"]

# float32 values per block (32 MiB), so the temporaries stay small whatever the dim: a block of
# a fixed number of tokens would hold gigabytes of them for wide tokens.
_BLOCK_VALUES = 1 << 23
# What quantize_numpy holds of one element of a block at once beyond its input: the float32 copy it
# works in, one float32 temporary (|x|) and its int8 code. The shard writer sizes its blocks by it.
INT8_WORK_BYTES = 4 + 4 + 1
_FP8_MAX = 448.0  # the largest float8_e4m3fn


def _block_rows(d: int) -> int:
    """Tokens of dim ``d`` per block: ``_BLOCK_VALUES`` values, or one token where it holds more."""
    return max(1, _BLOCK_VALUES // d)


def non_finite_error(shape: tuple, flat_row: int, kind: str, finite: bool) -> ValueError:
    """The error for token ``flat_row`` (of the tokens of an ``X`` of ``shape``) that holds NaN or inf
    in float32; ``finite``: its values as given are finite (float64 beyond float32's range)."""
    token = tuple(int(i) for i in np.unravel_index(flat_row, shape[:-1])) if len(shape) > 1 else ()
    if finite:
        return ValueError(f"X holds a value beyond float32's range (|x| > {float(np.finfo(np.float32).max):.4g}) in "
                          f"token {token}; {kind} quantisation scales in float32")
    return ValueError(f"X holds NaN or inf in token {token}; {kind} quantisation needs finite values")


def _non_finite(x: np.ndarray, flat_row: int, kind: str) -> ValueError:
    return non_finite_error(x.shape, flat_row, kind, bool(np.isfinite(x.reshape(-1, x.shape[-1])[flat_row]).all()))


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
    step = _block_rows(d)
    for r0 in range(0, flat.shape[0], step):
        # (float64 past float32's range: inf, refused below; a signalling NaN warns where it is read: a NaN)
        with np.errstate(over="ignore", invalid="ignore"):
            blk = flat[r0 : r0 + step].astype(np.float32)
            amax = np.abs(blk).max(axis=1)
        finite = np.isfinite(blk).all(axis=1)
        if strict and not finite.all():
            raise _non_finite(x, r0 + int(np.argmin(finite)), "int8")
        sc = np.where(finite, amax / np.float32(127), np.float32(np.nan))
        div = np.where(sc > 0, sc, np.float32(1))
        # In place in blk (a copy): the same float32 operations as rint(blk / div) clipped, without
        # a temporary the size of the block for each.
        with np.errstate(invalid="ignore"):
            np.divide(blk, div[:, None], out=blk)
            np.rint(blk, out=blk)
            np.clip(blk, -127, 127, out=blk)
        blk[~finite] = 0
        q[r0 : r0 + step] = blk
        s[r0 : r0 + step] = sc
        del blk
    return q.reshape(x.shape), s.reshape(x.shape[:-1])


def quantize_fp8_numpy(x: np.ndarray, *, per: str = "token", strict: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy FP8 quantiser: ``x [..., d]`` (any float dtype) -> uint8 ``[..., d]`` (float8_e4m3fn
    bit patterns) and float32 scales ``[...]`` (``per="token"``) or ``[]`` (``per="tensor"``): scale =
    max|x| / 448 in float32, codes = e4m3(x / scale) rounded to nearest even (ml_dtypes' cast, which
    is torch's). A zero token (or tensor) gets scale 0 and codes 0. NaN or inf raises ValueError, or
    with ``strict=False`` gives its token (per tensor: every token) scale NaN and codes 0, as on the
    device."""
    import ml_dtypes

    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"X has shape {list(x.shape)}; expected [..., d] with an embedding dim d >= 1")
    if not isinstance(per, str) or per not in ("token", "tensor"):  # (an array would compare elementwise)
        raise ValueError(f"per is {per!r}; expected 'token' or 'tensor'")
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    rows, step = flat.shape[0], _block_rows(d)
    amax = np.zeros(rows, np.float32)
    for r0 in range(0, rows, step):
        with np.errstate(invalid="ignore", over="ignore"):
            amax[r0 : r0 + step] = np.abs(flat[r0 : r0 + step].astype(np.float32)).max(axis=1)
    finite = np.isfinite(amax)
    if strict and not finite.all():
        raise _non_finite(x, int(np.argmin(finite)), "float8_e4m3fn")
    if per == "tensor":
        top = amax.max(initial=np.float32(0)) if finite.all() else np.float32(np.nan)
        sc = np.full(rows, np.float32(top) / np.float32(_FP8_MAX), np.float32)
    else:
        sc = np.where(finite, amax / np.float32(_FP8_MAX), np.float32(np.nan)).astype(np.float32)
    ok = finite & (sc > 0) & np.isfinite(sc)
    q = np.zeros(flat.shape, np.uint8)
    for r0 in range(0, rows, step):
        with np.errstate(over="ignore"):  # (only rows refused above, or given codes 0 without strict, overflow)
            blk = flat[r0 : r0 + step].astype(np.float32)
        k = ok[r0 : r0 + step]
        div = np.where(k, sc[r0 : r0 + step], np.float32(1))
        with np.errstate(invalid="ignore"):
            # In place in blk (a copy), as quantize_numpy. Saturated as the kernel's cvt.rn.satfinite and
            # torch's cast: ml_dtypes' cast turns 464 and over into NaN, and a row whose largest value is
            # a denormal gets a scale too coarse for it.
            np.divide(blk, div[:, None], out=blk)
            np.clip(blk, -_FP8_MAX, _FP8_MAX, out=blk)
            codes = blk.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        del blk
        q[r0 : r0 + step] = np.where(k[:, None], codes, 0)
    scales = np.float32(sc[0] if rows else np.float32(0)) if per == "tensor" else sc.reshape(x.shape[:-1])
    return q.reshape(x.shape), np.asarray(scales, np.float32)
