"""PLAID residual documents on the CPU: bit unpacking and decompression against ColBERTv2's own
procedure, scoring (padded, packed, per-query candidates) against float64 MaxSim of the decompressed
embeddings, the argument checks, and the index readers (synthetic fast-plaid and ColBERTv2 layouts;
an index built by fast-plaid itself where it installs)."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import zipfile

import numpy as np
import pytest

import lik_cupy
from lik_cupy import plaid
from lik_cupy._cpu.residual import unpack_buckets
from lik_cupy._plaid_files import read_torch_file
from lik_cupy.errors import ShardError
from reference import maxsim_ref, plaid_decompress_ref, plaid_pack_ref


def codec(rng, n_cent, dim, nbits, dtype=np.float16):
    cen = rng.standard_normal((n_cent, dim)).astype(dtype)
    w = np.sort(rng.standard_normal(1 << nbits) * 0.2).astype(np.float32)
    return cen, w


def tokens(rng, n, n_cent, dim, nbits):
    """Random codes (int64) and residual bytes of n tokens, packed from random buckets as ColBERTv2 does."""
    codes = rng.integers(0, n_cent, n)
    bits = plaid_pack_ref(rng.integers(0, 1 << nbits, (n, dim)), nbits)
    return codes, bits


def ragged(rng, nd, lo, hi, empty=0.15):
    lens = rng.integers(lo, hi + 1, nd)
    lens[rng.random(nd) < empty] = 0
    return lens


def ref_scores(Q, emb_docs, q_valid=None):
    """float64 scores of Q [nq, lq, d] against a list of documents [len_j, d] (-inf when empty)."""
    ld = max([len(e) for e in emb_docs] + [1])
    d = np.zeros((len(emb_docs), ld, Q.shape[-1]))
    dv = np.zeros((len(emb_docs), ld), bool)
    for j, e in enumerate(emb_docs):
        d[j, :len(e)], dv[j, :len(e)] = e, True
    s, _ = maxsim_ref(Q, d, q_valid, dv)
    return s


def assert_scores(got, Q, emb_docs, q_valid=None):
    """``got`` [nq, k] lies within float32 rounding of the float64 scores of ``ref_scores``: the
    decompressed tokens and the dot products are float32, so each term may move by about
    ``(dim + 4) * eps32 * ||q_s|| * max_t ||t||`` (a relative tolerance fails near a score of 0)."""
    Q = np.asarray(Q, np.float64)
    want = ref_scores(Q, emb_docs, q_valid)
    qv = np.ones(Q.shape[:2], bool) if q_valid is None else np.asarray(q_valid, bool)
    qn = np.where(qv, np.linalg.norm(Q, axis=-1), 0).sum(axis=1)
    dn = np.array([np.linalg.norm(np.asarray(e, np.float64), axis=-1).max(initial=0) for e in emb_docs])
    eps = float(np.finfo(np.float32).eps)
    fin = np.isfinite(want)
    bound = (Q.shape[-1] + 4) * eps * qn[:, None] * dn[None, :] + eps * np.abs(np.where(fin, want, 0))
    got = np.asarray(got, np.float64).reshape(want.shape)
    np.testing.assert_array_equal(got[~fin], want[~fin])
    assert np.all(np.abs(got[fin] - want[fin]) <= bound[fin]), (got, want, bound)  # (-inf - -inf is NaN: finite ones only)


# ---------------------------------------------------------------- unpacking and decompression


@pytest.mark.parametrize("nbits", [1, 2, 4])
@pytest.mark.parametrize("dim", [8, 24, 40, 100, 128])
def test_unpack_reads_colbert_packing(rng, nbits, dim):
    if dim * nbits % 8:
        pytest.skip("does not pack into whole bytes")
    b = rng.integers(0, 1 << nbits, (37, dim))
    np.testing.assert_array_equal(unpack_buckets(plaid_pack_ref(b, nbits), nbits, dim), b)


@pytest.mark.parametrize("nbits", [1, 2, 4])
@pytest.mark.parametrize("normalize", [True, False])
def test_decompress_matches_colbert_procedure(rng, nbits, normalize):
    dim = 48
    cen, w = codec(rng, 23, dim, nbits)
    codes = rng.integers(0, 23, 301)
    bits = rng.integers(0, 256, (301, dim * nbits // 8), dtype=np.uint8)  # every byte pattern
    got = plaid.decompress_residuals(codes, bits, cen, w, nbits, normalize=normalize)
    want = plaid_decompress_ref(codes, bits, cen, w, nbits, normalize)
    assert got.dtype == np.float32 and got.shape == (301, dim)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, rtol=1e-6)
    # other shapes: codes [2, 3] -> [2, 3, d]
    got2 = plaid.decompress_residuals(codes[:6].reshape(2, 3), bits[:6].reshape(2, 3, -1), cen, w, nbits,
                                      normalize=normalize)
    np.testing.assert_array_equal(got2.reshape(6, dim), got[:6])


def test_zero_embedding_stays_zero_and_a_tiny_one_is_scaled_to_unit_length():
    cen = np.zeros((1, 8), np.float16)
    w = np.zeros(2, np.float32)
    got = plaid.decompress_residuals(np.array([0]), np.zeros((1, 1), np.uint8), cen, w, 1)
    np.testing.assert_array_equal(got, 0)
    # norm 1.7e-4: divided by its norm (the floor is torch's 1e-12), as ColBERTv2 does
    cen = np.full((1, 8), 2.0**-14, np.float16)
    got = plaid.decompress_residuals(np.array([0]), np.zeros((1, 1), np.uint8), cen, w, 1)
    want = plaid_decompress_ref(np.array([0]), np.zeros((1, 1), np.uint8), cen, w, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, rtol=1e-6)


# ---------------------------------------------------------------- scoring


@pytest.mark.parametrize("nbits", [1, 2, 4])
@pytest.mark.parametrize("dim,nq,lq", [(128, 3, 32), (40, 1, 7), (8, 2, 1)])
def test_padded_scores_and_argmax(rng, nbits, dim, nq, lq):
    cen, w = codec(rng, 31, dim, nbits, np.float32 if dim == 40 else np.float16)
    nd, ld = 13, 21
    lens = ragged(rng, nd, 1, ld)
    codes, bits = tokens(rng, nd * ld, 31, dim, nbits)
    codes, bits = codes.reshape(nd, ld), bits.reshape(nd, ld, -1)
    Q = rng.standard_normal((nq, lq, dim)).astype(np.float16)
    qm = rng.random((nq, lq)) < 0.8
    s, a = lik_cupy.maxsim_residual(Q, codes, bits, lens, cen, w, nbits, qm, return_argmax=True, backend="cpu")
    emb = plaid_decompress_ref(codes, bits, cen, w, nbits).reshape(nd, ld, dim)
    want = ref_scores(Q, [emb[j, :lens[j]] for j in range(nd)], qm)
    np.testing.assert_allclose(s, want, rtol=1e-6, atol=1e-6)
    assert s.dtype == np.float32 and a.shape == (nq, nd, lq) and a.dtype == np.int32
    sim = np.einsum("isk,jtk->ijst", Q.astype(np.float64), emb)
    for i in range(nq):
        for j in range(nd):
            for t in range(lq):
                if not qm[i, t] or lens[j] == 0:
                    assert a[i, j, t] == -1
                else:
                    assert 0 <= a[i, j, t] < lens[j]
                    best = sim[i, j, t, :lens[j]].max()
                    assert sim[i, j, t, a[i, j, t]] >= best - 1e-9 * abs(best)


def test_padded_candidate_sets_and_no_lengths(rng):
    nbits, dim, nq, k, ld = 2, 64, 3, 5, 9
    cen, w = codec(rng, 17, dim, nbits)
    codes, bits = tokens(rng, nq * k * ld, 17, dim, nbits)
    codes, bits = codes.reshape(nq, k, ld), bits.reshape(nq, k, ld, -1)
    Q = rng.standard_normal((nq, 4, dim)).astype(np.float32)
    s = lik_cupy.maxsim_residual(Q, codes, bits, None, cen, w, nbits, backend="cpu")
    emb = plaid_decompress_ref(codes, bits, cen, w, nbits).reshape(nq, k, ld, dim)
    for i in range(nq):
        assert_scores(s[i][None], Q[i:i + 1], list(emb[i]))
    one = lik_cupy.maxsim_residual(Q[0], codes[0], bits[0], None, cen, w, nbits, backend="cpu")  # 2-D Q
    np.testing.assert_array_equal(one, s[0])


@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_packed_every_document_and_candidates(rng, nbits):
    dim, nd, nq, lq = 96, 41, 4, 11
    cen, w = codec(rng, 64, dim, nbits)
    lens = ragged(rng, nd, 1, 70)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    codes, bits = tokens(rng, int(off[-1]), 64, dim, nbits)
    codes = codes.astype(np.int32)
    Q = rng.standard_normal((nq, lq, dim)).astype(np.float16)
    ql = rng.integers(0, lq + 1, nq)
    emb = plaid_decompress_ref(codes, bits, cen, w, nbits)
    docs = [emb[off[j]:off[j + 1]] for j in range(nd)]
    qv = np.arange(lq)[None, :] < ql[:, None]
    every = lik_cupy.maxsim_residual_varlen(Q, codes, bits, off, cen, w, nbits, q_lengths=ql, backend="cpu")
    np.testing.assert_allclose(every, ref_scores(Q, docs, qv), rtol=1e-6, atol=1e-6)
    cand = rng.integers(0, nd, (nq, 17))
    s, a = lik_cupy.maxsim_residual_varlen(Q, codes, bits, off, cen, w, nbits, q_lengths=ql, candidates=cand,
                                           return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(s, np.take_along_axis(every, cand, axis=1))
    _, a_all = lik_cupy.maxsim_residual_varlen(Q, codes, bits, off, cen, w, nbits, q_lengths=ql, return_argmax=True,
                                               backend="cpu")
    np.testing.assert_array_equal(a, np.take_along_axis(a_all, cand[..., None], axis=1))


def _index_arrays(rng, nd, dim, nbits, n_cent, lo=1, hi=200):
    cen, w = codec(rng, n_cent, dim, nbits)
    lens = ragged(rng, nd, lo, hi)
    off = np.concatenate([[0], np.cumsum(lens)])
    codes, bits = tokens(rng, int(off[-1]), n_cent, dim, nbits)
    return cen, w, off, codes, bits


def _decompressed_and_scored(Q, qm, codes, bits, off, cen, w, nbits, cand):
    """The manual path: the candidates' union decompressed (decompress_residuals), scored by
    maxsim_varlen, gathered."""
    u = np.unique(cand)
    rows = np.concatenate([np.arange(off[j], off[j + 1]) for j in u] + [np.zeros(0, np.int64)])
    D = plaid.decompress_residuals(codes[rows], bits[rows], cen, w, nbits)
    o = np.concatenate([[0], np.cumsum(off[u + 1] - off[u])])
    s, a = lik_cupy.maxsim_varlen(Q.astype(np.float32), D, o, qm, return_argmax=True, backend="cpu")  # (exact)
    at = np.searchsorted(u, cand)
    return np.take_along_axis(s, at, axis=1), np.take_along_axis(a, at[..., None], axis=1)


@pytest.mark.parametrize("sharing", ["own", "shared", "mixed"])
def test_candidates_equal_decompress_then_maxsim_varlen(rng, monkeypatch, sharing):
    # Whatever the blocks and whether queries share a block's GEMMs or score their own documents:
    # bit for bit the scores and argmax of maxsim_varlen over the decompressed float32 embeddings.
    from lik_cupy._cpu import residual as res

    dim, nbits, nd, nq, k = 64, 2, 300, 6, 40
    cen, w, off, codes, bits = _index_arrays(rng, nd, dim, nbits, 37)
    Q = rng.standard_normal((nq, 9, dim)).astype(np.float16)
    qm = rng.random((nq, 9)) < 0.85
    if sharing == "own":
        cand = rng.permutation(nd)[:nq * k].reshape(nq, k)
    elif sharing == "shared":
        cand = np.tile(rng.permutation(nd)[:k], (nq, 1))
    else:  # overlapping sets, repeated ids; a NaN centroid: NaN scores where maxsim_varlen gives them
        cand = rng.integers(0, 60, (nq, k))
        cen[int(codes[off[5]]), 3] = np.nan
    want_s, want_a = _decompressed_and_scored(Q, qm, codes, bits, off, cen, w, nbits, cand)
    seen = []
    real = res.Tokens.decompressed
    monkeypatch.setattr(res.Tokens, "decompressed", lambda self, docs, scratch: seen.append(docs.size)
                        or real(self, docs, scratch))
    for block in (None, 64 << 10):
        if block:
            monkeypatch.setattr(res, "_BLOCK_BYTES", block)
        seen.clear()
        s, a = lik_cupy.maxsim_residual_varlen(Q, codes, bits, off, cen, w, nbits, qm, candidates=cand,
                                               return_argmax=True, backend="cpu")
        np.testing.assert_array_equal(s, want_s)
        np.testing.assert_array_equal(a, want_a)
        assert np.isnan(s).any() == (sharing == "mixed")
        assert sum(seen) == np.unique(cand).size  # each distinct candidate decompressed once
        if block:
            assert len(seen) > 4


def test_packed_runs_bound_memory(rng):
    # tracemalloc counts every NumPy allocation, whatever the machine's load: beside the results,
    # a call holds at most block_bytes however many documents it scores.
    import tracemalloc

    from lik_cupy._cpu import residual as res

    dim, nbits, nd, nq = 64, 2, 400, 8
    cen, w, off, codes, bits = _index_arrays(rng, nd, dim, nbits, 50)
    Q = rng.standard_normal((nq, 32, dim)).astype(np.float32)
    qv = np.ones((nq, 32), bool)
    t = res.Tokens(codes, bits, cen, w, nbits, True, off[:-1], np.diff(off))
    sets = {"own": rng.integers(0, nd, (nq, 60)), "shared": np.tile(rng.choice(nd, 60), (nq, 1)), "every": None}
    res.residual_maxsim_numpy(Q, qv, t, sets["own"], return_argmax=True, block_bytes=1 << 20)  # (first-call imports)
    for block in (1 << 20, 4 << 20):
        for name, cand in sets.items():
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                s, a = res.residual_maxsim_numpy(Q, qv, t, cand, return_argmax=True, block_bytes=block)
                peak = tracemalloc.get_traced_memory()[1] - base
            finally:
                tracemalloc.stop()
            assert peak - s.nbytes - a.nbytes <= block, (name, block, peak)
    whole = int(off[-1]) * dim * 4  # the corpus decompressed: what a call would hold without blocks
    assert whole > 4 << 20  # (more than either block: holding everything would not pass)


def test_index_rerank_holds_its_candidates_not_the_index(rng, monkeypatch):
    """rerank's CPU path took every document's start and length ([N] int64 each, and the offsets'
    check) on each call: about 17 bytes a document of the index, past block_bytes for a large index
    however few candidates a call scored. Now only the candidates' are read."""
    import tracemalloc

    from lik_cupy._cpu import residual as res
    from lik_cupy._plaid_files import IndexArrays

    monkeypatch.setattr(res, "_BLOCK_BYTES", 1 << 20)
    dim, nbits, nd = 32, 2, 1_000_000  # 4 tokens a document; 17 MB of [N] temporaries on the old path
    cen, w = codec(rng, 16, dim, nbits)
    off = np.arange(nd + 1, dtype=np.int64) * 4
    codes, bits = tokens(rng, int(off[-1]), 16, dim, nbits)
    idx = lik_cupy.PlaidIndex(IndexArrays("fast-plaid", nbits, cen, w, codes, bits, off))
    Q = rng.standard_normal((2, 8, dim)).astype(np.float32)
    cand = np.array([[nd - 1, 0, 5], [3, nd - 1, 3]])
    s, a = idx.rerank(Q, cand, return_argmax=True, backend="cpu")
    tracemalloc.start()
    try:
        idx.rerank(Q, cand, return_argmax=True, backend="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 1 << 20, peak
    ref, ref_a = _decompressed_and_scored(Q, None, codes, bits, off, cen, w, nbits, cand)
    np.testing.assert_array_equal(s, ref)
    np.testing.assert_array_equal(a, ref_a)


@pytest.mark.parametrize("dim, nbits", [(4, 2), (520, 1)])
def test_an_index_of_a_dim_the_residual_kernels_refuse_is_not_copied_to_a_gpu(rng, monkeypatch, dim, nbits):
    """An index a PLAID reader takes (dim * nbits a multiple of 8) whose dim the residual kernels do
    not (a multiple of 8, at most 512): rerank on the GPU copied the whole compressed corpus to the
    device (to_device too) and only then raised the kernel chooser's ValueError, without the hint
    that the CPU path takes it. The dim is checked before anything is copied now. (No GPU is
    needed: the check comes first.)"""
    from lik_cupy._plaid_files import IndexArrays

    cen, w = codec(rng, 4, dim, nbits)
    codes, bits = tokens(rng, 6, 4, dim, nbits)
    idx = lik_cupy.PlaidIndex(IndexArrays("fast-plaid", nbits, cen, w, codes, bits, np.array([0, 2, 6])))
    monkeypatch.setattr(plaid, "use_gpu", lambda *a, **k: True)
    monkeypatch.setattr(plaid, "gpu_available", lambda: True)
    Q = rng.standard_normal((1, 3, dim)).astype(np.float32)
    words = rf"the index has dim {dim}; the residual kernels need a multiple of 8 up to 512 \(backend='cpu' takes any dim\)"
    with pytest.raises(ValueError, match=words):
        idx.rerank(Q, [[1, 0]], backend="gpu")
    with pytest.raises(ValueError, match=words):
        idx.to_device()
    assert idx._device == {}
    monkeypatch.undo()
    assert idx.rerank(Q, [[1, 0]], backend="cpu").shape == (1, 2)


def test_unnormalized_and_empty(rng):
    dim, nbits = 16, 4
    cen, w = codec(rng, 5, dim, nbits)
    off = np.array([0, 0, 3, 3])
    codes, bits = tokens(rng, 3, 5, dim, nbits)
    Q = rng.standard_normal((2, 3, dim)).astype(np.float32)
    s = lik_cupy.maxsim_residual_varlen(Q, codes, bits, off, cen, w, nbits, normalize=False, backend="cpu")
    emb = plaid_decompress_ref(codes, bits, cen, w, nbits, normalize=False)
    assert_scores(s[:, 1:2], Q, [emb])
    assert np.all(s[:, [0, 2]] == -np.inf)
    z = lik_cupy.maxsim_residual_varlen(Q, codes, bits, off, cen, w, nbits, q_lengths=[0, 3], backend="cpu")
    assert np.all(z[0] == 0) and np.all(z[1, [0, 2]] == -np.inf)


def test_bfloat16_queries_and_lists(rng):
    import ml_dtypes

    dim, nbits = 32, 1
    cen, w = codec(rng, 7, dim, nbits)
    codes, bits = tokens(rng, 10, 7, dim, nbits)
    Q = rng.standard_normal((3, dim)).astype(ml_dtypes.bfloat16)
    s = lik_cupy.maxsim_residual_varlen(Q, codes, bits, [0, 4, 10], cen, w, nbits, candidates=[1, 1, 0],
                                        backend="cpu")
    emb = plaid_decompress_ref(codes, bits, cen, w, nbits)
    assert_scores(np.asarray(s)[None], Q.astype(np.float64)[None], [emb[4:], emb[4:], emb[:4]])


# ---------------------------------------------------------------- argument checks


def test_argument_errors(rng):
    dim, nbits = 16, 2
    cen, w = codec(rng, 5, dim, nbits)
    codes, bits = tokens(rng, 6, 5, dim, nbits)
    off = np.array([0, 2, 6])
    Q = rng.standard_normal((1, 3, dim)).astype(np.float32)
    f = lik_cupy.maxsim_residual_varlen
    with pytest.raises(ValueError, match="nbits must be 1, 2 or 4"):
        f(Q, codes, bits, off, cen, w, 3, backend="cpu")
    with pytest.raises(ValueError, match=r"residuals rows hold 3 bytes; expected 4"):
        f(Q, codes, bits[:, :3], off, cen, w, nbits, backend="cpu")
    with pytest.raises(ValueError, match=r"bucket_weights has shape \[2\]; expected \[4\]"):
        f(Q, codes, bits, off, cen, w[:2], nbits, backend="cpu")
    with pytest.raises(ValueError, match="centroids have dim 8 but Q has dim 16"):
        f(Q, codes, bits, off, cen[:, :8], w, nbits, backend="cpu")
    with pytest.raises(TypeError, match="residuals has dtype int8"):
        f(Q, codes, bits.view(np.int8), off, cen, w, nbits, backend="cpu")
    with pytest.raises(ValueError, match=r"codes holds 5; every entry must be in \[0, 4\]"):
        f(Q, np.where(np.arange(6) == 3, 5, codes), bits, off, cen, w, nbits, backend="cpu")
    with pytest.raises(ValueError, match=r"candidates holds 2; every entry must be in \[0, 1\]"):
        f(Q, codes, bits, off, cen, w, nbits, candidates=np.array([[0, 2]]), backend="cpu")
    with pytest.raises(ValueError, match=r"candidates has shape \[2, 2\]; expected \[Nq, K\] with Nq = 1"):
        f(Q, codes, bits, off, cen, w, nbits, candidates=np.zeros((2, 2), np.int64), backend="cpu")
    with pytest.raises(ValueError, match="d_offsets ends at 5"):
        f(Q, codes, bits, np.array([0, 2, 5]), cen, w, nbits, backend="cpu")
    with pytest.raises(ValueError, match="dim 12 with nbits 1 does not pack"):
        f(Q[..., :12], codes, bits[:, :1], off, cen[:, :12], w[:2], 1, backend="cpu")
    with pytest.raises(ValueError, match=r"d_lengths holds 4; every length must be in \[0, 3\]"):
        lik_cupy.maxsim_residual(Q, codes.reshape(2, 3), bits.reshape(2, 3, 4), [1, 4], cen, w, nbits, backend="cpu")
    with pytest.raises(ValueError, match="codes has candidate sets for 2 queries but Q has 1"):
        lik_cupy.maxsim_residual(Q, codes.reshape(2, 1, 3), bits.reshape(2, 1, 3, 4), None, cen, w, nbits,
                                 backend="cpu")


# ---------------------------------------------------------------- index directories


def _write_fast_plaid(path, cen, w, nbits, lens_per_chunk, codes, bits, merged: bool, pad_rows=0):
    """A fast-plaid index directory as its documentation and sources lay it out."""
    os.makedirs(path, exist_ok=True)
    np.save(os.path.join(path, "centroids.npy"), cen)
    np.save(os.path.join(path, "bucket_weights.npy"), w)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"num_chunks": len(lens_per_chunk), "nbits": nbits, "num_documents": 0}, f)
    at, manifest_c, manifest_r = 0, {}, {}
    for i, lens in enumerate(lens_per_chunk):
        with open(os.path.join(path, f"doclens.{i}.json"), "w") as f:
            json.dump([int(n) for n in lens], f)
        n = int(sum(lens))
        if not merged:
            np.save(os.path.join(path, f"{i}.codes.npy"), codes[at:at + n])
            np.save(os.path.join(path, f"{i}.residuals.npy"), bits[at:at + n])
        manifest_c[f"{i}.codes.npy"] = {"rows": n, "merged": True}
        manifest_r[f"{i}.residuals.npy"] = {"rows": n, "merged": True}
        at += n
    if merged:
        np.save(os.path.join(path, "merged_codes.npy"), np.concatenate([codes, np.zeros(pad_rows, codes.dtype)]))
        np.save(os.path.join(path, "merged_residuals.npy"),
                np.concatenate([bits, np.zeros((pad_rows, bits.shape[1]), np.uint8)]))
        for name, m in (("codes", manifest_c), ("residuals", manifest_r)):
            with open(os.path.join(path, f"merged_{name}.manifest.json"), "w") as f:
                json.dump(m, f)


@pytest.mark.parametrize("merged", [True, False])
def test_fast_plaid_layout(rng, tmp_path, merged):
    dim, nbits = 64, 2
    cen, w = codec(rng, 40, dim, nbits)
    chunks = [ragged(rng, 12, 1, 30), ragged(rng, 9, 1, 30), ragged(rng, 5, 1, 30)]
    t = int(sum(c.sum() for c in chunks))
    codes, bits = tokens(rng, t, 40, dim, nbits)
    _write_fast_plaid(tmp_path, cen, w.astype(np.float32), nbits, chunks, codes, bits, merged, pad_rows=7)
    idx = plaid.PlaidIndex.open(tmp_path)
    assert idx.kind == "fast-plaid" and len(idx) == 26 and idx.dim == dim and idx.nbits == nbits
    np.testing.assert_array_equal(idx.codes, codes)
    np.testing.assert_array_equal(idx.residual_bits, bits)
    np.testing.assert_array_equal(idx.bucket_weights, w.astype(np.float16).astype(np.float32))
    lens = np.concatenate(chunks)
    off = np.concatenate([[0], np.cumsum(lens)])
    ids = np.array([3, 25, 0, 12, 3])
    c, b, o = idx.residuals(ids)
    np.testing.assert_array_equal(o, np.concatenate([[0], np.cumsum(lens[ids])]))
    np.testing.assert_array_equal(c, np.concatenate([codes[off[i]:off[i + 1]] for i in ids]))
    np.testing.assert_array_equal(b, np.concatenate([bits[off[i]:off[i + 1]] for i in ids]))
    emb = plaid_decompress_ref(codes, bits, cen, idx.bucket_weights, nbits)
    for got, i in zip(idx.embeddings(ids), ids):
        np.testing.assert_allclose(got, emb[off[i]:off[i + 1]], rtol=1e-6, atol=1e-7)
    Q = rng.standard_normal((2, 6, dim)).astype(np.float16)
    cand = np.array([[25, 3, 3, 0], [1, 2, 24, 13]])
    s = idx.rerank(Q, cand, backend="cpu")
    docs = [emb[off[i]:off[i + 1]] for i in range(26)]
    for i in range(2):
        assert_scores(s[i][None], Q[i:i + 1], [docs[j] for j in cand[i]])
    with pytest.raises(ValueError, match=r"candidate_ids holds 26; every entry must be in \[0, 25\] \(ids of the 26 "
                                         r"documents of the index\)"):
        idx.rerank(Q, cand + 1, backend="cpu")


def test_fast_plaid_unmerged_chunk_wins(rng, tmp_path):
    # A chunk written by an update and not merged yet: its own file is read, the merged rows of the
    # others at the manifest's offsets.
    dim, nbits = 32, 4
    cen, w = codec(rng, 8, dim, nbits)
    chunks = [ragged(rng, 4, 1, 9, 0), ragged(rng, 3, 1, 9, 0)]
    t0, t = int(chunks[0].sum()), int(sum(c.sum() for c in chunks))
    codes, bits = tokens(rng, t, 8, dim, nbits)
    _write_fast_plaid(tmp_path, cen, w, nbits, chunks, codes, bits, merged=True)
    new_codes = rng.integers(0, 8, t - t0)
    np.save(tmp_path / "1.codes.npy", new_codes)
    np.save(tmp_path / "1.residuals.npy", bits[t0:][::-1].copy())
    idx = plaid.PlaidIndex.open(tmp_path)
    np.testing.assert_array_equal(idx.codes, np.concatenate([codes[:t0], new_codes]))
    np.testing.assert_array_equal(idx.residual_bits, np.concatenate([bits[:t0], bits[t0:][::-1]]))


def test_bad_index_directories(rng, tmp_path):
    with pytest.raises(ShardError, match="neither a fast-plaid index"):
        plaid.PlaidIndex.open(tmp_path)
    dim, nbits = 16, 2
    cen, w = codec(rng, 4, dim, nbits)
    codes, bits = tokens(rng, 5, 4, dim, nbits)
    codes[2] = 9
    _write_fast_plaid(tmp_path / "x", cen, w, nbits, [np.array([2, 3])], codes, bits, merged=False)
    with pytest.raises(ShardError, match="a code lies outside the 4 centroids"):
        plaid.PlaidIndex.open(tmp_path / "x")


def test_an_index_without_centroids_is_refused_when_read(tmp_path):
    # centroids.npy of shape [0, d] opened (with documents of no tokens), and embeddings() then
    # raised "centroids must be [n_centroids, d] with at least one centroid", an argument the
    # caller never passed; with tokens, the error said "expected ids in [0, -1]". The reader now
    # refuses such a file, as maxsim_residual refuses such centroids.
    for t in (0, 3):
        d = tmp_path / f"t{t}"
        _write_fast_plaid(d, np.zeros((0, 16), np.float16), np.zeros(4, np.float32), 2, [np.array([0, t])],
                          np.zeros(t, np.int64), np.zeros((t, 4), np.uint8), merged=False)
        with pytest.raises(ShardError, match=re.escape(f"{d / 'centroids.npy'}: centroids are float16 of shape "
                                                       f"[0, 16]; expected floats [C, d], at least one centroid")):
            plaid.PlaidIndex.open(d)


def test_codec_values_past_float16_are_a_shard_error_and_no_warning(rng, tmp_path):
    # float32 centroids or bucket weights past float16's range were refused only after NumPy's
    # cast warned "overflow encountered in cast" (under -W error, a RuntimeWarning instead of the
    # ShardError); the values are now judged without a warning.
    import warnings

    cen, w = codec(rng, 4, 16, 2, np.float32)
    codes, bits = tokens(rng, 5, 4, 16, 2)
    for file, big in (("centroids", cen * 1e6), ("bucket_weights", w * 1e6)):
        d = tmp_path / file
        _write_fast_plaid(d, big if file == "centroids" else cen, big if file != "centroids" else w, 2,
                          [np.array([2, 3])], codes, bits, merged=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ShardError, match=f"{file}.npy: a .* is not finite \\(as float16\\)"):
                plaid.PlaidIndex.open(d)


def test_torch_reader_refuses_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(Evil()))
    with pytest.raises(ShardError, match="posix.system is not a tensor or container; refusing"):
        read_torch_file(str(path))


def test_torch_reader_errors_show_a_long_detail_cut_short(tmp_path):
    """A detail or a member name over 40 characters was reported as its length ("a str of 72 characters")."""
    def text(t):
        return b"X" + len(t).to_bytes(4, "little") + t.encode()

    key = "k" * 300
    storage = b"\x80\x02(" + text("storage") + b"ctorch\nFloatStorage\n" + text(key) + text("cpu") + b"K\x01tQ."
    for pkl, detail in ((b"\x80\x02\x8c\x02\xff\xfe.", "corrupt torch archive (UnicodeDecodeError: \"'utf-8' codec "
                                                       "can't decode byte 0xff in position 0: invalid start byte\")"),
                        (storage, f"the archive has no member {('archive/data/' + key)[:40]!r}... (313 characters)")):
        path = tmp_path / "bad.pt"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("archive/data.pkl", pkl)
        with pytest.raises(ShardError) as e:
            read_torch_file(str(path))
        assert str(e.value) == f"{path}: {detail}"


def test_torch_reader_reads_what_torch_saves(rng, tmp_path):
    torch = pytest.importorskip("torch")
    base = torch.from_numpy(rng.standard_normal(6).astype(np.float32))
    objs = {"half": torch.from_numpy(rng.standard_normal((7, 5))).half(), "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4, dtype=torch.int64), "pair": (torch.arange(5, dtype=torch.int32), base),
            "list": [torch.ones(2, dtype=torch.uint8)], "view": torch.arange(20).reshape(4, 5)[1:, ::2],
            "dict": {"a": base}, "shared": (base, base[1:]), "wide": torch.tensor([1 << 40, -3])}

    def same(a, b):
        if isinstance(b, torch.Tensor):
            return isinstance(a, np.ndarray) and a.shape == tuple(b.shape) and bool((a == b.numpy()).all())
        if isinstance(b, (tuple, list)):
            return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in b)

    for name, obj in objs.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        assert same(read_torch_file(str(tmp_path / f"{name}.pt")), obj), name


def test_colbertv2_layout(rng, tmp_path):
    torch = pytest.importorskip("torch")
    dim, nbits = 32, 2
    cen, w = codec(rng, 12, dim, nbits)
    chunks = [ragged(rng, 6, 1, 20, 0), ragged(rng, 4, 1, 20, 0)]
    t = int(sum(c.sum() for c in chunks))
    codes, bits = tokens(rng, t, 12, dim, nbits)
    torch.save(torch.from_numpy(cen), tmp_path / "centroids.pt")
    torch.save((torch.zeros(3), torch.from_numpy(w)), tmp_path / "buckets.pt")
    with open(tmp_path / "metadata.json", "w") as f:
        json.dump({"config": {"dim": dim, "nbits": nbits}, "num_chunks": 2, "num_partitions": 12}, f)
    at = 0
    for i, lens in enumerate(chunks):
        n = int(lens.sum())
        torch.save(torch.from_numpy(codes[at:at + n].astype(np.int32)), tmp_path / f"{i}.codes.pt")
        # a non-contiguous view saved as such: the reader follows its strides
        torch.save(torch.from_numpy(np.ascontiguousarray(bits[at:at + n].T)).T, tmp_path / f"{i}.residuals.pt")
        with open(tmp_path / f"doclens.{i}.json", "w") as f:
            json.dump([int(x) for x in lens], f)
        at += n
    idx = plaid.PlaidIndex.open(tmp_path)
    assert idx.kind == "colbertv2" and len(idx) == 10
    np.testing.assert_array_equal(idx.codes, codes)
    np.testing.assert_array_equal(idx.residual_bits, bits)
    np.testing.assert_array_equal(idx.centroids, cen)
    Q = rng.standard_normal((1, 5, dim)).astype(np.float32)
    emb = plaid_decompress_ref(codes, bits, cen, idx.bucket_weights, nbits)
    off = np.concatenate([[0], np.cumsum(np.concatenate(chunks))])
    s = idx.rerank(Q, np.array([[9, 0]]), backend="cpu")
    assert_scores(s[:1], Q, [emb[off[9]:off[10]], emb[:off[1]]])


def test_fast_plaid_built_index(rng, tmp_path):
    # An index built by fast-plaid itself (on the CPU): our embeddings against its get_embeddings
    # (it decompresses in float16, so to about 2^-11 of each value), and our exact scores of the
    # documents its search returns against the scores its exact stage gave them.
    search = pytest.importorskip("fast_plaid.search")
    torch = pytest.importorskip("torch")
    torch.manual_seed(int(rng.integers(1 << 30)))
    for nbits in (1, 2, 4):
        docs = [torch.nn.functional.normalize(torch.randn(int(n), 128), dim=-1) for n in rng.integers(3, 60, 150)]
        path = tmp_path / f"fp{nbits}"
        fp = search.FastPlaid(index=str(path), device="cpu")
        fp.create(documents_embeddings=docs, nbits=nbits)
        idx = plaid.PlaidIndex.open(path)
        assert idx.kind == "fast-plaid" and len(idx) == 150 and idx.nbits == nbits
        ids = [0, 7, 149, 75]
        for theirs, ours in zip(fp.get_embeddings(ids), idx.embeddings(ids)):
            np.testing.assert_allclose(ours, theirs.float().numpy(), atol=2e-3)
        q = torch.nn.functional.normalize(torch.randn(3, 16, 128), dim=-1)
        for i, r in enumerate(fp.search(queries_embeddings=q, top_k=40, n_full_scores=4096)):
            pids = np.array([p for p, _ in r])
            theirs = np.array([s for _, s in r])
            ours = idx.rerank(q[i].numpy(), pids, backend="cpu")
            np.testing.assert_allclose(ours, theirs, atol=16 * 2e-3)


# ---------------------------------------------------------------- kernel choice (no GPU needed)


def test_residual_tiles_fit_and_follow_the_rules():
    from lik_cupy import _dispatch as dispatch

    for cc in (80, 86, 89, 90, 120):
        arch = dispatch.arch_of(cc)
        for dim in range(8, 513, 8):
            for lq, shared in ((1, 1), (32, 1), (64, 1), (300, 1), (8, 16)):
                for packed, cand in ((False, False), (True, False), (True, True)):
                    c = dispatch.choose_residual(cc, "float16", dim, lq, 2, True, shared, packed, cand)
                    where = (cc, dim, lq, shared, packed, cand, c.name)
                    assert c.smem_bytes <= dispatch.SMEM_PER_BLOCK.get(arch, 99 * 1024), where
                    assert c.residual == 2 and c.cand == cand and c.packed == packed and not c.token_split, where
                    assert not (c.wgmma or c.tma or c.split) and c.vec and c.stages >= 3, where
                    assert c.dp == dispatch.padded_dim(dim) and c.multi == (shared > 1 and not cand), where
                    assert c.threads * (168 if c.multi else 128) * c.min_blocks <= 65536, where
                    assert dispatch.ctas_per_sm(c, cc) >= 1, where
    assert dispatch.choose_residual(90, "bfloat16", 128, 32, 4, False).elem == 1
    for bad in (12, 0, 520):
        with pytest.raises(ValueError, match="multiple of 8 up to 512"):
            dispatch.choose_residual(90, "float16", bad, 32, 2, False)
    with pytest.raises(ValueError, match="nbits must be 1, 2 or 4"):
        dispatch.choose_residual(90, "float16", 128, 32, 3, False)
    # the compile check builds them: every kernel they can name is among all_forward_configs
    names = {c.name for c in dispatch.all_forward_configs(90)}
    assert {c.name for c in dispatch.all_residual_configs(90)} <= names
    assert dispatch.choose_residual(90, "float16", 128, 32, 2, False, 1, True, True).name in names


def test_residual_kernel_parameter_layout():
    # ResidualSrc in cuda_src/fwd/config.cuh: four pointers, then four ints
    from lik_cupy._runtime.residual import _SRC

    assert _SRC.size == 48
    src = (open(os.path.join(os.path.dirname(__file__), "..", "cuda_src", "fwd", "config.cuh")).read())
    body = src[src.index("struct ResidualSrc {"):src.index("};", src.index("struct ResidualSrc {"))]
    fields = [line.split("//")[0].strip() for line in body.splitlines()[1:] if line.split("//")[0].strip()]
    assert [f.split()[0] for f in fields] == ["const"] * 4 + ["int"] * 4, fields


@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_indexes_fast_plaid_built(nbits):
    # Indexes fast-plaid 1.7 built (tests/data/fast_plaid/make_fixture.py), with what its
    # get_embeddings and its exact stage returned: CI checks the real tool's files without it.
    data = pathlib.Path(__file__).parent / "data" / "fast_plaid"
    idx = plaid.PlaidIndex.open(data / f"fast_plaid_nbits{nbits}")
    want = np.load(data / f"fast_plaid_nbits{nbits}_expected.npz")
    assert idx.kind == "fast-plaid" and len(idx) == 60 and idx.nbits == nbits
    ours = idx.embeddings(want["ids"])
    assert [len(e) for e in ours] == want["lengths"].tolist()
    np.testing.assert_allclose(np.concatenate(ours), want["embeddings"], atol=2e-3)  # theirs: float16
    for q, pids, scores in zip(want["queries"], want["pids"], want["scores"]):
        found = pids >= 0
        np.testing.assert_allclose(idx.rerank(q, pids[found], backend="cpu"), scores[found], atol=16 * 2e-3)


@pytest.mark.parametrize("nbits", [1, 2, 4])
def test_index_rerank_equals_decompress_then_maxsim_varlen(rng, nbits):
    # fast-plaid's own indexes: rerank gives bit for bit the scores and argmax of maxsim_varlen over
    # the decompressed float32 embeddings (what embeddings() returns), whose scores lie within the
    # float32 rounding of those embeddings (2^-24 of each value, unit-length tokens: 2^-24 ||q|| a
    # query token) and of the score itself of the float64 MaxSim of the float64 embeddings.
    data = pathlib.Path(__file__).parent / "data" / "fast_plaid"
    idx = plaid.PlaidIndex.open(data / f"fast_plaid_nbits{nbits}")
    Q = np.load(data / f"fast_plaid_nbits{nbits}_expected.npz")["queries"]
    off = idx.offsets
    for cand in (rng.integers(0, len(idx), (Q.shape[0], 25)), np.tile(np.arange(len(idx)), (Q.shape[0], 1))):
        s, a = idx.rerank(Q, cand, return_argmax=True, backend="cpu")
        want_s, want_a = _decompressed_and_scored(Q, None, idx.codes, idx.residual_bits, off, idx.centroids,
                                                  idx.bucket_weights, nbits, cand)
        np.testing.assert_array_equal(s, want_s)
        np.testing.assert_array_equal(a, want_a)
        emb = plaid_decompress_ref(idx.codes, idx.residual_bits, idx.centroids, idx.bucket_weights, nbits)
        exact = ref_scores(Q, [emb[off[j]:off[j + 1]] for j in range(len(idx))])
        exact = np.take_along_axis(exact, cand, axis=1)
        room = 2.0**-24 * np.linalg.norm(Q.astype(np.float64), axis=2).sum(axis=1)[:, None] * 1.01
        assert np.all(np.abs(s - exact) <= room + np.spacing(np.abs(s))), np.abs(s - exact).max()


def test_zero_tokens_and_no_candidates():
    """Decompressing no codes gives no embeddings (the residual rows' width is known, not inferred);
    an empty list of candidates reranks to empty scores, as the functions it wraps do."""
    cen, w = np.eye(4, 8, dtype=np.float16), np.array([0, 1], np.float16)
    assert plaid.decompress_residuals(np.zeros(0, np.int64), np.zeros((0, 1), np.uint8), cen, w, 1).shape == (0, 8)
    assert plaid.decompress_residuals(np.zeros((3, 0), np.int64), np.zeros((3, 0, 1), np.uint8), cen, w,
                                      1).shape == (3, 0, 8)
    idx = lik_cupy.PlaidIndex.open(pathlib.Path(__file__).parent / "data" / "fast_plaid" / "fast_plaid_nbits2")
    assert idx.embeddings([]) == []
    Q = np.ones((3, 4, idx.dim), np.float32)
    assert idx.rerank(Q[0], [], backend="cpu").shape == (0,)
    assert idx.rerank(Q, [[], [], []], backend="cpu").shape == (3, 0)
    with pytest.raises(TypeError, match="candidate_ids is None"):
        idx.rerank(Q, None, backend="cpu")
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="candidate_ids is a numpy array but Q is a torch array"):
        idx.rerank(torch.from_numpy(Q[0]), np.array([0, 1]), backend="cpu")
    assert idx.rerank(torch.from_numpy(Q[0]), [0, 1], backend="cpu").shape == (2,)  # a list goes with any framework


def test_index_rerank_checks_its_arguments_before_converting_them(monkeypatch):
    """rerank copied Q (and its mask, lengths and ids) to the host, or to the GPU, before checking it: bad
    input paid for the copy, and a Q that was no array got an error naming no argument."""
    idx = lik_cupy.PlaidIndex.open(pathlib.Path(__file__).parent / "data" / "fast_plaid" / "fast_plaid_nbits2")
    real = plaid.host_array

    def host_array(x, fw):
        if np.asarray(x).dtype.kind == "f":
            raise AssertionError("Q was converted before the arguments were checked")
        return real(x, fw)

    monkeypatch.setattr(plaid, "host_array", host_array)
    Q, n = np.ones((2, 3, idx.dim), np.float32), len(idx)
    cases = [
        (lambda: idx.rerank(Q[..., :8], [[0], [1]]), ValueError, f"Q has dim 8 but the index has dim {idx.dim}"),
        (lambda: idx.rerank(Q, [[0, 1]]), ValueError, "candidate_ids has shape [1, 2]; expected [Nq, K] with Nq = 2"),
        (lambda: idx.rerank(Q, np.array([[0.5], [1]])), TypeError, "candidate_ids must be int32 or int64 document ids"),
        (lambda: idx.rerank(Q, [[0], [n]]), ValueError, f"candidate_ids holds {n}; every entry must be in [0, {n - 1}]"),
        (lambda: idx.rerank(Q.astype(np.float64), [[0], [1]]), TypeError, "Q has dtype float64; expected float16"),
        (lambda: idx.rerank(Q.tolist(), [[0], [1]]), TypeError, "Q: expected a NumPy"),
        (lambda: idx.rerank(Q, [[0], [1]], q_lengths=[3]), ValueError, "q_lengths has shape [1]; expected [2]"),
    ]
    for call, err, msg in cases:
        with pytest.raises(err, match=re.escape(msg)):
            call()


def test_index_rerank_scores_host_queries_on_the_device_of_to_device(monkeypatch):
    """rerank of host queries took the current GPU, whatever ``to_device(n)`` had chosen: a second copy of
    the compressed corpus on device 0 and the work there. Now they are scored on device n (and come back
    on the host); the GPU is faked, so what is checked is the device each step is asked for."""
    from lik_cupy._dispatch import backend as backend_mod

    idx = lik_cupy.PlaidIndex.open(pathlib.Path(__file__).parent / "data" / "fast_plaid" / "fast_plaid_nbits2")
    asked = []

    class Stop(Exception):
        pass

    def on_device(self, device):
        asked.append(("copy", device))
        return (0 if device is None else device), (None,) * 5

    class FakeCall:
        def __init__(self, p, device=None):
            asked.append(("call", device))
            raise Stop

    monkeypatch.setattr(plaid, "gpu_available", lambda: True)
    monkeypatch.setattr(backend_mod, "gpu_available", lambda: True)
    monkeypatch.setattr(plaid, "present", lambda d: d)
    monkeypatch.setattr(plaid.PlaidIndex, "_on_device", on_device)
    monkeypatch.setattr(plaid, "GpuCall", FakeCall)
    Q = np.ones((2, 3, idx.dim), np.float32)
    with pytest.raises(Stop):  # no to_device yet: the current GPU
        idx.rerank(Q, [[0], [1]])
    assert asked == [("copy", None), ("call", 0)]
    asked.clear()
    assert idx.to_device(1) is idx
    assert asked == [("copy", 1)]
    asked.clear()
    for backend in ("auto", "gpu"):
        with pytest.raises(Stop):
            idx.rerank(Q, [[0], [1]], backend=backend)
        assert asked == [("copy", 1), ("call", 1)], backend
        asked.clear()


def _python_calls(f) -> int:
    """Function calls (Python and C) that ``f()`` makes, as sys.setprofile sees them."""
    import sys

    n = 0

    def count(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        f()
    finally:
        sys.setprofile(None)
    return n


def test_index_residuals_gathers_in_whole_array_steps(rng):
    """residuals built one arange per id and concatenated them: Python work (and a temporary array)
    per document asked for. Now the rows come from whole-array steps, whatever the ids, with the same
    arrays bit for bit (empty documents, repeated ids, no ids, int32 ids and lists)."""
    from lik_cupy._plaid_files import IndexArrays

    dim, nbits, nd = 16, 2, 400
    cen, w = codec(rng, 8, dim, nbits)
    lens = ragged(rng, nd, 1, 9, empty=0.3)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    codes, bits = tokens(rng, int(off[-1]), 8, dim, nbits)
    idx = lik_cupy.PlaidIndex(IndexArrays("fast-plaid", nbits, cen, w, codes, bits, off))
    for ids in [rng.integers(0, nd, 50), rng.integers(0, nd, 2000).astype(np.int32), np.flatnonzero(lens == 0),
                np.array([5, 5, 5]), np.zeros(0, np.int64), [], [3, int(np.flatnonzero(lens == 0)[0]), 3]]:
        a = np.asarray(ids, np.int64)
        rows = np.concatenate([np.arange(off[i], off[i + 1]) for i in a] + [np.zeros(0, np.int64)])
        c, b, o = idx.residuals(ids)
        for got, want in ((c, codes[rows]), (b, bits[rows]), (o, np.concatenate([[0], np.cumsum(lens[a])]))):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
        assert o.dtype == np.int64
    few, many = rng.integers(0, nd, 10), rng.integers(0, nd, 2000)
    assert _python_calls(lambda: idx.residuals(many)) <= _python_calls(lambda: idx.residuals(few)) + 5
