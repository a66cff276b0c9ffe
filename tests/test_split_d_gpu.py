"""Wide embeddings (split-d forward) against a float64 reference (skipped without a GPU).

Dims up to 8192 (the largest the library accepts), odd dims padded on chip, masks, empty documents, argmax, packed
documents, multi-query tiles and per-query candidates. The session script runs this
file a second time with the Hopper kernels forced off.
"""

import os

import numpy as np
import pytest

import lik_cupy
from reference import maxsim_ref, rel_err
from test_forward_gpu import TOL, _argmax_ok, _cast, _np, _torch, _unit
from test_tma_gpu import record_forward_choices

pytestmark = pytest.mark.gpu

DIMS = [1, 3, 17, 384, 512, 513, 768, 1000, 1024, 2048, 4096, 8192]


def _conv(a):
    import cupy

    return _torch(a) if a.dtype.name == "bfloat16" else cupy.asarray(a)


def _masks(rng, nq, lq, nd, ld):
    q_mask = rng.random((nq, lq)) < 0.85
    d_mask = rng.random((nd, ld)) < 0.75
    d_mask[[0, nd - 2]] = False  # empty documents score -inf
    return q_mask, d_mask


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("lq", [23, 77])  # short-query tiles, and the Hopper tiles (Lq > 64)
def test_wide_dims_masks_argmax(rng, dtype, dim, lq):
    if dtype == "float32" and dim not in (17, 513, 1000, 4096):
        pytest.skip("fp32: a sample of the dims (its kernels differ only in the chunk width)")
    nq, nd, ld = 2, 9, int(rng.integers(40, 140))
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    d, d64 = _cast(_unit(rng, nd, ld, dim), dtype)
    q_mask, d_mask = _masks(rng, nq, lq, nd, ld)
    if dtype == "bfloat16":  # torch carries bf16; its masks must come from torch too
        torch = pytest.importorskip("torch")
        qm, dm = torch.from_numpy(q_mask).cuda(), torch.from_numpy(d_mask).cuda()
    else:
        import cupy

        qm, dm = cupy.asarray(q_mask), cupy.asarray(d_mask)
    s, a = lik_cupy.maxsim(_conv(q), _conv(d), qm, dm, return_argmax=True)
    ref, sim = maxsim_ref(q64, d64, q_mask, d_mask)
    assert rel_err(_np(s), ref) < TOL[dtype], dim
    _argmax_ok(_np(a), sim, q_mask, d_mask, 1e-3 if dtype == "float32" else 1e-5)


@pytest.mark.parametrize("dim", [768, 2048])
def test_wide_multi_query_and_lengths(rng, dim):
    # several short queries share one tile; lengths instead of masks
    nq, lq, nd, ld = 9, 13, 31, 57
    q, q64 = _cast(_unit(rng, nq, lq, dim), "float16")
    d, d64 = _cast(_unit(rng, nd, ld, dim), "float16")
    q_len = rng.integers(0, lq + 1, nq)
    d_len = rng.integers(0, ld + 1, nd)
    d_len[4] = 0
    import cupy

    s = lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d), q_lengths=cupy.asarray(q_len), d_lengths=cupy.asarray(d_len))
    ref, _ = maxsim_ref(q64, d64, np.arange(lq)[None] < q_len[:, None], np.arange(ld)[None] < d_len[:, None])
    assert rel_err(_np(s), ref) < TOL["float16"]


@pytest.mark.parametrize("dim", [640, 1000, 4096])
def test_wide_packed_documents(rng, dim):
    lens = rng.integers(0, 90, 14)
    lens[[2, 9]] = 0
    off = np.concatenate([[0], np.cumsum(lens)])
    nq, lq = 3, 70
    q, q64 = _cast(_unit(rng, nq, lq, dim), "bfloat16")
    t, t64 = _cast(_unit(rng, int(off[-1]), dim), "bfloat16")
    s, a = lik_cupy.maxsim_varlen(_torch(q), _torch(t), _torch(off.astype(np.int64)), return_argmax=True)
    ld = int(lens.max())
    dpad = np.zeros((len(lens), ld, dim))
    dv = np.arange(ld)[None] < lens[:, None]
    for j in range(len(lens)):
        dpad[j, : lens[j]] = t64[off[j]: off[j + 1]]
    ref, sim = maxsim_ref(q64, dpad, None, dv)
    assert rel_err(_np(s), ref) < TOL["bfloat16"]
    _argmax_ok(_np(a), sim, np.ones((nq, lq), bool), dv, 1e-5)


@pytest.mark.parametrize("dim", [768, 1000, 2048])
@pytest.mark.parametrize("lq", [1, 20, 32])
@pytest.mark.parametrize("packed", [False, True])
def test_short_query_half_stages(rng, monkeypatch, dim, lq, packed):
    # One query of at most 32 tokens stages 32 query rows per split-d stage on Hopper (the
    # wgmma's other 32 rows read past them into rows that are never used): scores and argmax
    # must match float64 and be bitwise those of the 64-row stages.
    import dataclasses

    import cupy

    from lik_cupy import _dispatch as dispatch

    lens = rng.integers(0, 140, 11)
    lens[3] = 0
    ld = int(lens.max())
    q, q64 = _cast(_unit(rng, 1, lq, dim), "float16")
    d, d64 = _cast(_unit(rng, len(lens), ld, dim), "float16")
    q_mask = rng.random((1, lq)) < 0.9
    dv = np.arange(ld)[None] < lens[:, None]
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = np.concatenate([d[j, : lens[j]] for j in range(len(lens))])

    def run():
        if packed:
            return lik_cupy.maxsim_varlen(cupy.asarray(q), cupy.asarray(tokens), cupy.asarray(off),
                                          cupy.asarray(q_mask), return_argmax=True)
        return lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d), cupy.asarray(q_mask), cupy.asarray(dv),
                               return_argmax=True)

    chosen = dispatch.choose_forward
    picked = record_forward_choices(monkeypatch)
    s, a = (_np(x) for x in run())
    hopper = cupy.cuda.Device().compute_capability == "90" and not os.environ.get("LIK_DISABLE_WGMMA")
    if hopper and not picked[-1].qhalf:
        pytest.fail(f"expected half query stages, dispatch picked {picked[-1].name}")
    ref, sim = maxsim_ref(q64, d64, q_mask, dv)
    assert rel_err(s, ref) < TOL["float16"]
    _argmax_ok(a, sim, q_mask, dv, 1e-5)
    monkeypatch.setattr(dispatch, "choose_forward",
                        lambda *args, **kw: dataclasses.replace(chosen(*args, **kw), qhalf=False))
    s64, a64 = (_np(x) for x in run())
    assert np.array_equal(s, s64, equal_nan=True) and np.array_equal(a, a64)


def test_wide_candidates_layout(rng):
    # per-query candidate sets D [Nq, K, Ld, d] (reranking)
    nq, k, lq, ld, dim = 3, 5, 40, 33, 1536
    q, q64 = _cast(_unit(rng, nq, lq, dim), "float16")
    d, d64 = _cast(_unit(rng, nq, k, ld, dim), "float16")
    import cupy

    s = _np(lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d)))
    for i in range(nq):
        assert rel_err(s[i], maxsim_ref(q64[i: i + 1], d64[i])[0][0]) < TOL["float16"]


def test_wide_long_query_partials(rng):
    # a query longer than one tile: partial scores over several CTAs, summed in a fixed order
    nq, lq, nd, ld, dim = 1, 300, 6, 200, 2048
    q, q64 = _cast(_unit(rng, nq, lq, dim), "float16")
    d, d64 = _cast(_unit(rng, nd, ld, dim), "float16")
    import cupy

    s1 = _np(lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d)))
    s2 = _np(lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d)))
    assert rel_err(s1, maxsim_ref(q64, d64)[0]) < TOL["float16"]
    assert np.array_equal(s1.view(np.uint32), s2.view(np.uint32))  # bitwise reproducible
