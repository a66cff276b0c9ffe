"""The operands in the form each path takes: which tokens are valid (masks, lengths and offsets made
into the device arrays the kernels read, range checks queued on the device, or into host arrays
the NumPy path reads, range checks raised at once), and the embeddings' dtype as the kernels
take it (kernel_operands)."""

from __future__ import annotations

import numpy as np

from .._interop import device_array, host_array
from .._validate import check_length_values, check_offset_values, scale_error
from .device_checks import queue_or_verify

__all__ = ["host_metadata", "valid_host", "host_offsets", "check_scales_of_valid", "device_valid", "device_offsets",
           "unpack_queries", "kernel_operands"]


def host_metadata(*xs) -> bool:
    """Whether any of the lengths, offsets or argmax ``xs`` is host-resident (a list, an int, a NumPy
    array or a CPU tensor): such values are checked on the host and raise unless ``validate`` is False
    (only device values follow the NaN contract, docs in ``lik_cupy.forward.maxsim``; the CPU path
    checks them always)."""
    from .._interop import describe

    for x in xs:
        if x is None:
            continue
        if isinstance(x, (list, tuple, int, np.integer, np.ndarray)) or describe(x).device is None:
            return True
    return False


def valid_host(mask, lengths, rows: int, length: int, name: str, fw: str) -> np.ndarray:
    """One side's valid tokens on the host: bool [rows, length] from a mask, range-checked
    lengths, or all True."""
    if mask is not None:
        return host_array(mask, fw).reshape(rows, length).astype(bool, copy=False)
    if lengths is not None:
        lens = host_array(lengths, fw).reshape(rows)
        if lens.size:  # on the values as given: a uint64 past int64 would read as negative after the cast
            check_length_values(name, int(lens.min()), int(lens.max()), length)
        lens = lens.astype(np.int64)
        return np.arange(length)[None, :] < lens[:, None]
    return np.ones((rows, length), bool)


def host_offsets(off: np.ndarray, total: int, name: str) -> np.ndarray:
    """int64 copy of host offsets after the value checks."""
    off = np.ascontiguousarray(off, dtype=np.int64).reshape(-1)
    check_offset_values(name, int(off[0]), int(off[-1]), bool((np.diff(off) < 0).any()), total)
    return off


def check_scales_of_valid(scales, valid, name: str, shape: tuple | None = None) -> None:
    """Raise unless every INT8 document scale of a valid token is finite and >= 0: ``scales`` and the
    bool ``valid`` (None: every token valid) of one shape, both NumPy or both CuPy (a device array
    waits for its answer: for checks made once, as a Corpus's). ``shape``: the scales' shape as the
    caller passed them, when ``scales`` is them reshaped (or ``[]`` broadcast), so that the error
    names the entry as passed."""
    if isinstance(scales, np.ndarray):
        xp = np
    else:
        import cupy as xp
    bad = ~((scales >= 0) & (scales <= np.finfo(np.float32).max))
    if valid is not None:
        bad &= valid
    if bool(bad.any()):
        flat = int(xp.argmax(bad))
        value = float(scales[np.unravel_index(flat, scales.shape)])
        at = () if shape == () else np.unravel_index(flat, scales.shape if shape is None else shape)
        raise scale_error(name, tuple(int(i) for i in at), value)


def device_valid(mask, lengths, rows: int, length: int, name: str, fw: str, on_host: bool, checks=None):
    """One side's valid tokens on the device: (uint8 mask [rows, length] or None, int32 or int64
    lengths [rows] or None). ``checks`` (``device_checks.call_checks``) queues their value check
    (strict) or notes them for the NaN pass; without, a strict check is verified here."""
    import cupy

    m = None if mask is None else device_array(mask, fw, on_host).view(cupy.uint8).reshape(rows, length)
    n = None
    if lengths is not None:
        a = cupy.ascontiguousarray(device_array(lengths, fw, on_host).reshape(rows))
        if rows:
            queue_or_verify(checks, "lengths", a, length, name)
        n = a if a.dtype in (np.int32, np.int64) else a.astype(cupy.int32)  # the kernels read either
    return m, n


def device_offsets(off, total: int, name: str, check: bool = True, checks=None, *, wide: bool = False):
    """Contiguous device offsets, int32 kept as given (the forward kernel reads either width)
    and int64 otherwise, or always int64 with ``wide``. ``check`` runs the value checks on the
    device (no copy of the array): queued on ``checks`` (a ``DeviceChecks``) for the caller to
    verify, or verified here."""
    import cupy

    off = off.reshape(-1)
    off = cupy.ascontiguousarray(off, dtype=cupy.int64 if wide or off.dtype != np.int32 else cupy.int32)
    if check:
        queue_or_verify(checks, "offsets", off, total, name)
    return off


def unpack_queries(qt, q_offsets: np.ndarray, rows: np.ndarray | None = None):
    """Packed queries [Tq, d] on the device, with their checked int64 offsets on the host (read there to
    size the tile) -> padded [n, Lq, d] plus int32 lengths [n]: every query, or with ``rows`` (indices)
    those queries, in that order, Lq the longest of them (``lik_cupy._cpu.query_groups``)."""
    import cupy

    starts, lens = q_offsets[:-1], np.diff(q_offsets)
    if rows is not None:
        starts, lens = starts[rows], lens[rows]
    nq = lens.size
    lq = int(lens.max()) if nq else 0
    if lq == 0 or qt.shape[0] == 0:
        return cupy.zeros((nq, lq, qt.shape[1]), qt.dtype), cupy.zeros(nq, cupy.int32)
    at = np.minimum(starts[:, None] + np.arange(lq)[None, :], qt.shape[0] - 1)  # rows past a length are masked
    q = qt[cupy.asarray(at)]
    return cupy.ascontiguousarray(q), cupy.asarray(lens.astype(np.int32))


def kernel_operands(dtype: str, *arrays):
    """Device ``arrays`` of ``dtype`` as the kernels take them: bfloat16 as its uint16 bits, float64
    rounded to float32 (kernel_dtype), the rest as they are."""
    import cupy

    if dtype == "bfloat16":
        return tuple(a.view(cupy.uint16) for a in arrays)
    if dtype == "float64":
        return tuple(a.astype(cupy.float32) for a in arrays)
    return arrays
