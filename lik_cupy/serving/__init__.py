"""Serving MaxSim to concurrent callers: :class:`Batcher` coalesces their requests into multi-query
calls on resident corpus replicas (``batcher.py``); ``lik_cupy.serving.http`` puts it behind the Open
Inference Protocol (the ``[serve]`` extra; ``lik serve``). This package imports NumPy only."""

from .batcher import OPERATIONS, Batcher, Observer
from .errors import DeadlineExceeded, Overloaded, ShuttingDown

__all__ = ["Batcher", "Observer", "OPERATIONS", "Overloaded", "DeadlineExceeded", "ShuttingDown"]
