"""INT8 scoring on the GPU (skipped without one).

Two references: the float64 MaxSim of the dequantised inputs (which the kernel must match
to float32 rounding), and the NumPy INT8 path, which does the kernel's arithmetic (exact
integer dots, float32 scaling) and so must give the same argmax exactly.
"""

import numpy as np
import pytest

import lik_cupy
from reference import maxsim_ref, rel_err

pytestmark = pytest.mark.gpu

TOL = 2e-6  # float32 rounding of the scaled products and of the sum over query tokens


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _cp(a):
    import cupy

    return cupy.asarray(a)


def _np(a):
    import cupy

    return cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else np.asarray(a)


def _deq(q, s):
    return q.astype(np.float64) * s.astype(np.float64)[..., None]


@pytest.fixture(params=["wgmma", "mma"])
def kernel_family(request, monkeypatch):
    # Both kernel families on Hopper: the warpgroup kernels and the portable mma.sync ones.
    if request.param == "mma":
        monkeypatch.setenv("LIK_DISABLE_WGMMA", "1")
    return request.param


@pytest.mark.parametrize("dim", [16, 48, 96, 128, 256, 512])
def test_vs_float64_of_dequantised(rng, dim, kernel_family):
    nq, lq, nd, ld = 3, int(rng.integers(1, 200)), 41, int(rng.integers(1, 300))
    q8, qs = lik_cupy.quantize_int8(_unit(rng, nq, lq, dim))
    d8, ds = lik_cupy.quantize_int8(_unit(rng, nd, ld, dim))
    out = lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs))
    ref, _ = maxsim_ref(_deq(q8, qs), _deq(d8, ds))
    assert rel_err(_np(out), ref) < TOL


@pytest.mark.parametrize("lq", [1, 31, 32, 100, 300, 1024])
def test_masks_lengths_empty_docs_and_argmax_match_numpy_path(rng, lq, kernel_family):
    dim, nq, nd, ld = 128, 2, 23, 151
    q8, qs = lik_cupy.quantize_int8(_unit(rng, nq, lq, dim))
    d8, ds = lik_cupy.quantize_int8(_unit(rng, nd, ld, dim))
    q_mask = rng.random((nq, lq)) < 0.8
    d_len = rng.integers(0, ld + 1, nd)
    d_len[[0, 5]] = 0  # empty documents
    d_len[1] = ld
    args = dict(q_scales=qs, q_mask=q_mask, d_lengths=d_len, return_argmax=True)
    s, a = lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ds), **{k: _cp(v) if isinstance(v, np.ndarray) else v
                                                              for k, v in args.items()})
    s_cpu, a_cpu = lik_cupy.maxsim_int8(q8, d8, ds, backend="cpu", **args)
    assert np.array_equal(_np(a), a_cpu)
    dv = np.arange(ld)[None, :] < d_len[:, None]
    ref, _ = maxsim_ref(_deq(q8, qs), _deq(d8, ds), q_mask, dv)
    assert rel_err(_np(s), ref) < TOL
    assert rel_err(s_cpu, ref) < TOL


def test_float_queries_are_quantised_on_device_like_numpy(rng, kernel_family):
    import ml_dtypes

    dim = 128
    d8, ds = lik_cupy.quantize_int8(_unit(rng, 17, 90, dim))
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        q = _unit(rng, 4, 37, dim).astype(dtype)
        q8, qs = lik_cupy.quantize_int8(q)  # NumPy path
        if dtype is ml_dtypes.bfloat16:
            torch = pytest.importorskip("torch")
            qd = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16).cuda()
            q8_gpu, qs_gpu = (t.cpu().numpy() for t in lik_cupy.quantize_int8(qd))
            out = lik_cupy.maxsim_int8(qd, torch.from_numpy(d8).cuda(), torch.from_numpy(ds).cuda()).cpu().numpy()
        else:
            q8_gpu, qs_gpu = (_np(t) for t in lik_cupy.quantize_int8(_cp(q)))
            out = _np(lik_cupy.maxsim_int8(_cp(q), _cp(d8), _cp(ds)))
        assert np.array_equal(q8_gpu, q8) and np.array_equal(qs_gpu, qs)  # bitwise: same IEEE float32 steps
        pre = _np(lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs)))
        assert np.array_equal(out, pre)


def test_packed_documents_match_padded(rng, kernel_family):
    dim, nq, lq = 96, 3, 45
    lens = rng.integers(0, 260, 57)
    off = np.concatenate([[0], np.cumsum(lens)])
    tok8, ts = lik_cupy.quantize_int8(_unit(rng, int(off[-1]), dim))
    q = _unit(rng, nq, lq, dim)
    s, a = lik_cupy.maxsim_int8_varlen(_cp(q), _cp(tok8), _cp(ts), _cp(off), return_argmax=True)
    s_cpu, a_cpu = lik_cupy.maxsim_int8_varlen(q, tok8, ts, off, return_argmax=True, backend="cpu")
    assert np.array_equal(_np(a), a_cpu)
    assert rel_err(_np(s), s_cpu) < TOL
    assert np.all(np.isneginf(_np(s)[:, lens == 0]))


@pytest.mark.parametrize("nq,lq", [(32, 32), (8, 20), (5, 64)])
def test_short_queries_share_document_tiles(rng, nq, lq, kernel_family):
    dim, nd, ld = 128, 300, 130
    q8, qs = lik_cupy.quantize_int8(_unit(rng, nq, lq, dim))
    d8, ds = lik_cupy.quantize_int8(_unit(rng, nd, ld, dim))
    d_len = rng.integers(1, ld + 1, nd)
    s, a = lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs), d_lengths=_cp(d_len),
                                return_argmax=True)
    s_cpu, a_cpu = lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs, d_lengths=d_len, return_argmax=True, backend="cpu")
    assert np.array_equal(_np(a), a_cpu)
    assert rel_err(_np(s), s_cpu) < TOL


def test_candidates_per_query(rng):
    dim, nq, k, lq, ld = 64, 4, 9, 33, 70
    q = _unit(rng, nq, lq, dim)
    d8, ds = lik_cupy.quantize_int8(_unit(rng, nq, k, ld, dim))
    s = _np(lik_cupy.maxsim_int8(_cp(q), _cp(d8), _cp(ds)))
    s_cpu = lik_cupy.maxsim_int8(q, d8, ds, backend="cpu")
    assert s.shape == (nq, k) and rel_err(s, s_cpu) < TOL


@pytest.mark.parametrize("dim", [224, 512])
def test_extreme_int8_values_are_exact(dim, kernel_family):
    # -128 everywhere: the largest dot products (16384 * dim), at the edge of the fast
    # integer-to-float conversion (dim 224) and beyond it (dim 512, the exact conversion).
    q8 = np.full((1, 100, dim), -128, np.int8)  # 100 query rows: the Hopper kernel where dim allows
    d8 = np.full((3, 50, dim), -128, np.int8)
    d8[1, :, ::2] = 127
    qs = np.ones((1, 100), np.float32)
    ds = np.ones((3, 50), np.float32)
    s = _np(lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs)))
    ref, _ = maxsim_ref(q8, d8)
    assert np.array_equal(s, ref.astype(np.float32))


def test_nan_tokens_and_zero_scales(rng, kernel_family):
    dim = 128
    q = _unit(rng, 2, 40, dim)
    q[0, 3, 7] = np.nan  # a float query token with NaN: its scale is NaN, so are query 0's scores
    q[1, 5] = 0.0  # a zero token: scale 0, contributes 0
    d8, ds = lik_cupy.quantize_int8(_unit(rng, 6, 77, dim))
    d_len = np.array([77, 0, 10, 77, 3, 1])
    s, a = lik_cupy.maxsim_int8(_cp(q), _cp(d8), _cp(ds), d_lengths=_cp(d_len), return_argmax=True)
    s, a = _np(s), _np(a)
    assert np.all(np.isnan(s[0, d_len > 0])) and np.all(np.isneginf(s[:, 1]))
    s_cpu, a_cpu = lik_cupy.maxsim_int8(q, d8, ds, d_lengths=d_len, return_argmax=True, backend="cpu")
    assert np.array_equal(a[1], a_cpu[1]) and rel_err(s[1], s_cpu[1]) < TOL
    neg = lik_cupy.maxsim_int8(_cp(np.ones((2, 3, dim), np.int8)), _cp(d8), _cp(ds),
                               q_scales=_cp(np.array([[1, -1, 1], [1, 1, 1]], np.float32)))
    neg = _np(neg)  # a negative query scale: NaN scores for that query (never a silently wrong max)
    assert np.all(np.isnan(neg[0, d_len > 0])) and np.all(np.isfinite(neg[1, d_len > 0]))
    with pytest.raises(ValueError, match="NaN or inf"):
        lik_cupy.quantize_int8(_cp(q))
    big = np.ones((3, 4, dim))
    big[1, 2, 0] = 1e300  # float64 past float32's range: the message the NumPy path gives
    import ml_dtypes
    torch = pytest.importorskip("torch")

    bf = np.ones((3, 4, dim), ml_dtypes.bfloat16)
    bf[1, 2, 0] = np.nan  # (read by the kernel as its bits)
    bf = torch.from_numpy(bf.view(np.int16)).view(torch.bfloat16).cuda()
    for quantize in (lik_cupy.quantize_int8, lik_cupy.quantize_fp8):
        with pytest.raises(ValueError, match=r"beyond float32's range .* in token \(1, 2\)"):
            quantize(_cp(big))
        with pytest.raises(ValueError, match=r"NaN or inf in token \(1, 2\)"):
            quantize(bf)


def test_frameworks_round_trip(rng):
    torch = pytest.importorskip("torch")
    dim = 128
    q = _unit(rng, 2, 30, dim)
    d8, ds = lik_cupy.quantize_int8(_unit(rng, 11, 50, dim))
    want = lik_cupy.maxsim_int8(q, d8, ds, backend="cpu")
    out = lik_cupy.maxsim_int8(torch.from_numpy(q).cuda(), torch.from_numpy(d8).cuda(), torch.from_numpy(ds).cuda())
    assert isinstance(out, torch.Tensor) and out.is_cuda and rel_err(out.cpu().numpy(), want) < TOL
    host = lik_cupy.maxsim_int8(q, d8, ds, backend="gpu")  # NumPy in, NumPy out, GPU in between
    assert isinstance(host, np.ndarray) and rel_err(host, want) < TOL
    t8, ts = lik_cupy.quantize_int8(torch.from_numpy(q).cuda())
    assert t8.dtype == torch.int8 and ts.dtype == torch.float32 and t8.is_cuda
    back = lik_cupy.dequantize_int8(t8, ts)
    assert back.dtype == torch.float32 and float((back.cpu() - torch.from_numpy(q)).abs().max()) <= float(ts.max()) / 2 + 1e-7


def test_jax_round_trip(rng):
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    dim = 64
    q = _unit(rng, 2, 30, dim)
    d8, ds = lik_cupy.quantize_int8(_unit(rng, 11, 50, dim))
    want = lik_cupy.maxsim_int8(q, d8, ds, backend="cpu")
    out = lik_cupy.maxsim_int8(*(jax.device_put(x, gpu) for x in (q, d8, ds)))
    assert isinstance(out, jax.Array) and rel_err(np.asarray(out), want) < TOL
    j8, js = lik_cupy.quantize_int8(jax.device_put(q, gpu))
    assert np.array_equal(np.asarray(j8), lik_cupy.quantize_int8(q)[0])


def test_one_scale_for_all_of_d_in_every_framework(rng, kernel_family):
    # A 0-d d_scales on the device is broadcast to every token (CuPy's ascontiguousarray gives a 0-d
    # array an axis: the kernel then read one float and whatever followed it)
    dim = 128
    q8, qs = lik_cupy.quantize_int8(_unit(rng, 4, 33, dim))
    d = _unit(rng, 60, 77, dim)
    ds = np.float32(np.abs(d).max() / 127)
    d8 = np.clip(np.rint(d / ds), -127, 127).astype(np.int8)
    ref, _ = maxsim_ref(_deq(q8, qs), d8.astype(np.float64) * np.float64(ds))
    arrays = {"cupy": _cp}
    try:
        import torch

        arrays["torch"] = lambda a: torch.from_numpy(np.asarray(a)).cuda()
    except ImportError:
        pass
    try:
        import jax

        gpu = jax.devices("gpu")[0]
        arrays["jax"] = lambda a: jax.device_put(np.asarray(a), gpu)
    except (ImportError, RuntimeError):  # no JAX, or no GPU backend for it
        pass
    for name, to in arrays.items():
        out = lik_cupy.maxsim_int8(to(q8), to(d8), to(np.asarray(ds)), q_scales=to(qs))
        assert rel_err(out.cpu().numpy() if name == "torch" else _np(out), ref) < TOL, name


def test_deterministic_bits(rng):
    dim = 128
    q = _unit(rng, 3, 300, dim)
    d8, ds = lik_cupy.quantize_int8(_unit(rng, 64, 200, dim))
    a = _np(lik_cupy.maxsim_int8(_cp(q), _cp(d8), _cp(ds)))
    b = _np(lik_cupy.maxsim_int8(_cp(q), _cp(d8), _cp(ds)))
    assert np.array_equal(a, b)


# Tokens-on-M tiles (LIK_TOKM): dispatch takes them for one query of >= 65 tokens against
# documents of >= 512 tokens on an sm_90 with TMA; elsewhere these tests still check the scores.
def _tokm_picks(monkeypatch):
    from test_tma_gpu import record_forward_choices

    return record_forward_choices(monkeypatch)


def _on_hopper_with_tma() -> bool:
    import cupy

    from lik_cupy._runtime.launch import tma_usable

    return cupy.cuda.Device().compute_capability == "90" and tma_usable()


@pytest.mark.parametrize("nq,lq,nd,ld", [(2, 1024, 9, 1000), (3, 200, 17, 613), (1, 130, 33, 512), (2, 100, 12, 777)])
def test_tokens_on_m_tiles_vs_float64_and_standard_tiles(rng, monkeypatch, standard_tiles, nq, lq, nd, ld):
    dim = 128
    q8, qs = lik_cupy.quantize_int8(_unit(rng, nq, lq, dim))
    d8, ds = lik_cupy.quantize_int8(_unit(rng, nd, ld, dim))
    ds[3, ::5] = 0.0  # zero-scale (padding) tokens inside a document
    d_len = rng.integers(0, ld + 1, nd)
    d_len[[0, 4]] = 0  # empty documents: -inf
    d_len[1] = ld
    d_mask = rng.random((nd, ld)) < 0.6
    d_mask[2] = False  # every token masked: -inf
    q_len = rng.integers(1, lq + 1, nq)
    q_mask = rng.random((nq, lq)) < 0.8
    cases = {
        "plain": dict(),
        "lengths": dict(d_lengths=d_len, q_lengths=q_len),
        "masks": dict(d_mask=d_mask, q_mask=q_mask),
    }
    picked = _tokm_picks(monkeypatch)
    out = {}
    for name, kw in cases.items():
        out[name] = _np(lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs),
                                             **{k: _cp(v) for k, v in kw.items()}))
        dv = np.arange(ld)[None, :] < d_len[:, None] if "d_lengths" in kw else kw.get("d_mask")
        qv = np.arange(lq)[None, :] < q_len[:, None] if "q_lengths" in kw else kw.get("q_mask")
        ref, _ = maxsim_ref(_deq(q8, qs), _deq(d8, ds), qv, dv)
        assert rel_err(out[name], ref) < TOL, name
        assert np.array_equal(np.isneginf(out[name]), np.isneginf(ref)), name
    if _on_hopper_with_tma():
        assert picked and all(c.tokm for c in picked), [c.name for c in picked]
    # Packed documents (tiles chosen by the mean length, rounded up: tokens on M from 512)
    pl = rng.integers(ld // 2, ld + 1, nd)
    pl[[0, 4]] = 0
    off = np.concatenate([[0], np.cumsum(pl)])
    tok = np.concatenate([d8[j, :pl[j]] for j in range(nd)])
    ts = np.concatenate([ds[j, :pl[j]] for j in range(nd)])
    n = len(picked)
    packed = _np(lik_cupy.maxsim_int8_varlen(_cp(q8), _cp(tok), _cp(ts), _cp(off), q_scales=_cp(qs),
                                             q_lengths=_cp(q_len)))
    if _on_hopper_with_tma():
        assert picked[n].tokm == (-(-off[-1] // nd) >= 512), picked[n].name
    ref, _ = maxsim_ref(_deq(q8, qs), _deq(d8, ds), np.arange(lq)[None, :] < q_len[:, None],
                        np.arange(ld)[None, :] < pl[:, None])
    assert rel_err(packed, ref) < TOL
    assert np.array_equal(np.isneginf(packed), np.isneginf(ref))
    standard_tiles()
    del picked[:]
    for name, kw in cases.items():
        std = _np(lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs),
                                       **{k: _cp(v) for k, v in kw.items()}))
        assert rel_err(out[name], std) < TOL, name
    assert not any(c.tokm for c in picked)


def test_tokens_on_m_tiles_extremes(rng, monkeypatch):
    # The conversion's edges: dot products of +-2^21 (every value -128 against -128 or 127, d=128,
    # exact integers in float32); scales from 2^-60 to 2^20 (the exact range is [2^-77, 2^28)); a
    # NaN document scale and a negative query scale give NaN; a zero query token gives 0.
    dim, lq, ld = 128, 100, 600
    picked = _tokm_picks(monkeypatch)
    q8 = np.full((1, lq, dim), -128, np.int8)
    d8 = np.full((3, ld, dim), -128, np.int8)
    d8[1, :, ::2] = 127
    ones_q, ones_d = np.ones((1, lq), np.float32), np.ones((3, ld), np.float32)
    s = _np(lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ones_d), q_scales=_cp(ones_q)))
    ref, _ = maxsim_ref(q8, d8)
    assert np.array_equal(s, ref.astype(np.float32))

    q8, qs = lik_cupy.quantize_int8(_unit(rng, 2, lq, dim))
    d8, ds = lik_cupy.quantize_int8(_unit(rng, 5, ld, dim))
    ds[0] *= np.float32(2.0**20)
    ds[1] *= np.float32(2.0**-60)
    ds[2, 17] = np.nan
    qs[1, 3] = 0.0  # a zero query token (scale 0): its rows add 0
    ref, _ = maxsim_ref(_deq(q8, qs), _deq(d8, np.nan_to_num(ds)))
    s = _np(lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs)))
    fin = np.ones_like(ref, bool)
    fin[:, 2] = False
    assert rel_err(s[fin], ref[fin]) < TOL
    assert np.all(np.isnan(s[:, 2]))
    qs[0, 5] = -1.0
    neg = _np(lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs)))
    assert np.all(np.isnan(neg[0])) and rel_err(neg[1][fin[1]], ref[1][fin[1]]) < TOL
    if _on_hopper_with_tma():
        assert picked and all(c.tokm for c in picked), [c.name for c in picked]


@pytest.mark.parametrize("dim", [528, 1024, 2048, 4096])
@pytest.mark.parametrize("nq,lq", [(1, 32), (6, 20), (2, 150)])
def test_wide_dims_split_d_vs_float64_and_numpy(rng, dim, nq, lq, kernel_family):
    # Above 512 INT8 runs split-d: int32 dot products accumulate over dim chunks.
    nd, ld = 13, 75
    q8, qs = lik_cupy.quantize_int8(_unit(rng, nq, lq, dim))
    d8, ds = lik_cupy.quantize_int8(_unit(rng, nd, ld, dim))
    d_len = rng.integers(0, ld + 1, nd)
    d_len[0] = ld
    s, a = lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs), d_lengths=_cp(d_len), return_argmax=True)
    s_cpu, a_cpu = lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs, d_lengths=d_len, return_argmax=True, backend="cpu")
    assert np.array_equal(_np(a), a_cpu)
    dv = np.arange(ld)[None, :] < d_len[:, None]
    assert rel_err(_np(s), maxsim_ref(_deq(q8, qs), _deq(d8, ds), d_valid=dv)[0]) < TOL
    lens = d_len.copy()
    off = np.concatenate([[0], np.cumsum(lens)])
    tok8 = np.concatenate([d8[j, :lens[j]] for j in range(nd)])
    ts = np.concatenate([ds[j, :lens[j]] for j in range(nd)])
    sp = lik_cupy.maxsim_int8_varlen(_cp(q8), _cp(tok8), _cp(ts), _cp(off), q_scales=_cp(qs))
    assert rel_err(_np(sp), s_cpu) < TOL


def test_wide_dims_extreme_values_are_exact(kernel_family):
    # 16384 * 4096 = 2^26: past the fast conversion and float32's integers, well inside int32.
    dim = 4096
    q8 = np.full((1, 64, dim), -128, np.int8)
    d8 = np.full((2, 40, dim), -128, np.int8)
    d8[1, :, ::2] = 127
    ones = np.ones((1, 64), np.float32)
    s = _np(lik_cupy.maxsim_int8(_cp(q8), _cp(d8), _cp(np.ones((2, 40), np.float32)), q_scales=_cp(ones)))
    ref = (q8[0, 0].astype(np.int64) @ d8[:, 0].astype(np.int64).T) * 64
    assert np.array_equal(s[0], ref.astype(np.float32))


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_int8_on_another_gpu_is_the_current_gpus_call(rng, other_gpu, fw):
    """quantize_int8, dequantize_int8, maxsim_int8 (float and int8 queries, device lengths) and
    maxsim_int8_varlen with their arrays on cuda:1 while cuda:0 is current: on cuda:1, bit for bit as on
    cuda:0, twice, with cuda:0 current after each."""
    from devices import assert_calls_match, on_gpu

    def there(x, device):
        if fw == "torch":
            torch = pytest.importorskip("torch")
            return torch.from_numpy(x).to(f"cuda:{device}")
        return on_gpu(x, device)

    dim = 64
    q = _unit(rng, 3, 20, dim)
    d = _unit(rng, 9, 30, dim)
    d8, ds = lik_cupy.quantize_int8(d, backend="cpu")
    q8, qs = lik_cupy.quantize_int8(q, backend="cpu")
    dl = rng.integers(0, 31, 9)
    off = np.concatenate([[0], np.cumsum(dl)])
    valid = np.arange(30)[None, :] < dl[:, None]
    arrays = {"q": q, "d": d, "d8": d8, "ds": ds, "q8": q8, "qs": qs, "dl": dl, "off": off,
              "t8": np.ascontiguousarray(d8[valid]), "ts": np.ascontiguousarray(ds[valid])}
    calls = {
        "quantize": lambda a: lik_cupy.quantize_int8(a["d"]),
        "dequantize": lambda a: lik_cupy.dequantize_int8(a["d8"], a["ds"]),
        "float queries": lambda a: lik_cupy.maxsim_int8(a["q"], a["d8"], a["ds"], d_lengths=a["dl"],
                                                        return_argmax=True),
        "int8 queries": lambda a: lik_cupy.maxsim_int8(a["q8"], a["d8"], a["ds"], q_scales=a["qs"]),
        "packed": lambda a: lik_cupy.maxsim_int8_varlen(a["q"], a["t8"], a["ts"], a["off"], return_argmax=True),
    }
    here = {k: there(v, 0) for k, v in arrays.items()}
    other = {k: there(v, other_gpu) for k, v in arrays.items()}
    assert_calls_match(calls, here, other, other_gpu)
