"""``lik_cupy.torch.maxsim_from_hidden``'s operators: ``torch.ops.lik_cupy.maxsim_from_hidden`` and
its backward, with fake implementations from ``_validate`` (``torch.compile``, ``torch.export``) and
the backward as the forward's autograd formula, which traced calls (``torch.compile``, tensor
subclasses) go through; eager calls take their implementations through an autograd.Function
(``from_hidden_eager``). Registered on import, in the ``lik_cupy`` library that ``_torch_autograd``
defines.

float16 and bfloat16 CUDA tensors that the one-pass kernel takes (``lik_cupy.fused_head``'s docstring
says which) are scored by it, training calls included (their backward then projects again). Other
float16 and bfloat16 CUDA tensors whose projected tokens fit one chunk (training batches, reranking)
take torch's own GEMMs (``F.linear``'s, under torch's matmul settings) and the MaxSim calls' torch path, with the normalisation and
its gradient by ``cuda_src/hidden.cu`` in place on the projection: the same steps as
``lik_cupy.fused_head``'s, in a few torch calls instead of some sixty calls through CuPy (the
training step was bound by their host time: 0.1-0.2 ms of GPU work in a 2.4-3.3 ms step on an H200).
An eager training call keeps that projection for its backward instead of computing it again. Other
calls (float32 and float64, the CPU, several chunks) take ``lik_cupy.fused_head``."""

from __future__ import annotations

import torch

from ._base.device import device_properties
from ._dispatch import choose_hidden_fused
from ._runtime.prepared_calls import call_key
from ._torch_autograd import (backend_of, fake_outputs, no_argmax, no_second_derivative, through_operator,
                              transformed, vmap_each)
from ._validate import check_flag, check_hidden, check_hidden_backward, check_hidden_options
from .backward import maxsim_backward
from .forward import maxsim
from .fused_head import CHUNK_BYTES, maxsim_from_hidden, maxsim_from_hidden_backward

_CHECKED: dict = {}  # a repeat call's signature -> its HiddenProblem (_checked)
_CHECKED_MAX = 64
_lib = torch.library.Library("lik_cupy", "FRAGMENT")
_TAGS = (torch.Tag.pt2_compliant_tag,)
_lib.define("maxsim_from_hidden(Tensor Q, Tensor H, Tensor W, Tensor? bias, Tensor? q_mask, Tensor? d_mask, "
            "Tensor? q_lengths, Tensor? d_lengths, bool normalize, float eps, bool return_argmax, "
            "int? max_chunk_bytes, str? precision) -> (Tensor, Tensor)", tags=_TAGS)
_lib.define("maxsim_from_hidden_backward(Tensor grad_scores, Tensor Q, Tensor H, Tensor W, Tensor? bias, "
            "Tensor argmax, Tensor? d_mask, Tensor? d_lengths, bool normalize, float eps, int? max_chunk_bytes, "
            "str? precision) -> (Tensor, Tensor, Tensor, Tensor)", tags=_TAGS)


def _forward_op(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, return_argmax, max_chunk_bytes,
                precision):
    fused = _fused_forward(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, return_argmax,
                           max_chunk_bytes)
    if fused is not None:
        return fused
    if _one_torch_chunk(Q, H, W, max_chunk_bytes):
        return _torch_forward(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps,
                              check_flag("return_argmax", return_argmax), max_chunk_bytes, precision)[:2]
    out = maxsim_from_hidden(Q, H, W, bias, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths,
                             normalize=normalize, eps=eps, return_argmax=return_argmax, max_chunk_bytes=max_chunk_bytes,
                             backend=backend_of(Q), precision=precision)
    return out if return_argmax else (out, no_argmax(out))


def _backward_op(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize, eps, max_chunk_bytes, precision):
    # the argmax is the forward's own: trusted, no host read (CUDA-graph capture)
    if _one_torch_chunk(Q, H, W, max_chunk_bytes):
        hp = check_hidden_backward(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths)
        normalize, eps, _ = check_hidden_options(normalize, eps, max_chunk_bytes)
        h2 = H.reshape(hp.p.nd * hp.p.ld, hp.hidden)
        D, ss = _project(h2, W, bias, normalize, eps)  # again: the operator keeps no projection
        return _torch_backward(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize, eps, D, ss)
    dq, dh, dw, db = maxsim_from_hidden_backward(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths=d_lengths,
                                                 normalize=normalize, eps=eps, max_chunk_bytes=max_chunk_bytes,
                                                 backend=backend_of(Q), precision=precision, validate=False)
    return dq, dh, dw, (_no_bias_grad(W) if db is None else db)


def _fused_forward(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, return_argmax,
                   max_chunk_bytes):
    """``(scores, argmax)`` by the one-pass kernel (``lik_cupy._runtime.hidden_maxsim``) where it runs: float16
    or bfloat16 CUDA tensors on a Hopper GPU, a boolean ``d_mask`` or none (``fused_width`` has the rest of
    the rule); else None. Its scratch is one int64 a query token and document, from torch's allocator."""
    # The rule on the shapes as given, before any validation: a call it refuses (a training batch's query
    # rows, another GPU) is validated once, by the path that takes it, and nothing is copied for nothing.
    if not (Q.is_cuda and Q.dtype in (torch.float16, torch.bfloat16) and H.dim() == 3 and Q.dim() in (2, 3)):
        return None
    if q_mask is not None or q_lengths is not None or d_lengths is not None:
        return None
    if d_mask is not None and not (isinstance(d_mask, torch.Tensor) and d_mask.dtype == torch.bool):
        return None
    dev = Q.device.index
    if choose_hidden_fused(device_properties(dev).cc, str(Q.dtype).removeprefix("torch."), Q.shape[-1], H.shape[-1],
                           Q.numel() // max(1, Q.shape[-1]), H.shape[0] * H.shape[1]) is None:
        return None
    from ._interop.torch_tensors import current_stream
    from ._runtime.hidden_maxsim import aligned, fused_width, key_count, score_hidden

    hp = check_hidden(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths)
    normalize, eps, max_chunk_bytes = check_hidden_options(normalize, eps, max_chunk_bytes)
    qn = fused_width(hp, dev, q_mask, q_lengths, d_lengths, CHUNK_BYTES if max_chunk_bytes is None else max_chunk_bytes)
    if qn is None:
        return None
    # (read by pointer: a negative-bit view's memory holds its values' negations, resolved first)
    q, h, w = (x.resolve_neg().contiguous() for x in (Q, H, W))
    if not aligned(q.data_ptr(), h.data_ptr(), w.data_ptr()):
        return None
    p = hp.p
    keys = torch.zeros(key_count(p.nq, p.lq, p.nd), dtype=torch.int64, device=Q.device)
    scores = torch.empty((p.nq, p.nd), dtype=torch.float32, device=Q.device)
    amax = torch.empty((p.nq, p.nd, p.lq), dtype=torch.int32, device=Q.device) if return_argmax else None
    b32 = None if bias is None else bias.resolve_neg().float().contiguous()
    dm = None if d_mask is None else d_mask.contiguous().view(torch.uint8)
    import cupy

    with cupy.cuda.Device(dev):
        score_hidden(q=q.data_ptr(), h=h.data_ptr(), w=w.data_ptr(), bias=0 if b32 is None else b32.data_ptr(),
                     dmask=0 if dm is None else dm.data_ptr(), keys=keys.data_ptr(), scores=scores.data_ptr(),
                     amax=0 if amax is None else amax.data_ptr(), nq=p.nq, lq=p.lq, nd=p.nd, ld=p.ld,
                     hidden=hp.hidden, dtype=p.dtype, qn=qn, normalize=normalize, eps=eps, device=dev,
                     stream=current_stream(dev).ptr)
    scores = scores.view(p.scores_shape)
    return scores, (no_argmax(scores) if amax is None else amax.view(p.argmax_shape))


def _torch_forward(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, return_argmax: bool,
                   max_chunk_bytes, precision):
    """The torch path's forward: ``(scores, argmax, D, ss)``, the projection ``D [R, d]`` and its rows' sums
    of squares ``ss`` as :func:`_project` gives them (a placeholder argmax without ``return_argmax``)."""
    hp = _checked(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths)
    normalize, eps, _ = check_hidden_options(normalize, eps, max_chunk_bytes)
    p = hp.p
    D, ss = _project(H.reshape(p.nd * p.ld, hp.hidden), W, bias, normalize, eps)
    out = maxsim(Q, D.view(H.shape[:-1] + (p.dim,)), q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths,
                 return_argmax=return_argmax, backend="gpu", precision=precision)
    scores, amax = out if return_argmax else (out, no_argmax(out))
    return scores, amax, D, ss


def _torch_backward(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize: bool, eps: float, D, ss):
    """The torch path's gradients ``(dQ, dH, dW, dbias)`` from the forward's projection ``D`` and ``ss``
    (:func:`_project`; read only: the projection's gradient is written over the MaxSim backward's dD)."""
    rows, dim = D.shape
    h2 = H.reshape(rows, H.shape[-1])
    dq, dD = maxsim_backward(grad_scores.float(), Q, D.view(H.shape[:-1] + (dim,)), argmax, validate=False,
                             backend="gpu")
    dP = dD.reshape(rows, dim)
    keep = _keep(d_mask, d_lengths, H.shape[1], rows, H.device)
    if normalize or keep is not None:
        _rows_launch("lik_hidden_normalize_grad", D, (D, dP, ss if normalize else None, keep), (rows, dim, eps))
    db = _no_bias_grad(W) if bias is None else dP.sum(0)  # (16-bit sums accumulate in float32)
    return dq.view(Q.shape), torch.mm(dP, W).view(H.shape), torch.mm(dP.t(), h2), db


def _checked(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths):
    """:func:`check_hidden`'s problem, kept for repeat calls of CUDA tensors without masks or lengths
    (their checks read more than a signature holds), keyed by the repeat-call path's signature: a
    training loop calls with the same shapes every step, and the checks took 43 us of a 1.3 ms step
    on an H200 host."""
    key = None
    if (q_mask is None and d_mask is None and q_lengths is None and d_lengths is None and Q.is_cuda and H.is_cuda
            and W.is_cuda and (bias is None or bias.is_cuda)):
        key = call_key("maxsim_from_hidden", (None,), Q, (H, W, bias), precision=False)
        hp = _CHECKED.get(key)
        if hp is not None:
            return hp
    hp = check_hidden(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths)
    if key is not None:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()  # (a loop of ever new shapes: no more kept than this)
        _CHECKED[key] = hp
    return hp


def _one_torch_chunk(Q, H, W, max_chunk_bytes) -> bool:
    """Whether a call takes the torch path (the module's docstring): CUDA float16 or bfloat16 inputs whose
    projected tokens, H's rows times W's, fit one chunk (mismatched arguments are left to the checks)."""
    if not (Q.is_cuda and H.dtype in (torch.float16, torch.bfloat16) and Q.dtype == H.dtype == W.dtype and H.dim() == 3
            and W.dim() == 2):
        return False
    budget = CHUNK_BYTES if max_chunk_bytes is None else max_chunk_bytes
    return H.shape[0] * H.shape[1] * W.shape[0] * H.element_size() <= budget


def _project(h2, W, bias, normalize: bool, eps: float):
    """``h2 [R, h] @ W.T + bias`` in h2's 16-bit type, normalised in place where ``normalize`` (the bias
    then added in float32 by the normalisation, as ``lik_cupy._runtime.hidden.project`` does); returns it
    and its rows' float32 sums of squares ``[R]`` (None without normalisation)."""
    if not normalize:
        return torch.nn.functional.linear(h2, W, bias), None
    D = torch.mm(h2, W.t())
    ss = torch.empty(D.shape[0], dtype=torch.float32, device=D.device)
    b32 = None if bias is None else bias.float()
    _rows_launch("lik_hidden_normalize", D, (D, b32, ss), (D.shape[0], D.shape[1], eps))
    return D, ss


def _keep(d_mask, d_lengths, ld: int, rows: int, device):
    """uint8 [rows]: the document tokens that take a gradient, or None where all do."""
    if d_mask is not None:
        return d_mask.reshape(rows).to(device=device, dtype=torch.uint8)
    if d_lengths is not None:
        lens = d_lengths.to(device=device).reshape(-1, 1)
        return (torch.arange(ld, device=device)[None, :] < lens).reshape(rows).to(torch.uint8)
    return None


def _rows_launch(entry: str, like, arrays: tuple, scalars: tuple) -> None:
    """``cuda_src/hidden.cu``'s ``entry`` for the rows of ``like`` (one warp a row), on torch's current
    stream of ``like``'s device: ``arrays`` (tensors, or None for null) by address, then ``scalars``."""
    import cupy

    from ._interop.torch_tensors import stream_handle
    from ._runtime.hidden import launch_rows

    dev = like.device.index
    dtype = "float16" if like.dtype == torch.float16 else "bfloat16"
    values = tuple(0 if a is None else a.data_ptr() for a in arrays) + scalars
    if cupy.cuda.runtime.getDevice() == dev:
        launch_rows(entry, dtype, dev, int(like.shape[0]), values, stream_handle(dev))
        return
    with cupy.cuda.Device(dev):
        launch_rows(entry, dtype, dev, int(like.shape[0]), values, stream_handle(dev))


def _input_grads(needs, grads, bias) -> tuple:
    """An autograd backward's return: dQ, dH, dW and dbias where ``needs`` (``ctx.needs_input_grad``) asks
    for them (dbias None without a bias), then None for every other input."""
    out = [x if need else None for x, need in zip(grads, needs[:4])]
    if bias is None:
        out[3] = None
    return (*out,) + (None,) * (len(needs) - 4)


def _no_bias_grad(W):
    """The bias gradient of a call without a bias: an empty tensor (an operator returns tensors only)."""
    return W.new_empty((0,))


for _name, _impl in (("maxsim_from_hidden", _forward_op), ("maxsim_from_hidden_backward", _backward_op)):
    for _key in ("CPU", "CUDA"):
        _lib.impl(_name, _impl, _key)
del _name, _impl, _key


@torch.library.register_fake("lik_cupy::maxsim_from_hidden", lib=_lib)
def _forward_fake(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, return_argmax,
                  max_chunk_bytes, precision):
    hp = check_hidden(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths)
    return fake_outputs(Q, hp.p, "auto", return_argmax, precision)


@torch.library.register_fake("lik_cupy::maxsim_from_hidden_backward", lib=_lib)
def _backward_fake(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize, eps, max_chunk_bytes, precision):
    check_hidden_backward(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths)
    return Q.new_empty(Q.shape), H.new_empty(H.shape), W.new_empty(W.shape), \
        (_no_bias_grad(W) if bias is None else bias.new_empty(bias.shape))


def _setup_context(ctx, inputs, output):
    Q, H, W, bias, _q_mask, d_mask, _q_lengths, d_lengths, normalize, eps, kept_argmax, chunk, precision = inputs
    ctx.save_for_backward(Q, H, W, bias, output[1], d_mask, d_lengths)
    ctx.normalize, ctx.eps, ctx.kept_argmax, ctx.chunk, ctx.precision = normalize, eps, kept_argmax, chunk, precision


def _autograd_backward(ctx, g, _g_amax):
    if not ctx.kept_argmax:
        raise RuntimeError("the gradient of lik_cupy::maxsim_from_hidden needs its argmax: call it with "
                           "return_argmax=True (lik_cupy.torch.maxsim_from_hidden does whenever a gradient is needed)")
    Q, H, W, bias, amax, d_mask, d_lengths = ctx.saved_tensors
    if not any(ctx.needs_input_grad[:4]):
        return (None,) * 13
    dq, dh, dw, db = torch.ops.lik_cupy.maxsim_from_hidden_backward.default(
        g.contiguous(), Q, H, W, bias, amax, d_mask, d_lengths, ctx.normalize, ctx.eps, ctx.chunk, ctx.precision)
    return _input_grads(ctx.needs_input_grad, (dq, dh, dw, db), bias)


torch.library.register_autograd("lik_cupy::maxsim_from_hidden", _autograd_backward, setup_context=_setup_context,
                                lib=_lib)
torch.library.register_autograd("lik_cupy::maxsim_from_hidden_backward",
                                no_second_derivative("lik_cupy::maxsim_from_hidden_backward"),
                                setup_context=lambda ctx, inputs, output: None, lib=_lib)

# The forward operator, as lik_cupy.torch.maxsim_from_hidden calls it while tracing.
maxsim_from_hidden_op = torch.ops.lik_cupy.maxsim_from_hidden.default


# ---------------------------------------------------------------- eager


class _FromHidden(torch.autograd.Function):
    """The operators' implementations as an autograd.Function, for eager calls: torch.library's Python
    dispatch and autograd wrapper cost about 0.4 ms of a training step's host time (an H200 host's
    profile), where this costs microseconds."""

    @staticmethod
    def forward(ctx, Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, max_chunk_bytes, precision):
        # The torch path keeps its projection for the backward (a sixth of H at h = 768, d = 128): one GEMM
        # and one normalisation fewer in a step bound by their host time. The one-pass kernel has none to keep.
        kept = (None, None)
        fused = _fused_forward(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, True,
                               max_chunk_bytes)
        if fused is not None:  # (as an inference call scores: the backward projects again)
            scores, amax = fused
        elif _one_torch_chunk(Q, H, W, max_chunk_bytes):
            scores, amax, *kept = _torch_forward(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps,
                                                 True, max_chunk_bytes, precision)
        else:
            scores, amax = _forward_op(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, True,
                                       max_chunk_bytes, precision)
        ctx.save_for_backward(Q, H, W, bias, amax, d_mask, d_lengths, *kept)
        ctx.options = (normalize, eps, max_chunk_bytes, precision)
        ctx.mark_non_differentiable(amax)
        return scores, amax

    @staticmethod
    def backward(ctx, g, _g_amax):
        Q, H, W, bias, amax, d_mask, d_lengths, D, ss = ctx.saved_tensors
        if not any(ctx.needs_input_grad[:4]):
            return (None,) * 12
        normalize, eps, chunk, precision = ctx.options
        if through_operator(g):
            dq, dh, dw, db = torch.ops.lik_cupy.maxsim_from_hidden_backward.default(
                g.contiguous(), Q, H, W, bias, amax, d_mask, d_lengths, normalize, eps, chunk, precision)
        elif D is not None:
            dq, dh, dw, db = _torch_backward(g.contiguous(), Q, H, W, bias, amax, d_mask, d_lengths, normalize, eps, D, ss)
        else:
            dq, dh, dw, db = _backward_op(g.contiguous(), Q, H, W, bias, amax, d_mask, d_lengths, normalize, eps, chunk,
                                          precision)
        return _input_grads(ctx.needs_input_grad, (dq, dh, dw, db), bias)


class _FromHiddenFunc(torch.autograd.Function):
    """:class:`_FromHidden` in the form ``torch.func`` takes (``_torch_autograd._MaxSimFunc`` says why
    only under its transforms), on the operators' implementations, with a ``vmap`` rule."""

    @staticmethod
    def forward(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, max_chunk_bytes, precision):
        return _forward_op(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, True, max_chunk_bytes,
                           precision)

    @staticmethod
    def setup_context(ctx, inputs, output):
        Q, H, W, bias, _q_mask, d_mask, _q_lengths, d_lengths, *options = inputs
        ctx.save_for_backward(Q, H, W, bias, output[1], d_mask, d_lengths)
        ctx.options = options
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, g, _g_amax):
        Q, H, W, bias, amax, d_mask, d_lengths = ctx.saved_tensors
        if not any(ctx.needs_input_grad[:4]):
            return (None,) * 12
        grads = _FromHiddenBackward.apply(g.contiguous(), Q, H, W, bias, amax, d_mask, d_lengths, *ctx.options)
        return _input_grads(ctx.needs_input_grad, grads, bias)

    @staticmethod
    def vmap(info, in_dims, *inputs):
        return vmap_each(info.batch_size, in_dims[:8], inputs[:8], lambda *t: _FromHiddenFunc.apply(*t, *inputs[8:]))


class _FromHiddenBackward(torch.autograd.Function):
    """The backward's implementation as a function ``torch.func`` can batch, with no gradient of its own."""

    @staticmethod
    def forward(g, Q, H, W, bias, amax, d_mask, d_lengths, normalize, eps, max_chunk_bytes, precision):
        return _backward_op(g, Q, H, W, bias, amax, d_mask, d_lengths, normalize, eps, max_chunk_bytes, precision)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = staticmethod(no_second_derivative("lik_cupy.torch.maxsim_from_hidden's backward"))

    @staticmethod
    def vmap(info, in_dims, *inputs):
        return vmap_each(info.batch_size, in_dims[:8], inputs[:8],
                         lambda *t: _FromHiddenBackward.apply(*t, *inputs[8:]))


def from_hidden_eager(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, return_argmax,
                      max_chunk_bytes, precision, need_grad: bool):
    """``(scores, argmax)`` of an eager call, as the operator gives them: through :class:`_FromHidden` where a
    gradient is needed (the argmax then kept), under ``torch.func``'s transforms through
    :class:`_FromHiddenFunc`, else the forward's implementation alone."""
    if transformed():
        return _FromHiddenFunc.apply(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps,
                                     max_chunk_bytes, precision)
    if need_grad:
        return _FromHidden.apply(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, max_chunk_bytes,
                                 precision)
    return _forward_op(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, return_argmax,
                       max_chunk_bytes, precision)
