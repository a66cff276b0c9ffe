"""PyTorch autograd for MaxSim: ``lik_cupy.torch.maxsim``, ``maxsim_varlen`` and ``maxsim_from_hidden``.

Importing this module imports torch (``import lik_cupy`` alone never does). The forward keeps
only the int32 argmax ``[Nq, Nd, Lq]`` for the backward, never the similarity tensor; the
backward is ``lik_cupy.maxsim_backward``. CPU tensors are scored on the CPU (the NumPy path,
``backend="cpu"``), CUDA tensors on their GPU.

``torch.compile``: importing this module registers three operators, ``torch.ops.lik_cupy.maxsim``,
``maxsim_varlen`` and ``maxsim_backward``, for CPU and CUDA tensors, with fake implementations
(their shapes are the ones ``lik_cupy._validate`` gives the call) and the forward's autograd
formula. While ``torch.compile`` (or ``torch.export``, or ``torch.jit.trace``) traces, and for tensor
subclasses such as fake tensors, the two functions call these operators, so a training step compiles with
``fullgraph=True``, backward included, without a graph break. ``method``, ``precision`` and
``return_argmax`` are operator arguments; lengths and offsets given as Python ints or lists
become tensors (pass tensors when they change from step to step, or each new list is a guard
to recompile). An eager call skips the dispatcher: it applies a ``torch.autograd.Function``
straight over ``lik_cupy.maxsim`` (or calls ``lik_cupy.maxsim`` alone when no gradient is
needed), because each of the registered forms (``torch.library.custom_op``,
``Library.define``/``impl`` with ``register_autograd`` or with an ``autograd.Function`` at the
Autograd key) adds 13 to 22 us of host time to an eager call, where the autograd.Function adds
under one and this module's whole eager wrapper about two (``bench/tools/torch_op_overhead.py``).

``torch.func``: ``grad``, ``vmap``, ``vmap`` of ``grad`` (per-sample gradients) and ``jacrev`` take
eager calls of the three functions through autograd.Functions whose ``vmap`` rules make one call
per element of the batch (any tensor argument batched: queries, documents, masks, lengths).
Batched gradients of ``torch.autograd.grad(..., is_grads_batched=True)`` (and so
``torch.autograd.functional.jacobian(..., vectorize=True)``) take the backward operator, one call per
element.

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
lik_cupy's Python. ``maxsim_from_hidden``'s operator is ``torch.ops.lik_cupy.maxsim_from_hidden``
(``lik_cupy/_torch_hidden.py``); eager calls take an autograd.Function over the same implementation.
"""

from __future__ import annotations

import torch

from ._torch_autograd import apply as _apply
from ._torch_autograd import as_tensor as _tensor
from ._torch_autograd import backend_of as _backend
from ._torch_autograd import check_method as _check_method
from ._torch_autograd import check_tensors as _check_tensors
from ._torch_autograd import keeps_argmax as _keeps_argmax
from ._torch_autograd import needs_grad as _needs_grad
from ._torch_autograd import traced as _traced
from ._torch_autograd import transformed as _transformed
from ._torch_hidden import from_hidden_eager as _from_hidden_eager
from ._torch_hidden import maxsim_from_hidden_op as _maxsim_from_hidden_op
from ._validate import check_flag as _check_flag
from ._validate import check_hidden_options as _check_hidden_options
from .forward import maxsim as _maxsim
from .forward import maxsim_varlen as _maxsim_varlen

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
    _check_tensors(Q=Q, D=D)
    _check_method(method)
    return_argmax = _check_flag("return_argmax", return_argmax)  # a truthy "no" would ask for the argmax
    if _traced(Q):
        scores, amax = torch.ops.lik_cupy.maxsim.default(Q, D, q_mask, d_mask, _tensor(q_lengths, Q),
                                                         _tensor(d_lengths, Q), method,
                                                         _keeps_argmax(return_argmax, _needs_grad(Q, D)), precision)
        return (scores, amax) if return_argmax else scores
    extras = (q_mask, d_mask, q_lengths, d_lengths)
    if not (_needs_grad(Q, D) or _transformed()):  # a serving call: lik_cupy.maxsim alone
        return _maxsim(Q, D, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths, return_argmax=return_argmax,
                       backend=_backend(Q), precision=precision)

    def call(q, d, qm, dm, ql, dl):
        return _maxsim(q, d, qm, dm, q_lengths=ql, d_lengths=dl, return_argmax=True, backend=_backend(q),
                       precision=precision)

    return _apply(Q, D, None, method, call, return_argmax, extras)


def maxsim_varlen(Q, D_tokens, d_offsets, q_mask=None, *, q_lengths=None, method="auto", return_argmax=False,
                  precision=None):
    """``lik_cupy.maxsim_varlen`` (packed documents ``D_tokens [T, d]`` with ``d_offsets``)
    with gradients for Q and D_tokens. Padded queries only (``q_mask`` / ``q_lengths``).
    Under ``torch.compile`` the call is the operator ``torch.ops.lik_cupy.maxsim_varlen``."""
    _check_tensors(Q=Q, D_tokens=D_tokens)
    _check_method(method)
    return_argmax = _check_flag("return_argmax", return_argmax)
    if _traced(Q):
        scores, amax = torch.ops.lik_cupy.maxsim_varlen.default(Q, D_tokens, _tensor(d_offsets, Q), q_mask,
                                                                _tensor(q_lengths, Q), method,
                                                                _keeps_argmax(return_argmax, _needs_grad(Q, D_tokens)),
                                                                precision)
        return (scores, amax) if return_argmax else scores
    if not (_needs_grad(Q, D_tokens) or _transformed()):
        return _maxsim_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths=q_lengths, return_argmax=return_argmax,
                              backend=_backend(Q), precision=precision)
    offsets = _tensor(d_offsets, Q)  # the backward reads them too

    def call(q, d, off, qm, ql):
        return _maxsim_varlen(q, d, off, qm, q_lengths=ql, return_argmax=True, backend=_backend(q),
                              precision=precision)

    # (the offsets are the backward's d_offsets and the call's first extra: vmap slices both alike)
    return _apply(Q, D_tokens, offsets, method, call, return_argmax, (offsets, q_mask, q_lengths))


def maxsim_from_hidden(Q, H, W, bias=None, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None,
                       normalize=True, eps=1e-12, return_argmax=False, max_chunk_bytes=None, precision=None):
    """:func:`lik_cupy.maxsim_from_hidden` (documents as hidden states ``H [Nd, Ld, h]`` through
    ``W [d, h]`` and ``bias [d]``) with gradients for Q, H, W and bias (torch tensors, CUDA or CPU).

    Arguments and semantics as :func:`lik_cupy.maxsim_from_hidden`. The forward keeps the int32
    argmax; the backward (:func:`lik_cupy.maxsim_from_hidden_backward`) projects each chunk of
    documents again, so no projected tensor is saved for it, except in eager calls of float16 or
    bfloat16 CUDA tensors whose projection is one chunk, which keep it (``d / h`` of H's bytes);
    those project with torch's own GEMMs, under torch's matmul settings as ``F.linear`` is.
    Under ``torch.compile`` the call is the operator ``torch.ops.lik_cupy.maxsim_from_hidden``, with
    ``maxsim_from_hidden_backward`` as its autograd formula; eager calls run the same implementation
    through an autograd.Function.

    Returns:
        float32 scores ``[Nq, Nd]`` (float64 for float64 tensors) and, if asked, the int32 argmax.
    """
    _check_tensors(Q=Q, H=H, W=W, bias=bias)
    # Checked here, not cast: bool("no") would pass the operator's schema as True.
    normalize, eps, max_chunk_bytes = _check_hidden_options(normalize, eps, max_chunk_bytes)
    return_argmax = _check_flag("return_argmax", return_argmax)
    need = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (Q, H, W, bias))
    if _traced(Q):
        scores, amax = _maxsim_from_hidden_op(
            Q, H, W, bias, q_mask, d_mask, _tensor(q_lengths, Q), _tensor(d_lengths, Q), normalize, eps,
            _keeps_argmax(return_argmax, need), max_chunk_bytes, precision)
    else:
        scores, amax = _from_hidden_eager(Q, H, W, bias, q_mask, d_mask, _tensor(q_lengths, Q), _tensor(d_lengths, Q),
                                          normalize, eps, return_argmax, max_chunk_bytes, precision, need)
    return (scores, amax) if return_argmax else scores
