"""Candidate ids on the device: the documents each query scores in place (the forward's ``LIK_CAND``
tiles), and the kernel parameter that says where they are (``CandSrc`` in ``cuda_src/fwd/config.cuh``)."""

from __future__ import annotations

import ctypes
import struct

import numpy as np

__all__ = ["CandidateIds", "CandidateParam"]

# CandSrc: a pointer, an int64 and an int (24 bytes, 8-byte aligned), as the kernel declares it.
_SRC = struct.Struct("<Qqi4x")


class CandidateIds:
    """Device ids ``[Nq, K]`` (int32 or int64 kept as given, other integer dtypes widened to int64;
    C-contiguous) of documents of a corpus of ``n_docs``, and their kernel parameter (``address``:
    its bytes, as the driver takes a by-value parameter). An id outside ``[0, n_docs)`` reads
    nothing; the kernel scores it NaN."""

    def __init__(self, ids, n_docs: int):
        import cupy

        self.ids = cupy.ascontiguousarray(ids, dtype=ids.dtype if ids.dtype in (np.int32, np.int64) else np.int64)
        self.n_docs = int(n_docs)
        self._param = CandidateParam(self.ids.data.ptr, self.n_docs, self.ids.dtype == np.int64)

    @property
    def address(self) -> int:
        return self._param.address


class CandidateParam:
    """The kernel parameter of device ids at ``ptr`` (int64 when ``wide``, else int32) of documents of
    a corpus of ``n_docs``: its bytes, at ``address``."""

    __slots__ = ("_bytes",)

    def __init__(self, ptr: int, n_docs: int, wide: bool):
        self._bytes = ctypes.create_string_buffer(_SRC.size)
        _SRC.pack_into(self._bytes, 0, ptr, n_docs, int(wide))

    @property
    def address(self) -> int:
        return ctypes.addressof(self._bytes)
