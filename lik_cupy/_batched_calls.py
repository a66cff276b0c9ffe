"""One public scoring function called on arrays that carry ``jax.vmap``'s batch axes in front.

``lik_cupy.jax`` hands its callbacks every argument with the same number of leading batch axes
(``vmap_method="expand_dims"``: an argument that is not mapped has size 1 there). ``run_batched``
turns such a call into as few calls of the public function as the shapes allow:

- ``"single"``: no batch axes, or a batch of one element: one call as it is;
- ``"queries"``: only the query side (``Q``, ``q_mask``, ``q_lengths``, ``q_scales``) is mapped, in
  a forward call whose documents are shared (``D [Nd, Ld, d]`` or ``[Ld, d]``, or packed): the
  batch joins the queries' axis, one call;
- ``"pairs"``: queries ``[Lq, d]`` against documents ``[Nd, Ld, d]`` mapped over every batch axis
  (a forward or backward call with padded documents): the batch becomes the per-query
  candidate sets ``D [B, Nd, Ld, d]``, one call (a shared scale per tensor ``[]`` stays one);
- ``"loop"``: anything else (a scale per tensor ``[]`` mapped too), one call per batch element.

A backward call with shared documents loops: each batch element has its own ``dD``.

Arrays are NumPy or CuPy (``xp``); nothing here imports jax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["CallSpec", "run_batched", "plan"]

_Q_SIDE = frozenset({"Q", "q_mask", "q_lengths", "q_scales"})
_D_SIDE = frozenset({"D", "D_tokens", "d_mask", "d_lengths", "d_offsets", "d_scales"})
_FORWARD = frozenset({"maxsim", "maxsim_varlen", "maxsim_int8", "maxsim_int8_varlen"})
_PADDED = frozenset({"maxsim", "maxsim_int8", "maxsim_backward"})
_SCALES = frozenset({"q_scales", "d_scales"})


@dataclass(frozen=True)
class CallSpec:
    """One call of a public function (``lik_cupy.<fn>``): its array arguments by name, in the
    order a callback receives them, with their ranks without batch axes, and its other keyword
    arguments (hashable, so a spec can key caches and be a static argument of ``jax.jit``)."""

    fn: str
    names: tuple[str, ...]
    ranks: tuple[int, ...]
    kwargs: tuple[tuple[str, object], ...] = ()

    def rank(self, name: str) -> int:
        return self.ranks[self.names.index(name)]


def plan(spec: CallSpec, arrays: dict) -> str:
    """"single", "queries", "pairs" or "loop" (the module docstring) for ``arrays`` by name."""
    k = arrays[spec.names[0]].ndim - spec.ranks[0]
    if all(math.prod(a.shape[:k]) == 1 for a in arrays.values()):
        return "single"
    batch = tuple(max(a.shape[i] for a in arrays.values()) for i in range(k))
    # A scale per tensor ([]) mapped over the batch is one scale per element: folding it into the
    # queries' or documents' axis would make it a scale per query or document (the wrong shape).
    # Shared, it stays one scale for the folded call.
    if any(_per_tensor(spec, n) and math.prod(a.shape[:k]) != 1 for n, a in arrays.items()):
        return "loop"
    d_args = [a for n, a in arrays.items() if n in _D_SIDE and not _per_tensor(spec, n)]
    d_name = "D_tokens" if "D_tokens" in spec.names else "D"
    if spec.fn in _FORWARD and all(math.prod(a.shape[:k]) == 1 for a in d_args) and spec.rank(d_name) != 4:
        return "queries"
    # Documents mapped over every batch axis: no copy of them (a query [Lq, d] copied is small).
    if (spec.fn in _PADDED and "d_offsets" not in spec.names and spec.rank("Q") == 2 and spec.rank("D") == 3
            and all(a.shape[:k] == batch for a in d_args)):
        return "pairs"
    return "loop"


def _per_tensor(spec: CallSpec, name: str) -> bool:
    """Whether ``name`` is a scale per tensor (``[]``), which no plan folds into a batch."""
    return name in _SCALES and spec.rank(name) == 0


def run_batched(spec: CallSpec, call, arrays: list, outs: list, write, xp) -> None:
    """Call ``call(**arguments)`` (the public function, returning one array or a tuple) on
    ``arrays`` (in ``spec.names`` order, batch axes in front) and ``write(out, result)`` each
    result into ``outs`` (shaped ``batch + unbatched shape``)."""
    args = dict(zip(spec.names, arrays))
    k = arrays[0].ndim - spec.ranks[0]
    batch = tuple(outs[0].shape[:k])
    how = plan(spec, args)
    if how == "loop":
        # Indexed with a trailing ellipsis: a view, also of a 0-d element (a scalar result, or a
        # scalar grad_scores), where a plain index returns a NumPy scalar, a copy.
        for idx in np.ndindex(*batch):
            sub = {n: a[tuple(i if s != 1 else 0 for i, s in zip(idx, a.shape[:k])) + (...,)] for n, a in args.items()}
            for out, r in zip(outs, _results(call(**sub))):
                write(out[idx + (...,)], r)
        return
    n = math.prod(batch)
    if how == "single":
        folded = {nm: a.reshape(a.shape[k:]) for nm, a in args.items()}
    elif how == "pairs":
        folded = {nm: a.reshape(a.shape[k:]) if _per_tensor(spec, nm) else _flat(_full(a, batch, xp), k)
                  for nm, a in args.items()}
    else:  # "queries"
        folded = {}
        for nm, a in args.items():
            if nm not in _Q_SIDE or _per_tensor(spec, nm):  # (a scale per tensor is not mapped here)
                folded[nm] = a.reshape(a.shape[k:])
            elif spec.rank("Q") == 3:  # [B, Nq, ...] -> [B * Nq, ...]
                a = _flat(_full(a, batch, xp), k)
                folded[nm] = a.reshape((n * a.shape[1],) + a.shape[2:])
            else:  # a single query [Lq, d] per element: the batch is the queries' axis
                folded[nm] = _flat(_full(a, batch, xp), k)
    for out, r in zip(outs, _results(call(**folded))):
        write(out, r.reshape(out.shape))


def _results(r) -> tuple:
    return r if isinstance(r, tuple) else (r,)


def _full(a, batch: tuple, xp):
    """``a`` with its batch axes broadcast to ``batch``, C-contiguous (a copy only where an axis was 1)."""
    shape = batch + a.shape[len(batch):]
    if a.shape == shape:
        return a
    b = xp.broadcast_to(a, shape)
    if b.dtype.name == "bfloat16":  # copied as its bits (CuPy has no bfloat16 arithmetic)
        return xp.ascontiguousarray(b.view(np.uint16)).view(a.dtype)
    return xp.ascontiguousarray(b)


def _flat(a, k: int):
    """The first ``k`` (batch) axes of a C-contiguous array merged into one."""
    return a.reshape((math.prod(a.shape[:k]),) + a.shape[k:])
