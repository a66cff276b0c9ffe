"""PLAID residual documents on the CPU: decompression and exact MaxSim, with bounded memory.

A token is a centroid code and ``nbits`` bits per dim (``unpack_buckets`` says how they are
packed); its embedding is ``centroids[code] + bucket_weights[bucket]`` per dim, scaled to unit
length when ``normalize`` (as ``torch.nn.functional.normalize``: divided by ``max(norm, 1e-12)``).
Scoring decompresses runs of documents in float64, never more than ``block_bytes`` of them at a
time, and scores each run with ``maxsim_numpy``: the exact MaxSim of the decompressed values.
"""

from __future__ import annotations

import numpy as np

from .maxsim import maxsim_numpy

_BLOCK_BYTES = 64 << 20


def unpack_buckets(residuals: np.ndarray, nbits: int, dim: int) -> np.ndarray:
    """uint8 ``[n, dim * nbits / 8]`` -> uint8 bucket indices ``[n, dim]``.

    The bits of a row form one stream, each byte filled from its most significant bit
    (``np.packbits``' order); dim ``j``'s bucket is stream bits ``j * nbits .. j * nbits + nbits - 1``,
    least significant first. That is how ColBERTv2 (``ResidualCodec.binarize``) and fast-plaid
    (``packbits`` in its index builder) write them.
    """
    bits = np.unpackbits(residuals.reshape(residuals.shape[0], dim * nbits // 8), axis=1)
    bits = bits.reshape(-1, dim, nbits)
    out = bits[..., 0].copy()
    for b in range(1, nbits):
        out |= bits[..., b] << b
    return out


def decompress(codes: np.ndarray, residuals: np.ndarray, centroids: np.ndarray, weights: np.ndarray, nbits: int,
               normalize: bool) -> np.ndarray:
    """float64 ``[n, dim]`` embeddings of ``n`` tokens (codes ``[n]``, residuals ``[n, dim * nbits / 8]``)."""
    dim = centroids.shape[1]
    x = centroids[codes.astype(np.intp, copy=False)].astype(np.float64)
    x += weights.astype(np.float64)[unpack_buckets(residuals, nbits, dim)]
    if normalize:
        x /= np.maximum(np.sqrt(np.einsum("ij,ij->i", x, x)), 1e-12)[:, None]
    return x


class Tokens:
    """Where each document's tokens lie in the flat codes ``[T]`` and residuals ``[T, R]``:
    ``starts[j]`` and ``lens[j]`` for the documents a call scores (int64)."""

    def __init__(self, codes, residuals, centroids, weights, nbits, normalize, starts, lens):
        self.codes, self.residuals, self.centroids, self.weights = codes, residuals, centroids, weights
        self.nbits, self.normalize = nbits, normalize
        self.starts, self.lens = starts, lens

    def padded(self, docs: np.ndarray):
        """Documents ``docs`` (indices into starts/lens) decompressed: float64 ``[n, Lmax, d]`` and
        bool valid ``[n, Lmax]``."""
        lens = self.lens[docs]
        lmax = int(lens.max()) if lens.size else 0
        valid = np.arange(lmax)[None, :] < lens[:, None]
        rows = (self.starts[docs][:, None] + np.arange(lmax)[None, :])[valid]
        out = np.zeros((docs.size, lmax, self.centroids.shape[1]))
        out[valid] = decompress(self.codes[rows], self.residuals[rows], self.centroids, self.weights, self.nbits,
                                self.normalize)
        return out, valid


def _run_end(lens: np.ndarray, j0: int, rows: int) -> int:
    """The end of the run of documents starting at ``j0`` whose padded size (documents times the
    longest) stays within ``rows`` token rows; one document at least. Looks ahead only as far as
    needed, doubling, so a corpus costs time in proportion to its documents."""
    nd, ahead = lens.size, 64
    while True:
        window = lens[j0 : j0 + ahead]
        padded = np.arange(1, window.size + 1) * np.maximum.accumulate(window)
        n = max(1, int(np.searchsorted(padded, rows, side="right")))
        if n < window.size or j0 + window.size >= nd:
            return j0 + min(n, window.size)
        ahead *= 2


def residual_maxsim_numpy(Q: np.ndarray, q_valid: np.ndarray, tokens: Tokens, sets: np.ndarray | None, *,
                          return_argmax: bool, block_bytes: int | None = None):
    """MaxSim of padded queries ``Q [Nq, Lq, d]`` against residual documents.

    ``sets``: None when every query scores every document of ``tokens`` (scores ``[Nq, Nd]``), or
    int64 ``[Nq, K]``, the documents query ``i`` scores (scores ``[Nq, K]``). Documents are
    decompressed in runs of at most ``block_bytes`` (default ``_BLOCK_BYTES``) of float64, one
    document at least.
    """
    nq, lq, dim = Q.shape
    nd = tokens.lens.size if sets is None else sets.shape[1]
    scores = np.empty((nq, nd), np.float32)
    amax = np.empty((nq, nd, lq), np.int32) if return_argmax else None
    rows = max(1, (block_bytes or _BLOCK_BYTES) // (8 * max(dim, 1)))  # token rows of float64 per run
    groups = [(slice(None), np.arange(nd))] if sets is None else [(slice(i, i + 1), sets[i]) for i in range(nq)]
    for qs, docs in groups:
        lens = tokens.lens[docs]
        j0 = 0
        while j0 < nd:
            j1 = _run_end(lens, j0, rows)
            blk, dv = tokens.padded(docs[j0:j1])
            s, a = maxsim_numpy(Q[qs], blk, q_valid[qs], dv, candidates=False, nd=j1 - j0,
                                return_argmax=return_argmax)
            scores[qs, j0:j1] = s
            if amax is not None:
                amax[qs, j0:j1] = a
            j0 = j1
    return scores, amax
