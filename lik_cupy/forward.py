"""MaxSim forward: ``maxsim``, ``maxsim_pairs`` and ``maxsim_varlen``.

Each call is validate (``lik_cupy._validate``), choose GPU or CPU (``lik_cupy._dispatch.backend``),
then launch (``lik_cupy._runtime.launch``) or the NumPy path (``lik_cupy._cpu``).
"""

from __future__ import annotations

from dataclasses import replace

from . import _cpu as cpu
from ._dispatch import kernel_dtype
from ._dispatch.backend import check_backend, scoring_on_gpu
from ._dispatch.precision import fp32_accurate
from ._interop import caller_results, caller_stream, describe, device_array, host_array, host_result
from ._runtime.device_checks import call_checks
from ._runtime.launch import launch, prepare, use_tma_for
from ._runtime.prepared_calls import PreparedCall, call_key, lookup, store
from ._runtime.operands import (device_offsets, host_metadata, device_valid, host_offsets, kernel_operands,
                                unpack_queries, valid_host)
from ._validate import Problem, check_call, check_varlen, check_zero_pad

__all__ = ["maxsim", "maxsim_pairs", "maxsim_varlen"]


def maxsim(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, return_argmax=False, backend="auto",
           precision=None, validate=None):
    """Late-interaction score ``sum_s max_t <Q[i, s], D[j, t]>`` without the ``[Nq, Nd, Lq, Ld]`` tensor.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` query token embeddings.
        D: ``[Nd, Ld, d]`` documents scored against every query -> scores ``[Nq, Nd]``;
            ``[Nq, K, Ld, d]`` a candidate set per query (reranking) -> ``[Nq, K]``;
            ``[Ld, d]`` one document -> ``[Nq]``. A 2-D ``Q`` drops the leading axis.
            Q and D share a dtype: float16, bfloat16, float32 (float32 accuracy on the GPU
            unless ``precision="tf32"``) or float64 (float64 on the CPU; on the GPU rounded
            to float32 and scored as float32, with float64 scores), and a framework: NumPy,
            CuPy, PyTorch (CUDA or CPU), JAX, or any DLPack producer.
        q_mask: bool ``Q.shape[:-1]``, True = valid token. Masked query tokens add nothing.
        d_mask: bool ``D.shape[:-1]``. Masked document tokens never win the max.
        q_lengths: int ``Q.shape[:-2]``: the first ``q_lengths[i]`` tokens are valid (instead of q_mask).
        d_lengths: int ``D.shape[:-2]``: likewise for documents (instead of d_mask).
        return_argmax: also return int32 ``scores.shape + (Lq,)``: the winning document
            token per query token (lowest index on ties), -1 for masked query tokens and
            empty documents.
        backend: "auto" (GPU for device arrays, and for host arrays when a GPU is
            present; float64 host arrays: the CPU), "gpu", or "cpu" (the NumPy path: BLAS
            float32 similarities, float64 for float64 inputs, with the argmax of the float64
            similarities exactly and each score the sum of its winners' float64 similarities;
            see ``lik_cupy._cpu.maxsim``).
        precision: float32 inputs on the GPU: "fp32" (float32 accuracy, 3xTF32) or "tf32"
            (one TF32 product, ~1e-3 relative error, faster); None follows the process
            default and then the caller's framework (``lik_cupy.precision``).
        validate: device-resident lengths. None (default): an invalid value (negative, or past
            ``Lq`` / ``Ld``) makes exactly the scores it touches NaN (their argmax rows -1),
            checked on the device with no host synchronisation; True (or ``LIK_VALIDATE=1``):
            strict, the call waits for the check and raises a ValueError; False: no check (an
            invalid value gives wrong scores, never a read out of bounds). Host-resident
            lengths (lists, NumPy, CPU tensors) are checked on the host and raise, unless False.

    Returns:
        float32 scores (float64 for float64 inputs) and the argmax, in the caller's framework,
        on the caller's device. A document with no valid token scores -inf; a query with no valid
        token scores 0 (also against an empty document); a NaN in any unmasked
        similarity makes that score NaN. Device work runs on the caller's current
        CuPy or PyTorch stream and the call returns without waiting for it (strict
        validation aside). A repeat call with the same shapes, dtypes and flags reuses
        the first one's kernel choice and launch plan (``lik_cupy._runtime.prepared_calls``).
    Example (the NumPy path; on a GPU the same call runs the CUDA kernels)::

        >>> import numpy as np, lik_cupy
        >>> Q = np.array([[[1, 0], [0, 1]]], np.float32)            # 1 query, 2 tokens, d = 2
        >>> D = np.array([[[1, 0], [0, 0]], [[0, 2], [1, 1]]], np.float32)  # 2 documents
        >>> lik_cupy.maxsim(Q, D, backend="cpu")
        array([[1., 3.]], dtype=float32)
        >>> s, a = lik_cupy.maxsim(Q, D, d_lengths=[1, 2], return_argmax=True, backend="cpu")
        >>> s, a[0, 1]
        (array([[1., 3.]], dtype=float32), array([1, 0], dtype=int32))
    """
    return _run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, pairs=False)


def maxsim_pairs(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, return_argmax=False,
                 backend="auto", precision=None, validate=None):
    """Diagonal MaxSim: ``score[b] = maxsim(Q[b], D[b])``.

    Args:
        Q: ``[B, Lq, d]``; D: ``[B, Ld, d]``; masks ``[B, Lq]`` / ``[B, Ld]`` or lengths ``[B]``.
        Other arguments (``validate`` too) as in :func:`maxsim`.

    Returns:
        float32 ``[B]`` (float64 for float64 inputs), and int32 argmax ``[B, Lq]`` if asked.
    Example::

        >>> import numpy as np, lik_cupy
        >>> Q = np.ones((3, 2, 4), np.float32)
        >>> D = np.arange(3 * 5 * 4, dtype=np.float32).reshape(3, 5, 4) / 100
        >>> lik_cupy.maxsim_pairs(Q, D, backend="cpu")
        array([1.4, 3. , 4.6], dtype=float32)
    """
    return _run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, pairs=True)


def maxsim_varlen(Q, D_tokens, d_offsets, q_mask=None, *, q_lengths=None, q_offsets=None, return_argmax=False,
                  validate_offsets=True, backend="auto", precision=None, validate=None):
    """MaxSim against packed (ragged) documents: no work is spent on padding.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` padded queries (with ``q_mask`` / ``q_lengths``
            as in :func:`maxsim`), or packed query tokens ``[Tq, d]`` with ``q_offsets``.
        D_tokens: ``[T, d]`` the documents' tokens back to back, same dtype and
            framework/device as Q (float16, bfloat16, float32 or float64, as in :func:`maxsim`).
        d_offsets: int32 or int64 ``[Nd + 1]``: document j is ``D_tokens[d_offsets[j]:d_offsets[j + 1]]``
            (FlashAttention's ``cu_seqlens``). Must start at 0, never decrease and end at T;
            equal neighbours are empty documents (score -inf). Device offsets are checked on
            the device after the scoring kernel, never copied to the host: a document whose
            offsets are negative, decreasing or past T scores NaN, and every score is NaN
            when the offsets do not run from 0 to T (``validate`` as in :func:`maxsim`).
        q_offsets: int32 or int64 ``[Nq + 1]`` for packed queries (read on the host:
            the longest query sets the argmax width).
        return_argmax: also return int32 ``[Nq, Nd, Lq]`` document-local token indices
            (``Lq`` = the longest query for packed queries), -1 for masked/absent query
            tokens and empty documents.
        validate_offsets: False is ``validate=False``: no check of ``d_offsets`` (nor of
            ``q_lengths``) for offsets already known good. The kernel clamps every document
            to ``[0, T)``, so bad offsets then give wrong scores but never touch memory
            outside ``D_tokens``.
        backend, precision, validate: as in :func:`maxsim`.

    Returns:
        float32 ``[Nq, Nd]`` (``[Nd]`` for a 2-D padded Q; float64 for float64 inputs), in the caller's framework
        and device; semantics as in :func:`maxsim`.
    Example::

        >>> import numpy as np, lik_cupy
        >>> Q = np.array([[1, 0], [0, 1]], np.float32)               # one query [Lq, d]
        >>> tokens = np.array([[1, 0], [0, 2], [1, 1]], np.float32)  # docs of 1 and 2 tokens
        >>> lik_cupy.maxsim_varlen(Q, tokens, np.array([0, 1, 3]), backend="cpu")
        array([1., 3.], dtype=float32)
    """
    validate = False if validate_offsets is False and validate is None else validate
    return _run_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, q_offsets, return_argmax, backend, precision,
                       validate)


def _maxsim_zero_pad(Q, D, zero_pad, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None,
                     return_argmax=False, backend="auto", precision=None, validate=None):
    """:func:`maxsim` of documents with zero-vector padding, as PyLate's and colpali-engine's torch
    paths score them (for ``lik_cupy.integrations``).

    ``zero_pad``: bool ``D.shape[:-2]``, True for a document whose padding (the tokens past its
    ``d_lengths``, or masked out by ``d_mask``) is zero vectors that count as tokens: each query
    token's max over it is at least 0 (a NaN max stays NaN), and where 0 wins its argmax is -1 (no
    token, so the backward gives it no gradient). The padding is skipped, not read, so it need not
    hold zeros. ``"masked"`` (``lik_cupy._runtime.masks.MASKED``) flags every document with a
    masked token in ``d_mask`` (PyLate's masks); the GPU makes the flags while it reads the mask,
    with no kernel of their own. Other arguments as in :func:`maxsim`; Q and D float16, bfloat16,
    float32 or float64.
    """
    return _run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, pairs=False,
                zero_pad=zero_pad)


def _maxsim_varlen_zero_pad(Q, D_tokens, d_offsets, zero_pad, q_mask=None, *, q_lengths=None, return_argmax=False,
                            backend="auto", precision=None, validate=None):
    """:func:`maxsim_varlen` of documents with zero-vector padding (``zero_pad`` bool ``[Nd]``, as in
    :func:`_maxsim_zero_pad`: the packed documents hold their real tokens only). Padded queries."""
    return _run_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, None, return_argmax, backend, precision, validate,
                       zero_pad=zero_pad)


def _varlen_key(Q, D_tokens, d_offsets, q_mask, q_lengths, return_argmax, backend, precision, validate, zero_pad=None):
    return call_key("varlen", (validate, return_argmax, backend, precision), Q,
                    (D_tokens, d_offsets, q_mask, q_lengths, zero_pad))


def _maxsim_key(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, pairs=False,
                zero_pad=None):
    masked = isinstance(zero_pad, str)  # MASKED: a flag of the call, not an array
    flags = (validate, return_argmax, backend) + ((zero_pad,) if masked else ()) + (precision,)
    return call_key("pairs" if pairs else "maxsim", flags, Q,
                    (D, q_mask, d_mask, q_lengths, d_lengths, None if masked else zero_pad))


def _prepared_call(fn: str, Q, D=None, D_tokens=None, d_offsets=None, q_mask=None, d_mask=None, q_lengths=None,
                   d_lengths=None, return_argmax=False, backend="auto", precision=None, validate=None):
    """The :class:`PreparedCall` that a repeat of ``lik_cupy.<fn>`` ("maxsim" or "maxsim_varlen")
    with these arguments would run, if one is kept (``lik_cupy.jax`` rebinds it to XLA's buffers)."""
    if fn == "maxsim_varlen":
        return lookup(_varlen_key(Q, D_tokens, d_offsets, q_mask, q_lengths, return_argmax, backend, precision,
                                  validate))
    return lookup(_maxsim_key(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate))


def _run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, *, pairs,
         zero_pad=None):
    key = _maxsim_key(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, pairs,
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


def _run_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, q_offsets, return_argmax, backend, precision, validate,
                zero_pad=None):
    key = _varlen_key(Q, D_tokens, d_offsets, q_mask, q_lengths, return_argmax, backend, precision, validate,
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
    if any(x is not None and x.dtype.itemsize not in (4, 8) for x in metadata):
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
    if q_offsets is not None:
        qt = host_array(Q, fw).reshape(-1, p.dim)
        q, qv = cpu.unpack(qt, host_offsets(host_array(q_offsets, fw), qt.shape[0], "q_offsets"))
    else:
        q = host_array(Q, fw).reshape(p.nq, p.lq, p.dim)
        qv = valid_host(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw)
    zp = None if zero_pad is None else host_array(zero_pad, fw).reshape(p.nd)
    s, a = cpu.maxsim_packed_numpy(q, qv, d, doff, return_argmax=return_argmax, zero_pad=zp)
    lq = q.shape[1]
    s = s.reshape(p.scores_shape)
    a = a.reshape(p.scores_shape + (lq,)) if a is not None else None
    return host_result(s, p), (host_result(a, p) if a is not None else None)


# ---------------------------------------------------------------- GPU


def _gpu(p: Problem, Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, validate, x3: bool, zero_pad=None):
    import cupy

    fw = p.framework
    on_host = p.device is None
    device = p.device if p.device is not None else cupy.cuda.runtime.getDevice()
    with call_checks(True if validate is not False and host_metadata(q_lengths, d_lengths) else validate) as checks:
        with caller_stream(fw, device):
            q = device_array(Q, fw, on_host)
            d = device_array(D, fw, on_host)
            q, d = kernel_operands(p.dtype, q, d)
            nrows = p.nq * p.nd if p.candidates else p.nd
            qm, ql = device_valid(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw, on_host, checks)
            dm, dl = device_valid(d_mask, d_lengths, nrows, p.ld, "d_lengths", fw, on_host, checks)
            zp = _device_zero_pad(zero_pad, nrows, fw, on_host)
            kp = replace(p, dtype=kernel_dtype(p.dtype))
            scores, amax = launch(kp, q, d, qm, dm, ql, dl, return_argmax, device, x3=x3, zero_pad=zp)
            checks.apply(p, scores, amax, device)
            results = caller_results(p, scores.astype("float64") if p.dtype == "float64" else scores, amax, on_host)
        checks.verify()  # last, while the scoring kernel runs (lik_cupy._runtime.device_checks)
    return results


def _gpu_varlen(p: Problem, Q, D, d_offsets, q_mask, q_lengths, q_offsets, return_argmax, validate, x3: bool,
                zero_pad=None):
    import cupy

    fw = p.framework
    on_host = p.device is None
    device = p.device if p.device is not None else cupy.cuda.runtime.getDevice()
    with call_checks(True if validate is not False and host_metadata(q_lengths, d_offsets) else validate) as checks:
        with caller_stream(fw, device):
            q = device_array(Q, fw, on_host)
            d = device_array(D, fw, on_host).reshape(p.ntok, p.dim)
            q, d = kernel_operands(p.dtype, q, d)
            doff = device_offsets(device_array(d_offsets, fw, on_host), p.ntok, "d_offsets", True, checks)
            qm = None
            if q_offsets is not None:
                q, ql = unpack_queries(q.reshape(-1, p.dim), device_array(q_offsets, fw, on_host), p.nq)
                p = replace(p, lq=q.shape[1], argmax_shape=p.scores_shape + (q.shape[1],))
            else:
                q = q.reshape(p.nq, p.lq, p.dim)
                qm, ql = device_valid(q_mask, q_lengths, p.nq, p.lq, "q_lengths", fw, on_host, checks)
            ld_hint = -(-p.ntok // max(1, p.nd))
            zp = _device_zero_pad(zero_pad, p.nd, fw, on_host)
            kp = replace(p, dtype=kernel_dtype(p.dtype))
            scores, amax = launch(kp, q, d, qm, None, ql, None, return_argmax, device, d_off=doff, ld_hint=ld_hint,
                                  x3=x3, zero_pad=zp)
            checks.apply(p, scores, amax, device)
            results = caller_results(p, scores.astype("float64") if p.dtype == "float64" else scores, amax, on_host)
        checks.verify()  # last, while the scoring kernel runs (lik_cupy._runtime.device_checks)
    return results


def _device_zero_pad(zero_pad, rows: int, fw: str, on_host: bool):
    """The zero-vector padding flags as the kernels read them: contiguous uint8 [rows], None, or
    ``"masked"`` (``launch`` makes them with the mask's spans)."""
    if zero_pad is None or isinstance(zero_pad, str):
        return zero_pad
    import cupy

    return cupy.ascontiguousarray(device_array(zero_pad, fw, on_host).reshape(rows)).view(cupy.uint8)
