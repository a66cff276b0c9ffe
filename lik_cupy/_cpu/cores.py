"""Every core for one block: its chunks go to as many threads as NumPy's BLAS has, each thread
running its chunks' GEMMs single-threaded and every pass after them.

With BLAS's own threads only the GEMM uses every core; the passes after it (norm bounds, argmax,
second max, the winners' dot products) are NumPy's, on one core, and cost about as much again as a
GEMM of a few query rows. A thread per core running whole chunks keeps every core busy. BLAS's
thread count is set to one meanwhile: a threaded GEMM beside the chunk threads asks for more
cores than there are, and OpenBLAS's threads, waiting for each other, then lose many times the
GEMM's time, the more so on a busy machine. The count is process-wide (OpenBLAS has no per-thread
one): while any call runs its chunks, every BLAS call of the process runs on one core; the last
such call to end restores the count it found. Nothing computed depends on it.

Only NumPy's own OpenBLAS built with pthreads is controlled (found among the process's libraries
by the symbols, version and integer size NumPy's build names). With another BLAS, or one thread,
chunks run one after another on the calling thread and BLAS keeps its threads.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

__all__ = ["chunk_threads", "run_chunks"]

_lock = threading.Lock()
_users = 0  # calls running chunks now
_found = 0  # BLAS's thread count when the first of them began
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


class _OpenBLAS:
    def __init__(self, lib, prefix: str, suffix: str):
        self.get = getattr(lib, f"{prefix}get_num_threads{suffix}")
        self.set = getattr(lib, f"{prefix}set_num_threads{suffix}")
        self.get.restype = ctypes.c_int
        self.get.argtypes = []
        self.set.restype = None
        self.set.argtypes = [ctypes.c_int]


def _libraries() -> list[str]:
    """Paths of the OpenBLAS libraries this process has loaded (Linux), and those NumPy's wheel bundles."""
    paths = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and "openblas" in os.path.basename(parts[5]).lower():
                    paths.add(parts[5].strip())
    except OSError:
        pass
    root = os.path.dirname(np.__file__)
    for pattern in (root + ".libs/*openblas*", os.path.join(root, ".dylibs", "*openblas*")):
        paths.update(glob.glob(pattern))
    return sorted(paths)


@functools.cache
def _numpy_openblas() -> _OpenBLAS | None:
    """NumPy's OpenBLAS, where it is one built with pthreads; None otherwise."""
    try:
        blas = np.__config__.CONFIG["Build Dependencies"]["blas"]
        name, config, version = (str(blas.get(k, "")) for k in ("name", "openblas configuration", "version"))
    except (AttributeError, KeyError, TypeError):
        return None
    if "openblas" not in name or not version:
        return None
    prefix = "scipy_openblas_" if name.startswith("scipy") else "openblas_"
    suffix = "64_" if "USE64BITINT" in config else ""
    for path in _libraries():
        try:
            lib = ctypes.CDLL(path)
            get_config = getattr(lib, f"{prefix}get_config{suffix}")
            get_parallel = getattr(lib, f"{prefix}get_parallel{suffix}")
            blas_lib = _OpenBLAS(lib, prefix, suffix)
        except (OSError, AttributeError):
            continue
        get_config.restype = ctypes.c_char_p
        get_parallel.restype = ctypes.c_int
        if (get_config() or b"").decode(errors="replace").split()[1:2] == [version] and get_parallel() == 1:
            return blas_lib
    return None


def chunk_threads() -> int:
    """Threads a block's chunks may use: NumPy's BLAS threads (as the caller set them, or the
    environment) where their count can be set to one meanwhile; otherwise 1."""
    blas = _numpy_openblas()
    if blas is None:
        return 1
    with _lock:
        n = _found if _users else blas.get()
    try:
        n = min(n, len(os.sched_getaffinity(0)))
    except AttributeError:  # (no affinity masks on this platform)
        n = min(n, os.cpu_count() or 1)
    return max(1, n)


@contextmanager
def _single_threaded_blas():
    global _users, _found
    blas = _numpy_openblas()
    if blas is None:
        yield
        return
    with _lock:
        if not _users:
            _found = blas.get()
            blas.set(1)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if not _users:
                blas.set(_found)


def _after_fork_in_child() -> None:
    """A child forked during a call has neither that call nor the pool's threads: start afresh, with
    the BLAS thread count the call found."""
    global _lock, _users, _pool, _pool_size
    _lock = threading.Lock()
    _pool, _pool_size = None, 0
    if _users:
        _users = 0
        blas = _numpy_openblas()
        if blas is not None:
            blas.set(_found)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Claims:
    """A shared iterator that several threads take items from, until it is closed."""

    def __init__(self, items):
        self._items = iter(items)
        self._lock = threading.Lock()

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            return next(self._items)

    def close(self) -> None:
        with self._lock:
            self._items = iter(())


def run_chunks(items, work, threads: int, *, blas_threads: bool = True) -> None:
    """``work(k, claims)`` on ``threads`` threads at once (``k`` = 0 .. threads - 1; the calling
    thread is 0), each taking items from the shared iterator ``claims`` until none is left, with
    BLAS single-threaded meanwhile; returns when all have, re-raising the first exception. With
    one thread, ``work(0, iter(items))`` on the calling thread, BLAS keeping its threads if
    ``blas_threads``, else single-threaded too: for GEMMs too small to share between cores, whose
    hand-over between BLAS's threads costs more than they save (many times more on a busy
    machine, where a descheduled thread keeps the others waiting)."""
    if threads <= 1:
        if blas_threads:
            work(0, iter(items))
            return
        with _single_threaded_blas():
            work(0, iter(items))
        return
    global _pool, _pool_size
    claims = _Claims(items)
    # The pool's threads reach ``work`` (and through it the caller's block) only through ``shared``,
    # emptied when the call ends: a pool thread holds its work item for a moment after the future
    # completes, and a cancelled one stays queued, which on a busy machine kept a finished block
    # alive beside the next one.
    shared = [work, claims]

    def helper(k: int) -> None:
        shared[0](k, shared[1])

    with _single_threaded_blas():
        # The pool taken and given the helpers under the lock: a call that replaces it (shut down, so
        # refusing new work) does so before or after, never between.
        with _lock:
            if _pool_size < threads - 1:
                if _pool is not None:
                    _pool.shutdown(wait=False)  # (its running and queued work finishes)
                _pool, _pool_size = ThreadPoolExecutor(threads - 1, thread_name_prefix="lik_cupy-cpu"), threads - 1
            futures = [_pool.submit(helper, k) for k in range(1, threads)]
        try:
            work(0, claims)
        finally:
            # the calling thread took every item it could (or failed): a helper not started yet has
            # nothing left to do
            claims.close()
            for f in futures:
                f.cancel()
            errors = [f.exception() for f in futures if not f.cancelled()]
            shared.clear()
    for e in errors:
        if e is not None:
            raise e
