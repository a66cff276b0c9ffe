"""GPU discovery: whether a GPU is usable, and the per-device facts dispatch needs."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "use the CPU"
        return False


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
