"""Where BLAS rounding could decide the argmax, decide in float64.

The similarity block comes from one GEMM in float32 (float64 for float64 inputs). BLAS rounds
each dot product a little differently depending on where it falls in its blocking, so two
bitwise-identical document tokens can get different similarities, and two tokens whose float64
similarities are a hair apart can come out in the wrong order. The argmax the CPU path returns is
the argmax of the *reference similarity* ``r(q, t)``: the float64 dot product of the two vectors
summed in one fixed order (:func:`dot64`: NumPy's pairwise summation; the products are exact for
float16, bfloat16 and float32 inputs), a function of the two vectors alone. Ties go to the lowest
index.

The rounding bound. For a dot product of length ``d`` evaluated with any summation order, FMA or
not, ``|fl(q.t) - q.t| <= gamma_d * sum_i |q_i t_i| <= gamma_d * ||q|| * ||t||`` with
``gamma_d = d u / (1 - d u)`` (``u``: unit roundoff; plus ``d`` times the smallest subnormal for
underflow). Let ``g`` be the GEMM's similarities and ``r`` the reference; both are within such a bound
of the exact value, so ``|g(t) - r(t)| <= B(t) = (gamma_g + gamma_r) ||q|| ||t||``. If ``t*`` is the
reference argmax and ``t_g`` the GEMM's, ``g(t*) >= r(t*) - B(t*) >= r(t_g) - B(t*) >=
g(t_g) - B(t_g) - B(t*)``: every reference maximiser lies within ``margin = 2 (gamma_g + gamma_r)
||q|| max_t ||t||`` of the GEMM's max. :func:`margin` adds ``4 u`` times the same product, far more
than the float64 rounding of the margin and of the threshold ``max - margin`` (both in float64, so
the GEMM's values compare with it exactly). So a document whose GEMM max has no other column within
the margin has its reference argmax there; one with two or more is *refined*: ``r`` is computed for
the columns within the margin and the first of their maxima wins. ``||q||`` and ``max_t ||t||`` come
from :func:`norm_bound`, an upper bound however the squares round or underflow (for the documents,
taken over runs of consecutive tokens: a run's norm bounds each of its tokens').

Overflow never hides from the argmax: a float32 dot product that overflows stays inf or NaN (an
infinity never becomes finite again), so its document's GEMM max is non-finite, or, for an overflow
to -inf, its norms' product is beyond float32's range and the margin is infinite. Documents whose
GEMM max is NaN or infinite are recomputed whole in float64 (:class:`Pending`, every valid column):
their max and argmax are then the reference's, and a NaN score means a NaN reference similarity.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["margin", "norm_bound", "bound_norms", "norm_terms", "dot64", "Pending"]

_PER_CANDIDATE = 128  # bytes a pair's candidate column takes until decided (indices, masks, values, gathers)


def _gamma(dim: int, u: float) -> float:
    return dim * u / (1 - dim * u) if dim * u < 0.5 else np.inf


@functools.cache
def _margin_terms(dim: int, dtype: np.dtype) -> tuple[float, float]:
    """The margin's factor of the norms' product, and its underflow term (:func:`margin`)."""
    u_gemm = float(np.finfo(dtype).eps) / 2
    u_ref = float(np.finfo(np.float64).eps) / 2
    tiny = 2.0 * (dim + 1) * float(np.finfo(dtype).smallest_subnormal)  # underflow, the GEMM's and the reference's
    return 2 * (_gamma(dim, u_gemm) + _gamma(dim, u_ref)) + 4 * u_gemm, tiny


def margin(qn: np.ndarray, dn: np.ndarray, dim: int, dtype) -> np.ndarray:
    """float64 ``[M, nb]``: a rounding margin for query tokens of norm at most ``qn [M]`` against
    documents whose tokens have norm at most ``dn [M, nb]``, for a GEMM in ``dtype`` (module
    docstring), infinite where it overflows or cannot be bounded. Its ``4 u`` (GEMM's ``u``) more
    than the bound covers the float64 rounding of the margin and of the threshold ``max - margin``."""
    c, tiny = _margin_terms(dim, np.dtype(dtype))
    with np.errstate(over="ignore", invalid="ignore"):
        m = (c * qn.astype(np.float64))[:, None] * dn + tiny
    m[np.isnan(m)] = np.inf  # NaN norms: no bound
    return m


@functools.cache
def norm_terms(d: int, dtype: np.dtype) -> tuple:
    """What :func:`norm_bound` adds to and multiplies rows of ``d`` elements by, in ``dtype``."""
    f = np.finfo(dtype)
    u = float(f.eps) / 2
    t = dtype.type
    return t(d * float(f.smallest_subnormal)), t(1 + 2 * _gamma(d + 1, u)), t(1 + 4 * u)


def norm_bound(x: np.ndarray) -> np.ndarray:
    """An upper bound on the Euclidean norm of each row of ``x [n, d]`` (float32 or float64), in its
    dtype: the sum of squares plus what underflow can lose, inflated by its rounding bound, and the
    square root by ``4 u`` for the last three roundings (each at most ``u``, relative)."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return bound_norms(np.vecdot(x, x), x.shape[1])


def bound_norms(squares: np.ndarray, d: int) -> np.ndarray:
    """:func:`norm_bound` from the sums of squares ``np.vecdot`` gave for rows of ``d`` elements or
    fewer (float32 or float64), in place."""
    underflow, inflate, root = norm_terms(d, squares.dtype)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        squares += underflow
        squares *= inflate
        np.sqrt(squares, out=squares)
        squares *= root
    return squares


def dot64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The reference similarity of row pairs ``a[..., :] . b[..., :]`` (broadcast, ``[..., d]``) ->
    float64 ``[...]``: the products in float64 (exact for float16, bfloat16 and float32 inputs),
    summed along ``d`` by ``np.add.reduce``, NumPy's pairwise summation, whose order is fixed by ``d``
    alone: the value depends on the two vectors only, never on where they sit, on the rows beside
    them or on BLAS (``fold.py`` computes the same sums compiled, step for step)."""
    with np.errstate(invalid="ignore", over="ignore"):  # (a signalling NaN warns as it converts)
        return np.add.reduce(np.multiply(a, b, dtype=np.float64), axis=-1)


class Pending:
    """The (query row, document) pairs of a block whose winner the reference similarity decides, with
    their candidate columns, collected over the block's chunks while each chunk's similarities are at
    hand, and decided together (one batch of dot products), or sooner once they pass half of
    ``budget`` bytes. A decided pair's winner (the first of its candidates' maxima; a NaN is the max)
    goes to ``idx`` (local to its document) and its reference similarity to ``val``.

    ``A [M, d]``: the query rows (None: exact similarities, decided by their own values);
    ``T [sets, N, d]``: the block's tokens; ``row_set [M]``: each row's document set; ``start [nb]``:
    each document's first column."""

    def __init__(self, A, T, row_set, start, idx, val, budget: int):
        self.A, self.T, self.row_set, self.start, self.idx, self.val = A, T, row_set, start, idx, val
        self.budget = budget
        self._clear()

    def _clear(self) -> None:
        self._parts: list = []
        self._pairs = 0
        self._bytes = 0

    def add(self, S, runs, c0: int, j0: int, rows, docs, thr) -> None:
        """Pairs ``rows``, ``docs`` (int ``[G]``; documents of ``runs``, a chunk whose first document
        is the block's ``j0`` and whose columns, from the block's ``c0``, ``S`` holds). Their
        candidates: the valid columns with ``S >= thr[row, doc]`` (``thr`` None: every valid column)."""
        if not rows.size:
            return
        lengths = runs.length[docs]
        most = max(1, self.budget // 4 // 40)  # pairs a piece may hold (each of one column at least)
        g0 = 0
        while g0 < rows.size:  # pieces of the budget (one pair at least)
            # A piece gathers [pairs, its longest run]: 40 bytes a column (its index, mask and value as
            # gathered), so its pairs times its longest run, not the sum of their lengths, stays within
            # the budget (one long run among many short ones took it many times over).
            w = lengths[g0:g0 + most]
            area = np.arange(1, w.size + 1) * np.maximum.accumulate(w) * 40
            g1 = g0 + max(1, int(np.searchsorted(area, self.budget // 4, side="right")))
            if g1 == g0 + 1 and lengths[g0] * _PER_CANDIDATE > self.budget // 4:
                self._add_long(S, runs, c0, j0, int(rows[g0]), int(docs[g0]), thr)  # (a long run's pair)
                g0 = g1
                continue
            r, j = rows[g0:g1], docs[g0:g1]
            local = np.arange(int(lengths[g0:g1].max()))
            cand = local[None, :] < lengths[g0:g1][:, None]
            cols = np.where(cand, runs.start[j][:, None] + local[None, :], 0)
            if runs.valid is not None:
                cand &= runs.valid[self.row_set[r][:, None], cols]
            vals = S[r[:, None], cols]
            if thr is not None:
                cand &= vals >= thr[r, j][:, None]
            g, c = np.nonzero(cand)  # every pair has one: its max column, or a valid one
            given = vals[g, c].astype(np.float64) if self.A is None else None
            self._parts.append((r, j + j0, g + self._pairs, cols[g, c] + c0, given))
            self._pairs += r.size
            self._bytes += 24 * g.size + 16 * r.size
            if self._bytes > self.budget // 2:
                self.flush()
            g0 = g1

    def _add_long(self, S, runs, c0: int, j0: int, r: int, j: int, thr) -> None:
        """One pair of a run too long for a piece of the budget: its candidates listed a slice of
        columns at a time. Few (a near tie or two, as a rule), they join the others as any pair's;
        past the budget (a run all tied, or holding a NaN), the pair is decided as they come,
        keeping the first of the maxima so far (the first NaN, once there is one), as :meth:`flush`
        decides."""
        start, length = int(runs.start[j]), int(runs.length[j])
        limit = max(1, self.budget // 4 // _PER_CANDIDATE)  # candidates held at once
        step = max(1, self.budget // 4 // 16)  # columns compared at once (a value, a mask, an index)
        kept: list = []  # (columns of the block, their exact values or None) while few
        held, best, at = 0, None, -1
        for a in range(start, start + length, step):
            b = min(start + length, a + step)
            seg = S[r, a:b]
            cand = seg >= thr[r, j] if thr is not None else np.ones(b - a, bool)
            if runs.valid is not None:
                cand &= runs.valid[self.row_set[r], a:b]
            at_ = np.flatnonzero(cand)
            if not at_.size:
                continue
            part = (at_ + (a + c0), seg[at_].astype(np.float64) if self.A is None else None)
            if best is None and held + at_.size <= limit:
                kept.append(part)
                held += at_.size
                continue
            for cols, given in [*kept, part]:
                best, at = self._running_max(r, cols, given, best, at)
                if np.isnan(best):
                    break
            kept = []
            if np.isnan(best):
                break
        if best is not None:
            self.idx[r, j + j0] = at - self.start[j + j0]
            self.val[r, j + j0] = best
            return
        if kept:  # few: decided with the others
            cols, given = (np.concatenate(x) if x[0] is not None else None for x in zip(*kept))
            self._parts.append((np.array([r]), np.array([j + j0]), np.full(cols.size, self._pairs), cols, given))
            self._pairs += 1
            self._bytes += 24 * cols.size + 16
            if self._bytes > self.budget // 2:
                self.flush()

    def _running_max(self, r: int, cols, given, best, at):
        """``(best, at)`` after the candidates ``cols`` (block columns, in order) of row ``r``: a larger
        value replaces them, an equal one does not; the first NaN ends it. Their reference
        similarities are taken a slice at a time (a slice's rows gathered and in float64)."""
        step = max(1, self.budget // 2 // (32 * self.T.shape[-1] + 32))
        for a in range(0, cols.size, step):
            c = cols[a:a + step]
            val = given[a:a + step] if given is not None else dot64(self.A[r], self.T[self.row_set[r], c])
            top = val.max()  # NaN propagates
            if np.isnan(top):
                return top, int(c[np.argmax(np.isnan(val))])
            if best is None or top > best:
                best, at = top, int(c[np.argmax(val == top)])
        return best, at

    def flush(self) -> None:
        """Decide every pair collected so far."""
        if not self._parts:
            return
        rows, docs, pair, col, given = (np.concatenate(p) if p[0] is not None else None for p in zip(*self._parts))
        self._clear()
        if given is not None:
            val = given
        else:
            val = np.empty(pair.size)
            step = max(1, self.budget // 2 // (32 * self.A.shape[1] + 32))  # a pair's two rows, as given and in float64
            for p0 in range(0, pair.size, step):
                p = slice(p0, p0 + step)
                rr = rows[pair[p]]
                val[p] = dot64(self.A[rr], self.T[self.row_set[rr], col[p]])
        starts = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1]])
        gmax = np.maximum.reduceat(val, starts)  # NaN propagates
        each = np.repeat(gmax, np.diff(np.r_[starts, pair.size]))
        hit = np.flatnonzero((val == each) | (np.isnan(val) & np.isnan(each)))
        first = hit[np.r_[True, pair[hit][1:] != pair[hit][:-1]]]  # candidates are in column order
        self.idx[rows, docs] = col[first] - self.start[docs]
        self.val[rows, docs] = gmax
