"""FP8 (e4m3) scoring on the GPU (skipped without one, or on a GPU older than sm_89).

The reference is the float64 MaxSim of the dequantised inputs. The tensor cores accumulate e4m3
products in float32 (Hopper's FP8 wgmma keeps fewer bits per addition), so a score may lie from it
by a small fraction of the sum of |products| (``_bound``), and an argmax may point at any token
whose reference similarity is within that of its row's max. Outputs are poisoned (LIK_POISON=1,
tests/conftest.py), so an element a kernel forgot to write cannot pass. On Hopper FP8 runs on its
wgmma tiles only (mma.sync is emulated there): shapes those tiles do not take raise instead.
"""

import ml_dtypes
import numpy as np
import pytest

import lik_cupy
from reference import clustered, maxsim_ref, spearman, topk_overlap

pytestmark = pytest.mark.gpu

REL = 2.0**-9  # of the sum of |products|: float32 accumulation with Hopper's shorter FP8 adder, and scaling


@pytest.fixture(autouse=True)
def _fp8_gpu():
    if not lik_cupy.gpu_available():
        pytest.skip("no GPU")
    import cupy

    if int(cupy.cuda.Device().compute_capability) < 89:
        pytest.skip("FP8 tensor cores need sm_89 or newer")


def _hopper() -> bool:
    import cupy

    return int(cupy.cuda.Device().compute_capability) == 90


def _wgmma_takes(dim: int) -> bool:
    """Whether Hopper's FP8 wgmma tiles take dim (d > 512 runs split-d, any multiple of 16; short
    queries of d 384 and 512 take the two-warpgroup tiles)."""
    return dim % 128 == 0 or dim > 512


@pytest.fixture(params=["wgmma", "mma"])
def kernel_family(request, monkeypatch):
    # The warpgroup kernels and the portable mma.sync ones (the same on sm_89; Hopper has only the first).
    if request.param == "mma":
        if _hopper():
            pytest.skip("FP8's mma.sync is emulated on sm_90, which takes its wgmma tiles only")
        monkeypatch.setenv("LIK_DISABLE_WGMMA", "1")
    return request.param


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _cp(a):
    """A CuPy copy; FP8 (ml_dtypes) as its uint8 bit patterns, the form CuPy holds it in."""
    import cupy

    a = np.asarray(a)
    return cupy.asarray(a.view(np.uint8) if a.dtype == ml_dtypes.float8_e4m3fn else a)


def _np(a):
    import cupy

    return cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else np.asarray(a)


def _deq(q, s):
    s = np.asarray(s, np.float64)
    return q.astype(np.float64) * (s[..., None] if s.ndim else s)


def _bound(qd, dd, q_valid=None, d_valid=None):
    """[Nq, Nd]: REL times the MaxSim of |Q| against |D| (each term bounds its row's sum of |products|)."""
    return REL * maxsim_ref(np.abs(qd), np.abs(dd), q_valid, d_valid)[0] + 1e-30


def _check(s, a, qd, dd, q_valid=None, d_valid=None):
    """Scores against the float64 reference and argmax against each row's reference maxima."""
    ref, sims = maxsim_ref(qd, dd, q_valid, d_valid)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(s), fin) and np.array_equal(s[~fin], ref[~fin])
    bound = _bound(qd, dd, q_valid, d_valid)
    assert np.all(np.abs(s[fin] - ref[fin]) <= bound[fin]), np.max(np.abs(s - ref)[fin] / bound[fin])
    if a is None:
        return
    best = sims.max(axis=3)
    qv = np.ones((best.shape[0], best.shape[2]), bool) if q_valid is None else q_valid
    row_bound = REL * np.einsum("isk,jtk->ijst", np.abs(qd), np.abs(dd)).max(axis=3)
    live = qv[:, None, :] & np.isfinite(best)
    assert np.all(a[live] >= 0)
    got = np.take_along_axis(sims, np.maximum(a, 0)[..., None].astype(np.int64), axis=3)[..., 0]
    assert np.all(got[live] >= best[live] - row_bound[live] - 1e-30)


@pytest.mark.parametrize("dim", [16, 48, 128, 256, 512, 1024, 2048])
def test_padded_vs_float64_of_dequantised(rng, dim, kernel_family):
    if _hopper() and not _wgmma_takes(dim):
        pytest.skip("no Hopper FP8 tile for this dim (test_hopper_refuses_what_its_wgmma_tiles_do_not_take)")
    nq, lq, nd, ld = 3, int(rng.integers(1, 200)), 41, int(rng.integers(1, 300))
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, nq, lq, dim))
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, nd, ld, dim))
    s, a = lik_cupy.maxsim_fp8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs), return_argmax=True)
    _check(_np(s), _np(a), _deq(q8, qs), _deq(d8, ds))


@pytest.mark.parametrize("dim,nq,lq", [(640, 9, 5), (1024, 1, 32), (2048, 3, 21), (2048, 1, 64)])
def test_short_queries_with_the_argmax_split_over_d(rng, dim, nq, lq, kernel_family):
    # Split-d's one-warpgroup tiles leave a scaled type's argmax out: on sm_90 these short queries
    # take the two-warpgroup tiles (once refused there, as if no tile took the dim)
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, nq, lq, dim))
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, 37, 90, dim))
    s, a = lik_cupy.maxsim_fp8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs), return_argmax=True)
    _check(_np(s), _np(a), _deq(q8, qs), _deq(d8, ds))
    _check(_np(lik_cupy.maxsim_fp8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs))), None, _deq(q8, qs), _deq(d8, ds))


@pytest.mark.parametrize("lq", [1, 31, 32, 100, 300, 1024])
def test_masks_lengths_and_empty_documents(rng, lq, kernel_family):
    dim, nq, nd, ld = 128, 2, 23, 151
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, nq, lq, dim))
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, nd, ld, dim) * rng.uniform(0.1, 4, (nd, ld, 1)).astype(np.float32))
    q_mask = rng.random((nq, lq)) < 0.8
    d_len = rng.integers(0, ld + 1, nd)
    d_len[[0, 5]] = 0
    d_len[1] = ld
    s, a = lik_cupy.maxsim_fp8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs), q_mask=_cp(q_mask),
                               d_lengths=_cp(d_len), return_argmax=True)
    dv = np.arange(ld)[None, :] < d_len[:, None]
    _check(_np(s), _np(a), _deq(q8, qs), _deq(d8, ds), q_mask, dv)
    live = q_mask.any(axis=1)  # a query with no valid token scores 0 everywhere
    assert np.all(np.isneginf(_np(s)[live][:, d_len == 0]))


@pytest.mark.parametrize("nq,lq", [(32, 32), (8, 20), (5, 64)])
def test_short_queries_share_document_tiles(rng, nq, lq, kernel_family):
    dim, nd, ld = 128, 300, 130
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, nq, lq, dim))
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, nd, ld, dim))
    d_len = rng.integers(1, ld + 1, nd)
    s, a = lik_cupy.maxsim_fp8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs), d_lengths=_cp(d_len), return_argmax=True)
    _check(_np(s), _np(a), _deq(q8, qs), _deq(d8, ds), None, np.arange(ld)[None, :] < d_len[:, None])


@pytest.mark.parametrize("dim", [96, 128, 1024])
def test_packed_documents(rng, dim, kernel_family):
    if _hopper() and not _wgmma_takes(dim):
        pytest.skip("no Hopper FP8 tile for this dim (test_hopper_refuses_what_its_wgmma_tiles_do_not_take)")
    nq, lq = 3, 45
    lens = rng.integers(0, 260, 57)
    lens[[2, 9]] = 0
    off = np.concatenate([[0], np.cumsum(lens)])
    tok8, ts = lik_cupy.quantize_fp8(_unit(rng, int(off[-1]), dim))
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, nq, lq, dim))
    s, a = lik_cupy.maxsim_fp8_varlen(_cp(q8), _cp(tok8), _cp(ts), _cp(off), q_scales=_cp(qs), return_argmax=True)
    ld = int(lens.max())
    pad = np.zeros((len(lens), ld, dim))
    for j, (o, n) in enumerate(zip(off[:-1], lens)):
        pad[j, :n] = _deq(tok8[o:o + n], ts[o:o + n])
    _check(_np(s), _np(a), _deq(q8, qs), pad, None, np.arange(ld)[None, :] < lens[:, None])
    assert np.all(np.isneginf(_np(s)[:, lens == 0]))


def test_few_long_packed_documents_split_over_ctas(rng, kernel_family):
    # Two documents of 20,000 tokens: the token split shares them out over CTAs and merges the pieces.
    dim, lens = 128, np.array([20_000, 13_001])
    off = np.concatenate([[0], np.cumsum(lens)])
    tok8, ts = lik_cupy.quantize_fp8(_unit(rng, int(off[-1]), dim))
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, 1, 32, dim))
    s, a = lik_cupy.maxsim_fp8_varlen(_cp(q8), _cp(tok8), _cp(ts), _cp(off), q_scales=_cp(qs), return_argmax=True)
    pad = np.zeros((2, lens.max(), dim))
    for j in range(2):
        pad[j, :lens[j]] = _deq(tok8[off[j]:off[j + 1]], ts[off[j]:off[j + 1]])
    _check(_np(s), _np(a), _deq(q8, qs), pad, None, np.arange(lens.max())[None, :] < lens[:, None])


def test_candidates_per_query(rng, kernel_family):
    nq, k, ld, dim = 5, 7, 90, 128
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, nq, 24, dim))
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, nq, k, ld, dim))
    # [nq, k, ld, dim]: each query's own documents (Hopper's argmax over candidate id arrays has no
    # FP8 tile; this layout is not that)
    out = lik_cupy.maxsim_fp8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs), return_argmax=True)
    s, a = _np(out[0]), _np(out[1])
    assert s.shape == (nq, k)
    for i in range(nq):
        _check(s[i:i + 1], a[i:i + 1], _deq(q8[i:i + 1], qs[i:i + 1]), _deq(d8[i], ds[i]))


def test_hopper_refuses_what_its_wgmma_tiles_do_not_take(rng, monkeypatch):
    if not _hopper():
        pytest.skip("sm_90 only")
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, 2, 16, 96))
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, 5, 40, 96))
    with pytest.raises(ValueError, match=r"float8_e4m3fn on sm_90 runs on its wgmma tiles only .* \(d = 96\)"):
        lik_cupy.maxsim_fp8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs))
    assert np.isfinite(lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, backend="cpu")).all()
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, 2, 16, 128))
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, 3, 40, 128))
    monkeypatch.setenv("LIK_DISABLE_WGMMA", "1")
    with pytest.raises(ValueError, match="leave LIK_DISABLE_WGMMA unset"):
        lik_cupy.maxsim_fp8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs))


def test_per_tensor_scales_and_float_queries(rng, kernel_family):
    q = _unit(rng, 4, 33, 128)
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, 60, 77, 128), per="tensor")
    s_float_q = _np(lik_cupy.maxsim_fp8(_cp(q), _cp(d8), _cp(ds)))  # Q quantised per token on the device
    q8, qs = lik_cupy.quantize_fp8(q)
    s = _np(lik_cupy.maxsim_fp8(_cp(q8), _cp(d8), _cp(ds), q_scales=_cp(qs)))
    assert np.array_equal(s_float_q, s)
    _check(s, None, _deq(q8, qs), _deq(d8, ds))


@pytest.mark.parametrize("per", ["token", "tensor"])
def test_device_quantiser_gives_the_numpy_bytes(rng, per):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((7, 50, 96)) * np.exp2(rng.uniform(-20, 6, (7, 50, 1)))
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        xh = x.astype(dtype)
        q, s = lik_cupy.quantize_fp8(xh, per=per, backend="cpu")
        if dtype is ml_dtypes.bfloat16:
            qd, sd = lik_cupy.quantize_fp8(torch.from_numpy(xh.view(np.int16)).view(torch.bfloat16).cuda(), per=per)
            assert qd.dtype == torch.float8_e4m3fn
            qd, sd = qd.view(torch.uint8).cpu().numpy(), sd.cpu().numpy()
        else:
            qd, sd = (_np(t) for t in lik_cupy.quantize_fp8(_cp(xh), per=per))
        assert np.array_equal(qd.view(np.uint8), q.view(np.uint8)) and np.array_equal(sd, s)


def test_torch_float8_tensors_round_trip(rng):
    torch = pytest.importorskip("torch")
    q = torch.from_numpy(_unit(rng, 3, 20, 128)).cuda()
    d = torch.from_numpy(_unit(rng, 40, 60, 128)).cuda()
    q8, qs = lik_cupy.quantize_fp8(q)
    d8, ds = lik_cupy.quantize_fp8(d)
    assert q8.dtype == torch.float8_e4m3fn and q8.is_cuda and ds.dtype == torch.float32
    s = lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs)
    assert isinstance(s, torch.Tensor) and s.is_cuda
    bits = lik_cupy.maxsim_fp8(q8.view(torch.uint8), d8.view(torch.uint8), ds, q_scales=qs)
    assert torch.equal(s, bits)
    back = lik_cupy.dequantize_fp8(d8, ds)
    assert torch.equal(back.cpu(), d8.cpu().float() * ds.cpu()[..., None])


def test_nan_tokens_and_zero_scales(rng, kernel_family):
    dim = 128
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, 2, 10, dim))
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, 6, 12, dim))
    qs[0, 3] = 0  # a zero-scale query token: its term is 0
    ds = ds.copy()
    ds[2, :] = 0  # a document of zero-scale tokens scores 0 per term
    dnan = d8.view(np.uint8).copy()
    dnan[4, 5, 7] = 0x7F  # e4m3 NaN: that document's scores are NaN
    s = _np(lik_cupy.maxsim_fp8(_cp(q8), _cp(dnan), _cp(ds), q_scales=_cp(qs)))
    ref = lik_cupy.maxsim_fp8(q8, dnan, ds, q_scales=qs, backend="cpu")
    assert np.array_equal(np.isnan(s), np.isnan(ref)) and np.all(np.isnan(s[:, 4]))
    assert np.all(s[:, 2] == 0)


# Spearman and recall@10 bars per kind: FP8's 3 fraction bits rank less faithfully than INT8 (the
# NumPy path measured Spearman 0.996 / 0.994-0.996 / 0.93-0.95 and recall@10 0.89-0.90 / 0.83-0.91 /
# 0.45-0.49 on these inputs, where INT8 has 0.9997 / 0.9996 / 0.995 and 0.95-0.98 / 0.95-0.96 / 0.83).
FIDELITY_BARS = {"unit": (0.99, 0.75), "clustered-64-0.1": (0.985, 0.7), "clustered-16-0.05": (0.9, 0.3)}


@pytest.mark.parametrize("kind", list(FIDELITY_BARS))
def test_fidelity_against_float_scores(rng, kind):
    # As INT8's: Spearman and recall@10 of FP8 scores against float64 scores of the float inputs.
    dim, nq, lq, nd, ld = 128, 16, 32, 1500, 48
    if kind == "unit":
        q, d = _unit(rng, nq, lq, dim), _unit(rng, nd, ld, dim)
    else:
        centres, spread = (64, 0.1) if kind == "clustered-64-0.1" else (16, 0.05)
        q = clustered(rng, (nq, lq, dim), centres, spread).astype(np.float32)
        d = clustered(rng, (nd, ld, dim), centres, spread).astype(np.float32)
    exact = maxsim_ref(q, d)[0]
    d8, ds = lik_cupy.quantize_fp8(_cp(d))
    got = _np(lik_cupy.maxsim_fp8(_cp(q), d8, ds))
    rho = np.mean([spearman(got[i], exact[i]) for i in range(nq)])
    recall = np.mean([topk_overlap(got[i], exact[i], 10) for i in range(nq)])
    print(f"\nFP8 fidelity {kind}: Spearman {rho:.5f}, recall@10 {recall:.3f}")
    assert rho >= FIDELITY_BARS[kind][0] and recall >= FIDELITY_BARS[kind][1], (kind, rho, recall)


def test_fp8_on_another_gpu_is_the_current_gpus_call(rng, other_gpu):
    """quantize_fp8 (per token and per tensor), dequantize_fp8, maxsim_fp8 and maxsim_fp8_varlen with their
    arrays on cuda:1 while cuda:0 is current: on cuda:1, bit for bit as on cuda:0, with cuda:0 current after each."""
    from devices import assert_calls_match, on_gpu

    import cupy

    with cupy.cuda.Device(other_gpu):
        if int(cupy.cuda.Device().compute_capability) < 89:
            pytest.skip("FP8 tensor cores need sm_89 or newer")
    dim = 128
    q = _unit(rng, 3, 16, dim)
    d = _unit(rng, 9, 24, dim)
    d8, ds = lik_cupy.quantize_fp8(d, backend="cpu")
    dl = rng.integers(0, 25, 9)
    off = np.concatenate([[0], np.cumsum(dl)])
    valid = np.arange(24)[None, :] < dl[:, None]
    arrays = {"q": q, "d": d, "d8": d8, "ds": ds, "dl": dl, "off": off, "t8": np.ascontiguousarray(d8[valid]),
              "ts": np.ascontiguousarray(ds[valid])}
    calls = {
        "quantize": lambda a: lik_cupy.quantize_fp8(a["d"]),
        "quantize per tensor": lambda a: lik_cupy.quantize_fp8(a["d"], per="tensor"),
        "dequantize": lambda a: lik_cupy.dequantize_fp8(a["d8"], a["ds"]),
        "padded": lambda a: lik_cupy.maxsim_fp8(a["q"], a["d8"], a["ds"], d_lengths=a["dl"], return_argmax=True),
        "packed": lambda a: lik_cupy.maxsim_fp8_varlen(a["q"], a["t8"], a["ts"], a["off"]),
    }
    here = {k: on_gpu(_np(_cp(v)), 0) for k, v in arrays.items()}  # (FP8 as its uint8 bits)
    other = {k: on_gpu(v, other_gpu) for k, v in here.items()}
    assert_calls_match(calls, here, other, other_gpu, repeats=1)
