"""The NumPy path: MaxSim at BLAS speed with the exact float64 argmax, its gradients and the
quantisers (INT8, FP8) on the CPU, with the same semantics as the GPU kernels (``maxsim.py`` says what the
scores promise)."""

from .backward import maxsim_backward_numpy
from .maxsim import (BLOCK_BYTES, QUERY_CHUNK, gathered_rows, maxsim_numpy, maxsim_packed_numpy, packed_rows,
                     query_groups, unpack)
from .quantize import quantize_fp8_numpy, quantize_numpy

__all__ = ["maxsim_numpy", "maxsim_packed_numpy", "maxsim_backward_numpy", "unpack", "packed_rows", "gathered_rows",
           "query_groups", "quantize_numpy", "quantize_fp8_numpy", "BLOCK_BYTES", "QUERY_CHUNK"]
