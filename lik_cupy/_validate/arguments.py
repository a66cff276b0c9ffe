"""Argument checking for the scoring functions.

Everything here reads shapes, dtypes, frameworks and devices only (plus the
values of length arrays, which must be range-checked), and raises a
``ValueError``/``TypeError`` that names the argument and what was expected,
before any data moves or any kernel runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .._dispatch.elements import elem_spec
from .._interop import FLOAT_DTYPES, Info
from .._interop import describe_named as _info

_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


@dataclass(frozen=True, kw_only=True)
class Problem:
    """A validated call, in canonical shapes: Q [nq, lq, dim], D [nsets * nd, ld, dim]."""

    framework: str
    device: int | None  # CUDA ordinal of the inputs, None for host inputs
    dtype: str
    nq: int
    lq: int
    nd: int  # documents scored per query
    ld: int
    dim: int
    candidates: bool  # D holds a separate set of nd documents for each query
    scores_shape: tuple[int, ...]
    argmax_shape: tuple[int, ...]
    q_valid: str | None  # "mask" | "lengths" | "offsets" | None
    d_valid: str | None
    d_packed: bool = False  # D is packed tokens [ntok, dim] with offsets (ld is then 0)
    ntok: int = 0  # packed document tokens


def host_ints(name: str, x, expected: str = "a rectangular list of integers") -> np.ndarray:
    """A host int, or list or tuple of ints, as NumPy makes it, for the caller's dtype and shape checks.
    Integers that no 64-bit type holds (2**70; 2**64 - 1 beside a negative one) NumPy makes an
    object or float64 array, which would read as a type error: a ValueError names one, as values
    out of range are named. Ragged nesting is a ValueError saying what was ``expected``."""
    try:
        a = np.asarray(x)
    except ValueError:  # NumPy's "inhomogeneous shape"
        raise ValueError(f"{name} is a ragged list (its rows differ in length); expected {expected}") from None
    if a.dtype.kind in "Of" and a.size:  # (strings, such as ids, are no integers to look for)
        flat = np.asarray(x, dtype=object).reshape(-1)
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in flat):
            bad = next((int(v) for v in flat if not -2**63 <= int(v) < 2**63), None)
            if bad is not None:
                raise ValueError(f"{name} holds {bad}; every entry must fit int64")
            return np.asarray(x, np.int64)  # (NumPy's float64 for np.uint64 beside a signed int: every one fits)
    return a


def _lengths_info(name: str, x, q: Info) -> Info | None:
    if x is None:
        return None
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        host_ints(name, x)  # (a Python int past int64)
        return Info(q.framework, q.device, "int64", ())  # a plain int goes with any framework, like a list
    if isinstance(x, (list, tuple)):
        arr = host_ints(name, x)
        if arr.dtype == object or arr.size and arr.dtype.kind not in "iu":  # never truncate 1.5 to 1
            raise TypeError(f"{name} must hold integers, got {str(list(x))[:80]}")
        return Info(q.framework, q.device, "int64", arr.shape)  # host list: accepted with any framework
    return _info(name, x)


def check_call(Q, D, q_mask, d_mask, q_lengths, d_lengths, *, pairs: bool, scaled: str | None = None) -> Problem:
    """``scaled``: a scaled element type ("int8", "float8_e4m3fn") that D holds as the kernels read it
    (``ElemSpec.numpy_dtype``: FP8 as uint8 bits), and Q too or a float (see :func:`check_scaled_scales`);
    the Problem's dtype is ``scaled``."""
    q = _info("Q", Q)
    d = _info("D", D)
    if q.framework != d.framework:
        raise TypeError(f"Q is a {q.framework} array but D is a {d.framework} array: pass both from one framework")
    if q.device != d.device:
        raise ValueError(f"Q is on {_where(q.device)} but D is on {_where(d.device)}: put both on one device")
    _check_dtypes(q, "D", d, scaled)

    if pairs:
        if len(q.shape) != 3 or len(d.shape) != 3:
            raise ValueError(f"maxsim_pairs needs Q [B, Lq, d] and D [B, Ld, d]; got Q {list(q.shape)}, D {list(d.shape)}")
        if q.shape[0] != d.shape[0]:
            raise ValueError(f"D has {d.shape[0]} documents but Q has {q.shape[0]} queries: maxsim_pairs scores Q[b] with D[b]")
    if len(q.shape) not in (2, 3):
        raise ValueError(f"Q must be [Nq, Lq, d] or [Lq, d]; got shape {list(q.shape)}")
    if len(d.shape) not in (2, 3, 4):
        raise ValueError(f"D must be [Nd, Ld, d], [Nq, K, Ld, d] or [Ld, d]; got shape {list(d.shape)}")
    dim = q.shape[-1]
    if d.shape[-1] != dim:
        raise ValueError(f"D has dim {d.shape[-1]} but Q has dim {dim}")
    if dim < 1:
        raise ValueError("Q and D have embedding dim 0; expected at least 1")

    nq, lq = (q.shape[0], q.shape[1]) if len(q.shape) == 3 else (1, q.shape[0])
    ld = d.shape[-2]
    candidates = pairs or len(d.shape) == 4
    if len(d.shape) == 4:
        if len(q.shape) != 3:
            raise ValueError(f"D [Nq, K, Ld, d] (per-query candidates) needs Q [Nq, Lq, d]; got Q shape {list(q.shape)}")
        if d.shape[0] != nq:
            raise ValueError(f"D has candidate sets for {d.shape[0]} queries but Q has {nq} queries")
        nd = d.shape[1]
    elif pairs:
        nd = 1
    else:
        nd = d.shape[0] if len(d.shape) == 3 else 1

    if pairs:
        scores_shape = (nq,)
    else:
        scores_shape = tuple(q.shape[:-2]) + tuple(d.shape[1:-2] if candidates else d.shape[:-2])
    argmax_shape = scores_shape + (lq,)

    q_valid = check_valid("q", q_mask, q_lengths, q, q.shape[:-1], q.shape[:-2])
    d_valid = check_valid("d", d_mask, d_lengths, q, d.shape[:-1], d.shape[:-2])
    return Problem(framework=q.framework, device=q.device, dtype=scaled or q.dtype, nq=nq, lq=lq,
                   nd=nd, ld=ld, dim=dim, candidates=candidates, scores_shape=scores_shape,
                   argmax_shape=argmax_shape, q_valid=q_valid, d_valid=d_valid)


def check_varlen(Q, D, d_offsets, q_mask, q_lengths, q_offsets, *, scaled: str | None = None) -> Problem:
    """Validate a ``maxsim_varlen`` call: packed documents D [T, d] with offsets [Nd + 1].

    Q is padded [Nq, Lq, d] / [Lq, d] (with q_mask or q_lengths), or packed
    [Tq, d] with q_offsets [Nq + 1]; for packed queries ``lq`` is left 0 and
    resolved from the offsets' values by the caller.
    """
    q = _info("Q", Q)
    d = _info("D_tokens", D)
    _same_place("D_tokens", d, q)
    _check_dtypes(q, "D_tokens", d, scaled)
    if len(d.shape) != 2:
        raise ValueError(f"D_tokens must be packed tokens [T, d]; got shape {list(d.shape)}")
    if q_offsets is not None and (q_mask is not None or q_lengths is not None):
        raise ValueError("packed queries (q_offsets) take no q_mask or q_lengths: the offsets give the lengths")
    if q_offsets is not None and len(q.shape) != 2:  # ranks first, as check_call does: then dims
        raise ValueError(f"with q_offsets, Q must be packed tokens [Tq, d]; got shape {list(q.shape)}")
    if q_offsets is None and len(q.shape) not in (2, 3):
        raise ValueError(f"Q must be [Nq, Lq, d] or [Lq, d] (or packed [Tq, d] with q_offsets); got shape {list(q.shape)}")
    dim = q.shape[-1]
    if d.shape[1] != dim:
        raise ValueError(f"D_tokens has dim {d.shape[1]} but Q has dim {dim}")
    if dim < 1:
        raise ValueError("Q and D_tokens have embedding dim 0; expected at least 1")
    nd = offsets_count("d_offsets", d_offsets, q)
    if q_offsets is not None:
        nq = offsets_count("q_offsets", q_offsets, q)
        scores_shape = (nq, nd)
        return Problem(framework=q.framework, device=q.device, dtype=scaled or q.dtype, nq=nq, lq=0,
                       nd=nd, ld=0, dim=dim, candidates=False, scores_shape=scores_shape,
                       argmax_shape=scores_shape + (0,), q_valid="offsets", d_valid="offsets", d_packed=True,
                       ntok=d.shape[0])
    nq, lq = (q.shape[0], q.shape[1]) if len(q.shape) == 3 else (1, q.shape[0])
    scores_shape = tuple(q.shape[:-2]) + (nd,)
    q_valid = check_valid("q", q_mask, q_lengths, q, q.shape[:-1], q.shape[:-2])
    return Problem(framework=q.framework, device=q.device, dtype=scaled or q.dtype, nq=nq, lq=lq,
                   nd=nd, ld=0, dim=dim, candidates=False, scores_shape=scores_shape,
                   argmax_shape=scores_shape + (lq,), q_valid=q_valid, d_valid="offsets", d_packed=True,
                   ntok=d.shape[0])


def check_docs(D, offsets, mask, lengths, name: str = "D", offsets_name: str = "d_offsets") -> Problem:
    """A float corpus on its own, before any query (``retrieve``'s and ``Corpus``'s documents, of the
    rank their layout takes): padded ``[Nd, Ld, d]`` with ``mask`` or ``lengths``, or packed tokens
    ``[T, d]`` with ``offsets``. Errors name the documents (``name``: "D", or "shard i" of an
    iterable corpus) where a scoring call's name Q. The Problem has no queries yet."""
    d = _info(name, D)
    if d.dtype not in _SCORING_DTYPES:
        raise TypeError(f"{name} has dtype {d.dtype}; expected float16, bfloat16, float32 or float64")
    if d.shape[-1] < 1:
        raise ValueError(f"{name} has embedding dim 0; expected at least 1")
    packed = offsets is not None
    if packed:
        nd, ld, d_valid = offsets_count(offsets_name, offsets, d, name), 0, "offsets"
    else:
        nd, ld = d.shape[0], d.shape[1]
        d_valid = check_valid("d", mask, lengths, d, d.shape[:-1], d.shape[:-2], name)
    return Problem(framework=d.framework, device=d.device, dtype=d.dtype, nq=0, lq=0, nd=nd, ld=ld, dim=d.shape[-1],
                   candidates=False, scores_shape=(0, nd), argmax_shape=(0, nd, 0), q_valid=None, d_valid=d_valid,
                   d_packed=packed, ntok=d.shape[0] if packed else 0)


def offsets_count(name: str, offsets, q: Info, ref_name: str = "Q") -> int:
    """Check an offsets argument's type and shape (in the framework and place of ``q``, the array
    ``ref_name``); returns the number of segments it describes."""
    if offsets is None:
        raise TypeError(f"{name} is required: int32/int64 [N + 1] offsets into the packed tokens")
    o = _lengths_info(name, offsets, q)
    _same_place(name, o, q, ref_name)
    if o.dtype not in ("int32", "int64"):
        raise TypeError(f"{name} must be int32 or int64, got dtype {o.dtype}")
    if len(o.shape) != 1 or o.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D [N + 1] with at least one entry; got shape {list(o.shape)}")
    return o.shape[0] - 1


def check_offset_values(name: str, first: int, last: int, decreasing: bool, total: int) -> None:
    """Offsets must start at 0, never decrease and end at the number of packed tokens."""
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {first}")
    if decreasing:
        raise ValueError(f"{name} must be non-decreasing (document i spans offsets[i]:offsets[i+1])")
    if last != total:
        raise ValueError(f"{name} ends at {last} but there are {total} packed tokens; the last offset must equal T")


# Scoring inputs: the GPU's dtypes, and float64, which runs on the CPU (lik_cupy._dispatch.backend).
_SCORING_DTYPES = FLOAT_DTYPES + ("float64",)


def _check_dtypes(q: Info, dname: str, d: Info, scaled: str | None) -> None:
    if scaled:
        spec = elem_spec(scaled)
        if d.dtype != spec.numpy_dtype:
            raise TypeError(f"{dname} has dtype {d.dtype}; expected {spec.accepted} (quantize it with "
                            f"lik_cupy.{spec.public_quantiser})")
        if q.dtype not in _SCORING_DTYPES + (spec.numpy_dtype,):
            raise TypeError(f"Q has dtype {q.dtype}; expected {spec.accepted} (with q_scales) or float16, bfloat16, "
                            "float32 or float64")
        return
    for name, info in (("Q", q), (dname, d)):
        if info.dtype not in _SCORING_DTYPES:
            raise TypeError(f"{name} has dtype {info.dtype}; expected float16, bfloat16, float32 or float64")
    if d.dtype != q.dtype:
        raise TypeError(f"{dname} has dtype {d.dtype} but Q has {q.dtype}: cast one so both match")


def check_quantized(name: str, X, sname: str, scales, dtype: str = "int8") -> Info:
    """``X [..., d]`` of scaled element type ``dtype`` (as the kernels read it: FP8 as uint8 bits) and
    float32 ``scales`` of shape ``X.shape[:-1]`` (or ``[]``, one per tensor), in one framework and place."""
    x = _info(name, X)
    spec = elem_spec(dtype)
    if x.dtype != spec.numpy_dtype:
        raise TypeError(f"{name} has dtype {x.dtype}; expected {spec.accepted}")
    if len(x.shape) < 1:
        raise ValueError(f"{name} must have at least one axis (the embedding dim)")
    check_scales(sname, scales, x, tuple(x.shape[:-1]), f"{name}'s shape without its last axis", name, per_tensor=True)
    return x


def check_scaled_scales(p: Problem, Q, D, q_scales, d_scales) -> bool:
    """Scales of a scaled call (``p.dtype`` INT8 or FP8): ``d_scales`` shaped like D without its last
    axis (packed: [T]) or ``[]`` (one per tensor); ``q_scales`` likewise for Q, required when Q is
    quantised and refused when Q is float. Returns whether Q is already quantised."""
    q = _info("Q", Q)
    d = _info("D_tokens" if p.d_packed else "D", D)
    check_scales("d_scales", d_scales, q, tuple(d.shape[:-1]), "one per document token", per_tensor=True)
    spec = elem_spec(p.dtype)
    if q.dtype == spec.numpy_dtype:
        if q_scales is None:
            raise TypeError(f"Q is {spec.name}, so q_scales is required (the float32 scales from "
                            f"{spec.public_quantiser})")
        check_scales("q_scales", q_scales, q, tuple(q.shape[:-1]), "one per query token", per_tensor=True)
        return True
    if q_scales is not None:
        article = "an" if spec.name[0] in "aeiou" else "a"
        raise ValueError(f"q_scales goes with {article} {spec.name} Q, but Q is {q.dtype} (it is quantised on the fly)")
    return False


def check_scales(name: str, scales, ref: Info, shape: tuple, what: str, ref_name: str = "Q", *,
                 per_tensor: bool = False) -> None:
    """Per-token scales: float32 of ``shape`` (or, ``per_tensor``, ``[]``: one for the whole tensor),
    in ``ref``'s framework and place (values not read)."""
    if scales is None:
        raise TypeError(f"{name} is required: float32 {list(shape)} ({what})")
    s = _info(name, scales)
    _same_place(name, s, ref, ref_name)
    if s.dtype != "float32":
        raise TypeError(f"{name} has dtype {s.dtype}; expected float32 (one scale per token; cast it)")
    if tuple(s.shape) != shape and not (per_tensor and s.shape == ()):
        also = " or [] (one per tensor)" if per_tensor else ""
        raise ValueError(f"{name} has shape {list(s.shape)}; expected {list(shape)} ({what}){also}")


def _where(dev) -> str:
    return "the host" if dev is None else f"cuda:{dev}"


def check_valid(side: str, mask, lengths, q: Info, mask_shape, len_shape, ref_name: str = "Q",
                shape_of: str | None = None) -> str | None:
    """One side's mask or lengths, in the framework and place of ``q`` (the array ``ref_name``);
    ``shape_of`` names the array whose shape the mask follows (default Q or D)."""
    what = shape_of or ("Q" if side == "q" else "D")
    if mask is not None and lengths is not None:
        raise ValueError(f"pass either {side}_mask or {side}_lengths, not both")
    if mask is not None:
        m = _info(f"{side}_mask", mask)
        _same_place(f"{side}_mask", m, q, ref_name)
        if m.dtype != "bool":
            raise TypeError(f"{side}_mask must be boolean (True = valid token), got dtype {m.dtype}")
        if tuple(m.shape) != tuple(mask_shape):
            raise ValueError(f"{side}_mask has shape {list(m.shape)}; expected {list(mask_shape)} ({what}'s shape without its last axis)")
        return "mask"
    if lengths is not None:
        li = _lengths_info(f"{side}_lengths", lengths, q)
        _same_place(f"{side}_lengths", li, q, ref_name)
        if li.dtype not in _INT_DTYPES:
            raise TypeError(f"{side}_lengths must be integers, got dtype {li.dtype}")
        if tuple(li.shape) != tuple(len_shape):
            one = "query" if side == "q" else "document"
            # ("expected []" alone reads as an empty list, which is refused too)
            per = f"one length per {one}" if len(len_shape) else \
                f"one int: {what} is one {one} {'[Lq, d]' if side == 'q' else '[Ld, d]'}"
            raise ValueError(f"{side}_lengths has shape {list(li.shape)}; expected {list(len_shape)} ({per})")
        return "lengths"
    return None


def check_zero_pad(zero_pad, p: Problem, shape, d_mask=None) -> None:
    """The zero-vector padding flags of a call (``lik_cupy._maxsim_calls.maxsim_zero_pad``): bool, one per
    document (``shape``: D's shape without its last two axes, or ``(Nd,)`` for packed documents), in
    Q's framework and place; or ``"masked"`` (the documents with a masked token), which needs the
    call's ``d_mask``."""
    if isinstance(zero_pad, str):
        if zero_pad != "masked":
            raise ValueError(f"zero_pad must be a boolean array or 'masked', got {zero_pad!r}")
        if d_mask is None:
            raise ValueError("zero_pad='masked' flags the documents with a masked token, so it needs a d_mask")
        return
    z = _info("zero_pad", zero_pad)
    _same_place("zero_pad", z, Info(p.framework, p.device, p.dtype, ()))
    if z.dtype != "bool":
        raise TypeError(f"zero_pad must be boolean (True = the document has zero-vector padding), got dtype {z.dtype}")
    if tuple(z.shape) != tuple(shape):
        raise ValueError(f"zero_pad has shape {list(z.shape)}; expected {list(shape)} (one flag per document)")


def _same_framework(name: str, a: Info, q: Info, qname: str = "Q") -> None:
    if a.framework != q.framework:
        raise TypeError(f"{name} is a {a.framework} array but {qname} is a {q.framework} array: pass both from one framework")


def _same_place(name: str, a: Info, q: Info, qname: str = "Q") -> None:
    _same_framework(name, a, q, qname)
    if a.device != q.device:
        raise ValueError(f"{name} is on {_where(a.device)} but {qname} is on {_where(q.device)}")


def check_flag(name: str, value, *, none: bool = False) -> bool | None:
    """An on/off argument: True or False (NumPy's bools too), as Python's bool, or with ``none`` also
    None (``validate``: the process default); anything else (a string such as "no", which is
    truthy) is a TypeError."""
    if none and value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {'None, ' if none else ''}True or False, got {value!r}")
    return bool(value)


def check_timeout(timeout, name: str = "timeout") -> None:
    """TypeError / ValueError unless ``timeout`` is a positive, finite number of seconds that a
    thread's join takes (``DistributedCorpus`` bounds its calls so; ``lik serve``'s ``cluster_timeout``
    is one); ``name``: the argument's, for the message."""
    if not isinstance(timeout, (int, float, np.integer, np.floating)) or isinstance(timeout, bool):
        raise TypeError(f"{name} must be a number of seconds, got {timeout!r}")
    if not 0 < timeout <= threading.TIMEOUT_MAX:
        raise ValueError(f"{name} must be a positive, finite number of seconds (at most {threading.TIMEOUT_MAX:.3g}), "
                         f"got {timeout!r}")


def check_32bit(**extents: int) -> None:
    """Every count a kernel indexes with a 32-bit int (``Nq=...``, ``grid=...``) must stay below 2**31."""
    for n, v in extents.items():
        if v >= 2**31:
            raise ValueError(f"{n} = {v} does not fit the kernel's 32-bit index; split the call")


def check_length_values(name: str, lo: int, hi: int, limit: int) -> None:
    """``lo``/``hi`` are the smallest and largest lengths given; valid range is [0, limit]."""
    if lo < 0 or hi > limit:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds {bad}; every length must be in [0, {limit}]")


def scale_error(name: str, index: tuple, value: float) -> ValueError:
    """The error for a (scaled type's) document scale of a valid token (at ``index``; ``()``: the one
    scale for all of D) that is negative, NaN or infinite."""
    at = f"[{', '.join(str(i) for i in index)}]" if index else " (one for all of D)"
    return ValueError(f"{name}{at} is {value!r}; the scale of a valid token must be finite and >= 0 "
                      "(token = values * scale)")


def check_backward(grad_scores, Q, D, argmax, d_offsets) -> Problem:
    """Validate a ``maxsim_backward`` call: the forward's Q and D (padded, per-query candidates,
    or packed with ``d_offsets``), float scores' gradient and the forward's int32 argmax."""
    p = check_call(Q, D, None, None, None, None, pairs=False) if d_offsets is None else \
        check_varlen(Q, D, d_offsets, None, None, None)
    q = _info("Q", Q)
    g = _info("grad_scores", grad_scores)
    _same_place("grad_scores", g, q)
    if g.dtype not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"grad_scores must be floating point, got dtype {g.dtype}")
    if tuple(g.shape) != tuple(p.scores_shape):
        raise ValueError(f"grad_scores has shape {list(g.shape)}; expected {list(p.scores_shape)} (the scores' shape)")
    a = _info("argmax", argmax)
    _same_place("argmax", a, q)
    if a.dtype != "int32":
        raise TypeError(f"argmax must be the forward's int32 argmax, got dtype {a.dtype}")
    if tuple(a.shape) != tuple(p.argmax_shape):
        raise ValueError(f"argmax has shape {list(a.shape)}; expected {list(p.argmax_shape)} (scores' shape + (Lq,))")
    return p


def check_argmax_values(lo: int, over: bool, what: str) -> None:
    """``lo``: smallest argmax entry; ``over``: some entry points past its document's end."""
    if lo < -1:
        raise ValueError(f"argmax holds {lo}; entries must be -1 (no token) or a token index of the document")
    if over:
        raise ValueError(f"argmax holds a token index past the end of its document ({what}); "
                         "pass the argmax the forward returned for these Q and D")
