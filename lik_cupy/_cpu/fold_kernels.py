"""The compiled kernels of ``fold.py`` (Numba, ``nopython``, the GIL released, cached on disk beside
this file or in Numba's user cache). Imported by ``fold.py`` at its first use, never with the package;
``fold.py`` says what they compute and why."""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["dot", "piece", "scratch", "widen"]

_PAIRWISE_BLOCK = 128  # NumPy's PW_BLOCKSIZE: runs this long or shorter sum in eight interleaved partial sums


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _block(p, lo, n):  # pragma: no cover (compiled): NumPy's pairwise_sum of p[lo:lo + n], n <= 128
    if n < 8:
        res = 0.0
        for i in range(n):
            res += p[lo + i]
        return res
    r0, r1, r2, r3 = p[lo], p[lo + 1], p[lo + 2], p[lo + 3]
    r4, r5, r6, r7 = p[lo + 4], p[lo + 5], p[lo + 6], p[lo + 7]
    i = 8
    while i < n - n % 8:
        r0 += p[lo + i]
        r1 += p[lo + i + 1]
        r2 += p[lo + i + 2]
        r3 += p[lo + i + 3]
        r4 += p[lo + i + 4]
        r5 += p[lo + i + 5]
        r6 += p[lo + i + 6]
        r7 += p[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += p[lo + i]
        i += 1
    return res


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _block_dot(a, b):  # pragma: no cover (compiled): _block of the products a[k] * b[k], a.size <= 128
    n = a.size  # (the same additions in the same order, each product rounded to float64 as NumPy's is)
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[i] * np.float64(b[i])
        return res
    r0, r1 = a[0] * np.float64(b[0]), a[1] * np.float64(b[1])
    r2, r3 = a[2] * np.float64(b[2]), a[3] * np.float64(b[3])
    r4, r5 = a[4] * np.float64(b[4]), a[5] * np.float64(b[5])
    r6, r7 = a[6] * np.float64(b[6]), a[7] * np.float64(b[7])
    i = 8
    while i < n - n % 8:
        r0 += a[i] * np.float64(b[i])
        r1 += a[i + 1] * np.float64(b[i + 1])
        r2 += a[i + 2] * np.float64(b[i + 2])
        r3 += a[i + 3] * np.float64(b[i + 3])
        r4 += a[i + 4] * np.float64(b[i + 4])
        r5 += a[i + 5] * np.float64(b[i + 5])
        r6 += a[i + 6] * np.float64(b[i + 6])
        r7 += a[i + 7] * np.float64(b[i + 7])
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[i] * np.float64(b[i])
        i += 1
    return res


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _pairwise(p, n, frames, vals):  # pragma: no cover (compiled)
    """NumPy's pairwise_sum of ``p[:n]``: blocks of 128 or fewer as :func:`_block`, longer runs split
    at half rounded down to a multiple of 8, the halves' sums added. Without recursion (a cached
    recursive function crashed as Numba loaded it): ``frames [64, 3]`` (start, length, whether its
    left half is summed) and ``vals [64]`` (that sum) are the stack."""
    if n <= _PAIRWISE_BLOCK:
        return _block(p, 0, n)
    sp = 0
    frames[0, 0], frames[0, 1], frames[0, 2] = 0, n, 0
    while True:
        lo, m = frames[sp, 0], frames[sp, 1]
        if m > _PAIRWISE_BLOCK:  # its left half first
            half = m // 2
            half -= half % 8
            sp += 1
            frames[sp, 0], frames[sp, 1], frames[sp, 2] = lo, half, 0
            continue
        ret = _block(p, lo, m)
        sp -= 1
        while sp >= 0:
            if frames[sp, 2] == 0:  # a left half summed: its right half next
                vals[sp] = ret
                frames[sp, 2] = 1
                half = frames[sp, 1] // 2
                half -= half % 8
                sp += 1
                frames[sp, 0], frames[sp, 1], frames[sp, 2] = frames[sp - 1, 0] + half, frames[sp - 1, 1] - half, 0
                break
            ret = vals[sp] + ret  # both halves summed
            sp -= 1
        if sp < 0:
            return ret


@numba.njit(nogil=True, cache=True, boundscheck=False)
def dot(a, b, prod, frames, vals):  # pragma: no cover (compiled)
    """``np.add.reduce(a * b)`` in float64 (``refine.dot64``); ``prod`` a scratch of ``a.size``,
    ``frames`` and ``vals`` :func:`_pairwise`'s (unused for rows of 128 or fewer)."""
    if a.size <= _PAIRWISE_BLOCK:
        return 0.0 + _block_dot(a, b)
    for k in range(a.size):
        prod[k] = a[k] * np.float64(b[k])
    return 0.0 + _pairwise(prod, a.size, frames, vals)


def scratch(d: int):
    """:func:`dot`'s scratch for rows of ``d``: (prod, frames, vals)."""
    return np.empty(d), np.empty((64, 3), np.int64), np.empty(64)


@numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _squares(T, t):  # pragma: no cover (compiled)
    """The sum of token ``T[t]``'s squares in any order, fused or not: ``refine.norm_terms``' bound
    holds for every order (with fewer roundings where fused), which lets it vectorise."""
    ss = T.dtype.type(0)
    for k in range(T.shape[1]):
        ss += T[t, k] * T[t, k]
    return ss


@numba.njit(nogil=True, cache=True, boundscheck=False)
def piece(St, T, A64, valid, start, length, terms, p0, p1, state, squares, top, runner, runner2, at, nan, offset,
          first, best, second, win, norms):  # pragma: no cover (compiled; fold.DocumentFold.piece says what)
    """Columns ``p0 .. p1`` of ``St [n, R]``: the running maxima ``top``, the runner-up in ``runner``
    or ``runner2`` (``state[1]`` says which holds it), ``at`` (whose dtype, int64 or int32,
    ``offset``'s one element shares: each vectorises best for few or many rows), ``nan`` and the largest
    sum of squares ``squares[0]`` of the document ``state[0]``; each document that ends here written to
    ``first``, ``best``, ``second``, ``win`` and ``norms``."""
    n_rows = St.shape[1]
    prod = np.empty(T.shape[1])  # (one row's products: d * 8 bytes, whatever the rows)
    frames = np.empty((64, 3), np.int64)
    vals = np.empty(64)
    masked = valid.size > 0
    short = T.shape[1] <= _PAIRWISE_BLOCK  # (dot's own test, taken once: the call is not inlined)
    underflow, inflate, root = terms[0], terms[1], terms[2]
    j = state[0]
    while j < start.size:
        s = start[j]
        e = s + length[j]
        for t in range(max(s, p0), min(e, p1)):
            if masked and not valid[t]:
                continue
            ss = _squares(T, t)
            if ss > squares[0] or ss != ss:  # (a NaN stays)
                squares[0] = ss
            offset[0] = t - s
            off = offset[0]
            # Every array read once into a local and every store unconditional, so that the loop
            # vectorises without masked loads or stores (slow on AMD's cores): a value read on one
            # path only became a masked load, and a store of "new or old" a masked store. Hence the
            # runner-up goes to the other buffer (never stored back where it was read) and ``at`` by
            # a bitwise select. The runner-up: the old top where v beats it, else the larger of v
            # and the old runner-up (a NaN v changes nothing).
            if state[1]:
                src, dst = runner2, runner
            else:
                src, dst = runner, runner2
            for r in range(n_rows):
                v = St[t, r]
                tp = top[r]
                rn = src[r]
                a = at[r]
                up = v > tp
                m = tp if up else v
                dst[r] = m if m > rn else rn
                at[r] = a ^ ((a ^ off) & -up)
                top[r] = v if up else tp
                nan[r] = nan[r] | (v != v)
            state[1] = 1 - state[1]
        if e > p1:
            break  # the document goes on in the next piece
        norms[j] = np.sqrt((squares[0] + underflow) * inflate) * root  # refine.bound_norms's steps
        squares[0] = 0
        held = runner2 if state[1] else runner
        for r in range(n_rows):
            first[r, j] = at[r]
            best[r, j] = np.nan if nan[r] else top[r]
            second[r, j] = held[r]
            if e == s:
                win[r, j] = -np.inf
            elif short:
                win[r, j] = 0.0 + _block_dot(A64[r], T[s + at[r]])
            else:
                win[r, j] = dot(A64[r], T[s + at[r]], prod, frames, vals)
            top[r] = -np.inf
            held[r] = -np.inf
            at[r] = 0
            nan[r] = False
        j += 1
    state[0] = j


@numba.njit(nogil=True, cache=True, boundscheck=False)
def widen(bits, table, out):  # pragma: no cover (compiled)
    """``out[i] = table[bits[i]]``: 16-bit values (their bits, uint16) widened by a table of all 65,536."""
    for i in range(bits.size):
        out[i] = table[bits[i]]
