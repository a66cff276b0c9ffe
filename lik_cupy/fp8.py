"""FP8 MaxSim: ``maxsim_fp8`` and ``maxsim_fp8_varlen``.

Queries and documents in FP8 e4m3 (``float8_e4m3fn``) with float32 scales, per token or per tensor
(:func:`lik_cupy.quantize_fp8`), scored on FP8 tensor cores: mma.sync on Ada (sm_89), wgmma on
Hopper (sm_90), whose mma.sync for FP8 is emulated, so that shapes its wgmma tiles do not take raise
a ValueError there (inputs not 16-byte aligned, d not a multiple of 128 up to 512, the argmax over
candidate ids or of short queries above d = 512); older GPUs raise a RuntimeError naming the GPU
(the CPU path runs anywhere). As INT8
(:mod:`lik_cupy.int8`, whose tiles these are): each dot product, accumulated in float32, is
multiplied by its document token's scale before the running max, and each query token's scale
multiplies the max, so no dequantised copy of D exists. A float Q is quantised per token on the fly.

How FP8 arrays are passed: natively where the framework has the type (``torch.float8_e4m3fn``,
NumPy arrays of ``ml_dtypes.float8_e4m3fn``, JAX's ``float8_e4m3fn``), or as uint8 arrays of their
bit patterns (CuPy, which has no float8 type; any framework). Both cross to the kernels as the same
bytes, without a copy.

The CPU path dequantises exactly: e4m3 values and their products are exact in float64, so its
similarities are the exact dot products rounded to float32, then scaled as the kernels do. The
GPU's tensor cores accumulate in float32 (Hopper's FP8 wgmma with fewer bits kept per addition), so
its scores differ from the CPU's by that rounding.
"""

from __future__ import annotations

from ._scaled import run, run_varlen

__all__ = ["maxsim_fp8", "maxsim_fp8_varlen"]

_FP8 = "float8_e4m3fn"


def maxsim_fp8(Q, D, d_scales, q_mask=None, d_mask=None, *, q_scales=None, q_lengths=None, d_lengths=None,
               return_argmax=False, backend="auto", validate=None):
    """MaxSim of queries against FP8 (e4m3) documents, on FP8 tensor cores.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]``: float16, bfloat16 or float32 (quantised per token on the
            fly), or float8_e4m3fn (or uint8 bit patterns) with ``q_scales``. A float64 Q is quantised
            on the CPU path only, as in :func:`lik_cupy.maxsim_int8`.
        D: float8_e4m3fn, or uint8 holding its bit patterns, ``[Nd, Ld, d]`` (shared by all queries
            -> ``[Nq, Nd]``), ``[Nq, K, Ld, d]`` (a candidate set per query -> ``[Nq, K]``) or
            ``[Ld, d]`` (-> ``[Nq]``), as made by :func:`lik_cupy.quantize_fp8`. On the GPU, d must be
            a multiple of 16, at most 8192 (on Hopper, up to 512 a multiple of 128).
        d_scales: float32 ``D.shape[:-1]`` (one per document token) or ``[]`` (one for all of D).
        q_mask, d_mask, q_lengths, d_lengths: valid tokens, as in :func:`lik_cupy.maxsim`.
        q_scales: float32 ``Q.shape[:-1]`` or ``[]``, for an FP8 Q; non-negative (a negative or NaN
            scale makes its query's scores NaN; an empty document still scores -inf).
        return_argmax: also return int32 ``scores.shape + (Lq,)``: the max over the document-scaled
            dot products, as in :func:`lik_cupy.maxsim_int8`.
        backend: "auto", "gpu" (sm_89 or newer) or "cpu".
        validate: device lengths and document scales, as in :func:`lik_cupy.maxsim_int8`.

    Returns:
        float32 scores (and the argmax) in the caller's framework and device, with the semantics of
        :func:`lik_cupy.maxsim` (-inf for an empty document, 0 for a query with no valid token, NaN
        where a token's value or scale is NaN).
    Example::

        >>> import numpy as np, lik_cupy
        >>> rng = np.random.default_rng(0)
        >>> Q, D = rng.standard_normal((2, 8, 64), np.float32), rng.standard_normal((5, 16, 64), np.float32)
        >>> D8, scales = lik_cupy.quantize_fp8(D, backend="cpu")
        >>> s = lik_cupy.maxsim_fp8(Q, D8, scales, backend="cpu")
        >>> exact = lik_cupy.maxsim(Q, D, backend="cpu")
        >>> bool(np.abs(s - exact).max() < 0.05 * np.abs(exact).max())
        True
    """
    return run(_FP8, Q, D, d_scales, q_mask, d_mask, q_scales, q_lengths, d_lengths,
               return_argmax, backend, validate)


def maxsim_fp8_varlen(Q, D_tokens, d_scales, d_offsets, q_mask=None, *, q_scales=None, q_lengths=None,
                      return_argmax=False, validate_offsets=True, backend="auto", validate=None):
    """:func:`maxsim_fp8` against packed (ragged) FP8 documents.

    Args:
        Q: padded ``[Nq, Lq, d]`` or ``[Lq, d]``, float or FP8 (with ``q_scales``), with ``q_mask`` /
            ``q_lengths`` as in :func:`lik_cupy.maxsim`.
        D_tokens: float8_e4m3fn (or uint8 bit patterns) ``[T, d]``, the documents' tokens back to back.
        d_scales: float32 ``[T]`` (each token's scale) or ``[]``.
        d_offsets: int32 or int64 ``[Nd + 1]`` as in :func:`lik_cupy.maxsim_varlen`.
        validate_offsets, return_argmax, backend, validate: as in :func:`lik_cupy.maxsim_int8_varlen`.

    Returns:
        float32 ``[Nq, Nd]`` (``[Nd]`` for a 2-D Q), and the int32 argmax ``[Nq, Nd, Lq]`` if asked,
        in the caller's framework and device.
    """
    return run_varlen(_FP8, Q, D_tokens, d_scales, d_offsets, q_mask, q_scales, q_lengths,
                      return_argmax, validate_offsets, backend, validate)
