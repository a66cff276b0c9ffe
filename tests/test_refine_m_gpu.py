"""Refined float32 tiles with the document tokens on M (``cuda_src/fwd/refine_m.cuh``: the default for
float32 queries of at most 32 tokens scored one to a tile without the argmax, on Hopper; these tests
take it up to 64, the kernel's limit): bit for bit
the scores of the queries-on-M refined tile that dispatch takes without them, and within the float32
contract of float64, on awkward inputs: lengths of 0 and 1, masks with holes, query lengths and masks,
packed documents, planted near ties, NaN, infinities, zero rows, elements whose squares fall below
float32's range, zero-vector padding. Skipped without a Hopper GPU."""

from __future__ import annotations

import numpy as np
import pytest

import lik_cupy
from lik_cupy import _dispatch as dispatch
from lik_cupy._maxsim_calls import maxsim_varlen_zero_pad, maxsim_zero_pad
from reference import maxsim_ref, zero_pad_ref
from test_precision_gpu import CONTRACT_TOL, _contract_err, _cp, _np, _packed, _planted_ties, sum_slack

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _tokens_on_m(monkeypatch):
    """On Hopper, with the tokens-on-M tiles taken for queries of up to 64 tokens and documents of
    any length (the kernel's limits; the rule's ``REFINE_TOKM_MAX_LQ`` and ``REFINE_TOKM_MIN_LD``
    are speed thresholds); cached choices dropped then and after."""
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the tokens-on-M refined tiles are sm_90a tiles")
    monkeypatch.setattr(dispatch.tables, "REFINE_TOKM_MIN_LD", 0)
    monkeypatch.setattr(dispatch.tables, "REFINE_TOKM_MAX_LQ", 64)
    dispatch.clear_caches()
    yield
    monkeypatch.undo()
    dispatch.clear_caches()


def _tile(dim: int, lq: int, packed: bool):
    return dispatch.choose_forward(90, "float32", dim, lq, False, True, True, 1, 300, packed, True, True)


def _both(call):
    """(scores of the tokens-on-M tile, scores of the queries-on-M tile), the second with the rule off."""
    new = _np(call()).copy()
    was = dispatch.tables.REFINE_TOKM_STAGES
    dispatch.tables.REFINE_TOKM_STAGES = ()
    dispatch.clear_caches()
    try:
        old = _np(call()).copy()
    finally:
        dispatch.tables.REFINE_TOKM_STAGES = was
        dispatch.clear_caches()
    return new, old


def _same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b)), "NaN patterns differ"
    diff = a[~nan].view(np.uint32) != b[~nan].view(np.uint32)
    assert not diff.any(), f"{diff.sum()} scores differ, e.g. {a[~nan][diff][:4]} against {b[~nan][diff][:4]}"


def _contract(out, ref, slack=0.0):
    """Within the contract of float64 (``slack``: the score's float32 sum of its rows' maxima may add
    as much, see ``_ref``)."""
    assert _contract_err(out, ref, slack) < CONTRACT_TOL


def _ref(q, d, qv=None, dv=None):
    """float64 scores, and what summing each score's rows' maxima in float32 may add (sum_slack)."""
    ref, sim = maxsim_ref(q, d, qv, dv)
    return ref, sum_slack(sim, qv)


@pytest.mark.parametrize("dim", [32, 64, 96, 128])
@pytest.mark.parametrize("lq,nq", [(1, 1), (7, 3), (32, 1), (33, 2), (64, 1)])
def test_same_bits_as_queries_on_m_and_float64(rng, dim, lq, nq):
    assert _tile(dim, lq, False).tokm and _tile(dim, lq, True).tokm
    nd, ld = 41, int(rng.integers(60, 400))
    q = rng.standard_normal((nq, lq, dim)).astype(np.float32)
    d = rng.standard_normal((nd, ld, dim)).astype(np.float32)
    lens = rng.integers(0, ld + 1, nd).astype(np.int32)
    lens[:3] = [0, 1, ld]
    ql = rng.integers(1, lq + 1, nq).astype(np.int32)
    dv = np.arange(ld)[None, :] < lens[:, None]
    qv = np.arange(lq)[None, :] < ql[:, None]
    ref, slack = _ref(q, d, qv, dv)
    new, old = _both(lambda: lik_cupy.maxsim(_cp(q), _cp(d), d_lengths=_cp(lens), q_lengths=_cp(ql)))
    _same_bits(new, old)
    _contract(new, ref, slack)
    # documents masked with holes, queries masked
    dm = rng.random((nd, ld)) < 0.8
    qm = rng.random((nq, lq)) < 0.7
    qm[:, 0] = True
    ref, slack = _ref(q, d, qm, dm)
    new, old = _both(lambda: lik_cupy.maxsim(_cp(q), _cp(d), q_mask=_cp(qm), d_mask=_cp(dm)))
    _same_bits(new, old)
    _contract(new, ref, slack)
    # packed
    tok, off = _packed(d, lens)
    ref, slack = _ref(q, d, None, dv)
    new, old = _both(lambda: lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off)))
    _same_bits(new, old)
    _contract(new, ref, slack)


@pytest.mark.parametrize("same_lane", [False, True])
@pytest.mark.parametrize("copies,ulps", [(1, 1), (2, 0), (2, 1), (3, 10), (40, 0), (40, 1)])
def test_near_ties_same_bits(rng, copies, ulps, same_lane):
    # several near-max tokens in one thread's slice or in many (same_lane: tokens 8 apart, of which
    # a thread holds two places in every tile): whole columns recomputed
    q, d = _planted_ties(rng, 1, 40, 17, 333, 128, ulps, copies, same_lane)[:2]
    ref = maxsim_ref(q, d)[0]
    new, old = _both(lambda: lik_cupy.maxsim(_cp(q), _cp(d)))
    _same_bits(new, old)
    _contract(new, ref)


def test_nan_inf_and_zero_rows(rng):
    # a NaN document token scores NaN, an infinite element inf or NaN (the exact sums meet inf - inf
    # where float64's dot product need not), as the queries-on-M tile does; a zero query row scores 0
    # against any document with tokens; a NaN past a length is never read
    nd, ld, dim = 8, 200, 128
    q = rng.standard_normal((2, 40, dim)).astype(np.float32)
    d = rng.standard_normal((nd, ld, dim)).astype(np.float32)
    q[0, 7] = 0.0
    q[1, 3, 5] = np.inf
    lens = np.array([200, 150, 150, 90, 1, 0, 200, 130], np.int32)
    d[1, 30, 5] = np.nan
    d[2, 170, 3] = np.nan  # past its length
    d[3, 10, 0] = np.inf
    d[6, 199, 2] = -np.inf
    dv = np.arange(ld)[None, :] < lens[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        ref, slack = _ref(q, d, None, dv)  # document 4 has one token: its rows of both signs cancel
    new, old = _both(lambda: lik_cupy.maxsim(_cp(q), _cp(d), d_lengths=_cp(lens)))
    _same_bits(new, old)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isnan(new[np.isnan(ref)]), np.ones(np.isnan(ref).sum(), bool))
    assert not np.isfinite(new[np.isinf(ref)]).any()
    _contract(new[fin], ref[fin], slack[fin])


@pytest.mark.parametrize("scale", [2.0 ** -80, 2.0 ** 40])
def test_tiny_and_large_elements(rng, scale):
    # squares below float32's range (the bound's floor) and products near its top
    q = rng.standard_normal((1, 32, 128)).astype(np.float32)
    d = (rng.standard_normal((30, 250, 128)) * scale).astype(np.float32)
    ref = maxsim_ref(q, d)[0]
    new, old = _both(lambda: lik_cupy.maxsim(_cp(q), _cp(d)))
    _same_bits(new, old)
    np.testing.assert_allclose(new, ref, rtol=2e-6, atol=0)


def test_zero_vector_padding(rng):
    # each column's max floored at 0 for flagged documents (empty ones score 0 there)
    nd, ld, dim = 24, 180, 128
    q = (rng.standard_normal((1, 32, dim)) / 4).astype(np.float32)
    d = (rng.standard_normal((nd, ld, dim)) / 4).astype(np.float32)
    q[0, 1] = 0.0
    q[0, 1, 0] = -1.0
    d[..., 0] = np.abs(d[..., 0]) + 0.5
    lens = rng.integers(0, ld + 1, nd).astype(np.int32)
    lens[:3] = [ld, 0, 0]
    zp = rng.random(nd) < 0.5
    zp[:3] = [True, True, False]
    dv = np.arange(ld)[None, :] < lens[:, None]
    ref = zero_pad_ref(q, d, np.ones((1, 32), bool), dv, zp)[0]
    new, old = _both(lambda: maxsim_zero_pad(_cp(q), _cp(d), _cp(zp), d_lengths=_cp(lens)))
    _same_bits(new, old)
    _contract(new, ref)
    tok, off = _packed(d, lens)
    new, old = _both(lambda: maxsim_varlen_zero_pad(_cp(q), _cp(tok), _cp(off), _cp(zp)))
    _same_bits(new, old)
    _contract(new, ref)


def test_few_long_documents_split_on_the_queries_on_m_twin(rng):
    # packed documents few and long: the launch splits them over CTAs on the queries-on-M tile
    q = rng.standard_normal((1, 32, 128)).astype(np.float32)
    lens = np.array([9000, 1, 7000, 0])
    d = rng.standard_normal((4, 9000, 128)).astype(np.float32)
    tok, off = _packed(d, lens)
    ref = maxsim_ref(q, d, None, np.arange(9000)[None, :] < lens[:, None])[0]
    _contract(_np(lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off))), ref)


def test_many_documents_many_ctas(rng):
    # several query tiles' worth of queries against more documents than a wave takes (the tests poison
    # every output first, so a score no CTA wrote would show)
    q = rng.standard_normal((5, 20, 128)).astype(np.float32)
    d = rng.standard_normal((3001, 70, 128)).astype(np.float32)
    ref = maxsim_ref(q, d)[0]
    _contract(_np(lik_cupy.maxsim(_cp(q), _cp(d))), ref)


@pytest.mark.parametrize("packed", [False, True])
def test_first_document_without_tiles(rng, packed):
    # A CTA whose first document is empty reaches that document's end before its first stage, where
    # the query tile's copies are awaited; the column weights, taken there once per CTA, wait for
    # them too. Every second document is empty, so most CTAs start with one, and a call with a zero
    # query first leaves zeros where the query tiles land: weights read from there would make every
    # product look exact. (On an H200 the copies landed in time without the wait as well, even from
    # managed memory moved to the host: the race was found by reading, and this checks the scores
    # whatever the timing.)
    q = rng.standard_normal((1, 32, 128)).astype(np.float32)
    nd, ld = 800, 160
    d = rng.standard_normal((nd, ld, 128)).astype(np.float32)
    lens = rng.integers(1, ld + 1, nd).astype(np.int32)
    lens[::2] = 0
    ref, slack = _ref(q, d, None, np.arange(ld)[None, :] < lens[:, None])
    tok, off = _packed(d, lens)

    def call(x):
        if packed:
            return lik_cupy.maxsim_varlen(_cp(x), _cp(tok), _cp(off))
        return lik_cupy.maxsim(_cp(x), _cp(d), d_lengths=_cp(lens))

    assert _tile(128, 32, packed).tokm
    for _ in range(3):
        call(np.zeros_like(q))
        _contract(_np(call(q)), ref, slack)
