"""CuPy arrays: device memory, the GPU path's own type (results come back as they are)."""

from __future__ import annotations

import numpy as np

from .._base import env
from .info import Info, dtype_name

FRAMEWORK = "cupy"
STAND_IN = None  # the repeat path takes them as they are


def describe(x) -> Info:
    return Info(FRAMEWORK, int(x.device.id), dtype_name(x.dtype), tuple(x.shape))


def to_numpy(x) -> np.ndarray:
    return x.get()


def to_cupy(x):
    return contiguous(x)


def contiguous(a):
    """A CuPy array as the kernels take it: C-contiguous (a device copy where it is not), bool as
    uint8 (every adapter's ``to_cupy`` ends here)."""
    import cupy

    if a.dtype == np.bool_:
        a = a.view(np.uint8)
    out = cupy.ascontiguousarray(a)
    # ascontiguousarray returns at least one axis: a 0-d argument (a per-tensor scale) keeps none
    return out.reshape(()) if a.ndim == 0 else out


def from_cupy(a, on_host: bool):
    return a


def bfloat16_from_bits(a, on_host: bool, like):
    return a.view(like.dtype)  # the caller's own bfloat16 dtype object


def byte_view(x):
    return x  # no float8 type here: FP8 travels as its uint8 bit patterns


def float8_view(x):
    return x


def from_numpy(a: np.ndarray):
    return a


def caller_stream(device: int):
    """CuPy's own current stream and pool, on ``device``."""
    import cupy

    return cupy.cuda.Device(device)


def tf32_default() -> str | None:
    return "tf32" if env.cupy_tf32() else "fp32"  # CUPY_TF32, CuPy's own switch


# ---------------------------------------------------------------- the repeat-call path (lik_cupy._runtime.prepared_calls)


def signature(x):
    """What a prepared call depends on: (shape, dtype, device, 16-byte aligned, C-contiguous)."""
    return x.shape, x.dtype, x.data.device_id, not x.data.ptr & 15, x._c_contiguous


def address(x) -> int:
    return x.data.ptr


def stream_handle(device: int) -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


NEW_DTYPES = frozenset(("float16", "float32", "int32", "int64"))
_DTYPES = {n: np.dtype(n) for n in NEW_DTYPES}


def new_empty(shape, dtype: str, device: int):
    import cupy

    return cupy.ndarray(shape, _DTYPES.get(dtype) or dtype)  # cupy.empty without its Python layer


def to_int32(x):
    return x.astype(np.int32)


def is_float32(x) -> bool:
    return x.dtype == np.float32


def fill(x, value) -> None:
    x.fill(value)
