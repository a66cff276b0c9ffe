"""Value checks of device lengths, offsets and scales (shapes and dtypes are checked in
``lik_cupy._validate``).

By default nothing here waits for the GPU: :func:`mark_invalid` queues one small kernel after the
scoring kernel, on the caller's stream, that writes NaN into exactly the scores an invalid value
touches (``cuda_src/checks.cu``, ``lik_nan_invalid``; the contract: docs/api.md, "Invalid device values"). The
scoring kernels clamp every length to [0, L] and every document to [0, T), so an invalid value
is never read out of bounds; the pass only marks what it gave. It runs inside CUDA graph capture
too, reading the values of each replay.

Strict mode (``validate=True``, or ``LIK_VALIDATE=1``) raises instead, with :class:`DeviceChecks`.
Each check is one single-block kernel (``cuda_src/checks.cu``) that writes three int64 slots
straight into page-locked host memory; ``verify`` waits for the checks and raises the
``ValueError`` of the first bad array. The arrays themselves are never copied to the host.

The checks run on a side stream of ours, forked from the caller's stream as each array is
ready, and a scoring call queues its kernel on the caller's stream right after them: the
forward kernel clamps every length to [0, L] and every document to [0, T), so bad values give
a wrong (and discarded) result, never a read outside the inputs. The checks and the scoring
kernel then run side by side, and the host waits for the checks alone while the scoring
kernel runs, instead of the kernel waiting behind them. The error is still raised before any
result is returned.

Inside CUDA graph capture no strict check runs: reading a result on the host is not allowed while a
stream is being captured, and a check of the values seen at capture would say nothing about
the values of later replays. The clamping above still keeps every read inside the inputs.
"""

from __future__ import annotations

import threading

import numpy as np

from .._base.env import validate_strict
from .._validate import check_id_values, check_length_values, check_offset_values
from .kernels import CHECKS
from .nvrtc import function_handle
from .raw_launch import launch_raw, signature

_MAX_CHECKS = 4  # q_lengths, d_lengths or d_offsets, candidate ids (and a spare)
_THREADS = 1024
_local = threading.local()


class _Side:
    """One thread's side stream and events on one device, made once (stream and event creation
    are driver calls costing more than a check)."""

    def __init__(self):
        import cupy

        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.fork = cupy.cuda.Event(disable_timing=True)
        self.done = cupy.cuda.Event(disable_timing=True)


def _pinned_slots():
    import cupy

    return np.frombuffer(cupy.cuda.alloc_pinned_memory(3 * _MAX_CHECKS * 8), np.int64)


class DeviceChecks:
    """The value checks of one call on the current CuPy device, forked from the current stream;
    a context manager (leaving it waits for any check still running)."""

    def __init__(self):
        self._pending: list[tuple[str, str, int]] = []  # (kind, argument name, limit or total)
        self._host = None  # this call's pinned slots, once a check is queued
        self._side = None
        self._shared = False  # whether the slots and side stream are the thread's own (released on wait)
        self._running = False  # checks queued and not waited for
        # The arrays the side stream reads, held until it is done: a temporary freed earlier could
        # be handed by the caching allocator to the caller's stream and overwritten meanwhile.
        self._reading: list = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        # The thread's pinned slots are reused by its next call: never while a check may still
        # write them (an error between queueing and verify()).
        if self._running:
            self._wait()

    def _slot(self):
        """The next check's pinned slots (as a device-visible address), the side stream forked
        from the caller's stream at each check (its array may have been written on the caller's
        stream since the last one: a length array converted there was read half-written)."""
        import cupy

        i = len(self._pending)
        if i >= _MAX_CHECKS:  # a kernel must never write past the buffer
            raise RuntimeError(f"DeviceChecks holds at most {_MAX_CHECKS} checks per call")
        if self._host is None:
            # One pinned buffer per thread and one side stream per (thread, device), reused: a
            # call waits for its checks before returning. A second DeviceChecks still running
            # on the same thread (not expected) gets its own.
            if not hasattr(_local, "host"):
                _local.host, _local.sides, _local.busy = _pinned_slots(), {}, False
            device = cupy.cuda.runtime.getDevice()
            if not _local.busy:
                side = _local.sides.get(device)
                if side is None:
                    side = _local.sides[device] = _Side()
                self._host, self._side, self._shared = _local.host, side, True
                _local.busy = True
            else:
                self._host, self._side = _pinned_slots(), _Side()
        self._side.fork.record(cupy.cuda.get_current_stream())
        self._side.stream.wait_event(self._side.fork)
        self._running = True
        # Page-locked memory is mapped at the same address on the device (unified addressing).
        return np.uint64(self._host.ctypes.data + 24 * i)

    def _launch(self, entry: str, args) -> None:
        import cupy

        from .nvrtc import get_function

        kern = get_function(CHECKS.file, entry, cupy.cuda.runtime.getDevice())
        with self._side.stream:
            kern((1,), (_THREADS,), args)

    def lengths(self, a, limit: int, name: str) -> None:
        """Queue the range check of lengths ``a`` (any integer dtype, C-contiguous, non-empty): [0, limit]."""
        import cupy

        if a.dtype not in (np.int32, np.int64):
            a = a.astype(cupy.int64)
        entry = "lik_check_range_i32" if a.dtype == np.int32 else "lik_check_range_i64"
        self._launch(entry, (a, np.int64(a.size), self._slot()))
        self._reading.append(a)
        self._pending.append(("lengths", name, limit))

    def ids(self, a, n: int, name: str, what: str) -> None:
        """Queue the range check of int32 or int64 ids ``a`` (C-contiguous, non-empty): [0, n)."""
        entry = "lik_check_range_i32" if a.dtype == np.int32 else "lik_check_range_i64"
        self._launch(entry, (a, np.int64(a.size), self._slot()))
        self._reading.append(a)
        self._pending.append(("ids", name, (n, what)))

    def offsets(self, off, total: int, name: str) -> None:
        """Queue the value check of int32 or int64 offsets ``off`` [N + 1]: start at 0, never
        decrease, end at ``total``."""
        entry = "lik_check_offsets_i32" if off.dtype == np.int32 else "lik_check_offsets_i64"
        self._launch(entry, (off, np.int64(off.size), self._slot()))
        self._reading.append(off)
        self._pending.append(("offsets", name, total))

    def _wait(self):
        """Wait for the queued checks; returns their results [checks, 3] (a copy) and frees the slots."""
        self._side.done.record(self._side.stream)
        self._side.done.synchronize()
        vals = self._host[:3 * len(self._pending)].reshape(-1, 3).copy()
        self._running = False
        self._reading.clear()
        if self._shared:
            _local.busy = False
        self._host = None
        return vals

    def scales(self, *args) -> None:
        """Document scales are checked by the scoring kernel's NaN contract only."""

    def apply(self, *args) -> None:
        """Nothing to queue after the scoring kernel (``verify`` raises instead)."""

    def verify(self) -> None:
        """Wait for the checks and raise the first failure."""
        if not self._running:
            return
        vals = self._wait()
        pending, self._pending = self._pending, []
        for (kind, name, bound), (a, b, c) in zip(pending, vals.tolist()):
            if kind == "lengths":
                check_length_values(name, a, b, bound)
            elif kind == "ids":
                check_id_values(name, a, b, *bound)
            else:
                check_offset_values(name, a, b, bool(c), bound)


def capturing() -> bool:
    """Whether the current CuPy stream is being captured into a CUDA graph."""
    import cupy

    return cupy.cuda.get_current_stream().is_capturing()


def queue_or_verify(checks, kind: str, *args) -> None:
    """Queue one check (``kind`` "lengths", "ids" or "offsets", with that method's arguments) on
    ``checks``, a :class:`DeviceChecks` (strict: skipped inside CUDA graph capture, see the module
    docstring) or :class:`Marks` (the NaN pass); with ``checks`` None, run a strict check on its
    own and verify it at once."""
    if checks is not None and not isinstance(checks, DeviceChecks):
        getattr(checks, kind)(*args)
        return
    if capturing():
        return
    own = DeviceChecks() if checks is None else None
    getattr(own or checks, kind)(*args)
    if own is not None:
        own.verify()


def strict(validate) -> bool:
    """Whether a call raises on invalid device values (strict mode) rather than marking NaN:
    ``validate`` True, or None with ``LIK_VALIDATE=1``."""
    return validate_strict() if validate is None else bool(validate)


class Checked:
    """A device array whose values the marking pass checks: its address, whether its entries are
    int64, and the bound of its values (a length's limit, or the packed token count)."""

    __slots__ = ("ptr", "wide", "bound")

    def __init__(self, ptr: int, wide: bool, bound: int):
        self.ptr, self.wide, self.bound = ptr, int(wide), bound

    @classmethod
    def of(cls, a, bound: int):
        """From a CuPy array (None gives None)."""
        return None if a is None else cls(a.data.ptr, a.dtype.itemsize == 8, bound)


_MARK_PARAMS = signature("ppqqiipiqpiqpiqppqpq")  # lik_nan_invalid's parameters
_MARK_THREADS = 256
_MARK_WARPS = _MARK_THREADS // 32  # one warp per document row


def mark_invalid(stream: int, device: int, scores: int, amax: int, nq: int, nd: int, lq: int, per_cell: bool, *,
                 q_len: Checked | None = None, d_len: Checked | None = None, d_off: Checked | None = None,
                 d_scale: int = 0, d_mask: int = 0, ld: int = 0, off_all: tuple[int, int] | None = None) -> None:
    """Queue on ``stream`` (a handle) the pass that makes the scores NaN (and their argmax rows -1)
    where ``q_len`` [nq], ``d_len`` ([nd], or [nq * nd] cells with ``per_cell``), ``d_off`` [nd + 1]
    or the float32 document scales ``d_scale`` (padded rows of ``ld`` tokens, kept by ``d_len`` or
    the uint8 ``d_mask``, or the tokens of ``d_off``) hold an invalid value.
    ``scores``, ``amax``: device addresses of [nq, nd] float32 and [nq, nd, lq] int32 (0: none).
    ``off_all``: (address, documents) of the whole offsets array ``d_off`` is a slice of (None: the
    same array), which must run from 0 to the token count."""
    rows = nq * nd if per_cell else nd
    if not rows or not nq or not (q_len or d_len or d_off or d_scale):
        return
    ql, dl, off = q_len or _NONE, d_len or _NONE, d_off or _NONE
    whole, nd_all = off_all or (off.ptr, nd)
    launch_raw(function_handle(CHECKS.file, "lik_nan_invalid", device), (min(-(-rows // _MARK_WARPS), 65535), 1, 1),
               _MARK_THREADS, 0, stream, _MARK_PARAMS,
               (scores, amax, nq, nd, lq, per_cell, ql.ptr, ql.wide, ql.bound, dl.ptr, dl.wide, dl.bound,
                off.ptr, off.wide, off.bound, d_scale, d_mask, ld, whole, nd_all))


_NONE = Checked(0, False, 0)


class Marks:
    """The device arrays of one call whose values the NaN pass checks (:func:`mark_invalid`),
    collected as :class:`DeviceChecks` collects its checks (the same methods), and queued by
    :meth:`apply` after the scoring kernel. A context manager, like DeviceChecks."""

    def __init__(self):
        self.q_len = self.d_len = self.d_off = None
        self.d_scale = self.d_mask = None
        self.off_all = None  # (address, documents) of the whole array d_off is a slice of
        self._keep: list = []  # the arrays, alive until the pass is queued

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._keep.clear()

    def lengths(self, a, limit: int, name: str) -> None:
        if a.dtype.itemsize not in (4, 8) or a.dtype.kind not in "iu":
            import cupy

            a = a.astype(cupy.int64)
        self._keep.append(a)
        c = Checked(a.data.ptr, a.dtype.itemsize == 8, limit)
        if name.startswith("q"):
            self.q_len = c
        else:
            self.d_len = c

    def offsets(self, off, total: int, name: str, whole=None) -> None:
        """``off`` [nd + 1], or a slice of the offsets ``whole`` (the documents of a chunk)."""
        self._keep += [off, whole]
        self.d_off = Checked.of(off, total)
        self.off_all = None if whole is None else (whole.data.ptr, whole.size - 1)

    def chunk(self) -> Marks:
        """A new Marks with this one's query lengths, for one chunk's documents."""
        m = Marks()
        m.q_len = self.q_len
        return m

    def scales(self, d_scale, d_mask=None) -> None:
        """float32 document scales (contiguous), with the uint8 mask that keeps their tokens."""
        self._keep += [d_scale, d_mask]
        self.d_scale, self.d_mask = d_scale, d_mask

    def apply(self, p, scores, amax, device: int) -> None:
        """Queue the NaN pass of problem ``p``'s CuPy ``scores`` [nq, nd] and ``amax`` on the current stream."""
        import cupy

        if self.q_len is None and self.d_len is None and self.d_off is None and self.d_scale is None:
            return
        mark_invalid(cupy.cuda.get_current_stream().ptr, device, scores.data.ptr,
                     amax.data.ptr if amax is not None else 0, p.nq, p.nd, p.lq, p.candidates,
                     q_len=self.q_len, d_len=self.d_len, d_off=self.d_off,
                     d_scale=self.d_scale.data.ptr if self.d_scale is not None else 0,
                     d_mask=self.d_mask.data.ptr if self.d_mask is not None else 0, ld=p.ld, off_all=self.off_all)

    def verify(self) -> None:
        """Nothing to wait for (the pass marks, it does not raise)."""


class _Unchecked:
    """validate=False: no check and no NaN pass."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def lengths(self, *args) -> None:
        pass

    offsets = ids = scales = lengths

    def apply(self, *args) -> None:
        pass

    def verify(self) -> None:
        pass


def call_checks(validate):
    """The checks of one scoring call: :class:`DeviceChecks` in strict mode (``validate`` True, or
    None with ``LIK_VALIDATE=1``), nothing with ``validate=False``, else :class:`Marks`."""
    if strict(validate):
        return DeviceChecks()
    return _Unchecked() if validate is False else Marks()
