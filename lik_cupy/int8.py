"""INT8 MaxSim: ``maxsim_int8`` and ``maxsim_int8_varlen``.

Documents quantised per token (:func:`lik_cupy.quantize_int8`: int8 values and one
float32 scale per token) are scored on INT8 tensor cores. Each integer dot product
is multiplied by its document token's scale before the running max, and each query
token's scale multiplies the max (deferred dequantisation): no dequantised copy of
D exists, in HBM or in shared memory. A float Q is quantised on the device first, the
same way. The result equals MaxSim of the dequantised inputs up to float32 rounding.

Each call is validate (``validate.check_call`` / ``check_varlen`` with ``int8=True``,
then ``check_int8_scales``), choose and launch (``lik_cupy._runtime.launch``, which picks the
INT8 kernel from ``dispatch``), or the NumPy path (``cpu.maxsim_numpy`` with scales).
"""

from __future__ import annotations

import numpy as np

from . import _cpu as cpu
from . import _interop as interop
from ._cpu import quantize_numpy
from ._dispatch.backend import check_backend, scoring_on_gpu
from ._interop import GpuCall, host_array, host_result
from ._runtime.device_checks import call_checks
from ._runtime.launch import launch
from ._runtime.operands import (check_scales_of_valid, device_offsets, device_valid, host_metadata, host_offsets,
                                valid_host)
from ._validate import Problem, check_call, check_int8_scales, check_varlen

__all__ = ["maxsim_int8", "maxsim_int8_varlen"]


def maxsim_int8(Q, D, d_scales, q_mask=None, d_mask=None, *, q_scales=None, q_lengths=None, d_lengths=None,
                return_argmax=False, backend="auto", validate=None):
    """MaxSim of queries against INT8 documents, on INT8 tensor cores.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]``: float16, bfloat16 or float32 (quantised per token
            on the fly), or int8 with ``q_scales``. A float64 Q is quantised on the CPU path only
            (``backend="auto"`` with host arrays, or ``"cpu"``; the GPU refuses it with a TypeError).
        D: int8 ``[Nd, Ld, d]`` (shared by all queries -> ``[Nq, Nd]``), ``[Nq, K, Ld, d]``
            (a candidate set per query -> ``[Nq, K]``) or ``[Ld, d]`` (-> ``[Nq]``), as made by
            :func:`lik_cupy.quantize_int8`. On the GPU, d must be a multiple of 16, at most 4096.
        d_scales: float32 ``D.shape[:-1]``: each document token's scale.
        q_mask, d_mask, q_lengths, d_lengths: valid tokens, as in :func:`lik_cupy.maxsim`.
        q_scales: float32 ``Q.shape[:-1]`` for an int8 Q. They multiply each row's max, so
            they must be non-negative (as ``quantize_int8`` makes them): a negative or NaN
            scale makes its query's scores NaN (checked in the kernel, with no host sync).
        return_argmax: also return int32 ``scores.shape + (Lq,)``, as in :func:`lik_cupy.maxsim`.
            The max is taken over the document-scaled dot products (float32); the query
            token's scale comes after it, so a zero-scale query token keeps the token of its
            largest unscaled product rather than token 0.
        backend: "auto", "gpu" or "cpu" (the same arithmetic in NumPy).
        validate: device lengths, offsets and document scales, as in :func:`lik_cupy.maxsim`: by
            default a negative, NaN or infinite device document scale of a valid token makes its
            document's scores NaN, with no host sync; ``True`` raises for invalid lengths and offsets
            instead. Host (NumPy) document scales are checked on the host and raise.

    Returns:
        float32 scores (and the argmax) in the caller's framework and device, with the
        semantics of :func:`lik_cupy.maxsim` (-inf for an empty document, 0 for a query with
        no valid token, NaN where a query token held NaN or inf).
    Example::

        >>> import numpy as np, lik_cupy
        >>> rng = np.random.default_rng(0)
        >>> Q, D = rng.standard_normal((2, 8, 64), np.float32), rng.standard_normal((5, 16, 64), np.float32)
        >>> D8, scales = lik_cupy.quantize_int8(D, backend="cpu")
        >>> s = lik_cupy.maxsim_int8(Q, D8, scales, backend="cpu")
        >>> exact = lik_cupy.maxsim(Q, D, backend="cpu")
        >>> bool(np.abs(s - exact).max() < 0.05 * np.abs(exact).max())
        True
    """
    check_backend(backend)
    p = check_call(Q, D, q_mask, d_mask, q_lengths, d_lengths, pairs=False, int8=True)
    q_int8 = check_int8_scales(p, Q, D, q_scales, d_scales)
    s, a = _score(p, Q, q_scales, q_int8, q_mask, q_lengths, D, d_scales, d_mask, d_lengths, None, validate,
                  return_argmax, backend)
    return (s, a) if return_argmax else s


def maxsim_int8_varlen(Q, D_tokens, d_scales, d_offsets, q_mask=None, *, q_scales=None, q_lengths=None,
                       return_argmax=False, validate_offsets=True, backend="auto", validate=None):
    """:func:`maxsim_int8` against packed (ragged) INT8 documents.

    Args:
        Q: padded ``[Nq, Lq, d]`` or ``[Lq, d]``, float or int8 (with ``q_scales``), with
            ``q_mask`` / ``q_lengths`` as in :func:`lik_cupy.maxsim`.
        D_tokens: int8 ``[T, d]``, the documents' tokens back to back.
        d_scales: float32 ``[T]``, each token's scale.
        d_offsets: int32 or int64 ``[Nd + 1]`` as in :func:`lik_cupy.maxsim_varlen`.
        validate_offsets, return_argmax, backend, validate: as in :func:`lik_cupy.maxsim_varlen`
            (document scales as in :func:`maxsim_int8`).

    Returns:
        float32 ``[Nq, Nd]`` (``[Nd]`` for a 2-D Q), and the int32 argmax ``[Nq, Nd, Lq]``
        if asked, in the caller's framework and device.
    """
    check_backend(backend)
    p = check_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, None, int8=True)
    q_int8 = check_int8_scales(p, Q, D_tokens, q_scales, d_scales)
    validate = False if validate_offsets is False and validate is None else validate
    s, a = _score(p, Q, q_scales, q_int8, q_mask, q_lengths, D_tokens, d_scales, None, None, d_offsets,
                  validate, return_argmax, backend)
    return (s, a) if return_argmax else s


def _score(p: Problem, Q, q_scales, q_int8: bool, q_mask, q_lengths, D, d_scales, d_mask, d_lengths, d_offsets,
           validate, return_argmax: bool, backend: str):
    """Scores and argmax (or None) of a validated call; documents padded, or packed when ``p.d_packed``."""
    fw = p.framework
    nrows = p.ntok if p.d_packed else p.nq * p.nd if p.candidates else p.nd
    on_cpu = not scoring_on_gpu(p, backend, float64=not q_int8 and interop.describe(Q).dtype == "float64")
    if on_cpu or p.device is None:  # host values are checked on the host and raise, whatever the path
        ds = np.asarray(host_array(d_scales, fw), np.float32)
        if p.d_packed:
            doff = host_offsets(host_array(d_offsets, fw), p.ntok, "d_offsets")  # every token is then a document's
            check_scales_of_valid(ds.reshape(p.ntok), None, "d_scales")
        else:
            dv = valid_host(d_mask, d_lengths, nrows, p.ld, "d_lengths", fw)
            check_scales_of_valid(ds.reshape(nrows, p.ld), dv, "d_scales")
    if on_cpu:
        q, qs = _host_queries(p, Q, q_scales, q_int8)
        qv = valid_host(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw)
        if p.d_packed:
            s, a = cpu.maxsim_packed_numpy(q, qv, host_array(D, fw).reshape(p.ntok, p.dim), doff,
                                           return_argmax=return_argmax, q_scale=qs, d_scale=ds.reshape(p.ntok))
        else:
            s, a = cpu.maxsim_numpy(q, host_array(D, fw).reshape(nrows, p.ld, p.dim), qv, dv, candidates=p.candidates,
                                    nd=p.nd, return_argmax=return_argmax, q_scale=qs, d_scale=ds.reshape(nrows, p.ld))
        return host_result(s.reshape(p.scores_shape), p), (
            host_result(a.reshape(p.argmax_shape), p) if a is not None else None)

    import cupy

    with call_checks(True if validate is not False and host_metadata(q_lengths, d_lengths, d_offsets) else validate) as checks:
        with GpuCall(p) as g:
            q, qs = _device_queries(p, Q, q_scales, q_int8, g)
            d = g.array(D)
            ds = cupy.ascontiguousarray(g.array(d_scales).reshape(-1), dtype=cupy.float32)
            qm, ql = device_valid(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw, g.on_host, checks)
            if p.d_packed:
                doff = device_offsets(g.array(d_offsets), p.ntok, "d_offsets", True, checks)
                checks.scales(ds)
                scores, amax = launch(p, q, d.reshape(p.ntok, p.dim), qm, None, ql, None, return_argmax, g.device,
                                       d_off=doff, ld_hint=-(-p.ntok // max(1, p.nd)), q_scale=qs, d_scale=ds)
            else:
                dm, dl = device_valid(d_mask, d_lengths, nrows, p.ld, "d_lengths", fw, g.on_host, checks)
                checks.scales(ds, dm)
                scores, amax = launch(p, q, d, qm, dm, ql, dl, return_argmax, g.device, q_scale=qs, d_scale=ds)
            checks.apply(p, scores, amax, g.device)
            results = g.results(p, scores, amax)
        checks.verify()  # last, while the scoring kernel runs (device_checks.py)
    return results


def _device_queries(p: Problem, Q, q_scales, q_int8: bool, g: GpuCall):
    """int8 queries [nq, lq, dim] and their float32 scales [nq * lq] on the device."""
    import cupy

    q = g.array(Q)
    if q_int8:
        return q, cupy.ascontiguousarray(g.array(q_scales).reshape(-1), dtype=cupy.float32)
    dtype = interop.describe(Q).dtype
    if dtype == "bfloat16":
        q = q.view(cupy.uint16)
    from ._runtime.quantize import quantize_cupy

    q8, qs = quantize_cupy(q, dtype)
    return q8, qs.reshape(-1)


def _host_queries(p: Problem, Q, q_scales, q_int8: bool):
    """int8 queries [nq, lq, dim] and float32 scales [nq, lq] on the host."""
    q = host_array(Q, p.framework).reshape(p.nq, p.lq, p.dim)
    if not q_int8:
        return quantize_numpy(q, strict=False)  # NaN/inf tokens: scale NaN, as on the device
    return q, np.asarray(host_array(q_scales, p.framework), np.float32).reshape(p.nq, p.lq)
