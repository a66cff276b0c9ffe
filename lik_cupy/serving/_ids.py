"""External document ids (the shards' ``ids.npy``) back to corpus positions, for rerank requests."""

from __future__ import annotations

import numpy as np


class IdIndex:
    """Positions of a corpus's external ids: sorted once (``[Nd]`` int64 or strings), looked up by
    binary search; without ids, the ids are the positions. A repeated id finds its first document."""

    def __init__(self, ids: np.ndarray | None, nd: int):
        self._nd = nd
        self._kind = None if ids is None else "string" if ids.dtype.kind in "US" else "integer"
        if ids is not None:
            self._order = np.argsort(ids, kind="stable")
            self._sorted = ids[self._order]

    @property
    def kind(self) -> str:
        """"string" or "integer": what a request's ids must be."""
        return self._kind or "integer"

    @property
    def dtype(self) -> np.dtype:
        """The ids' dtype, as results hold them (int64 where the ids are the positions)."""
        return np.dtype(np.int64) if self._kind is None else self._sorted.dtype

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """int64 positions of ``ids`` (any shape); ValueError naming the first few unknown ones."""
        want = "US" if self.kind == "string" else "iu"
        if ids.dtype.kind not in want:
            raise TypeError(f"ids must be {self.kind}s (this corpus's ids are), got dtype {ids.dtype}")
        if self._kind is None:
            if ids.size and (ids.min() < 0 or ids.max() >= self._nd):  # two reductions; the message's mask only then
                bad = ids[(ids < 0) | (ids >= self._nd)]
                raise ValueError(f"unknown ids {bad[:5].tolist()}: this corpus has no ids, so ids are positions in "
                                 f"[0, {self._nd})")
            return ids.astype(np.int64)
        if self._kind == "integer" and ids.dtype.kind == "u" and ids.size and int(ids.max()) >= 2**63:
            raise ValueError(f"unknown id {int(ids.max())}")
        flat = ids.reshape(-1).astype(np.int64) if self._kind == "integer" else ids.reshape(-1)
        if not flat.size:
            return np.zeros(ids.shape, np.int64)
        if not self._sorted.size:
            raise ValueError(f"unknown ids {flat[:5].tolist()}: the corpus is empty")
        # byte-string ids (ids.npy of dtype S) are UTF-8 text, as the outputs and lik's results show them
        key = np.char.encode(flat, "utf-8") if self._sorted.dtype.kind == "S" and flat.dtype.kind == "U" else flat
        at = np.minimum(np.searchsorted(self._sorted, key), self._sorted.size - 1)
        found = self._sorted[at] == key
        if not found.all():
            raise ValueError(f"unknown ids {flat[~found][:5].tolist()}")
        return self._order[at].astype(np.int64).reshape(ids.shape)
