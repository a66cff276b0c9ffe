"""What a :class:`lik_cupy.serving.Batcher` answers instead of a result (beside ``ValueError`` /
``TypeError`` for a bad request, raised at once, before it is queued).

Each survives pickling with its message."""

from __future__ import annotations

__all__ = ["Overloaded", "DeadlineExceeded", "ShuttingDown"]


class Overloaded(RuntimeError):
    """Every device's queue is full: the request was not queued. Retry later (the server answers 503
    with ``Retry-After``)."""


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed while it waited in the queue: it was never scored."""


class ShuttingDown(RuntimeError):
    """The batcher is closing: it takes no new requests (those already queued are still answered)."""
