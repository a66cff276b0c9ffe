"""PyTorch tensors (CUDA or CPU). torch is never imported here: a tensor reaching us means torch
is in ``sys.modules`` already.

Hot paths avoid the DLPack handshake, about ten times dearer than reading a pointer: device
tensors are viewed in CuPy from their pointer, results allocated by torch's caching allocator
come back as views of the owning tensor, and CuPy runs on torch's current stream.

A tensor with its negative bit set (``z.conj().imag``, ``torch._neg_view``) holds the values'
negations in memory: its pointer, and the DLPack capsule torch exports for it, would give the
kernels the wrong signs, so it is materialised (``resolve_neg``) before its memory is read, and
its signature never takes the repeat path.
"""

from __future__ import annotations

import contextlib
import math
import sys

import numpy as np

from .._base.cache import DeviceCache
from .info import Info

FRAMEWORK = "torch"
STAND_IN = None  # the repeat path takes them as they are

_DTYPE_NAMES: dict = {}


def dtype_name(dt) -> str:
    """``torch.float16`` -> "float16", memoised by the dtype object (``str`` of it costs about a
    microsecond, several times per call)."""
    try:
        return _DTYPE_NAMES[dt]
    except KeyError:
        name = _DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
        return name


# The NumPy dtype of a torch dtype's elements as the kernels read them, by dtype name.
_TORCH_NP = {n: np.dtype(n) for n in ("float16", "float32", "float64", "int16", "int32", "int64", "uint8", "int8")}
_TORCH_NP.update({"bfloat16": np.dtype(np.int16), "bool": np.dtype(np.uint8)})  # their bits
_NP_TORCH = {v: k for k, v in _TORCH_NP.items() if k not in ("bfloat16", "bool")}  # (those two come back as bits)


def describe(x) -> Info:
    if x.layout is not sys.modules["torch"].strided or x.is_nested:
        raise TypeError(f"torch tensors must be dense and strided (.to_dense()), got layout {x.layout}"
                        + (" (nested)" if x.is_nested else ""))
    if x.is_cuda:
        dev = x.get_device()  # (``x.device`` builds an object per access)
    elif x.device.type == "cpu":
        dev = None
    else:
        raise ValueError(f"torch tensors must be on a CUDA device or the CPU, got device {x.device}")
    return Info(FRAMEWORK, dev, dtype_name(x.dtype), tuple(x.shape))


def _bits_view(x):
    torch = sys.modules["torch"]
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16)
    if x.dtype == torch.bool:
        return x.view(torch.uint8)
    return x


def cuda_view(t):
    """Zero-copy C-contiguous CuPy view of a C-contiguous CUDA tensor from its pointer (the
    tensor is kept alive as the memory's owner; bfloat16 comes as int16 bits, bool as uint8);
    None for anything unusual, which takes the DLPack path."""
    import cupy

    if not t.is_cuda or not t.is_contiguous():
        return None
    n = t.numel()
    dtype = _TORCH_NP.get(dtype_name(t.dtype))
    if dtype is None or n == 0:
        return None
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), n * dtype.itemsize, t, t.get_device())
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(mem, 0))


def to_cupy(x):
    x = x.resolve_neg()
    a = cuda_view(x)  # the common case, ready as it is
    if a is not None:
        return a
    import cupy

    return cupy.ascontiguousarray(cupy.from_dlpack(_bits_view(x.detach())))


def to_numpy(x) -> np.ndarray:
    torch = sys.modules["torch"]
    t = x.detach().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _owner_view(a):
    """A C-contiguous CuPy array in memory ``malloc`` allocated, as a view of the torch tensor
    owning that memory (several times cheaper than the DLPack handshake); None for any other
    array."""
    torch = sys.modules["torch"]
    owner = getattr(a.data.mem, "_owner", None)
    dt = _NP_TORCH.get(a.dtype)
    if type(owner) is not torch.Tensor or owner.dtype != torch.uint8 or dt is None or not a.flags.c_contiguous:
        return None
    start = a.data.ptr - owner.data_ptr()
    if start or owner.numel() != a.nbytes:  # (a buffer of its own, the usual case, needs no slice)
        owner = owner[start:start + a.nbytes]
    return owner.view(getattr(torch, dt)).view(a.shape)


def from_cupy(a, on_host: bool):
    torch = sys.modules["torch"]
    if on_host:
        return torch.from_numpy(a.get())
    t = _owner_view(a)
    return t if t is not None else torch.from_dlpack(a)


def bfloat16_from_bits(a, on_host: bool, like):
    torch = sys.modules["torch"]
    bits = a.view(np.int16)
    if on_host:
        return torch.from_numpy(bits.get()).view(torch.bfloat16)
    t = _owner_view(bits)
    return (t if t is not None else torch.from_dlpack(bits)).view(torch.bfloat16)


def byte_view(x):
    return x.view(sys.modules["torch"].uint8)


def float8_view(x):
    return x.view(sys.modules["torch"].float8_e4m3fn)


def from_numpy(a: np.ndarray):
    torch = sys.modules["torch"]
    # (ascontiguousarray alone would turn a 0-d result into shape [1])
    a = np.ascontiguousarray(a).reshape(a.shape)
    if a.dtype.name == "bfloat16":  # ml_dtypes' type, which torch cannot take: its bits
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# (device, stream handle) -> CuPy's non-owning view of a torch stream, built once (about 10 us
# per call otherwise); a handle torch reuses for a new stream is the same stream to CuPy.
_external = DeviceCache(256)


def _external_stream(device: int):
    import cupy

    s = sys.modules["torch"].cuda.current_stream(device)
    if hasattr(s, "__cuda_stream__") and hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(s)  # CuPy 14 deprecates ExternalStream (a warning per call)
    return cupy.cuda.ExternalStream(s.cuda_stream, device)


def current_stream(device: int):
    """CuPy's view of torch's current stream on ``device`` (built once per stream)."""
    torch = sys.modules["torch"]
    # The raw handle is what Triton's launcher reads too: a fifth of the cost of the Stream
    # object, which only a new stream needs.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    handle = raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
    return _external.lookup(device, handle) or _external.get(device, handle, lambda: _external_stream(device))


@contextlib.contextmanager
def caller_stream(device: int):
    """CuPy on torch's current stream on ``device``, every CuPy buffer inside the block from torch's
    caching allocator (:func:`malloc`)."""
    import cupy

    with cupy.cuda.Device(device), current_stream(device), cupy.cuda.using_allocator(malloc):
        yield


def tf32_default() -> str | None:
    """What ``torch.backends.cuda.matmul`` asks of float32 matmuls."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    matmul = torch.backends.cuda.matmul
    fp32 = getattr(matmul, "fp32_precision", None)  # PyTorch 2.9+
    if fp32 in ("tf32", "ieee"):
        return "tf32" if fp32 == "tf32" else "fp32"
    try:
        tf32 = matmul.allow_tf32 or torch.get_float32_matmul_precision() in ("high", "medium")
    except RuntimeError:  # PyTorch refuses the older switches once the newer ones were set
        return None
    return "tf32" if tf32 else "fp32"


def malloc(size: int):
    """A CuPy allocation owned by a torch uint8 tensor (allocated on torch's current stream,
    freed when CuPy drops the memory): inside ``caller_stream`` every CuPy buffer of a torch
    caller comes from torch's caching allocator, so torch's memory statistics and limits see it
    and ``torch.cuda.graph`` capture takes it from the graph's pool. torch's out-of-memory error
    becomes CuPy's, which
    ``lik_cupy._base.device.allocating`` turns into the named ``DeviceMemoryError``."""
    import cupy

    torch = sys.modules["torch"]
    device = cupy.cuda.runtime.getDevice()
    try:
        t = torch.empty(max(int(size), 1), dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError as e:
        raise cupy.cuda.memory.OutOfMemoryError(int(size), 0) from e
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), int(size), t, device), 0)


# ---------------------------------------------------------------- the repeat-call path (lik_cupy._runtime.prepared_calls)


def signature(x):
    """What a prepared call depends on: (shape, dtype, device (-1: not a CUDA device), 16-byte
    aligned, C-contiguous, a negative-bit view counted as not). (``get_device`` numbers other
    accelerators' devices from 0 too: such a tensor, keyed as cuda:0's, would skip the check that
    refuses it.)"""
    return (x.shape, x.dtype, x.get_device() if x.is_cuda else -1, not x.data_ptr() & 15,
            x.is_contiguous() and not x.is_neg())


def address(x) -> int:
    return x.data_ptr()


def stream_handle(device: int) -> int:
    """torch's current stream on ``device``, as a raw handle (what Triton's launcher reads)."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


NEW_DTYPES = frozenset(("float16", "bfloat16", "float32", "int32", "int64"))
_DEVICES: dict = {}  # ordinal -> torch.device


def new_empty(shape, dtype: str, device: int):
    """An uninitialised tensor from torch's caching allocator (on its current stream)."""
    torch = sys.modules["torch"]
    dev = _DEVICES.get(device)
    if dev is None:
        dev = _DEVICES[device] = torch.device("cuda", device)
    try:
        return torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
    except torch.cuda.OutOfMemoryError as e:
        import cupy

        raise cupy.cuda.memory.OutOfMemoryError(math.prod(shape) * getattr(torch, dtype).itemsize, 0) from e


def to_int32(x):
    return x.to(sys.modules["torch"].int32)


def is_float32(x) -> bool:
    return x.dtype == sys.modules["torch"].float32


def fill(x, value) -> None:
    x.fill_(value)
