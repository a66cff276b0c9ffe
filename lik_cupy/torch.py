"""PyTorch autograd for MaxSim: ``lik_cupy.torch.maxsim`` and ``maxsim_varlen``.

Importing this module imports torch (``import lik_cupy`` alone never does). The
forward keeps only the int32 argmax ``[Nq, Nd, Lq]`` for the backward, never the
similarity tensor; the backward is ``lik_cupy.maxsim_backward``.

``torch.compile``: the functions are excluded from tracing (``torch.compiler.disable``),
so a compiled model runs them eagerly behind a graph break; results are never
silently wrong.

CUDA graphs: a training step that calls these functions can be captured whole with
``torch.cuda.graph`` (or ``torch.cuda.make_graphed_callables``) and replayed. Every
kernel runs on torch's current stream and every buffer, scratch included, comes from
torch's caching allocator, so a capture takes them from the graph's private pool. Warm up
once outside the capture (the first call compiles its kernels). Inside a capture the
value checks of lengths and offsets are skipped (they need a host read); the kernels clamp
those values, so bad ones give wrong scores, never reads outside the inputs.
"""

from __future__ import annotations

import torch

from .backward import maxsim_backward
from .forward import maxsim as _maxsim
from .forward import maxsim_varlen as _maxsim_varlen

__all__ = ["maxsim", "maxsim_varlen"]

_disable = getattr(getattr(torch, "compiler", None), "disable", lambda f: f)


class _MaxSim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, D, d_offsets, method, call):
        scores, amax = call(Q.detach(), D.detach())
        ctx.save_for_backward(Q, D, amax, d_offsets)
        ctx.method = method
        ctx.mark_non_differentiable(amax)
        return scores, amax

    @staticmethod
    def backward(ctx, g, _g_amax):
        Q, D, amax, d_offsets = ctx.saved_tensors
        need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_q or need_d):
            return None, None, None, None, None
        dq, dd = maxsim_backward(g.contiguous(), Q.detach(), D.detach(), amax, d_offsets=d_offsets,
                                 method=ctx.method, validate=False)  # the argmax is our own
        return (dq if need_q else None), (dd if need_d else None), None, None, None


@_disable
def maxsim(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, method="auto", return_argmax=False,
           precision=None):
    """``lik_cupy.maxsim`` with gradients for Q and D (torch tensors, CUDA or CPU).

    Arguments and semantics as :func:`lik_cupy.maxsim` (in-batch ``D [Nd, Ld, d]``,
    candidates ``D [Nq, K, Ld, d]``, masks or lengths); ``method`` is the backward's
    dD method ("auto", "atomic" or "csr", see :func:`lik_cupy.maxsim_backward`).
    ``precision`` as in :func:`lik_cupy.maxsim` (None follows ``torch.backends.cuda.matmul``).
    Masks and lengths take no gradient. Returns float32 scores (float64 for float64 tensors) and,
    if asked, the int32 argmax.
    """
    def call(q, d):
        return _maxsim(q, d, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths, return_argmax=True,
                       precision=precision)

    return _apply(Q, D, None, method, call, return_argmax)


@_disable
def maxsim_varlen(Q, D_tokens, d_offsets, q_mask=None, *, q_lengths=None, method="auto", return_argmax=False,
                  precision=None):
    """``lik_cupy.maxsim_varlen`` (packed documents ``D_tokens [T, d]`` with ``d_offsets``)
    with gradients for Q and D_tokens. Padded queries only (``q_mask`` / ``q_lengths``)."""
    def call(q, d):
        return _maxsim_varlen(q, d, d_offsets, q_mask, q_lengths=q_lengths, return_argmax=True, precision=precision)

    return _apply(Q, D_tokens, d_offsets, method, call, return_argmax)


def _apply(Q, D, d_offsets, method, call, return_argmax):
    if method not in ("auto", "atomic", "csr"):  # checked here, not first at backward time
        raise ValueError(f"method must be one of ('auto', 'atomic', 'csr'), got {method!r}")
    if not torch.is_grad_enabled() or not (Q.requires_grad or D.requires_grad):
        scores, amax = call(Q, D)
    else:
        off = None if d_offsets is None else torch.as_tensor(d_offsets, dtype=torch.int64, device=Q.device)
        scores, amax = _MaxSim.apply(Q, D, off, method, call)
    return (scores, amax) if return_argmax else scores
