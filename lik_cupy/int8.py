"""INT8 MaxSim: ``maxsim_int8`` and ``maxsim_int8_varlen``.

Documents quantised per token (:func:`lik_cupy.quantize_int8`: int8 values and one
float32 scale per token) are scored on INT8 tensor cores. Each integer dot product
is multiplied by its document token's scale before the running max, and each query
token's scale multiplies the max (deferred dequantisation): no dequantised copy of
D exists, in HBM or in shared memory. A float Q is quantised on the device first, the
same way. The result equals MaxSim of the dequantised inputs up to float32 rounding.

Each call goes to ``lik_cupy._scaled`` (which FP8 shares): validate (``check_call`` / ``check_varlen``
with ``scaled="int8"``, then ``check_scaled_scales``) and score (the NumPy path with scales, or the
kernel ``dispatch`` picks, launched by ``lik_cupy._runtime.launch``).
"""

from __future__ import annotations

from ._scaled import run, run_varlen

__all__ = ["maxsim_int8", "maxsim_int8_varlen"]


def maxsim_int8(Q, D, d_scales, q_mask=None, d_mask=None, *, q_scales=None, q_lengths=None, d_lengths=None,
                return_argmax=False, backend="auto", validate=None):
    """MaxSim of queries against INT8 documents, on INT8 tensor cores.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]``: float16, bfloat16 or float32 (quantised per token
            on the fly), or int8 with ``q_scales``. A float64 Q is quantised on the CPU path only
            (``backend="auto"`` with host arrays, or ``"cpu"``; the GPU refuses it with a TypeError),
            in float32: a value beyond float32's range is inf there, so its query's scores are NaN.
        D: int8 ``[Nd, Ld, d]`` (shared by all queries -> ``[Nq, Nd]``), ``[Nq, K, Ld, d]``
            (a candidate set per query -> ``[Nq, K]``) or ``[Ld, d]`` (-> ``[Nq]``), as made by
            :func:`lik_cupy.quantize_int8`. On the GPU, d must be a multiple of 16, at most 4096.
        d_scales: float32 ``D.shape[:-1]``: each document token's scale (or ``[]``: one for all).
        q_mask, d_mask, q_lengths, d_lengths: valid tokens, as in :func:`lik_cupy.maxsim`.
        q_scales: float32 ``Q.shape[:-1]`` for an int8 Q. They multiply each row's max, so
            they must be non-negative (as ``quantize_int8`` makes them): a negative or NaN
            scale makes its query's scores NaN, except against an empty document, which scores -inf
            as always (checked in the kernel, with no host sync).
        return_argmax: also return int32 ``scores.shape + (Lq,)``, as in :func:`lik_cupy.maxsim`.
            The max is taken over the document-scaled dot products (float32); the query
            token's scale comes after it, so a zero-scale query token keeps the token of its
            largest unscaled product rather than token 0.
        backend: "auto", "gpu" or "cpu" (the same arithmetic in NumPy).
        validate: device lengths, offsets and document scales, as in :func:`lik_cupy.maxsim`: by
            default a negative, NaN or infinite device document scale of a valid token makes its
            document's scores NaN, with no host sync; ``True`` raises for invalid lengths and offsets
            instead. Host (NumPy) document scales are checked on the host and raise.

    Returns:
        float32 scores (and the argmax) in the caller's framework and device, with the
        semantics of :func:`lik_cupy.maxsim` (-inf for an empty document, 0 for a query with
        no valid token, NaN where a query token held NaN or inf).
    Example::

        >>> import numpy as np, lik_cupy
        >>> rng = np.random.default_rng(0)
        >>> Q, D = rng.standard_normal((2, 8, 64), np.float32), rng.standard_normal((5, 16, 64), np.float32)
        >>> D8, scales = lik_cupy.quantize_int8(D, backend="cpu")
        >>> s = lik_cupy.maxsim_int8(Q, D8, scales, backend="cpu")
        >>> exact = lik_cupy.maxsim(Q, D, backend="cpu")
        >>> bool(np.abs(s - exact).max() < 0.05 * np.abs(exact).max())
        True
    """
    return run("int8", Q, D, d_scales, q_mask, d_mask, q_scales, q_lengths, d_lengths, return_argmax, backend,
               validate)


def maxsim_int8_varlen(Q, D_tokens, d_scales, d_offsets, q_mask=None, *, q_scales=None, q_lengths=None,
                       return_argmax=False, validate_offsets=True, backend="auto", validate=None):
    """:func:`maxsim_int8` against packed (ragged) INT8 documents.

    Args:
        Q: padded ``[Nq, Lq, d]`` or ``[Lq, d]``, float or int8 (with ``q_scales``), with
            ``q_mask`` / ``q_lengths`` as in :func:`lik_cupy.maxsim`.
        D_tokens: int8 ``[T, d]``, the documents' tokens back to back.
        d_scales: float32 ``[T]``, each token's scale.
        d_offsets: int32 or int64 ``[Nd + 1]`` as in :func:`lik_cupy.maxsim_varlen`.
        validate_offsets, return_argmax, backend, validate: as in :func:`lik_cupy.maxsim_varlen`
            (document scales as in :func:`maxsim_int8`).

    Returns:
        float32 ``[Nq, Nd]`` (``[Nd]`` for a 2-D Q), and the int32 argmax ``[Nq, Nd, Lq]``
        if asked, in the caller's framework and device.
    """
    return run_varlen("int8", Q, D_tokens, d_scales, d_offsets, q_mask, q_scales, q_lengths, return_argmax,
                      validate_offsets, backend, validate)
