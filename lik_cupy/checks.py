"""Value checks of device lengths and offsets (shapes and dtypes are checked in validate.py).

Each check is one single-block kernel (``cuda_src/checks.cu``) writing three int64 slots of a
buffer shared by the call's checks; ``send`` queues one copy of them into pinned host memory
and ``verify`` waits for that copy alone and raises the ``ValueError`` of the first bad array.
The arrays themselves are never copied to the host.

A scoring call queues its kernel between ``send`` and ``verify``: the forward kernel clamps
every length to [0, L] and every document to [0, T), so bad values give a wrong (and
discarded) result, never a read outside the inputs. The host then waits for the checks while
the scoring kernel is already queued behind them, instead of the GPU waiting for the host.
The error is still raised before any result is returned.

Inside CUDA graph capture no check runs: reading a result on the host is not allowed while a
stream is being captured, and a check of the values seen at capture would say nothing about
the values of later replays. The clamping above still keeps every read inside the inputs.
"""

from __future__ import annotations

import threading

import numpy as np

from .validate import check_length_values, check_offset_values

_MAX_CHECKS = 4  # q_lengths, d_lengths, d_offsets (and a spare)
_THREADS = 1024
_local = threading.local()


class DeviceChecks:
    """The value checks of one call on the current CuPy device and stream; a context manager
    (leaving it waits for a copy ``send`` queued and ``verify`` did not consume)."""

    def __init__(self):
        self._res = None
        self._pending: list[tuple[str, str, int]] = []  # (kind, argument name, limit or total)
        self._sent = None  # (pinned host slots, event, shared buffer) once send() ran

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        # The thread's pinned buffer is reused by its next call: never while a copy into it is
        # pending (an error between send() and verify()).
        if self._sent is not None:
            self._wait()

    def _slot(self):
        import cupy

        if self._res is None:
            self._res = cupy.empty(3 * _MAX_CHECKS, cupy.int64)
        i = len(self._pending)
        if i >= _MAX_CHECKS:  # a kernel must never write past the buffer
            raise RuntimeError(f"DeviceChecks holds at most {_MAX_CHECKS} checks per call")
        return self._res[3 * i:3 * i + 3]

    def _kernel(self, name: str):
        import cupy

        from .compile import get_function

        return get_function("checks.cu", name, cupy.cuda.runtime.getDevice())

    def lengths(self, a, limit: int, name: str) -> None:
        """Queue the range check of lengths ``a`` (any integer dtype, C-contiguous, non-empty): [0, limit]."""
        import cupy

        if a.dtype not in (np.int32, np.int64):
            a = a.astype(cupy.int64)
        entry = "lik_check_range_i32" if a.dtype == np.int32 else "lik_check_range_i64"
        self._kernel(entry)((1,), (_THREADS,), (a, np.int64(a.size), self._slot()))
        self._pending.append(("lengths", name, limit))

    def offsets(self, off, total: int, name: str) -> None:
        """Queue the value check of int64 offsets ``off`` [N + 1]: start at 0, never decrease, end at ``total``."""
        self._kernel("lik_check_offsets")((1,), (_THREADS,), (off, np.int64(off.size), self._slot()))
        self._pending.append(("offsets", name, total))

    def send(self) -> None:
        """Queue the copy of the check results to the host (call before queueing the kernel
        that the checks guard, so that ``verify`` does not wait for that kernel too)."""
        import cupy

        if not self._pending or self._sent is not None:
            return
        # One pinned buffer per thread and one event per (thread, device), reused: a call's copy
        # is waited for before the call returns (verify, or __exit__), and pinned allocations
        # and event creation are driver calls costing more than the check. A second DeviceChecks
        # awaiting its copy on the same thread (not expected) gets its own.
        if not hasattr(_local, "host"):
            _local.host = np.frombuffer(cupy.cuda.alloc_pinned_memory(3 * _MAX_CHECKS * 8), np.int64)
            _local.events, _local.busy = {}, False
        shared = not _local.busy
        if shared:
            device = cupy.cuda.runtime.getDevice()
            host, event = _local.host, _local.events.get(device)
            if event is None:
                event = _local.events[device] = cupy.cuda.Event(disable_timing=True)
            _local.busy = True
        else:
            host = np.frombuffer(cupy.cuda.alloc_pinned_memory(3 * _MAX_CHECKS * 8), np.int64)
            event = cupy.cuda.Event(disable_timing=True)
        n = 3 * len(self._pending)
        stream = cupy.cuda.get_current_stream()
        self._res.data.copy_to_host_async(host.ctypes.data, n * 8, stream)
        event.record(stream)
        self._sent = (host[:n], event, shared)

    def _wait(self):
        """Wait for the sent copy; returns the results [checks, 3] (a copy) and frees the buffer."""
        host, event, shared = self._sent
        event.synchronize()
        vals = host.reshape(-1, 3).copy()
        self._sent = None
        if shared:
            _local.busy = False
        return vals

    def verify(self) -> None:
        """Wait for the checks' results (sent now if ``send`` was not called) and raise the first failure."""
        if not self._pending:
            return
        self.send()
        vals = self._wait()
        pending, self._pending = self._pending, []
        for (kind, name, bound), (a, b, c) in zip(pending, vals.tolist()):
            if kind == "lengths":
                check_length_values(name, a, b, bound)
            else:
                check_offset_values(name, a, b, bool(c), bound)


def capturing() -> bool:
    """Whether the current CuPy stream is being captured into a CUDA graph."""
    import cupy

    return cupy.cuda.get_current_stream().is_capturing()


def queue_or_verify(checks: DeviceChecks | None, kind: str, *args) -> None:
    """Queue one check (``kind`` "lengths" or "offsets", with that method's arguments) on
    ``checks``; with ``checks`` None, run it on its own and verify it at once. Skipped inside
    CUDA graph capture (see the module docstring)."""
    if capturing():
        return
    own = DeviceChecks() if checks is None else None
    getattr(own or checks, kind)(*args)
    if own is not None:
        own.verify()
