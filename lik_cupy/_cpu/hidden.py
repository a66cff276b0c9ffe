"""The fused projection head's row arithmetic (``lik_cupy.fused_head``): L2-normalisation of
projected tokens and its gradient, in NumPy's API, which CuPy arrays run through too (NumPy's
functions dispatch to CuPy's), so the float64 GPU path shares it; the 16-bit and float32 GPU path
has fused kernels of its own (``lik_cupy._runtime.hidden``)."""

from __future__ import annotations

import numpy as np


def project_numpy(H: np.ndarray, W: np.ndarray, bias) -> np.ndarray:
    """``H [R, h] @ W.T + bias`` in float64: ``[R, d]``. Non-finite values (a masked token's padding
    may hold anything) make NaN or inf rows without a warning, as ``lik_cupy.maxsim`` reads them."""
    with np.errstate(invalid="ignore", over="ignore"):
        P = H.astype(np.float64) @ W.astype(np.float64).T
        if bias is not None:
            P += bias.astype(np.float64)
    return P


def normalize_rows(P, eps: float):
    """Normalise the rows of ``P [R, d]`` in place as ``torch.nn.functional.normalize`` does,
    ``P / max(|P|, eps)``; returns the norms ``[R, 1]``."""
    with np.errstate(invalid="ignore", over="ignore"):  # (non-finite rows: NaN, as torch's, without a warning)
        r = np.sqrt((P * P).sum(axis=1, keepdims=True))
        P /= np.maximum(r, eps)
    return r


def normalize_grad(D, r, dD, keep, eps: float):
    """The gradient with respect to the unnormalised rows, from ``dD`` with respect to the
    normalised rows ``D`` (norms ``r`` before, ``[R, 1]``), zero in the rows where ``keep`` ``[R, 1]``
    is False (masked tokens, whose values may be anything); ``r=None``: no normalisation."""
    if r is None:
        return np.where(keep, dD, 0)
    dot = (D * dD).sum(axis=1, keepdims=True) * (r >= eps)  # below eps: scaled, not normalised (clamp_min passes the gradient at eps)
    return np.where(keep, (dD - D * dot) / np.maximum(r, eps), 0)
