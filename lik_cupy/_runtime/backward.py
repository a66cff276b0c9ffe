"""The backward kernels' launches (``cuda_src/maxsim_bwd.cu``): dQ, and dD by fp32 atomics or by
a sorted CSR map, for the device operands ``lik_cupy.maxsim_backward`` has checked and converted."""

from __future__ import annotations

import functools

import numpy as np

from .. import _dispatch as dispatch
from .. import _interop as interop
from .._base.device import allocating, device_properties, empty
from .._validate import Problem, check_32bit
from .kernels import BACKWARD
from .nvrtc import get_module

__all__ = ["THREADS", "doc_rows", "grids", "launch_backward", "atomic_functions"]

THREADS = 256  # per block, every backward kernel (their __launch_bounds__)


def doc_rows(p: Problem) -> int:
    """Rows of D a problem's argmax indexes: packed tokens, or padded documents' Ld rows each."""
    if p.d_packed:
        return p.ntok
    return (p.nq * p.nd if p.candidates else p.nd) * p.ld


def grids(p: Problem) -> tuple:
    """(dQ pass grid, cast grid) of a problem, and the 32-bit checks of their sizes."""
    rows, warps = doc_rows(p), THREADS // 32  # one warp per query token (dQ) or document row (CSR dD)
    check_32bit(Nq=p.nq, Nd=p.nd, Lq=p.lq, Ld=p.ld, **{"Nq * Lq / 8 blocks": -(-p.nq * p.lq // warps),
                                                        "document rows / 8 blocks": -(-rows // warps)})
    n = rows * p.dim
    return (-(-p.nq * p.lq // warps), -(-p.dim // 128), 1), (min(-(-n // THREADS), 65535 * 8), 1, 1)


def _module(p: Problem, cc: int, device: int, vec: bool):
    defines = {"LIK_ELEM": dispatch.elem_spec(dispatch.kernel_dtype(p.dtype)).code, "LIK_VEC": int(vec)}
    return get_module(BACKWARD.file, defines, dispatch.arch_of(cc), device, entry="lik_bwd_dq")


def launch_backward(p: Problem, q, d, gs, a, off, method: str, device: int):
    """Queue the backward of device operands on the current stream: ``q`` [nq * lq, dim] and ``d``
    [doc_rows, dim] in a kernel dtype (``kernel_operands``), ``gs`` float32 [nq, nd], ``a`` int32
    argmax [nq, nd, lq], ``off`` int64 offsets [nd + 1] of packed documents or None; ``method``
    as ``maxsim_backward`` takes it. Returns (dQ, dD) shaped and typed like ``q`` and ``d``."""
    import cupy

    rows = doc_rows(p)
    esize = q.dtype.itemsize
    warps = THREADS // 32  # one warp per query token (dQ) or document row (CSR dD)
    dq_grid, cast_grid = grids(p)
    if p.nq * p.nd * p.lq >= 2**62 // max(1, rows):
        raise ValueError("argmax entries x document rows exceed the CSR key range; split the call")

    cc = device_properties(device).cc
    how = dispatch.choose_backward(method, cc, p.nq, p.nd, p.lq, rows, p.dim)
    vec = p.dim % 4 == 0 and q.data.ptr % (4 * esize) == 0 and d.data.ptr % (4 * esize) == 0
    mod = _module(p, cc, device, vec)

    # float32 dD takes the atomics itself (the cast would copy it, bit for bit)
    direct = how == "atomic" and d.dtype == np.float32
    dq = _empty(q.shape, q.dtype, "dQ", "split the call over fewer queries")
    dd = _empty(d.shape, d.dtype, "dD", "split the call over fewer documents", zeros=direct)
    null = np.uint64(0)
    chunks = -(-p.dim // 128)
    common = (np.int32(p.nq), np.int32(p.nd), np.int32(p.lq))
    launch = functools.partial(_launch, mod, p)
    if p.nq * p.lq and p.nd and p.dim:
        dd32 = dd if direct else None
        if how == "atomic" and not direct:
            dd32 = _empty((rows, p.dim), np.float32, "the atomic method's fp32 dD",
                          "method='csr' needs no fp32 copy of dD; or split the call over fewer documents",
                          zeros=True)
        launch("lik_bwd_dq", dq_grid[:2],
               (q, d, gs, a, off if off is not None else null, dq, dd32 if dd32 is not None else null, *common,
                np.int32(p.ld), np.int32(p.dim), np.int32(p.candidates), np.int64(rows)))
        n = rows * p.dim
        if how == "atomic" and n and not direct:
            launch("lik_bwd_cast", cast_grid[:1], (dd32, dd, np.int64(n)))
        elif how == "csr" and rows:
            m = p.nq * p.nd * p.lq
            hint = "method='atomic' needs no key map; or split the call over fewer queries or documents"
            key = _empty((m,), np.int64, "the CSR method's keys", hint)
            launch("lik_bwd_keys", (min(-(-m // THREADS), 65535 * 8),),
                   (a, off if off is not None else null, key, *common, np.int32(p.ld), np.int32(p.candidates),
                    np.int64(rows)))
            with allocating("maxsim_backward: the CSR method's sort scratch and row starts",
                            key.nbytes + 16 * (rows + 1), hint):
                key.sort()  # unique keys: the order, and so the summation order, is fixed
                start = cupy.searchsorted(key, cupy.arange(rows + 1, dtype=cupy.int64) * m)
            launch("lik_bwd_dd_csr", (-(-rows // warps), chunks),
                   (q, gs, key, start, dd, *common, np.int32(p.dim), np.int64(rows)))
    else:  # nothing contributes
        dq.fill(0)
        dd.fill(0)
    return dq, dd


def atomic_functions(p: Problem, cc: int) -> tuple:
    """Driver handles of the atomic method's kernels (dQ with dD in fp32, then dD's cast) for the
    repeat-call path, their grids, and the module that owns them, which the caller keeps while it
    holds the handles (the compile cache may drop it, and its release unloads them): (dq, cast,
    dq_grid, cast_grid, module)."""
    import cupy

    dq_grid, cast_grid = grids(p)
    with cupy.cuda.Device(p.device):
        mod = _module(p, cc, p.device, p.dim % 4 == 0)
        dq, cast = (mod.get_function(k).kernel.ptr for k in ("lik_bwd_dq", "lik_bwd_cast"))
    return dq, cast, dq_grid, cast_grid, mod


def _empty(shape, dtype, what: str, hint: str, zeros: bool = False):
    return empty(shape, dtype, f"maxsim_backward: {what}", hint, zeros=zeros)


def _launch(mod, p: Problem, name: str, grid: tuple, args: tuple) -> None:
    """Launch ``name`` on the current stream; a launch error names the kernel and the call's shapes."""
    import cupy

    try:
        mod.get_function(name)(grid, (THREADS,), args)
    except cupy.cuda.driver.CUDADriverError as e:
        raise RuntimeError(f"{name} failed to launch (grid {grid}, block {THREADS}, Nq={p.nq}, Nd={p.nd}, "
                           f"Lq={p.lq}, Ld={p.ld}, rows={doc_rows(p)}, d={p.dim}): {e}") from e


def grad_scores_f32(g, fw: str, on_host: bool, p: Problem):
    """grad_scores as contiguous float32 [nq, nd] on the device (bfloat16 decoded from its bits,
    which is how bfloat16 crosses into CuPy)."""
    import cupy

    if on_host:
        return cupy.asarray(np.ascontiguousarray(interop.to_numpy(g, fw), dtype=np.float32).reshape(p.nq, p.nd))
    a = interop.to_cupy(g, fw)
    if interop.describe(g).dtype == "bfloat16":
        a = (a.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return cupy.ascontiguousarray(a.reshape(p.nq, p.nd), dtype=cupy.float32)


def gradient_out(x, shape, p: Problem, like, fw: str, on_host: bool):
    """A gradient in the caller's framework, dtype and shape (bfloat16 from its bits)."""
    x = x.reshape(shape)
    if p.dtype != "bfloat16":
        return interop.from_cupy(x, fw, on_host)
    return interop.bfloat16_from_bits(x, fw, on_host, like)


def host_gradient_out(x64: np.ndarray, dtype, shape, p: Problem, like):
    """A NumPy-computed gradient in the input's dtype, framework and device (device inputs
    sent to the CPU path get their results back on their device): rounded, beyond its range to inf,
    whatever the caller's ``np.seterr``."""
    with np.errstate(over="ignore", under="ignore"):
        out = x64.astype(dtype).reshape(shape)
    bf16 = interop.is_bfloat16(dtype)
    if p.device is not None:
        import cupy

        with cupy.cuda.Device(p.device):
            dev = cupy.asarray(out.view(np.uint16) if bf16 else out)
            return gradient_out(dev, shape, p, like, p.framework, on_host=False)
    return interop.from_numpy(out, p.framework)
