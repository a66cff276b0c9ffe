"""PLAID residual documents on the GPU (skipped without one): the residual kernels against float64
MaxSim of the decompressed embeddings, within the bound their float16 (bfloat16) tiles allow.

Each decompressed value is rounded once to the tile's dtype (relative error <= 2^-11, 2^-8 for
bfloat16), so a similarity <q, e> is off by at most |q| |e| 2^-11 and, e having unit length, a score
by at most sum_s |q_s| 2^-11 (queries given as float32 are rounded to float16 too: twice that).
The tests allow twice the bound, plus float32 accumulation.
"""

from __future__ import annotations

import numpy as np
import pytest

import lik_cupy
from lik_cupy import _dispatch as dispatch
from lik_cupy import plaid
from devices import on_gpu
from reference import plaid_decompress_ref
from test_forward_gpu import _cp, _np, _torch
from test_residual_cpu import _write_fast_plaid, codec, ragged, ref_scores, tokens

pytestmark = pytest.mark.gpu


def _bound(Q, q_valid, dtype):
    """Per-query allowance [Nq, 1]: 2 * sum over valid tokens of |q_s| * unit rounding of the tile."""
    u = {"bfloat16": 2.0**-8, "float32": 2.0**-10}.get(dtype, 2.0**-11)
    norms = np.linalg.norm(np.asarray(Q, np.float64), axis=-1) * q_valid
    return 2 * u * norms.sum(axis=1, keepdims=True) + 1e-5


def _check(got, want, bound):
    got = _np(got).astype(np.float64)
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), fin)
    np.testing.assert_array_equal(got[~fin], want[~fin])
    err = np.where(fin, np.abs(got - np.where(fin, want, 0)), 0)
    assert (err <= np.broadcast_to(bound, err.shape) + 1e-5 * np.abs(np.where(fin, want, 0))).all(), err.max()


def _queries(rng, shape, dtype):
    import ml_dtypes

    q = rng.standard_normal(shape)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    return q.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


# Every layout at every nbits for ColBERT's d = 128; other dims (one pass per row of the 8-dim
# chunks a lane decompresses: 8 -> one lane per row, 40 -> four of them with one idle, 96, 256,
# 512 -> 32 lanes) and query lengths (1; 65 and 300 on eight-warp tiles, 300 over three CTAs)
# each with two layouts. Each case compiles a kernel of its own, so the list stays short.
CASES = [(128, 3, 32, nbits, layout) for nbits in (1, 2, 4) for layout in ("padded", "sets", "packed", "candidates")]
CASES += [(96, 2, 7, 2, "packed"), (96, 2, 7, 1, "candidates"), (8, 1, 1, 4, "padded"), (8, 1, 1, 2, "candidates"),
          (40, 2, 65, 1, "sets"), (40, 2, 65, 4, "packed"), (256, 1, 300, 2, "candidates"), (256, 1, 300, 4, "padded"),
          (512, 2, 16, 4, "candidates"), (512, 2, 16, 1, "padded")]


@pytest.mark.parametrize("dim,nq,lq,nbits,layout", CASES)
def test_matches_float64(rng, nbits, dim, nq, lq, layout):
    cen, w = codec(rng, 97, dim, nbits)
    Q = _queries(rng, (nq, lq, dim), np.float16)
    qm = rng.random((nq, lq)) < 0.9
    argmax = layout in ("padded", "candidates")
    if layout in ("padded", "sets"):
        nd, ld = 37, 45
        rows = nq * nd if layout == "sets" else nd
        lens = ragged(rng, rows, 1, ld)
        codes, bits = tokens(rng, rows * ld, 97, dim, nbits)
        shape = (nq, nd, ld) if layout == "sets" else (nd, ld)
        codes, bits = codes.reshape(shape), bits.reshape(shape + (-1,))
        emb = plaid_decompress_ref(codes, bits, cen, w, nbits).reshape(rows, ld, dim)
        docs = [emb[j, :lens[j]] for j in range(rows)]
        got = lik_cupy.maxsim_residual(_cp(Q), _cp(codes), _cp(bits), _cp(lens.reshape(shape[:-1])), _cp(cen), _cp(w),
                                       nbits, _cp(qm), return_argmax=argmax)
        if layout == "sets":
            want = np.stack([ref_scores(Q[i:i + 1], docs[i * nd:(i + 1) * nd], qm[i:i + 1])[0] for i in range(nq)])
        else:
            want = ref_scores(Q, docs, qm)
    else:
        nd = 53
        lens = ragged(rng, nd, 1, 150)
        off = np.concatenate([[0], np.cumsum(lens)])
        codes, bits = tokens(rng, int(off[-1]), 97, dim, nbits)
        emb = plaid_decompress_ref(codes, bits, cen, w, nbits)
        docs = [emb[off[j]:off[j + 1]] for j in range(nd)]
        cand = rng.integers(0, nd, (nq, 29)) if layout == "candidates" else None
        got = lik_cupy.maxsim_residual_varlen(_cp(Q), _cp(codes), _cp(bits), _cp(off), _cp(cen), _cp(w), nbits,
                                              _cp(qm), candidates=None if cand is None else _cp(cand),
                                              return_argmax=argmax)
        want = ref_scores(Q, docs, qm)
        if cand is not None:
            want = np.take_along_axis(want, cand, axis=1)
    scores, amax = got if argmax else (got, None)
    bound = _bound(Q, qm, "float16")
    _check(scores, want, bound)
    if amax is None:
        return
    amax = _np(amax)
    for i in range(nq):
        for j, e in enumerate([docs[k] for k in cand[i]] if layout == "candidates" else docs):
            sim = np.asarray(Q[i], np.float64) @ e.T  # [lq, len]
            for t in range(lq):
                if not qm[i, t] or len(e) == 0:
                    assert amax[i, j, t] == -1
                else:
                    assert 0 <= amax[i, j, t] < len(e)
                    assert sim[t, amax[i, j, t]] >= sim[t].max() - 2 * bound[i, 0]


def test_several_queries_share_a_tile(rng):
    # 16 queries of 8 tokens against shared packed documents take the multi-query tiles.
    dim, nbits, nq, lq = 128, 2, 16, 8
    assert dispatch.choose_residual(90, "float16", dim, lq, nbits, False, nq, True).multi
    cen, w = codec(rng, 50, dim, nbits)
    lens = ragged(rng, 300, 1, 120)
    off = np.concatenate([[0], np.cumsum(lens)])
    codes, bits = tokens(rng, int(off[-1]), 50, dim, nbits)
    Q = _queries(rng, (nq, lq, dim), np.float16)
    got = lik_cupy.maxsim_residual_varlen(_cp(Q), _cp(codes), _cp(bits), _cp(off), _cp(cen), _cp(w), nbits)
    emb = plaid_decompress_ref(codes, bits, cen, w, nbits)
    want = ref_scores(Q, [emb[off[j]:off[j + 1]] for j in range(300)])
    _check(got, want, _bound(Q, np.ones((nq, lq)), "float16"))


@pytest.mark.parametrize("qdtype", ["bfloat16", "float32"])
def test_query_dtypes_and_torch(rng, qdtype):
    torch = pytest.importorskip("torch")
    dim, nbits, nq, lq = 64, 4, 3, 20
    cen, w = codec(rng, 40, dim, nbits, np.float32)  # float32 centroids: rounded to float16 on the GPU
    lens = ragged(rng, 25, 1, 60)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    codes, bits = tokens(rng, int(off[-1]), 40, dim, nbits)
    Q = _queries(rng, (nq, lq, dim), qdtype)
    cand = rng.integers(0, 25, (nq, 9))
    arrays = {"Q": Q, "codes": codes.astype(np.int32), "bits": bits, "off": off, "cen": cen, "w": w, "cand": cand}
    t = {k: _torch(np.ascontiguousarray(v)) for k, v in arrays.items()}
    got = lik_cupy.maxsim_residual_varlen(t["Q"], t["codes"], t["bits"], t["off"], t["cen"], t["w"], nbits,
                                          candidates=t["cand"])
    assert isinstance(got, torch.Tensor) and got.is_cuda and got.dtype == torch.float32
    emb = plaid_decompress_ref(codes, bits, cen.astype(np.float16), w, nbits)
    want = np.take_along_axis(ref_scores(Q.astype(np.float64), [emb[off[j]:off[j + 1]] for j in range(25)]), cand, 1)
    _check(got.cpu().numpy(), want, _bound(Q.astype(np.float64), np.ones((nq, lq)), qdtype))


def test_edges(rng):
    dim, nbits = 32, 1
    cen, w = codec(rng, 6, dim, nbits)
    off = np.array([0, 0, 5, 5, 9])
    codes, bits = tokens(rng, 9, 6, dim, nbits)
    Q = _queries(rng, (2, 4, dim), np.float16)
    args = (_cp(codes), _cp(bits), _cp(off), _cp(cen), _cp(w), nbits)
    s = _np(lik_cupy.maxsim_residual_varlen(_cp(Q), *args, q_lengths=_cp(np.array([0, 4])), normalize=False))
    emb = plaid_decompress_ref(codes, bits, cen, w, nbits, normalize=False)
    assert np.all(s[0] == 0) and np.all(s[1, [0, 2]] == -np.inf)
    want = ref_scores(Q[1:].astype(np.float64), [emb[:5], emb[5:]])[0]
    # Not normalised, so the tokens' own norms scale the float16 tile's rounding (a relative
    # tolerance fails where a score is small next to its terms).
    e_norm = np.linalg.norm(np.asarray(emb, np.float64), axis=-1).max()
    _check(s[1, [1, 3]], want, _bound(Q[1:].astype(np.float64), np.ones((1, 4)), "float16")[0] * max(e_norm, 1.0))
    with pytest.raises(ValueError, match=r"candidates holds 4; every entry must be in \[0, 3\]"):
        lik_cupy.maxsim_residual_varlen(_cp(Q), *args, candidates=_cp(np.array([[0, 4], [1, 1]])))
    # unchecked, an id outside the documents reads nothing and scores NaN (document 0 is empty: -inf)
    s = _np(lik_cupy.maxsim_residual_varlen(_cp(Q), *args, candidates=_cp(np.array([[1, 4], [-1, 0]])),
                                            validate=False))
    assert np.isfinite(s[0, 0]) and np.isnan(s[0, 1]) and np.isnan(s[1, 0]) and s[1, 1] == -np.inf
    q12 = _queries(rng, (1, 2, 12), np.float16)
    cen12, w12 = codec(rng, 6, 12, 2)
    c12, b12 = tokens(rng, 9, 6, 12, 2)
    with pytest.raises(ValueError, match="the residual kernels need a multiple of 8"):
        lik_cupy.maxsim_residual_varlen(_cp(q12), _cp(c12), _cp(b12), _cp(off), _cp(cen12), _cp(w12), 2)


def test_index_rerank_on_the_gpu(rng, tmp_path):
    dim, nbits = 128, 2
    cen, w = codec(rng, 64, dim, nbits)
    chunks = [ragged(rng, 200, 5, 180), ragged(rng, 150, 5, 180)]
    t = int(sum(c.sum() for c in chunks))
    codes, bits = tokens(rng, t, 64, dim, nbits)
    _write_fast_plaid(tmp_path, cen, w, nbits, chunks, codes, bits, merged=True)
    idx = plaid.PlaidIndex.open(tmp_path)
    Q = _queries(rng, (4, 32, dim), np.float16)
    cand = rng.integers(0, len(idx), (4, 100))
    cpu = idx.rerank(Q, cand, backend="cpu")
    gpu = idx.rerank(Q, cand)  # host queries, a GPU present: scored there, returned on the host
    assert isinstance(gpu, np.ndarray)
    _check(gpu, cpu.astype(np.float64), _bound(Q, np.ones((4, 32)), "float16"))
    s, a = idx.rerank(_cp(Q), _cp(cand), return_argmax=True)
    assert a.shape == (4, 100, 32)
    _check(s, cpu.astype(np.float64), _bound(Q, np.ones((4, 32)), "float16"))


def test_index_to_device_scores_host_queries_there(rng, tmp_path, other_gpu):
    # to_device(1) while device 0 is current: host queries are scored on device 1 (no copy of the
    # index on device 0) and come back on the host, equal to the same call on device-1 arrays.
    dim, nbits = 64, 2
    cen, w = codec(rng, 32, dim, nbits)
    chunks = [ragged(rng, 60, 5, 90)]
    codes, bits = tokens(rng, int(chunks[0].sum()), 32, dim, nbits)
    _write_fast_plaid(tmp_path, cen, w, nbits, chunks, codes, bits, merged=True)
    idx = plaid.PlaidIndex.open(tmp_path).to_device(other_gpu)
    Q = _queries(rng, (3, 16, dim), np.float16)
    cand = rng.integers(0, len(idx), (3, 20))
    s, a = idx.rerank(Q, cand, return_argmax=True)
    assert isinstance(s, np.ndarray) and isinstance(a, np.ndarray)
    assert set(idx._device) == {other_gpu}
    ds, da = idx.rerank(*on_gpu((Q, cand), other_gpu), return_argmax=True)
    assert ds.device.id == other_gpu and set(idx._device) == {other_gpu}
    np.testing.assert_array_equal(s, ds.get())
    np.testing.assert_array_equal(a, da.get())
