"""lik-cupy: exact late-interaction (MaxSim) scoring with raw-CUDA kernels.

``maxsim``, ``maxsim_pairs``, ``maxsim_varlen`` (packed ragged documents),
``maxsim_int8`` / ``maxsim_int8_varlen`` (documents stored as INT8 by ``quantize_int8``) and
``retrieve`` (streaming top-k over a corpus of any size; ``pin_host`` page-locks a host corpus
so it streams without a staging copy) take NumPy, CuPy, PyTorch, JAX or any DLPack
arrays and return results in the caller's framework; ``maxsim_backward`` turns the forward's
argmax into exact gradients (autograd adapters: ``lik_cupy.torch``, ``lik_cupy.jax``). Importing this package
imports neither torch nor jax (nor CuPy, until a GPU path runs).

>>> import numpy as np, lik_cupy
>>> Q = np.ones((1, 2, 4), np.float32)
>>> D = np.ones((3, 5, 4), np.float32)
>>> lik_cupy.maxsim(Q, D, backend="cpu")
array([[8., 8., 8.]], dtype=float32)
"""

__version__ = "0.1.0"

from . import _moved  # noqa: E402
from ._runtime.device import gpu_available  # noqa: E402
from ._runtime.pinned import PinnedHost, pin_host  # noqa: E402
from ._runtime.warmup import warmup  # noqa: E402
from .backward import maxsim_backward  # noqa: E402
from .errors import CompileError, DeviceMemoryError, LikError, ShardError  # noqa: E402
from .forward import maxsim, maxsim_pairs, maxsim_varlen  # noqa: E402
from .int8 import maxsim_int8, maxsim_int8_varlen  # noqa: E402
from .quantize import dequantize_int8, quantize_int8  # noqa: E402
from .retrieve import retrieve  # noqa: E402

__all__ = ["maxsim", "maxsim_pairs", "maxsim_varlen", "maxsim_int8", "maxsim_int8_varlen", "quantize_int8",
           "dequantize_int8", "maxsim_backward", "retrieve", "pin_host", "PinnedHost", "warmup", "gpu_available",
           "CompileError", "DeviceMemoryError", "ShardError", "LikError", "__version__"]

_moved.install()


def __getattr__(name: str):
    return _moved.attribute(name)
