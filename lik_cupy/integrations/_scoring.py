"""What the PyLate and colpali-engine drop-ins share: operands in a dtype the kernels take, and ragged
lists zero-padded a bounded run of rows at a time."""

from __future__ import annotations

import torch

__all__ = ["kernel_operands", "padded_runs", "list_dim", "CHUNK_BYTES"]

# A list of embeddings is zero-padded a run of rows at a time into buffers of at most about this many
# bytes (colpali-engine pads a batch of 128 rows, PyLate's pairwise scores pair by pair).
CHUNK_BYTES = 512 << 20

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_operands(Q: torch.Tensor, D: torch.Tensor):
    """``(Q, D, out)``: Q and D in a dtype the kernels take (float64 becomes float32), and the dtype
    the scores are returned in (float32, or float64 for float64 inputs)."""
    if Q.dtype != D.dtype:
        raise TypeError(f"queries are {Q.dtype} but documents are {D.dtype}: give both one dtype")
    if Q.dtype not in _KERNEL_DTYPES and Q.dtype != torch.float64:
        raise TypeError(f"embeddings must be float16, bfloat16, float32 or float64, got {Q.dtype}")
    out = torch.promote_types(Q.dtype, torch.float32)
    if Q.dtype == torch.float64:
        Q, D = Q.float(), D.float()
    return Q, D, out


def padded_runs(limit: int, token_bytes: int, *lengths) -> list:
    """Slices of consecutive rows: each run's zero-padded copies (each list of ``lengths`` padded to its
    longest in the run, ``len(run) * sum(longest) * token_bytes`` bytes) within ``limit``, or a single
    row. Padding every row to the longest of them all would let one long row among many short ones
    take that length times their number."""
    n = len(lengths[0])
    runs, start, widths = [], 0, [0] * len(lengths)
    for i in range(n):
        grown = [max(w, ls[i]) for w, ls in zip(widths, lengths)]
        if i > start and (i + 1 - start) * sum(grown) * token_bytes > limit:
            runs.append(slice(start, i))
            start, grown = i, [ls[i] for ls in lengths]
        widths = grown
    runs.append(slice(start, n))
    return runs


def list_dim(xs, name: str, layout: str) -> int | None:
    """The embedding dim of a list of embeddings ``xs`` (``name`` in errors; each a torch tensor
    ``layout``, 2-D, of one last dim), every entry checked before any is copied; None for no entry."""
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch tensor, got {type(x).__name__}")
        if x.ndim != 2:
            raise ValueError(f"{name}[{i}] must be {layout}, got shape {list(x.shape)}")
        if x.shape[1] != xs[0].shape[1]:
            raise ValueError(f"{name}[{i}] has dim {x.shape[1]} but {name}[0] has dim {xs[0].shape[1]}")
    return xs[0].shape[1] if len(xs) else None
