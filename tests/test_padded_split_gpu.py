"""Token split of padded documents (strided tiles, ``FwdConfig.strided_tile``): split and unsplit
plans give the same bits, scores and argmax, and both match float64 (skipped without a GPU)."""

import numpy as np
import pytest

import lik_cupy
from reference import maxsim_ref, rel_err
from test_forward_gpu import TOL, _argmax_ok, _cast, _cp, _np, _torch, _unit

pytestmark = pytest.mark.gpu


def _forced(monkeypatch, shares):
    """Make every launch of padded documents split them over ``shares`` CTAs a query tile
    (``shares`` None: never split); returns the (strided, token_split) of each launch."""
    from lik_cupy import _dispatch as dispatch

    plan, seen = dispatch.plan_launch, []

    def forced(cfg, cc, sms, nq, nd, lq, shared=1, ntok=0):
        if cfg.strided and shares is not None:
            got = plan(cfg, cc, sms, nq, nd, lq, shared)  # its query tiles
            got = dispatch.Launch(n_qt=got.n_qt, qb=1, docs_per_cta=0, grid=(got.grid[0], shares, 1),
                                  token_split=True)
        else:
            got = plan(cfg, cc, sms, nq, nd, lq, shared, 0 if cfg.strided else ntok)
        seen.append((cfg.strided, got.token_split))
        return got

    monkeypatch.setattr(dispatch, "plan_launch", forced)
    if shares is not None:  # any Ld (the launch asks the table before it plans)
        monkeypatch.setattr(dispatch.tables, "PADDED_SPLIT_MIN_LD", (1, 1))
    return seen


def _problem(rng, case, dtype):
    """(Q, D, kwargs for maxsim, q_valid, d_valid [rows of D, Ld], candidates) of one case: awkward
    lengths (0, 1, Ld), query tiles past a query's length, NaN tokens, masks with holes."""
    dim = 128
    qlen = dlen = dmask = None
    cand = False
    if case == "one_long":  # a document over every share, an empty one, one of a few tokens
        nq, lq, nd, ld = 1, 27, 4, 40_000
        dlen = np.array([ld, 0, 3, int(rng.integers(1, ld))])
    elif case == "two_tiles":  # two query tiles; the second query's second tile lies past its length
        nq, lq, nd, ld = 2, 200, 4, 3003
        qlen = np.array([200, 100])
        dlen = np.array([0, ld, 1, int(rng.integers(2, ld))])
    elif case == "tiny":  # one-token documents: most shares hold nothing
        nq, lq, nd, ld = 1, 5, 4, 1
    elif case == "short":  # documents shorter than a tile (one query: several would share a tile, which never splits)
        nq, lq, nd, ld = 1, 40, 7, 40
        dlen = rng.integers(0, ld + 1, nd)
        dlen[0] = 0
    elif case == "mask":  # holes, a prefix mask (read as a length), an empty one
        nq, lq, nd, ld = 1, 32, 4, 3001
        dmask = rng.random((nd, ld)) < 0.7
        dmask[1] = np.arange(ld) < 2000
        dmask[2] = False
    elif case == "candidates":  # a candidate set per query: D [Nq, K, Ld, d]
        nq, lq, nd, ld = 3, 20, 4, 2500
        dlen = rng.integers(1, ld + 1, (nq, nd))
        dlen[0, 1], dlen[2, 3] = 0, ld
        cand = True
    elif case == "nan":  # NaN tokens late in a document, and one past its length (never seen)
        nq, lq, nd, ld = 1, 64, 3, 7000
        dlen = np.array([ld, 6800, ld])
    else:
        raise AssertionError(case)
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    shape = (nq, nd, ld, dim) if cand else (nd, ld, dim)
    d, d64 = _cast(_unit(rng, *shape), dtype)
    if case == "nan":
        for t in (5000, 6500, 6900):
            d[1, t, 7] = np.nan
            d64[1, t, 7] = np.nan
    rows = nq * nd if cand else nd
    qv = np.ones((nq, lq), bool) if qlen is None else np.arange(lq)[None, :] < qlen[:, None]
    if dmask is not None:
        dv = dmask
    elif dlen is not None:
        dv = np.arange(ld)[None, :] < dlen.reshape(rows, 1)
    else:
        dv = np.ones((rows, ld), bool)
    conv = _torch if dtype == "bfloat16" else _cp
    kw = {}
    if qlen is not None:
        kw["q_lengths"] = conv(qlen)
    if dlen is not None:
        kw["d_lengths"] = conv(dlen)
    if dmask is not None:
        kw["d_mask"] = conv(dmask)
    return conv(q), conv(d), kw, (q64, d64, qv, dv.reshape(rows, ld)), cand


def _split_and_whole(monkeypatch, Q, D, kw, argmax, shares):
    runs = []
    for s in (shares, None):
        with monkeypatch.context() as m:
            seen = _forced(m, s)
            got = lik_cupy.maxsim(Q, D, return_argmax=argmax, **kw)
        taken = [split for strided, split in seen if strided]  # the strided tile's plans
        # Forced: every launch took the split. Not forced: none did (at these lengths the launch
        # does not even plan one).
        assert (taken and all(taken)) if s is not None else not any(taken), seen
        runs.append([_np(x) for x in (got if argmax else (got,))])
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()
    return runs[0]


def _check_reference(case, got, ref64, cand, dtype, argmax):
    q64, d64, qv, dv = ref64
    nq, nd = got[0].shape
    for i in range(nq) if cand else (slice(None),):
        qs = slice(i, i + 1) if cand else i
        dd = d64[i] if cand else d64
        dvi = dv[i * nd:(i + 1) * nd] if cand else dv
        ref, sim = maxsim_ref(q64[qs], dd, qv[qs], dvi)
        if case == "nan":
            s = got[0]
            assert np.isnan(s[:, 1]).all() and np.isfinite(s[:, [0, 2]]).all()
            assert rel_err(s[:, [0, 2]], ref[:, [0, 2]]) < TOL[dtype]
            if argmax:
                assert (got[1][:, 1] == 5000).all()  # the first NaN token wins every row
                _argmax_ok(got[1][:, [0, 2]], sim[:, [0, 2]], qv, dv[[0, 2]], 1e-3)
            continue
        assert rel_err(got[0][qs], ref) < TOL[dtype]
        if argmax:
            _argmax_ok(got[1][qs], sim, qv[qs], dvi, 1e-3)


CASES = ["one_long", "two_tiles", "tiny", "short", "mask", "candidates", "nan"]


@pytest.mark.parametrize("dtype,argmax", [("float16", False), ("float16", True), ("bfloat16", False),
                                          ("bfloat16", True)])
def test_padded_split_matches_whole_documents_bitwise(rng, monkeypatch, dtype, argmax):
    # Every case split over an awkward number of shares (and over as many as a wave holds) gives
    # the unsplit plan's bits; both against float64.
    for case in CASES:
        Q, D, kw, ref64, cand = _problem(rng, case, dtype)
        for shares in (7, 131):
            got = _split_and_whole(monkeypatch, Q, D, kw, argmax, shares)
        _check_reference(case, got, ref64, cand, dtype, argmax)


def test_padded_split_portable_tiles(rng, monkeypatch):
    # The mma.sync tiles (LIK_DISABLE_WGMMA) take the same split.
    monkeypatch.setenv("LIK_DISABLE_WGMMA", "1")
    dtype, argmax = "float16", True
    for case in ("one_long", "mask", "candidates"):
        Q, D, kw, ref64, cand = _problem(rng, case, dtype)
        got = _split_and_whole(monkeypatch, Q, D, kw, argmax, 23)
        _check_reference(case, got, ref64, cand, dtype, argmax)


def test_dispatch_splits_few_long_documents(rng, monkeypatch):
    # Without forcing: one short query against a few documents of 40,000 tokens takes the split
    # (the rule of tables.PADDED_SPLIT_MIN_LD), and pairs (one document per query) too.
    from lik_cupy import _dispatch as dispatch

    plan, seen = dispatch.plan_launch, []

    def recording(*a, **k):
        got = plan(*a, **k)
        seen.append((a[0].strided, got.token_split))
        return got

    Q, D, kw, ref64, _ = _problem(rng, "one_long", "float16")
    monkeypatch.setattr(dispatch, "plan_launch", recording)
    s = _np(lik_cupy.maxsim(Q, D, **kw))
    assert (True, True) in seen
    q64, d64, qv, dv = ref64
    assert rel_err(s, maxsim_ref(q64, d64, qv, dv)[0]) < TOL["float16"]
    seen.clear()
    Qp, Dp = Q[:1].repeat(3, 0), D[:3]
    dl = kw["d_lengths"][:3]
    sp = _np(lik_cupy.maxsim_pairs(Qp, Dp, d_lengths=dl))
    assert (True, True) in seen
    assert sp.tobytes() == s[0, :3].tobytes()


def test_padded_split_is_left_out_of_graph_capture(rng):
    # A captured launch scores whole documents (token_split.py), with the eager call's bits.
    import cupy

    Q, D, kw, _, _ = _problem(rng, "one_long", "float16")
    want = _np(lik_cupy.maxsim(Q, D, **kw)).tobytes()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        out = lik_cupy.maxsim(Q, D, **kw)
        graph = s.end_capture()
        for _ in range(2):
            out.fill(0)
            graph.launch()
            s.synchronize()
            assert _np(out).tobytes() == want


@pytest.mark.parametrize("argmax", [False, True])
def test_int8_padded_split_matches_whole_documents_bitwise(rng, monkeypatch, argmax):
    # INT8 documents take the same split: each piece's rows are maxima of dequantised products,
    # and the merge scales them by the query token's scale as the unsplit tile does. Long queries
    # ("two_tiles") take INT8's tokens-on-M tiles on Hopper whole, and their queries-on-M twins
    # split: the same bits from the other operand order; with the argmax, the two-warpgroup argmax
    # tile splits on its own strided twin (compiled for one CTA an SM).
    for case in ("one_long", "short", "mask", "candidates", "two_tiles"):
        Q, D, kw, (q64, d64, qv, dv), cand = _problem(rng, case, "float16")
        d8, ds = lik_cupy.quantize_int8(D)
        for shares in (7, 131):
            runs = []
            for s in (shares, None):
                with monkeypatch.context() as m:
                    seen = _forced(m, s)
                    got = lik_cupy.maxsim_int8(Q, d8, ds, return_argmax=argmax, **kw)
                taken = [split for strided, split in seen if strided]
                assert (taken and all(taken)) if s is not None else not any(taken), seen
                runs.append([_np(x) for x in (got if argmax else (got,))])
            for a, b in zip(*runs):
                assert a.tobytes() == b.tobytes(), case
        deq = _np(lik_cupy.dequantize_int8(d8, ds)).astype(np.float64)
        for i in range(Q.shape[0]) if cand else (slice(None),):
            qs = slice(i, i + 1) if cand else i
            di = deq[i] if cand else deq
            dvi = dv[i * di.shape[0]:(i + 1) * di.shape[0]] if cand else dv
            ref, _ = maxsim_ref(q64[qs], di, qv[qs], dvi)
            assert rel_err(runs[0][0][qs], ref) < 2e-2, case  # the queries are quantised per token too
