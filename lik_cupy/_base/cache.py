"""The one memoising cache of the runtime: a value per (device, key), built once.

Every per-device lookup on a call's path (loaded modules, kernel handles, small kernels, torch
streams seen through CuPy) is one of these. A hit is one dict read, with no lock; a miss builds
the value under a lock of its own key, so concurrent callers of one key build it once while other
keys build side by side, and a build that raises leaves nothing behind. The cache holds at most
``maxsize`` values; past that the oldest goes, or with ``lru`` the least recently used (a hit
then also takes the cache's lock to record the use).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

__all__ = ["DeviceCache"]


class DeviceCache:
    def __init__(self, maxsize: int, *, lru: bool = False):
        self.maxsize, self.lru = maxsize, lru
        self._values: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict = {}  # key -> the lock its builders hold; empty when none is building

    def lookup(self, device: int, key: Hashable):
        """The value of ``(device, key)`` if it is built, else None: the hot path's one dict read."""
        return self._values.get((device, key))

    def get(self, device: int, key: Hashable, build: Callable[[], object]):
        """The value of ``(device, key)``, from ``build()`` the first time."""
        k = (device, key)
        value = self._values.get(k)
        if value is not None:
            if self.lru:
                with self._lock:
                    if k in self._values:
                        self._values.move_to_end(k)
            return value
        with self._lock:
            lock = self._building.setdefault(k, threading.Lock())
        try:
            with lock:  # callers of one key wait for its single build; other keys go on in parallel
                value = self._values.get(k)
                if value is None:
                    value = build()
                    with self._lock:
                        self._values[k] = value
                        while len(self._values) > self.maxsize:
                            self._values.popitem(last=False)
                return value
        finally:
            with self._lock:
                if self._building.get(k) is lock and not lock.locked():
                    del self._building[k]

    def values(self):
        return list(self._values.values())

    def building(self) -> int:
        """Keys being built now (0 once every build has ended)."""
        return len(self._building)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()

    def __len__(self) -> int:
        return len(self._values)
