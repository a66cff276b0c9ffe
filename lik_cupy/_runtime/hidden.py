"""The fused projection head's device arithmetic (``lik_cupy.fused_head``): cuBLAS GEMMs of
row-major device arrays (float16 and bfloat16 as their uint16 bits, float32, float64) with float32
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

# Each kernel element type and float32, per kind: 16-bit elements are their uint16 bits (float16
# converted by PTX's cvt, round to nearest even; bfloat16 by its top half, rounded to nearest even
# on the way back, NaN kept), so the kernels need no half type of CuPy's or CUDA's headers.
_CONVERT = {
    "float16": r"""
__device__ __forceinline__ float lik_f(unsigned short b) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b)); return f; }
__device__ __forceinline__ void lik_set(unsigned short &y, float v) { asm("cvt.rn.f16.f32 %0, %1;" : "=h"(y) : "f"(v)); }
""",
    "bfloat16": r"""
__device__ __forceinline__ float lik_f(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ void lik_set(unsigned short &y, float v) {
    unsigned int u = __float_as_uint(v);
    y = (v != v) ? (unsigned short)0x7fc0 : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
""",
    "float32": r"""
__device__ __forceinline__ float lik_f(float x) { return x; }
__device__ __forceinline__ void lik_set(float &y, float v) { y = v; }
""",
}


@functools.cache
def _kernels(dtype: str):
    """The kernels of element type ``dtype`` ("float16", "bfloat16" or "float32")."""
    import cupy

    pre, tag = _CONVERT[dtype], dtype[:4]
    return {
        # the rows' float32 sums of squares, with the bias added (float32, broadcast over the rows)
        "sumsq": cupy.ReductionKernel("T x, float32 bias", "float32 y", "(lik_f(x) + bias) * (lik_f(x) + bias)",
                                      "a + b", "y = a", "0", f"lik_hidden_sumsq_{tag}", reduce_type="float",
                                      preamble=pre),
        "dot": cupy.ReductionKernel("T x, T z", "float32 y", "lik_f(x) * lik_f(z)", "a + b", "y = a", "0",
                                    f"lik_hidden_dot_{tag}", reduce_type="float", preamble=pre),
        "sum": cupy.ReductionKernel("T x", "float32 y", "lik_f(x)", "a + b", "y = a", "0", f"lik_hidden_sum_{tag}",
                                    reduce_type="float", preamble=pre),
        # (x + bias) / max(|x + bias|, eps), the norm from the row's float32 sum of squares
        "scale": cupy.ElementwiseKernel("float32 bias, float32 ss, float32 eps", "T d",
                                        "lik_set(d, (lik_f(d) + bias) / fmaxf(sqrtf(ss), eps))",
                                        f"lik_hidden_scale_{tag}", preamble=pre),
        # F.normalize's gradient: (g - y <y, g>) / |x| where |x| > eps, g / eps where the floor held
        "grad": cupy.ElementwiseKernel(
            "T y, float32 dot, float32 ss, float32 eps, bool keep", "T g",
            "float r = sqrtf(ss); float c = r > eps ? dot : 0.f;"
            "lik_set(g, keep ? (lik_f(g) - lik_f(y) * c) / fmaxf(r, eps) : 0.f)",
            f"lik_hidden_grad_{tag}", preamble=pre),
        "to_f32": cupy.ElementwiseKernel("T x", "float32 y", "y = lik_f(x)", f"lik_hidden_to_f32_{tag}", preamble=pre),
        "from_f32": cupy.ElementwiseKernel("float32 x", "T y", "lik_set(y, x)", f"lik_hidden_from_f32_{tag}",
                                           preamble=pre),
    }


def gemm(a, b, out, dtype: str, *, ta: bool = False, tb: bool = False, beta: float = 0.0, tf32: bool = False):
    """``out = op(a) @ op(b) + beta * out`` for C-contiguous row-major device arrays (``op`` transposes
    where ``ta`` / ``tb``), on the current stream. ``dtype`` names a's and b's element type (16-bit
    types as uint16 bits); ``out`` is of it, or float32 (float64 for float64): float32 accumulation, float64
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
    place where ``normalize``; returns ``(D, state)``, ``state`` what :func:`project_grad` needs of
    the rows' norms (the float32 sums of squares ``[R, 1]``; the norms for float64; None without
    normalisation). float64 stays float64 throughout."""
    import cupy

    from .._cpu.hidden import normalize_rows

    D = cupy.empty((H.shape[0], W.shape[0]), H.dtype)
    fused_bias = normalize and dtype != "float64"  # added by the normalisation's two passes, in float32
    if bias is not None and not fused_bias:
        D[...] = bias  # added by the GEMM (beta = 1)
    gemm(H, W, D, dtype, tb=True, beta=1.0 if bias is not None and not fused_bias else 0.0, tf32=tf32)
    if not normalize:
        return D, None
    if dtype == "float64":
        return D, normalize_rows(D, eps)
    k = _kernels(dtype)
    b32 = cupy.zeros(1, cupy.float32) if bias is None else bias if dtype == "float32" else to_float32(bias, dtype)
    ss = k["sumsq"](D, b32, axis=1)[:, None]
    k["scale"](b32, ss, np.float32(eps), D)
    return D, ss


def project_grad(D, state, dD, keep, dtype: str, eps: float):
    """The gradient with respect to the unnormalised projection, written over ``dD`` (``[R, d]``, of
    ``D``'s element type) for 16-bit and float32 rows, from the normalised rows ``D`` and
    :func:`project`'s ``state`` (None: no normalisation); rows where ``keep`` ``[R, 1]`` is False are zero."""
    from .._cpu.hidden import normalize_grad

    if dtype == "float64":
        return normalize_grad(D, state, dD, keep, eps)
    k = _kernels(dtype)
    if state is None:  # dot 0, norm 1 and no floor: the gradient as it is, masked
        k["grad"](D, np.float32(0), np.float32(1), np.float32(0), keep, dD)
    else:
        k["grad"](D, k["dot"](D, dD, axis=1)[:, None], state, np.float32(eps), keep, dD)
    return dD


def row_sums(x, dtype: str):
    """float32 sums over the rows of ``x [R, d]`` (16-bit bits or float32 elements): ``[d]``."""
    return _kernels(dtype)["sum"](x, axis=0)


def to_float32(x, dtype: str):
    return _kernels(dtype)["to_f32"](x)


def from_float32(x, dtype: str):
    """float32 ``x`` in element type ``dtype`` (16-bit types as their uint16 bits)."""
    import cupy

    out = cupy.empty(x.shape, cupy.float32 if dtype == "float32" else cupy.uint16)
    _kernels(dtype)["from_f32"](x, out)
    return out
