"""Symmetric quantisation: ``quantize_int8`` / ``dequantize_int8`` and ``quantize_fp8`` / ``dequantize_fp8``.

INT8, per token.

Each token (a row of the last axis) ``x`` gets one float32 scale and int8 values::

    scale = max|x| / 127,    q = rint(x / scale)  in [-127, 127],    x ~= q * scale

so every element is within half a step (``scale / 2``) of its original, except in tokens of
float32 subnormals only: below a largest element of about 2^-135 the scale, itself subnormal,
rounds so coarsely that elements clip at +-127 (and at or below 63 * 2^-149, about 8.8e-44, where
max|x| / 127 rounds to 0, to a scale of 0 and codes 0). An all-zero token (padding) gets scale 0 and
q 0: it dequantises to zeros, never NaN. The NumPy
path and the device kernel (``cuda_src/quantize.cu``) do the same IEEE float32
operations, so both give bitwise the same bytes. Storage is ``d + 4`` bytes per token
(``d`` int8 values and a float32 scale) against ``2 d`` for fp16.

FP8 e4m3 (``float8_e4m3fn``), per token or per tensor::

    scale = max|x| / 448,    q = e4m3(x / scale)  (round to nearest even),    x ~= q * scale

with ``max|x|`` over the token (``per="token"``) or the whole tensor (``per="tensor"``), in float32;
the codes are bitwise those of ``(x / scale).to(torch.float8_e4m3fn)``, on the NumPy path
(ml_dtypes) and on the device (sm_89 and newer). Zero tokens (or tensors) get scale 0 and codes 0,
as do those of float32 subnormals whose max|x| / 448 rounds to 0 (max|x| at or below 224 * 2^-149,
about 3.1e-43), where torch's cast of ``x / 0`` would give +-448 or NaN: they dequantise to zeros.
"""

from __future__ import annotations

import numpy as np

from . import _interop as interop
from . import _cpu
from ._dispatch import ElemSpec, elem_spec
from ._dispatch.backend import use_gpu
from ._interop import GpuCall, float8_bits, float8_view, host_result
from ._validate import check_quantized

__all__ = ["quantize_int8", "dequantize_int8", "quantize_fp8", "dequantize_fp8"]

_FP8 = "float8_e4m3fn"


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
        ValueError: X holds NaN or inf, or (float64) a value beyond float32's range (the message
            names the first such token).
    Example::

        >>> import numpy as np, lik_cupy
        >>> q, s = lik_cupy.quantize_int8(np.array([[0.5, -1.0, 0.25]], np.float32), backend="cpu")
        >>> q, s
        (array([[  64, -127,   32]], dtype=int8), array([0.00787402], dtype=float32))
        >>> lik_cupy.dequantize_int8(q, s, backend="cpu")
        array([[ 0.503937 , -1.       ,  0.2519685]], dtype=float32)
    """
    return _quantize(X, backend, elem_spec("int8"))


def quantize_fp8(X, *, per="token", backend="auto"):
    """Quantise token embeddings to FP8 e4m3 with one float32 scale per token or per tensor.

    Args:
        X: ``[..., d]`` float16, bfloat16, float32 or float64 (computed in float32), any framework.
            Every value must be finite.
        per: "token" (one scale per token, the last axis's rows) or "tensor" (one for all of X).
        backend: "auto", "gpu" (sm_89 or newer) or "cpu". Both give bitwise the same result.

    Returns:
        ``(X_fp8, scales)``: float8_e4m3fn ``[..., d]`` (torch, NumPy through ml_dtypes, JAX; uint8 bit
        patterns in CuPy, which has no float8 type) and float32 ``X.shape[:-1]`` (per tensor: ``[]``),
        in X's framework and on X's device. :func:`lik_cupy.maxsim_fp8` takes both as they are.

    Raises:
        ValueError: X holds NaN or inf, or (float64) a value beyond float32's range (the message
            names the first such token), or ``per`` is neither.
    Example::

        >>> import numpy as np, lik_cupy
        >>> q, s = lik_cupy.quantize_fp8(np.array([[0.5, -1.0, 0.3]], np.float32), backend="cpu")
        >>> q.view(np.uint8), s
        (array([[118, 254, 112]], dtype=uint8), array([0.00223214], dtype=float32))
        >>> lik_cupy.dequantize_fp8(q, s, backend="cpu")
        array([[ 0.5      , -1.       ,  0.2857143]], dtype=float32)
    """
    if not isinstance(per, str) or per not in ("token", "tensor"):  # (an array would compare elementwise)
        raise ValueError(f"per is {per!r}; expected 'token' or 'tensor'")
    return _quantize(X, backend, elem_spec(_FP8), per=per)


def _quantize(X, backend: str, spec: ElemSpec, **how):
    """X quantised to ``spec``'s type by its quantisers (``how``: their options, FP8's ``per``)."""
    info = interop.describe_named("X", X)
    if info.dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"X has dtype {info.dtype}; expected float16, bfloat16, float32 or float64")
    if len(info.shape) < 1 or info.shape[-1] == 0:
        raise ValueError(f"X has shape {list(info.shape)}; expected [..., d] with an embedding dim d >= 1")
    if use_gpu(backend, info.device, host_to_gpu=False):
        import cupy

        with GpuCall(info) as g:
            x = g.array(X)
            dtype, source = info.dtype, None
            if dtype == "bfloat16":
                x = x.view(cupy.uint16)  # the kernel reads bfloat16 as its 16-bit patterns
            elif dtype == "float64":
                source, x, dtype = x, x.astype(cupy.float32), "float32"
            from ._runtime.quantize import quantize_cupy

            q, s = quantize_cupy(x, dtype, check=True, to=spec.name, source=source, **how)
            return _native(g.result(q), spec, info.framework), g.result(s)
    q, s = getattr(_cpu, spec.quantiser)(interop.to_numpy(X, info.framework), **how)
    return _native(host_result(q, info), spec, info.framework), host_result(s, info)


def _native(q, spec: ElemSpec, fw: str):
    """Codes in the framework's own type where the kernels read them as bits (FP8: float8_e4m3fn)."""
    return q if spec.numpy_dtype == spec.name else float8_view(q, fw)


def dequantize_int8(X_int8, scales, *, backend="auto"):
    """``X_int8 * scales[..., None]`` as float32 (for checks and round trips).

    Args:
        X_int8: int8 ``[..., d]``; scales: float32 ``X_int8.shape[:-1]``, same framework and device.
        backend: as in :func:`quantize_int8`.

    Returns:
        float32 ``[..., d]`` in the inputs' framework and on their device.
    """
    return _dequantize("X_int8", X_int8, scales, backend, elem_spec("int8"))


def dequantize_fp8(X_fp8, scales, *, backend="auto"):
    """``X_fp8 * scales[..., None]`` (or ``* scales`` for one per tensor) as float32, exact: e4m3
    values times a float32 scale round once.

    Args:
        X_fp8: float8_e4m3fn (or uint8 bit patterns) ``[..., d]``; scales: float32 ``X_fp8.shape[:-1]``
            or ``[]``, same framework and device.
        backend: as in :func:`quantize_fp8`.

    Returns:
        float32 ``[..., d]`` in the inputs' framework and on their device.
    """
    return _dequantize("X_fp8", float8_bits(X_fp8, "X_fp8"), scales, backend, elem_spec(_FP8))


def _dequantize(name: str, X, scales, backend: str, spec: ElemSpec):
    """float32 values of one-byte codes ``X`` (as the kernels read them) times their scales."""
    info = check_quantized(name, X, "scales", scales, spec.name)
    values = _byte_values(spec)
    if use_gpu(backend, info.device, host_to_gpu=False):
        import cupy

        with GpuCall(info) as g:
            q = g.array(X)
            s = g.array(scales)
            out = cupy.asarray(values)[q.view(cupy.uint8)]
            out *= s[..., None] if s.ndim else s  # in place: no second array the size of the result
            return g.result(out)
    q = interop.to_numpy(X, info.framework)
    s = interop.to_numpy(scales, info.framework)
    out = values[q.view(np.uint8)]
    out *= s[..., None] if s.ndim else s  # (as on the GPU)
    return host_result(out, info)


def _byte_values(spec: ElemSpec) -> np.ndarray:
    """float32 [256]: the value of each byte of a one-byte element type (exact)."""
    import ml_dtypes  # noqa: F401  (registers the float8 dtype names with NumPy)

    return np.arange(256, dtype=np.uint8).view(np.dtype(spec.name)).astype(np.float32)
