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
to_int32 = cupy_arrays.to_int32


def fill(x, value) -> None:
    import cupy

    cai = x.__cuda_array_interface__
    n = 1
    for s in cai["shape"]:
        n *= s
    dtype = cupy.dtype(cai["typestr"])
    mem = cupy.cuda.UnownedMemory(cai["data"][0], n * dtype.itemsize, x)
    cupy.ndarray(tuple(cai["shape"]), dtype, cupy.cuda.MemoryPointer(mem, 0)).fill(value)
