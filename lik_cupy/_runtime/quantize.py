"""The INT8 quantiser on the GPU (``cuda_src/quantize.cu``, built once per float element type of
its input), same bytes as the NumPy one."""

from __future__ import annotations

import numpy as np

from .._base.device import device_properties
from .._dispatch import arch_of, elem_spec
from .kernels import QUANTIZE
from .nvrtc import get_module

__all__ = ["quantize_cupy"]

_INT8 = elem_spec("int8")


def quantize_cupy(x, dtype: str, *, check: bool = False):
    """Quantise a C-contiguous CuPy array ``x [..., d]`` (float16/float32, or bfloat16 as its
    uint16 bits with ``dtype="bfloat16"``) on the current stream.

    Returns ``(q int8 [..., d], scales float32 [...])``. A token with NaN or inf gets scale
    NaN (scores against it are NaN) and no host sync happens, unless ``check``: then one
    sync, and ValueError naming the first such token.
    """
    import cupy

    x = cupy.ascontiguousarray(x)
    d = x.shape[-1] if x.ndim else 0
    rows = x.size // d if d else (int(np.prod(x.shape[:-1])) if x.ndim else 0)
    q = cupy.empty(x.shape, cupy.int8)
    s = cupy.zeros(x.shape[:-1], cupy.float32)
    if rows == 0 or d == 0:
        return q, s
    bad = cupy.zeros((), cupy.int32)
    device = x.device.id
    defines = {"LIK_ELEM": elem_spec(dtype).code}
    entry = _INT8.quantiser_kernel
    kern = get_module(QUANTIZE.file, defines, arch_of(device_properties(device).cc), device, entry=entry).get_function(entry)
    warps = 8
    blocks = int(min(-(-rows // warps), 65535))
    kern((blocks,), (warps * 32,), (x, q, s, np.int64(rows), np.int32(d), bad))
    if check and int(bad.get()):
        first = int(cupy.argmax(~cupy.isfinite(s.reshape(-1))).get())
        where = np.unravel_index(first, x.shape[:-1])
        raise ValueError(f"X holds NaN or inf in token {tuple(int(i) for i in where)}; "
                         "INT8 quantisation needs finite values")
    return q, s
