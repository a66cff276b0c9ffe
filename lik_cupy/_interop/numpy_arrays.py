"""NumPy arrays: host memory, the CPU path's own type."""

from __future__ import annotations

import numpy as np

from . import cupy_arrays
from .info import Info, dtype_name

FRAMEWORK = "numpy"
STAND_IN = "staged"  # a resident corpus's calls move them in one page-locked copy each way (host_staging)


def describe(x) -> Info:
    return Info(FRAMEWORK, None, dtype_name(x.dtype), tuple(x.shape))


def to_numpy(x) -> np.ndarray:
    return np.asarray(x)  # (a subclass as a plain array: np.matrix stays 2-D whatever it is reshaped to)


def to_cupy(x):
    import cupy

    return cupy_arrays.contiguous(cupy.asarray(x))


def from_cupy(a, on_host: bool):
    return a.get()


def bfloat16_from_bits(a, on_host: bool, like):
    import ml_dtypes

    return a.get().view(ml_dtypes.bfloat16)


def byte_view(x):
    return x.view(np.uint8)


def float8_view(x):
    import ml_dtypes

    return x.view(ml_dtypes.float8_e4m3fn)


def from_numpy(a: np.ndarray):
    return a


caller_stream = cupy_arrays.caller_stream


def tf32_default() -> None:
    return None  # NumPy's matmuls have no TF32
