"""The NumPy path: exact MaxSim, its gradients and the INT8 quantiser on the CPU, with the same
semantics as the GPU kernels."""

from .maxsim import maxsim_backward_numpy, maxsim_numpy, maxsim_packed_numpy, unpack
from .quantize import quantize_numpy

__all__ = ["maxsim_numpy", "maxsim_packed_numpy", "maxsim_backward_numpy", "unpack", "quantize_numpy"]
