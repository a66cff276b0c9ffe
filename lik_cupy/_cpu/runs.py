"""The documents of one block as runs of consecutive columns of the similarity block ``S [M, N]``
(M query tokens by N document tokens), and the per-document reductions over them.

Padded documents are runs of one width (masked columns inside hold -inf); packed documents are
runs of their own lengths. Every reduction is one NumPy pass over ``S`` or a boolean of its shape:
``np.maximum.reduceat`` over the runs (as fast here as a reshaped ``max``, and it takes packed
runs without padding them), ``argmax`` over the reshaped padded runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Runs"]


@dataclass(frozen=True)
class Runs:
    """``start`` / ``length``: int64 ``[nb]``, each document's columns ``start .. start + length``;
    ``width``: the common length of padded documents (None: packed); ``valid``: bool ``[sets, N]``,
    the columns that count in each document set (None: all of them); ``nonempty``: bool
    ``[sets, nb]``, documents with a column that counts. A block holds one set of documents shared
    by every query, or one set per query (candidate sets), all with these runs of columns."""

    start: np.ndarray
    length: np.ndarray
    width: int | None
    valid: np.ndarray | None
    nonempty: np.ndarray

    @staticmethod
    def padded(nb: int, width: int, valid: np.ndarray) -> Runs:
        """``nb`` documents of ``width`` columns each; ``valid`` bool ``[sets, nb * width]``."""
        start = np.arange(nb, dtype=np.int64) * width
        length = np.full(nb, width, np.int64)
        sets = valid.shape[0]
        if valid.all():
            return Runs(start, length, width, None, np.full((sets, nb), width > 0))
        return Runs(start, length, width, valid, valid.reshape(sets, nb, width).any(axis=2))

    @staticmethod
    def packed(offsets: np.ndarray) -> Runs:
        """Documents ``offsets[j] - offsets[0] .. offsets[j + 1] - offsets[0]`` (int64 ``[nb + 1]``), one set."""
        start = offsets[:-1] - offsets[0]
        length = np.diff(offsets)
        return Runs(start, length, None, None, (length > 0)[None, :])

    @property
    def count(self) -> int:
        """Documents in the block."""
        return self.start.size

    def chunks(self, columns: int):
        """The block in chunks of whole documents of about ``columns`` columns (one document at
        least): ``(j0, j1, c0, c1, runs)``, documents ``j0 .. j1`` in columns ``c0 .. c1``, and their
        runs relative to ``c0``."""
        nb = self.count
        if self.width is not None:
            step = max(1, columns // max(1, self.width))
            for j0 in range(0, nb, step):
                j1 = min(nb, j0 + step)
                c0, c1 = j0 * self.width, j1 * self.width
                valid = None if self.valid is None else self.valid[:, c0:c1]
                yield j0, j1, c0, c1, Runs(self.start[:j1 - j0], self.length[:j1 - j0], self.width, valid,
                                           self.nonempty[:, j0:j1])
            return
        end = self.start + self.length
        j0 = 0
        while j0 < nb:
            c0 = int(self.start[j0])
            j1 = min(nb, max(j0 + 1, int(np.searchsorted(end, c0 + columns, side="right"))))
            c1 = int(end[j1 - 1])
            yield j0, j1, c0, c1, Runs(self.start[j0:j1] - c0, self.length[j0:j1], None, None,
                                       self.nonempty[:, j0:j1])
            j0 = j1

    def mask_invalid(self, S: np.ndarray, row_set: np.ndarray) -> None:
        """Masked columns never win: -inf, in place (``row_set [M]``: each row's document set, the
        rows of a set consecutive)."""
        if self.valid is None:
            return
        if self.valid.shape[0] == 1:
            S[:, ~self.valid[0]] = -np.inf
            return
        sets, n = self.valid.shape
        i, c = np.nonzero(~self.valid)
        S.reshape(sets, S.shape[0] // sets, n)[i, :, c] = -np.inf

    def max(self, S: np.ndarray) -> np.ndarray:
        """Per-document max ``[M, nb]`` (NaN propagates; -inf for a document with no column)."""
        out = np.full((S.shape[0], self.count), -np.inf, S.dtype)
        some = self.length > 0
        if some.any():
            out[:, some] = np.maximum.reduceat(S, self.start[some], axis=1)
        return out

    def compare(self, S: np.ndarray, thr: np.ndarray) -> np.ndarray:
        """bool ``[M, N]``: ``S >= thr`` of the column's document (``thr [M, nb]``; packed documents
        repeat it over their columns first). A float64 ``thr`` against float32 ``S`` is compared as
        the least float32 at or above it, which gives every float32 the same answer without
        widening ``S`` or repeating float64s."""
        if S.dtype == np.float32 and thr.dtype == np.float64:
            with np.errstate(over="ignore"):  # (beyond float32's range: the infinity on that side)
                t = thr.astype(np.float32)
            low = t < thr  # rounded down (NaN: never)
            t[low] = np.nextafter(t[low], np.float32(np.inf))
            thr = t
        if self.width is not None:
            nb, w = self.count, self.width
            return (S.reshape(S.shape[0], nb, w) >= thr[:, :, None]).reshape(S.shape)
        return S >= np.repeat(thr, self.length, axis=1)

    def argmax(self, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-document first maximum column (local) and maximum, ``[M, nb]`` each, in one pass over
        ``S`` (a NaN is the max, at its first column; a document with no column: 0 and -inf).
        Padded runs only: NumPy has no segmented argmax."""
        m, nb, w = S.shape[0], self.count, self.width
        if not w:
            return np.zeros((m, nb), np.int64), np.full((m, nb), -np.inf, S.dtype)
        first = S.reshape(m, nb, w).argmax(axis=2)
        return first, S.reshape(m * nb, w)[np.arange(m * nb), first.reshape(-1)].reshape(m, nb)

    def second_max(self, S: np.ndarray, first: np.ndarray) -> np.ndarray:
        """Per-document max ``[M, nb]`` of the columns other than ``first`` (local, ``[M, nb]``; -inf for
        a document of one column). Padded runs only; ``S`` (C-contiguous) is left as it was."""
        m, nb, w = S.shape[0], self.count, self.width
        if not w:
            return np.full((m, nb), -np.inf, S.dtype)
        flat = S.reshape(-1)
        at = np.arange(m * nb, dtype=np.int64) * w + first.reshape(-1)
        kept = flat[at]
        flat[at] = -np.inf
        second = np.maximum.reduceat(S, self.start, axis=1)  # (faster here than a reshaped max)
        flat[at] = kept
        return second

    def first_hit(self, hit: np.ndarray) -> np.ndarray:
        """For bool ``hit [M, N]``: each document's first hit column, local to it (``[M, nb]``; 0 where
        a document has none)."""
        m, nb = hit.shape[0], self.count
        if self.width is not None:
            return hit.reshape(m, nb, self.width).argmax(axis=2) if self.width else np.zeros((m, nb), np.int64)
        first = np.zeros((m, nb), np.int64)
        some = self.length > 0
        if some.any():
            starts = self.start[some]
            n = hit.shape[1]
            code = np.where(hit, np.arange(n, dtype=np.int64 if n >= 2**31 else np.int32), n)
            first[:, some] = np.minimum.reduceat(code, starts, axis=1) - starts
        return np.minimum(first, np.maximum(self.length - 1, 0)[None, :])

    def hits(self, hit: np.ndarray, ok: np.ndarray, budget: int):
        """``first_hit(hit)`` and then ``second_hits(hit, first, ok, budget)`` (which clears the first
        hits in ``hit``), for ``hit`` that holds a hit in every ``ok`` document and none elsewhere:
        from the hits' positions when they fit ``budget`` bytes (a pass to count them and one to
        list them, where those two make four over ``hit``), else as those two do."""
        m, n = hit.shape
        if self.width is not None or np.count_nonzero(hit) * 24 > budget:
            first = self.first_hit(hit)
            return first, *self.second_hits(hit, first, ok, budget)
        rows, cols = np.divmod(np.flatnonzero(hit), n)  # by row, then column
        docs = np.searchsorted(self.start, cols, side="right") - 1
        key = rows * self.count + docs  # nondecreasing: a document's hits are consecutive
        new = np.ones(key.size, bool)
        new[1:] = key[1:] != key[:-1]
        first = np.broadcast_to(np.maximum(self.length - 1, 0), (m, self.count)).copy()  # no hit: as first_hit
        first[rows[new], docs[new]] = cols[new] - self.start[docs[new]]
        hit[rows[new], cols[new]] = False
        return (first, *np.divmod(np.unique(key[~new]), self.count))

    def second_hits(self, hit: np.ndarray, first: np.ndarray, ok: np.ndarray, budget: int):
        """The documents (rows and document indices, int ``[G]`` each) among ``ok [M, nb]`` whose
        ``hit`` holds a column besides ``first`` (a hit, local). Clears those first hits in ``hit``.

        The extra hits are few as a rule: their positions are listed when they fit ``budget``
        bytes; otherwise each document's hits are reduced whole."""
        m, n = hit.shape
        r, j = np.nonzero(ok)
        hit[r, self.start[j] + first[r, j]] = False
        extra = int(np.count_nonzero(hit))
        if not extra:
            return r[:0], j[:0]
        if extra * 24 <= budget:
            pos = np.flatnonzero(hit)
            rows, cols = np.divmod(pos, n)
            docs = cols // self.width if self.width else np.searchsorted(self.start, cols, side="right") - 1
            key = np.unique(rows * self.count + docs)
            return np.divmod(key, self.count)
        if self.width is not None:
            again = hit.reshape(m, self.count, self.width).any(axis=2)
        else:
            again = np.zeros((m, self.count), bool)
            some = self.length > 0
            again[:, some] = np.logical_or.reduceat(hit, self.start[some], axis=1)
        return np.nonzero(again & ok)
