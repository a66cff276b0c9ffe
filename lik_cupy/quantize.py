"""Per-token symmetric INT8 quantisation: ``quantize_int8`` and ``dequantize_int8``.

Each token (a row of the last axis) ``x`` gets one float32 scale and int8 values::

    scale = max|x| / 127,    q = rint(x / scale)  in [-127, 127],    x ~= q * scale

so every element is within half a step (``scale / 2``) of its original. An all-zero
token (padding) gets scale 0 and q 0: it dequantises to zeros, never NaN. The NumPy
path and the device kernel (``cuda_src/quantize.cu``) do the same IEEE float32
operations, so both give bitwise the same bytes. Storage is ``d + 4`` bytes per token
(``d`` int8 values and a float32 scale) against ``2 d`` for fp16.
"""

from __future__ import annotations

import numpy as np

from . import interop
from .forward import _dev_array, _host_result
from .validate import check_quantized

_BACKENDS = ("auto", "gpu", "cpu")
_BLOCK_ROWS = 1 << 16  # NumPy path: tokens per block, so float32 temporaries stay small


def quantize_int8(X, *, backend="auto"):
    """Quantise token embeddings to INT8 with one scale per token.

    Args:
        X: ``[..., d]`` float16, bfloat16, float32 or float64 (computed in float32), any
            framework (NumPy, CuPy, PyTorch, JAX or a DLPack producer). Every value must
            be finite.
        backend: "auto" (where X lives: device arrays on the GPU, host arrays with
            NumPy), "gpu" or "cpu". Both give bitwise the same result.

    Returns:
        ``(X_int8, scales)``: int8 ``[..., d]`` in [-127, 127] and float32 ``X.shape[:-1]``,
        in X's framework and on X's device.

    Raises:
        ValueError: X holds NaN or inf (the message names the first such token).
    """
    info = interop.describe(X)
    if info.dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"X has dtype {info.dtype}; expected float16, bfloat16, float32 or float64")
    if len(info.shape) < 1 or info.shape[-1] == 0:
        raise ValueError(f"X has shape {list(info.shape)}; expected [..., d] with an embedding dim d >= 1")
    if _on_gpu(info, backend):
        import cupy

        with interop.caller_stream(info.framework, _device(info)):
            x = _dev_array(X, info.framework, info.device is None)
            dtype = info.dtype
            if dtype == "bfloat16":
                x = x.view(cupy.uint16)  # the kernel reads bfloat16 as its 16-bit patterns
            elif dtype == "float64":
                x, dtype = x.astype(cupy.float32), "float32"
            q, s = quantize_cupy(x, dtype, check=True)
            on_host = info.device is None
            return interop.from_cupy(q, info.framework, on_host), interop.from_cupy(s, info.framework, on_host)
    q, s = quantize_numpy(interop.to_numpy(X, info.framework))
    return _host_result(q, info), _host_result(s, info)


def dequantize_int8(X_int8, scales, *, backend="auto"):
    """``X_int8 * scales[..., None]`` as float32 (for checks and round trips).

    Args:
        X_int8: int8 ``[..., d]``; scales: float32 ``X_int8.shape[:-1]``, same framework and device.
        backend: as in :func:`quantize_int8`.

    Returns:
        float32 ``[..., d]`` in the inputs' framework and on their device.
    """
    info = check_quantized("X_int8", X_int8, "scales", scales)
    if _on_gpu(info, backend):
        import cupy

        with interop.caller_stream(info.framework, _device(info)):
            on_host = info.device is None
            q = _dev_array(X_int8, info.framework, on_host)
            out = q.astype(cupy.float32) * _dev_array(scales, info.framework, on_host)[..., None]
            return interop.from_cupy(out, info.framework, info.device is None)
    q = interop.to_numpy(X_int8, info.framework)
    s = interop.to_numpy(scales, info.framework)
    return _host_result(q.astype(np.float32) * s[..., None], info)


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


def quantize_cupy(x, dtype: str, *, check: bool = False):
    """Quantise a C-contiguous CuPy array ``x [..., d]`` (float16/float32, or bfloat16 as its
    uint16 bits with ``dtype="bfloat16"``) on the current stream.

    Returns ``(q int8 [..., d], scales float32 [...])``. A token with NaN or inf gets scale
    NaN (scores against it are NaN) and no host sync happens, unless ``check``: then one
    sync, and ValueError naming the first such token.
    """
    import cupy

    from .compile import get_module
    from .device import device_properties
    from .dispatch import ELEM_CODES, arch_of

    x = cupy.ascontiguousarray(x)
    d = x.shape[-1] if x.ndim else 0
    rows = x.size // d if d else (int(np.prod(x.shape[:-1])) if x.ndim else 0)
    q = cupy.empty(x.shape, cupy.int8)
    s = cupy.zeros(x.shape[:-1], cupy.float32)
    if rows == 0 or d == 0:
        return q, s
    bad = cupy.zeros((), cupy.int32)
    device = x.device.id
    defines = {"LIK_ELEM": ELEM_CODES[dtype]}
    kern = get_module("quantize.cu", defines, arch_of(device_properties(device).cc), device,
                      entry="lik_quantize_int8").get_function("lik_quantize_int8")
    warps = 8
    blocks = int(min(-(-rows // warps), 65535))
    kern((blocks,), (warps * 32,), (x, q, s, np.int64(rows), np.int32(d), bad))
    if check and int(bad.get()):
        first = int(cupy.argmax(~cupy.isfinite(s.reshape(-1))).get())
        where = np.unravel_index(first, x.shape[:-1])
        raise ValueError(f"X holds NaN or inf in token {tuple(int(i) for i in where)}; "
                         "INT8 quantisation needs finite values")
    return q, s


def _on_gpu(info: interop.Info, backend: str) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "gpu":
        from .device import gpu_available

        if not gpu_available():
            raise RuntimeError("backend='gpu' but no CUDA GPU is visible (CuPy could not find one)")
        return True
    return backend == "auto" and info.device is not None


def _device(info: interop.Info) -> int:
    import cupy

    return info.device if info.device is not None else cupy.cuda.runtime.getDevice()
