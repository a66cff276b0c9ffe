"""``lik_cupy.torch``'s machinery: the ``torch.autograd.Function`` eager calls apply, the
``torch.library`` operators (``lik_cupy::maxsim``, ``maxsim_varlen``, ``maxsim_backward``) registered
when this module is imported, and the zero-vector padding forms with gradients that
``lik_cupy.integrations`` call. ``lik_cupy.torch``'s docstring says why eager calls skip the
dispatcher and how tracing and CUDA graphs take the calls."""

from __future__ import annotations

import functools
import numbers

import torch

from ._validate import check_backward, check_call, check_varlen
from ._dispatch.select import check_backward_method as check_method  # (with the forward, not first at backward time)
from .backward import maxsim_backward as _maxsim_backward
from ._maxsim_calls import maxsim_varlen_zero_pad as _maxsim_varlen_zero_pad
from ._maxsim_calls import maxsim_zero_pad as _maxsim_zero_pad
from .forward import maxsim as _maxsim
from .forward import maxsim_varlen as _maxsim_varlen
from ._dispatch.precision import checked as _checked_precision


def maxsim_zero_pad_grad(Q, D, zero_pad, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None,
                          method="auto", precision=None, validate=None):
    """``lik_cupy.torch.maxsim`` of documents with zero-vector padding (``lik_cupy._maxsim_calls.maxsim_zero_pad``:
    ``zero_pad`` bool ``D.shape[:-2]``), with gradients; eager calls only (the operators take no such
    flags: ``lik_cupy.integrations`` score the padding as zero vectors while tracing)."""
    check_method(method)
    check_eager(Q)

    # The flags, masks and lengths are the call's extras, so that torch.func's vmap slices them with Q and D.
    def call(q, d, flags, qm, dm, ql, dl, argmax=True):
        return _maxsim_zero_pad(q, d, flags, qm, dm, q_lengths=ql, d_lengths=dl, return_argmax=argmax,
                                backend=backend_of(q), precision=precision, validate=validate)

    extras = (zero_pad, q_mask, d_mask, q_lengths, d_lengths)
    if not (needs_grad(Q, D) or transformed()):
        return call(Q, D, *extras, argmax=False)
    return apply(Q, D, None, method, call, False, extras)


def maxsim_varlen_zero_pad_grad(Q, D_tokens, d_offsets, zero_pad, q_mask=None, *, q_lengths=None, method="auto",
                                 precision=None, validate=None):
    """``lik_cupy.torch.maxsim_varlen`` of documents with zero-vector padding (``zero_pad`` bool ``[Nd]``), as
    :func:`maxsim_zero_pad_grad`; ``validate`` as in :func:`lik_cupy.maxsim_varlen` (False: offsets
    known good)."""
    check_method(method)
    check_eager(Q)
    if not (needs_grad(Q, D_tokens) or transformed()):  # (torch.func's tensors have no data: the Function's vmap rule)
        return _maxsim_varlen_zero_pad(Q, D_tokens, d_offsets, zero_pad, q_mask, q_lengths=q_lengths,
                                       backend=backend_of(Q), precision=precision, validate=validate)
    offsets = as_tensor(d_offsets, Q)  # the backward reads them too

    def call(q, d):
        return _maxsim_varlen_zero_pad(q, d, offsets, zero_pad, q_mask, q_lengths=q_lengths, return_argmax=True,
                                       backend=backend_of(q), precision=precision, validate=validate)

    return apply(Q, D_tokens, offsets, method, call, False)


# ---------------------------------------------------------------- eager


def no_second_derivative(name: str):
    """An autograd formula for a backward operator ``name`` that raises when its own gradient is asked
    for (``create_graph=True`` and then a gradient through it): the kernels give no second
    derivative, and without a formula torch would return the gradients detached, so a loss of them
    would be differentiated as if they were constants."""

    def backward(ctx, *grads):
        raise RuntimeError(f"{name} has no second derivative: a gradient of lik-cupy's MaxSim gradients "
                           f"(create_graph=True) is not supported")

    return backward


class _MaxSim(torch.autograd.Function):
    """The forward with its argmax saved for the backward. ``call(Q, D, *extras)`` scores; ``extras``
    are its masks, lengths or offsets (tensors, lists or None)."""

    @staticmethod
    def forward(ctx, Q, D, d_offsets, method, call, *extras):
        scores, amax = call(Q, D, *extras)
        _save(ctx, Q, D, amax, d_offsets, method)
        return scores, amax

    @staticmethod
    def backward(ctx, g, _g_amax):
        return _maxsim_grads(ctx, g)


class _MaxSimFunc(torch.autograd.Function):
    """``_MaxSim`` in the form ``torch.func`` takes (forward without ctx, then setup_context, and a
    ``vmap`` rule), for calls made under its transforms only: applying this form costs some 27 us
    more host time than ``_MaxSim`` (torch 2.13, CPU)."""

    @staticmethod
    def forward(Q, D, d_offsets, method, call, *extras):
        return call(Q, D, *extras)

    @staticmethod
    def setup_context(ctx, inputs, output):
        Q, D, d_offsets, method = inputs[:4]
        _save(ctx, Q, D, output[1], d_offsets, method)

    @staticmethod
    def backward(ctx, g, _g_amax):
        return _maxsim_grads(ctx, g)

    @staticmethod
    def vmap(info, in_dims, Q, D, d_offsets, method, call, *extras):
        return vmap_each(info.batch_size, in_dims[:3] + in_dims[5:], (Q, D, d_offsets, *extras),
                         lambda q, d, off, *ex: _MaxSimFunc.apply(q, d, off, method, call, *ex))


def _save(ctx, Q, D, amax, d_offsets, method) -> None:
    ctx.save_for_backward(Q, D, amax, d_offsets)
    ctx.method = method
    ctx.mark_non_differentiable(amax)


def _maxsim_grads(ctx, g):
    Q, D, amax, d_offsets = ctx.saved_tensors
    return (*_grads(ctx, g, Q, D, amax, d_offsets, _backward), *(None,) * (len(ctx.needs_input_grad) - 2))


class _Backward(torch.autograd.Function):
    """The backward's kernels as a function ``torch.func`` can batch (``vmap`` of ``grad``), with
    no gradient of its own."""

    @staticmethod
    def forward(g, Q, D, argmax, d_offsets, method):
        return _backward_kernels(g, Q, D, argmax, d_offsets, method)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = staticmethod(no_second_derivative("lik_cupy.torch's MaxSim backward"))

    @staticmethod
    def vmap(info, in_dims, g, Q, D, argmax, d_offsets, method):
        return vmap_each(info.batch_size, in_dims[:5], (g, Q, D, argmax, d_offsets),
                         lambda *a: _Backward.apply(*a, method))


def vmap_each(batch_size: int, dims, tensors, fn):
    """A ``torch.func.vmap`` rule: ``fn`` called once per element of the batch, each batched tensor
    (its dim in ``dims`` not None) sliced along that dim, the others as they are; the outputs
    stacked on dim 0. An empty batch gives empty outputs, shaped by one call on an element of zeros.
    A list or tuple argument (lengths as Python ints) has a list or tuple of dims, one per item
    (torch.func gives a pytree's dims in its structure): each item is taken the same way."""
    if batch_size == 0:
        zeros = lambda t, k: t.new_zeros(t.shape[:k] + t.shape[k + 1:])  # noqa: E731
        one = fn(*(_element(x, d, zeros) for x, d in zip(tensors, dims)))
        return tuple(o.new_empty((0,) + tuple(o.shape)) for o in one), (0,) * len(one)
    outs = [fn(*(_element(x, d, lambda t, k: t.select(k, b)) for x, d in zip(tensors, dims)))
            for b in range(batch_size)]
    return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])


def _element(x, dim, take):
    """``x`` for one element of a vmap batch: ``take(x, dim)`` where ``dim`` is an int, ``x`` itself where
    it is None, item by item where ``x`` is a list or tuple (``dim`` then one of the same length)."""
    if dim is None:
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_element(y, k, take) for y, k in zip(x, dim))
    return take(x, dim)


def transformed() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jacrev) is active: its tensors' data cannot be
    read, so calls go through ``_MaxSimFunc`` and ``_Backward``, which have the transforms' rules."""
    return torch._C._are_functorch_transforms_active()


def apply(Q, D, d_offsets, method, call, return_argmax, extras=()):
    fn = _MaxSimFunc if transformed() else _MaxSim
    scores, amax = fn.apply(Q, D, d_offsets, method, call, *extras)
    return (scores, amax) if return_argmax else scores


# ---------------------------------------------------------------- shared by both paths


_PLAIN = (torch.Tensor, torch.nn.Parameter)


# make_fx's tracing mode, by torch's private key (None where a torch lacks it: make_fx then records eager calls)
_PROXY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "PROXY", None)


def traced(Q) -> bool:
    """Whether the call goes through the registered operators: while torch.compile, torch.export,
    torch.jit.trace or make_fx traces (an eager call under jit.trace, or make_fx's real tracing mode,
    recorded its scores as a constant), and for tensor subclasses (fake tensors among them), whose data
    lik_cupy cannot read."""
    return (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or (_PROXY is not None and torch._C._get_dispatch_mode(_PROXY) is not None)
            or (type(Q) not in _PLAIN and isinstance(Q, torch.Tensor)))


def keeps_argmax(return_argmax: bool, need_grad: bool) -> bool:
    """The operators' ``return_argmax`` in a traced call: where asked for, where a gradient is needed, and
    always under torch.jit.trace, whose check runs the call again under no_grad and finds the graph changed
    (``Tracing failed sanity checks``) if the flag follows the grad mode."""
    return return_argmax or need_grad or torch.jit.is_tracing()


def check_eager(Q) -> None:
    if traced(Q):
        raise RuntimeError("zero-vector padding flags are for eager calls: while tracing, score the padding "
                           "as zero vectors (lik_cupy.integrations does)")


def needs_grad(Q, D) -> bool:
    return torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad)


def backend_of(Q) -> str:
    return "gpu" if Q.is_cuda else "cpu"


def check_tensors(**named) -> None:
    """The embeddings of a ``lik_cupy.torch`` call are torch tensors (an array of another framework,
    or None, raised an AttributeError on ``requires_grad``); only ``bias`` may be None."""
    for name, x in named.items():
        if x is None and name != "bias":
            raise TypeError(f"{name} is None; lik_cupy.torch takes torch tensors")
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} is a {type(x).__module__}.{type(x).__qualname__}; lik_cupy.torch takes torch "
                            "tensors (lik_cupy.maxsim takes any framework's arrays, without autograd)")


def as_tensor(x, like):
    """Lengths or offsets given as Python (or NumPy) ints or lists, as a tensor on ``like``'s
    device (the operators take tensors, and the backward saves the offsets); anything else as it is."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple, numbers.Integral)) and not isinstance(x, bool):
        t = torch.as_tensor(x, device=like.device)
        return t.long() if _no_numbers(x) else t  # (an empty list would be float32)
    return x


def _no_numbers(x) -> bool:
    """Whether ``x`` is a list or tuple with no number in it, however nested (``[]``, ``[[], []]``): read from
    the list, not the tensor made of it, whose ``numel()`` is a tensor under torch.jit.trace."""
    return isinstance(x, (list, tuple)) and all(_no_numbers(v) for v in x)


def _grads(ctx, g, Q, D, amax, d_offsets, backward):
    need_q, need_d = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_q or need_d):
        return None, None
    dq, dd = backward(g.contiguous(), Q, D, amax, d_offsets, ctx.method)
    return (dq if need_q else None), (dd if need_d else None)


# torch's legacy batched tensors (None where a torch lacks the test)
_IS_LEGACY_BATCHED = getattr(getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor", None)


def through_operator(g) -> bool:
    """Whether an eager backward calls its backward operator rather than the kernels: with
    create_graph=True (the operator's own gradient raises), and for a gradient batched by
    ``torch.autograd.grad(..., is_grads_batched=True)`` (``torch.autograd.functional.jacobian(...,
    vectorize=True)``): torch's legacy vmap, whose data the kernels cannot read and whose fallback runs
    the operator once per element."""
    return torch.is_grad_enabled() or (_IS_LEGACY_BATCHED is not None and _IS_LEGACY_BATCHED(g))


def _backward(g, Q, D, argmax, d_offsets, method):
    if transformed():  # torch.func (which differentiates with create_graph=True)
        return _Backward.apply(g, Q, D, argmax, d_offsets, method)
    if through_operator(g):
        return torch.ops.lik_cupy.maxsim_backward.default(g, Q, D, argmax, d_offsets, method)
    return _backward_kernels(g, Q, D, argmax, d_offsets, method)


def _backward_kernels(g, Q, D, argmax, d_offsets, method):
    # The argmax is the forward's own: no value check, and so no host read (CUDA-graph capture).
    return _maxsim_backward(g, Q, D, argmax, d_offsets=d_offsets, method=method, validate=False,
                            backend=backend_of(Q))


# ---------------------------------------------------------------- the operators (torch.compile, torch.export)

_lib = torch.library.Library("lik_cupy", "DEF")
_TAGS = (torch.Tag.pt2_compliant_tag,)
_lib.define("maxsim(Tensor Q, Tensor D, Tensor? q_mask, Tensor? d_mask, Tensor? q_lengths, Tensor? d_lengths, "
            "str method, bool return_argmax, str? precision) -> (Tensor, Tensor)", tags=_TAGS)
_lib.define("maxsim_varlen(Tensor Q, Tensor D_tokens, Tensor d_offsets, Tensor? q_mask, Tensor? q_lengths, "
            "str method, bool return_argmax, str? precision) -> (Tensor, Tensor)", tags=_TAGS)
_lib.define("maxsim_backward(Tensor grad_scores, Tensor Q, Tensor D, Tensor argmax, Tensor? d_offsets, str method) "
            "-> (Tensor, Tensor)", tags=_TAGS)


def no_argmax(scores):
    """The argmax output of a call that did not ask for one: int32 ``scores.shape + (0,)``."""
    return scores.new_empty(tuple(scores.shape) + (0,), dtype=torch.int32)


def _maxsim_op(Q, D, q_mask, d_mask, q_lengths, d_lengths, method, return_argmax, precision):
    check_method(method)
    out = _maxsim(Q, D, q_mask, d_mask, q_lengths=q_lengths, d_lengths=d_lengths, return_argmax=return_argmax,
                  backend=backend_of(Q), precision=precision)
    return out if return_argmax else (out, no_argmax(out))


def _maxsim_varlen_op(Q, D_tokens, d_offsets, q_mask, q_lengths, method, return_argmax, precision):
    check_method(method)
    out = _maxsim_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths=q_lengths, return_argmax=return_argmax,
                         backend=backend_of(Q), precision=precision)
    return out if return_argmax else (out, no_argmax(out))


def _maxsim_backward_op(grad_scores, Q, D, argmax, d_offsets, method):
    check_method(method)
    return _backward_kernels(grad_scores, Q, D, argmax, d_offsets, method)


for _name, _impl in (("maxsim", _maxsim_op), ("maxsim_varlen", _maxsim_varlen_op),
                     ("maxsim_backward", _maxsim_backward_op)):
    for _key in ("CPU", "CUDA"):
        _lib.impl(_name, _impl, _key)


def fake_outputs(Q, p, method, return_argmax, precision):
    """The forward's outputs as ``lik_cupy.maxsim`` shapes them: float32 scores (float64 for
    float64 inputs) of ``p.scores_shape``, int32 argmax of ``p.argmax_shape``."""
    check_method(method)
    if precision is not None:
        _checked_precision(precision, "precision")
    scores = Q.new_empty(p.scores_shape, dtype=torch.float64 if Q.dtype == torch.float64 else torch.float32)
    return scores, (Q.new_empty(p.argmax_shape, dtype=torch.int32) if return_argmax else no_argmax(scores))


@torch.library.register_fake("lik_cupy::maxsim", lib=_lib)
def _maxsim_fake(Q, D, q_mask, d_mask, q_lengths, d_lengths, method, return_argmax, precision):
    p = check_call(Q, D, q_mask, d_mask, q_lengths, d_lengths, pairs=False)
    return fake_outputs(Q, p, method, return_argmax, precision)


@torch.library.register_fake("lik_cupy::maxsim_varlen", lib=_lib)
def _maxsim_varlen_fake(Q, D_tokens, d_offsets, q_mask, q_lengths, method, return_argmax, precision):
    p = check_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, None)
    return fake_outputs(Q, p, method, return_argmax, precision)


@torch.library.register_fake("lik_cupy::maxsim_backward", lib=_lib)
def _maxsim_backward_fake(grad_scores, Q, D, argmax, d_offsets, method):
    check_method(method)
    check_backward(grad_scores, Q, D, argmax, d_offsets)
    return Q.new_empty(Q.shape), D.new_empty(D.shape)


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


torch.library.register_autograd("lik_cupy::maxsim_backward", no_second_derivative("lik_cupy::maxsim_backward"),
                                setup_context=lambda ctx, inputs, output: None, lib=_lib)
del _name, _impl, _key, _packed
