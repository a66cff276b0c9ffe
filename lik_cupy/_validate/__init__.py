"""Host-side argument checks: every shape, dtype, framework and device rule of the public
functions, each raising an error that names the argument and what was expected, before any data
moves or any kernel runs. (Values that live on the GPU are checked there:
``lik_cupy._runtime.device_checks``.)"""

from .arguments import (Problem, check_32bit, check_flag, check_argmax_values, check_backward, check_call, check_docs,
                        check_scaled_scales, check_length_values, check_offset_values, check_quantized, check_scales,
                        check_timeout, check_valid, check_varlen, check_zero_pad, host_ints, offsets_count,
                        scale_error)
from .hidden import HiddenProblem, check_hidden, check_hidden_backward, check_hidden_options
from .residual import NBITS, ResidualProblem, check_decompress, check_id_values, check_index_rerank, check_residual

__all__ = ["Problem", "check_32bit", "check_flag", "check_argmax_values", "check_backward", "check_call", "check_docs",
           "check_scaled_scales", "check_length_values", "check_offset_values", "check_quantized", "check_scales",
           "check_timeout", "check_valid", "check_varlen", "check_zero_pad", "host_ints", "offsets_count",
           "scale_error", "NBITS", "ResidualProblem", "check_decompress", "check_id_values", "check_index_rerank",
           "check_residual", "HiddenProblem", "check_hidden", "check_hidden_backward", "check_hidden_options"]
