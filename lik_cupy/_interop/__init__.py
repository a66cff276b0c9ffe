"""Framework interop: any DLPack array in, the caller's framework out.

The frameworks are recognised by the module that defines the array's type,
so ``import lik_cupy`` never imports torch or jax: if a torch tensor reaches
us, torch is already in ``sys.modules``.

Device arrays cross into CuPy through DLPack without a copy when they are
C-contiguous (other strides are copied on the device, never misread).
bfloat16 travels as its 16-bit pattern (a free view in torch, NumPy and
CuPy), because the kernels read raw bits and CuPy's own bfloat16 support
depends on its version.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


@dataclass(frozen=True)
class Info:
    """What validation needs to know about one array argument, without touching its data."""

    framework: str  # "numpy" | "cupy" | "torch" | "jax" | "dlpack"
    device: int | None  # CUDA device ordinal, or None for host memory
    dtype: str  # canonical numpy-style name: "float16", "bfloat16", "bool", "int32", ...
    shape: tuple[int, ...]


def framework_of(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        return "cupy"
    if mod == "torch":
        return "torch"
    if mod in ("jax", "jaxlib"):
        return "jax"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "dlpack"
    raise TypeError(f"expected a NumPy, CuPy, PyTorch or JAX array (or any DLPack array), got {type(x).__name__}")


_TORCH_DTYPE_NAMES: dict = {}


def _torch_dtype_name(dt) -> str:
    """``torch.float16`` -> "float16", memoised by the dtype object (``str`` of it costs about a
    microsecond, several times per call)."""
    try:
        return _TORCH_DTYPE_NAMES[dt]
    except KeyError:
        name = _TORCH_DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
        return name


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


def describe(x) -> Info:
    fw = framework_of(x)
    if fw == "numpy":
        return Info(fw, None, dtype_name(x.dtype), tuple(x.shape))
    if fw == "cupy":
        return Info(fw, int(x.device.id), dtype_name(x.dtype), tuple(x.shape))
    if fw == "torch":
        if x.is_cuda:
            dev = x.get_device()  # (``x.device`` builds an object per access)
        elif x.device.type == "cpu":
            dev = None
        else:
            raise ValueError(f"torch tensors must be on a CUDA device or the CPU, got device {x.device}")
        return Info(fw, dev, _torch_dtype_name(x.dtype), tuple(x.shape))
    if fw == "jax":
        devs = list(x.devices())
        if len(devs) != 1:
            raise ValueError(f"JAX arrays must live on one device, got one sharded over {len(devs)}")
        d = devs[0]
        dev = None if d.platform == "cpu" else int(getattr(d, "local_hardware_id", d.id) or 0)
        return Info(fw, dev, dtype_name(x.dtype), tuple(x.shape))
    kind, ordinal = x.__dlpack_device__()
    dev = int(ordinal) if kind in (_DL_CUDA, _DL_CUDA_MANAGED) else None
    import cupy  # a foreign DLPack producer: read its metadata through CuPy (device) or NumPy (host)

    arr = cupy.from_dlpack(x) if dev is not None else np.from_dlpack(x)
    return Info(fw, dev, dtype_name(arr.dtype), tuple(arr.shape))


def is_bfloat16(dtype) -> bool:
    return dtype_name(dtype) == "bfloat16"


# ---------------------------------------------------------------- to CuPy / NumPy


def _bits_view_torch(x):
    torch = sys.modules["torch"]
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16)
    if x.dtype == torch.bool:
        return x.view(torch.uint8)
    return x


def _torch_cuda_view(t):
    """Zero-copy C-contiguous CuPy view of a C-contiguous CUDA tensor from its pointer (the
    tensor is kept alive as the memory's owner; bfloat16 comes as int16 bits, bool as uint8).
    About ten times cheaper than the DLPack handshake, which matters for small calls; anything
    unusual takes the DLPack path."""
    import cupy

    if not t.is_cuda or not t.is_contiguous():
        return None
    n = t.numel()
    dtype = _torch_np(t.dtype)
    if dtype is None or n == 0:
        return None
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), n * dtype.itemsize, t, t.get_device())
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(mem, 0))


# The NumPy dtype of a torch dtype's elements as the kernels read them, by dtype name.
_TORCH_NP = {n: np.dtype(n) for n in ("float16", "float32", "float64", "int16", "int32", "int64", "uint8", "int8")}
_TORCH_NP.update({"bfloat16": np.dtype(np.int16), "bool": np.dtype(np.uint8)})  # their bits


def _torch_np(dtype):
    return _TORCH_NP.get(_torch_dtype_name(dtype))


def to_cupy(x, fw: str):
    """A C-contiguous CuPy view (or device copy) of ``x``; bool comes back as uint8 and
    torch bfloat16 as int16 bits (the caller, knowing the dtype, views them as uint16)."""
    import cupy

    if fw == "cupy":
        a = x
    elif fw == "torch":
        a = _torch_cuda_view(x)
        if a is not None:
            return a
        a = cupy.from_dlpack(_bits_view_torch(x.detach()))
    elif fw == "jax":
        try:
            a = cupy.from_dlpack(x)
        except (TypeError, NotImplementedError, BufferError, ValueError):
            if not is_bfloat16(x.dtype):
                raise
            jax = sys.modules["jax"]
            a = cupy.from_dlpack(jax.lax.bitcast_convert_type(x, np.uint16))  # device copy, bit-exact
    elif fw == "numpy":
        a = cupy.asarray(to_numpy(x, fw))
    else:
        a = cupy.from_dlpack(x)
    if a.dtype == np.bool_:
        a = a.view(np.uint8)
    return cupy.ascontiguousarray(a)


def to_numpy(x, fw: str) -> np.ndarray:
    """A host NumPy array (bfloat16 as ml_dtypes.bfloat16)."""
    if fw == "numpy":
        return x
    if fw == "torch":
        torch = sys.modules["torch"]
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if fw == "cupy":
        return x.get()
    return np.asarray(x) if fw == "jax" else np.from_dlpack(x)


# ---------------------------------------------------------------- back to the caller


def from_cupy(a, fw: str, on_host: bool):
    """Return a CuPy result in the caller's framework (host results for host inputs)."""
    if fw == "cupy":
        return a
    if fw == "torch":
        torch = sys.modules["torch"]
        if on_host:
            return torch.from_numpy(a.get())
        t = _torch_owner_view(a)
        return t if t is not None else torch.from_dlpack(a)
    if fw == "jax":
        jax = sys.modules["jax"]
        import cupy

        if on_host:
            return jax.numpy.asarray(a.get())
        cupy.cuda.get_current_stream().synchronize()  # JAX does not share our stream
        return jax.dlpack.from_dlpack(a)
    if fw == "numpy":
        return a.get()
    return a


def _torch_owner_view(a):
    """A C-contiguous CuPy array in memory ``_torch_malloc`` allocated, as a view of the torch
    tensor owning that memory (several times cheaper than the DLPack handshake); None for any
    other array."""
    torch = sys.modules["torch"]
    owner = getattr(a.data.mem, "_owner", None)
    dt = _NP_TORCH.get(a.dtype)
    if type(owner) is not torch.Tensor or owner.dtype != torch.uint8 or dt is None or not a.flags.c_contiguous:
        return None
    start = a.data.ptr - owner.data_ptr()
    if start or owner.numel() != a.nbytes:  # (a buffer of its own, the usual case, needs no slice)
        owner = owner[start:start + a.nbytes]
    return owner.view(getattr(torch, dt)).view(a.shape)


_NP_TORCH = {v: k for k, v in _TORCH_NP.items() if k not in ("bfloat16", "bool")}  # (those two come back as bits)


def bfloat16_from_bits(a, fw: str, on_host: bool, like):
    """A bfloat16 result from its CuPy uint16 bits, in the caller's framework (``like`` is an
    input of the call, whose dtype object a CuPy caller gets back)."""
    import ml_dtypes

    if fw == "torch":
        torch = sys.modules["torch"]
        bits = a.view(np.int16)
        if on_host:
            return torch.from_numpy(bits.get()).view(torch.bfloat16)
        t = _torch_owner_view(bits)
        return (t if t is not None else torch.from_dlpack(bits)).view(torch.bfloat16)
    if fw == "jax":
        jax = sys.modules["jax"]
        if on_host:
            return jax.numpy.asarray(a.get().view(ml_dtypes.bfloat16))
        import cupy

        cupy.cuda.get_current_stream().synchronize()  # JAX does not share our stream
        return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(a), jax.numpy.bfloat16)
    if fw == "cupy":
        return a.view(like.dtype)
    return a.get().view(ml_dtypes.bfloat16)


def from_numpy(a: np.ndarray, fw: str):
    """Return a host NumPy result in the caller's framework (CPU path)."""
    if fw == "torch":  # (ascontiguousarray alone would turn a 0-d result into shape [1])
        return sys.modules["torch"].from_numpy(np.ascontiguousarray(a).reshape(a.shape))
    if fw == "jax":
        return sys.modules["jax"].numpy.asarray(a)
    return a


# (device, stream handle) -> CuPy's non-owning view of a torch stream, built once (about 10 us
# per call otherwise); a handle torch reuses for a new stream is the same stream to CuPy.
_external: dict = {}


@contextlib.contextmanager
def caller_stream(fw: str, device: int):
    """Make CuPy work on the caller's current stream on ``device``; for torch callers, CuPy's
    device buffers inside the block (results and scratch) come from torch's caching allocator.

    One pool for both frameworks: memory CuPy frees goes back where torch can reuse it, torch's
    memory statistics and limits see it, and inside ``torch.cuda.graph`` capture every buffer
    comes from the graph's private pool, which keeps it for the graph's replays.
    """
    import cupy

    with cupy.cuda.Device(device):
        if fw == "torch":
            torch = sys.modules["torch"]
            # The raw handle is what Triton's launcher reads too: a fifth of the cost of the
            # Stream object, which only a new stream needs.
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            handle = raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
            ext = _external.get((device, handle))
            if ext is None:
                s = torch.cuda.current_stream(device)
                if hasattr(s, "__cuda_stream__") and hasattr(cupy.cuda.Stream, "from_external"):
                    ext = cupy.cuda.Stream.from_external(s)  # CuPy 14 deprecates ExternalStream (a warning per call)
                else:
                    ext = cupy.cuda.ExternalStream(s.cuda_stream, device)
                if len(_external) >= 256:
                    _external.clear()
                _external[(device, handle)] = ext
            with ext, cupy.cuda.using_allocator(_torch_malloc):
                yield
        else:
            yield


def _torch_malloc(size: int):
    """A CuPy allocation owned by a torch uint8 tensor (allocated on torch's current stream,
    freed when CuPy drops the memory); torch's out-of-memory error becomes CuPy's, which
    ``device.allocating`` turns into the named ``DeviceMemoryError``."""
    import cupy

    torch = sys.modules["torch"]
    device = cupy.cuda.runtime.getDevice()
    try:
        t = torch.empty(max(int(size), 1), dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError as e:
        raise cupy.cuda.memory.OutOfMemoryError(int(size), 0) from e
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), int(size), t, device), 0)


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

    from .._runtime.device import allocating

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
