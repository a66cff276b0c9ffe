"""Value checks of device lengths and offsets (shapes and dtypes are checked in validate.py).

Each check is one single-block kernel (``cuda_src/checks.cu``) that writes three int64 slots
straight into page-locked host memory; ``verify`` waits for the checks and raises the
``ValueError`` of the first bad array. The arrays themselves are never copied to the host.

The checks run on a side stream of ours, forked from the caller's stream once the arrays are
ready, and a scoring call queues its kernel on the caller's stream right after them: the
forward kernel clamps every length to [0, L] and every document to [0, T), so bad values give
a wrong (and discarded) result, never a read outside the inputs. The checks and the scoring
kernel then run side by side, and the host waits for the checks alone while the scoring
kernel runs, instead of the kernel waiting behind them. The error is still raised before any
result is returned.

Inside CUDA graph capture no check runs: reading a result on the host is not allowed while a
stream is being captured, and a check of the values seen at capture would say nothing about
the values of later replays. The clamping above still keeps every read inside the inputs.
"""

from __future__ import annotations

import threading

import numpy as np

from .._validate import check_id_values, check_length_values, check_offset_values

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
        from the caller's stream at the call's first check."""
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

        kern = get_function("checks.cu", entry, cupy.cuda.runtime.getDevice())
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


def queue_or_verify(checks: DeviceChecks | None, kind: str, *args) -> None:
    """Queue one check (``kind`` "lengths", "ids" or "offsets", with that method's arguments) on
    ``checks``; with ``checks`` None, run it on its own and verify it at once. Skipped inside
    CUDA graph capture (see the module docstring)."""
    if capturing():
        return
    own = DeviceChecks() if checks is None else None
    getattr(own or checks, kind)(*args)
    if own is not None:
        own.verify()
