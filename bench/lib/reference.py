"""The float64 reference the suites measure errors and rankings against, and the errors themselves.

The reference of a contender is float64 MaxSim of the inputs it scores, exactly as it reads them
(quantised inputs dequantised in float64, where their products are exact), so that its error is its
own arithmetic's and nothing else's."""

from __future__ import annotations

import numpy as np


def _dequantised(x, scales):
    """``x`` in float64, times its ``scales`` (None: none; ``[]``: one for all; else one per token)."""
    x = x.double()
    if scales is None:
        return x
    s = scales.double()
    return x * (s[..., None] if s.dim() else s)


def exact_scores(torch, q, d, chunk=None, *, d_mask=None, q_scales=None, d_scales=None):
    """float64 MaxSim [Nq, B] of q [Nq, Lq, dim] and d [B, Ld, dim] (torch tensors, any device), chunked
    over documents: ``chunk`` at a time, by default as many as keep a chunk's similarities within 1 GiB.

    ``d_mask``: bool [B, Ld], the valid document tokens (None: all). ``q_scales`` / ``d_scales``: the
    float32 scales of quantised q / d (``[Nq, Lq]`` / ``[B, Ld]`` per token, ``[]`` per tensor), which
    multiply the values in float64 (FP8 and INT8 values times a float32 scale are exact there)."""
    q64 = _dequantised(q, q_scales)
    if chunk is None:
        chunk = max(1, (1 << 30) // max(1, q.shape[0] * q.shape[1] * d.shape[1] * 8))
    per_token = d_scales is not None and d_scales.dim() > 0
    out = []
    for j in range(0, d.shape[0], chunk):
        dj = _dequantised(d[j:j + chunk], d_scales[j:j + chunk] if per_token else d_scales)
        sim = torch.einsum("isk,jtk->ijst", q64, dj)
        if d_mask is not None:
            sim = sim.masked_fill(~d_mask[None, j:j + chunk, None, :].bool(), float("-inf"))
        out.append(sim.amax(dim=3).sum(dim=2))
    return torch.cat(out, dim=1)


def exact_query_scores(torch, q, d, q_scales=None, d_scales=None):
    """float64 MaxSim [B] of one query q [Lq, dim] against d [B, Ld, dim], each times its scales where
    given (per token: ``[Lq]`` / ``[B, Ld]``; per tensor: ``[]``)."""
    qs = None if q_scales is None else q_scales[None] if q_scales.dim() else q_scales
    return exact_scores(torch, q[None], d, q_scales=qs, d_scales=d_scales).reshape(-1)


def exact_grads(torch, q, d, w, chunk=None):
    """float64 ``(dQ, dD, scores)`` of the in-batch step ``(MaxSim(q, d) * w).sum()``: q [N, Lq, dim],
    d [M, Ld, dim], w [N, M] (torch tensors, any device); scores [N, M]. Chunked over documents as
    ``exact_scores``, so no [N, M, Lq, Ld] tensor is made whole."""
    q64 = q.detach().double().requires_grad_(True)
    d64 = d.detach().double().requires_grad_(True)
    w64 = w.detach().double()
    if chunk is None:
        chunk = max(1, (1 << 30) // max(1, q.shape[0] * q.shape[1] * d.shape[1] * 8))
    scores = []
    for j in range(0, d.shape[0], chunk):
        s = torch.einsum("isk,jtk->ijst", q64, d64[j:j + chunk]).amax(dim=3).sum(dim=2)
        (s * w64[:, j:j + chunk]).sum().backward()
        scores.append(s.detach())
    return q64.grad, d64.grad, torch.cat(scores, dim=1)


def host64(x) -> np.ndarray:
    """A torch, CuPy, JAX or NumPy array as a NumPy float64 array on the host."""
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().double().numpy()
    if type(x).__module__.startswith("cupy"):
        x = x.get()
    return np.asarray(x, dtype=np.float64)


def max_rel_err(got, want) -> float:
    """max |got - want| / |want| over the scores (``got`` any array ``host64`` takes, reshaped to
    ``want``'s shape); NaN where any score of ``got`` is NaN (a NaN score is wrong, not skipped)."""
    g, w = host64(got), host64(want)
    if g.size != w.size:
        raise ValueError(f"the contender returned {g.size} scores; expected {w.size} (shape {list(w.shape)})")
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.max(np.abs(g.reshape(w.shape) - w) / np.maximum(np.abs(w), 1e-30))) if w.size else 0.0


def norm_rel_err(got, want) -> float:
    """||got - want|| / ||want|| (Frobenius), for gradients: one row's argmax moved by a near tie moves
    this by about that row's share of the norm, where an elementwise error would call it wrong."""
    g, w = host64(got), host64(want)
    if g.size != w.size:
        raise ValueError(f"the contender returned {g.size} values; expected {w.size} (shape {list(w.shape)})")
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.linalg.norm(g.reshape(w.shape) - w) / max(np.linalg.norm(w), 1e-300))
