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

from . import _interop as interop
from ._cpu import quantize_numpy
from ._dispatch.backend import use_gpu
from ._interop import GpuCall, host_result
from ._validate import check_quantized

__all__ = ["quantize_int8", "dequantize_int8"]


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
    Example::

        >>> import numpy as np, lik_cupy
        >>> q, s = lik_cupy.quantize_int8(np.array([[0.5, -1.0, 0.25]], np.float32), backend="cpu")
        >>> q, s
        (array([[  64, -127,   32]], dtype=int8), array([0.00787402], dtype=float32))
        >>> lik_cupy.dequantize_int8(q, s, backend="cpu")
        array([[ 0.503937 , -1.       ,  0.2519685]], dtype=float32)
    """
    info = interop.describe(X)
    if info.dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"X has dtype {info.dtype}; expected float16, bfloat16, float32 or float64")
    if len(info.shape) < 1 or info.shape[-1] == 0:
        raise ValueError(f"X has shape {list(info.shape)}; expected [..., d] with an embedding dim d >= 1")
    if use_gpu(backend, info.device, host_to_gpu=False):
        import cupy

        with GpuCall(info) as g:
            x = g.array(X)
            dtype = info.dtype
            if dtype == "bfloat16":
                x = x.view(cupy.uint16)  # the kernel reads bfloat16 as its 16-bit patterns
            elif dtype == "float64":
                x, dtype = x.astype(cupy.float32), "float32"
            from ._runtime.quantize import quantize_cupy

            q, s = quantize_cupy(x, dtype, check=True)
            return g.result(q), g.result(s)
    q, s = quantize_numpy(interop.to_numpy(X, info.framework))
    return host_result(q, info), host_result(s, info)


def dequantize_int8(X_int8, scales, *, backend="auto"):
    """``X_int8 * scales[..., None]`` as float32 (for checks and round trips).

    Args:
        X_int8: int8 ``[..., d]``; scales: float32 ``X_int8.shape[:-1]``, same framework and device.
        backend: as in :func:`quantize_int8`.

    Returns:
        float32 ``[..., d]`` in the inputs' framework and on their device.
    """
    info = check_quantized("X_int8", X_int8, "scales", scales)
    if use_gpu(backend, info.device, host_to_gpu=False):
        import cupy

        with GpuCall(info) as g:
            return g.result(g.array(X_int8).astype(cupy.float32) * g.array(scales)[..., None])
    q = interop.to_numpy(X_int8, info.framework)
    s = interop.to_numpy(scales, info.framework)
    return host_result(q.astype(np.float32) * s[..., None], info)
