"""Spans of boolean document masks (``cuda_src/masks.cu``).

A padded corpus with ``d_mask`` gives the forward kernel, beside the mask, each document's span:
how far its valid tokens reach, and whether they are a prefix. The kernel then stages no tile
past a document's last valid token and reads no mask for a document whose valid tokens come
first, so a mask costs what the same lengths cost (one small kernel more, reading the mask once).
"""

from __future__ import annotations

from .nvrtc import function_handle
from .raw_launch import launch_raw, signature

_THREADS = 256


def mask_spans(mask, device: int):
    """int32 ``[rows]`` spans of a C-contiguous uint8 mask ``[rows, L]`` on ``device`` (the current
    CuPy stream): ``n`` when a row's valid tokens are exactly its first ``n``, else ``~n`` (negative),
    ``n`` one past its last valid token."""
    import cupy

    rows, length = mask.shape
    out = cupy.empty(rows, cupy.int32)
    queue_mask_spans(cupy.cuda.get_current_stream().ptr, device, mask.data.ptr, rows, length, out.data.ptr)
    return out


_PARAMS = signature("pqip")


def queue_mask_spans(stream: int, device: int, mask: int, rows: int, length: int, out: int) -> None:
    """``mask_spans`` by addresses: the uint8 mask ``[rows, length]`` at ``mask`` into int32 ``[rows]``
    at ``out``, queued on ``stream`` (a handle)."""
    if not rows:
        return
    warps_per_block = _THREADS // 32
    launch_raw(function_handle("masks.cu", "lik_mask_spans", device), (min(-(-rows // warps_per_block), 65535), 1, 1), _THREADS, 0, stream, _PARAMS,
               (mask, rows, length, out))
