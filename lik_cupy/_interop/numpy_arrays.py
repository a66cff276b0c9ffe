"""NumPy arrays: host memory, the CPU path's own type."""

from __future__ import annotations

import numpy as np

from . import cupy_arrays
from .info import Info, dtype_name

FRAMEWORK = "numpy"
STAND_IN = "staged"  # a resident corpus's calls move them in one page-locked copy each way (host_staging)


def describe(x) -> Info:
    if isinstance(x, np.ma.MaskedArray):
        _unmasked(x)
    return Info(FRAMEWORK, None, dtype_name(x.dtype), tuple(x.shape))


def _unmasked(x) -> None:
    """A masked array is read as its data, masked entries included: one whose mask hides something
    would score values its caller masked out, so it is refused."""
    n = int(np.ma.count_masked(x))
    if n:
        raise ValueError(f"a NumPy masked array with {n} masked entr{'y' if n == 1 else 'ies'}, whose values would be "
                         "read as they lie: pass its .data, and the tokens to leave out as q_mask, d_mask or lengths")


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
