"""float64 MaxSim reference used by the tests (deliberately naive)."""

import numpy as np


def maxsim_ref(Q, D, q_valid=None, d_valid=None):
    """Q [Nq, Lq, d], D [Nd, Ld, d] (float64-able) -> scores [Nq, Nd] float64, argmax-free."""
    Q = np.asarray(Q, np.float64)
    D = np.asarray(D, np.float64)
    nq, lq, _ = Q.shape
    nd, ld, _ = D.shape
    qv = np.ones((nq, lq), bool) if q_valid is None else np.asarray(q_valid, bool)
    dv = np.ones((nd, ld), bool) if d_valid is None else np.asarray(d_valid, bool)
    sim = np.einsum("isk,jtk->ijst", Q, D)
    sim = np.where(dv[None, :, None, :], sim, -np.inf)
    with np.errstate(invalid="ignore"):
        best = sim.max(axis=3) if ld else np.full((nq, nd, lq), -np.inf)
    return np.where(qv[:, None, :], best, 0.0).sum(axis=2), sim


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(out), fin), "non-finite pattern differs from the reference"
    assert np.array_equal(out[~fin], ref[~fin]), "infinite scores differ from the reference"
    if not fin.any():
        return 0.0
    return float(np.linalg.norm(out[fin] - ref[fin]) / max(np.linalg.norm(ref[fin]), 1e-30))


def spearman(a, b):
    """Spearman rank correlation of two 1-D score vectors (no ties in practice)."""
    ra = np.argsort(np.argsort(a)).astype(np.float64)
    rb = np.argsort(np.argsort(b)).astype(np.float64)
    return float(np.corrcoef(ra, rb)[0, 1])


def topk_overlap(a, b, k):
    """Fraction of the k best documents by score ``b`` that are also among the k best by ``a``."""
    return len(set(np.argsort(-a)[:k]) & set(np.argsort(-b)[:k])) / k


def clustered(rng, shape, centres=16, spread=0.05):
    """Unit embeddings crowded around a few centres: many near-duplicate tokens, so rankings
    hinge on small score differences (the hard case for quantisation)."""
    c = rng.standard_normal((centres, shape[-1]))
    x = c[rng.integers(0, centres, shape[:-1])] + spread * rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def rounding_bound(Q, D, q_valid=None, d_valid=None, dtype=np.float32):
    """[Nq, Nd]: how far the CPU path's scores may lie from the float64 MaxSim (``lik_cupy._cpu.maxsim``):
    each valid query token's term is its winner's float64 dot product and the terms are summed in
    float64 (each within ``gamma_n * ||q_s|| * max_t ||t||`` of exact, as is the reference), then
    rounded to ``dtype``, ``|score| * eps``. A float32 GEMM's rounding (``d * 6e-8`` relative) is far
    outside it."""
    Q = np.asarray(Q, np.float64)
    D = np.asarray(D, np.float64)
    nq, lq, dim = Q.shape
    nd, ld, _ = D.shape
    qv = np.ones((nq, lq), bool) if q_valid is None else np.asarray(q_valid, bool)
    dv = np.ones((nd, ld), bool) if d_valid is None else np.asarray(d_valid, bool)
    u64 = float(np.finfo(np.float64).eps) / 2
    gamma = (dim + lq) * u64 / (1 - (dim + lq) * u64)
    qn = np.where(qv, np.linalg.norm(Q, axis=-1), 0).sum(axis=1)
    dn = np.where(dv, np.linalg.norm(D, axis=-1), 0).max(axis=1, initial=0)
    ref = maxsim_ref(Q, D, qv, dv)[0]
    with np.errstate(invalid="ignore"):
        return 4 * gamma * qn[:, None] * dn[None, :] + float(np.finfo(dtype).eps) * np.abs(np.where(np.isfinite(ref), ref, 0))


def assert_within_rounding(out, ref, bound):
    """``out`` equals ``ref`` where ``ref`` is not finite, and lies within ``bound`` of it elsewhere."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(out), fin), "non-finite pattern differs from the reference"
    assert np.array_equal(out[~fin], ref[~fin], equal_nan=True), "non-finite scores differ from the reference"
    err = np.abs(out[fin] - ref[fin])
    assert np.all(err <= bound[fin]), f"max error {err.max():.3g} beyond the rounding bound (worst excess " \
                                      f"{(err - bound[fin]).max():.3g})"
