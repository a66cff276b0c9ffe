"""Argument checks of the fused projection head (``lik_cupy.fused_head``): queries ``Q [Nq, Lq, d]``
against documents given as hidden states ``H [Nd, Ld, h]`` with a projection ``W [d, h]`` and an
optional ``bias [d]``; shapes, dtypes, frameworks and devices, read without touching the data."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .arguments import Problem, _info, _same_place, _where, check_flag, check_valid

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_NO_BOUND = 2**63 - 1  # the largest max_chunk_bytes torch's operator schema takes (int64); any larger bounds nothing


@dataclass(frozen=True, kw_only=True)
class HiddenProblem:
    """A validated fused-head call: the scoring problem of ``Q`` against the projected documents
    (``p``: Q [nq, lq, dim], documents [nd, ld, dim]) and the hidden size ``hidden`` (W [dim, hidden])."""

    p: Problem
    hidden: int
    has_bias: bool


def check_hidden(Q, H, W, bias, q_mask, d_mask, q_lengths, d_lengths) -> HiddenProblem:
    """Q ``[Nq, Lq, d]`` or ``[Lq, d]``; H ``[Nd, Ld, h]``; W ``[d, h]``; bias ``[d]`` or None; all of
    one float dtype, framework and device; masks and lengths as :func:`lik_cupy.maxsim` takes them."""
    q = _info("Q", Q)
    if q.dtype not in _FLOATS:
        raise TypeError(f"Q has dtype {q.dtype}; expected float16, bfloat16, float32 or float64")
    if len(q.shape) not in (2, 3):
        raise ValueError(f"Q must be [Nq, Lq, d] or [Lq, d]; got shape {list(q.shape)}")
    dim = q.shape[-1]
    h = _info("H", H)
    w = _info("W", W)
    for name, x in (("H", h), ("W", w)):
        _same_place(name, x, q)
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but Q has {q.dtype}: cast one so they match")
    if len(h.shape) != 3:
        raise ValueError(f"H must be hidden states [Nd, Ld, h]; got shape {list(h.shape)}")
    hidden = h.shape[-1]
    if tuple(w.shape) != (dim, hidden):
        raise ValueError(f"W must be [d, h] = [{dim}, {hidden}] (Q's dim, H's hidden size); got shape {list(w.shape)}")
    if dim < 1 or hidden < 1:
        raise ValueError(f"Q's dim is {dim} and H's hidden size {hidden}; expected both at least 1")
    if bias is not None:
        b = _info("bias", bias)
        _same_place("bias", b, q)
        if b.dtype != q.dtype:
            raise TypeError(f"bias has dtype {b.dtype} but Q has {q.dtype}: cast one so they match")
        if tuple(b.shape) != (dim,):
            raise ValueError(f"bias has shape {list(b.shape)}; expected [{dim}] (Q's dim)")
    nq, lq = (q.shape[0], q.shape[1]) if len(q.shape) == 3 else (1, q.shape[0])
    nd, ld = h.shape[0], h.shape[1]
    scores_shape = tuple(q.shape[:-2]) + (nd,)
    q_valid = check_valid("q", q_mask, q_lengths, q, q.shape[:-1], q.shape[:-2])
    d_valid = check_valid("d", d_mask, d_lengths, q, h.shape[:-1], h.shape[:-2], shape_of="H")
    p = Problem(framework=q.framework, device=q.device, dtype=q.dtype, nq=nq, lq=lq, nd=nd, ld=ld, dim=dim,
                candidates=False, scores_shape=scores_shape, argmax_shape=scores_shape + (lq,), q_valid=q_valid,
                d_valid=d_valid)
    return HiddenProblem(p=p, hidden=hidden, has_bias=bias is not None)


def check_hidden_backward(grad_scores, Q, H, W, bias, argmax, d_mask, d_lengths) -> HiddenProblem:
    """The fused head's backward: the forward's arguments (:func:`check_hidden`), ``grad_scores`` of
    the scores' shape (any float dtype) and the forward's int32 ``argmax`` (scores' shape + ``[Lq]``)."""
    hp = check_hidden(Q, H, W, bias, None, d_mask, None, d_lengths)
    p = hp.p
    g = _info("grad_scores", grad_scores)
    a = _info("argmax", argmax)
    q = _info("Q", Q)
    for name, x in (("grad_scores", g), ("argmax", a)):
        _same_place(name, x, q)
    if g.dtype not in _FLOATS:
        raise TypeError(f"grad_scores has dtype {g.dtype}; expected a float dtype")
    if tuple(g.shape) != p.scores_shape:
        raise ValueError(f"grad_scores has shape {list(g.shape)}; expected the scores' shape {list(p.scores_shape)}")
    if a.dtype != "int32":
        raise TypeError(f"argmax has dtype {a.dtype}; expected int32 (the forward's return_argmax=True result)")
    if tuple(a.shape) != p.argmax_shape:
        raise ValueError(f"argmax has shape {list(a.shape)}; expected {list(p.argmax_shape)} "
                         f"(the scores' shape and Lq, on {_where(q.device)})")
    return hp


def check_hidden_options(normalize, eps, max_chunk_bytes) -> tuple[bool, float, int | None]:
    """The fused head's options: ``normalize`` a bool, ``eps`` a positive finite float,
    ``max_chunk_bytes`` None or a positive int (NumPy's scalars too). Returns them as Python's
    ``bool``, ``float`` and ``int`` (what torch's operator schema takes: ``max_chunk_bytes`` at most
    int64's largest)."""
    normalize = check_flag("normalize", normalize)
    # An int compared as given (float() of one past float's range, 10**400, raises OverflowError); a NumPy
    # float as a Python float (float64's largest cast to float32 is inf, which let a float32 inf through)
    value = float(eps) if isinstance(eps, np.floating) else eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating)) or not 0 < value <= sys.float_info.max:
        raise ValueError(f"eps must be a positive finite float (the normalisation's floor), got {eps!r}")
    if max_chunk_bytes is not None and (isinstance(max_chunk_bytes, (bool, np.bool_))
                                        or not isinstance(max_chunk_bytes, (int, np.integer)) or max_chunk_bytes < 1):
        raise ValueError(f"max_chunk_bytes must be a positive int (bytes of projected tokens), got {max_chunk_bytes!r}")
    return normalize, float(eps), None if max_chunk_bytes is None else min(int(max_chunk_bytes), _NO_BOUND)
