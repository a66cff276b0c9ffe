"""What the PyLate and colpali-engine drop-ins share: operands in a dtype the kernels take."""

from __future__ import annotations

import torch

__all__ = ["kernel_operands"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_operands(Q: torch.Tensor, D: torch.Tensor):
    """``(Q, D, out)``: Q and D in a dtype the kernels take (float64 becomes float32), and the dtype
    the scores are returned in (float32, or float64 for float64 inputs)."""
    if Q.dtype != D.dtype:
        raise TypeError(f"queries are {Q.dtype} but documents are {D.dtype}: give both one dtype")
    if not Q.dtype.is_floating_point:
        raise TypeError(f"embeddings must be floating point, got {Q.dtype}")
    out = torch.promote_types(Q.dtype, torch.float32)
    if Q.dtype not in _KERNEL_DTYPES:
        Q, D = Q.float(), D.float()
    return Q, D, out
