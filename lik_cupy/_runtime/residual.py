"""PLAID residual documents on the device: the arrays the residual loader reads, in the dtypes and
alignment it needs, and the kernel parameter that tells it where they are (``ResidualSrc`` in
``cuda_src/fwd/config.cuh``)."""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import numpy as np

__all__ = ["ResidualOperands", "residual_operands"]

# ResidualSrc: four pointers, then four ints (48 bytes, 8-byte aligned), as the kernel declares it.
_SRC = struct.Struct("<QQQQiiii")


def _aligned(a, dtype):
    """``a`` as a C-contiguous device array of ``dtype`` starting on a 16-byte boundary (the
    loader's 16-byte copies need it): a view when it already is, else a copy."""
    import cupy

    a = cupy.ascontiguousarray(a, dtype=dtype)
    return a if a.data.ptr % 16 == 0 else a.copy()


@dataclass
class ResidualOperands:
    """The device arrays of one residual call and its kernel parameter (``address``: its bytes, as
    the driver takes a by-value parameter). Candidate ids travel apart (``candidates.CandidateIds``)."""

    nbits: int
    codes: object  # int32 or int64 [rows]
    bits: object  # uint8 [rows, rbytes]
    centroids: object  # float16 [n_cent, dim]
    weights: object  # float32 [2^nbits]
    _param: ctypes.Array = None

    def pack(self, normalize: bool) -> None:
        rows = self.codes.size
        self._param = ctypes.create_string_buffer(_SRC.size)
        _SRC.pack_into(self._param, 0, self.codes.data.ptr, self.bits.data.ptr, self.centroids.data.ptr,
                       self.weights.data.ptr, self.centroids.shape[0], self.bits.size // max(rows, 1) if rows else 0,
                       int(self.codes.dtype == np.int64), int(normalize))

    @property
    def address(self) -> int:
        return ctypes.addressof(self._param)


def residual_operands(codes, bits, centroids, weights, *, nbits: int, normalize: bool):
    """CuPy device arrays (on the current device) -> the operands the residual kernel reads: codes
    kept as int32 or int64 (other integer dtypes become int32), residual bits uint8, centroids
    float16 (float32 ones are rounded), bucket weights float32."""
    codes = codes.reshape(-1)
    cdt = codes.dtype if codes.dtype in (np.int32, np.int64) else np.int32
    ops = ResidualOperands(nbits=nbits, codes=_aligned(codes, cdt), bits=_aligned(bits, np.uint8),
                           centroids=_aligned(centroids, np.float16), weights=_aligned(weights, np.float32))
    ops.pack(normalize)
    return ops
