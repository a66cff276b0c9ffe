"""JAX: ``maxsim`` and ``maxsim_varlen`` with gradients, ``maxsim_int8`` and ``maxsim_int8_varlen``,
under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` as well as eagerly.

Importing this module imports jax (``import lik_cupy`` alone never does).

Training steps: where XLA's own einsum makes a faster ``jit(grad)`` step (small problems, by the
measured rule of ``lik_cupy._dispatch.jax_paths``; ``LIK_JAX_PATH=xla`` or ``kernel`` forces a
path), a differentiated ``maxsim`` is XLA's computation: an einsum, each query token's maximum
and their sum, with the kernels' semantics (masks, lengths, the NaN contract, the gradient to the
first winner), which JAX differentiates with no callback (``lik_cupy._jax_xla``). A call not
differentiated, and every other call, is one custom call in XLA's computation
(``lik_cupy._jax_ops``), jitted or not:

- on a CUDA device, a ``jax.experimental.buffer_callback`` (jax >= 0.7): the kernels read XLA's
  buffers and run on XLA's stream, and the host never waits for the device. A first run (and
  every run of the INT8 functions, the backward and batched calls) computes its results in
  CuPy's memory pool and copies them into XLA's buffers on the device; repeat runs of
  ``maxsim`` and ``maxsim_varlen`` write XLA's buffers directly. Scratch still comes from CuPy's
  pool: leave CuPy room beside JAX's preallocation (``XLA_PYTHON_CLIENT_MEM_FRACTION``, or
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false``).
- on the CPU, a ``jax.pure_callback`` running the NumPy path (``backend="cpu"``).

``backend``: "auto" (where XLA runs the computation), "gpu" (a call or trace with no CUDA GPU
visible, or no CuPy, raises RuntimeError), or "cpu" (the NumPy path; device arrays go to the
host and back).

Tracing a call compiles its forward kernels (``lik_cupy.warmup`` for its dtype, dim and query
length), so a first run does not hold XLA's stream while NVRTC works; a kernel variant that
warm-up did not prepare compiles on its first run. The precision of float32 inputs is fixed
then too: ``precision=``, else ``lik_cupy.set_precision``, else ``jax_default_matmul_precision``
as it is while tracing.

Gradients: ``maxsim`` and ``maxsim_varlen`` are ``jax.custom_vjp`` functions whose forward keeps
only the int32 argmax ``[*scores.shape, Lq]`` and whose backward is :func:`lik_cupy.maxsim_backward`,
a custom call of its own. The INT8 functions have no gradient: differentiating them raises
``TypeError``.

``jax.vmap``: one kernel launch for a batch of queries (``Q`` with its mask, lengths or scales)
against shared documents, and for a batch of single queries ``[Lq, d]`` each with its own
documents ``[Nd, Ld, d]`` (they become per-query candidates, in the backward too). Any other
batch runs one call per batch element, all in one custom call (``lik_cupy._batched_calls``);
so does the backward of a batch of queries against shared documents, each element having a
``dD`` of its own: pass such a batch as one ``[Nq, Lq, d]`` call where you can.
``method="csr"`` sorts with CuPy (thrust), which can wait on the host for XLA's stream; the
default ``"auto"`` (atomic) does not.

Lengths and offsets are never read on the host. A length outside ``[0, L]`` makes its query's
(or document's) scores NaN, and ``d_offsets`` that do not start at 0, decrease, or end
elsewhere than at ``T`` make every score NaN, where ``lik_cupy.maxsim`` raises ``ValueError``.
Likewise an INT8 document scale of a valid token that is negative, NaN or infinite makes its
document's scores NaN (``lik_cupy.maxsim_int8`` raises); a query token's negative or NaN scale
makes its query's scores NaN, as there (an infinite one multiplies its row's max, as there too).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_ops, _jax_xla
from ._dispatch.backend import check_backend, use_gpu
from ._dispatch.jax_paths import choose_jax_path
from ._validate import (HiddenProblem, Problem, check_call, check_hidden, check_hidden_options, check_scaled_scales,
                        check_varlen, host_ints)
from ._dispatch.select import check_backward_method
from ._dispatch.precision import fp32_accurate

__all__ = ["maxsim", "maxsim_varlen", "maxsim_int8", "maxsim_int8_varlen", "maxsim_from_hidden"]


def maxsim(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, method="auto", precision=None,
           backend="auto"):
    """:func:`lik_cupy.maxsim` as a JAX operation, differentiable in Q and D.

    Arguments and semantics as :func:`lik_cupy.maxsim` (``[Nq, Lq, d]`` or ``[Lq, d]`` queries;
    ``[Nd, Ld, d]``, ``[Nq, K, Ld, d]`` or ``[Ld, d]`` documents; float16, bfloat16, float32, or
    float64 with ``jax_enable_x64``), except that lengths outside ``[0, L]`` give NaN scores (the
    module docstring). Masks and lengths take no gradient. ``method``: the backward's dD method
    (:func:`lik_cupy.maxsim_backward`). ``precision``: as in :func:`lik_cupy.maxsim`, resolved
    when traced. ``backend``: "auto", "gpu" or "cpu" (the module docstring).

    Returns:
        float32 scores (float64 for float64 inputs), a ``jax.Array``.
    Example (on the CPU, the NumPy path; on a CUDA device the same code runs the kernels)::

        >>> import jax, jax.numpy as jnp
        >>> from lik_cupy.jax import maxsim
        >>> Q = jnp.array([[[1., 0.], [0., 1.]]])                           # 1 query, 2 tokens
        >>> D = jnp.array([[[1., 0.], [0., 0.]], [[0., 2.], [1., 1.]]])     # 2 documents
        >>> jax.jit(maxsim)(Q, D)
        Array([[1., 3.]], dtype=float32)
        >>> jax.jit(jax.grad(lambda q: maxsim(q, D).sum()))(Q)
        Array([[[2., 1.],
                [1., 2.]]], dtype=float32)
    """
    args = _arrays(Q=Q, D=D, q_mask=q_mask, d_mask=d_mask, q_lengths=q_lengths, d_lengths=d_lengths)
    p = check_call(*_stand_ins(args, "Q", "D", "q_mask", "d_mask", "q_lengths", "d_lengths"), pairs=False)
    return _staged(args, call=_Call.of("maxsim", p, method, precision, backend))


def maxsim_varlen(Q, D_tokens, d_offsets, q_mask=None, *, q_lengths=None, method="auto", precision=None,
                  backend="auto"):
    """:func:`lik_cupy.maxsim_varlen` (packed documents ``D_tokens [T, d]``, ``d_offsets [Nd + 1]``)
    as a JAX operation, differentiable in Q and D_tokens.

    Padded queries only (``Q [Nq, Lq, d]`` or ``[Lq, d]`` with ``q_mask`` or ``q_lengths``): the
    scores' shape must be known when traced. Offsets that break the contract give NaN scores
    (the module docstring). Other arguments as in :func:`maxsim`.

    Returns:
        float32 ``[Nq, Nd]`` (``[Nd]`` for a 2-D Q; float64 for float64 inputs).
    Example::

        >>> import jax, jax.numpy as jnp
        >>> from lik_cupy.jax import maxsim_varlen
        >>> Q = jnp.array([[1., 0.], [0., 1.]])                    # one query [Lq, d]
        >>> tokens = jnp.array([[1., 0.], [0., 2.], [1., 1.]])     # documents of 1 and 2 tokens
        >>> jax.jit(maxsim_varlen)(Q, tokens, jnp.array([0, 1, 3]))
        Array([1., 3.], dtype=float32)
    """
    args = _arrays(Q=Q, D_tokens=D_tokens, d_offsets=d_offsets, q_mask=q_mask, q_lengths=q_lengths)
    p = check_varlen(*_stand_ins(args, "Q", "D_tokens", "d_offsets", "q_mask", "q_lengths"), None)
    return _staged(args, call=_Call.of("maxsim_varlen", p, method, precision, backend))


def maxsim_int8(Q, D, d_scales, q_mask=None, d_mask=None, *, q_scales=None, q_lengths=None, d_lengths=None,
                backend="auto"):
    """:func:`lik_cupy.maxsim_int8` (INT8 documents with per-token scales) as a JAX operation.

    Arguments as :func:`lik_cupy.maxsim_int8`; lengths as in :func:`maxsim`. Not differentiable.

    Returns:
        float32 scores, a ``jax.Array``.
    """
    args = _arrays(Q=Q, D=D, d_scales=d_scales, q_mask=q_mask, d_mask=d_mask, q_scales=q_scales,
                   q_lengths=q_lengths, d_lengths=d_lengths)
    stand_ins = _stand_ins(args, "Q", "D", "d_scales", "q_mask", "d_mask", "q_scales", "q_lengths", "d_lengths")
    q, d, ds, qm, dm, qs, ql, dl = stand_ins
    p = check_call(q, d, qm, dm, ql, dl, pairs=False, scaled="int8")
    check_scaled_scales(p, q, d, qs, ds)
    return _staged(args, call=_Call.of("maxsim_int8", p, "auto", None, backend))


def maxsim_int8_varlen(Q, D_tokens, d_scales, d_offsets, q_mask=None, *, q_scales=None, q_lengths=None,
                       backend="auto"):
    """:func:`lik_cupy.maxsim_int8_varlen` (packed INT8 documents) as a JAX operation.

    Arguments as :func:`lik_cupy.maxsim_int8_varlen`; offsets as in :func:`maxsim_varlen`. Not
    differentiable.

    Returns:
        float32 ``[Nq, Nd]`` (``[Nd]`` for a 2-D Q).
    """
    args = _arrays(Q=Q, D_tokens=D_tokens, d_scales=d_scales, d_offsets=d_offsets, q_mask=q_mask,
                   q_scales=q_scales, q_lengths=q_lengths)
    q, d, ds, off, qm, qs, ql = _stand_ins(args, "Q", "D_tokens", "d_scales", "d_offsets", "q_mask", "q_scales",
                                          "q_lengths")
    p = check_varlen(q, d, off, qm, ql, None, scaled="int8")
    check_scaled_scales(p, q, d, qs, ds)
    return _staged(args, call=_Call.of("maxsim_int8_varlen", p, "auto", None, backend))

def maxsim_from_hidden(Q, H, W, bias=None, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None,
                       normalize=True, eps=1e-12, max_chunk_bytes=None, precision=None, backend="auto"):
    """:func:`lik_cupy.maxsim_from_hidden` (documents as hidden states ``H [Nd, Ld, h]`` through
    ``W [d, h]`` and ``bias [d]``) as a JAX operation, differentiable in Q, H, W and bias.

    Arguments and semantics as :func:`lik_cupy.maxsim_from_hidden`, lengths as in :func:`maxsim`
    (out of range: NaN scores). A ``jax.custom_vjp``: the forward is one custom call keeping the
    int32 argmax, the backward one custom call of :func:`lik_cupy.maxsim_from_hidden_backward`
    (each chunk of documents projected again). ``jax.vmap`` runs one call per batch element.

    Returns:
        float32 scores ``[Nq, Nd]`` (``[Nd]`` for a 2-D Q; float64 for float64 inputs), a ``jax.Array``.
    """
    args = _arrays(Q=Q, H=H, W=W, bias=bias, q_mask=q_mask, d_mask=d_mask, q_lengths=q_lengths, d_lengths=d_lengths)
    hp = check_hidden(*_stand_ins(args, "Q", "H", "W", "bias", "q_mask", "d_mask", "q_lengths", "d_lengths"))
    return _hidden_staged(args, call=_HiddenCall.of(hp, normalize, eps, max_chunk_bytes, precision, backend))


@dataclass(frozen=True)
class _HiddenCall:
    """What a ``maxsim_from_hidden`` computation depends on besides its arrays (static under ``jax.jit``)."""

    hp: HiddenProblem
    kwargs: tuple  # the public functions' keyword arguments: normalize, eps, max_chunk_bytes, precision
    backend: str

    @classmethod
    def of(cls, hp: HiddenProblem, normalize, eps, max_chunk_bytes, precision, backend: str) -> _HiddenCall:
        normalize, eps, max_chunk_bytes = check_hidden_options(normalize, eps, max_chunk_bytes)
        if backend == "gpu":
            use_gpu(backend, None)
        check_backend(backend)
        x3 = fp32_accurate(precision, "jax", hp.p.dtype)
        resolved = ("fp32" if x3 else "tf32") if hp.p.dtype in ("float32", "float64") else None
        return cls(hp, (("normalize", normalize), ("eps", eps), ("max_chunk_bytes", max_chunk_bytes),
                        ("precision", resolved)), backend)


@functools.partial(jax.jit, static_argnames=("call",))
def _hidden_staged(args: dict, call: _HiddenCall):
    p = call.hp.p
    dtype = jnp.float64 if p.dtype == "float64" else jnp.float32
    if math.prod(p.scores_shape) == 0:
        return jnp.zeros(p.scores_shape, dtype)
    args, bad = _clamped(dict(args), p)
    diff = {k: v for k, v in args.items() if k in ("Q", "H", "W", "bias")}
    rest = {k: v for k, v in args.items() if k not in diff}
    scores = _hidden(call, diff, rest)
    return scores if bad is None else jnp.where(bad, jnp.asarray(jnp.nan, scores.dtype), scores)


def _hidden_forward(call: _HiddenCall, diff: dict, rest: dict, argmax: bool) -> tuple:
    p = call.hp.p
    outs = [jax.ShapeDtypeStruct(p.scores_shape, jnp.float64 if p.dtype == "float64" else jnp.float32)]
    if argmax:
        outs.append(jax.ShapeDtypeStruct(p.argmax_shape, jnp.int32))
    return _jax_ops.call("maxsim_from_hidden", {**diff, **rest}, outs,
                         {"return_argmax": argmax, **dict(call.kwargs)}, call.backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _hidden(call: _HiddenCall, diff: dict, rest: dict):
    return _hidden_forward(call, diff, rest, argmax=False)[0]


def _hidden_fwd(call: _HiddenCall, diff: dict, rest: dict):
    scores, amax = _hidden_forward(call, diff, rest, argmax=True)
    return scores, (diff, amax, {k: v for k, v in rest.items() if k in ("d_mask", "d_lengths")})


def _hidden_bwd(call: _HiddenCall, residuals, g):
    diff, amax, d_valid = residuals
    arrays = {"grad_scores": g, **diff, "argmax": amax, **d_valid}
    outs = [jax.ShapeDtypeStruct(diff[k].shape, diff[k].dtype) for k in ("Q", "H", "W", "bias") if k in diff]
    kwargs = dict(call.kwargs, **({} if "bias" in diff else {"bias": None}))
    grads = _jax_ops.call("maxsim_from_hidden_backward", arrays, outs, kwargs, call.backend)
    return dict(zip([k for k in ("Q", "H", "W", "bias") if k in diff], grads)), None  # masks, lengths: no gradient


_hidden.defvjp(_hidden_fwd, _hidden_bwd)


# ---------------------------------------------------------------- the staged computation


@dataclass(frozen=True)
class _Call:
    """What a call's computation depends on besides its arrays (a static argument of ``jax.jit``)."""

    fn: str
    problem: Problem
    method: str
    precision: str | None  # resolved, for float32 and float64 inputs
    backend: str
    xla_on: frozenset  # the backends ("gpu", "cpu") where a differentiated call is XLA's einsum, not the kernels

    @classmethod
    def of(cls, fn: str, p: Problem, method: str, precision, backend: str) -> _Call:
        check_backward_method(method)
        if backend == "gpu":  # no GPU or no CuPy: the documented error now, not from inside XLA's run
            use_gpu(backend, None)
        check_backend(backend)
        x3 = fp32_accurate(precision, "jax", p.dtype)  # also checks the value
        resolved = ("fp32" if x3 else "tf32") if p.dtype in ("float32", "float64") else None
        return cls(fn, p, method, resolved, backend, _xla_on(fn, p, backend))

    @property
    def d_name(self) -> str:
        return "D_tokens" if self.problem.d_packed else "D"

    @property
    def scores_dtype(self):
        return jnp.float64 if self.problem.dtype == "float64" else jnp.float32


def _xla_on(fn: str, p: Problem, backend: str) -> frozenset:
    """Where ``maxsim`` takes XLA's einsum (``lik_cupy._jax_xla``) by the measured rule; the packed
    and INT8 functions always take the kernels (or the NumPy path)."""
    if fn != "maxsim":
        return frozenset()
    sides = ("gpu", "cpu") if backend == "auto" else (backend,)
    return frozenset(b for b in sides if choose_jax_path(b, p.nq, p.nd, p.lq, p.ld) == "xla")


def _arrays(**named) -> dict:
    """The given arguments as JAX arrays (or tracers), by name; lists and ints become arrays.
    Integers past int32 (lengths, offsets) where JAX keeps int32 (x64 off) are clipped to its
    range first, still out of range for their check (NaN scores): JAX would wrap them silently
    (2**32 + 2 into 2)."""
    out = {}
    for k, v in named.items():
        if v is None:
            continue
        given = v
        if isinstance(v, (list, tuple, int)):
            v = host_ints(k, v)  # (an integer past int64: a ValueError naming it, not jnp's OverflowError)
        try:
            if not isinstance(v, jax.Array) and not jax.config.jax_enable_x64:
                a = np.asarray(v)
                if a.dtype.kind in "iu" and a.dtype.itemsize * 8 - (a.dtype.kind == "i") > 31:
                    v = np.clip(a, -1, np.iinfo(np.int32).max).astype(np.int32)
            out[k] = v if isinstance(v, jax.Array) else jnp.asarray(v)
        except (TypeError, RuntimeError) as e:  # (object, string or float128 arrays; a torch tensor needing grad)
            what = type(given).__name__ + (f" of dtype {given.dtype}" if hasattr(given, "dtype") else "")
            raise TypeError(f"{k}: expected a JAX array, or an array or list of numbers JAX holds; got {what}"
                            + (f" ({e})" if isinstance(e, RuntimeError) else "")) from None
    return out


def _stand_ins(args: dict, *names) -> list:
    """Zero-byte NumPy arrays with each argument's shape and dtype (or None), for the shared
    argument checks, which read shapes and dtypes only."""
    return [None if n not in args else np.broadcast_to(np.zeros((), args[n].dtype), args[n].shape) for n in names]


@functools.partial(jax.jit, static_argnames=("call",))
def _staged(args: dict, call: _Call):
    p = call.problem
    if math.prod(p.scores_shape) == 0:
        return jnp.zeros(p.scores_shape, call.scores_dtype)
    args, bad = _clamped(dict(args), p)
    if call.fn in ("maxsim", "maxsim_varlen"):
        rest = {k: v for k, v in args.items() if k not in ("Q", call.d_name)}
        scores = _scores(call, args["Q"], args[call.d_name], rest)
    else:
        scores = _not_differentiable(call, args)
    return scores if bad is None else jnp.where(bad, jnp.asarray(jnp.nan, scores.dtype), scores)


def _clamped(args: dict, p: Problem):
    """Lengths clamped to ``[0, L]`` and offsets replaced by valid ones where they break the
    contract, so the kernels and the NumPy path never see bad values; and where the scores are
    NaN instead (bool, broadcastable to the scores; None when no lengths or offsets)."""
    bad = None
    for side, limit in (("q", p.lq), ("d", p.ld)):
        lengths = args.get(f"{side}_lengths")
        if lengths is None:
            continue
        wide = lengths.astype(jnp.promote_types(lengths.dtype, jnp.int32))  # (L past a narrow dtype's range)
        wrong = (wide < 0) | (wide > limit)
        args[f"{side}_lengths"] = jnp.clip(wide, 0, limit).astype(lengths.dtype)
        if side == "q":  # the query axes lead the scores' axes; the documents' axes end them
            wrong = wrong.reshape(wrong.shape + (1,) * (len(p.scores_shape) - wrong.ndim))
        bad = wrong if bad is None else bad | wrong
    off = args.get("d_offsets")
    if off is not None:
        wrong = (off[0] != 0) | (off[-1] != p.ntok) | jnp.any(off[1:] < off[:-1])
        args["d_offsets"] = jnp.where(wrong, jnp.zeros_like(off).at[-1].set(p.ntok), off)
        bad = wrong if bad is None else bad | wrong
    if args.get("d_scales") is not None:
        wrong = _bad_scales(args)
        bad = wrong if bad is None else bad | wrong
    return args, bad


def _bad_scales(args: dict):
    """INT8 documents with a valid token whose scale is negative, NaN or infinite (which the eager
    call refuses, naming it: traced, its documents' scores are NaN instead), broadcastable to the
    scores; those scales are set to 0 for the kernels and the NumPy path. Runs after the lengths
    and offsets are made valid."""
    ds = args["d_scales"]
    token = ~((ds >= 0) & (ds <= jnp.finfo(jnp.float32).max))
    off = args.get("d_offsets")
    if ds.ndim == 0:  # one scale for all of D: every score
        wrong = token
    elif off is None:  # padded [..., Ld]: masked and past-length tokens are not read
        if args.get("d_mask") is not None:
            token &= args["d_mask"].astype(bool)
        elif args.get("d_lengths") is not None:
            token &= jnp.arange(ds.shape[-1]) < args["d_lengths"][..., None]
        wrong = token.any(axis=-1)
    else:  # packed [T]: each token's document
        doc = jnp.searchsorted(off, jnp.arange(ds.shape[0]), side="right") - 1
        wrong = jnp.zeros(off.shape[0] - 1, bool).at[doc].max(token, mode="drop")
    args["d_scales"] = jnp.where(token, jnp.zeros_like(ds), ds)
    return wrong


def _scores(call: _Call, q, d, rest: dict):
    """The differentiable scores: the kernels (the NumPy path on the CPU), differentiated through
    XLA's einsum where ``call.xla_on`` names the platform XLA runs on."""
    if not call.xla_on:
        return _differentiable(call, q, d, rest)
    if call.backend != "auto" or len(call.xla_on) == 2:
        return _trained_on_xla(call, q, d, rest)
    return jax.lax.platform_dependent(
        q, d, rest, cuda=functools.partial(_trained_on_xla if "gpu" in call.xla_on else _differentiable, call),
        default=functools.partial(_trained_on_xla if "cpu" in call.xla_on else _differentiable, call))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _trained_on_xla(call: _Call, q, d, rest: dict):
    """Scores that a call not differentiated takes from the kernels (one custom call, nothing
    materialised), and a differentiated one from XLA's einsum, whose own VJP is the backward."""
    return _forward(call, {"Q": q, call.d_name: d, **rest}, argmax=False)[0]


def _trained_on_xla_fwd(call: _Call, q, d, rest: dict):
    scores, vjp = jax.vjp(lambda a, b: _jax_xla.maxsim(call.problem, a, b, rest, call.precision), q, d)
    return scores, vjp


def _trained_on_xla_bwd(call: _Call, vjp, g):
    return (*vjp(g), None)  # masks and lengths take no gradient


_trained_on_xla.defvjp(_trained_on_xla_fwd, _trained_on_xla_bwd)


def _forward(call: _Call, arrays: dict, argmax: bool) -> tuple:
    p = call.problem
    outs = [jax.ShapeDtypeStruct(p.scores_shape, call.scores_dtype)]
    if argmax:
        outs.append(jax.ShapeDtypeStruct(p.argmax_shape, jnp.int32))
    kwargs = {"return_argmax": argmax}
    if call.fn in ("maxsim", "maxsim_varlen"):
        kwargs["precision"] = call.precision
    warm = functools.partial(_jax_ops.compile_ahead, p.dtype, p.dim, p.lq, argmax, call.precision)
    return _jax_ops.call(call.fn, arrays, outs, kwargs, call.backend, warm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable(call: _Call, q, d, rest: dict):
    return _forward(call, {"Q": q, call.d_name: d, **rest}, argmax=False)[0]


def _differentiable_fwd(call: _Call, q, d, rest: dict):
    scores, amax = _forward(call, {"Q": q, call.d_name: d, **rest}, argmax=True)
    return scores, (q, d, amax, rest.get("d_offsets"))


def _differentiable_bwd(call: _Call, residuals, g):
    q, d, amax, off = residuals
    arrays = {"grad_scores": g, "Q": q, "D": d, "argmax": amax}
    if off is not None:
        arrays["d_offsets"] = off
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(d.shape, d.dtype)]
    dq, dd = _jax_ops.call("maxsim_backward", arrays, outs, {"method": call.method, "validate": False}, call.backend)
    return dq, dd, None  # masks, lengths and offsets take no gradient


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def _not_differentiable(call: _Call, args: dict):
    @jax.custom_jvp
    def scores(args):
        return _forward(call, args, argmax=False)[0]

    @scores.defjvp
    def _no_gradient(primals, tangents):
        raise TypeError(f"lik_cupy.jax.{call.fn} has no gradient (INT8 scores are not differentiable); "
                        "train through lik_cupy.jax.maxsim on float inputs")

    return scores(args)
