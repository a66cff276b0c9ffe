"""float32 precision on the GPU (``lik_cupy.precision``): "fp32" (3xTF32) against float64 on every
layout, near ties the TF32 path cannot resolve, and the default following each framework's
switch (skipped without a GPU)."""

import numpy as np
import pytest

import lik_cupy
from reference import maxsim_ref, rel_err

pytestmark = pytest.mark.gpu

FP32_TOL = 1e-5  # the bar; 3xTF32 measures ~1e-7 on unit vectors


def _cp(a):
    import cupy

    return cupy.asarray(a)


def _np(a):
    import cupy

    return cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else np.asarray(a)


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _packed(docs, lens):
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return np.concatenate([docs[j, :lens[j]] for j in range(len(lens))]), off


def _best_and_lead(sim):
    """Along the last axis: the best similarity and its lead over the runner-up (+inf with one
    finite token, NaN with none, so neither counts as a clear winner unless the caller wants)."""
    pad = np.full(sim.shape[:-1] + (2,), -np.inf)
    top2 = np.sort(np.concatenate([pad, sim], axis=-1), axis=-1)[..., -2:]
    with np.errstate(invalid="ignore"):
        return top2[..., 1], top2[..., 1] - top2[..., 0]


@pytest.mark.parametrize("dim", [16, 64, 96, 128, 200, 384, 1000])
@pytest.mark.parametrize("lq,nq", [(1, 3), (32, 5), (77, 2), (300, 2)])
def test_fp32_padded_vs_float64(rng, dim, lq, nq):
    nd, ld = 23, int(rng.integers(1, 180))
    q, d = _unit(rng, nq, lq, dim), _unit(rng, nd, ld, dim)
    lens = rng.integers(0, ld + 1, nd).astype(np.int32)
    dv = np.arange(ld)[None, :] < lens[:, None]
    ref, sim = maxsim_ref(q, d, d_valid=dv)
    s, a = lik_cupy.maxsim(_cp(q), _cp(d), d_lengths=_cp(lens), return_argmax=True, precision="fp32")
    assert rel_err(_np(s), ref) < FP32_TOL
    # The argmax agrees with float64 wherever float64's winner leads by more than float32 rounding.
    a = _np(a)
    clear = (_best_and_lead(np.where(dv[None, :, None, :], sim, -np.inf))[1] > 1e-5) & (lens[None, :, None] > 1)
    exact = np.where(dv[None, :, None, :], sim, -np.inf).argmax(axis=3)
    assert np.array_equal(a[clear], exact[clear])


@pytest.mark.parametrize("layout", ["pairs", "candidates", "packed", "retrieve"])
@pytest.mark.parametrize("dim", [96, 128, 640])
def test_fp32_every_layout_vs_float64(rng, layout, dim):
    nq, lq, k_docs, ld = 4, 37, 11, 90
    q = _unit(rng, nq, lq, dim)
    if layout == "pairs":
        d = _unit(rng, nq, ld, dim)
        s = lik_cupy.maxsim_pairs(_cp(q), _cp(d), precision="fp32")
        ref = np.array([maxsim_ref(q[b:b + 1], d[b:b + 1])[0][0, 0] for b in range(nq)])
    elif layout == "candidates":
        d = _unit(rng, nq, k_docs, ld, dim)
        s = lik_cupy.maxsim(_cp(q), _cp(d), precision="fp32")
        ref = np.stack([maxsim_ref(q[i:i + 1], d[i])[0][0] for i in range(nq)])
    else:
        d = _unit(rng, 60, ld, dim)
        lens = rng.integers(0, ld + 1, 60)
        tok, off = _packed(d, lens)
        ref = maxsim_ref(q, d, d_valid=np.arange(ld)[None, :] < lens[:, None])[0]
        if layout == "packed":
            s = lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off), precision="fp32")
        else:
            s, i = lik_cupy.retrieve(_cp(q), _cp(tok), 7, d_offsets=_cp(off), precision="fp32")
            ref = np.take_along_axis(ref, _np(i), axis=1)
    assert rel_err(_np(s), ref) < FP32_TOL


def _near_tie(rng, dim, ld, step):
    """One query token and a document whose tokens differ only in component 0, by ``step`` per
    token, so their similarities rise by ``step / 2`` per token and the last token wins. Every
    token rounds to the same TF32 vector (0.5 + 63 * step stays within half a TF32 step of 0.5),
    so the TF32 path sees 64 equal similarities and keeps the first; float32 resolves them."""
    b = _unit(rng, dim)
    b = (b.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)  # exactly representable in TF32
    b[0] = 0.5
    q = _unit(rng, 1, 1, dim)
    q[0, 0, 0] = 0.5
    d = np.repeat(b[None], ld, axis=0)
    d[:, 0] += (step * np.arange(ld)).astype(np.float32)
    return q, d[None]


def test_fp32_resolves_near_ties_that_tf32_cannot(rng):
    q, d = _near_tie(rng, 128, 64, 2e-6)
    ref, sim = maxsim_ref(q, d)
    assert sim[0, 0, 0].argmax() == 63
    s, a = lik_cupy.maxsim(_cp(q), _cp(d), return_argmax=True, precision="fp32")
    assert int(_np(a)[0, 0, 0]) == 63
    assert abs(float(_np(s)[0, 0]) - ref[0, 0]) < 1e-6
    _, a32 = lik_cupy.maxsim(_cp(q), _cp(d), return_argmax=True, precision="tf32")
    assert int(_np(a32)[0, 0, 0]) == 0  # one TF32 value for all 64: the lowest index wins


def test_tf32_is_the_faster_coarser_path(rng):
    q, d = _unit(rng, 3, 32, 128), _unit(rng, 50, 100, 128)
    ref = maxsim_ref(q, d)[0]
    e_fp32 = rel_err(_np(lik_cupy.maxsim(_cp(q), _cp(d), precision="fp32")), ref)
    e_tf32 = rel_err(_np(lik_cupy.maxsim(_cp(q), _cp(d), precision="tf32")), ref)
    assert e_fp32 < FP32_TOL < e_tf32 < 3e-3


def _same(a, b):
    return np.array_equal(_np(a), _np(b))


def test_default_follows_torch_switches(rng):
    torch = pytest.importorskip("torch")
    q, d = _unit(rng, 2, 32, 128), _unit(rng, 30, 64, 128)
    tq, td = torch.from_numpy(q).cuda(), torch.from_numpy(d).cuda()
    fp32 = lik_cupy.maxsim(tq, td, precision="fp32").cpu()
    tf32 = lik_cupy.maxsim(tq, td, precision="tf32").cpu()
    assert not torch.equal(fp32, tf32)
    assert torch.equal(lik_cupy.maxsim(tq, td).cpu(), fp32)  # torch's default: full float32 matmuls
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert torch.equal(lik_cupy.maxsim(tq, td).cpu(), tf32)
        assert torch.equal(lik_cupy.maxsim(tq, td, precision="fp32").cpu(), fp32)  # the call wins
    finally:
        torch.set_float32_matmul_precision(old)
    assert torch.equal(lik_cupy.maxsim(tq, td).cpu(), fp32)


def test_default_follows_cupy_and_the_process_default(rng, monkeypatch):
    q, d = _cp(_unit(rng, 2, 32, 128)), _cp(_unit(rng, 30, 64, 128))
    fp32 = lik_cupy.maxsim(q, d, precision="fp32")
    tf32 = lik_cupy.maxsim(q, d, precision="tf32")
    assert _same(lik_cupy.maxsim(q, d), fp32)
    monkeypatch.setenv("CUPY_TF32", "1")
    assert _same(lik_cupy.maxsim(q, d), tf32)
    monkeypatch.setenv("LIK_PRECISION", "fp32")  # the process default beats the framework
    assert _same(lik_cupy.maxsim(q, d), fp32)
    monkeypatch.delenv("LIK_PRECISION")
    monkeypatch.delenv("CUPY_TF32")
    try:
        lik_cupy.set_precision("tf32")
        assert _same(lik_cupy.maxsim(q, d), tf32)
        assert _same(lik_cupy.retrieve(q, d, 5)[0], lik_cupy.retrieve(q, d, 5, precision="tf32")[0])
    finally:
        lik_cupy.set_precision(None)


def test_default_follows_jax(rng):
    jax = pytest.importorskip("jax")
    if not any(dev.platform == "gpu" for dev in jax.devices()):
        pytest.skip("JAX has no GPU here")
    import jax.numpy as jnp

    q, d = _unit(rng, 2, 32, 128), _unit(rng, 30, 64, 128)
    fp32 = _np(lik_cupy.maxsim(_cp(q), _cp(d), precision="fp32"))
    tf32 = _np(lik_cupy.maxsim(_cp(q), _cp(d), precision="tf32"))
    jq, jd = jnp.asarray(q), jnp.asarray(d)
    assert np.array_equal(np.asarray(lik_cupy.maxsim(jq, jd)), fp32)
    with jax.default_matmul_precision("tensorfloat32"):
        assert np.array_equal(np.asarray(lik_cupy.maxsim(jq, jd)), tf32)


def test_float64_in_float64_out_at_float32_accuracy(rng):
    # float64 device arrays score on the GPU from their float32 rounding at precision "fp32" and
    # come back as float64: padded with lengths and argmax, packed, and through torch's autograd.
    q, d = _unit(rng, 3, 40, 96).astype(np.float64), _unit(rng, 20, 70, 96).astype(np.float64)
    lens = rng.integers(0, 71, 20)
    dv = np.arange(70)[None, :] < lens[:, None]
    ref, sim = maxsim_ref(q, d, d_valid=dv)
    s, a = lik_cupy.maxsim(_cp(q), _cp(d), d_lengths=_cp(lens), return_argmax=True)
    assert s.dtype == np.float64 and rel_err(_np(s), ref) < FP32_TOL
    tok = np.concatenate([d[j, :lens[j]] for j in range(20)])
    off = np.concatenate([[0], np.cumsum(lens)])
    sp = lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off))
    assert sp.dtype == np.float64 and rel_err(_np(sp), ref) < FP32_TOL
    torch = pytest.importorskip("torch")
    import lik_cupy.torch as lt

    tq = torch.from_numpy(q).cuda().requires_grad_()
    td = torch.from_numpy(d).cuda().requires_grad_()
    out = lt.maxsim(tq, td)
    assert out.dtype == torch.float64
    out.sum().backward()
    assert tq.grad.dtype == torch.float64 and td.grad.dtype == torch.float64
    rq = torch.from_numpy(q).requires_grad_()
    rd = torch.from_numpy(d).requires_grad_()
    torch.einsum("isk,jtk->ijst", rq, rd).amax(dim=3).sum().backward()
    assert torch.allclose(tq.grad.cpu(), rq.grad, atol=1e-5) and torch.allclose(td.grad.cpu(), rd.grad, atol=1e-5)


# The float32-accuracy contract (README, Semantics): every score within 2e-6 of float64, relative
# to |score| + 1, and the argmax float64's wherever the two best products differ by more than
# float32 rounding. On Hopper the default takes TF32 wgmma tiles and recomputes the near-max
# similarities exactly (cuda_src/fwd/refine.cuh); elsewhere 3xTF32.
CONTRACT_TOL = 2e-6


def _contract_err(out, ref, slack=0.0):
    """The largest error against the contract (``slack``: what a score may miss by besides, per score)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    slack = np.broadcast_to(slack, ref.shape)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(out), fin) and np.array_equal(out[~fin], ref[~fin])
    return float(np.max((np.abs(out[fin] - ref[fin]) - slack[fin]) / (np.abs(ref[fin]) + 1.0), initial=0.0))


def sum_slack(sim, q_valid=None):
    """What summing each score's rows' maxima in float32 may add to its error (sim [Nq, Nd, Lq, Ld],
    invalid tokens -inf): Lq 2^-24 of their magnitudes. Rows of both signs cancel, and then that,
    not the maxima (float64's rounded once), bounds the error (docs/api.md: 64 random rows of norm
    10 against a one-token document measured 2.4e-6 relative to |score| + 1)."""
    with np.errstate(invalid="ignore"):
        best = sim.max(axis=3) if sim.shape[3] else np.full(sim.shape[:3], -np.inf)
    qv = np.ones((sim.shape[0], sim.shape[2]), bool) if q_valid is None else np.asarray(q_valid, bool)
    rows = np.where(qv[:, None, :] & np.isfinite(best), np.abs(best), 0.0).sum(axis=2)
    return sim.shape[2] * 2.0 ** -24 * rows


def _ulp_ties(rng, nd, ld, dim, ulps, winner_first):
    """Documents whose tokens all share one vector except component 0, where two of them lead: the
    winner by `ulps` float32 ulps of that component over the runner-up, the rest far below. The
    TF32 values of all of them agree, so only exact arithmetic finds the winner."""
    q = _unit(rng, 1, 1, dim)
    q[0, 0, 0] = 0.75
    base = _unit(rng, dim)
    base[0] = 0.5
    d = np.repeat(np.repeat(base[None, None], ld, axis=1), nd, axis=0)
    d[:, :, 0] -= np.float32(1e-4) * rng.random((nd, ld)).astype(np.float32) + np.float32(1e-5)
    want = np.empty(nd, np.int64)
    for j in range(nd):
        a, b = rng.choice(ld, 2, replace=False)
        win, lose = (min(a, b), max(a, b)) if winner_first else (max(a, b), min(a, b))
        d[j, lose, 0] = np.float32(0.5)
        d[j, win, 0] = np.nextafter(np.float32(0.5), np.float32(1.0)) if ulps == 1 else \
            np.float32(0.5) + np.float32(ulps) * np.spacing(np.float32(0.5))
        want[j] = win
    return q, d.astype(np.float32), want


@pytest.mark.parametrize("ulps", [1, 3, 10, 100])
@pytest.mark.parametrize("winner_first", [False, True])
def test_default_argmax_follows_float64_on_ulp_near_ties(rng, ulps, winner_first):
    nd, ld, dim = 37, 150, 128
    q, d, want = _ulp_ties(rng, nd, ld, dim, ulps, winner_first)
    ref, sim = maxsim_ref(q, d)
    assert np.array_equal(sim[0, :, 0].argmax(axis=1), want)
    s, a = lik_cupy.maxsim(_cp(q), _cp(d), return_argmax=True)
    assert np.array_equal(_np(a)[0, :, 0], want)
    assert _contract_err(_np(s), ref) < CONTRACT_TOL
    # packed, and the same documents picked by candidate ids
    tok, off = _packed(d, np.full(nd, ld))
    sp, ap = lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off), return_argmax=True)
    assert np.array_equal(_np(ap)[0, :, 0], want) and _contract_err(_np(sp), ref) < CONTRACT_TOL
    dc = np.stack([d[::-1]])
    sc, ac = lik_cupy.maxsim(_cp(q), _cp(dc), return_argmax=True)
    assert np.array_equal(_np(ac)[0, :, 0], want[::-1])


@pytest.mark.parametrize("dim", [64, 96, 128, 256])
@pytest.mark.parametrize("lq,nq,shared", [(32, 1, True), (32, 9, True), (100, 2, True), (1024, 1, True),
                                          (40, 3, False)])
def test_default_meets_the_float32_contract(rng, dim, lq, nq, shared):
    # random (not unit) vectors of awkward sizes, lengths with empty documents, argmax compared
    # where float64's two best products differ by more than float32 rounding (the refined TF32
    # tiles, whose rows of at most 512 bytes run one-shot; wider rows run split-d on 3xTF32, whose
    # float32 accumulation decides gaps of a few ulps either way, so there the scores alone)
    strict = dim * 4 <= 512
    nd, ld = 29, int(rng.integers(1, 260))

    def meets(out, ref, absq, absd, d_valid=None, sim=None):
        # refined tiles: the 2e-6 contract, where the rows' maxima do not cancel (random vectors'
        # do, against short documents: sum_slack); 3xTF32: float32 accumulation over d and the
        # query rows (2.2e-6 was seen at d = 256 on random non-unit vectors, docs/api.md)
        if strict:
            return _contract_err(out, ref, sum_slack(sim)) < CONTRACT_TOL
        out, fin = np.asarray(out, np.float64), np.isfinite(ref)
        if not (np.array_equal(np.isfinite(out), fin) and np.array_equal(out[~fin], ref[~fin])):
            return False
        bound = (dim + lq + 8) * 2.0 ** -24 * maxsim_ref(absq, absd, d_valid=d_valid)[0]
        return bool(np.all(np.abs(out[fin] - ref[fin]) <= bound[fin]))

    q = rng.standard_normal((nq, lq, dim)).astype(np.float32)
    d = rng.standard_normal((nd if shared else nq, ld, dim) if shared else (nq, nd, ld, dim)).astype(np.float32)
    if not shared:
        s, a = lik_cupy.maxsim(_cp(q), _cp(d), return_argmax=True)
        for i in range(nq):
            ref_i, sim_i = maxsim_ref(q[i:i + 1], d[i])
            assert meets(_np(s)[i:i + 1], ref_i, np.abs(q[i:i + 1]), np.abs(d[i]), sim=sim_i)
            exact = sim_i.argmax(axis=3)
            # (a one-token document's winner is always clear)
            best, lead = _best_and_lead(sim_i)
            clear = lead > 4 * np.spacing(np.abs(best).astype(np.float32))
            assert not strict or np.array_equal(_np(a)[i:i + 1][clear], exact[clear])
        return
    lens = rng.integers(0, ld + 1, nd).astype(np.int32)
    dv = np.arange(ld)[None, :] < lens[:, None]
    ref, sim = maxsim_ref(q, d, d_valid=dv)
    s, a = lik_cupy.maxsim(_cp(q), _cp(d), d_lengths=_cp(lens), return_argmax=True)
    masked = np.where(dv[None, :, None, :], sim, -np.inf)
    assert meets(_np(s), ref, np.abs(q), np.abs(d), dv, masked)
    best, lead = _best_and_lead(masked)
    clear = (lead > 4 * np.spacing(np.abs(best).astype(np.float32))) & (lens[None, :, None] > 1)
    assert not strict or np.array_equal(_np(a)[clear], masked.argmax(axis=3)[clear])
    tok, off = _packed(d, lens)
    sp = lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off))
    assert meets(_np(sp), ref, np.abs(q), np.abs(d), dv, masked)


def test_tf32_error_stays_within_its_bound(rng):
    # "tf32": each similarity within 2^-9 |q| |d| (+ accumulation) of float64, on every layout
    q, d = _unit(rng, 5, 40, 128), _unit(rng, 40, 120, 128)
    ref = maxsim_ref(q, d)[0]
    bound = 40 * (2.0 ** -9 + 2.0 ** -12)  # per score: 40 query tokens of unit vectors
    s = _np(lik_cupy.maxsim(_cp(q), _cp(d), precision="tf32"))
    assert np.all(np.abs(s - ref) <= bound)
    tok, off = _packed(d, np.full(40, 120))
    sp = _np(lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off), precision="tf32"))
    assert np.all(np.abs(sp - ref) <= bound)


def test_default_few_long_documents_split_over_ctas(rng):
    # few long packed documents: the token split's pieces each refine their rows, and the merge
    # keeps the float32 contract and float64's argmax
    q = rng.standard_normal((1, 64, 128)).astype(np.float32)
    lens = np.array([9000, 1, 7000, 0])
    d = rng.standard_normal((4, 9000, 128)).astype(np.float32)
    dv = np.arange(9000)[None, :] < lens[:, None]
    ref, sim = maxsim_ref(q, d, d_valid=dv)
    tok, off = _packed(d, lens)
    s, a = lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off), return_argmax=True)
    assert _contract_err(_np(s), ref) < CONTRACT_TOL
    masked = np.where(dv[None, :, None, :], sim, -np.inf)
    clear = (_best_and_lead(masked)[1] > 1e-5) & (lens[None, :, None] > 1)
    assert np.array_equal(_np(a)[clear], masked.argmax(axis=3)[clear])


def _planted_ties(rng, nq, lq, nd, ld, dim, ulps, copies, same_lane):
    """Documents whose tokens share one vector except component 0, which puts every token far below
    the TF32 bound (0.0375 to 0.045 under) but `copies` runner-ups at 0.5 and, for ulps > 0, a winner
    `ulps` float32 ulps above them (ulps 0: the first runner-up wins, float64's tie rule). Every query
    token has component 0 at 0.75, so all rows share the winner. same_lane puts the planted tokens 8
    apart, in one thread's accumulator columns (a thread keeps two near-max tokens and then scans its
    columns). Returns q, d, the winners [nd] and each document's last planted token + 1 [nd]."""
    q = _unit(rng, nq, lq, dim)
    q[..., 0] = 0.75
    base = _unit(rng, dim)
    base[0] = 0.5
    d = np.repeat(np.repeat(base[None, None], ld, axis=1), nd, axis=0)
    d[:, :, 0] = np.float32(0.45) - np.float32(0.01) * rng.random((nd, ld)).astype(np.float32)
    want, need = np.empty(nd, np.int64), np.empty(nd, np.int64)
    n = copies + (ulps > 0)
    for j in range(nd):
        pool = np.arange(int(rng.integers(0, 8)), ld, 8) if same_lane else np.arange(ld)
        pos = rng.choice(pool, n, replace=False)
        d[j, pos, 0] = np.float32(0.5)
        if ulps:
            d[j, pos[0], 0] = np.float32(0.5) + np.float32(ulps) * np.spacing(np.float32(0.5))
        want[j] = pos[0] if ulps else pos.min()
        need[j] = pos.max() + 1
    return q, d.astype(np.float32), want, need


PLANTED_LAYOUTS = ["padded", "lengths", "packed", "candidates", "multi", "long-query"]


@pytest.mark.parametrize("layout", PLANTED_LAYOUTS)
@pytest.mark.parametrize("ulps", [0, 1, 3, 10, 100])
@pytest.mark.parametrize("copies,same_lane", [(1, False), (1, True), (2, True), (40, False)])
def test_default_argmax_on_planted_ties_every_layout(rng, layout, ulps, copies, same_lane):
    # the refined TF32 tiles' near-max tokens: one or two per thread (recomputed at the document's
    # end), three in one thread's columns or 40 exact duplicates (that thread's columns scanned);
    # the argmax is float64's (the first of equal maxima) and the scores meet the contract
    nq, lq = {"multi": (9, 32), "long-query": (1, 256), "candidates": (2, 40)}.get(layout, (1, 40))
    nd, ld = 13, 400
    q, d, want, need = _planted_ties(rng, nq, lq, nd, ld, 128, ulps, copies, same_lane)
    ref, sim = maxsim_ref(q, d)
    assert np.array_equal(sim[0, :, 0].argmax(axis=1), want)
    if layout == "lengths":
        lens = rng.integers(need, ld + 1).astype(np.int32)
        ref = maxsim_ref(q, d, d_valid=np.arange(ld)[None, :] < lens[:, None])[0]
        s, a = lik_cupy.maxsim(_cp(q), _cp(d), d_lengths=_cp(lens), return_argmax=True)
    elif layout == "packed":
        lens = rng.integers(need, ld + 1)
        tok, off = _packed(d, lens)
        ref = maxsim_ref(q, d, d_valid=np.arange(ld)[None, :] < lens[:, None])[0]
        s, a = lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off), return_argmax=True)
    elif layout == "candidates":  # each query its own candidates: the documents in reverse
        s, a = lik_cupy.maxsim(_cp(q), _cp(np.repeat(d[None, ::-1], nq, axis=0)), return_argmax=True)
        s, a, ref = _np(s)[:, ::-1], _np(a)[:, ::-1], ref
    else:
        s, a = lik_cupy.maxsim(_cp(q), _cp(d), return_argmax=True)
    assert np.array_equal(_np(a), np.broadcast_to(want[None, :, None], (nq, nd, lq)))
    assert _contract_err(_np(s), ref) < CONTRACT_TOL


@pytest.mark.parametrize("copies", [1, 40])
def test_default_planted_ties_in_few_long_documents(rng, copies):
    # the token split: each piece keeps and recomputes (or scans) its own tokens, the merge keeps
    # float64's argmax across pieces
    q, d, want, _ = _planted_ties(rng, 1, 64, 3, 6000, 128, 1, copies, False)
    ref = maxsim_ref(q, d)[0]
    tok, off = _packed(d, np.full(3, 6000))
    s, a = lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off), return_argmax=True)
    assert np.array_equal(_np(a), np.broadcast_to(want[None, :, None], (1, 3, 64)))
    assert _contract_err(_np(s), ref) < CONTRACT_TOL


def test_default_nan_and_zero_rows_follow_float64(rng):
    # a NaN in a document's valid token: its rows score NaN at the first NaN token (rows scanned
    # exactly); a NaN past the length is never read into a score; a query row of zeros scores 0 at
    # the first valid token
    nd, ld, dim = 6, 200, 128
    q, d = _unit(rng, 1, 40, dim), _unit(rng, nd, ld, dim)
    q[0, 7] = 0.0
    lens = np.array([200, 150, 150, 90, 1, 0], np.int32)
    d[1, 30, 5] = np.nan
    d[1, 70, 9] = np.nan
    d[2, 170, 3] = np.nan  # past document 2's length
    dv = np.arange(ld)[None, :] < lens[:, None]
    ref, sim = maxsim_ref(q, d, d_valid=dv)
    s, a = lik_cupy.maxsim(_cp(q), _cp(d), d_lengths=_cp(lens), return_argmax=True)
    s, a = _np(s), _np(a)
    assert np.isnan(s[0, 1]) and np.all(a[0, 1] == 30)
    assert _contract_err(np.delete(s, 1, axis=1), np.delete(ref, 1, axis=1)) < CONTRACT_TOL
    assert np.all(a[0, [0, 2, 3, 4], 7] == 0) and a[0, 5, 7] == -1
    masked = np.where(dv[None, :, None, :], sim, -np.inf)
    clear = (_best_and_lead(masked)[1] > 1e-5) & (lens[None, :, None] > 1)
    clear[:, 1] = False  # the NaN document, checked above
    assert np.array_equal(a[clear], masked.argmax(axis=3)[clear])


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_default_argmax_in_documents_below_float32_squares(rng, layout):
    # documents scaled by 2^-80: their elements' squares fall below float32's range, so a bound on
    # the TF32 error taken from float32 sums of squares alone would vanish. Each document's winner
    # sits 1.8e-4 (times 2^-80) below a runner-up in TF32 (component 0 one ulp under 0.5 truncates
    # to 0.5 - 2^-12) but 3.5e-7 above it exactly (component 1 raised by 100 ulps, under TF32's step)
    nd, ld, lq, dim = 7, 300, 32, 128
    q = _unit(rng, 1, lq, dim)
    q[..., 0], q[..., 1] = 0.75, 0.5
    base = _unit(rng, dim)
    base[1] = np.float32(0.09375)  # a TF32 value: its low 13 bits are zero
    d = np.repeat(np.repeat(base[None, None], ld, axis=1), nd, axis=0)
    d[:, :, 0] = np.float32(0.45) - np.float32(0.05) * rng.random((nd, ld)).astype(np.float32)
    want = np.empty(nd, np.int64)
    for j in range(nd):
        runner, winner = rng.choice(ld, 2, replace=False)
        d[j, runner, 0] = np.float32(0.5)
        d[j, winner, 0] = np.nextafter(np.float32(0.5), np.float32(0))
        d[j, winner, 1] = base[1] + np.float32(100) * np.spacing(base[1])
        want[j] = winner
    d = (d.astype(np.float32) * np.float32(2.0 ** -80)).astype(np.float32)
    ref, sim = maxsim_ref(q, d)
    assert np.array_equal(sim[0, :, 0].argmax(axis=1), want)
    if layout == "packed":
        tok, off = _packed(d, np.full(nd, ld))
        s, a = lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off), return_argmax=True)
    else:
        s, a = lik_cupy.maxsim(_cp(q), _cp(d), return_argmax=True)
    assert np.array_equal(_np(a), np.broadcast_to(want[None, :, None], (1, nd, lq)))
    assert np.allclose(_np(s), ref, rtol=2e-6, atol=0)
