"""The framework adapter contract: what each adapter module of ``lik_cupy._interop`` provides.

An adapter is a module (``numpy_arrays``, ``cupy_arrays``, ``torch_tensors``, ``jax_arrays``,
``dlpack_arrays``) whose functions are the methods below; the core files reach a framework only
through them, never by its name. Every adapter is an :class:`Adapter`. The frameworks whose
device arrays take the repeat-call path (``lik_cupy._runtime.prepared_calls``) are also
:class:`RepeatCalls`; ``xla_buffers`` (XLA's buffers inside ``lik_cupy.jax``'s callbacks) is
the :class:`CallBuffers` of JAX's repeat calls. ``tests/test_interop_contract.py`` checks that
each module has every member, with these parameters.

Out of memory: an adapter that allocates through its framework (``torch_tensors.new_empty``,
``torch_tensors.malloc``) raises CuPy's ``OutOfMemoryError`` from the framework's own, so that
``lik_cupy._base.device.allocating`` names the buffer whatever the framework.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from .info import Info

__all__ = ["Adapter", "CallBuffers", "RepeatCalls"]


class Adapter(Protocol):
    """Conversion to and from one framework's arrays, its stream and allocator, and its TF32 default."""

    FRAMEWORK: str  # "numpy" | "cupy" | "torch" | "jax" | "dlpack": Info.framework of its arrays
    # How a GPU-resident Corpus's call on these arrays becomes the CuPy call on the same values (whose
    # repeat path then runs): "staged" (host arrays, one page-locked copy each way,
    # lik_cupy._runtime.host_staging), "shared" (device arrays through to_cupy and from_cupy), or None
    STAND_IN: str | None

    def describe(self, x) -> Info:
        """Framework, device, dtype and shape of ``x``, without touching its data."""

    def to_numpy(self, x) -> np.ndarray:
        """A host NumPy array (bfloat16 as ``ml_dtypes.bfloat16``)."""

    def to_cupy(self, x):
        """A C-contiguous CuPy view (or device copy) of ``x``: bool as uint8, bfloat16 as its 16-bit
        integer bits."""

    def from_cupy(self, a, on_host: bool):
        """A CuPy result as this framework's array (on the host for host inputs)."""

    def bfloat16_from_bits(self, a, on_host: bool, like):
        """A bfloat16 result from its CuPy uint16 bits (``like``: an input of the call)."""

    def from_numpy(self, a: np.ndarray):
        """A host NumPy result (bfloat16 as ``ml_dtypes.bfloat16``) as this framework's array."""

    def byte_view(self, x):
        """One-byte elements (FP8 codes) as this framework's uint8, without a copy."""

    def float8_view(self, x):
        """uint8 FP8 codes as this framework's float8_e4m3fn where it has one (CuPy has none: uint8)."""

    def caller_stream(self, device: int) -> AbstractContextManager:
        """Entered around a call's GPU work: CuPy on ``device``, on the framework's current stream and
        with its allocator where it has them."""

    def tf32_default(self) -> str | None:
        """What the framework asks of its own float32 matmuls, "tf32" or "fp32"; None: nothing."""


class CallBuffers(Protocol):
    """What a prepared call (``lik_cupy._runtime.prepared_calls``) reads and makes per call."""

    def address(self, x) -> int:
        """The device address of ``x``'s first element."""

    def stream_handle(self, device: int) -> int:
        """The caller's current stream on ``device``, as a raw handle."""

    def new_empty(self, shape, dtype: str, device: int):
        """An uninitialised array on ``device``, on the caller's stream (CuPy's OutOfMemoryError
        when it does not fit)."""

    def to_int32(self, x):
        """``x`` as int32 (lengths narrowed for the kernels)."""

    def fill(self, x, value) -> None:
        """Set every element of ``x`` to ``value``, on the caller's stream."""


class RepeatCalls(CallBuffers, Protocol):
    """A framework whose device arrays take the repeat-call path: their signatures besides."""

    FRAMEWORK: str
    NEW_DTYPES: frozenset  # the dtype names new_empty makes

    def signature(self, x) -> tuple:
        """What a prepared call depends on: (shape, dtype, device (-1: the host), 16-byte aligned,
        C-contiguous)."""

    def dtype_name(self, dt) -> str:
        """The name ("float32", "int64", ...) of a signature's dtype."""

    def is_float32(self, x) -> bool:
        """Whether ``x`` is float32 (its call resolves a precision)."""
