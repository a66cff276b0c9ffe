"""Zero-vector padding on the GPU (``lik_cupy._maxsim_calls.maxsim_zero_pad`` and
``maxsim_varlen_zero_pad``: each row max of a flagged document floored at 0 in the kernel's
epilogue, NaN kept, argmax -1 where the floor wins) against the float64 reference of those
semantics, on every tile kind the flag reaches: several queries a tile and one, query tiles summed
as partials, padded (lengths, masks with holes, candidates) and packed documents, and token-split
plans forced to split (their merged maxima floored once), bit for bit as the whole plans; then the
PyLate and colpali-engine paths built on it, gradients against PyLate's torch path. Skipped without
a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from lik_cupy._maxsim_calls import maxsim_varlen_zero_pad as _maxsim_varlen_zero_pad
from lik_cupy._maxsim_calls import maxsim_zero_pad as _maxsim_zero_pad
from reference import masked_maxsim_ref, maxsim_ref, negative_token_inputs, padding_mask, zero_pad_ref
from test_forward_gpu import TOL, _cast, _cp, _np, _torch

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32"]
NEAR = 2e-3  # a true max this close to 0 may be floored or not, after the kernel's rounding


def _conv(dtype):
    return _torch if dtype == "bfloat16" else _cp  # NumPy has no bf16 array to hand to CuPy


def _embeddings(rng, q_shape, d_shape, dtype):
    """Q, D (as the library takes them, and float64 of exactly that) whose similarities straddle 0:
    query 0's token 1 is below 0 against every document token."""
    q = rng.standard_normal(q_shape) / 4
    d = rng.standard_normal(d_shape) / 4
    d[..., 0] = np.abs(d[..., 0]) + 0.5
    q[0, 1] = 0.0
    q[0, 1, 0] = -1.0
    return (*_cast(q, dtype), *_cast(d, dtype))


def _flags(rng, nd):
    zp = rng.random(nd) < 0.5
    zp[:2] = True  # documents 0 (full) and 1 (empty) flagged, 2 (empty) not
    zp[2] = False
    return zp


def _check(got, ref, ref_a, near, sim_valid, dtype, amax=None):
    """Scores within TOL of the reference (non-finite ones equal, NaN where NaN); each argmax -1 where
    the reference's is, else a valid token within rounding of the row max (rows near 0 skipped)."""
    s = np.asarray(got, np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(s), fin), "non-finite pattern differs from the reference"
    assert np.array_equal(s[~fin], ref[~fin], equal_nan=True)
    if fin.any():
        err = np.linalg.norm(s[fin] - ref[fin]) / max(np.linalg.norm(ref[fin]), 1e-30)
        assert err < TOL[dtype], f"relative error {err:.2e}"
    if amax is None:
        return
    sim, dv = sim_valid  # [Nq, Nd, Lq, Ld] float64 (padding -inf), bool [Nd, Ld]
    a = np.asarray(amax)
    none = (ref_a < 0) & ~near
    assert (a[none] == -1).all(), "argmax not -1 where the floor, an empty document or a masked token wins"
    i, j, r = np.nonzero((ref_a >= 0) & ~near)
    got, want = a[i, j, r], ref_a[i, j, r]
    assert ((got >= 0) & (got < sim.shape[3])).all()
    with np.errstate(invalid="ignore"):
        best = sim.max(axis=3)[i, j, r]
    nan_row = np.isnan(best)
    assert np.array_equal(got[nan_row], want[nan_row]), "the first NaN token wins its row"
    got, best = got[~nan_row], best[~nan_row]
    i, j, r = i[~nan_row], j[~nan_row], r[~nan_row]
    assert dv[j, got].all(), "argmax on a padding token"
    rtol = 1e-3 if dtype == "float32" else 1e-4
    assert (sim[i, j, r, got] >= best - rtol * (np.abs(best) + 1)).all()


def _run_padded(rng, dtype, argmax, nq, lq, nd, ld, dim, how):
    q, q64, d, d64 = _embeddings(rng, (nq, lq, dim), (nd, ld, dim), dtype)
    qv = rng.random((nq, lq)) < 0.85
    qv[0, :2] = True
    zp = _flags(rng, nd)
    zp[3:5] = True
    conv = _conv(dtype)
    if how == "lengths":
        dlen = rng.integers(1, ld + 1, nd)
        dlen[:5] = (ld, 0, 0, ld // 3, ld // 2)
        dv = np.arange(ld)[None] < dlen[:, None]
        kw = {"d_lengths": conv(dlen)}
    else:
        dv = rng.random((nd, ld)) < 0.7
        dv[0], dv[1], dv[2] = True, False, False
        dv[3, 0] = True
        dv[4, ld // 2:] = False
        kw = {"d_mask": conv(dv)}
    # NaN in the last valid token of flagged document 3 (its scores are NaN, not floored), and in
    # every padding token of flagged document 4 (never read)
    t_nan = int(np.flatnonzero(dv[3])[-1])
    d[3, t_nan, 3] = d64[3, t_nan, 3] = np.nan
    d[4, ~dv[4]] = np.nan
    out = _maxsim_zero_pad(conv(q), conv(d), conv(zp), conv(qv), return_argmax=argmax, **kw)
    ref, ref_a, near = zero_pad_ref(q64, d64, qv, dv, zp, NEAR)
    assert np.isnan(ref[:, 3]).all() and np.isfinite(ref[:, 4]).all()
    sim = maxsim_ref(q64, d64, qv, dv)[1]
    got = [_np(x) for x in (out if argmax else (out,))]
    _check(got[0], ref, ref_a, near, (sim, dv), dtype, got[1] if argmax else None)
    assert (got[0][:, 1] == 0).all() and (got[0][:, 2][qv.any(1)] == -np.inf).all()
    return got


@pytest.mark.parametrize("argmax", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["mask", "lengths"])
@pytest.mark.parametrize("shape", [(9, 13, 37, 61, 64),  # several short queries a tile
                                   (2, 200, 23, 131, 128),  # query tiles summed as partials
                                   (3, 45, 29, 300, 96)])
def test_padded_documents_floor_their_rows(rng, shape, how, dtype, argmax):
    _run_padded(rng, dtype, argmax, *shape, how)


@pytest.mark.parametrize("dtype", DTYPES)
def test_candidates_floor_by_their_own_flags(rng, dtype):
    nq, k, lq, ld, dim = 3, 7, 33, 90, 64
    q, q64, d, d64 = _embeddings(rng, (nq, lq, dim), (nq, k, ld, dim), dtype)
    dv = rng.random((nq, k, ld)) < 0.6
    dv[0, 1] = False
    zp = rng.random((nq, k)) < 0.5
    zp[0, 1] = True
    qv = np.ones((nq, lq), bool)
    conv = _conv(dtype)
    s, a = (_np(x) for x in _maxsim_zero_pad(conv(q), conv(d), conv(zp), None, conv(dv), return_argmax=True))
    for i in range(nq):
        ref, ref_a, near = zero_pad_ref(q64[i:i + 1], d64[i], qv[i:i + 1], dv[i], zp[i], NEAR)
        sim = maxsim_ref(q64[i:i + 1], d64[i], qv[i:i + 1], dv[i])[1]
        _check(s[i:i + 1], ref, ref_a, near, (sim, dv[i]), dtype, a[i:i + 1])
    assert (s[0, 1] == 0).all()


def _packed(rng, dtype, nq, lq, lens, dim):
    lens = np.asarray(lens)
    nd, ld = len(lens), int(lens.max())
    q, q64, d, d64 = _embeddings(rng, (nq, lq, dim), (nd, ld, dim), dtype)
    dv = np.arange(ld)[None] < lens[:, None]
    tokens, offsets = d[dv], np.concatenate([[0], np.cumsum(lens)])
    return q, q64, tokens, offsets, d64, dv


@pytest.mark.parametrize("argmax", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nq,lq", [(12, 9), (1, 40), (2, 150)])
def test_packed_documents_floor_their_rows(rng, nq, lq, dtype, argmax):
    lens = rng.integers(1, 400, 31)
    lens[[1, 2]] = 0
    q, q64, tokens, offsets, d64, dv = _packed(rng, dtype, nq, lq, lens, 128)
    zp = _flags(rng, len(lens))
    conv = _conv(dtype)
    out = _maxsim_varlen_zero_pad(conv(q), conv(tokens), conv(offsets), conv(zp), return_argmax=argmax)
    got = [_np(x) for x in (out if argmax else (out,))]
    qv = np.ones((nq, lq), bool)
    ref, ref_a, near = zero_pad_ref(q64, d64, qv, dv, zp, NEAR)
    _check(got[0], ref, ref_a, near, (maxsim_ref(q64, d64, qv, dv)[1], dv), dtype, got[1] if argmax else None)


def _forced(monkeypatch, shares):
    """Every token-split-capable launch split over ``shares`` CTAs a query tile (None: none split);
    returns the token_split of each launch of such a tile."""
    from lik_cupy import _dispatch as dispatch

    plan, seen = dispatch.plan_launch, []

    def forced(cfg, cc, sms, nq, nd, lq, shared=1, ntok=0):
        if cfg.token_split and shares is not None:
            got = plan(cfg, cc, sms, nq, nd, lq, shared)
            got = dispatch.Launch(n_qt=got.n_qt, qb=1, docs_per_cta=0, grid=(got.grid[0], shares, 1), token_split=True)
        else:
            got = plan(cfg, cc, sms, nq, nd, lq, shared, 0 if cfg.token_split else ntok)
        if cfg.token_split:
            seen.append(got.token_split)
        return got

    monkeypatch.setattr(dispatch, "plan_launch", forced)
    if shares is not None:  # padded documents of any length take the strided tile
        monkeypatch.setattr(dispatch.tables, "PADDED_SPLIT_MIN_LD", (1, 1))
    return seen


@pytest.mark.parametrize("argmax", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_token_split_floors_the_merged_rows(rng, monkeypatch, layout, dtype, argmax):
    # Pieces keep their raw maxima; the last CTA floors the merged ones: bit for bit the whole plan.
    nq, lq, dim = 2, 150, 128  # the second query tile lies past query 1's length
    conv = _conv(dtype)
    if layout == "padded":
        nd, ld = 5, 6000
        q, q64, d, d64 = _embeddings(rng, (nq, lq, dim), (nd, ld, dim), dtype)
        dlen = np.array([ld, 0, 0, 5, int(rng.integers(4000, ld))])
        dv = np.arange(ld)[None] < dlen[:, None]
        args = (conv(q), conv(d))
        kw = {"d_lengths": conv(dlen)}
        fn = _maxsim_zero_pad
    else:
        lens = np.array([5000, 0, 0, 5, 2000, 6000, 1])
        q, q64, tokens, offsets, d64, dv = _packed(rng, dtype, nq, lq, lens, dim)
        nd = len(lens)
        args = (conv(q), conv(tokens), conv(offsets))
        kw = {}
        fn = _maxsim_varlen_zero_pad
    qlen = np.array([lq, 100])
    zp = _flags(rng, nd)
    runs = []
    for shares in (7, 131, None):
        with monkeypatch.context() as m:
            seen = _forced(m, shares)
            out = fn(*args, conv(zp), q_lengths=conv(qlen), return_argmax=argmax, **kw)
        assert (seen and all(seen)) if shares is not None else not any(seen), seen
        runs.append([_np(x) for x in (out if argmax else (out,))])
    for got in runs[:2]:
        assert all(x.tobytes() == y.tobytes() for x, y in zip(got, runs[2]))
    qv = np.arange(lq)[None] < qlen[:, None]
    ref, ref_a, near = zero_pad_ref(q64, d64, qv, dv, zp, NEAR)
    got = runs[2]
    _check(got[0], ref, ref_a, near, (maxsim_ref(q64, d64, qv, dv)[1], dv), dtype, got[1] if argmax else None)


def test_every_document_empty(rng):
    import cupy

    q = cupy.asarray(rng.standard_normal((3, 5, 32)).astype(np.float16))
    zp = np.array([True, False, True, False])
    qlen = cupy.asarray([5, 0, 2])
    s = _np(_maxsim_zero_pad(q, cupy.zeros((4, 0, 32), np.float16), cupy.asarray(zp), q_lengths=qlen))
    want = np.where(zp, 0.0, -np.inf)[None].repeat(3, 0)
    want[1] = 0  # a query without tokens
    assert np.array_equal(s, want)
    s = _np(_maxsim_varlen_zero_pad(q, cupy.zeros((0, 32), np.float16), cupy.zeros(5, np.int64), cupy.asarray(zp),
                                    q_lengths=qlen))
    assert np.array_equal(s, want)


def test_repeat_and_general_paths_agree(rng):
    # The first call of a signature leaves a prepared call that the second takes; a strict call
    # (validate=True) takes the general path each time: the same bits.
    torch = pytest.importorskip("torch")
    q, _, d, _ = _embeddings(rng, (4, 32, 128), (50, 70, 128), "float16")
    dm = torch.from_numpy(rng.random((50, 70)) < 0.8).cuda()
    zp = torch.from_numpy(_flags(rng, 50)).cuda()
    Q, D = torch.from_numpy(q).cuda(), torch.from_numpy(d).cuda()
    outs = [_maxsim_zero_pad(Q, D, zp, None, dm, return_argmax=True, validate=v) for v in (None, None, True)]
    for s, a in outs[1:]:
        assert s.cpu().numpy().tobytes() == outs[0][0].cpu().numpy().tobytes()
        assert torch.equal(a, outs[0][1])
    plain = _maxsim_zero_pad(Q, D, torch.zeros_like(zp), None, dm)
    import lik_cupy

    assert torch.equal(plain, lik_cupy.maxsim(Q, D, None, dm))


@pytest.mark.parametrize("layout", ["padded", "candidates"])
def test_masked_flags_come_with_the_mask_spans(rng, layout):
    # zero_pad="masked" (PyLate's masks): the flags the spans kernel writes give the bits that flags
    # computed from the mask give, on the general path (first call) and the repeat path, for full,
    # empty, prefix and holed masks; with no document token, no document is masked.
    torch = pytest.importorskip("torch")
    d_shape = (37, 70, 128) if layout == "padded" else (4, 9, 70, 128)
    q, _, d, _ = _embeddings(rng, (4, 32, 128), d_shape, "float16")
    dm = rng.random(d_shape[:-1]) < 0.8
    rows = dm.reshape(-1, 70)
    rows[0], rows[1], rows[2] = True, False, np.arange(70) < 33
    Q, D, DM = torch.from_numpy(q).cuda(), torch.from_numpy(d).cuda(), torch.from_numpy(dm).cuda()
    want = _maxsim_zero_pad(Q, D, ~DM.all(-1), None, DM, return_argmax=True)
    for _ in range(2):
        got = _maxsim_zero_pad(Q, D, "masked", None, DM, return_argmax=True)
        assert got[0].cpu().numpy().tobytes() == want[0].cpu().numpy().tobytes()
        assert torch.equal(got[1], want[1])
    empty = _maxsim_zero_pad(Q, D[..., :0, :], "masked", None, DM[..., :0])
    assert bool((empty == -float("inf")).all())


# ---------------------------------------------------------------- the integrations built on it

GRAD_TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-4}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["inbatch", "kd"])
def test_pylate_masked_gradients_match_the_torch_path(rng, layout, dtype):
    torch = pytest.importorskip("torch")
    from lik_cupy.integrations import pylate as lp

    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    d_shape = (19, 53, 96) if layout == "inbatch" else (6, 4, 53, 96)
    Q, D = negative_token_inputs(rng, (6, 29, 96), d_shape)
    qm = torch.from_numpy(padding_mask(rng, Q.shape[:-1])).cuda()
    dm = torch.from_numpy(padding_mask(rng, D.shape[:-1]).astype(np.int64)).cuda()  # PyLate's attention masks
    Q, D = (torch.from_numpy(x).to("cuda", tdt).requires_grad_(True) for x in (Q, D))
    Q64, D64 = (x.detach().double().requires_grad_(True) for x in (Q, D))
    fn = lp.colbert_scores if layout == "inbatch" else lp.colbert_kd_scores
    out = fn(Q, D, qm, dm)
    ref = masked_maxsim_ref(Q64, D64, qm, dm)
    assert ((out.double() - ref).norm() / ref.norm()).item() < (2e-3 if dtype == "float32" else 1e-4)
    g = torch.randn(ref.shape, device="cuda", dtype=torch.float64, generator=torch.Generator("cuda").manual_seed(5))
    (out * g.float()).sum().backward()
    (ref * g).sum().backward()
    for mine, theirs in ((Q.grad, Q64.grad), (D.grad, D64.grad)):
        assert ((mine.double() - theirs).norm() / theirs.norm()).item() < GRAD_TOL[dtype]


@pytest.mark.parametrize("where", ["cuda", "cpu"])
def test_colpali_pages_packed_and_stacked(rng, monkeypatch, where):
    # Chunks of equal pages are stacked, ragged ones packed with their short pages flagged.
    torch = pytest.importorskip("torch")
    from lik_cupy.integrations import colpali as lc

    lens = [1030] * 6 + list(rng.integers(700, 1031, 9)) + [1030] * 3
    qs = [torch.from_numpy(rng.standard_normal((n, 128))).to(where, torch.bfloat16) for n in (20, 17, 25)]
    ps = [torch.from_numpy(rng.standard_normal((n, 128)) / 8).to(where, torch.bfloat16) for n in lens]
    monkeypatch.setattr(lc, "_CHUNK_BYTES", 6 * 1030 * 128 * 2)  # chunks of two batches of 3 pages
    out = lc.score_multi_vector(qs, ps, batch_size=3, device="cuda")
    Q = torch.nn.utils.rnn.pad_sequence(qs, batch_first=True).cuda()
    ref = torch.cat([masked_maxsim_ref(Q, torch.nn.utils.rnn.pad_sequence(ps[b:b + 3], batch_first=True).cuda())
                     for b in range(0, len(ps), 3)], dim=1).cpu()
    assert out.device.type == "cpu" and out.dtype == torch.float32
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-4


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_max_of_exactly_zero_keeps_its_token(dtype):
    """The GPU twin of the CPU test of that name: the kernels' floor wins only where the max is below 0
    (``v < 0``), so a token whose similarity is exactly 0 keeps the argmax (small integers: every
    similarity exact; d padded with zeros to a dim the kernels take)."""
    q = np.zeros((1, 3, 16), np.float32)
    q[0, :, 0] = [1, -1, 0]
    q[0, 2, 1] = -1
    d = np.zeros((2, 3, 16), np.float32)
    d[:, 0, 1] = 1
    d[:, 1, 0] = -2
    d[1, 2, 0] = 3
    zp = np.ones(2, bool)
    dm = np.array([[True, True, False], [True, True, True]])
    s, a = _maxsim_zero_pad(_cp(q.astype(dtype)), _cp(d.astype(dtype)), _cp(zp), d_mask=_cp(dm), return_argmax=True,
                            backend="gpu")
    assert _np(a)[0].tolist() == [[0, 1, 1], [2, 1, 1]] and _np(s).tolist() == [[2.0, 5.0]]
    d[:, 1, 0] = 2
    dm[0, 0] = False  # document 0 is token 1 alone: query token 1's max is -2, and the floor wins
    s, a = _maxsim_zero_pad(_cp(q.astype(dtype)), _cp(d.astype(dtype)), _cp(zp), d_mask=_cp(dm), return_argmax=True,
                            backend="gpu")
    assert _np(a)[0, 0].tolist() == [1, -1, 1] and _np(s)[0, 0] == 2.0
