"""What validation needs to know about one array argument, without touching its data."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Info", "dtype_name"]


@dataclass(frozen=True)
class Info:
    framework: str  # "numpy" | "cupy" | "torch" | "jax" | "dlpack"
    device: int | None  # CUDA device ordinal, or None for host memory
    dtype: str  # canonical numpy-style name: "float16", "bfloat16", "bool", "int32", ...
    shape: tuple[int, ...]


_DTYPE_NAMES: dict = {}


def dtype_name(dt) -> str:
    """``np.dtype(dt).name``, memoised: numpy builds the name in Python on every access, which
    showed up in the per-call cost of small calls."""
    try:
        return _DTYPE_NAMES[dt]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype-like
        name = np.dtype(dt).name
        try:
            _DTYPE_NAMES[dt] = name
        except TypeError:
            pass
        return name
