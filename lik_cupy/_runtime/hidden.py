"""The fused projection head's device arithmetic (``lik_cupy.fused_head``): cuBLAS GEMMs of
row-major device arrays (float16, bfloat16 as its uint16 bits, float32, float64) with float32
accumulation, and fused CuPy kernels (compiled by NVRTC on first use) that L2-normalise projected
tokens in place and form the normalisation's gradient, reading and writing the 16-bit or float32
rows once each. float64 rows take the NumPy-API arithmetic of ``lik_cupy._cpu.hidden``."""

from __future__ import annotations

import functools

import numpy as np

# cudaDataType and cuBLAS enums (their ABI values)
_CUDA_TYPE = {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32, _COMPUTE_64F = 68, 77, 70
_OP_N, _OP_T, _GEMM_DEFAULT = 0, 1, -1

# Conversions between a kernel's element type and float32: bfloat16 is its uint16 bits, rounded
# to nearest even on the way back (NaN stays NaN).
_PREAMBLE = r"""
__device__ __forceinline__ float lik_f(float16 x) { return (float)x; }
__device__ __forceinline__ float lik_f(float x) { return x; }
__device__ __forceinline__ float lik_f(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ void lik_set(float16 &y, float v) { y = float16(v); }
__device__ __forceinline__ void lik_set(float &y, float v) { y = v; }
__device__ __forceinline__ void lik_set(unsigned short &y, float v) {
    unsigned int u = __float_as_uint(v);
    y = (v != v) ? (unsigned short)0x7fc0 : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
"""


@functools.cache
def _kernels():
    import cupy

    k = {
        "sumsq": cupy.ReductionKernel("T x", "float32 y", "lik_f(x) * lik_f(x)", "a + b", "y = a", "0",
                                      "lik_hidden_sumsq", reduce_type="float32", preamble=_PREAMBLE),
        "dot": cupy.ReductionKernel("T x, T z", "float32 y", "lik_f(x) * lik_f(z)", "a + b", "y = a", "0",
                                    "lik_hidden_dot", reduce_type="float32", preamble=_PREAMBLE),
        "sum": cupy.ReductionKernel("T x", "float32 y", "lik_f(x)", "a + b", "y = a", "0", "lik_hidden_sum",
                                    reduce_type="float32", preamble=_PREAMBLE),
        "scale": cupy.ElementwiseKernel("float32 s", "T d", "lik_set(d, lik_f(d) * s)", "lik_hidden_scale",
                                        preamble=_PREAMBLE),
        "grad": cupy.ElementwiseKernel("T dv, float32 c, float32 inv, bool keep", "T g",
                                       "lik_set(g, keep ? (lik_f(g) - lik_f(dv) * c) * inv : 0.f)",
                                       "lik_hidden_grad", preamble=_PREAMBLE),
        "to_f32": cupy.ElementwiseKernel("T x", "float32 y", "y = lik_f(x)", "lik_hidden_to_f32", preamble=_PREAMBLE),
        "from_f32": cupy.ElementwiseKernel("float32 x", "T y", "lik_set(y, x)", "lik_hidden_from_f32",
                                           preamble=_PREAMBLE),
    }
    return k


def gemm(a, b, out, dtype: str, *, ta: bool = False, tb: bool = False, beta: float = 0.0, tf32: bool = False):
    """``out = op(a) @ op(b) + beta * out`` for C-contiguous row-major device arrays (``op`` transposes
    where ``ta`` / ``tb``), on the current stream. ``dtype`` names a's and b's element type (bfloat16
    as uint16 bits); ``out`` is of it, or float32 (float64 for float64): float32 accumulation, float64
    for float64, TF32 tensor cores for float32 where ``tf32``."""
    import cupy
    from cupy.cuda import cublas

    m, k = (a.shape[1], a.shape[0]) if ta else a.shape
    n = b.shape[0] if tb else b.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        out *= beta
        return out
    wide = dtype == "float64"
    scalar = np.float64 if wide else np.float32
    alpha_h, beta_h = np.array([1.0], scalar), np.array([beta], scalar)
    compute = _COMPUTE_64F if wide else (_COMPUTE_32F_FAST_TF32 if tf32 and dtype == "float32" else _COMPUTE_32F)
    out_type = _CUDA_TYPE[dtype] if out.dtype.itemsize == 2 else _CUDA_TYPE[np.dtype(out.dtype).name]
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    # row-major C = op(a) op(b) is column-major C^T = op(b)^T op(a)^T: b's buffer first
    cublas.gemmEx(handle, _OP_T if tb else _OP_N, _OP_T if ta else _OP_N, n, m, k, alpha_h.ctypes.data,
                  b.data.ptr, _CUDA_TYPE[dtype], b.shape[1], a.data.ptr, _CUDA_TYPE[dtype], a.shape[1],
                  beta_h.ctypes.data, out.data.ptr, out_type, n, compute, _GEMM_DEFAULT)
    return out


def project(H, W, bias, dtype: str, normalize: bool, eps: float, tf32: bool):
    """Projected tokens ``H [R, h] @ W.T + bias`` ``[R, d]`` in ``H``'s element type, L2-normalised in
    place where ``normalize`` (from float32 sums of squares); returns ``(D, norms [R, 1] float32 or
    None)``. float64 stays float64 throughout."""
    import cupy

    from .._cpu.hidden import normalize_rows

    D = cupy.empty((H.shape[0], W.shape[0]), H.dtype)
    if bias is not None:
        D[...] = bias
    gemm(H, W, D, dtype, tb=True, beta=1.0 if bias is not None else 0.0, tf32=tf32)
    if not normalize:
        return D, None
    if dtype == "float64":
        return D, normalize_rows(D, eps)
    k = _kernels()
    r = cupy.sqrt(k["sumsq"](D, axis=1))[:, None]
    k["scale"](1.0 / cupy.maximum(r, np.float32(eps)), D)
    return D, r


def project_grad(D, r, dD, keep, dtype: str, eps: float):
    """The gradient with respect to the unnormalised projection, written over ``dD`` (``[R, d]``, of
    ``D``'s element type) for 16-bit and float32 rows, from the normalised rows ``D`` and their norms
    ``r`` (None: no normalisation); rows where ``keep`` ``[R, 1]`` is False are zero."""
    import cupy

    from .._cpu.hidden import normalize_grad

    if dtype == "float64":
        return normalize_grad(D, r, dD, keep, eps)
    k = _kernels()
    if r is None:
        c, inv = np.float32(0), np.float32(1)
    else:
        big = r > np.float32(eps)
        c = k["dot"](D, dD, axis=1)[:, None] * big
        inv = 1.0 / cupy.maximum(r, np.float32(eps))
    k["grad"](D, c, inv, keep, dD)
    return dD


def row_sums(x):
    """float32 sums over the rows of ``x [R, d]`` (16-bit or float32 elements): ``[d]``."""
    return _kernels()["sum"](x, axis=0)


def to_float32(x):
    return _kernels()["to_f32"](x)


def from_float32(x, like_dtype):
    """float32 ``x`` in a kernel element type (``like_dtype``; uint16 is bfloat16's bits)."""
    import cupy

    out = cupy.empty(x.shape, like_dtype)
    _kernels()["from_f32"](x, out)
    return out
