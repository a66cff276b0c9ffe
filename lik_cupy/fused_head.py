"""The fused projection head: ``maxsim_from_hidden`` scores queries against documents given as
encoder hidden states ``H [Nd, Ld, h]`` through a projection ``W [d, h]`` (+ ``bias``) and
L2-normalisation, without holding the projected ``[Nd, Ld, d]`` tensor; ``maxsim_from_hidden_backward``
gives its gradients for Q, H, W and bias.

How, on a Hopper GPU (float16 and bfloat16, d = 128, at most 64 query rows ``Nq * Lq``, no query
masks or lengths and no document lengths: ``lik_cupy._dispatch.choose_hidden_fused`` and
``lik_cupy._runtime.hidden_maxsim.fused_width``): one kernel (``cuda_src/hidden_maxsim.cu``)
projects each tile of hidden states on wgmma, rounds it to the inputs' dtype, adds the bias and
normalises it in float32 in registers, rounds it again and scores it against the queries there; each
document's maxima meet in a small scratch of one int64 per query token and document. Nothing the
size of the projection is written, and H is read once. Elsewhere the documents are streamed in
chunks of at most ``max_chunk_bytes`` of projected tokens. Each chunk is projected by one GEMM
(cuBLAS on the GPU, float32 accumulation; float64 BLAS on the CPU), normalised in place
(``cuda_src/hidden.cu``: one warp a row, the sum of squares and the scaling, which add the bias in
float32) and scored by the MaxSim kernels with their argmax (``lik_cupy.maxsim``); the chunk is then
dropped. The two ways round the same values alike, up to the float32 order of the projection's and
the norm's sums (a projected element may round one unit apart). The backward recomputes each chunk's projection,
turns the saved argmax into the gradient of the projected tokens (``lik_cupy.maxsim_backward``),
pulls it back through the normalisation, and forms ``dH = dP @ W``, ``dW += dP.T @ H`` and
``db += sum(dP)`` by GEMMs (the sum too: a row of ones). So the projection runs once in the forward
and four GEMMs in the backward, never once per query; the scratch is one chunk (plus the
backward's ``dH``, which is the size of ``H``).
"""

from __future__ import annotations

import numpy as np

from . import _interop as interop
from ._interop import GpuCall
from ._cpu.hidden import normalize_grad, normalize_rows, project_numpy
from ._dispatch.backend import check_backend, scoring_on_gpu
from ._dispatch.precision import fp32_accurate
from ._runtime.hidden_maxsim import aligned, fused_width
from ._runtime.operands import valid_host
from ._validate import HiddenProblem, check_flag, check_hidden, check_hidden_backward, check_hidden_options
from ._runtime.backward import grad_scores_f32, gradient_out, host_gradient_out
from .backward import maxsim_backward as _maxsim_backward
from .forward import maxsim as _maxsim

__all__ = ["maxsim_from_hidden", "maxsim_from_hidden_backward", "CHUNK_BYTES"]

CHUNK_BYTES = 256 << 20  # default bound on one chunk's projected tokens, in bytes as held


def maxsim_from_hidden(Q, H, W, bias=None, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None,
                       normalize=True, eps=1e-12, return_argmax=False, max_chunk_bytes=None, backend="auto",
                       precision=None, validate=None):
    """``maxsim(Q, normalize(H @ W.T + bias))`` without the projected ``[Nd, Ld, d]`` tensor.

    The same scores as ``D = F.linear(H, W, bias); D = F.normalize(D, dim=-1, eps=eps);
    maxsim(Q, D, ...)``, with every semantic of :func:`lik_cupy.maxsim` (masks, lengths, empty
    documents scoring ``-inf``, NaN, argmax).

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` query token embeddings, already projected (and normalised,
            if the documents are).
        H: ``[Nd, Ld, h]`` document hidden states (an encoder's last layer).
        W: ``[d, h]`` the projection (``torch.nn.Linear(h, d).weight``).
        bias: ``[d]`` or None.
        q_mask, d_mask, q_lengths, d_lengths: as in :func:`lik_cupy.maxsim`; ``d_mask [Nd, Ld]``,
            ``d_lengths [Nd]``. Masked tokens of ``H`` are projected but never scored.
        normalize: L2-normalise each projected token, ``x / max(|x|, eps)`` (``F.normalize``).
        eps: the normalisation's floor, a positive float.
        return_argmax: also return the int32 argmax ``scores.shape + (Lq,)``, as :func:`lik_cupy.maxsim`.
        max_chunk_bytes: the most bytes of projected tokens held at once, in the inputs' dtype on
            the GPU (on the CPU: each token's hidden state, projection and its gradient in
            float64, ``8 (h + 2 d)`` bytes); default ``CHUNK_BYTES``, 256 MiB (1,000 documents of 300
            tokens of d = 128 in 16 bits are 77 MB: one chunk). At least one document at a time. The
            one-pass kernel on Hopper (this module's docstring) holds no projected tokens but a
            scratch of 8 bytes a query token and document, which this bounds too: a call past it
            takes the streamed path.
        backend, precision, validate: as in :func:`lik_cupy.maxsim`; float32 inputs project at
            float32 accuracy, or on TF32 tensor cores with ``precision="tf32"``.

    Q, H, W and bias share one float dtype (float16, bfloat16, float32 or float64), framework and
    device. On the GPU the projection accumulates in float32 (float64 for float64) and is stored in
    the inputs' dtype before scoring, as the unfused pipeline stores it; on the CPU it is float64
    throughout (Q too), rounded only in the scores.

    Returns:
        float32 scores ``[Nq, Nd]`` (``[Nd]`` for a 2-D Q; float64 for float64 inputs) in the
        caller's framework, and with ``return_argmax`` the argmax.
    Example::

        >>> import numpy as np, lik_cupy
        >>> Q = np.array([[[1, 0], [0, 1]]], np.float32)
        >>> H = np.array([[[2, 0, 0], [0, 0, 5]]], np.float32)
        >>> W = np.array([[1, 0, 0], [0, 0, 1]], np.float32)
        >>> lik_cupy.maxsim_from_hidden(Q, H, W, backend="cpu")
        array([[2.]], dtype=float32)
    """
    check_backend(backend)
    hp = check_hidden(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths)
    normalize, eps, max_chunk_bytes = check_hidden_options(normalize, eps, max_chunk_bytes)
    return_argmax, validate = check_flag("return_argmax", return_argmax), check_flag("validate", validate, none=True)
    x3 = fp32_accurate(precision, hp.p.framework, hp.p.dtype)
    if scoring_on_gpu(hp.p, backend, float64_gpu=True):
        scores, amax = _gpu_forward(hp, Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps,
                                    return_argmax, max_chunk_bytes, precision, validate, x3)
    else:
        scores, amax = _cpu_forward(hp, Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps,
                                    return_argmax, max_chunk_bytes)
    return (scores, amax) if return_argmax else scores


def maxsim_from_hidden_backward(grad_scores, Q, H, W, bias, argmax, d_mask=None, *, d_lengths=None, normalize=True,
                                eps=1e-12, max_chunk_bytes=None, backend="auto", precision=None, validate=None):
    """Gradients of :func:`maxsim_from_hidden` with respect to Q, H, W and bias.

    Each chunk of documents is projected again; the forward's ``argmax`` gives the gradient of
    the projected tokens (:func:`lik_cupy.maxsim_backward`), which is pulled back through the
    normalisation and the projection. Masked document tokens get no gradient; their values in ``H``
    must be finite for ``dW`` (a GEMM multiplies them by the zero gradient).

    Args:
        grad_scores: float, the scores' shape.
        Q, H, W, bias, d_mask, d_lengths, normalize, eps, max_chunk_bytes, backend, precision:
            the forward's (query masks and lengths are not needed: the argmax marks masked query
            tokens with -1).
        argmax: the int32 argmax the forward returned (``return_argmax=True``).
        validate: None or False: the argmax is trusted (an entry outside its document makes that
            query token's dQ row NaN, as in :func:`lik_cupy.maxsim_backward`); True checks it.

    Returns:
        ``(dQ, dH, dW, dbias)`` shaped and typed like Q, H, W and bias (``dbias`` None without a
        bias), accumulated in float32 on the GPU (float64 on the CPU), in the caller's framework.
    """
    check_backend(backend)
    hp = check_hidden_backward(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths)
    normalize, eps, max_chunk_bytes = check_hidden_options(normalize, eps, max_chunk_bytes)
    validate = check_flag("validate", validate, none=True)
    x3 = fp32_accurate(precision, hp.p.framework, hp.p.dtype)
    if scoring_on_gpu(hp.p, backend, float64_gpu=True):
        return _gpu_backward(hp, grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize, eps,
                             max_chunk_bytes, validate, x3)
    return _cpu_backward(hp, grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize, eps, max_chunk_bytes)


def _chunks(hp: HiddenProblem, max_chunk_bytes, token_bytes: int):
    """Document ranges ``(j0, j1)`` whose tokens (``token_bytes`` each: what a chunk holds of one)
    fit the budget (one document at least)."""
    p = hp.p
    per_doc = max(1, p.ld * token_bytes)
    step = max(1, (CHUNK_BYTES if max_chunk_bytes is None else max_chunk_bytes) // per_doc)
    return [(j, min(p.nd, j + step)) for j in range(0, p.nd, step)]


def _cpu_token_bytes(hp: HiddenProblem) -> int:
    """What a CPU chunk holds of one token: its hidden state and its projection (with, in the
    backward, the projection's gradient) in float64. Counting the projection alone, a chunk of h = 768
    held six times the budget in float64 hidden states."""
    return 8 * (hp.hidden + 2 * hp.p.dim)


def _sliced(x, j0: int, j1: int):
    return None if x is None else x[j0:j1]


# ---------------------------------------------------------------- CPU


def _host_q(hp: HiddenProblem, Q, q_mask, q_lengths):
    """Q as float64 [nq, lq, d] and its validity as the NumPy path takes it."""
    p, fw = hp.p, hp.p.framework
    q = interop.to_numpy(Q, fw).astype(np.float64).reshape(p.nq, p.lq, p.dim)
    qm = None if q_mask is None else interop.host_array(q_mask, fw).reshape(p.nq, p.lq)
    ql = None if q_lengths is None else interop.host_array(q_lengths, fw).reshape(p.nq)
    return q, qm, ql


def _host_weights(hp: HiddenProblem, H, W, bias):
    fw, p = hp.p.framework, hp.p
    h = interop.to_numpy(H, fw).reshape(p.nd * p.ld, hp.hidden)
    w = interop.to_numpy(W, fw)
    return h, w, None if bias is None else interop.to_numpy(bias, fw)


def _cpu_forward(hp: HiddenProblem, Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps,
                 return_argmax, max_chunk_bytes):
    p, fw = hp.p, hp.p.framework
    q, qm, ql = _host_q(hp, Q, q_mask, q_lengths)
    h, w, b = _host_weights(hp, H, W, bias)
    dm = None if d_mask is None else interop.host_array(d_mask, fw).reshape(p.nd, p.ld)
    dl = None if d_lengths is None else interop.host_array(d_lengths, fw).reshape(p.nd)
    scores = np.empty((p.nq, p.nd), np.float64)
    # (the argmax only where asked: Lq int32 a score, far more than the scores themselves)
    amax = np.empty((p.nq, p.nd, p.lq), np.int32) if return_argmax else None
    for j0, j1 in _chunks(hp, max_chunk_bytes, _cpu_token_bytes(hp)):
        D = project_numpy(h[j0 * p.ld:j1 * p.ld], w, b)
        if normalize:
            normalize_rows(D, eps)
        out = _maxsim(q, D.reshape(j1 - j0, p.ld, p.dim), qm, _sliced(dm, j0, j1), q_lengths=ql,
                      d_lengths=_sliced(dl, j0, j1), return_argmax=return_argmax, backend="cpu")
        if return_argmax:
            scores[:, j0:j1], amax[:, j0:j1] = out
        else:
            scores[:, j0:j1] = out
    s = scores if p.dtype == "float64" else scores.astype(np.float32)
    return interop.host_result(s.reshape(p.scores_shape), p), \
        (interop.host_result(amax.reshape(p.argmax_shape), p) if return_argmax else None)


def _cpu_backward(hp: HiddenProblem, grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize, eps,
                  max_chunk_bytes):
    p, fw = hp.p, hp.p.framework
    q, _, _ = _host_q(hp, Q, None, None)
    h, w, b = _host_weights(hp, H, W, bias)
    g = interop.to_numpy(grad_scores, fw).astype(np.float64).reshape(p.nq, p.nd)
    a = interop.to_numpy(argmax, fw).reshape(p.nq, p.nd, p.lq)
    keep = valid_host(d_mask, d_lengths, p.nd, p.ld, "d_lengths", fw).reshape(-1, 1)
    w64 = w.astype(np.float64)
    dq = np.zeros(q.shape)
    dh = np.empty(h.shape, h.dtype)  # each chunk's float64 rows rounded once as they are written
    dw = np.zeros(w.shape)
    db = np.zeros(p.dim)
    for j0, j1 in _chunks(hp, max_chunk_bytes, _cpu_token_bytes(hp)):
        rows = slice(j0 * p.ld, j1 * p.ld)
        D = project_numpy(h[rows], w, b)
        r = normalize_rows(D, eps) if normalize else None
        dqc, dD = _maxsim_backward(g[:, j0:j1], q, D.reshape(j1 - j0, p.ld, p.dim), a[:, j0:j1], backend="cpu")
        dq += dqc
        dP = normalize_grad(D, r, dD.reshape(D.shape), keep[rows], eps)
        db += dP.sum(axis=0)
        dw += dP.T @ h[rows].astype(np.float64)
        dh[rows] = dP @ w64
    shapes = [interop.describe(x).shape for x in (Q, H, W)]
    out = [host_gradient_out(x, y.dtype, s, p, like) for x, y, s, like in ((dq, h, shapes[0], Q), (dh, h, shapes[1], H),
                                                                    (dw, w, shapes[2], W))]
    return (*out, None if bias is None else host_gradient_out(db, w.dtype, (p.dim,), p, bias))


# ---------------------------------------------------------------- GPU


def _typed(x, dtype: str):
    """Element bits (:func:`_bits`) as the public functions take them: float16, bfloat16 as
    ml_dtypes' bfloat16."""
    if dtype == "float16":
        return x.view(np.float16)
    if dtype == "bfloat16":
        import ml_dtypes

        return x.view(np.dtype(ml_dtypes.bfloat16))
    return x


def _bits(x, dtype: str):
    """A device array as ``lik_cupy._runtime.hidden`` takes it: float16 and bfloat16 as uint16 bits."""
    return x.view(np.uint16) if dtype in ("float16", "bfloat16") else x


def _device_operands(hp: HiddenProblem, Q, H, W, bias, on_host: bool):
    """C-contiguous device Q [nq, lq, d] (typed), H rows [nd * ld, h], W and bias (kernel bits)."""
    import cupy

    p, fw = hp.p, hp.p.framework

    def dev(x):
        return cupy.ascontiguousarray(_bits(interop.device_array(x, fw, on_host), p.dtype))

    q = _typed(dev(Q).reshape(p.nq, p.lq, p.dim), p.dtype)
    return q, dev(H).reshape(p.nd * p.ld, hp.hidden), dev(W), None if bias is None else dev(bias)


def _device_valid(x, fw: str, on_host: bool, shape):
    """A mask (bool) or lengths on the device for the per-chunk calls; host lengths stay on the host
    (as lists), so their values are checked there and raise, as in :func:`lik_cupy.maxsim`."""
    if x is None:
        return None
    if on_host or isinstance(x, (list, tuple, np.ndarray)) or interop.describe(x).device is None:
        a = interop.host_array(x, fw).reshape(shape)
        return a if a.dtype == bool else a.tolist()
    import cupy

    a = interop.device_array(x, fw, on_host).reshape(shape)
    return a.view(cupy.bool_) if a.dtype == np.uint8 else a


def _gpu_forward(hp: HiddenProblem, Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps,
                 return_argmax, max_chunk_bytes, precision, validate, x3):
    import cupy

    from ._runtime.hidden import project

    p, fw = hp.p, hp.p.framework
    with GpuCall(p) as call:
        on_host = call.on_host
        q, h, w, b = _device_operands(hp, Q, H, W, bias, on_host)
        qm = _device_valid(q_mask, fw, on_host, (p.nq, p.lq))
        ql = _device_valid(q_lengths, fw, on_host, (p.nq,))
        dm = _device_valid(d_mask, fw, on_host, (p.nd, p.ld))
        dl = _device_valid(d_lengths, fw, on_host, (p.nd,))
        if isinstance(dm, np.ndarray):
            dm = cupy.asarray(dm)
        if isinstance(qm, np.ndarray):
            qm = cupy.asarray(qm)
        qn = None if dm is not None and dm.dtype != cupy.bool_ else \
            fused_width(hp, call.device, q_mask, q_lengths, d_lengths,
                        CHUNK_BYTES if max_chunk_bytes is None else max_chunk_bytes)
        if qn is not None and aligned(q.data.ptr, h.data.ptr, w.data.ptr):
            return call.results(p, *_fused_forward(hp, q, h, w, b, dm, normalize, eps, return_argmax, qn, call.device))
        chunks = _chunks(hp, max_chunk_bytes, p.dim * h.dtype.itemsize)
        scores = amax = None
        if len(chunks) != 1:  # (none for no documents)
            scores = cupy.empty((p.nq, p.nd), cupy.float64 if p.dtype == "float64" else cupy.float32)
            amax = cupy.empty((p.nq, p.nd, p.lq), cupy.int32) if return_argmax else None
        for j0, j1 in chunks:
            D, _ = project(h[j0 * p.ld:j1 * p.ld], w, b, p.dtype, normalize, eps, not x3)
            out = _maxsim(q, _typed(D, p.dtype).reshape(j1 - j0, p.ld, p.dim), qm, _sliced(dm, j0, j1), q_lengths=ql,
                          d_lengths=_sliced(dl, j0, j1), return_argmax=return_argmax, backend="gpu",
                          precision=precision, validate=validate)
            s, a = out if return_argmax else (out, None)
            del D  # the chunk's projection goes back to the pool before the next one
            if len(chunks) == 1:
                scores, amax = s, a
            else:
                scores[:, j0:j1] = s
                if return_argmax:
                    amax[:, j0:j1] = a
        return call.results(p, scores, amax)


def _fused_forward(hp: HiddenProblem, q, h, w, b, dm, normalize, eps, return_argmax, qn: int, device: int):
    """(scores, argmax or None) of the one-pass kernel (``lik_cupy._runtime.hidden_maxsim``), CuPy arrays
    on the current stream: ``q``, ``h``, ``w`` and ``b`` as :func:`_device_operands` gives them, ``dm``
    a boolean document mask or None."""
    import cupy

    from ._runtime.hidden import to_float32
    from ._runtime.hidden_maxsim import key_count, score_hidden

    p = hp.p
    keys = cupy.zeros(key_count(p.nq, p.lq, p.nd), cupy.uint64)
    scores = cupy.empty((p.nq, p.nd), cupy.float32)
    amax = cupy.empty((p.nq, p.nd, p.lq), cupy.int32) if return_argmax else None
    b32 = None if b is None else to_float32(b, p.dtype)
    dmask = None if dm is None else cupy.ascontiguousarray(dm).view(cupy.uint8)
    score_hidden(q=q.data.ptr, h=h.data.ptr, w=w.data.ptr, bias=0 if b32 is None else b32.data.ptr,
                 dmask=0 if dmask is None else dmask.data.ptr, keys=keys.data.ptr, scores=scores.data.ptr,
                 amax=0 if amax is None else amax.data.ptr, nq=p.nq, lq=p.lq, nd=p.nd, ld=p.ld, hidden=hp.hidden,
                 dtype=p.dtype, qn=qn, normalize=normalize, eps=eps, device=device,
                 stream=cupy.cuda.get_current_stream().ptr)
    return scores, amax


def _gpu_backward(hp: HiddenProblem, grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize, eps,
                  max_chunk_bytes, validate, x3):
    import cupy

    from ._runtime.hidden import from_float32, gemm, project, project_grad, row_sums, to_float32

    p, fw = hp.p, hp.p.framework
    wide = p.dtype == "float64"
    acc = cupy.float64 if wide else cupy.float32
    with GpuCall(p) as call:
        on_host = call.on_host
        q, h, w, b = _device_operands(hp, Q, H, W, bias, on_host)
        g = grad_scores_f32(grad_scores, fw, on_host, p)
        a = cupy.ascontiguousarray(interop.device_array(argmax, fw, on_host).reshape(p.nq, p.nd, p.lq))
        keep = _device_keep(d_mask, d_lengths, p, fw, on_host, wide)
        chunks = _chunks(hp, max_chunk_bytes, p.dim * h.dtype.itemsize)
        # One chunk (training batches): dQ as the backward gives it, dW and db written by their
        # GEMMs in the inputs' type; several: float32 sums, rounded once at the end.
        one = len(chunks) == 1 and not wide
        dq = None if one else cupy.zeros((p.nq, p.lq, p.dim), acc)
        dh = cupy.empty(h.shape, h.dtype)
        dw = cupy.empty(w.shape, w.dtype) if one else cupy.zeros(w.shape, acc)
        db = cupy.empty(p.dim, w.dtype) if one else cupy.zeros(p.dim, acc)
        for j0, j1 in chunks:
            rows = slice(j0 * p.ld, j1 * p.ld)
            D, state = project(h[rows], w, b, p.dtype, normalize, eps, not x3)
            dqc, dD = _maxsim_backward(cupy.ascontiguousarray(g[:, j0:j1]), q,
                                       _typed(D, p.dtype).reshape(j1 - j0, p.ld, p.dim),
                                       cupy.ascontiguousarray(a[:, j0:j1]), validate=validate or False, backend="gpu")
            dqc, dD = _bits(dqc, p.dtype), _bits(dD, p.dtype).reshape(D.shape)
            if one:
                dq = dqc
            else:
                dq += dqc if wide else to_float32(dqc, p.dtype)
            dP = project_grad(D, state, dD, None if keep is None else keep[rows], p.dtype, eps)
            if b is not None and wide:
                db += dP.sum(axis=0)
            elif b is not None:
                row_sums(dP, db, p.dtype, beta=0.0 if one else 1.0)
            gemm(dP, h[rows], dw, p.dtype, ta=True, beta=0.0 if one else 1.0, tf32=not x3)
            gemm(dP, w, dh[rows], p.dtype, tf32=not x3)
            del D, state, dD, dP, dqc
        if not one:  # float16 as float16, bfloat16 as the bits the results' adapters take
            dq, dw, db = (x if wide else from_float32(x, p.dtype) for x in (dq, dw, db))
        dq, dh, dw, db = (x.view(np.float16) if p.dtype == "float16" else x for x in (dq, dh, dw, db))
        shapes = [interop.describe(x).shape for x in (Q, H, W)]
        out = [gradient_out(x, s, p, like, fw, on_host) for x, s, like in ((dq, shapes[0], Q), (dh, shapes[1], H),
                                                                  (dw, shapes[2], W))]
        return (*out, None if bias is None else gradient_out(db, (p.dim,), p, bias, fw, on_host))


def _device_keep(d_mask, d_lengths, p, fw: str, on_host: bool, wide: bool):
    """bool [nd * ld, 1]: the document tokens that take a gradient; None when all do (``wide``,
    float64 rows: an array of ones, for the NumPy-API arithmetic)."""
    import cupy

    if d_mask is None and d_lengths is None:
        return cupy.ones((p.nd * p.ld, 1), cupy.bool_) if wide else None
    if d_mask is not None:
        m = interop.device_array(d_mask, fw, on_host)
        return cupy.ascontiguousarray(m.view(cupy.bool_) if m.dtype == np.uint8 else m).reshape(-1, 1)
    n = interop.device_array(d_lengths, fw, on_host).reshape(p.nd, 1)
    return (cupy.arange(p.ld)[None, :] < n).reshape(-1, 1)
