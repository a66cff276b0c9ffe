"""Spans of boolean document masks (``cuda_src/masks.cu``).

A padded corpus with ``d_mask`` gives the forward kernel, beside the mask, each document's span:
how far its valid tokens reach, and whether they are a prefix. The kernel then stages no tile
past a document's last valid token and reads no mask for a document whose valid tokens come
first, so a mask costs what the same lengths cost (one small kernel more, reading the mask once).
"""

from __future__ import annotations

from .._validate import check_32bit
from .kernels import MASKS
from .nvrtc import function_handle
from .raw_launch import launch_raw, signature

__all__ = ["MASKED", "mask_spans", "queue_mask_spans"]

_THREADS = 256
MASKED = "masked"  # zero_pad of lik_cupy._maxsim_calls.maxsim_zero_pad: the documents with a masked token


def mask_spans(mask, device: int, *, masked: bool = False):
    """int32 ``[rows]`` spans of a C-contiguous uint8 mask ``[rows, L]`` on ``device`` (the current
    CuPy stream): ``n`` when a row's valid tokens are exactly its first ``n``, else ``~n`` (negative),
    ``n`` one past its last valid token. ``masked``: also return uint8 ``[rows]``, 1 where a row has
    a masked token (the zero-vector padding flags of ``zero_pad="masked"``, ``lik_cupy._maxsim_calls``)."""
    import cupy

    rows, length = mask.shape
    check_32bit(Ld=length)  # (the kernel's int row length: else a struct.error saying nothing of it)
    out = cupy.empty(rows, cupy.int32)
    flags = cupy.empty(rows, cupy.uint8) if masked else None
    queue_mask_spans(cupy.cuda.get_current_stream().ptr, device, mask.data.ptr, rows, length, out.data.ptr,
                     0 if flags is None else flags.data.ptr)
    return (out, flags) if masked else out


_PARAMS = signature("pqipp")


def queue_mask_spans(stream: int, device: int, mask: int, rows: int, length: int, out: int, masked: int = 0) -> None:
    """``mask_spans`` by addresses: the uint8 mask ``[rows, length]`` at ``mask`` into int32 ``[rows]``
    at ``out`` (and, where ``masked`` is not 0, the uint8 flags ``[rows]`` there), queued on
    ``stream`` (a handle)."""
    if not rows:
        return
    warps_per_block = _THREADS // 32
    launch_raw(function_handle(MASKS.file, "lik_mask_spans", device), (min(-(-rows // warps_per_block), 65535), 1, 1),
               _THREADS, 0, stream, _PARAMS, (mask, rows, length, out, masked))
