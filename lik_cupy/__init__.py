"""lik-cupy: exact late-interaction (MaxSim) scoring with raw-CUDA kernels.

``maxsim``, ``maxsim_pairs``, ``maxsim_varlen`` (packed ragged documents),
``maxsim_int8`` / ``maxsim_int8_varlen`` (documents stored as INT8 by ``quantize_int8``),
``maxsim_fp8`` / ``maxsim_fp8_varlen`` (FP8 e4m3 by ``quantize_fp8``),
``maxsim_residual`` / ``maxsim_residual_varlen`` (PLAID-compressed documents, as fast-plaid and
ColBERTv2 store them; ``PlaidIndex`` reads their index directories) and
``retrieve`` (streaming top-k over a corpus of any size; ``pin_host`` page-locks a host corpus
so it streams without a staging copy) and ``Corpus`` (a corpus checked once and kept resident
for a search service: score, search, rerank by candidate ids in place) take NumPy, CuPy, PyTorch, JAX or any DLPack
arrays and return results in the caller's framework; ``maxsim_backward`` turns the forward's
argmax into exact gradients (autograd adapters: ``lik_cupy.torch``, ``lik_cupy.jax``). Importing this package
imports neither torch nor jax (nor CuPy, until a call looks for a GPU: ``backend="cpu"`` never does). Scale-out over a Dask cluster:
``lik_cupy.distributed`` (the ``[distributed]`` extra; this package never imports Dask). Serving
concurrent requests in batches: ``lik_cupy.serving`` (``lik serve``, the ``[serve]`` extra).

>>> import numpy as np, lik_cupy
>>> Q = np.ones((1, 2, 4), np.float32)
>>> D = np.ones((3, 5, 4), np.float32)
>>> lik_cupy.maxsim(Q, D, backend="cpu")
array([[8., 8., 8.]], dtype=float32)
"""

import importlib

from ._version import __version__
from .errors import CompileError, DeviceMemoryError, LikError, ShardError

__all__ = ["maxsim", "maxsim_pairs", "maxsim_varlen", "maxsim_int8", "maxsim_int8_varlen", "maxsim_fp8",
           "maxsim_fp8_varlen", "maxsim_residual", "maxsim_residual_varlen", "PlaidIndex", "quantize_int8",
           "dequantize_int8", "quantize_fp8", "dequantize_fp8", "maxsim_backward", "maxsim_from_hidden",
           "maxsim_from_hidden_backward", "retrieve",
           "Corpus", "pin_host", "PinnedHost", "warmup", "gpu_available", "set_precision", "get_precision", "CompileError",
           "DeviceMemoryError", "ShardError", "LikError", "__version__"]

# Public name -> the module defining it, imported on first use (PEP 562): `import lik_cupy`, and so
# the `lik` command's start, pays only for the modules a program touches (`lik info` needs none
# of the scoring code). No public module shares its name with a public function (`retrieve` lives
# in `retrieval`), so importing a module never rebinds a name of this package.
_HOMES = {
    "maxsim": ".forward", "maxsim_pairs": ".forward", "maxsim_varlen": ".forward",
    "maxsim_int8": ".int8", "maxsim_int8_varlen": ".int8",
    "maxsim_fp8": ".fp8", "maxsim_fp8_varlen": ".fp8",
    "maxsim_residual": ".plaid", "maxsim_residual_varlen": ".plaid", "PlaidIndex": ".plaid",
    "quantize_int8": ".quantize", "dequantize_int8": ".quantize", "quantize_fp8": ".quantize",
    "dequantize_fp8": ".quantize",
    "maxsim_backward": ".backward",
    "maxsim_from_hidden": ".fused_head", "maxsim_from_hidden_backward": ".fused_head",
    "retrieve": ".retrieval",
    "Corpus": ".corpus",
    "pin_host": "._runtime.pinned", "PinnedHost": "._runtime.pinned",
    "warmup": "._runtime.warmup",
    "gpu_available": "._base.device",
    "set_precision": ".precision", "get_precision": ".precision",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))

