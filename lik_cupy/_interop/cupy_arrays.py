"""CuPy arrays: device memory, the GPU path's own type (results come back as they are)."""

from __future__ import annotations

import numpy as np

from .info import Info, dtype_name

FRAMEWORK = "cupy"


def describe(x) -> Info:
    return Info(FRAMEWORK, int(x.device.id), dtype_name(x.dtype), tuple(x.shape))


def to_numpy(x) -> np.ndarray:
    return x.get()


def to_cupy(x):
    return x


def from_cupy(a, on_host: bool):
    return a


def bfloat16_from_bits(a, on_host: bool, like):
    return a.view(like.dtype)  # the caller's own bfloat16 dtype object


def from_numpy(a: np.ndarray):
    return a
