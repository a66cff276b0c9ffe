"""MaxSim forward: ``maxsim``, ``maxsim_pairs`` and ``maxsim_varlen``.

The signatures and docstrings users read; each call runs in ``lik_cupy._maxsim_calls`` (validate,
choose GPU or CPU, launch or the NumPy path).
"""

from __future__ import annotations

from ._maxsim_calls import run as _run
from ._maxsim_calls import run_varlen as _run_varlen
from ._validate import check_flag

__all__ = ["maxsim", "maxsim_pairs", "maxsim_varlen"]


def maxsim(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, return_argmax=False, backend="auto",
           precision=None, validate=None):
    """Late-interaction score ``sum_s max_t <Q[i, s], D[j, t]>`` without the ``[Nq, Nd, Lq, Ld]`` tensor.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` query token embeddings.
        D: ``[Nd, Ld, d]`` documents scored against every query -> scores ``[Nq, Nd]``;
            ``[Nq, K, Ld, d]`` a candidate set per query (reranking) -> ``[Nq, K]``;
            ``[Ld, d]`` one document -> ``[Nq]``. A 2-D ``Q`` drops the leading axis.
            Q and D share a dtype: float16, bfloat16, float32 (float32 accuracy on the GPU
            unless ``precision="tf32"``) or float64 (float64 on the CPU; on the GPU rounded
            to float32 and scored as float32, with float64 scores), and a framework: NumPy,
            CuPy, PyTorch (CUDA or CPU), JAX, or any DLPack producer.
        q_mask: bool ``Q.shape[:-1]``, True = valid token. Masked query tokens add nothing.
        d_mask: bool ``D.shape[:-1]``. Masked document tokens never win the max.
        q_lengths: int ``Q.shape[:-2]``: the first ``q_lengths[i]`` tokens are valid (instead of q_mask).
        d_lengths: int ``D.shape[:-2]``: likewise for documents (instead of d_mask).
        return_argmax: also return int32 ``scores.shape + (Lq,)``: the winning document
            token per query token (lowest index on ties), -1 for masked query tokens and
            empty documents.
        backend: "auto" (GPU for device arrays, and for host arrays when a GPU is
            present; float64 host arrays: the CPU), "gpu", or "cpu" (the NumPy path: BLAS
            float32 similarities, float64 for float64 inputs, with the argmax of the float64
            similarities exactly and each score the sum of its winners' float64 similarities;
            see ``lik_cupy._cpu.maxsim``).
        precision: float32 inputs on the GPU: "fp32" (float32 accuracy, 3xTF32) or "tf32"
            (one TF32 product, ~1e-3 relative error, faster); None follows the process
            default and then the caller's framework (``lik_cupy.precision``).
        validate: device-resident lengths. None (default): an invalid value (negative, or past
            ``Lq`` / ``Ld``) makes exactly the scores it touches NaN (their argmax rows -1),
            checked on the device with no host synchronisation; True (or ``LIK_VALIDATE=1``):
            strict, the call waits for the check and raises a ValueError; False: no check (an
            invalid value gives wrong scores, never a read out of bounds). Host-resident
            lengths (lists, NumPy, CPU tensors) are checked on the host and raise: on the GPU
            path unless False, on the CPU path always (NumPy reads them as indices).

    Returns:
        float32 scores (float64 for float64 inputs) and the argmax, in the caller's framework,
        on the caller's device. A document with no valid token scores -inf; a query with no valid
        token scores 0 (also against an empty document); a NaN in any unmasked
        similarity makes that score NaN. Device work runs on the caller's current
        CuPy or PyTorch stream and the call returns without waiting for it (strict
        validation aside). A repeat call with the same shapes, dtypes and flags reuses
        the first one's kernel choice and launch plan (``lik_cupy._runtime.prepared_calls``).
    Example (the NumPy path; on a GPU the same call runs the CUDA kernels)::

        >>> import numpy as np, lik_cupy
        >>> Q = np.array([[[1, 0], [0, 1]]], np.float32)            # 1 query, 2 tokens, d = 2
        >>> D = np.array([[[1, 0], [0, 0]], [[0, 2], [1, 1]]], np.float32)  # 2 documents
        >>> lik_cupy.maxsim(Q, D, backend="cpu")
        array([[1., 3.]], dtype=float32)
        >>> s, a = lik_cupy.maxsim(Q, D, d_lengths=[1, 2], return_argmax=True, backend="cpu")
        >>> s, a[0, 1]
        (array([[1., 3.]], dtype=float32), array([1, 0], dtype=int32))
    """
    return _run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, pairs=False)


def maxsim_pairs(Q, D, q_mask=None, d_mask=None, *, q_lengths=None, d_lengths=None, return_argmax=False,
                 backend="auto", precision=None, validate=None):
    """Diagonal MaxSim: ``score[b] = maxsim(Q[b], D[b])``.

    Args:
        Q: ``[B, Lq, d]``; D: ``[B, Ld, d]``; masks ``[B, Lq]`` / ``[B, Ld]`` or lengths ``[B]``.
        Other arguments (``validate`` too) as in :func:`maxsim`.

    Returns:
        float32 ``[B]`` (float64 for float64 inputs), and int32 argmax ``[B, Lq]`` if asked.
    Example::

        >>> import numpy as np, lik_cupy
        >>> Q = np.ones((3, 2, 4), np.float32)
        >>> D = np.arange(3 * 5 * 4, dtype=np.float32).reshape(3, 5, 4) / 100
        >>> lik_cupy.maxsim_pairs(Q, D, backend="cpu")
        array([1.4, 3. , 4.6], dtype=float32)
    """
    return _run(Q, D, q_mask, d_mask, q_lengths, d_lengths, return_argmax, backend, precision, validate, pairs=True)


def maxsim_varlen(Q, D_tokens, d_offsets, q_mask=None, *, q_lengths=None, q_offsets=None, return_argmax=False,
                  validate_offsets=True, backend="auto", precision=None, validate=None):
    """MaxSim against packed (ragged) documents: no work is spent on padding.

    Args:
        Q: ``[Nq, Lq, d]`` or ``[Lq, d]`` padded queries (with ``q_mask`` / ``q_lengths``
            as in :func:`maxsim`), or packed query tokens ``[Tq, d]`` with ``q_offsets``.
        D_tokens: ``[T, d]`` the documents' tokens back to back, same dtype and
            framework/device as Q (float16, bfloat16, float32 or float64, as in :func:`maxsim`).
        d_offsets: int32 or int64 ``[Nd + 1]``: document j is ``D_tokens[d_offsets[j]:d_offsets[j + 1]]``
            (FlashAttention's ``cu_seqlens``). Must start at 0, never decrease and end at T;
            equal neighbours are empty documents (score -inf). Device offsets are checked on
            the device after the scoring kernel, never copied to the host: a document whose
            offsets are negative, decreasing or past T scores NaN, and every score is NaN
            when the offsets do not run from 0 to T (``validate`` as in :func:`maxsim`).
        q_offsets: int32 or int64 ``[Nq + 1]`` for packed queries (read on the host:
            the longest query sets the argmax width). They are padded a group of similar lengths
            at a time, each to its own longest query, so that padding takes at most twice the
            queries' bytes (or 16 MiB) however their lengths spread.
        return_argmax: also return int32 ``[Nq, Nd, Lq]`` document-local token indices
            (``Lq`` = the longest query for packed queries), -1 for masked/absent query
            tokens and empty documents.
        validate_offsets: False is ``validate=False``: no check of ``d_offsets`` (nor of
            ``q_lengths``) for offsets already known good. The kernel clamps every document
            to ``[0, T)``, so bad offsets then give wrong scores but never touch memory
            outside ``D_tokens``. The CPU path checks host offsets and lengths whatever it says.
        backend, precision, validate: as in :func:`maxsim`.

    Returns:
        float32 ``[Nq, Nd]`` (``[Nd]`` for a 2-D padded Q; float64 for float64 inputs), in the caller's framework
        and device; semantics as in :func:`maxsim`.
    Example::

        >>> import numpy as np, lik_cupy
        >>> Q = np.array([[1, 0], [0, 1]], np.float32)               # one query [Lq, d]
        >>> tokens = np.array([[1, 0], [0, 2], [1, 1]], np.float32)  # docs of 1 and 2 tokens
        >>> lik_cupy.maxsim_varlen(Q, tokens, np.array([0, 1, 3]), backend="cpu")
        array([1., 3.], dtype=float32)
    """
    validate = False if not check_flag("validate_offsets", validate_offsets) and validate is None else validate
    return _run_varlen(Q, D_tokens, d_offsets, q_mask, q_lengths, q_offsets, return_argmax, backend, precision,
                       validate)
