"""Scoring of the scaled element types (INT8, FP8): one call from its arguments to its results.

``lik_cupy.int8`` and ``lik_cupy.fp8`` are its APIs. :func:`run` and :func:`run_varlen` validate
(``check_call`` / ``check_varlen`` with ``scaled=``, then ``check_scaled_scales``) and call
:func:`score`, which reads everything that depends on the element type from its row
(``lik_cupy._dispatch.elements``): the quantiser of a float Q, the NumPy type of the CPU path, the
oldest GPU it runs on. Scales of one per tensor (shape ``[]``) are broadcast to one per token here,
so the kernels see per-token scales only.
"""

from __future__ import annotations

import numpy as np

from . import _cpu as cpu
from . import _interop as interop
from ._dispatch import ElemSpec, elem_spec
from ._dispatch.backend import check_backend, check_gpu_arch, scoring_on_gpu
from ._interop import GpuCall, host_array, host_result
from ._runtime.device_checks import call_checks
from ._runtime.launch import launch
from ._runtime.operands import (check_scales_of_valid, device_offsets, device_valid, host_metadata, host_offsets,
                                valid_host)
from ._validate import Problem, check_call, check_flag, check_scaled_scales, check_varlen

__all__ = ["run", "run_varlen", "score"]


def run(dtype: str, Q, D, d_scales, q_mask, d_mask, q_scales, q_lengths, d_lengths, return_argmax: bool, backend,
        validate):
    """``maxsim_int8`` / ``maxsim_fp8`` (``dtype`` its element type) of padded documents or candidate
    sets: validated, then scored (FP8 arrays as the bytes the kernels read)."""
    check_backend(backend)
    return_argmax, validate = check_flag("return_argmax", return_argmax), check_flag("validate", validate, none=True)
    Q, D = _as_read(dtype, Q, "Q"), _as_read(dtype, D, "D")
    p = check_call(Q, D, q_mask, d_mask, q_lengths, d_lengths, pairs=False, scaled=dtype)
    quantised = check_scaled_scales(p, Q, D, q_scales, d_scales)
    s, a = score(p, Q, q_scales, quantised, q_mask, q_lengths, D, d_scales, d_mask, d_lengths, None, validate,
                 return_argmax, backend)
    return (s, a) if return_argmax else s


def run_varlen(dtype: str, Q, D_tokens, d_scales, d_offsets, q_mask, q_scales, q_lengths, return_argmax: bool,
               validate_offsets, backend, validate):
    """``maxsim_int8_varlen`` / ``maxsim_fp8_varlen``: :func:`run` of packed documents."""
    check_backend(backend)
    return_argmax, validate = check_flag("return_argmax", return_argmax), check_flag("validate", validate, none=True)
    Q, D_tokens = _as_read(dtype, Q, "Q"), _as_read(dtype, D_tokens, "D_tokens")
    p = check_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, None, scaled=dtype)
    quantised = check_scaled_scales(p, Q, D_tokens, q_scales, d_scales)
    validate = False if not check_flag("validate_offsets", validate_offsets) and validate is None else validate
    s, a = score(p, Q, q_scales, quantised, q_mask, q_lengths, D_tokens, d_scales, None, None, d_offsets,
                 validate, return_argmax, backend)
    return (s, a) if return_argmax else s


def _as_read(dtype: str, x, name: str):
    """An argument of a ``dtype`` call as the kernels read it: FP8 arrays as their bytes (``float8_bits``)."""
    return interop.float8_bits(x, name) if dtype in interop.FLOAT8_DTYPES else x


def score(p: Problem, Q, q_scales, q_quantised: bool, q_mask, q_lengths, D, d_scales, d_mask, d_lengths, d_offsets,
          validate, return_argmax: bool, backend: str):
    """Scores and argmax (or None) of a validated call of element type ``p.dtype``; documents padded, or
    packed when ``p.d_packed``. Q and D arrive as the kernels read them (``ElemSpec.numpy_dtype``)."""
    spec = elem_spec(p.dtype)
    fw = p.framework
    nrows = p.ntok if p.d_packed else p.nq * p.nd if p.candidates else p.nd
    on_cpu = not scoring_on_gpu(p, backend, float64=not q_quantised and interop.describe(Q).dtype == "float64")
    if on_cpu or p.device is None:  # host values are checked on the host and raise, whatever the path
        given = host_array(d_scales, fw)
        ds = _host_scales(given, nrows * (1 if p.d_packed else p.ld))
        if p.d_packed:
            doff = host_offsets(host_array(d_offsets, fw), p.ntok, "d_offsets")  # every token is then a document's
            check_scales_of_valid(ds.reshape(p.ntok), None, "d_scales", given.shape)
        else:
            dv = valid_host(d_mask, d_lengths, nrows, p.ld, "d_lengths", fw)
            # (named as passed: candidate sets [Nq, K, Ld], one document's [Ld] or one for all [])
            check_scales_of_valid(ds.reshape(nrows, p.ld), dv, "d_scales", given.shape)
    if on_cpu:
        q, qs = _host_queries(p, spec, Q, q_scales, q_quantised)
        qv = valid_host(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw)
        d = _host_elements(host_array(D, fw), spec)
        if p.d_packed:
            s, a = cpu.maxsim_packed_numpy(q, qv, d.reshape(p.ntok, p.dim), doff, return_argmax=return_argmax,
                                           q_scale=qs, d_scale=ds.reshape(p.ntok))
        else:
            s, a = cpu.maxsim_numpy(q, d.reshape(nrows, p.ld, p.dim), qv, dv, candidates=p.candidates, nd=p.nd,
                                    return_argmax=return_argmax, q_scale=qs, d_scale=ds.reshape(nrows, p.ld))
        return host_result(s.reshape(p.scores_shape), p), (
            host_result(a.reshape(p.argmax_shape), p) if a is not None else None)

    g = GpuCall(p)
    check_gpu_arch(spec.name, g.device)
    with call_checks(True if validate is not False and host_metadata(q_lengths, d_lengths, d_offsets) else validate) as checks:
        with g:
            q, qs = _device_queries(p, spec, Q, q_scales, q_quantised, g)
            d = g.array(D)
            ds = _device_scales(g.array(d_scales), nrows * (1 if p.d_packed else p.ld))
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


def _host_scales(s, tokens: int) -> np.ndarray:
    """float32 scales, one per token: per-token ones as given, one per tensor (``[]``) broadcast."""
    s = np.asarray(s, np.float32)
    return np.full(tokens, s, np.float32) if s.ndim == 0 else s


def _device_scales(s, tokens: int):
    """Contiguous float32 device scales [tokens], one per tensor (``[]``) broadcast."""
    import cupy

    s = s.astype(cupy.float32, copy=False)
    return cupy.ascontiguousarray(s.reshape(-1) if s.ndim else cupy.broadcast_to(s, (tokens,)))


def _host_elements(x: np.ndarray, spec: ElemSpec) -> np.ndarray:
    """Quantised host elements as the NumPy path computes with them: FP8's uint8 bits as ml_dtypes float8."""
    import ml_dtypes  # noqa: F401  (registers the float8 dtype names with NumPy)

    return x.view(np.dtype(spec.name))


def _device_queries(p: Problem, spec: ElemSpec, Q, q_scales, q_quantised: bool, g: GpuCall):
    """Quantised queries [nq, lq, dim] and their float32 scales [nq * lq] on the device."""
    import cupy

    q = g.array(Q)
    if q_quantised:
        return q, _device_scales(g.array(q_scales), p.nq * p.lq)
    dtype = interop.describe(Q).dtype
    if dtype == "bfloat16":
        q = q.view(cupy.uint16)
    from ._runtime.quantize import quantize_cupy

    qq, qs = quantize_cupy(q, dtype, to=spec.name)
    return qq, qs.reshape(-1)


def _host_queries(p: Problem, spec: ElemSpec, Q, q_scales, q_quantised: bool):
    """Quantised queries [nq, lq, dim] (the NumPy path's type) and float32 scales [nq, lq] on the host."""
    q = host_array(Q, p.framework).reshape(p.nq, p.lq, p.dim)
    if not q_quantised:  # NaN/inf tokens: scale NaN, as on the device
        q, qs = getattr(cpu, spec.quantiser)(q, strict=False)
    else:
        qs = _host_scales(host_array(q_scales, p.framework), p.nq * p.lq)
    return _host_elements(q, spec), np.asarray(qs, np.float32).reshape(p.nq, p.lq)
