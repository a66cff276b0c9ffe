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
    top2 = np.sort(np.where(dv[None, :, None, :], sim, -np.inf), axis=3)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0] > 1e-5) & (lens[None, :, None] > 1)
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
