"""MaxSim backward: exact gradients from the forward's argmax.

``maxsim_backward`` is validate (``validate.check_backward``), choose
(``dispatch.choose_backward``), launch (``lik_cupy._runtime.backward``), or the
NumPy path (``cpu.maxsim_backward_numpy``). The autograd adapters in
``lik_cupy.torch`` and ``lik_cupy.jax`` call it.
"""

from __future__ import annotations

import numpy as np

from . import _cpu as cpu
from . import _dispatch as dispatch
from . import _interop as interop
from ._base.device import allocating, device_properties
from ._dispatch.backend import check_backend, use_gpu
from ._dispatch.select import check_backward_method
from ._interop import GpuCall, host_array
from ._runtime.device_checks import capturing, strict
from ._runtime.backward import (THREADS, atomic_functions, doc_rows, grad_scores_f32, gradient_out, host_gradient_out,
                                launch_backward)
from ._runtime.kernels import BACKWARD_DTYPES
from ._runtime.operands import device_offsets, host_metadata, host_offsets, kernel_operands
from ._runtime.prepared_calls import PreparedBackward, call_key, lookup, store
from ._validate import Problem, check_argmax_values, check_backward, check_flag

__all__ = ["maxsim_backward"]


def maxsim_backward(grad_scores, Q, D, argmax, *, d_offsets=None, method="auto", validate=None, backend="auto"):
    """Gradients of ``maxsim`` (or ``maxsim_varlen``) with respect to Q and D.

    ``dQ[i, s] = sum_j g[i, j] * D_j[argmax[i, j, s]]`` and
    ``dD_j[t] = sum of g[i, j] * Q[i, s] over the (i, s) whose argmax in document j is t``:
    the similarity tensor is never rebuilt. Masks and lengths are not needed: the
    forward's argmax already marks masked query tokens and empty documents with -1.

    Args:
        grad_scores: float ``scores.shape`` (any float dtype; used as float32 on the GPU, as given on
            the CPU).
        Q, D: the forward's inputs (float16, bfloat16, float32 or float64 (float32 arithmetic on the GPU), as in
            :func:`lik_cupy.maxsim`): Q ``[Nq, Lq, d]`` or ``[Lq, d]``; D ``[Nd, Ld, d]``
            (every query against every document, the in-batch layout),
            ``[Nq, K, Ld, d]`` (a candidate set per query) or ``[Ld, d]``; or packed
            ``D [T, d]`` with ``d_offsets`` (int32/int64 ``[Nd + 1]``, as in ``maxsim_varlen``).
        argmax: the int32 argmax the forward returned (``return_argmax=True``).
        method: "atomic": one pass producing dQ and dD, dD accumulated with fp32
            atomics (fastest; dD's rounding can differ run to run). "csr": the argmax is
            inverted into a map sorted by (document token, i, j, s) and each row of dD
            is summed by one writer in that order: bitwise reproducible. "auto": the
            dispatch rule (``dispatch.choose_backward``). dQ is deterministic either way.
        validate: None (default): no host synchronisation; an argmax entry that is neither -1
            nor a token of its document makes that query token's dQ row NaN and adds nothing
            to dD. True (or ``LIK_VALIDATE=1``): check the argmax values first (one reduction
            and one host synchronisation) and raise a ValueError. A host-resident argmax (or
            offsets) is checked on the host and raises, unless False. False: no check on the GPU
            (the CPU path checks every call: NumPy's indexing would wrap a negative entry round).
        backend: "auto", "gpu" or "cpu" (NumPy, accumulating in float64 in blocks bounded in
            bytes: ``lik_cupy._cpu.backward``).

    Returns:
        ``(dQ, dD)`` shaped and typed like Q and D (fp32 accumulation inside on the GPU, float64
        on the CPU), in the caller's framework and on its device.
    Example::

        >>> import numpy as np, lik_cupy
        >>> Q = np.array([[[1, 0], [0, 1]]], np.float32)
        >>> D = np.array([[[2, 0], [0, 3]]], np.float32)
        >>> s, a = lik_cupy.maxsim(Q, D, return_argmax=True, backend="cpu")
        >>> dQ, dD = lik_cupy.maxsim_backward(np.ones_like(s), Q, D, a, backend="cpu")
        >>> dQ[0], dD[0]
        (array([[2., 0.],
               [0., 3.]], dtype=float32), array([[1., 0.],
               [0., 1.]], dtype=float32))
    """
    validate = check_flag("validate", validate, none=True)
    key = call_key("backward", (validate, method, backend), grad_scores, (Q, D, argmax, d_offsets), precision=False)
    call = lookup(key)
    if call is not None:
        return call(grad_scores, Q, D, argmax, d_offsets)
    check_backward_method(method)
    check_backend(backend)
    p = check_backward(grad_scores, Q, D, argmax, d_offsets)
    on_gpu = use_gpu(backend, p.device, float64=p.dtype == "float64", float64_gpu=True)
    q_shape, d_shape = interop.describe(Q).shape, interop.describe(D).shape
    if on_gpu:
        call = _prepared(key, p, method, q_shape, d_shape)
        if call is not None:
            return call(grad_scores, Q, D, argmax, d_offsets)
        return _gpu(p, grad_scores, Q, D, argmax, d_offsets, method, validate, q_shape, d_shape)
    return _cpu(p, grad_scores, Q, D, argmax, d_offsets, q_shape, d_shape)


# ---------------------------------------------------------------- CPU


def _cpu(p: Problem, g, Q, D, argmax, d_offsets, q_shape, d_shape):

    fw = p.framework
    g = interop.to_numpy(g, fw).reshape(p.nq, p.nd)
    q = interop.to_numpy(Q, fw).reshape(p.nq, p.lq, p.dim)
    d = interop.to_numpy(D, fw).reshape(doc_rows(p), p.dim)
    a = interop.to_numpy(argmax, fw).reshape(p.nq, p.nd, p.lq)
    if p.d_packed:
        off = host_offsets(host_array(d_offsets, fw), p.ntok, "d_offsets")
        start, limit = np.broadcast_to(off[:-1], (p.nq, p.nd)), np.diff(off)[None, :, None]
    else:
        base = np.arange(p.nd)[None, :] + (np.arange(p.nq)[:, None] * p.nd if p.candidates else 0)
        start, limit = np.broadcast_to(base * p.ld, (p.nq, p.nd)), p.ld
    check_argmax_values(int(a.min()) if a.size else 0, bool((a >= limit).any()), _limit_words(p))
    dq, dd = cpu.maxsim_backward_numpy(g, q, d, a, start)
    return host_gradient_out(dq, q.dtype, q_shape, p, Q), host_gradient_out(dd, d.dtype, d_shape, p, D)


def _limit_words(p: Problem) -> str:
    return "its d_offsets length" if p.d_packed else f"Ld = {p.ld}"


# ---------------------------------------------------------------- GPU


def _gpu(p: Problem, g, Q, D, argmax, d_offsets, method, validate, q_shape, d_shape):
    import cupy

    # host values raise (operands.host_metadata) unless the caller said validate=False
    validate = strict(validate) or (validate is not False and host_metadata(argmax, d_offsets))
    rows = doc_rows(p)
    esize = {"float64": 8, "float32": 4}.get(p.dtype, 2)
    staged = (p.nq * p.lq + rows) * p.dim * esize + p.nq * p.nd * (4 + 4 * p.lq)  # Q, D, grad_scores, argmax
    with GpuCall(p) as gpu:
        fw, on_host = gpu.framework, gpu.on_host
        with allocating("maxsim_backward: Q, D, grad_scores and argmax on the GPU", staged,
                        "pass them as device arrays (host arrays are copied over), or split the call"):
            q = gpu.array(Q).reshape(p.nq * p.lq, p.dim)
            d = gpu.array(D).reshape(rows, p.dim)
            gs = grad_scores_f32(g, fw, on_host, p)
            a = gpu.array(argmax).reshape(p.nq, p.nd, p.lq)
        q, d = kernel_operands(p.dtype, q, d)  # float64: the forward's float32 rounding; float64 gradients
        off = device_offsets(gpu.array(d_offsets), p.ntok, "d_offsets", validate, wide=True) if p.d_packed else None
        if validate and a.size and not capturing():  # no host read inside graph capture (device_checks.py)
            limit = (off[1:] - off[:-1])[None, :, None] if off is not None else p.ld
            lo, over = (int(v) for v in cupy.stack([a.min().astype(cupy.int64),
                                                   (a >= limit).any().astype(cupy.int64)]).get())
            check_argmax_values(lo, bool(over), _limit_words(p))
        dq, dd = launch_backward(p, q, d, gs, a, off, method, gpu.device)
        if p.dtype == "float64":
            dq, dd = dq.astype(cupy.float64), dd.astype(cupy.float64)
        return gradient_out(dq, q_shape, p, Q, fw, on_host), gradient_out(dd, d_shape, p, D, fw, on_host)


def _prepared(key, p: Problem, method: str, q_shape, d_shape):
    """The :class:`PreparedBackward` of a validated GPU call whose signature ``key`` can take the
    repeat path (device arrays of torch or CuPy, C-contiguous and 16-byte aligned, float32
    grad_scores, int64 offsets, the atomic method), made and stored; None otherwise."""
    if key is None:
        return None
    a = interop.REPEAT_CALLS[p.framework]
    if p.dtype not in BACKWARD_DTYPES or p.dtype not in a.NEW_DTYPES:  # (CuPy makes no bfloat16 arrays)
        return None
    sigs = key[2:]  # grad_scores, Q, D, argmax, d_offsets: (shape, dtype, device, aligned, contiguous)
    if any(s is not None and (s[2] < 0 or not s[3] or not s[4]) for s in sigs):
        return None
    off = sigs[4]
    if a.dtype_name(sigs[0][1]) != "float32" or (off is not None and a.dtype_name(off[1]) != "int64"):
        return None
    rows = doc_rows(p)
    if not (p.nq * p.lq and p.nd and p.dim and rows):
        return None
    cc = device_properties(p.device).cc
    if dispatch.choose_backward(method, cc, p.nq, p.nd, p.lq, rows, p.dim) != "atomic":
        return None
    dq, cast, dq_grid, cast_grid, module = atomic_functions(p, cc)
    call = PreparedBackward(p.framework, p, p.device, dq, cast, dq_grid, cast_grid, THREADS,
                            (p.nq, p.nd, p.lq, p.ld, p.dim, int(p.candidates), rows), (q_shape, d_shape), p.dtype,
                            module)
    store(key, call)
    return call
