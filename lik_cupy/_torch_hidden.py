"""``lik_cupy.torch.maxsim_from_hidden``'s operators: ``torch.ops.lik_cupy.maxsim_from_hidden`` and
its backward, with fake implementations from ``_validate`` (``torch.compile``, ``torch.export``) and
the backward as the forward's autograd formula. Every call, eager or traced, goes through them (their
dispatch costs microseconds beside the projection). Registered on import, in the ``lik_cupy``
library that ``_torch_autograd`` defines."""

from __future__ import annotations

import torch

from ._torch_autograd import backend_of, fake_outputs, no_argmax, no_second_derivative
from ._validate import check_hidden, check_hidden_backward
from .fused_head import maxsim_from_hidden, maxsim_from_hidden_backward

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
    out = maxsim_from_hidden(Q, H, W, bias, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths,
                             normalize=normalize, eps=eps, return_argmax=return_argmax, max_chunk_bytes=max_chunk_bytes,
                             backend=backend_of(Q), precision=precision)
    return out if return_argmax else (out, no_argmax(out))


def _backward_op(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths, normalize, eps, max_chunk_bytes, precision):
    # the argmax is the forward's own: trusted, no host read (CUDA-graph capture)
    dq, dh, dw, db = maxsim_from_hidden_backward(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths=d_lengths,
                                                 normalize=normalize, eps=eps, max_chunk_bytes=max_chunk_bytes,
                                                 backend=backend_of(Q), precision=precision, validate=False)
    return dq, dh, dw, (_no_bias_grad(W) if db is None else db)


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
    grads = [x if need else None for x, need in zip((dq, dh, dw, db), ctx.needs_input_grad[:4])]
    if bias is None:
        grads[3] = None
    return (*grads,) + (None,) * 9


torch.library.register_autograd("lik_cupy::maxsim_from_hidden", _autograd_backward, setup_context=_setup_context,
                                lib=_lib)
torch.library.register_autograd("lik_cupy::maxsim_from_hidden_backward",
                                no_second_derivative("lik_cupy::maxsim_from_hidden_backward"),
                                setup_context=lambda ctx, inputs, output: None, lib=_lib)

# The forward operator, as lik_cupy.torch.maxsim_from_hidden calls it.
maxsim_from_hidden_op = torch.ops.lik_cupy.maxsim_from_hidden.default
