"""PyTorch autograd for MaxSim: ``lik_cupy.torch.maxsim`` and ``maxsim_varlen``.

Importing this module imports torch (``import lik_cupy`` alone never does). The forward keeps
only the int32 argmax ``[Nq, Nd, Lq]`` for the backward, never the similarity tensor; the
backward is ``lik_cupy.maxsim_backward``. CPU tensors are scored on the CPU (the NumPy path,
``backend="cpu"``), CUDA tensors on their GPU.

``torch.compile``: importing this module registers three operators, ``torch.ops.lik_cupy.maxsim``,
``maxsim_varlen`` and ``maxsim_backward`` (and the fused head's two, ``maxsim_from_hidden`` and
``maxsim_from_hidden_backward``, which ``maxsim_from_hidden`` always calls), for CPU and CUDA tensors, with fake implementations
(their shapes are the ones ``lik_cupy._validate`` gives the call) and the forward's autograd
formula. While ``torch.compile`` (or ``torch.export``) traces, and for tensor subclasses such as
fake tensors, the two functions call these operators, so a training step compiles with
``fullgraph=True``, backward included, without a graph break. ``method``, ``precision`` and
``return_argmax`` are operator arguments; lengths and offsets given as Python ints or lists
become tensors (pass tensors when they change from step to step, or each new list is a guard
to recompile). An eager call skips the dispatcher: it applies a ``torch.autograd.Function``
straight over ``lik_cupy.maxsim`` (or calls ``lik_cupy.maxsim`` alone when no gradient is
needed), because each of the registered forms (``torch.library.custom_op``,
``Library.define``/``impl`` with ``register_autograd`` or with an ``autograd.Function`` at the
Autograd key) adds 13 to 22 us of host time to an eager call, where the autograd.Function adds
under one and this module's whole eager wrapper about two (``bench/tools/torch_op_overhead.py``).

CUDA graphs: a training step that calls these functions, eager or compiled, can be captured
whole with ``torch.cuda.graph`` (or ``torch.cuda.make_graphed_callables``) and replayed. Every
kernel runs on torch's current stream and every buffer, scratch included, comes from torch's
caching allocator, so a capture takes them from the graph's private pool. Warm up once outside
the capture (the first call compiles its kernels). The pass that makes the scores of invalid
device lengths and offsets NaN is captured too and reads each replay's values; strict checks
(``validate=True``) are skipped inside a capture (they need a host read), and the kernels clamp
those values, so bad ones never read outside the inputs. Under ``torch.compile(mode="reduce-overhead")``
inductor's CUDA graphs take both operators (none is tagged cudagraph-unsafe, and their fake
implementations give static shapes): once warmed up and recorded, a replay runs none of
lik_cupy's Python.
"""

from __future__ import annotations

import functools
import numbers

import torch

from ._validate import check_backward, check_call, check_hidden, check_hidden_backward, check_varlen
from .backward import _METHODS
from .backward import maxsim_backward as _maxsim_backward
from .forward import _maxsim_varlen_zero_pad, _maxsim_zero_pad
from .forward import maxsim as _maxsim
from .forward import maxsim_varlen as _maxsim_varlen
from ._dispatch.precision import checked as _checked_precision
from .fused_head import maxsim_from_hidden as _maxsim_from_hidden
from .fused_head import maxsim_from_hidden_backward as _maxsim_from_hidden_backward

__all__ = ["maxsim", "maxsim_varlen", "maxsim_from_hidden"]


def maxsim(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, method="auto", return_argmax=False,
           precision=None):
    """``lik_cupy.maxsim`` with gradients for Q and D (torch tensors, CUDA or CPU).

    Arguments and semantics as :func:`lik_cupy.maxsim` (in-batch ``D [Nd, Ld, d]``,
    candidates ``D [Nq, K, Ld, d]``, masks or lengths); ``method`` is the backward's dD method
    ("auto", "atomic" or "csr", see :func:`lik_cupy.maxsim_backward`). ``precision`` as in
    :func:`lik_cupy.maxsim` (None follows ``torch.backends.cuda.matmul``). Masks and lengths take
    no gradient. Returns float32 scores (float64 for float64 tensors) and, if asked, the int32
    argmax. Under ``torch.compile`` the call is the operator ``torch.ops.lik_cupy.maxsim``.
    """
    _check_method(method)
    if _traced(Q):
        scores, amax = torch.ops.lik_cupy.maxsim.default(Q, D, q_mask, d_mask, _tensor(q_lengths, Q),
                                                         _tensor(d_lengths, Q), method,
                                                         return_argmax or _needs_grad(Q, D), precision)
        return (scores, amax) if return_argmax else scores
    if not _needs_grad(Q, D):  # a serving call: lik_cupy.maxsim alone
        return _maxsim(Q, D, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths, return_argmax=return_argmax,
                       backend=_backend(Q), precision=precision)

    def call(q, d):
        return _maxsim(q, d, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths, return_argmax=True,
                       backend=_backend(q), precision=precision)

    return _apply(Q, D, None, method, call, return_argmax)


def maxsim_varlen(Q, D_tokens, d_offsets, q_mask=None, *, q_lengths=None, method="auto", return_argmax=False,
                  precision=None):
    """``lik_cupy.maxsim_varlen`` (packed documents ``D_tokens [T, d]`` with ``d_offsets``)
    with gradients for Q and D_tokens. Padded queries only (``q_mask`` / ``q_lengths``).
    Under ``torch.compile`` the call is the operator ``torch.ops.lik_cupy.maxsim_varlen``."""
    _check_method(method)
    if _traced(Q):
        scores, amax = torch.ops.lik_cupy.maxsim_varlen.default(Q, D_tokens, _tensor(d_offsets, Q), q_mask,
                                                                _tensor(q_lengths, Q), method,
                                                                return_argmax or _needs_grad(Q, D_tokens), precision)
        return (scores, amax) if return_argmax else scores
    if not _needs_grad(Q, D_tokens):
        return _maxsim_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths=q_lengths, return_argmax=return_argmax,
                              backend=_backend(Q), precision=precision)
    offsets = _tensor(d_offsets, Q)  # the backward reads them too

    def call(q, d):
        return _maxsim_varlen(q, d, offsets, q_mask, q_lengths=q_lengths, return_argmax=True, backend=_backend(q),
                              precision=precision)

    return _apply(Q, D_tokens, offsets, method, call, return_argmax)


def maxsim_from_hidden(Q, H, W, bias=None, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None,
                       normalize=True, eps=1e-12, return_argmax=False, max_chunk_bytes=None, precision=None):
    """:func:`lik_cupy.maxsim_from_hidden` (documents as hidden states ``H [Nd, Ld, h]`` through
    ``W [d, h]`` and ``bias [d]``) with gradients for Q, H, W and bias (torch tensors, CUDA or CPU).

    Arguments and semantics as :func:`lik_cupy.maxsim_from_hidden`. The forward keeps the int32
    argmax; the backward (:func:`lik_cupy.maxsim_from_hidden_backward`) projects each chunk of
    documents again, so no projected tensor is saved for it. Every call, eager or traced, is the
    operator ``torch.ops.lik_cupy.maxsim_from_hidden`` (its dispatch costs microseconds beside
    the projection), with ``maxsim_from_hidden_backward`` as its autograd formula.

    Returns:
        float32 scores ``[Nq, Nd]`` (float64 for float64 tensors) and, if asked, the int32 argmax.
    """
    need = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (Q, H, W, bias))
    scores, amax = torch.ops.lik_cupy.maxsim_from_hidden.default(
        Q, H, W, bias, q_mask, d_mask, _tensor(q_lengths, Q), _tensor(d_lengths, Q), bool(normalize), float(eps),
        bool(return_argmax or need), max_chunk_bytes, precision)
    return (scores, amax) if return_argmax else scores


def _maxsim_zero_pad_grad(Q, D, zero_pad, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None,
                          method="auto", precision=None, validate=None):
    """:func:`maxsim` of documents with zero-vector padding (``lik_cupy.forward._maxsim_zero_pad``:
    ``zero_pad`` bool ``D.shape[:-2]``), with gradients; eager calls only (the operators take no such
    flags: ``lik_cupy.integrations`` score the padding as zero vectors while tracing)."""
    _check_method(method)
    _check_eager(Q)

    def call(q, d, argmax=True):
        return _maxsim_zero_pad(q, d, zero_pad, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths,
                                return_argmax=argmax, backend=_backend(q), precision=precision, validate=validate)

    return _apply(Q, D, None, method, call, False) if _needs_grad(Q, D) else call(Q, D, False)


def _maxsim_varlen_zero_pad_grad(Q, D_tokens, d_offsets, zero_pad, q_mask=None, *, q_lengths=None, method="auto",
                                 precision=None, validate=None):
    """:func:`maxsim_varlen` of documents with zero-vector padding (``zero_pad`` bool ``[Nd]``), as
    :func:`_maxsim_zero_pad_grad`; ``validate`` as in :func:`lik_cupy.maxsim_varlen` (False: offsets
    known good)."""
    _check_method(method)
    _check_eager(Q)
    if not _needs_grad(Q, D_tokens):
        return _maxsim_varlen_zero_pad(Q, D_tokens, d_offsets, zero_pad, q_mask, q_lengths=q_lengths,
                                       backend=_backend(Q), precision=precision, validate=validate)
    offsets = _tensor(d_offsets, Q)  # the backward reads them too

    def call(q, d):
        return _maxsim_varlen_zero_pad(q, d, offsets, zero_pad, q_mask, q_lengths=q_lengths, return_argmax=True,
                                       backend=_backend(q), precision=precision, validate=validate)

    return _apply(Q, D_tokens, offsets, method, call, False)


# ---------------------------------------------------------------- eager


class _MaxSim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, D, d_offsets, method, call):
        scores, amax = call(Q, D)
        ctx.save_for_backward(Q, D, amax, d_offsets)
        ctx.method = method
        ctx.mark_non_differentiable(amax)
        return scores, amax

    @staticmethod
    def backward(ctx, g, _g_amax):
        Q, D, amax, d_offsets = ctx.saved_tensors
        return (*_grads(ctx, g, Q, D, amax, d_offsets, _backward), None, None, None)


def _apply(Q, D, d_offsets, method, call, return_argmax):
    scores, amax = _MaxSim.apply(Q, D, d_offsets, method, call)
    return (scores, amax) if return_argmax else scores


# ---------------------------------------------------------------- shared by both paths


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _traced(Q) -> bool:
    """Whether the call goes through the registered operators: while torch.compile or torch.export
    traces, and for tensor subclasses (fake tensors among them), whose data lik_cupy cannot read."""
    return torch.compiler.is_compiling() or (type(Q) not in _PLAIN and isinstance(Q, torch.Tensor))


def _check_eager(Q) -> None:
    if _traced(Q):
        raise RuntimeError("zero-vector padding flags are for eager calls: while tracing, score the padding "
                           "as zero vectors (lik_cupy.integrations does)")


def _needs_grad(Q, D) -> bool:
    return torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)


def _backend(Q) -> str:
    return "gpu" if Q.is_cuda else "cpu"


def _check_method(method) -> None:
    if method not in _METHODS:  # checked with the forward, not first at backward time
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


def _tensor(x, like):
    """Lengths or offsets given as Python (or NumPy) ints or lists, as a tensor on ``like``'s
    device (the operators take tensors, and the backward saves the offsets); anything else as it is."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple, numbers.Integral)) and not isinstance(x, bool):
        t = torch.as_tensor(x, device=like.device)
        return t if t.numel() else t.long()  # (an empty list would be float32)
    return x


def _grads(ctx, g, Q, D, amax, d_offsets, backward):
    need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_q or need_d):
        return None, None
    dq, dd = backward(g.contiguous(), Q, D, amax, d_offsets, ctx.method)
    return (dq if need_q else None), (dd if need_d else None)


def _backward(g, Q, D, argmax, d_offsets, method):
    # The argmax is the forward's own: no value check, and so no host read (CUDA-graph capture).
    return _maxsim_backward(g, Q, D, argmax, d_offsets=d_offsets, method=method, validate=False,
                            backend=_backend(Q))


# ---------------------------------------------------------------- the operators (torch.compile, torch.export)

_lib = torch.library.Library("lik_cupy", "DEF")
_TAGS = (torch.Tag.pt2_compliant_tag,)
_lib.define("maxsim(Tensor Q, Tensor D, Tensor? q_mask, Tensor? d_mask, Tensor? q_lengths, Tensor? d_lengths, "
            "str method, bool return_argmax, str? precision) -> (Tensor, Tensor)", tags=_TAGS)
_lib.define("maxsim_varlen(Tensor Q, Tensor D_tokens, Tensor d_offsets, Tensor? q_mask, Tensor? q_lengths, "
            "str method, bool return_argmax, str? precision) -> (Tensor, Tensor)", tags=_TAGS)
_lib.define("maxsim_backward(Tensor grad_scores, Tensor Q, Tensor D, Tensor argmax, Tensor? d_offsets, str method) "
            "-> (Tensor, Tensor)", tags=_TAGS)
_lib.define("maxsim_from_hidden(Tensor Q, Tensor H, Tensor W, Tensor? bias, Tensor? q_mask, Tensor? d_mask, "
            "Tensor? q_lengths, Tensor? d_lengths, bool normalize, float eps, bool return_argmax, "
            "int? max_chunk_bytes, str? precision) -> (Tensor, Tensor)", tags=_TAGS)
_lib.define("maxsim_from_hidden_backward(Tensor grad_scores, Tensor Q, Tensor H, Tensor W, Tensor? bias, "
            "Tensor argmax, Tensor? d_mask, Tensor? d_lengths, bool normalize, float eps, int? max_chunk_bytes, "
            "str? precision) -> (Tensor, Tensor, Tensor, Tensor)", tags=_TAGS)


def _no_argmax(scores):
    """The argmax output of a call that did not ask for one: int32 ``scores.shape + (0,)``."""
    return scores.new_empty(tuple(scores.shape) + (0,), dtype=torch.int32)


def _maxsim_op(Q, D, q_mask, d_mask, q_lengths, d_lengths, method, return_argmax, precision):
    _check_method(method)
    out = _maxsim(Q, D, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths, return_argmax=return_argmax,
                  backend=_backend(Q), precision=precision)
    return out if return_argmax else (out, _no_argmax(out))


def _maxsim_varlen_op(Q, D_tokens, d_offsets, q_mask, q_lengths, method, return_argmax, precision):
    _check_method(method)
    out = _maxsim_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths=q_lengths, return_argmax=return_argmax,
                         backend=_backend(Q), precision=precision)
    return out if return_argmax else (out, _no_argmax(out))


def _maxsim_backward_op(grad_scores, Q, D, argmax, d_offsets, method):
    _check_method(method)
    return _backward(grad_scores, Q, D, argmax, d_offsets, method)


def _maxsim_from_hidden_op(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, return_argmax,
                           max_chunk_bytes, precision):
    out = _maxsim_from_hidden(Q, H, W, bias, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths,
                              normalize=normalize, eps=eps, return_argmax=return_argmax,
                              max_chunk_bytes=max_chunk_bytes, backend=_backend(Q), precision=precision)
    return out if return_argmax else (out, _no_argmax(out))


def _maxsim_from_hidden_backward_op(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize, eps,
                                    max_chunk_bytes, precision):
    # the argmax is the forward's own: trusted, no host read (CUDA-graph capture)
    dq, dh, dw, db = _maxsim_from_hidden_backward(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths=d_lengths,
                                                  normalize=normalize, eps=eps, max_chunk_bytes=max_chunk_bytes,
                                                  backend=_backend(Q), precision=precision, validate=False)
    return dq, dh, dw, (_no_bias_grad(W) if db is None else db)


def _no_bias_grad(W):
    """The bias gradient of a call without a bias: an empty tensor (an operator returns tensors only)."""
    return W.new_empty((0,))


for _name, _impl in (("maxsim", _maxsim_op), ("maxsim_varlen", _maxsim_varlen_op),
                     ("maxsim_backward", _maxsim_backward_op), ("maxsim_from_hidden", _maxsim_from_hidden_op),
                     ("maxsim_from_hidden_backward", _maxsim_from_hidden_backward_op)):
    for _key in ("CPU", "CUDA"):
        _lib.impl(_name, _impl, _key)


def _fake_outputs(Q, p, method, return_argmax, precision):
    """The forward's outputs as ``lik_cupy.maxsim`` shapes them: float32 scores (float64 for
    float64 inputs) of ``p.scores_shape``, int32 argmax of ``p.argmax_shape``."""
    _check_method(method)
    if precision is not None:
        _checked_precision(precision, "precision")
    scores = Q.new_empty(p.scores_shape, dtype=torch.float64 if Q.dtype == torch.float64 else torch.float32)
    return scores, (Q.new_empty(p.argmax_shape, dtype=torch.int32) if return_argmax else _no_argmax(scores))


@torch.library.register_fake("lik_cupy::maxsim", lib=_lib)
def _maxsim_fake(Q, D, q_mask, d_mask, q_lengths, d_lengths, method, return_argmax, precision):
    p = check_call(Q, D, q_mask, d_mask, q_lengths, d_lengths, pairs=False)
    return _fake_outputs(Q, p, method, return_argmax, precision)


@torch.library.register_fake("lik_cupy::maxsim_varlen", lib=_lib)
def _maxsim_varlen_fake(Q, D_tokens, d_offsets, q_mask, q_lengths, method, return_argmax, precision):
    p = check_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, None)
    return _fake_outputs(Q, p, method, return_argmax, precision)


@torch.library.register_fake("lik_cupy::maxsim_backward", lib=_lib)
def _maxsim_backward_fake(grad_scores, Q, D, argmax, d_offsets, method):
    _check_method(method)
    check_backward(grad_scores, Q, D, argmax, d_offsets)
    return Q.new_empty(Q.shape), D.new_empty(D.shape)


@torch.library.register_fake("lik_cupy::maxsim_from_hidden", lib=_lib)
def _maxsim_from_hidden_fake(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths, normalize, eps, return_argmax,
                             max_chunk_bytes, precision):
    hp = check_hidden(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths)
    return _fake_outputs(Q, hp.p, "auto", return_argmax, precision)


@torch.library.register_fake("lik_cupy::maxsim_from_hidden_backward", lib=_lib)
def _maxsim_from_hidden_backward_fake(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize, eps,
                                      max_chunk_bytes, precision):
    check_hidden_backward(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths)
    return Q.new_empty(Q.shape), H.new_empty(H.shape), W.new_empty(W.shape), \
        (_no_bias_grad(W) if bias is None else bias.new_empty(bias.shape))


def _hidden_setup_context(ctx, inputs, output):
    Q, H, W, bias, _q_mask, d_mask, _q_lengths, d_lengths, normalize, eps, kept_argmax, chunk, precision = inputs
    ctx.save_for_backward(Q, H, W, bias, output[1], d_mask, d_lengths)
    ctx.normalize, ctx.eps, ctx.kept_argmax, ctx.chunk, ctx.precision = normalize, eps, kept_argmax, chunk, precision


def _hidden_backward(ctx, g, _g_amax):
    if not ctx.kept_argmax:
        raise RuntimeError("the gradient of lik_cupy::maxsim_from_hidden needs its argmax: call it with "
                           "return_argmax=True (lik_cupy.torch.maxsim_from_hidden does whenever a gradient is needed)")
    Q, H, W, bias, amax, d_mask, d_lengths = ctx.saved_tensors
    if not any(ctx.needs_input_grad[:4]):
        return (None,) * 13
    dq, dh, dw, db = torch.ops.lik_cupy.maxsim_from_hidden_backward.default(
        g.contiguous(), Q, H, W, bias, amax, d_mask, d_lengths, ctx.normalize, ctx.eps, ctx.chunk, ctx.precision)
    grads = [x if need else None for x, need in zip((dq, dh, dw, db), ctx.needs_input_grad[:4])]
    if bias is None:
        grads[3] = None
    return (*grads,) + (None,) * 9


torch.library.register_autograd("lik_cupy::maxsim_from_hidden", _hidden_backward, setup_context=_hidden_setup_context,
                                lib=_lib)


def _setup_context(ctx, inputs, output, *, packed: bool):
    # Both forwards end in (method, return_argmax, precision); maxsim_varlen's third input is d_offsets.
    Q, D, *_, method, kept_argmax, _precision = inputs
    ctx.save_for_backward(Q, D, output[1], inputs[2] if packed else None)
    ctx.method, ctx.kept_argmax, ctx.n_inputs = method, kept_argmax, len(inputs)


def _op_backward(ctx, g, _g_amax):
    if not ctx.kept_argmax:
        raise RuntimeError("the gradient of lik_cupy's MaxSim operator needs its argmax: call it with "
                           "return_argmax=True (lik_cupy.torch does whenever a gradient is needed)")
    Q, D, amax, d_offsets = ctx.saved_tensors
    grads = _grads(ctx, g, Q, D, amax, d_offsets, torch.ops.lik_cupy.maxsim_backward.default)
    return grads + (None,) * (ctx.n_inputs - 2)


for _name, _packed in (("maxsim", False), ("maxsim_varlen", True)):
    torch.library.register_autograd(f"lik_cupy::{_name}", _op_backward,
                                    setup_context=functools.partial(_setup_context, packed=_packed), lib=_lib)
del _name, _impl, _key, _packed
