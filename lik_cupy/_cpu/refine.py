"""Where BLAS rounding could decide the argmax, decide in float64.

The similarity block comes from one GEMM in float32 (float64 for float64 inputs). BLAS rounds
each dot product a little differently depending on where it falls in its blocking, so two
bitwise-identical document tokens can get different similarities, and two tokens whose float64
similarities are a hair apart can come out in the wrong order. The argmax the CPU path returns is
the argmax of the *reference similarity* ``r(q, t)``: the float64 dot product of the two vectors
summed in one fixed order (:func:`dot64`: NumPy's pairwise sum of the products, which are exact for
float16, bfloat16 and float32 inputs), a function of the two vectors alone. Ties go to the lowest
index.

The rounding bound. For a dot product of length ``d`` evaluated with any summation order, FMA or
not, ``|fl(q.t) - q.t| <= gamma_d * sum_i |q_i t_i| <= gamma_d * ||q|| * ||t||`` with
``gamma_d = d u / (1 - d u)`` (``u``: unit roundoff; plus ``d`` times the smallest subnormal for
underflow). Let ``g`` be the GEMM's similarities and ``r`` the reference; both are within such a bound
of the exact value, so ``|g(t) - r(t)| <= B(t) = (gamma_g + gamma_r) ||q|| ||t||``. If ``t*`` is the
reference argmax and ``t_g`` the GEMM's, ``g(t*) >= r(t*) - B(t*) >= r(t_g) - B(t*) >=
g(t_g) - B(t_g) - B(t*)``: every reference maximiser lies within ``margin = 2 (gamma_g + gamma_r)
||q|| max_t ||t||`` of the GEMM's max. :func:`margin` adds ``4 u`` times the same product for the
rounding of the threshold itself and rounds the result up. So a document whose GEMM max has no other
column within the margin has its reference argmax there; one with two or more is *refined*: ``r`` is
computed for the columns within the margin and the first of their maxima wins. ``||t||`` comes from
:func:`norm_bound`, an upper bound however the squares round or underflow.

Overflow never hides from the argmax: a float32 dot product that overflows stays inf or NaN (an
infinity never becomes finite again), so its document's GEMM max is non-finite, or, for an overflow
to -inf, its norms' product is beyond float32's range and the margin is infinite. Documents whose
GEMM max is NaN or infinite are recomputed whole in float64 (:func:`refine` with ``thr=None``):
their max and argmax are then the reference's, and a NaN score means a NaN reference similarity.
"""

from __future__ import annotations

import numpy as np

__all__ = ["margin", "norm_bound", "dot64", "refine"]


def _gamma(dim: int, u: float) -> float:
    return dim * u / (1 - dim * u) if dim * u < 0.5 else np.inf


def margin(qn: np.ndarray, dn: np.ndarray, dim: int, dtype) -> np.ndarray:
    """``[M, nb]`` in ``dtype`` (the GEMM's): a rounding margin for query tokens of norm at most
    ``qn [M]`` against documents whose tokens have norm at most ``dn [M, nb]`` (module docstring),
    rounded up, infinite where it overflows or cannot be bounded."""
    u_gemm = float(np.finfo(dtype).eps) / 2
    u_ref = float(np.finfo(np.float64).eps) / 2
    tiny = 2.0 * (dim + 1) * float(np.finfo(dtype).smallest_subnormal)  # underflow, the GEMM's and the reference's
    c = 2 * (_gamma(dim, u_gemm) + _gamma(dim, u_ref)) + 4 * u_gemm
    with np.errstate(over="ignore", invalid="ignore"):
        m = c * qn.astype(np.float64)[:, None] * dn.astype(np.float64) + tiny
        m = np.nextafter(m.astype(dtype), np.inf)  # (the cast rounds to nearest)
    return np.where(np.isnan(m), np.inf, m).astype(dtype, copy=False)  # NaN norms: no bound


def norm_bound(x: np.ndarray) -> np.ndarray:
    """An upper bound on the Euclidean norm of each row of ``x [n, d]`` (float32 or float64), in its
    dtype: the sum of squares plus what underflow can lose, inflated by its rounding bound, and the
    square root by ``4 u`` for the last three roundings (each at most ``u``, relative)."""
    f = np.finfo(x.dtype)
    d = x.shape[1]
    u = float(f.eps) / 2
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        sq = np.vecdot(x, x)
        sq += x.dtype.type(d * float(f.smallest_subnormal))
        sq *= x.dtype.type(1 + 2 * _gamma(d + 1, u))
        out = np.sqrt(sq, out=sq)
        out *= x.dtype.type(1 + 4 * u)
        return out


def dot64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The reference similarity of row pairs ``a[p] . b[p]`` (``[P, d]`` each) -> float64 ``[P]``:
    exact float64 products summed pairwise along each row, so the value depends on the two rows
    only, never on where they sit."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.add.reduce(a.astype(np.float64) * b.astype(np.float64), axis=1)


def refine(S: np.ndarray, runs, rows: np.ndarray, docs: np.ndarray, row_set: np.ndarray, thr: np.ndarray | None,
           A: np.ndarray | None, T: np.ndarray | None, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The argmax (local column) and max of documents ``docs`` for query rows ``rows`` (int ``[G]``
    each): over the document's valid columns with ``S[row] >= thr[row, doc]`` (``thr`` None: every
    valid column), by the reference similarity of ``A[row]`` and the column's token, ``T[set, column]``
    (``T [sets, N, d]``, ``row_set [M]`` each row's set; ``A`` None: by ``S`` itself, for exact INT8
    similarities). The first of the maxima wins; a NaN is the max.

    Returns int64 ``[G]`` and float64 ``[G]``. Temporaries stay within about ``budget`` bytes (one
    group's columns at least)."""
    idx = np.empty(rows.size, np.int64)
    best = np.empty(rows.size, np.float64)
    if not rows.size:
        return idx, best
    lengths = runs.length[docs]
    # Half the budget for a chunk of groups' columns (per column: its index, masks and value; per
    # candidate: its pair and r), half for the float64 rows of its candidates, in pieces.
    cum = np.cumsum(lengths * 64)
    pair_bytes = 32 * (1 if A is None else A.shape[1]) + 32  # a pair's rows as given and in float64, their product
    g0 = 0
    while g0 < rows.size:  # chunks of groups (one group at least)
        spent = int(cum[g0 - 1]) if g0 else 0
        g1 = max(g0 + 1, int(np.searchsorted(cum, spent + budget // 2, side="right")))
        r, j = rows[g0:g1], docs[g0:g1]
        width = int(lengths[g0:g1].max())
        local = np.arange(width)
        cand = local[None, :] < lengths[g0:g1][:, None]
        cols = np.where(cand, runs.start[j][:, None] + local[None, :], 0)
        if runs.valid is not None:
            cand &= runs.valid[row_set[r][:, None], cols]
        vals = S[r[:, None], cols]
        if thr is not None:
            cand &= vals >= thr[r, j][:, None]
        g, c = np.nonzero(cand)  # every group has a candidate: its max column, or a valid one
        del cand
        if A is None:
            val = vals[g, c].astype(np.float64)
        else:
            val = np.empty(g.size)
            step = max(1, budget // 2 // pair_bytes)
            for p0 in range(0, g.size, step):  # the float64 rows in pieces of the budget
                p = slice(p0, p0 + step)
                val[p] = dot64(A[r[g[p]]], T[row_set[r[g[p]]], cols[g[p], c[p]]])
        del vals
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        gmax = np.maximum.reduceat(val, starts)  # NaN propagates
        each = np.repeat(gmax, np.diff(np.r_[starts, g.size]))
        hit = np.flatnonzero((val == each) | (np.isnan(val) & np.isnan(each)))
        first = hit[np.r_[True, g[hit][1:] != g[hit][:-1]]]  # candidates are in column order
        idx[g0:g1] = c[first]
        best[g0:g1] = gmax
        g0 = g1
    return idx, best
