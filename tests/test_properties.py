"""Property tests (hypothesis): random shapes, dtypes, masks, lengths and offsets at every public function.

Each draw builds a valid call, then usually breaks it in one or two documented ways (a wrong
dtype, shape, rank, mask, length, offset, argmax, k, ...). A broken call must raise ValueError or
TypeError (subclasses included) and nothing else; a valid call must return exactly what a naive
float64 reference written here says. Every input value is a small integer, so every product and
sum is exact in float16, bfloat16, float32 (TF32 on the GPU) and float64: scores, argmax ties
(lowest index) and NaN propagation are compared bit for bit (INT8 calls with a float Q, quantised by
the call, up to float32 rounding). Padding that masks or lengths exclude holds NaN, inf or huge
values, which must never show.

The ``gpu`` tests replay the same draws on the GPU (NumPy inputs with ``backend="gpu"``, or CuPy
arrays) and compare with the CPU path; ``bench/tools/sanitize.sh`` runs them under compute-sanitizer.
The GPU also gets calls the CPU refuses but the GPU promises to survive: unvalidated bad offsets
(``validate_offsets=False``) and out-of-range argmax entries (``validate=False``).
"""

from __future__ import annotations

import io
import json
import os
import pathlib
from dataclasses import dataclass, field
from unittest import mock

import ml_dtypes
import numpy as np
import pytest

import lik_cupy
from lik_cupy import _files, shards
from reference import HostDLPack

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ALLOWED = (ValueError, TypeError)
NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
FLOATS = tuple(NP)
BAD_DTYPES = (np.complex64, np.int32, np.int8, np.bool_)  # (float64 is taken: it scores on the CPU)
GARBAGE = (np.nan, np.inf, -np.inf, 6e4)  # what padding may hold (6e4: near float16's largest)
EXTENT = st.integers(0, 4) | st.integers(1, 4)  # every count may be 0, but most are not

# 150 draws per function: a few seconds on CI's two cores (LIK_PROPERTY_EXAMPLES=5000 also ran
# clean). No example database: a run does not replay an earlier one's failures by surprise.
CPU = settings(max_examples=int(os.environ.get("LIK_PROPERTY_EXAMPLES", 150)), deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
GPU = settings(CPU, max_examples=int(os.environ.get("LIK_GPU_PROPERTY_EXAMPLES", 40)))


@dataclass
class Call:
    """One call of a public function: its arguments by name, the corruptions applied (none: the
    call is valid) and, for a valid call, the reference result."""

    fn: str
    a: dict
    broken: list = field(default_factory=list)
    expect: tuple = ()
    generator: bool = False  # retrieve: hand the shard list over as a generator
    exact: bool = True  # False: scores may differ from the reference by float32 rounding

    def run(self, backend="cpu", convert=lambda x: x):
        a = {k: convert(v) for k, v in self.a.items()}
        if self.generator:
            a["D"] = (s for s in a["D"])
        pos = [a.pop(n) for n in _POSITIONAL[self.fn]]
        return getattr(lik_cupy, self.fn)(*pos, **{"backend": backend, **a})


_POSITIONAL = {"maxsim": ("Q", "D"), "maxsim_pairs": ("Q", "D"), "maxsim_varlen": ("Q", "D_tokens", "d_offsets"),
               "maxsim_backward": ("grad_scores", "Q", "D", "argmax"), "retrieve": ("Q", "D", "k"),
               "maxsim_int8": ("Q", "D", "d_scales"), "maxsim_int8_varlen": ("Q", "D_tokens", "d_scales", "d_offsets")}


# ---------------------------------------------------------------- references (naive, float64)


def _ints(rng, shape, dtype):
    """Small integers in [-3, 3]: exact in every dtype, and every sum of their products too."""
    return rng.integers(-3, 4, size=shape).astype(np.float32).astype(NP[dtype])


def ref_maxsim(q, d, qv, dv, candidates, q_scale=None):
    """q [nq, lq, dim]; d [nsets, nd, ld, dim] (nsets = nq with per-query candidates, else 1);
    qv [nq, lq], dv [nsets, nd, ld] -> scores float64 [nq, nd] and argmax int64 [nq, nd, lq].
    ``q_scale`` [nq, lq] (INT8) multiplies each row's max (an empty document's -inf stays -inf)."""
    q, d = q.astype(np.float64), d.astype(np.float64)
    nq, lq = qv.shape
    _, nd, ld = dv.shape
    scores = np.zeros((nq, nd))
    amax = np.full((nq, nd, lq), -1, np.int64)
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(nq):
            for j in range(nd):
                dj, vj = d[i if candidates else 0, j], dv[i if candidates else 0, j]
                for s in range(lq):
                    if not qv[i, s]:
                        continue
                    best, arg = -np.inf, -1
                    for t in range(ld):
                        if vj[t]:
                            x = float(np.dot(q[i, s], dj[t]))
                            # the first valid token, then a strictly larger one; the first NaN sticks
                            if arg < 0 or (x != x and best == best) or x > best:
                                best, arg = x, t
                    scores[i, j] += best * q_scale[i, s] if q_scale is not None and arg >= 0 else best
                    amax[i, j, s] = arg
    return scores, amax


def ref_topk(scores, k):
    """Per row: score descending, NaN last, ties to the lower index."""
    order = np.lexsort((np.broadcast_to(np.arange(scores.shape[1]), scores.shape),
                        -np.nan_to_num(scores, nan=0.0), np.isnan(scores)), axis=1)[:, :k]
    return np.take_along_axis(scores, order, 1).astype(np.float32), order.astype(np.int64)


def _unpack(tokens, off):
    """Packed [T, dim] with offsets -> padded [n, Lmax, dim] and valid [n, Lmax]."""
    lens = np.diff(off)
    lmax = int(lens.max()) if lens.size else 0
    out = np.zeros((lens.size, lmax, tokens.shape[1]), tokens.dtype)
    valid = np.arange(lmax)[None, :] < lens[:, None]
    out[valid] = tokens
    return out, valid


# ---------------------------------------------------------------- drawing calls


def _valid(draw, rng, rows, length, side):
    """Valid tokens of one side: no argument, a mask, or lengths (array of some int dtype, list,
    or a Python int for a single row). Returns (keyword arguments, bool [*rows, length])."""
    kind = draw(st.sampled_from(("none", "mask", "lengths", "list")))
    if kind == "none":
        return {}, np.ones(rows + (length,), bool)
    if kind == "mask":
        m = rng.random(rows + (length,)) < 0.7
        return {f"{side}_mask": m}, m
    lens = rng.integers(0, length + 1, size=rows)
    valid = np.arange(length) < lens[..., None]
    if kind == "list" and np.asarray(lens.tolist()).shape == rows:  # (a list cannot hold shape (0, n))
        return {f"{side}_lengths": lens.tolist()}, valid
    dt = draw(st.sampled_from((np.int64, np.int32, np.uint16, np.int8)))
    return {f"{side}_lengths": lens.astype(dt)}, valid


def _pad_with_garbage(draw, x, valid):
    """Fill the token rows ``valid`` excludes with NaN, inf or huge values (they must never count)."""
    if draw(st.booleans()):
        x[~valid] = draw(st.sampled_from(GARBAGE))


def _maybe_nan(draw, rng, *arrays):
    """Now and then a NaN anywhere (padding or not): scores it reaches turn NaN, argmax picks it."""
    if draw(st.integers(0, 7)) == 0:
        x = arrays[draw(st.integers(0, len(arrays) - 1))]
        if x.size:
            x.reshape(-1)[rng.integers(x.size)] = np.nan


@st.composite
def forward_calls(draw, pairs=False):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from(FLOATS))
    dim = draw(st.integers(1, 8))
    nq, lq, nd, ld = (draw(EXTENT) for _ in range(4))
    if pairs:
        q3, layout = True, "pairs"
    else:
        q3 = draw(st.booleans())
        layout = draw(st.sampled_from(("shared", "candidates", "single") if q3 else ("shared", "single")))
    qrows = (nq,) if q3 else ()
    drows = {"shared": (nd,), "candidates": (nq, nd), "single": (), "pairs": (nq,)}[layout]
    Q, D = _ints(rng, qrows + (lq, dim), dtype), _ints(rng, drows + (ld, dim), dtype)
    qkw, qv = _valid(draw, rng, qrows, lq, "q")
    dkw, dv = _valid(draw, rng, drows, ld, "d")
    _pad_with_garbage(draw, Q, qv)
    _pad_with_garbage(draw, D, dv)
    _maybe_nan(draw, rng, Q, D)
    argmax = draw(st.booleans())

    nqc = nq if q3 else 1
    dc = {"shared": D[None], "candidates": D, "single": D[None, None], "pairs": D[:, None]}[layout]
    dvc = {"shared": dv[None], "candidates": dv, "single": dv[None, None], "pairs": dv[:, None]}[layout]
    s, am = ref_maxsim(Q.reshape(nqc, lq, dim), dc, qv.reshape(nqc, lq), dvc, layout in ("candidates", "pairs"))
    shape = (nq,) if pairs else qrows + (drows[1:] if layout == "candidates" else drows)
    expect = (s.astype(np.float32).reshape(shape),) + ((am.astype(np.int32).reshape(shape + (lq,)),) if argmax else ())
    call = Call("maxsim_pairs" if pairs else "maxsim", {"Q": Q, "D": D, **qkw, **dkw, "return_argmax": argmax},
                expect=expect)
    _break(draw, call, _PAIRS_BREAKS if pairs else _FORWARD_BREAKS)
    return call


@st.composite
def varlen_calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from(FLOATS))
    dim, nd = draw(st.integers(1, 8)), draw(EXTENT)
    off = np.concatenate([[0], np.cumsum(rng.integers(0, 6, size=nd))])
    D = _ints(rng, (int(off[-1]), dim), dtype)
    a = {"D_tokens": D, "d_offsets": _offsets(draw, off)}
    packed_q = draw(st.booleans())
    if packed_q:
        nq = draw(EXTENT)
        qoff = np.concatenate([[0], np.cumsum(rng.integers(0, 5, size=nq))])
        Q = _ints(rng, (int(qoff[-1]), dim), dtype)
        _maybe_nan(draw, rng, Q, D)
        a.update(Q=Q, q_offsets=_offsets(draw, qoff))
        qc, qv = _unpack(Q, qoff)
        qrows, lq = (nq,), qc.shape[1]
    else:
        q3 = draw(st.booleans())
        nq, lq = draw(EXTENT), draw(EXTENT)
        qrows = (nq,) if q3 else ()
        Q = _ints(rng, qrows + (lq, dim), dtype)
        qkw, qv = _valid(draw, rng, qrows, lq, "q")
        _pad_with_garbage(draw, Q, qv)
        _maybe_nan(draw, rng, Q, D)
        a.update(Q=Q, **qkw)
        nqc = nq if q3 else 1
        qc, qv = Q.reshape(nqc, lq, dim), qv.reshape(nqc, lq)
    argmax = draw(st.booleans())
    a.update(return_argmax=argmax, validate_offsets=draw(st.booleans()))
    dpad, dv = _unpack(D, off)
    s, am = ref_maxsim(qc, dpad[None], qv, dv[None], False)
    shape = qrows + (nd,)
    expect = (s.astype(np.float32).reshape(shape),) + ((am.astype(np.int32).reshape(shape + (lq,)),) if argmax else ())
    call = Call("maxsim_varlen", a, expect=expect)
    _break(draw, call, _VARLEN_BREAKS)
    return call


def _offsets(draw, off):
    """Offsets as int64 or int32 arrays, or a Python list."""
    kind = draw(st.sampled_from(("int64", "int32", "list")))
    return off.tolist() if kind == "list" else off.astype(kind)


@st.composite
def backward_calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from(FLOATS))
    dim = draw(st.integers(1, 8))
    nq, lq, nd, ld = (draw(EXTENT) for _ in range(4))
    q3 = draw(st.booleans())
    layout = draw(st.sampled_from(("shared", "candidates", "single", "packed") if q3 else ("shared", "single", "packed")))
    qrows = (nq,) if q3 else ()
    nqc = nq if q3 else 1
    Q = _ints(rng, qrows + (lq, dim), dtype)
    a = {}
    if layout == "packed":
        off = np.concatenate([[0], np.cumsum(rng.integers(0, 6, size=nd))])
        D = _ints(rng, (int(off[-1]), dim), dtype)
        a["d_offsets"] = _offsets(draw, off)
        limit = np.broadcast_to(np.diff(off)[None, :, None], (nqc, nd, lq))
        rows = lambda i, j, t: off[j] + t  # noqa: E731
        shape = qrows + (nd,)
    else:
        drows = {"shared": (nd,), "candidates": (nq, nd), "single": ()}[layout]
        D = _ints(rng, drows + (ld, dim), dtype)
        ndc = nd if layout != "single" else 1
        limit = np.full((nqc, ndc, lq), ld)
        rows = (lambda i, j, t: (i * nd + j) * ld + t) if layout == "candidates" else (lambda i, j, t: j * ld + t)
        shape = qrows + (drows[1:] if layout == "candidates" else drows)
    # any valid argmax, not only a true one: the backward must follow whatever it is given
    am = np.where(rng.random(limit.shape) < 0.2, -1, np.floor(rng.random(limit.shape) * limit)).astype(np.int64)
    am[limit == 0] = -1
    gdt = draw(st.sampled_from((np.float16, np.float32, np.float64, ml_dtypes.bfloat16)))
    g = rng.integers(-3, 4, size=am.shape[:2]).astype(np.float32)
    dq, dd = np.zeros((nqc, lq, dim)), np.zeros((D.size // dim if dim else 0, dim))
    q64, d64 = Q.astype(np.float64).reshape(nqc, lq, dim), D.astype(np.float64).reshape(-1, dim)
    for i, j, s in zip(*np.nonzero(am >= 0)):
        r = rows(i, j, am[i, j, s])
        dq[i, s] += g[i, j] * d64[r]
        dd[r] += g[i, j] * q64[i, s]
    a.update(grad_scores=g.reshape(shape).astype(gdt), Q=Q, D=D, argmax=am.reshape(shape + (lq,)).astype(np.int32),
             method=draw(st.sampled_from(("auto", "atomic", "csr"))))
    call = Call("maxsim_backward", a, expect=(dq.astype(NP[dtype]).reshape(Q.shape), dd.astype(NP[dtype]).reshape(D.shape)))
    _break(draw, call, _BACKWARD_BREAKS)
    return call


@st.composite
def retrieve_calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from(FLOATS))
    dim, nq, lq = draw(st.integers(1, 8)), draw(EXTENT), draw(EXTENT)
    q3 = draw(st.booleans())
    qrows = (nq,) if q3 else ()
    Q = _ints(rng, qrows + (lq, dim), dtype)
    qkw, qv = _valid(draw, rng, qrows, lq, "q")
    _pad_with_garbage(draw, Q, qv)
    nqc = nq if q3 else 1
    qc, qvc = Q.reshape(nqc, lq, dim), qv.reshape(nqc, lq)

    def padded():
        nd, ld = draw(EXTENT), draw(EXTENT)
        D = _ints(rng, (nd, ld, dim), dtype)
        return D, D[None], np.ones((1, nd, ld), bool)

    def packed(as_list=True):
        off = np.concatenate([[0], np.cumsum(rng.integers(0, 5, size=draw(EXTENT)))])
        D = _ints(rng, (int(off[-1]), dim), dtype)
        dpad, dv = _unpack(D, off)
        # a shard tuple holds arrays; the d_offsets argument may also be a list
        off = _offsets(draw, off) if as_list else off.astype(draw(st.sampled_from((np.int32, np.int64))))
        return (D, off), dpad[None], dv[None]

    a = {"Q": Q, **qkw}
    kind = draw(st.sampled_from(("padded", "packed", "shards", "generator")))
    if kind == "padded":
        nd, ld = draw(EXTENT), draw(EXTENT)
        D = _ints(rng, (nd, ld, dim), dtype)
        dkw, dv = _valid(draw, rng, (nd,), ld, "d")
        _pad_with_garbage(draw, D, dv)
        a.update(D=D, **dkw)
        parts = [(D[None], dv[None])]
    elif kind == "packed":
        (D, off), dpad, dv = packed()
        a.update(D=D, d_offsets=off)
        parts = [(dpad, dv)]
    else:
        made = [draw(st.sampled_from((padded, lambda: packed(False))))() for _ in range(draw(st.integers(0, 3)))]
        a["D"] = [m[0] for m in made]
        parts = [(m[1], m[2]) for m in made]
    _maybe_nan(draw, rng, Q)
    scores = np.concatenate([np.zeros((nqc, 0))] + [ref_maxsim(qc, d, qvc, v, False)[0] for d, v in parts], axis=1)
    k = draw(st.integers(1, 6))
    a.update(k=k, max_gpu_bytes=draw(st.sampled_from((None, 1 << 20, 1 << 30))))
    s, i = ref_topk(scores.astype(np.float32), k)
    call = Call("retrieve", a, expect=(s, i) if q3 else (s[0], i[0]), generator=kind == "generator")
    _break(draw, call, _RETRIEVE_BREAKS)
    return call


# ---------------------------------------------------------------- corruptions
#
# Each takes (draw, arguments) and breaks the call in a way the documentation rules out, or
# returns False (leaving the arguments alone) where it does not apply to this draw.


def _break(draw, call: Call, breaks: dict) -> None:
    n = draw(st.sampled_from((0, 0, 1, 1, 2)))  # about 60% of the calls get broken
    for name in draw(st.lists(st.sampled_from(sorted(breaks)), min_size=n, max_size=n, unique=True)):
        if breaks[name](draw, call.a) is not False:
            call.broken.append(name)


def _arr(a, key):
    """The argument ``key`` if it is (still) a NumPy array, else None (an earlier corruption replaced it)."""
    x = a.get(key)
    return x if isinstance(x, np.ndarray) else None


def _swap_dtype(key, bad=BAD_DTYPES):
    """Q: a dtype the function does not take; D: that, or a float dtype other than Q's."""
    def f(draw, a):
        x, q = _arr(a, key), _arr(a, "Q")
        if x is None:
            return False
        other = [t for t in NP.values() if key != "Q" and q is not None and np.dtype(t) != q.dtype]
        a[key] = np.zeros(x.shape, draw(st.sampled_from(bad + tuple(other))))
    return f


def _wrong_dim(key):
    def f(draw, a):
        x = _arr(a, key)
        if x is None:
            return False
        a[key] = np.zeros(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype)
    return f


def _wrong_rank(key, low_ok):
    def f(draw, a):
        x = _arr(a, key)
        if x is None:
            return False
        a[key] = x.reshape(-1) if draw(st.booleans()) or x.ndim < low_ok else x[None, None]
    return f


def _not_an_array(key):
    def f(draw, a):
        x = _arr(a, key)
        if x is None:
            return False
        a[key] = draw(st.sampled_from((x.tolist(), "not an array", None, 3.0, {"x": 1})))
    return f


def _rows(a, side):
    """Shape of one side's rows (its array's shape without the token and dim axes)."""
    x = _arr(a, "Q" if side == "q" else "D")
    return x.shape[:-2] if x is not None and x.ndim >= 2 else None


def _mask_shape(side):
    def f(draw, a):
        rows = _rows(a, side)
        if rows is None:
            return False
        full = a["Q" if side == "q" else "D"].shape[:-1]
        axis = draw(st.integers(0, len(full) - 1))
        wrong = full[:axis] + (full[axis] + 1,) + full[axis + 1:] if draw(st.booleans()) else full + (1,)
        a.pop(f"{side}_lengths", None)
        a[f"{side}_mask"] = np.ones(wrong, bool)
    return f


def _mask_dtype(side):
    def f(draw, a):
        if _rows(a, side) is None:
            return False
        a.pop(f"{side}_lengths", None)
        full = a["Q" if side == "q" else "D"].shape[:-1]
        a[f"{side}_mask"] = np.ones(full, draw(st.sampled_from((np.uint8, np.int32, np.float32))))
    return f


def _mask_and_lengths(side):
    def f(draw, a):
        rows = _rows(a, side)
        if rows is None:
            return False
        a[f"{side}_mask"] = np.ones(a["Q" if side == "q" else "D"].shape[:-1], bool)
        a[f"{side}_lengths"] = np.zeros(rows, np.int64)
    return f


def _lengths_shape(side):
    def f(draw, a):
        rows = _rows(a, side)
        if rows is None:
            return False
        a.pop(f"{side}_mask", None)
        a[f"{side}_lengths"] = np.zeros(rows + (1,), np.int64)
    return f


def _lengths_float(side):
    def f(draw, a):
        rows = _rows(a, side)
        if rows is None:
            return False
        a.pop(f"{side}_mask", None)
        # as a list only when it holds a value: an empty list carries no dtype and is fine
        as_list = draw(st.booleans()) and np.prod(rows, dtype=int) > 0
        a[f"{side}_lengths"] = np.full(rows, 0.5).tolist() if as_list else np.zeros(rows, np.float32)
    return f


def _lengths_range(side):
    def f(draw, a):
        rows = _rows(a, side)
        if rows is None or not np.prod(rows, dtype=int):
            return False
        length = a["Q" if side == "q" else "D"].shape[-2]
        lens = np.zeros(rows, np.int64)
        lens.reshape(-1)[draw(st.integers(0, lens.size - 1))] = draw(st.sampled_from((-1, length + 1, 2**31)))
        a.pop(f"{side}_mask", None)
        a[f"{side}_lengths"] = lens
    return f


def _backend(draw, a):
    a["backend"] = draw(st.sampled_from(("tpu", "GPU", "")))


def _dim_zero(draw, a):
    for key in ("Q", "D", "D_tokens"):
        if isinstance(a.get(key), np.ndarray):
            a[key] = a[key][..., :0]


_FORWARD_BREAKS = {
    "Q dtype": _swap_dtype("Q"), "D dtype": _swap_dtype("D"), "D dim": _wrong_dim("D"),
    "Q rank": _wrong_rank("Q", 2), "D rank": _wrong_rank("D", 3), "Q not an array": _not_an_array("Q"),
    "D not an array": _not_an_array("D"), "backend": _backend, "dim 0": _dim_zero,
    **{f"{what} ({side})": make(side) for side in "qd" for what, make in (
        ("mask shape", _mask_shape), ("mask dtype", _mask_dtype), ("mask and lengths", _mask_and_lengths),
        ("lengths shape", _lengths_shape), ("lengths float", _lengths_float), ("lengths range", _lengths_range))},
}


def _pairs_count(draw, a):
    d = _arr(a, "D")
    if d is None or d.ndim != 3:
        return False
    a["D"] = np.zeros((d.shape[0] + 1,) + d.shape[1:], d.dtype)


def _candidates_need_q3(draw, a):
    q, d = _arr(a, "Q"), _arr(a, "D")
    if q is None or d is None or q.ndim != 2 or d.ndim not in (2, 3):
        return False
    a["D"] = d[None, None] if d.ndim == 2 else d[None]


def _candidates_mismatch(draw, a):
    q, d = _arr(a, "Q"), _arr(a, "D")
    if q is None or d is None or q.ndim != 3 or d.ndim != 4:
        return False
    a["D"] = np.zeros((q.shape[0] + 1,) + d.shape[1:], d.dtype)
    a.pop("d_mask", None)
    a.pop("d_lengths", None)


_FORWARD_BREAKS.update({"candidates need 3-D Q": _candidates_need_q3, "candidate sets != Nq": _candidates_mismatch})
_PAIRS_BREAKS = {**{k: v for k, v in _FORWARD_BREAKS.items() if "candidate" not in k}, "pairs count": _pairs_count}


def _offsets_break(key, how):
    def f(draw, a):
        off = a.get(key)
        o = np.array(off)
        if off is None or o.ndim != 1 or not o.size or o.dtype.kind not in "iu":
            return False  # (absent, or an earlier corruption already changed its form)
        o = o.astype(np.int64)
        if how == "start":
            o[0] = draw(st.sampled_from((1, -1)))
        elif how == "end":
            o[-1] += draw(st.sampled_from((1, -1))) if o[-1] else 1
        elif how == "decreasing":
            if o.size < 3:
                return False
            o[1] = o[2] + 1
        a[key] = o.tolist() if isinstance(off, list) else o.astype(np.asarray(off).dtype)
    return f


def _offsets_form(key):
    def f(draw, a):
        off = a.get(key)
        if off is None:
            return False
        o = np.asarray(off)
        forms = [o.astype(np.float64), o.astype(np.int16), o.astype(np.uint32), o[None], o[:0], [0.0, 1.5]]
        a[key] = draw(st.sampled_from(forms + ([None] if key == "d_offsets" else [])))  # no q_offsets: padded Q
    return f


def _q_offsets_with_mask(draw, a):
    if "q_offsets" not in a or _arr(a, "Q") is None:
        return False
    a["q_mask"] = np.ones(a["Q"].shape[:-1], bool)


def _q_offsets_padded_q(draw, a):
    if "q_offsets" not in a or _arr(a, "Q") is None:
        return False
    a["Q"] = a["Q"][None]


def _tokens_rank(draw, a):
    if _arr(a, "D_tokens") is None:
        return False
    a["D_tokens"] = a["D_tokens"][None]


_VARLEN_BREAKS = {
    "Q dtype": _swap_dtype("Q"), "D dtype": _swap_dtype("D_tokens"), "D dim": _wrong_dim("D_tokens"),
    "Q not an array": _not_an_array("Q"), "backend": _backend, "dim 0": _dim_zero, "D_tokens rank": _tokens_rank,
    "q_offsets with q_mask": _q_offsets_with_mask, "q_offsets with padded Q": _q_offsets_padded_q,
    **{f"{key} {how}": _offsets_break(key, how) for key in ("d_offsets", "q_offsets")
       for how in ("start", "end", "decreasing")},
    **{f"{key} form": _offsets_form(key) for key in ("d_offsets", "q_offsets")},
    **{f"{what} (q)": make("q") for what, make in (
        ("mask shape", _mask_shape), ("mask dtype", _mask_dtype), ("lengths shape", _lengths_shape),
        ("lengths float", _lengths_float), ("lengths range", _lengths_range))},
}


def _argmax_value(how):
    def f(draw, a):
        am, d = _arr(a, "argmax"), _arr(a, "D")
        if am is None or d is None or not am.size or am.dtype != np.int32 or (a.get("d_offsets") is not None
                                                                              and am.ndim < 2):
            return False  # (an earlier corruption already reshaped or retyped the argmax)
        am = am.copy()
        idx = np.unravel_index(draw(st.integers(0, am.size - 1)), am.shape)
        if how == "low":
            am[idx] = draw(st.sampled_from((-2, -(2**31))))
        else:  # one past its document's last token
            off = a.get("d_offsets")
            if off is not None:
                o = np.asarray(off, np.int64)
                if idx[-2] + 1 >= o.size:
                    return False
                am[idx] = o[idx[-2] + 1] - o[idx[-2]]
            else:
                am[idx] = d.shape[-2]
        a["argmax"] = am
    return f


def _argmax_form(draw, a):
    am = _arr(a, "argmax")
    if am is None:
        return False
    a["argmax"] = draw(st.sampled_from((am.astype(np.int64), am.astype(np.float32), am[..., None], am.reshape(-1)[:-1]
                                        if am.size else np.zeros(1, np.int32))))


def _grad_form(draw, a):
    g = _arr(a, "grad_scores")
    if g is None:
        return False
    a["grad_scores"] = draw(st.sampled_from((g.astype(np.int32), g[..., None], np.zeros(g.shape + (2,), np.float32))))


def _method(draw, a):
    a["method"] = draw(st.sampled_from(("fast", "CSR", None)))


_BACKWARD_BREAKS = {
    "Q dtype": _swap_dtype("Q"), "D dtype": _swap_dtype("D"), "D dim": _wrong_dim("D"),
    "backend": _backend, "method": _method, "grad form": _grad_form, "argmax form": _argmax_form,
    "argmax below -1": _argmax_value("low"), "argmax past the end": _argmax_value("high"),
    **{f"d_offsets {how}": _offsets_break("d_offsets", how) for how in ("start", "end", "decreasing")},
}


def _k(draw, a):
    a["k"] = draw(st.sampled_from((0, -1, 4097, True, 2.5, "3", None)))


def _max_gpu_bytes(draw, a):
    a["max_gpu_bytes"] = draw(st.sampled_from((0, -1, 2.5, "1GB")))


def _shard_entry(draw, a):
    if not isinstance(a["D"], list):
        return False
    a["D"] = a["D"] + [draw(st.sampled_from(([np.zeros((1, 1, 1), np.float32)], 7, "shard", (np.zeros((1, 1)),))))]


def _shard_dim(draw, a):
    q = _arr(a, "Q")
    if not isinstance(a["D"], list) or q is None:
        return False
    a["D"] = a["D"] + [np.zeros((1, 2, q.shape[-1] + 1), q.dtype)]


def _shard_dtype(draw, a):
    q = _arr(a, "Q")
    if not isinstance(a["D"], list) or q is None:
        return False
    other = draw(st.sampled_from([t for t in NP.values() if np.dtype(t) != q.dtype]))
    a["D"] = a["D"] + [np.zeros((1, 2, q.shape[-1]), other)]


def _offsets_with_shards(draw, a):
    if not isinstance(a["D"], list):
        return False
    a["d_offsets"] = [0]


def _flat_corpus(draw, a):
    d = _arr(a, "D")
    if d is None or d.ndim != 3 or "d_offsets" in a:
        return False
    a["D"] = d.reshape(-1, d.shape[-1])
    a.pop("d_mask", None)
    a.pop("d_lengths", None)


_RETRIEVE_BREAKS = {
    "k": _k, "max_gpu_bytes": _max_gpu_bytes, "Q dtype": _swap_dtype("Q"), "Q rank": _wrong_rank("Q", 2),
    "backend": _backend, "shard entry": _shard_entry, "shard dim": _shard_dim, "shard dtype": _shard_dtype,
    "d_offsets with shards": _offsets_with_shards, "flat corpus without offsets": _flat_corpus,
    "d_offsets end": _offsets_break("d_offsets", "end"), "d_offsets decreasing": _offsets_break("d_offsets", "decreasing"),
    **{f"{what} (q)": make("q") for what, make in (
        ("mask shape", _mask_shape), ("lengths range", _lengths_range), ("mask and lengths", _mask_and_lengths))},
}


# ---------------------------------------------------------------- checking


def _host(x):
    return x.get() if type(x).__module__.split(".")[0] == "cupy" else np.asarray(x)


def check(call: Call, out_or_exc):
    """A broken call raised (``outcome`` lets only ValueError/TypeError through); a valid one returned
    the reference exactly."""
    if call.broken:
        assert isinstance(out_or_exc, BaseException), f"{call.fn} accepted a call broken by {call.broken}"
        return
    assert not isinstance(out_or_exc, BaseException), f"{call.fn} refused a valid call: {out_or_exc!r}"
    got = out_or_exc if isinstance(out_or_exc, tuple) else (out_or_exc,)
    assert len(got) == len(call.expect)
    for g, want in zip(got, call.expect):
        g = _host(g)
        assert g.shape == want.shape and g.dtype == want.dtype, (g.shape, g.dtype, want.shape, want.dtype)
        if want.dtype.kind in "iu":
            assert np.array_equal(g, want), (g, want)
        elif call.exact:
            assert np.array_equal(g.astype(np.float64), want.astype(np.float64), equal_nan=True), (g, want)
        else:
            assert np.allclose(g, want, rtol=1e-6, atol=1e-6, equal_nan=True), (g, want)


def outcome(fn):
    """fn()'s result, or the ValueError/TypeError it raised; any other exception fails the test."""
    try:
        return fn()
    except ALLOWED as e:
        return e


@CPU
@given(forward_calls())
def test_maxsim(call):
    check(call, outcome(call.run))


@CPU
@given(forward_calls(pairs=True))
def test_maxsim_pairs(call):
    check(call, outcome(call.run))


@CPU
@given(varlen_calls())
def test_maxsim_varlen(call):
    check(call, outcome(call.run))


@CPU
@given(backward_calls())
def test_maxsim_backward(call):
    check(call, outcome(call.run))


@CPU
@given(retrieve_calls())
def test_retrieve(call):
    check(call, outcome(call.run))


# ---------------------------------------------------------------- files: .npy and manifests


@st.composite
def npy_bytes(draw):
    """A .npy file's bytes, often damaged: truncated, overwritten in places, or random."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(st.sampled_from((np.float16, np.float32, np.int64, np.uint16, "<U3", np.float64)))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    buf = io.BytesIO()
    np.save(buf, rng.integers(0, 9, size=shape).astype(dtype))
    data = bytearray(buf.getvalue())
    how = draw(st.sampled_from(("intact", "truncate", "overwrite", "header", "random")))
    if how == "truncate":
        data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    elif how == "overwrite":
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif how == "header":  # a header dictionary of any text (it is parsed, never executed)
        text = draw(st.sampled_from(("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }",
                                     "{'descr': '<f2', 'fortran_order': False, 'shape': (10**12,), }",
                                     "{'descr': '<f2', 'fortran_order': True, 'shape': (-1, 3), }",
                                     "__import__('os').system('touch pwned')", "{'descr': '<f2', 'shape': (1,",
                                     "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }")))
        header = (text + " " * (64 - (10 + len(text) + 1) % 64) + "\n").encode()
        data = bytearray(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data[-16:])
    elif how == "random":
        data = bytearray(draw(st.binary(max_size=200)))
    return bytes(data)


@CPU
@given(npy_bytes())
def test_open_npy_refuses_damage_with_a_shard_error(data):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.npy")
        with open(path, "wb") as f:
            f.write(data)
        try:
            arr = _files.open_npy(path)
        except shards.ShardError:
            return
        np.asarray(arr).tobytes()  # what opened reads back whole
        assert not os.path.exists(os.path.join(d, "pwned"))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**63) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)
# Manifest file names: any text (NUL and lone surrogates included), or names aimed outside the shard.
NAMES = st.text(st.characters(exclude_categories=()), max_size=12) | \
    st.sampled_from(("../tokens.npy", "/etc/passwd", "tokens.npy/.", "./tokens.npy", ".", "", "sub/../tokens.npy",
                     "ids.npy", "manifest.json", "outside/tokens.npy", "link/tokens.npy"))


@CPU
@given(st.lists(st.tuples(st.sampled_from(("format", "version", "dim", "dtype", "num_docs", "num_tokens",
                                           "normalized", "model", "files", "files.tokens", "files.offsets",
                                           "files.ids", "extra")), JSON | NAMES), min_size=1, max_size=3))
def test_open_shard_refuses_any_bad_manifest_with_a_shard_error(edits):
    """Random values for the manifest's keys (file names included): a ShardError, or a shard whose
    every file lies inside its directory."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        d = os.path.join(root, "s")
        shards.write_shard(d, np.arange(24, dtype=np.float32).reshape(6, 4), np.array([0, 2, 2, 6]), ids=np.arange(3))
        outside = os.path.join(root, "outside")
        os.mkdir(outside)
        np.save(os.path.join(outside, "tokens.npy"), np.zeros((6, 4), np.float32))
        os.symlink(outside, os.path.join(d, "link"))  # a directory link leading out
        path = os.path.join(d, "manifest.json")
        m = json.loads(pathlib.Path(path).read_text())
        for key, value in edits:
            top, _, sub = key.partition(".")
            if sub and isinstance(m.get(top), dict):
                m[top][sub] = value
            elif not sub:
                m[top] = value
        pathlib.Path(path).write_text(json.dumps(m))
        try:
            s = shards.open_shard(d)
        except shards.ShardError:
            return
        real = os.path.realpath(d)
        for name in ("tokens", "offsets", "ids"):
            f = getattr(s, f"{name}_file", None) or (m["files"].get(name) and os.path.join(d, m["files"][name]))
            if f:
                assert os.path.commonpath([real, os.path.realpath(f)]) == real, f


# ---------------------------------------------------------------- INT8 quantisation


@CPU
@given(st.integers(0, 2**32 - 1), st.sampled_from(("float16", "bfloat16", "float32", "float64")),
       st.lists(EXTENT, min_size=1, max_size=3), st.sampled_from(("finite", "zero rows", "nan", "inf", "int")))
def test_quantize_int8_round_trip_or_documented_error(seed, dtype, shape, kind):
    quantize, dequantize = lik_cupy.quantize_int8, lik_cupy.dequantize_int8
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 10 ** rng.uniform(-3, 3)).astype({**NP, "float64": np.float64}[dtype])
    if kind == "zero rows" and x.size:
        x.reshape(-1, shape[-1])[::2] = 0
    if kind in ("nan", "inf") and x.size:
        x.reshape(-1)[rng.integers(x.size)] = np.nan if kind == "nan" else -np.inf
    if kind == "int":
        x = rng.integers(-5, 5, size=shape).astype(np.int32)
    try:
        q, s = quantize(x, backend="cpu")
    except ALLOWED as e:
        if kind == "int":
            assert isinstance(e, TypeError), e
        else:  # NaN or inf, or an embedding dim of 0
            assert isinstance(e, ValueError) and (kind in ("nan", "inf") and x.size or not shape[-1]), e
        return
    assert kind in ("finite", "zero rows") or not x.size
    assert q.dtype == np.int8 and q.shape == x.shape and s.dtype == np.float32 and s.shape == x.shape[:-1]
    assert (np.abs(q.astype(np.int32)) <= 127).all() and (s >= 0).all()
    back = dequantize(q, s, backend="cpu")
    err = np.abs(back.astype(np.float64) - x.astype(np.float32).astype(np.float64))
    assert (err <= s[..., None].astype(np.float64) * (0.5 + 1e-5) + 1e-30).all()  # within half a step


# ---------------------------------------------------------------- INT8 scoring


def _pow2_scales(rng, shape, zeros=False):
    """Powers of two (and some zeros): a scaled small integer is still exact."""
    s = 2.0 ** rng.integers(-2, 3, size=shape)
    if zeros:
        s[rng.random(shape) < 0.15] = 0
    return s.astype(np.float32)


@st.composite
def int8_calls(draw, dims=st.integers(1, 8)):
    """maxsim_int8 / maxsim_int8_varlen: int8 documents with per-token scales; queries int8 with
    scales (every result exact) or float, quantised by the call (the reference quantises with
    quantize_int8's CPU path, and the comparison allows float32 rounding)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dim = draw(dims)
    nq, lq, nd, ld = (draw(EXTENT) for _ in range(4))
    q3 = draw(st.booleans())
    layout = draw(st.sampled_from(("shared", "candidates", "single", "packed") if q3 else ("shared", "single", "packed")))
    qrows = (nq,) if q3 else ()
    nqc = nq if q3 else 1
    q_int8 = draw(st.booleans())
    if q_int8:
        Q = rng.integers(-3, 4, size=qrows + (lq, dim)).astype(np.int8)
        qs = _pow2_scales(rng, qrows + (lq,), zeros=True)
        a = {"Q": Q, "q_scales": qs}
        qi, qsc = Q.astype(np.float64), qs.astype(np.float64)
    else:
        Q = _ints(rng, qrows + (lq, dim), draw(st.sampled_from(FLOATS)))
        a = {"Q": Q}
        qq, qs = lik_cupy.quantize_int8(Q, backend="cpu")
        qi, qsc = qq.astype(np.float64), qs.astype(np.float64)
    qkw, qv = _valid(draw, rng, qrows, lq, "q")
    a.update(qkw)
    if layout == "packed":
        off = np.concatenate([[0], np.cumsum(rng.integers(0, 6, size=nd))])
        D = rng.integers(-3, 4, size=(int(off[-1]), dim)).astype(np.int8)
        ds = _pow2_scales(rng, (D.shape[0],), zeros=True)
        a.update(D_tokens=D, d_scales=ds, d_offsets=_offsets(draw, off))
        dpad, dv = _unpack(D.astype(np.float64) * ds[:, None], off)
        dc, dvc, cand, shape = dpad[None], dv[None], False, qrows + (nd,)
    else:
        drows = {"shared": (nd,), "candidates": (nq, nd), "single": ()}[layout]
        D = rng.integers(-3, 4, size=drows + (ld, dim)).astype(np.int8)
        ds = _pow2_scales(rng, drows + (ld,), zeros=True)
        dkw, dv = _valid(draw, rng, drows, ld, "d")
        if draw(st.booleans()):
            ds[~dv] = draw(st.sampled_from(GARBAGE))  # padding's scales are never used either
        a.update(D=D, d_scales=ds, **dkw)
        dd = D.astype(np.float64) * np.where(dv, ds, 0)[..., None]
        dc = {"shared": dd[None], "candidates": dd, "single": dd[None, None]}[layout]
        dvc = {"shared": dv[None], "candidates": dv, "single": dv[None, None]}[layout]
        cand, shape = layout == "candidates", qrows + (drows[1:] if layout == "candidates" else drows)
    argmax = draw(st.booleans())
    a["return_argmax"] = argmax
    # the documented arithmetic: max over the document-scaled products, then times the query scale
    s, am = ref_maxsim(qi.reshape(nqc, lq, dim), dc, qv.reshape(nqc, lq), dvc, cand,
                       q_scale=qsc.reshape(nqc, lq))
    expect = (s.astype(np.float32).reshape(shape),) + ((am.astype(np.int32).reshape(shape + (lq,)),) if argmax else ())
    call = Call("maxsim_int8_varlen" if layout == "packed" else "maxsim_int8", a, expect=expect,
                exact=q_int8)
    _break(draw, call, _INT8_BREAKS)
    return call


def _d_not_int8(draw, a):
    key = "D_tokens" if "D_tokens" in a else "D"
    x = _arr(a, key)
    if x is None:
        return False
    a[key] = x.astype(draw(st.sampled_from((np.float16, np.float32, np.int16, np.uint8))))


def _scales_break(key, how):
    def f(draw, a):
        s, q = _arr(a, key), _arr(a, "Q")
        if s is None or how == "missing" and key == "q_scales" and (q is None or q.dtype != np.int8):
            return False  # (a float Q takes no q_scales: leaving them out would repair the call)
        if how == "shape":
            a[key] = np.ones(s.shape + (1,), np.float32)
        elif how == "dtype":
            a[key] = np.zeros(s.shape, draw(st.sampled_from((np.int32, np.int8, np.bool_))))
        else:
            a[key] = None
    return f


def _q_scales_for_float_q(draw, a):
    q = _arr(a, "Q")
    if q is None or q.dtype == np.int8:
        return False
    a["q_scales"] = np.ones(q.shape[:-1], np.float32)


_INT8_BREAKS = {
    "Q dtype": _swap_dtype("Q", (np.complex64, np.int32, np.uint8, np.bool_)), "D not int8": _d_not_int8, "backend": _backend, "dim 0": _dim_zero,
    "q_scales for a float Q": _q_scales_for_float_q,
    **{f"{key} {how}": _scales_break(key, how) for key in ("d_scales", "q_scales") for how in ("shape", "dtype", "missing")},
    **{f"{what} ({side})": make(side) for side in "qd" for what, make in (
        ("mask shape", _mask_shape), ("lengths range", _lengths_range), ("mask and lengths", _mask_and_lengths))},
    **{f"d_offsets {how}": _offsets_break("d_offsets", how) for how in ("start", "end", "decreasing")},
}


@CPU
@given(int8_calls())
def test_maxsim_int8(call):
    check(call, outcome(call.run))


# ---------------------------------------------------------------- gaps the properties found


def test_int_lengths_go_with_any_framework():
    Q, D = HostDLPack(np.ones((3, 4), np.float32)), HostDLPack(np.ones((2, 3, 4), np.float32))
    assert np.asarray(lik_cupy.maxsim(Q, D, q_lengths=2, backend="cpu")).tolist() == [8.0, 8.0]


# ---------------------------------------------------------------- the GPU against the CPU path


@pytest.fixture(scope="module")
def gpu_kernels():
    """Compile, in parallel, every kernel these draws can reach (NVRTC releases the GIL), so the
    examples run at kernel speed and a cold cache costs seconds, not minutes."""
    import concurrent.futures

    import cupy

    from lik_cupy._runtime import nvrtc as lc
    from lik_cupy import _dispatch as dispatch
    from lik_cupy._base.device import device_properties

    cc = device_properties(cupy.cuda.runtime.getDevice()).cc
    arch = dispatch.arch_of(cc)
    jobs = {}
    for dtype in FLOATS:
        esize = 4 if dtype == "float32" else 2
        for dim in range(1, 9):
            for lq in range(1, 5):
                for shared in range(1, 5):
                    for argmax in (False, True):
                        for vec in {False, dim * esize % 16 == 0}:
                            for packed in (False, True):
                                cfg = dispatch.choose_forward(cc, dtype, dim, lq, argmax, vec, True, shared, 4, packed)
                                jobs[cfg.name] = ("maxsim_fwd.cu", cfg.defines(), cfg.target(arch))
        for vec in (0, 1):
            jobs[f"bwd{dtype}{vec}"] = ("maxsim_bwd.cu", {"LIK_ELEM": dispatch.elem_spec(dtype).code, "LIK_VEC": vec}, arch)
    for int8 in ("int8",):  # the scaled type the draws score (maxsim_int8)
        for dim in (16, 32):
            for lq in range(1, 5):
                for shared in range(1, 5):
                    for argmax in (False, True):
                        for packed in (False, True):
                            cfg = dispatch.choose_forward(cc, int8, dim, lq, argmax, True, True, shared, 4, packed)
                            jobs[cfg.name] = ("maxsim_fwd.cu", cfg.defines(), cfg.target(arch))
    jobs["topk"] = ("topk.cu", {}, arch)
    jobs["masks"] = ("masks.cu", {}, arch)
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda job: lc.cubin_path(*job), jobs.values()))


def _on_gpu(fw: str):
    """Argument conversion for the GPU run: NumPy arrays stay (backend="gpu" copies them over) or
    become CuPy arrays; tuples and shard lists are converted element by element."""
    import cupy

    def conv(x):
        if fw == "cupy" and isinstance(x, np.ndarray):
            return cupy.asarray(x)
        if isinstance(x, tuple):
            return tuple(conv(v) for v in x)
        if isinstance(x, list) and any(isinstance(v, (np.ndarray, tuple, list)) for v in x):
            return [conv(v) for v in x]
        return x

    return conv


def _framework(call: Call, fw: str) -> str:
    """CuPy holds no bfloat16 array: calls with one stay NumPy (uploaded by the library); so do
    calls with lengths given as a Python int (test_int_lengths_go_with_any_framework)."""
    def has_bf16(x):
        if isinstance(x, np.ndarray):
            return x.dtype == ml_dtypes.bfloat16
        return isinstance(x, (list, tuple)) and any(has_bf16(v) for v in x)

    int_lengths = any(type(call.a.get(k)) is int for k in ("q_lengths", "d_lengths"))
    return "numpy" if int_lengths or any(has_bf16(v) for v in call.a.values()) else fw


def _same_outcome(call: Call, cpu, gpu):
    """The GPU raised what the CPU raised (same kind where one corruption decides it), or returned
    bitwise what the CPU returned."""
    if isinstance(cpu, BaseException):
        assert isinstance(gpu, ALLOWED), f"GPU returned for a call the CPU refused ({cpu!r})"
        if len(call.broken) == 1:
            assert isinstance(gpu, ValueError) == isinstance(cpu, ValueError), (cpu, gpu)
        return
    assert not isinstance(gpu, BaseException), f"the GPU refused what the CPU took: {gpu!r}"
    check(Call(call.fn, call.a, expect=tuple(_host(x) for x in (cpu if isinstance(cpu, tuple) else (cpu,))),
               exact=call.exact), gpu)


def _gpu_run(call: Call, fw: str, **extra):
    import cupy

    conv = _on_gpu(_framework(call, fw))
    out = outcome(lambda: Call(call.fn, {**call.a, **extra}, generator=call.generator).run("gpu", conv))
    cupy.cuda.runtime.deviceSynchronize()  # a fault in the kernels surfaces here, not in a later test
    return out


FW = st.sampled_from(("numpy", "cupy"))


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_kernels")
@GPU
@given(st.one_of(forward_calls(), forward_calls(pairs=True)), FW)
def test_gpu_forward_matches_cpu(call, fw):
    # validate=True: device lengths raise as host ones do (by default they mark NaN:
    # tests/test_nan_contract_gpu.py)
    cpu = outcome(call.run)
    check(call, cpu)
    _same_outcome(call, cpu, _gpu_run(call, fw, validate=True))


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_kernels")
@GPU
@given(varlen_calls(), FW)
def test_gpu_varlen_matches_cpu(call, fw):
    cpu = outcome(call.run)
    check(call, cpu)
    if call.broken and all(b.startswith("d_offsets") and b != "d_offsets form" for b in call.broken):
        # Bad offset values the caller chose not to validate: wrong scores, but no error and no
        # access outside D_tokens (compute-sanitizer's memcheck watches that).
        out = _gpu_run(call, fw, validate_offsets=False)
        assert not isinstance(out, BaseException), out
    _same_outcome(call, cpu, _gpu_run(call, fw, validate=True))


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_kernels")
@GPU
@given(backward_calls(), FW)
def test_gpu_backward_matches_cpu(call, fw):
    cpu = outcome(call.run)
    check(call, cpu)
    _same_outcome(call, cpu, _gpu_run(call, fw, validate=True))
    if call.broken in (["argmax below -1"], ["argmax past the end"]):
        # Unvalidated, an out-of-range entry is never followed: the query token's dQ row is NaN, and
        # the rest is the CPU's for the same argmax with that entry set to -1.
        am = call.a["argmax"]
        off = call.a.get("d_offsets")
        limit = np.diff(np.asarray(off, np.int64))[:, None] if off is not None else call.a["D"].shape[-2]
        out_of_range = (am < -1) | (am >= limit)
        fixed = Call(call.fn, {**call.a, "argmax": np.where(out_of_range, -1, am).astype(np.int32)})
        want = outcome(fixed.run)
        got = _gpu_run(call, fw, validate=False)
        assert not isinstance(got, BaseException), got
        wq, wd = (np.asarray(_host(x), np.float64) for x in want)
        gq, gd = (np.asarray(_host(x), np.float64) for x in got)
        lq = am.shape[-1]
        rows = gq.size // gq.shape[-1]  # query tokens: nq * lq
        nan_rows = out_of_range.reshape(rows // lq, -1, lq).any(axis=1).reshape(-1)  # [nq * lq]
        gq, wq = gq.reshape(rows, -1), wq.reshape(rows, -1)
        assert np.isnan(gq[nan_rows]).all() and not np.isnan(gq[~nan_rows]).any()
        np.testing.assert_allclose(gq[~nan_rows], wq[~nan_rows], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(gd, wd, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_kernels")
@GPU
@given(retrieve_calls(), FW)
def test_gpu_retrieve_matches_cpu(call, fw):
    # strict mode: device offsets and lengths raise as host ones do (retrieve has no validate
    # argument; by default they mark NaN: tests/test_nan_contract_gpu.py)
    cpu = outcome(call.run)
    check(call, cpu)
    with mock.patch.dict(os.environ, {"LIK_VALIDATE": "1"}):
        gpu = _gpu_run(call, fw)
    _same_outcome(call, cpu, gpu)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu_kernels")
@GPU
@given(int8_calls(dims=st.sampled_from((16, 32))), FW)  # the INT8 kernels take dims in multiples of 16
def test_gpu_int8_matches_cpu(call, fw):
    cpu = outcome(call.run)
    check(call, cpu)
    _same_outcome(call, cpu, _gpu_run(call, fw, validate=True))
