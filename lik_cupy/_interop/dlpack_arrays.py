"""Any other DLPack producer: read through CuPy (device memory) or NumPy (host memory), results
returned as CuPy or NumPy arrays, which are DLPack producers themselves."""

from __future__ import annotations

import numpy as np

from . import cupy_arrays
from .info import Info, dtype_name

FRAMEWORK = "dlpack"
STAND_IN = None
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13


def describe(x) -> Info:
    kind, ordinal = x.__dlpack_device__()
    dev = int(ordinal) if kind in (_DL_CUDA, _DL_CUDA_MANAGED) else None
    if dev is not None:
        import cupy

        arr = cupy.from_dlpack(x)
    else:
        arr = np.from_dlpack(x)
    return Info(FRAMEWORK, dev, dtype_name(arr.dtype), tuple(arr.shape))


def to_numpy(x) -> np.ndarray:
    return np.from_dlpack(x)


def to_cupy(x):
    import cupy

    return cupy_arrays.contiguous(cupy.from_dlpack(x))


def from_cupy(a, on_host: bool):
    return a


def bfloat16_from_bits(a, on_host: bool, like):
    import ml_dtypes

    return a.get().view(ml_dtypes.bfloat16)


def byte_view(x):
    return x  # no float8 type here: FP8 travels as its uint8 bit patterns


def float8_view(x):
    return x


def from_numpy(a: np.ndarray):
    return a


caller_stream = cupy_arrays.caller_stream


def tf32_default() -> None:
    return None  # a DLPack producer says nothing of its matmuls
