"""The quantisers on the GPU (``cuda_src/quantize.cu``: one entry per scaled element type, each built
once per float element type of its input), same bytes as the NumPy ones."""

from __future__ import annotations

import numpy as np

from .._base.device import device_properties
from .._dispatch import arch_of, elem_spec
from .._dispatch.backend import check_gpu_arch
from .kernels import QUANTIZE
from .nvrtc import get_module

__all__ = ["quantize_cupy"]


def quantize_cupy(x, dtype: str, *, check: bool = False, to: str = "int8", per: str = "token", source=None):
    """Quantise a C-contiguous CuPy array ``x [..., d]`` (float16/float32, or bfloat16 as its
    uint16 bits with ``dtype="bfloat16"``) to scaled element type ``to`` ("int8", or
    "float8_e4m3fn" as uint8 bit patterns) on the current stream; FP8 also ``per="tensor"``.

    Returns ``(q [..., d], scales float32 [...])`` (per tensor: scales ``[]``). A token with NaN or
    inf gets scale NaN (per tensor: every token) and no host sync happens, unless ``check``: then
    one sync, and ValueError naming the first such token (``source``: the values as given, where
    ``x`` is their float32 cast: a finite one beyond float32's range is named as such).
    """
    import cupy

    spec = elem_spec(to)
    x = cupy.ascontiguousarray(x)
    d = x.shape[-1] if x.ndim else 0
    rows = x.size // d if d else (int(np.prod(x.shape[:-1])) if x.ndim else 0)
    q = cupy.empty(x.shape, spec.numpy_dtype)
    s = cupy.zeros(x.shape[:-1], cupy.float32)
    if rows == 0 or d == 0:
        return q, (cupy.zeros((), cupy.float32) if per == "tensor" else s)
    bad = cupy.zeros((), cupy.int32)
    device = x.device.id
    check_gpu_arch(to, device)
    defines = {"LIK_ELEM": elem_spec(dtype).code}
    entry = spec.quantiser_kernel
    kern = get_module(QUANTIZE.file, defines, arch_of(device_properties(device).cc), device, entry=entry).get_function(entry)
    warps = 8
    blocks = int(min(-(-rows // warps), 65535))
    args = (x, q, s, np.int64(rows), np.int32(d), bad)
    kern((blocks,), (warps * 32,), args if spec.integer else args + (np.uint64(0),))  # FP8: no fixed scale
    if check and int(bad.get()):
        from .._cpu.quantize import non_finite_error

        first = int(cupy.argmax(~cupy.isfinite(s.reshape(-1))).get())
        # Only a float64 source can be finite and still overflow float32 (x may be bfloat16's bits).
        finite = source is not None and bool(cupy.isfinite(source.reshape(-1, d)[first]).all().get())
        raise non_finite_error(x.shape, first, spec.name, finite)
    if per == "tensor":  # the largest per-token scale is the tensor's max |x| / 448 (quantize.cu)
        fixed = s.max()
        kern((blocks,), (warps * 32,), args + (fixed,))
        s = fixed
    return q, s
