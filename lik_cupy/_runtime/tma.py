"""Hopper tensor maps (TMA descriptors) for the forward kernel's document tiles.

A tensor map tells the GPU's tensor memory accelerator the address, shape and row
stride of a global array, and the box and swizzle of the copies the kernel asks for.
The kernel then stages a whole document tile with one instruction per 128-byte column
block instead of one 16-byte ``cp.async`` per thread per chunk. Maps are built on the
host with the driver's ``cuTensorMapEncodeTiled`` (reached through ctypes: CuPy does not
wrap it, and it is one C entry point with a stable signature) and passed to the kernel
by value as a 128-byte ``__grid_constant__`` parameter.
"""

from __future__ import annotations

import ctypes
import functools

# CUtensorMap* enum values (cuda.h)
_UINT8, _FLOAT32 = 0, 7
_ESIZE = {_UINT8: 1, _FLOAT32: 4}
_INTERLEAVE_NONE = 0
_SWIZZLE_NONE, _SWIZZLE_128B = 0, 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZERO = 0

MAX_ROWS = 2**31 - 1  # box coordinates are signed 32-bit


@functools.lru_cache(maxsize=1)
def _encode():
    """The driver's cuTensorMapEncodeTiled, or None where the driver has none (CUDA < 12)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    """Whether tensor maps can be built here (a CUDA 12+ driver)."""
    return _encode() is not None


class TensorMap:
    """One encoded map: 128 bytes, 64-byte aligned, alive as long as this object is."""

    def __init__(self, dtype: int, ptr: int, dims: tuple[int, ...], box: tuple[int, ...], swizzle: int):
        self._buf = ctypes.create_string_buffer(128 + 64)
        self.address = (ctypes.addressof(self._buf) + 63) & ~63
        rank, esize = len(dims), _ESIZE[dtype]
        strides = [dims[0] * esize]  # bytes between rows (a rank-1 map has none)
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        err = _encode()(
            ctypes.c_void_p(self.address), dtype, rank, ctypes.c_void_p(ptr), (u64 * rank)(*dims),
            (u64 * 1)(*strides[:rank - 1]), (u32 * rank)(*box), (u32 * rank)(*([1] * rank)),
            _INTERLEAVE_NONE, swizzle, _L2_PROMOTION_256B, _OOB_FILL_ZERO,
        )
        if err:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUDA error {err} (dims {dims}, box {box})")


# A map only encodes an address and a shape, so a cached one is exact for any array that
# has them (a freed and reused allocation included).
@functools.lru_cache(maxsize=256)
def tile_map(ptr: int, rows: int, row_bytes: int, box_rows: int) -> TensorMap:
    """``rows`` rows of ``row_bytes`` bytes (a multiple of 128) at device address ``ptr``,
    copied in boxes of ``box_rows`` rows x 128 bytes, 128-byte swizzled (the layout wgmma
    reads and the portable kernel's ldmatrix addressing follows)."""
    return TensorMap(_UINT8, ptr, (row_bytes, rows), (128, box_rows), _SWIZZLE_128B)


@functools.lru_cache(maxsize=256)
def scale_map(ptr: int, n: int, box: int) -> TensorMap:
    """``n`` float32 values at ``ptr`` (16-byte aligned), copied ``box`` at a time from
    16-byte aligned starts."""
    return TensorMap(_FLOAT32, ptr, (n,), (box,), _SWIZZLE_NONE)
