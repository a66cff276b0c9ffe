"""Page-locked host memory: host corpora that reach the GPU without a staging copy.

A corpus in ordinary (pageable) host memory streams through pinned staging buffers
that host threads fill first, and that copy, not PCIe, bounds the stream: on the H100
host we measured, 16 threads copy about 30 GB/s while a DMA runs, against 55 GB/s for
DMA out of page-locked memory. ``pin_host`` page-locks arrays where they lie
(``cudaHostRegister``: nothing is copied), and ``retrieve`` then uploads straight from
them. Locking costs about one staging pass (0.15 s for 4 GiB there), so it pays from the
second pass over the corpus on: a service that holds its corpus in host memory locks it
once. Memory that is page-locked already (``torch.Tensor.pin_memory()``,
``cupyx.empty_pinned``) needs no call.
"""

from __future__ import annotations

import mmap

import numpy as np

_PAGE = mmap.PAGESIZE
_HOST_REGISTER_PORTABLE = 1  # page-locked for every device's context, not just the current one
_HOST_REGISTER_READ_ONLY = 8  # the only way to lock a read-only mapping (np.load(..., mmap_mode="r"))
_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost: page-locked host memory


def is_page_locked(ptr: int) -> bool:
    """Whether the host address ``ptr`` lies in page-locked memory the GPU can copy from directly."""
    import cupy

    try:
        return int(cupy.cuda.runtime.pointerGetAttributes(ptr).type) == _MEMORY_TYPE_HOST
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


def span_page_locked(a: np.ndarray) -> bool:
    """Whether the C-contiguous array ``a`` starts and ends in page-locked memory."""
    if a.nbytes == 0 or not a.flags.c_contiguous:
        return False
    ptr = a.ctypes.data
    return is_page_locked(ptr) and is_page_locked(ptr + a.nbytes - 1)


class PinnedHost:
    """Arrays page-locked by :func:`pin_host`; unlocks them on :meth:`release`, at the end of a ``with``,
    or when it is dropped (the driver must not keep freed memory registered: the arrays it keeps alive
    would be freed with it, their pages still locked)."""

    def __init__(self, arrays: list[np.ndarray]):
        self._arrays = arrays  # kept alive while their pages are locked
        self._locked: list[int] = []  # start addresses of the locked page ranges
        # Whole pages, with the ranges of arrays that share a page merged: the driver refuses
        # to lock a page twice, and small arrays from one heap can share pages.
        spans = sorted((a.ctypes.data // _PAGE * _PAGE, -(-(a.ctypes.data + a.nbytes) // _PAGE) * _PAGE,
                        a.flags.writeable) for a in arrays if a.nbytes and not span_page_locked(a))
        merged: list[list] = []
        for lo, hi, writeable in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
                merged[-1][2] = merged[-1][2] and writeable
            else:
                merged.append([lo, hi, writeable])
        try:
            for lo, hi, writeable in merged:
                self._lock(lo, hi - lo, writeable)
        except BaseException:
            self.release()
            raise

    def _lock(self, ptr: int, nbytes: int, writeable: bool) -> None:
        import cupy

        flags = _HOST_REGISTER_PORTABLE | (0 if writeable else _HOST_REGISTER_READ_ONLY)
        try:
            cupy.cuda.runtime.hostRegister(ptr, nbytes, flags)
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise RuntimeError(
                f"pin_host: cannot page-lock {nbytes:,} bytes at {ptr:#x}{'' if writeable else ' (read-only)'}: "
                f"{e}. Locked memory must fit in the host's RAM and in the locked-memory limit (ulimit -l), "
                "and no page of it may be locked already by another pin_host or cudaHostRegister") from e
        self._locked.append(ptr)

    def release(self) -> None:
        """Unlock every page range this object locked (idempotent)."""
        while self._locked:
            import cupy

            cupy.cuda.runtime.hostUnregister(self._locked.pop())
        self._arrays = []

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # (at interpreter exit CuPy may be gone: the process's locks go with it)
            pass

    def __enter__(self) -> PinnedHost:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def pin_host(*arrays) -> PinnedHost:
    """Page-lock NumPy arrays in place so :func:`lik_cupy.retrieve` uploads them without staging.

    Args:
        *arrays: C-contiguous NumPy arrays of any dtype (document tokens, INT8 scales),
            memory-mapped ``.npy`` files included (read-only maps are locked read-only;
            their pages are read from disk as they are locked).

    Returns:
        A :class:`PinnedHost`; use it as a context manager (``with lik_cupy.pin_host(D):``)
        or call ``release()`` (dropping it unlocks them too). It keeps the arrays alive while
        they are locked. Whole pages are locked (with any neighbouring bytes that share them). Arrays already
        page-locked are left as they are. On a machine without a GPU nothing is locked
        (``retrieve`` runs on the CPU there).

    Raises:
        TypeError: an argument is not a NumPy array.
        ValueError: an array is not C-contiguous (lock the array it is a view of).
        RuntimeError: the driver refused to lock the memory (the message says why it may have).
    """
    from .._base.device import gpu_available

    out = []
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"pin_host: argument {i} must be a NumPy array (np.ndarray or np.memmap), got "
                            f"{type(a).__module__}.{type(a).__name__}; torch tensors have .pin_memory()")
        if not a.flags.c_contiguous:
            raise ValueError(f"pin_host: argument {i} ({a.dtype} {list(a.shape)}, strides {list(a.strides)}) is not "
                             "C-contiguous; lock the contiguous array it is a view of")
        out.append(a)
    return PinnedHost(out if gpu_available() else [])
