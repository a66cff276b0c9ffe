"""Every exception lik-cupy raises of its own (beside Python's ``ValueError`` / ``TypeError`` for
bad arguments, which name the argument and what was expected).

Each survives pickling with its fields (``__reduce__``): errors raised in Dask workers
(``lik_cupy.distributed``) or other processes reach the caller as the same exception."""

from __future__ import annotations

__all__ = ["CompileError", "DeviceMemoryError", "ShardError", "LikError"]


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries the compiler log."""


class DeviceMemoryError(MemoryError):
    """A GPU buffer did not fit. The message names the buffer, its size, the memory left and
    what to do; ``buffer``, ``nbytes`` and ``device`` carry the same for programs."""

    def __init__(self, message: str, buffer: str, nbytes: int, device: int):
        super().__init__(message)
        self.buffer, self.nbytes, self.device = buffer, nbytes, device

    def __reduce__(self):
        return type(self), (str(self), self.buffer, self.nbytes, self.device)


class ShardError(ValueError):
    """A file or shard is missing, corrupt or inconsistent: any input file the package reads (a
    shard, a ``.npy`` or JSON input, a PLAID index's ``.npy``, ``.pt`` and JSON files).

    ``path`` names the file at fault and ``problem`` says what is wrong and what was
    expected; ``str(err)`` is ``"<path>: <problem>"``.
    """

    def __init__(self, path: object, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem

    def __reduce__(self):  # pickle rebuilds an exception from its args, here one string: pass both parts
        return type(self), (self.path, self.problem)


class LikError(Exception):
    """Bad input or environment for the ``lik`` command: reported as
    ``lik: error: <what>: <problem>``, exit 2."""

    def __init__(self, what: object, problem: str):
        super().__init__(f"{what}: {problem}")
        self.what = str(what)
        self.problem = problem

    def __reduce__(self):
        return type(self), (self.what, self.problem)
