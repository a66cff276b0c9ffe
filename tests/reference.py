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


def zero_pad_ref(Q, D, q_valid, d_valid, zero_pad, near_tol=1e-4):
    """float64 reference of documents with zero-vector padding (``lik_cupy._maxsim_calls.maxsim_zero_pad``):
    a flagged document (``zero_pad`` bool [Nd]) also holds a zero token, so each query token's max
    over it is max(its max over the valid tokens, 0), a NaN max staying NaN. Q [Nq, Lq, d], D
    [Nd, Ld, d], validity bool [Nq, Lq] / [Nd, Ld]. Returns (scores [Nq, Nd], argmax [Nq, Nd, Lq]:
    the first of the valid tokens' max (the first NaN where there is one), -1 for a masked query
    token, an empty document or where the zero wins, and near [Nq, Nd, Lq]: where a flagged
    document's true max lies within ``near_tol`` of 0, so a kernel's rounding may floor it or not)."""
    _, sim = maxsim_ref(Q, D, q_valid, d_valid)
    nq, nd, lq, ld = sim.shape
    qv = np.asarray(q_valid, bool)
    with np.errstate(invalid="ignore"):
        best = sim.max(axis=3) if ld else np.full((nq, nd, lq), -np.inf)
        amax = (np.where(np.isnan(sim), np.inf, sim).argmax(axis=3) if ld else np.zeros((nq, nd, lq), int))
        floored = np.asarray(zero_pad, bool)[None, :, None] & (best < 0)
        near = np.asarray(zero_pad, bool)[None, :, None] & (np.abs(best) < near_tol)
    best = np.where(floored, 0.0, best)
    amax = np.where(floored | (best == -np.inf) | ~qv[:, None, :], -1, amax).astype(np.int32)
    return np.where(qv[:, None, :], best, 0.0).sum(axis=2), amax, near


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


def negative_token_inputs(rng, q_shape, d_shape):
    """float32 Q ``q_shape`` and D ``d_shape`` (in-batch ``[Nd, Ld, d]`` or candidates
    ``[Nq, K, Ld, d]``) where query 0's token 1 has a negative similarity with every document
    token: its max is below 0 everywhere, so it scores differently where padding scores 0 (PyLate's
    torch path, colpali-engine's zero pads) and where padding is left out (lik-cupy's masks)."""
    D = 0.3 * rng.standard_normal(d_shape)
    D[..., 0] = np.abs(D[..., 0]) + 1.0
    Q = rng.standard_normal(q_shape)
    Q[0, 1] = 0.0
    Q[0, 1, 0] = -1.0
    return Q.astype(np.float32), D.astype(np.float32)


def padding_mask(rng, shape):
    """A bool ``[..., L]`` mask with random gaps, its first row full (no padding: a negative max
    stays negative there) and its second row empty."""
    m = rng.random(shape) < 0.7
    flat = m.reshape(-1, shape[-1])
    flat[0] = True
    flat[1] = False
    return m


def masked_maxsim_ref(Q, D, q_mask=None, d_mask=None):
    """float64 torch reference of PyLate's torch path: ``sum_s max_t <Q_s, D_t> * q_mask_s * d_mask_t``
    (masks multiply the similarities, so a masked document token scores 0); without masks it is
    colpali-engine's torch reference too. D is in-batch ``[Nd, Ld, d]`` (scores ``[Nq, Nd]``) or
    candidates ``[Nq, K, Ld, d]`` (``[Nq, K]``); differentiable in Q and D."""
    import torch

    cand = D.ndim == 4
    sim = torch.einsum("isk,ijtk->ijst" if cand else "isk,jtk->ijst", Q.double(), D.double())
    if q_mask is not None:
        sim = sim * q_mask.double()[:, None, :, None]
    if d_mask is not None:
        sim = sim * (d_mask.double()[:, :, None, :] if cand else d_mask.double()[None, :, None, :])
    return sim.max(dim=3).values.sum(dim=2)


# ---------------------------------------------------------------- PLAID residual compression, as ColBERTv2 does it


def plaid_pack_ref(buckets, nbits):
    """Bucket indices [n, d] -> packed uint8 [n, d * nbits / 8], as ColBERTv2's ResidualCodec.binarize
    writes them: each index expanded to its nbits bits least significant first, the whole stream
    packed with np.packbits (most significant bit of each byte first)."""
    buckets = np.asarray(buckets, np.uint8)
    n, d = buckets.shape
    bits = (buckets[..., None] >> np.arange(nbits, dtype=np.uint8)) & 1
    return np.packbits(bits.reshape(-1)).reshape(n, d * nbits // 8)


def plaid_decompress_ref(codes, residuals, centroids, weights, nbits, normalize=True):
    """float64 [n, d] embeddings, decompressed the way ColBERTv2's ResidualCodec.decompress does:
    each byte through reversed_bit_map, then decompression_lookup_table (all index tuples of a
    byte, most significant first), bucket_weights, plus the centroid, then L2-normalised."""
    import itertools

    codes = np.asarray(codes).reshape(-1)
    residuals = np.asarray(residuals).reshape(codes.size, -1)
    mask = (1 << nbits) - 1
    reversed_bit_map = np.zeros(256, np.int64)
    for i in range(256):
        z = 0
        for j in range(8, 0, -nbits):
            x = (i >> (j - nbits)) & mask
            y = 0
            for k in range(nbits - 1, -1, -1):
                y += ((x >> (nbits - k - 1)) & 1) * (2**k)
            z |= y
            if j > nbits:
                z <<= nbits
        reversed_bit_map[i] = z
    table = np.array(list(itertools.product(range(1 << nbits), repeat=8 // nbits)), np.int64)
    idx = table[reversed_bit_map[residuals]].reshape(codes.size, -1)
    x = np.asarray(centroids, np.float64)[codes] + np.asarray(weights, np.float64)[idx]
    if normalize:
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return x


class HostDLPack:
    """A host array known only through DLPack (as a framework other than NumPy hands one over)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()
