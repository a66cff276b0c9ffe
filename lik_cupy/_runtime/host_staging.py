"""Host arguments of a GPU call moved in one page-locked copy each way.

A NumPy query costs a call on a resident corpus a pageable copy per argument, the whole
validation path (the repeat path takes device arrays only) and a pageable copy back per result:
a rerank of 1,000 ids for one 32-token query took 0.19 ms from NumPy arrays on an H200, against
0.04 from CuPy ones. :func:`staged_call` lays the arguments out in one page-locked buffer, uploads
it with one copy on the current stream, runs the call on device views of it and copies the
results back into a second page-locked buffer, with one wait. Both buffers come from CuPy's pinned
memory pool, which keeps a freed block for a later request of its size: sizes are rounded up to a
power of two from 64 KiB, so the pool holds a few blocks (at most 2 MiB each) per thread that calls
at once, and calls on other threads never share one. :func:`layout` and :func:`fetch` also serve
``lik_cupy.serving``'s batches, which keep their own buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["MAX_BYTES", "ALIGN", "layout", "fits", "fetch", "staged_call"]

MAX_BYTES = 1 << 20  # each way, laid out: larger calls keep the plain path (no large page-locked block per call)
ALIGN = 256  # each array in a staged buffer starts on this byte boundary
_MIN_BLOCK = 1 << 16


def layout(*sizes: int) -> tuple[int, ...]:
    """Byte offsets of arrays of ``sizes`` bytes placed one after another on ``ALIGN`` boundaries,
    and the total."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += -(-n // ALIGN) * ALIGN
    return (*out, at)


def fetch(arrays: Sequence, stream, buffer: Callable[[int], np.ndarray]) -> tuple[np.ndarray, ...]:
    """Device ``arrays`` copied into the page-locked uint8 ``buffer(size)`` on ``stream``, with one wait;
    host arrays among them (string ids) pass as they are. Returns views of that buffer."""
    import cupy

    arrays = [a if isinstance(a, np.ndarray) else cupy.ascontiguousarray(a) for a in arrays]
    *spans, size = layout(*(0 if isinstance(a, np.ndarray) else a.nbytes for a in arrays))
    host = buffer(size)
    for a, at in zip(arrays, spans):
        if not isinstance(a, np.ndarray) and a.nbytes:
            cupy.cuda.runtime.memcpyAsync(host.ctypes.data + at, a.data.ptr, a.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
    stream.synchronize()
    return tuple(a if isinstance(a, np.ndarray) else np.ndarray(a.shape, a.dtype, host, at)
                 for a, at in zip(arrays, spans))


def fits(*nbytes: int) -> bool:
    """Whether arrays of ``nbytes`` bytes, laid out, take at most ``MAX_BYTES``."""
    return layout(*nbytes)[-1] <= MAX_BYTES


def _pinned(size: int) -> np.ndarray:
    """A page-locked uint8 buffer of at least ``size`` bytes, from CuPy's pinned pool, its size rounded
    up to a power of two (the pool keeps one block per size it was asked for)."""
    import cupyx

    return cupyx.empty_pinned(max(_MIN_BLOCK, 1 << (size - 1).bit_length()), np.uint8)


def staged_call(inputs: Sequence[np.ndarray], run: Callable[..., tuple]) -> tuple:
    """``run(*device_views)`` on device copies of the host ``inputs`` (native byte order, any strides,
    laid out within ``MAX_BYTES``), on the current device and stream; its results (CuPy arrays, or
    host arrays as they are) come back as new NumPy arrays."""
    import cupy

    from .._base.device import allocating

    *spans, size = layout(*(a.nbytes for a in inputs))
    host = _pinned(size)
    for a, at in zip(inputs, spans):
        np.copyto(np.ndarray(a.shape, a.dtype, host, at), a)
    with allocating("the queries' device copy", size, "free GPU memory held elsewhere"):
        dev = cupy.empty(max(size, 1), np.uint8)
    stream = cupy.cuda.get_current_stream()
    cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, size, cupy.cuda.runtime.memcpyHostToDevice,
                                  stream.ptr)
    try:
        outs = run(*(cupy.ndarray(a.shape, a.dtype, dev.data + at) for a, at in zip(inputs, spans)))
        views = fetch(outs, stream, _pinned)
    except BaseException:
        # The upload may still read ``host``, which goes back to the pool on the way out. A sync
        # that fails too (a sticky CUDA error) must not hide the original error.
        try:
            stream.synchronize()
        except Exception:
            pass
        raise
    return tuple(v if isinstance(o, np.ndarray) else v.copy() for v, o in zip(views, outs))
