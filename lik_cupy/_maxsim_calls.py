"""The forward's engine: one ``maxsim``, ``maxsim_pairs`` or ``maxsim_varlen`` call (``lik_cupy.forward``
is their API) from its arguments to its results, and the zero-vector padding forms ``lik_cupy.torch``
calls for ``lik_cupy.integrations``.

Each call is validate (``lik_cupy._validate``), choose GPU or CPU (``lik_cupy._dispatch.backend``),
then launch (``lik_cupy._runtime.launch``) or the NumPy path (``lik_cupy._cpu``); a repeat call
runs its :class:`PreparedCall` (``lik_cupy._runtime.prepared_calls``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import _cpu as cpu
from ._dispatch import kernel_dtype
from ._dispatch.backend import check_backend, scoring_on_gpu
from ._dispatch.precision import fp32_accurate
from ._interop import GpuCall, describe, host_array, host_result
from ._runtime.device_checks import call_checks
from ._runtime.launch import launch, prepare, use_tma_for
from ._runtime.prepared_calls import PreparedCall, call_key, lookup, store
from ._runtime.operands import (device_offsets, host_metadata, device_valid, host_offsets, kernel_operands,
                                unpack_queries, valid_host)
from ._validate import Problem, check_call, check_flag, check_varlen, check_zero_pad


def maxsim_zero_pad(Q, D, zero_pad, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None,
                    return_argmax=False, backend="auto", precision=None, validate=None):
    """``lik_cupy.maxsim`` of documents with zero-vector padding, as PyLate's and colpali-engine's torch
    paths score them (for ``lik_cupy.integrations``).

    ``zero_pad``: bool ``D.shape[:-2]``, True for a document whose padding (the tokens past its
    ``d_lengths``, or masked out by ``d_mask``) is zero vectors that count as tokens: each query
    token's max over it is at least 0 (a NaN max stays NaN), and where 0 wins its argmax is -1 (no
    token, so the backward gives it no gradient). The padding is skipped, not read, so it need not
    hold zeros. ``"masked"`` (``lik_cupy._runtime.masks.MASKED``) flags every document with a
    masked token in ``d_mask`` (PyLate's masks); the GPU makes the flags while it reads the mask,
    with no kernel of their own. Other arguments as in ``lik_cupy.maxsim``; Q and D float16, bfloat16,
    float32 or float64.
    """
    return run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, pairs=False,
               zero_pad=zero_pad)


def maxsim_varlen_zero_pad(Q, D_tokens, d_offsets, zero_pad, q_mask=None, *, q_lengths=None, return_argmax=False,
                           backend="auto", precision=None, validate=None):
    """``lik_cupy.maxsim_varlen`` of documents with zero-vector padding (``zero_pad`` bool ``[Nd]``, as in
    :func:`maxsim_zero_pad`: the packed documents hold their real tokens only). Padded queries."""
    return run_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, None, return_argmax, backend, precision, validate,
                      zero_pad=zero_pad)


def varlen_key(Q, D_tokens, d_offsets, q_mask, q_lengths, return_argmax, backend, precision, validate, zero_pad=None):
    return call_key("varlen", (validate, return_argmax, backend, precision), Q,
                    (D_tokens, d_offsets, q_mask, q_lengths, zero_pad))


def maxsim_key(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, pairs=False,
               zero_pad=None):
    masked = isinstance(zero_pad, str)  # MASKED: a flag of the call, not an array
    flags = (validate, return_argmax, backend) + ((zero_pad,) if masked else ()) + (precision,)
    return call_key("pairs" if pairs else "maxsim", flags, Q,
                    (D, q_mask, d_mask, q_lengths, d_lengths, None if masked else zero_pad))


def prepared_call(fn: str, Q, D=None, D_tokens=None, d_offsets=None, q_mask=None, d_mask=None, q_lengths=None,
                   d_lengths=None, return_argmax=False, backend="auto", precision=None, validate=None):
    """The :class:`PreparedCall` that a repeat of ``lik_cupy.<fn>`` ("maxsim" or "maxsim_varlen")
    with these arguments would run, if one is kept (``lik_cupy.jax`` rebinds it to XLA's buffers)."""
    if fn == "maxsim_varlen":
        return lookup(varlen_key(Q, D_tokens, d_offsets, q_mask, q_lengths, return_argmax, backend, precision,
                                  validate))
    return lookup(maxsim_key(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate))


def run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, *, pairs,
         zero_pad=None):
    return_argmax, validate = check_flag("return_argmax", return_argmax), check_flag("validate", validate, none=True)
    key = maxsim_key(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, pairs,
                      zero_pad)
    call = lookup(key)
    if call is not None:
        return call(Q, D, q_mask, d_mask, q_lengths, d_lengths, None, zero_pad)
    check_backend(backend)
    p = check_call(Q, D, q_mask, d_mask, q_lengths, d_lengths, pairs=pairs)
    if zero_pad is not None:
        check_zero_pad(zero_pad, p, describe(D).shape[:-2], d_mask)
    x3 = fp32_accurate(precision, p.framework, p.dtype)
    if scoring_on_gpu(p, backend, float64_gpu=True):
        call = _prepared(key, p, return_argmax, validate, x3, (q_lengths, d_lengths, None), packed=False)
        if call is not None:
            return call(Q, D, q_mask, d_mask, q_lengths, d_lengths, None, zero_pad)
        scores, amax = _gpu(p, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, validate, x3, zero_pad)
    else:
        scores, amax = _cpu(p, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, zero_pad)
    return (scores, amax) if return_argmax else scores


def run_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, q_offsets, return_argmax, backend, precision, validate,
                zero_pad=None):
    return_argmax, validate = check_flag("return_argmax", return_argmax), check_flag("validate", validate, none=True)
    key = varlen_key(Q, D_tokens, d_offsets, q_mask, q_lengths, return_argmax, backend, precision, validate,
                      zero_pad) if q_offsets is None else None
    call = lookup(key)
    if call is not None:
        return call(Q, D_tokens, q_mask, None, q_lengths, None, d_offsets, zero_pad)
    check_backend(backend)
    p = check_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, q_offsets)
    if zero_pad is not None:
        check_zero_pad(zero_pad, p, (p.nd,))
    x3 = fp32_accurate(precision, p.framework, p.dtype)
    if scoring_on_gpu(p, backend, float64_gpu=True):
        call = _prepared(key, p, return_argmax, validate, x3, (q_lengths, None, d_offsets), packed=True)
        if call is not None:
            return call(Q, D_tokens, q_mask, None, q_lengths, None, d_offsets, zero_pad)
        scores, amax = _gpu_varlen(p, Q, D_tokens, d_offsets, q_mask, q_lengths, q_offsets, return_argmax,
                                   validate, x3, zero_pad)
    else:
        scores, amax = _cpu_varlen(p, Q, D_tokens, d_offsets, q_mask, q_lengths, q_offsets, return_argmax, zero_pad)
    return (scores, amax) if return_argmax else scores


def _prepared(key, p: Problem, return_argmax: bool, validate, x3: bool, metadata: tuple, *, packed: bool):
    """The :class:`PreparedCall` of a validated GPU call whose signature ``key`` can take the repeat
    path (``lik_cupy._runtime.prepared_calls``), made and stored; None where the call needs the
    general path. ``metadata``: its (q_lengths, d_lengths, d_offsets)."""
    if key is None or p.dtype not in ("float16", "bfloat16", "float32") or not (p.nq and p.nd and p.lq) \
            or not (p.ntok if packed else p.ld):
        return None
    # every array on the device (not -1, torch's CPU) and C-contiguous (signature: shape, dtype,
    # device, aligned, contiguous)
    if any(isinstance(s, tuple) and (s[2] < 0 or not s[4]) for s in key[2:]):
        return None
    import cupy

    q_len, d_len, d_off = metadata
    wide = tuple(x is not None and x.dtype.itemsize == 8 for x in (q_len, d_len, d_off))
    # (unsigned ones too: the general path narrows them to int32, which uint64 lengths, read as
    # they are, would not match)
    if any(x is not None and (x.dtype.itemsize not in (4, 8) or "uint" in str(x.dtype)) for x in metadata):
        return None
    esize = 2 if p.dtype != "float32" else 4
    aligned = key[2][3] and key[3][3]  # Q's and D's 16-byte alignment
    vec = (p.dim * esize) % 16 == 0 and aligned
    rows = p.ntok if packed else (p.nq * p.nd if p.candidates else p.nd) * p.ld
    with cupy.cuda.Device(p.device):
        fwd = prepare(p, p.device, esize=esize, vec=vec, use_tma=use_tma_for(p, vec, rows), argmax=return_argmax,
                      packed=packed, off_wide=wide[2], ld_hint=-(-p.ntok // p.nd) if packed else None, x3=x3)
    caller = {"maxsim": "maxsim", "pairs": "maxsim_pairs", "varlen": "maxsim_varlen"}[key[0]]
    call = PreparedCall(p.framework, p, p.device, fwd, return_argmax, wide, mark=validate is not False, caller=caller)
    store(key, call)
    return call


# ---------------------------------------------------------------- CPU


def _cpu(p: Problem, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, zero_pad=None):
    fw = p.framework
    q = host_array(Q, fw).reshape(p.nq, p.lq, p.dim)
    nrows = p.nq * p.nd if p.candidates else p.nd
    d = host_array(D, fw).reshape(nrows, p.ld, p.dim)
    qv = valid_host(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw)
    dv = valid_host(d_mask, d_lengths, nrows, p.ld, "d_lengths", fw)
    zp = None if zero_pad is None else ~dv.all(axis=1) if isinstance(zero_pad, str) else \
        host_array(zero_pad, fw).reshape(nrows)
    s, a = cpu.maxsim_numpy(q, d, qv, dv, candidates=p.candidates, nd=p.nd, return_argmax=return_argmax, zero_pad=zp)
    s = s.reshape(p.scores_shape)
    a = a.reshape(p.argmax_shape) if a is not None else None
    return host_result(s, p), (host_result(a, p) if a is not None else None)


def _cpu_varlen(p: Problem, Q, D, d_offsets, q_mask, q_lengths, q_offsets, return_argmax, zero_pad=None):
    fw = p.framework
    d = host_array(D, fw).reshape(p.ntok, p.dim)
    doff = host_offsets(host_array(d_offsets, fw), p.ntok, "d_offsets")
    zp = None if zero_pad is None else host_array(zero_pad, fw).reshape(p.nd)
    if q_offsets is None:
        q = host_array(Q, fw).reshape(p.nq, p.lq, p.dim)
        qv = valid_host(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw)
        s, a = cpu.maxsim_packed_numpy(q, qv, d, doff, return_argmax=return_argmax, zero_pad=zp)
    else:
        qt = host_array(Q, fw).reshape(-1, p.dim)
        qoff = host_offsets(host_array(q_offsets, fw), qt.shape[0], "q_offsets")
        p = _packed_queries(p, qoff)

        def group(rows):
            q, qv = cpu.unpack(qt, qoff, rows)
            return cpu.maxsim_packed_numpy(q, qv, d, doff, return_argmax=return_argmax, zero_pad=zp)

        s, a = _by_groups(p, qoff, qt.itemsize, group, np.float64 if p.dtype == "float64" else np.float32,
                          return_argmax, np)
    s = s.reshape(p.scores_shape)
    a = a.reshape(p.argmax_shape) if a is not None else None
    return host_result(s, p), (host_result(a, p) if a is not None else None)


# ---------------------------------------------------------------- GPU


def _gpu(p: Problem, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, validate, x3: bool, zero_pad=None):
    with call_checks(True if validate is not False and host_metadata(q_lengths, d_lengths) else validate) as checks:
        with GpuCall(p) as g:
            q, d = kernel_operands(p.dtype, g.array(Q), g.array(D))
            nrows = p.nq * p.nd if p.candidates else p.nd
            qm, ql = device_valid(q_mask, q_lengths, p.nq, p.lq, "q_lengths", g.framework, g.on_host, checks)
            dm, dl = device_valid(d_mask, d_lengths, nrows, p.ld, "d_lengths", g.framework, g.on_host, checks)
            zp = _device_zero_pad(zero_pad, nrows, g)
            kp = replace(p, dtype=kernel_dtype(p.dtype))
            scores, amax = launch(kp, q, d, qm, dm, ql, dl, return_argmax, g.device, x3=x3, zero_pad=zp)
            checks.apply(p, scores, amax, g.device)
            results = g.results(p, scores.astype("float64") if p.dtype == "float64" else scores, amax)
        checks.verify()  # last, while the scoring kernel runs (lik_cupy._runtime.device_checks)
    return results


def _gpu_varlen(p: Problem, Q, D, d_offsets, q_mask, q_lengths, q_offsets, return_argmax, validate, x3: bool,
                zero_pad=None):
    with call_checks(True if validate is not False and host_metadata(q_lengths, d_offsets) else validate) as checks:
        with GpuCall(p) as g:
            q, d = kernel_operands(p.dtype, g.array(Q), g.array(D).reshape(p.ntok, p.dim))
            doff = device_offsets(g.array(d_offsets), p.ntok, "d_offsets", True, checks)
            kw = {"d_off": doff, "ld_hint": -(-p.ntok // max(1, p.nd)), "x3": x3,
                  "zero_pad": _device_zero_pad(zero_pad, p.nd, g)}
            kp = replace(p, dtype=kernel_dtype(p.dtype))
            if q_offsets is None:
                q = q.reshape(p.nq, p.lq, p.dim)
                qm, ql = device_valid(q_mask, q_lengths, p.nq, p.lq, "q_lengths", g.framework, g.on_host, checks)
                scores, amax = launch(kp, q, d, qm, None, ql, None, return_argmax, g.device, **kw)
            else:
                import cupy

                qt = q.reshape(-1, p.dim)
                qoff = host_offsets(host_array(q_offsets, g.framework), qt.shape[0], "q_offsets")
                p = _packed_queries(p, qoff)

                def group(rows):  # one launch of the group's queries as one padded call
                    qg, ql = unpack_queries(qt, qoff, rows)
                    n, lq = qg.shape[:2]
                    gp = replace(kp, nq=n, lq=lq, scores_shape=(n, p.nd), argmax_shape=(n, p.nd, lq))
                    return launch(gp, qg, d, None, None, ql, None, return_argmax, g.device, **kw)

                scores, amax = _by_groups(p, qoff, qt.itemsize, group, np.float32, return_argmax, cupy)
            checks.apply(p, scores, amax, g.device)
            results = g.results(p, scores.astype("float64") if p.dtype == "float64" else scores, amax)
        checks.verify()  # last, while the scoring kernel runs (lik_cupy._runtime.device_checks)
    return results


def _packed_queries(p: Problem, q_offsets) -> Problem:
    """The problem of packed queries (checked int64 host ``q_offsets``): argmax padded to the longest."""
    lq = int(np.diff(q_offsets).max()) if p.nq else 0
    return replace(p, lq=lq, argmax_shape=p.scores_shape + (lq,))


def _by_groups(p: Problem, q_offsets, itemsize: int, score, dtype, return_argmax: bool, xp):
    """Scores ``[Nq, Nd]`` and argmax (or None) of packed queries (``q_offsets``, checked int64 on the host;
    ``itemsize`` bytes an element), scored a group at a time (``cpu.query_groups``), each group padded to
    its own longest query: ``score(rows)`` gives a group's results (``rows`` None: every query, in the
    caller's order, one padded call as ever), scattered back here into the queries' order in ``xp``
    (NumPy or CuPy), argmax -1 past the group's width. A query's results are its own whatever its group
    on the NumPy path (``lik_cupy._cpu.maxsim``)."""
    groups = cpu.query_groups(np.diff(q_offsets), itemsize * p.dim)
    if len(groups) == 1:
        return score(None)
    s = xp.empty((p.nq, p.nd), dtype)
    a = xp.full(p.argmax_shape, -1, np.int32) if return_argmax else None
    for rows in groups:
        sg, ag = score(rows)
        at = xp.asarray(rows)
        s[at] = sg
        if a is not None:
            a[at, :, :ag.shape[2]] = ag
    return s, a


def _device_zero_pad(zero_pad, rows: int, g: GpuCall):
    """The zero-vector padding flags as the kernels read them: contiguous uint8 [rows], None, or
    ``"masked"`` (``launch`` makes them with the mask's spans)."""
    if zero_pad is None or isinstance(zero_pad, str):
        return zero_pad
    import cupy

    return cupy.ascontiguousarray(g.array(zero_pad).reshape(rows)).view(cupy.uint8)
