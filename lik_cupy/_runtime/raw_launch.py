"""Kernel launches by driver handle: a kernel's parameters packed into 8-byte slots in one call and
handed to ``cuLaunchKernel`` (CuPy's own argument conversion took a sixth of a one-query call's
host time), and the capture state of a stream by its handle."""

from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np

__all__ = ["signature", "launch_raw", "float32_arg", "is_capturing"]

_SLOT = {"p": "Q", "i": "i4x", "u": "I4x", "q": "q", "f": "f4x"}
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_params = threading.local()


def signature(kinds: str) -> struct.Struct:
    """The packed 8-byte slots of a kernel whose parameters are ``kinds`` in order, by C type: p
    pointer, i int, u unsigned, q long long, f float."""
    return struct.Struct("<" + "".join(_SLOT[c] for c in kinds))


def float32_arg(x) -> float:
    """``x`` as a kernel's ``float`` parameter receives it: rounded to float32, and past float32's range
    infinite, as a cast gives it (``struct``'s "f" refuses such a value rather than round it)."""
    if -_FLOAT32_MAX <= x <= _FLOAT32_MAX:
        return float(np.float32(x))
    with np.errstate(over="ignore"):  # (only here: entering it costs more than the cast, on every launch)
        return float(np.float32(x))


def launch_raw(func: int, grid, threads: int, smem: int, stream: int, params: struct.Struct, values: tuple,
               by_value: tuple = ()) -> None:
    """Launch kernel ``func`` (a CUfunction handle) on ``stream`` (a handle) with ``values`` packed
    as ``params``, then the parameters ``by_value``, each an object whose ``address`` holds its
    bytes (TMA maps, the residual kernel's ``ResidualSrc``)."""
    try:
        slots = _params.slots
    except AttributeError:
        slots = _params.slots = {}
    key = (params, len(by_value))
    entry = slots.get(key)
    if entry is None:  # one buffer per thread and signature: the driver copies the values at the launch
        n = params.size // 8
        buf = ctypes.create_string_buffer(params.size)
        base = ctypes.addressof(buf)
        addrs = (ctypes.c_void_p * (n + len(by_value)))(*[base + 8 * i for i in range(n)])
        entry = slots[key] = (buf, addrs, n, ctypes.addressof(addrs))
    buf, addrs, n, addrs_ptr = entry
    params.pack_into(buf, 0, *values)
    for i, m in enumerate(by_value):
        addrs[n + i] = m.address
    _driver_launch(func, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream, addrs_ptr, 0)


def _driver_launch(*args) -> None:
    """``cupy.cuda.driver.launchKernel``, bound at the first launch (CuPy is imported only then)."""
    global _driver_launch
    import cupy

    _driver_launch = cupy.cuda.driver.launchKernel
    _driver_launch(*args)


def is_capturing(stream: int) -> bool:
    """Whether the stream with handle ``stream`` is being captured into a CUDA graph."""
    import cupy

    return cupy.cuda.runtime.streamIsCapturing(stream) != 0
