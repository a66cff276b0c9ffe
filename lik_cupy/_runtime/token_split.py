"""Scratch memory of token-split forward launches (``dispatch.Launch.token_split``).

A packed document cut by the edge of a CTA's token share is scored in pieces by several CTAs.
Each piece leaves its row maxima here and adds one to the document's arrival count, and the CTA
whose arrival completes the count merges the pieces (``cuda_src/fwd/epilogue.cuh``,
``complete_pieces``).

The counts must read zero when a launch starts, and clearing them with a memset would cost a
launch per call. So the buffer holds two arrays of counts, and a launch of epoch ``e`` counts in
array ``e & 1`` while its CTAs zero the other one for the next launch. One buffer per (device,
stream), zeroed when made, serves every launch on that stream: launches on one stream run one
after another, and the epochs of a buffer are drawn and queued under its lock, so they
alternate in the order the launches run, whatever an earlier launch left (offsets that did not
add up included). A stream being captured into a CUDA graph gets no token split (each replay
would repeat the captured epoch); it scores whole documents, which gives the same bits.
"""

from __future__ import annotations

import threading

from .._dispatch.tables import SPLIT_MAX_CTAS as COUNTS  # counts per parity: one per CTA at most

_MAX_STREAMS = 64  # buffers kept; past that the least recently used is dropped
_buffers: dict = {}  # (device, stream handle) -> _Scratch
_lock = threading.Lock()


class _Scratch:
    def __init__(self, size: int, device: int, stream: int):
        import cupy

        from .._base.device import external_stream

        # Allocated and zeroed on the launch's stream, before the launch (CuPy's pool then hands
        # the memory out again only in that stream's order).
        with external_stream(stream, device):
            self.buf = cupy.zeros(size, cupy.uint8)
        self.epoch = 0
        self.lock = threading.Lock()


def nbytes(ctas: int, bm: int, argmax: bool, refined: bool = False) -> int:
    """Scratch bytes of a launch of ``ctas`` CTAs with ``bm``-row query tiles: two arrays of
    ``COUNTS`` uint32 counts (the layout ``cuda_src/fwd/tile_scheduler.cuh`` fixes as ``LIK_SPLIT_COUNTS``), then
    two slots of ``bm`` row maxima (and argmax indices, and for ``refined`` argmax tiles the maxima's
    residues) per CTA."""
    return 2 * 4 * COUNTS + ctas * 2 * bm * 4 * (1 + argmax + (argmax and refined))


def launch(device: int, stream: int, size: int, queue) -> None:
    """Queue a token-split launch: ``queue(split)``, with ``split`` the (address, epoch) of the
    scratch of stream ``stream`` (a handle) of at least ``size`` bytes on ``device``, under the
    buffer's lock."""
    key = (device, stream)
    entry = _buffers.get(key)
    if entry is None or entry.buf.nbytes < size:
        with _lock:
            if entry is None and len(_buffers) >= _MAX_STREAMS:
                _drop_oldest()
            # A smaller buffer it replaces goes back to CuPy's pool under this stream, which hands
            # it out again only in stream order.
            entry = _buffers[key] = _Scratch(max(size, 1 << 16), device, stream)
    else:  # most recently used last
        _buffers[key] = _buffers.pop(key, entry)
    with entry.lock:
        entry.epoch = (entry.epoch + 1) & 0xFFFFFFFF
        queue((entry.buf.data.ptr, entry.epoch))


def _drop_oldest() -> None:
    """Drop the least recently used buffer. A launch on its stream may still be running, and the
    pool would hand the memory to the current stream at once, so the device is synchronized
    first (only when more than _MAX_STREAMS streams have scored)."""
    import cupy

    key = next(iter(_buffers))
    with cupy.cuda.Device(key[0]):
        cupy.cuda.runtime.deviceSynchronize()
    # (the wait lets other threads run: one may be moving this key to the back, between its pop
    # and its re-insert, outside the lock)
    _buffers.pop(key, None)
