"""XLA's device buffers inside a ``jax.experimental.buffer_callback`` (``lik_cupy._jax_ops``), as the
repeat-call path (``lik_cupy._runtime.prepared_calls``) reads them: addresses through the CUDA array
interface, no CuPy array made. The callback runs with XLA's stream as CuPy's current stream, so
scratch buffers come from CuPy's pool on that stream."""

from __future__ import annotations

from . import cupy_arrays

FRAMEWORK = "jax"


def address(x) -> int:
    cai = x.__cuda_array_interface__  # XLA's buffers, and CuPy's scratch arrays
    return cai["data"][0]


stream_handle = cupy_arrays.stream_handle
new_empty = cupy_arrays.new_empty


def to_int32(x):
    """``x`` (an XLA buffer of int64 lengths, with x64 on) as a new int32 CuPy array on XLA's stream
    (the buffer has no ``astype`` of its own)."""
    import cupy

    return _view(x).astype(cupy.int32)


def fill(x, value) -> None:
    _view(x).fill(value)


def _view(x):
    """A CuPy array over XLA's buffer ``x`` (or a CuPy array), by its CUDA array interface: no copy."""
    import cupy

    cai = x.__cuda_array_interface__
    n = 1
    for s in cai["shape"]:
        n *= s
    dtype = cupy.dtype(cai["typestr"])
    mem = cupy.cuda.UnownedMemory(cai["data"][0], n * dtype.itemsize, x)
    return cupy.ndarray(tuple(cai["shape"]), dtype, cupy.cuda.MemoryPointer(mem, 0))
