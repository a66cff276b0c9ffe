"""JAX arrays on one device. jax is never imported here: a JAX array reaching us means jax is in
``sys.modules`` already. JAX does not share CuPy's stream, so device results are synchronised
before JAX takes them."""

from __future__ import annotations

import sys

import numpy as np

from . import cupy_arrays
from .info import Info, dtype_name

FRAMEWORK = "jax"
STAND_IN = "shared"  # a resident corpus's calls take them through DLPack (to_cupy, from_cupy)
_TF32 = ("tensorfloat32", "bfloat16", "fastest", "default")  # jax_default_matmul_precision's TF32 values
_FULL_PASSES = ("_X3", "_X6", "_X9")  # dot-algorithm presets of several passes: float32 accuracy, or near it


def describe(x) -> Info:
    if isinstance(x, sys.modules["jax"].core.Tracer):  # its devices() raises an error that names no fix
        raise TypeError("a JAX tracer (this code runs under jax.jit, jax.grad or jax.vmap): lik_cupy's top-level "
                        "functions read concrete arrays; inside traced code use lik_cupy.jax.maxsim (or "
                        "lik_cupy.jax's maxsim_varlen, maxsim_int8, maxsim_int8_varlen, maxsim_from_hidden)")
    devs = list(x.devices())
    if len(devs) != 1:
        raise ValueError(f"JAX arrays must live on one device, got one sharded over {len(devs)}")
    d = devs[0]
    dev = None if d.platform == "cpu" else int(getattr(d, "local_hardware_id", d.id) or 0)
    return Info(FRAMEWORK, dev, dtype_name(x.dtype), tuple(x.shape))


def to_cupy(x):
    import cupy

    try:
        a = cupy.from_dlpack(x)
    except (TypeError, NotImplementedError, BufferError, ValueError):
        if dtype_name(x.dtype) != "bfloat16":
            raise
        jax = sys.modules["jax"]
        a = cupy.from_dlpack(jax.lax.bitcast_convert_type(x, np.uint16))  # device copy, bit-exact
    return cupy_arrays.contiguous(a)


def to_numpy(x) -> np.ndarray:
    return np.asarray(x)


def _held(a):
    """``a`` (a NumPy or CuPy result) unchanged, where JAX holds its values: without 64-bit types
    (``jax_enable_x64`` off, JAX's default) JAX narrows 64-bit integers to 32 bits without a word, so
    a result holding a value past them (a corpus's ids) is a ValueError saying so."""
    jax = sys.modules["jax"]
    if a.dtype.kind in "iu" and a.dtype.itemsize == 8 and a.size and not jax.config.jax_enable_x64:
        narrow = np.iinfo(np.int32 if a.dtype.kind == "i" else np.uint32)
        lo, hi = int(a.min()), int(a.max())
        if lo < narrow.min or hi > narrow.max:
            raise ValueError(f"the result holds {hi if hi > narrow.max else lo}, which JAX without 64-bit types "
                             f"would truncate to {narrow.dtype}: enable them (jax.config.update(\"jax_enable_x64\", "
                             "True))")
    return a


def _on_host(a: np.ndarray):
    """A host result as a JAX array on the host (JAX's first CPU device), where the caller's array
    was: ``jnp.asarray`` takes JAX's default device, a GPU where there is one. (With several CPU
    devices, an input on another than the first still gets its result on the first.)"""
    jax = sys.modules["jax"]
    return jax.device_put(_held(a), jax.devices("cpu")[0])


def from_cupy(a, on_host: bool):
    jax = sys.modules["jax"]
    if on_host:
        return _on_host(a.get())
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    return jax.dlpack.from_dlpack(_held(a))


def bfloat16_from_bits(a, on_host: bool, like):
    jax = sys.modules["jax"]
    if on_host:
        import ml_dtypes

        return _on_host(a.get().view(ml_dtypes.bfloat16))
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(a), jax.numpy.bfloat16)


def byte_view(x):
    return sys.modules["jax"].lax.bitcast_convert_type(x, np.uint8)


def float8_view(x):
    jax = sys.modules["jax"]
    return jax.lax.bitcast_convert_type(x, jax.numpy.float8_e4m3fn)


def from_numpy(a: np.ndarray):
    return _on_host(a)


caller_stream = cupy_arrays.caller_stream  # (results are synchronised before JAX takes them)


def tf32_default() -> str | None:
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    value = jax.config.jax_default_matmul_precision
    if value is None:
        return "fp32"
    value = str(value)
    # A dot-algorithm preset ("TF32_TF32_F32", "BF16_BF16_F32", ...) names its operand types: one
    # product of operands narrower than float32 asks for TF32's accuracy or less.
    preset = value.isupper() and not value.startswith(("F32_", "F64_")) and not value.endswith(_FULL_PASSES)
    return "tf32" if value.lower() in _TF32 or preset else "fp32"
