"""The fused projection head's device arithmetic (``lik_cupy.fused_head``): cuBLAS GEMMs of
row-major device arrays (float16 and bfloat16 as their uint16 bits, float32, float64) with float32
accumulation, and the normalisation and its gradient by ``cuda_src/hidden.cu`` (one warp a row,
the 16-bit or float32 rows read and written once each). float64 rows take the NumPy-API arithmetic
of ``lik_cupy._cpu.hidden``."""

from __future__ import annotations

import functools
import threading

import numpy as np

from .raw_launch import float32_arg, launch_raw, signature

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
    """The CuPy conversion kernels of element type ``dtype`` ("float16", "bfloat16" or "float32")."""
    import cupy

    pre, tag = _CONVERT[dtype], dtype[:4]
    return {
        "to_f32": cupy.ElementwiseKernel("T x", "float32 y", "y = lik_f(x)", f"lik_hidden_to_f32_{tag}", preamble=pre),
        "from_f32": cupy.ElementwiseKernel("float32 x", "T y", "lik_set(y, x)", f"lik_hidden_from_f32_{tag}",
                                           preamble=pre),
    }


# The row kernels' parameters (raw_launch slots): arrays by address, then rows, dim and eps.
_PARAMS = {"lik_hidden_normalize": signature("pppqif"), "lik_hidden_normalize_grad": signature("ppppqif")}


def launch_rows(entry: str, dtype: str, device: int, rows: int, values: tuple, stream: int) -> None:
    """``cuda_src/hidden.cu``'s ``entry`` over ``rows`` rows of ``dtype`` on GPU ``device`` (the current
    one), one warp a row and eight a block, on the stream with handle ``stream``; ``values`` are the
    kernel's parameters, its arrays by address (0: null), then rows, dim and eps (any float: the
    kernel takes its float32). Launched by driver handle: CuPy's argument conversion was the larger
    part of the launch's host time, twice in a training step."""
    if rows:
        *given, eps = values
        launch_raw(_function(entry, dtype, device).ptr, (min(-(-rows // 8), 1 << 20), 1, 1), 256, 0, stream,
                   _PARAMS[entry], (*given, float32_arg(eps)))


def _here(entry: str, dtype: str, rows: int, arrays: tuple, scalars: tuple) -> None:
    """:func:`launch_rows` on the current device and CuPy stream; ``arrays`` CuPy arrays or None."""
    import cupy

    launch_rows(entry, dtype, cupy.cuda.runtime.getDevice(), rows,
                tuple(0 if a is None else a.data.ptr for a in arrays) + scalars, cupy.cuda.get_current_stream().ptr)


@functools.cache
def _function(entry: str, dtype: str, device: int):
    """``entry`` for ``dtype`` on ``device`` (called with it current), as CuPy's loaded function: its
    ``ptr`` is the driver's handle, and it holds its module, which the module cache may let go."""
    from .._base.device import device_properties
    from .._dispatch import arch_of, elem_spec
    from .kernels import HIDDEN
    from .nvrtc import get_module

    return get_module(HIDDEN.file, {"LIK_ELEM": elem_spec(dtype).code}, arch_of(device_properties(device).cc), device,
                      entry=entry).get_function(entry).kernel


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
    if k == 0:  # no products: beta * out, where out may be empty memory (NaN * 0 is NaN) and 16-bit outs are bits
        if beta == 0:
            out.fill(0)
        elif beta != 1:
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
    b32 = None if bias is None else bias if dtype == "float32" else to_float32(bias, dtype)
    rows, dim = D.shape
    ss = cupy.empty((rows, 1), cupy.float32)
    _here("lik_hidden_normalize", dtype, rows, (D, b32, ss), (rows, dim, eps))
    return D, ss


def project_grad(D, state, dD, keep, dtype: str, eps: float):
    """The gradient with respect to the unnormalised projection, written over ``dD`` (``[R, d]``, of
    ``D``'s element type) for 16-bit and float32 rows, from the normalised rows ``D`` and
    :func:`project`'s ``state`` (None: no normalisation); rows where ``keep`` ``[R, 1]`` is False are
    zero (None: every row counts)."""
    from .._cpu.hidden import normalize_grad

    if dtype == "float64":
        return normalize_grad(D, state, dD, keep, eps)
    rows, dim = dD.shape
    _here("lik_hidden_normalize_grad", dtype, rows, (D, dD, state, keep), (rows, dim, eps))
    return dD


def row_sums(x, out, dtype: str, beta: float = 0.0) -> None:
    """``out [d] = beta * out +`` the float32 sums over the rows of ``x [R, d]`` (16-bit bits or
    float32 elements; ``out`` float32, or of ``dtype``): a GEMM of a row of ones, deterministic,
    where a column reduction of CuPy's took 0.11 ms for 9,600 rows."""
    gemm(_ones(x.shape[0], dtype), x, out.reshape(1, -1), dtype, beta=beta)


_ONES = {"float16": 0x3C00, "bfloat16": 0x3F80}
# (device, dtype) -> every row of ones made, the longest last. Calls on other threads' streams read
# one with no wait on the stream that filled it, so it is filled before anyone sees it; and a shorter
# one is kept when a longer replaces it, as a GEMM queued on another stream may still read it (freed,
# the pool would hand it out again in the order of the stream that made it alone). Lengths double:
# they hold under twice the longest.
_ones_cache: dict = {}
_ones_lock = threading.Lock()


def _ones(n: int, dtype: str):
    """A row ``[1, n]`` of ones in element type ``dtype`` (bits for 16-bit types) on the current device,
    ready for any stream."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), dtype)
    rows = _ones_cache.get(key)
    if rows is None or rows[-1].shape[1] < n:
        with _ones_lock:
            rows = _ones_cache.get(key)
            if rows is None or rows[-1].shape[1] < n:
                size = 1 << max(10, (n - 1).bit_length())
                one = (cupy.full((1, size), _ONES[dtype], cupy.uint16) if dtype in _ONES
                       else cupy.ones((1, size), cupy.float32))
                cupy.cuda.get_current_stream().synchronize()
                rows = _ones_cache[key] = (*(rows or ()), one)
    return rows[-1][:, :n]


def to_float32(x, dtype: str):
    return _kernels(dtype)["to_f32"](x)


def from_float32(x, dtype: str):
    """float32 ``x`` in element type ``dtype`` (16-bit types as their uint16 bits)."""
    import cupy

    out = cupy.empty(x.shape, cupy.float32 if dtype == "float32" else cupy.uint16)
    _kernels(dtype)["from_f32"](x, out)
    return out
