"""GPU discovery (whether a GPU is usable, the per-device facts dispatch needs) and GPU
allocations whose out-of-memory errors say which buffer did not fit and what to do."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import numpy as np

from ..errors import DeviceMemoryError


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "use the CPU"
        return False


def check_ordinal(device, others: str) -> None:
    """ValueError unless ``device`` is None or a CUDA ordinal: an int >= 0, NumPy's too, but not a
    bool (True would pick GPU 1). Looks for no GPU; ``others``: the caller's other values, for the
    message (", 'cpu' or None")."""
    if device is not None and (isinstance(device, (bool, np.bool_)) or not isinstance(device, (int, np.integer))
                               or device < 0):
        raise ValueError(f"device must be a CUDA device ordinal (an int >= 0){others}, got {device!r}")


def present(device) -> int:
    """``device`` (an ordinal ``check_ordinal`` took) as an int, once this process is seen to have
    that GPU: CUDA's own error for one past the last, "invalid device ordinal", names neither the
    device nor the GPUs there are."""
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if device >= count:
        gpus = {0: "no visible GPU", 1: "1 visible GPU (0)"}.get(count, f"{count} visible GPUs (0..{count - 1})")
        raise ValueError(f"device {device} does not exist: this machine has {gpus}")
    return int(device)


@dataclass(frozen=True)
class DeviceProps:
    name: str
    cc: int  # compute capability * 10, e.g. 90
    num_sms: int


@functools.lru_cache(maxsize=None)
def device_properties(device: int) -> DeviceProps:
    import cupy

    p = cupy.cuda.runtime.getDeviceProperties(device)
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    return DeviceProps(name, int(p["major"]) * 10 + int(p["minor"]), int(p["multiProcessorCount"]))


_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


@contextlib.contextmanager
def allocating(buffer: str, nbytes: int, hint: str):
    """Turn a GPU out-of-memory error raised inside the block into a ``DeviceMemoryError`` naming
    ``buffer`` (e.g. "maxsim_backward: dD [4096, 128] float16") and its ``nbytes``, with ``hint``
    (what the caller can change) appended. Other errors pass through untouched."""
    import cupy

    try:
        yield
    except Exception as e:
        # Without CuPy's pool (cupy.cuda.set_allocator(None)) cudaMalloc's own error arrives instead;
        # a framework's allocator raises CuPy's error too (the adapter contract, lik_cupy._interop.contract).
        oom = isinstance(e, cupy.cuda.memory.OutOfMemoryError) or (
            isinstance(e, cupy.cuda.runtime.CUDARuntimeError) and e.status == _CUDA_ERROR_MEMORY_ALLOCATION)
        if not oom:
            raise
        device = cupy.cuda.runtime.getDevice()
        free, total = cupy.cuda.runtime.memGetInfo()
        limit = cupy.get_default_memory_pool().get_limit()
        where = f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB"
        if limit:
            where += f", CuPy pool limit {limit / 2**30:.2f} GiB"
        raise DeviceMemoryError(
            f"{buffer}: cannot allocate {nbytes:,} bytes ({nbytes / 2**30:.2f} GiB) on cuda:{device} "
            f"({where}). {hint}", buffer, nbytes, device) from e


def empty(shape, dtype, buffer: str, hint: str, *, zeros: bool = False):
    """``cupy.empty`` (or ``cupy.zeros``) whose out-of-memory error names the buffer; ``buffer``
    is the function and the buffer's role, the shape and dtype are added here."""
    import cupy

    shape = tuple(int(n) for n in shape)
    try:
        return cupy.zeros(shape, dtype) if zeros else cupy.empty(shape, dtype)
    except (cupy.cuda.memory.OutOfMemoryError, cupy.cuda.runtime.CUDARuntimeError):
        # The message is built only on failure (this runs on every call); ``allocating`` turns
        # the error being handled into the named one (and lets any other CUDA error through).
        dt = np.dtype(dtype)
        with allocating(f"{buffer} {list(shape)} {dt.name}", math.prod(shape) * dt.itemsize, hint):
            raise


class _StreamHandle:
    """A raw stream handle in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return 0, self.handle


def external_stream(handle: int, device: int):
    """CuPy's non-owning view of the stream with handle ``handle`` on ``device``."""
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy 14 deprecates ExternalStream (a warning per use)
        return cupy.cuda.Stream.from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle, device)
