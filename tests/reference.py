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
