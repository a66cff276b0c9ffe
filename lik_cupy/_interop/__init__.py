"""Framework interop: any DLPack array in, the caller's framework out.

One adapter module per framework (``numpy_arrays``, ``cupy_arrays``, ``torch_tensors``,
``jax_arrays``, ``dlpack_arrays``), each with the members of the contract in ``contract.py``
(conversion, the bf16 and float8 views, stream and allocator, TF32 default; the repeat-call hooks
for torch and CuPy, and ``xla_buffers`` for JAX's callbacks). The functions here pick the adapter by
framework name and do what every framework shares; the core modules reach a framework only through
its adapter.

Frameworks are recognised by the module that defines the array's type (a subclass defined
elsewhere, by ``isinstance`` against the frameworks already imported), so ``import lik_cupy`` never
imports torch or jax: if a torch tensor reaches us, torch is already in ``sys.modules``.
Device arrays cross into CuPy without a copy when they are C-contiguous (other strides are
copied on the device, never misread). bfloat16 travels as its 16-bit pattern (a free view in
torch, NumPy and CuPy), because the kernels read raw bits and CuPy's own bfloat16 support
depends on its version. FP8 (float8_e4m3fn) travels as its uint8 bit patterns likewise
(``float8_bits``), and comes back as float8 where the framework has the type (``float8_view``).
"""

from __future__ import annotations

import sys

import numpy as np

from . import cupy_arrays, dlpack_arrays, jax_arrays, numpy_arrays, torch_tensors, xla_buffers
from .info import Info, dtype_name

__all__ = ["FLOAT_DTYPES", "FLOAT8_DTYPES", "ADAPTERS", "REPEAT_CALLS", "CALLBACK_BUFFERS", "Info", "dtype_name",
           "framework_of", "describe", "describe_named", "is_bfloat16", "to_cupy", "to_numpy", "from_cupy", "bfloat16_from_bits",
           "from_numpy", "float8_bits", "float8_view", "caller_stream", "tf32_default", "host_array", "host_result",
           "device_array", "caller_results", "GpuCall"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
FLOAT8_DTYPES = ("float8_e4m3fn",)
ADAPTERS = {m.FRAMEWORK: m for m in (numpy_arrays, cupy_arrays, torch_tensors, jax_arrays, dlpack_arrays)}
# The repeat-call path's adapters (contract.RepeatCalls), by the top module of an array's type.
REPEAT_CALLS = {m.FRAMEWORK: m for m in (torch_tensors, cupy_arrays)}
# The buffers a prepared call is rebound to inside a framework's callback (contract.CallBuffers).
CALLBACK_BUFFERS = {xla_buffers.FRAMEWORK: xla_buffers}


def framework_of(x) -> str:
    if isinstance(x, (np.ndarray, np.generic)):  # a NumPy scalar (2 * a 0-d result) is a 0-d array
        return "numpy"
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        return "cupy"
    if mod == "torch":
        return "torch"
    if mod in ("jax", "jaxlib"):
        return "jax"
    for name, framework in (("torch", "torch"), ("cupy", "cupy"), ("jax", "jax")):  # a subclass defined elsewhere
        module = sys.modules.get(name)
        if module is not None and isinstance(x, module.Tensor if name == "torch" else
                                             module.ndarray if name == "cupy" else module.Array):
            return framework
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "dlpack"
    raise TypeError(f"expected a NumPy, CuPy, PyTorch or JAX array (or any DLPack array), got {type(x).__name__}")


def describe(x) -> Info:
    return ADAPTERS[framework_of(x)].describe(x)


def describe_named(name: str, x) -> Info:
    """:func:`describe`, its errors (no array; an array of no place or layout the kernels read; a DLPack
    producer that cannot export it) naming the argument ``name``."""
    try:
        return describe(x)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None
    except BufferError as e:  # (neither: the errors contract promises one of those)
        raise TypeError(f"{name}: its DLPack export failed ({e})") from None


def float8_bits(x, name: str = "x"):
    """``x`` as the kernels read it: a float8_e4m3fn array (PyTorch, NumPy through ml_dtypes, JAX) as a
    uint8 view of its bit patterns in its own framework; any other array unchanged. An argument
    that is no array is a TypeError naming it (``name``)."""
    info = describe_named(name, x)
    return ADAPTERS[info.framework].byte_view(x) if info.dtype in FLOAT8_DTYPES else x


def float8_view(x, fw: str):
    """uint8 bit patterns ``x`` of framework ``fw`` as float8_e4m3fn where the framework has the type
    (CuPy has none: its arrays stay uint8)."""
    return ADAPTERS[fw].float8_view(x)


def is_bfloat16(dtype) -> bool:
    return dtype_name(dtype) == "bfloat16"


def to_cupy(x, fw: str):
    """A C-contiguous CuPy view (or device copy) of ``x``; bool comes back as uint8 and
    bfloat16 as 16-bit integer bits (the caller, knowing the dtype, views them as uint16)."""
    return ADAPTERS[fw].to_cupy(x)


def to_numpy(x, fw: str) -> np.ndarray:
    """A host NumPy array (bfloat16 as ml_dtypes.bfloat16)."""
    return ADAPTERS[fw].to_numpy(x)


def from_cupy(a, fw: str, on_host: bool):
    """A CuPy result in the caller's framework (host results for host inputs)."""
    return ADAPTERS[fw].from_cupy(a, on_host)


def bfloat16_from_bits(a, fw: str, on_host: bool, like):
    """A bfloat16 result from its CuPy uint16 bits, in the caller's framework (``like`` is an
    input of the call, whose dtype object a CuPy caller gets back)."""
    return ADAPTERS[fw].bfloat16_from_bits(a, on_host, like)


def from_numpy(a: np.ndarray, fw: str):
    """A host NumPy result in the caller's framework (CPU path)."""
    return ADAPTERS[fw].from_numpy(a)


def caller_stream(fw: str, device: int):
    """Entered, CuPy works on ``device`` and the caller's current stream, with its framework's
    allocator where it has one (torch's: ``torch_tensors.caller_stream``)."""
    return ADAPTERS[fw].caller_stream(device)


def tf32_default(fw: str) -> str | None:
    """What the caller's framework asks of its own float32 matmuls ("tf32", "fp32"), or None. Read
    only when that framework is already imported (an array of it was passed, so it is)."""
    return ADAPTERS[fw].tf32_default()


# ---------------------------------------------------------------- arguments and results of a call


def host_array(x, fw: str) -> np.ndarray:
    """An argument on the host: lists and ints as NumPy, arrays through ``to_numpy``."""
    if isinstance(x, (list, tuple, int, np.integer)):
        return np.asarray(x)
    return to_numpy(x, fw)


def host_result(a: np.ndarray, p):
    """A CPU-path result in the caller's framework and on the caller's device (``p``: anything with
    ``.device`` and ``.framework``, a ``Problem`` or an ``Info``)."""
    if p.device is None:
        return from_numpy(a, p.framework)
    import cupy  # device inputs forced onto the CPU path: hand results back on their device

    with cupy.cuda.Device(p.device):
        return from_cupy(cupy.asarray(a), p.framework, on_host=False)


def device_array(x, fw: str, on_host: bool):
    """An argument as a CuPy array on the current device (host arrays are copied up)."""
    import cupy

    from .._base.device import allocating

    if isinstance(x, (list, tuple, int, np.integer)):
        return cupy.asarray(np.asarray(x))
    if not on_host:
        return to_cupy(x, fw)
    h = to_numpy(x, fw)
    with allocating(f"host array {list(h.shape)} {h.dtype} copied to the GPU", h.nbytes,
                    "pass device arrays, or split the call"):
        return cupy.asarray(h)


def caller_results(p, scores, amax, on_host: bool):
    """Scores (and argmax) of problem ``p`` in the caller's framework and shapes."""
    scores = from_cupy(scores.reshape(p.scores_shape), p.framework, on_host)
    if amax is not None:
        amax = from_cupy(amax.reshape(p.argmax_shape), p.framework, on_host)
    return scores, amax


class GpuCall:
    """The prologue every public GPU path shares: the caller's framework, the device (``device``, else
    the arrays', else the current one) and whether the arrays are on the host. Entered (``with
    GpuCall(p) as g``), CuPy works on that device and the caller's stream and allocator
    (``caller_stream``); ``array`` brings an argument over, ``result`` and ``results`` hand CuPy
    results back in the caller's framework. ``p``: anything with ``.framework`` and ``.device``."""

    __slots__ = ("framework", "device", "on_host", "_stream")

    def __init__(self, p, device: int | None = None):
        self.framework = p.framework
        self.on_host = p.device is None
        if device is None:
            device = p.device
            if device is None:
                import cupy

                device = cupy.cuda.runtime.getDevice()
        self.device = device

    def __enter__(self) -> GpuCall:
        self._stream = ADAPTERS[self.framework].caller_stream(self.device)
        self._stream.__enter__()
        return self

    def __exit__(self, *exc):
        return self._stream.__exit__(*exc)

    def array(self, x):
        """An argument as a CuPy array on the device (``device_array``)."""
        return device_array(x, self.framework, self.on_host)

    def result(self, a):
        """A CuPy result in the caller's framework, on the host for host arguments."""
        return from_cupy(a, self.framework, self.on_host)

    def results(self, p, scores, amax):
        """Scores (and argmax) of problem ``p`` in the caller's framework and shapes (``caller_results``)."""
        return caller_results(p, scores, amax, self.on_host)
