"""FP8 (float8_e4m3fn) quantisation and scoring on the CPU path: the quantisers against torch's float8
casts bit for bit, scores against the float64 MaxSim of the dequantised inputs on every layout, the
ways FP8 arrays are passed, validation, the GPU's architecture rule and the kernels' dispatch."""

import ml_dtypes
import numpy as np
import pytest

import lik_cupy
from lik_cupy import _dispatch as dispatch
from reference import maxsim_ref, rel_err

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _host_arrays_stay_on_the_cpu(monkeypatch):
    """The NumPy path's tests: on a GPU host, ``backend="auto"`` would send their host arrays to the
    GPU (whose FP8 tiles refuse most of these small dims, and whose quantiser these tests do not
    cover), so this module runs as a host without one does."""
    from lik_cupy._dispatch import backend

    monkeypatch.setattr(backend, "gpu_available", lambda: False)

F8 = ml_dtypes.float8_e4m3fn
TOL = 2e-6  # float32 rounding of the scaled similarities and of the sum over query tokens


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _deq(q, s):
    """float64 values of FP8 codes ``q`` (ml_dtypes) times scales ``s`` (per token, or one for all)."""
    s = np.asarray(s, np.float64)
    return q.astype(np.float64) * (s[..., None] if s.ndim else s)


def _torch_codes(x32, s, per):
    """torch's cast of x / scale to float8_e4m3fn, saturated at +-448 first (as the kernel's satfinite
    conversion: torch 2.13's cast saturates by itself, 2.11's gave past-range values the NaN code),
    as uint8 bit patterns."""
    st = torch.from_numpy(np.asarray(s, np.float32))
    t = (torch.from_numpy(x32) / (st[..., None] if per == "token" else st)).clamp(-448, 448)
    return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _check_argmax(a, sims, best, tol=1e-6):
    """Every valid argmax points at a token whose reference similarity is its row's max."""
    got = np.take_along_axis(sims, np.maximum(a, 0)[..., None].astype(np.int64), axis=-1)[..., 0]
    ok = np.isfinite(best)
    assert np.all(a[ok] >= 0)
    assert np.all(got[ok] >= best[ok] - tol * np.maximum(1, np.abs(best[ok])))


@pytest.mark.parametrize("per", ["token", "tensor"])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_quantiser_codes_match_torch(rng, per, dtype):
    # Magnitudes over 2^-30 .. 2^7 reach e4m3's subnormals and both ends of its range.
    x = (rng.standard_normal((9, 7, 48)) * np.exp2(rng.uniform(-30, 7, (9, 7, 1)))).astype(dtype)
    x[3, 2] = 0  # a padding token
    q, s = lik_cupy.quantize_fp8(x, per=per)
    assert q.dtype == F8 and q.shape == x.shape and s.dtype == np.float32
    x32 = x.astype(np.float32)
    amax = np.abs(x32).max(-1) if per == "token" else np.abs(x32).max()
    assert s.shape == (x.shape[:-1] if per == "token" else ()) and np.array_equal(s, amax / np.float32(448))
    want = _torch_codes(x32, s, per)
    if per == "token":  # scale 0 (the padding token, float16's underflows): codes 0, where torch divides by zero
        assert s[3, 2] == 0
        want[s == 0] = 0
    assert np.array_equal(q.view(np.uint8), want)
    # torch tensors in, torch float8 out, the same bits
    tq, ts = lik_cupy.quantize_fp8(torch.from_numpy(x32), per=per)
    assert tq.dtype == torch.float8_e4m3fn and np.array_equal(tq.view(torch.uint8).numpy(), want)
    assert np.array_equal(ts.numpy(), s.astype(np.float32))


def test_tokens_of_denormal_values_saturate_as_torch_does(rng):
    """A token whose largest value is a float32 denormal gets a scale too coarse for it: x / scale
    passes 448, which torch's cast (and the kernel's satfinite conversion) saturates, and ml_dtypes'
    cast would have turned into NaN codes."""
    x = np.array([[6.59e-43, -3.0e-43, 1e-43, 0.0], [1e-44, 0, 0, -1e-45]], np.float32)
    x = np.concatenate([x, (rng.standard_normal((200, 4)) * np.exp2(rng.uniform(-149, -120, (200, 1))))
                        .astype(np.float32)])
    q, s = lik_cupy.quantize_fp8(x)
    bits = q.view(np.uint8)
    assert not np.isin(bits, (0x7F, 0xFF)).any()  # no NaN code
    assert np.array_equal(bits, np.where((s == 0)[:, None], 0, _torch_codes(x, s, "token")))
    assert np.isfinite(lik_cupy.maxsim_fp8(np.ones((1, 1, 4), np.float32), q[None], s[None], backend="cpu")).all()


@pytest.mark.parametrize("per", ["token", "tensor"])
def test_dequantise_is_exact(rng, per):
    x = rng.standard_normal((5, 3, 32)).astype(np.float32)
    q, s = lik_cupy.quantize_fp8(x, per=per)
    back = lik_cupy.dequantize_fp8(q, s)
    assert back.dtype == np.float32 and np.array_equal(back, (_deq(q, s)).astype(np.float32))
    assert np.array_equal(lik_cupy.dequantize_fp8(q.view(np.uint8), s), back)  # bit patterns as uint8
    tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    assert np.array_equal(lik_cupy.dequantize_fp8(tq, torch.from_numpy(np.asarray(s))).numpy(), back)
    err = np.abs(_deq(q, s) - x)  # e4m3 keeps 3 fraction bits: within 2^-4 of each value (or of a subnormal step)
    scale = np.asarray(s, np.float64)[..., None] if per == "token" else float(s)
    assert np.all(err <= np.maximum(np.abs(x) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6))


def test_quantiser_rejects_bad_input():
    x = np.ones((3, 4, 16), np.float32)
    x[1, 2, 5] = np.nan
    with pytest.raises(ValueError, match=r"NaN or inf in token \(1, 2\)"):
        lik_cupy.quantize_fp8(x)
    with pytest.raises(ValueError, match=r"NaN or inf in token \(1, 2\)"):
        lik_cupy.quantize_fp8(x, per="tensor")
    with pytest.raises(ValueError, match="per is 'row'; expected 'token' or 'tensor'"):
        lik_cupy.quantize_fp8(np.ones((2, 16), np.float32), per="row")
    with pytest.raises(ValueError, match=r"per is array\(\['token', 'tensor'\].*; expected 'token' or 'tensor'"):
        lik_cupy.quantize_fp8(np.ones((2, 16), np.float32), per=np.array(["token", "tensor"]))
    with pytest.raises(TypeError, match="dtype int32"):
        lik_cupy.quantize_fp8(np.ones((2, 16), np.int32))
    with pytest.raises(TypeError, match=r"X_fp8 has dtype int8; expected float8_e4m3fn \(or uint8 holding its bit"):
        lik_cupy.dequantize_fp8(np.zeros((3, 16), np.int8), np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"scales has shape \[4\]; expected \[3\] .* or \[\] \(one per tensor\)"):
        lik_cupy.dequantize_fp8(np.zeros((3, 16), F8), np.ones(4, np.float32))


@pytest.mark.parametrize("per", ["token", "tensor"])
def test_padded_scores_and_argmax_vs_float64_of_dequantised(rng, per):
    nq, lq, nd, ld, dim = 3, 37, 29, 53, 80
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, nq, lq, dim), per=per)
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, nd, ld, dim) * rng.uniform(0.1, 3, (nd, ld, 1)).astype(np.float32),
                                   per=per)
    q_mask = rng.random((nq, lq)) < 0.8
    d_len = rng.integers(0, ld + 1, nd)
    d_len[[0, 4]] = 0  # empty documents
    s, a = lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, q_mask=q_mask, d_lengths=d_len, return_argmax=True)
    assert s.dtype == np.float32 and s.shape == (nq, nd) and a.shape == (nq, nd, lq)
    dv = np.arange(ld)[None, :] < d_len[:, None]
    ref, sims = maxsim_ref(_deq(q8, qs), _deq(d8, ds), q_mask, dv)
    assert rel_err(s, ref) < TOL
    assert np.all(np.isneginf(s[:, d_len == 0]))
    best = sims.max(axis=3)
    _check_argmax(np.where(q_mask[:, None, :], a, 0), sims, np.where(q_mask[:, None, :], best, np.nan))
    # the same bits as uint8 arrays, and as torch float8 tensors
    s8, a8 = lik_cupy.maxsim_fp8(q8.view(np.uint8), d8.view(np.uint8), ds, q_scales=qs, q_mask=q_mask,
                                 d_lengths=d_len, return_argmax=True)
    assert np.array_equal(s8, s) and np.array_equal(a8, a)
    ts = lik_cupy.maxsim_fp8(*(torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q8, d8)),
                             torch.from_numpy(np.asarray(ds)), q_scales=torch.from_numpy(np.asarray(qs)),
                             q_mask=torch.from_numpy(q_mask), d_lengths=torch.from_numpy(d_len))
    assert isinstance(ts, torch.Tensor) and np.array_equal(ts.numpy(), s)


def test_packed_documents_vs_float64_and_padded(rng):
    dim, nq, lq = 48, 2, 21
    lens = rng.integers(0, 40, 23)
    lens[3] = 0
    off = np.concatenate([[0], np.cumsum(lens)])
    tok8, ts = lik_cupy.quantize_fp8(_unit(rng, int(off[-1]), dim))
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, nq, lq, dim))
    s, a = lik_cupy.maxsim_fp8_varlen(q8, tok8, ts, off, q_scales=qs, return_argmax=True)
    ld = int(lens.max())
    pad = np.zeros((len(lens), ld, dim), F8)
    pads = np.zeros((len(lens), ld), np.float32)
    for j, (o, n) in enumerate(zip(off[:-1], lens)):
        pad[j, :n], pads[j, :n] = tok8[o:o + n], ts[o:o + n]
    sp, ap = lik_cupy.maxsim_fp8(q8, pad, pads, q_scales=qs, d_lengths=lens, return_argmax=True)
    assert np.array_equal(s, sp) and np.array_equal(a, ap)
    ref, _ = maxsim_ref(_deq(q8, qs), _deq(pad, pads), None, np.arange(ld)[None, :] < lens[:, None])
    assert rel_err(s, ref) < TOL and np.all(np.isneginf(s[:, 3]))


def test_candidates_and_float_queries(rng):
    nq, k, ld, dim = 4, 6, 19, 64
    q = _unit(rng, nq, 11, dim)
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, nq, k, ld, dim))
    s, a = lik_cupy.maxsim_fp8(q, d8, ds, return_argmax=True)  # a float Q is quantised per token first
    q8, qs = lik_cupy.quantize_fp8(q)
    s8, a8 = lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=True)
    assert s.shape == (nq, k) and np.array_equal(s, s8) and np.array_equal(a, a8)
    for i in range(nq):
        ref, _ = maxsim_ref(_deq(q8[i:i + 1], qs[i:i + 1]), _deq(d8[i], ds[i]))
        assert rel_err(s[i:i + 1], ref) < TOL


def test_per_tensor_scales_broadcast(rng):
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, 2, 9, 32), per="tensor")
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, 5, 13, 32), per="tensor")
    s = lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs)
    full = lik_cupy.maxsim_fp8(q8, d8, np.full((5, 13), ds, np.float32), q_scales=np.full((2, 9), qs, np.float32))
    assert np.array_equal(s, full)
    off = np.array([0, 20, 65], np.int64)
    t8, tsc = lik_cupy.quantize_fp8(_unit(rng, 65, 32), per="tensor")
    sv = lik_cupy.maxsim_fp8_varlen(q8, t8, tsc, off, q_scales=qs)
    assert np.array_equal(sv, lik_cupy.maxsim_fp8_varlen(q8, t8, np.full(65, tsc, np.float32), off, q_scales=qs))


def test_validation_messages():
    q = np.zeros((2, 5, 32), np.float32)
    d8 = np.zeros((3, 7, 32), F8)
    ds = np.ones((3, 7), np.float32)
    with pytest.raises(TypeError, match=r"D has dtype float16; expected float8_e4m3fn \(or uint8 holding its bit "
                                        r"patterns\) \(quantize it with lik_cupy.quantize_fp8\)"):
        lik_cupy.maxsim_fp8(q, d8.astype(np.float16), ds)
    with pytest.raises(TypeError, match="D has dtype int8"):
        lik_cupy.maxsim_fp8(q, np.zeros((3, 7, 32), np.int8), ds)
    with pytest.raises(TypeError, match="Q is float8_e4m3fn, so q_scales is required"):
        lik_cupy.maxsim_fp8(q.astype(F8), d8, ds)
    with pytest.raises(ValueError, match="q_scales goes with a float8_e4m3fn Q, but Q is float32"):
        lik_cupy.maxsim_fp8(q, d8, ds, q_scales=np.ones((2, 5), np.float32))
    with pytest.raises(ValueError, match=r"d_scales has shape \[3\]; expected \[3, 7\]"):
        lik_cupy.maxsim_fp8(q, d8, ds[:, 0])
    with pytest.raises(ValueError, match=r"d_scales has shape \[9\]; expected \[7\]"):
        lik_cupy.maxsim_fp8_varlen(q, d8[0], np.ones(9, np.float32), np.array([0, 7]))
    with pytest.raises(TypeError, match="Q has dtype int8"):  # INT8 queries do not score FP8 documents
        lik_cupy.maxsim_fp8(q.astype(np.int8), d8, ds)
    with pytest.raises(TypeError, match="D has dtype uint8; expected int8"):  # nor FP8 bits INT8's
        lik_cupy.maxsim_int8(q, d8.view(np.uint8), ds)
    neg = lik_cupy.maxsim_fp8(q.astype(F8), d8, ds, q_scales=np.full((2, 5), -1, np.float32))
    assert np.all(np.isnan(neg))  # negative query scales: NaN, as in the kernel
    with pytest.raises(ValueError, match=r"d_scales\[0, 2\] is -1.0; the scale of a valid token must be finite and "
                                         r">= 0 \(token = values \* scale\)"):
        lik_cupy.maxsim_fp8(q, d8, np.where(np.arange(7) == 2, -1, 1).astype(np.float32)[None].repeat(3, 0))


def test_retrieve_and_corpus_refuse_fp8_for_now(rng):
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, 4, 6, 32))
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, 2, 3, 32))
    refused = r"has dtype float8_e4m3fn, which retrieve and Corpus do not take yet .*lik_cupy\.dequantize_fp8"
    with pytest.raises(TypeError, match="the corpus " + refused):
        lik_cupy.retrieve(_unit(rng, 2, 3, 32), d8, 2, d_scales=ds)
    with pytest.raises(TypeError, match="Q " + refused):
        lik_cupy.retrieve(q8, d8, 2, q_scales=qs, d_scales=ds)
    with pytest.raises(TypeError, match=refused):
        lik_cupy.Corpus(d8, d_scales=ds)


def test_older_gpus_are_refused_by_name(monkeypatch):
    from lik_cupy._base.device import DeviceProps
    from lik_cupy._dispatch import backend

    monkeypatch.setattr(backend, "device_properties", lambda d: DeviceProps("NVIDIA A100-SXM4-80GB", 80, 108))
    with pytest.raises(RuntimeError, match=r"float8_e4m3fn on the GPU needs compute capability 8.9 or newer .* "
                                           r"device 0 \(NVIDIA A100-SXM4-80GB\) has 8.0: use backend='cpu', or "
                                           r"dequantise \(dequantize_fp8\)"):
        backend.check_gpu_arch("float8_e4m3fn", 0)
    backend.check_gpu_arch("int8", 0)  # INT8 runs there
    monkeypatch.setattr(backend, "device_properties", lambda d: DeviceProps("NVIDIA L4", 89, 58))
    backend.check_gpu_arch("float8_e4m3fn", 0)


def test_auto_keeps_host_arrays_the_gpu_cannot_take_on_the_cpu(rng, monkeypatch):
    """On a GPU host, ``backend="auto"`` scores host FP8 arrays on the CPU where the GPU lacks their dim
    or FP8 instructions (as a host without a GPU would), and sends them to the GPU where it has both;
    device arrays and ``"gpu"`` still raise."""
    import types

    from lik_cupy._base.device import DeviceProps
    from lik_cupy._dispatch import backend

    monkeypatch.setattr(backend, "gpu_available", lambda: True)
    monkeypatch.setattr(backend, "_current_device", lambda: 0)
    monkeypatch.setattr(backend, "device_properties", lambda d: DeviceProps("NVIDIA H200", 90, 132))
    q8, qs = lik_cupy.quantize_fp8(_unit(rng, 2, 5, 32), backend="cpu")
    d8, ds = lik_cupy.quantize_fp8(_unit(rng, 3, 7, 32), backend="cpu")
    s, a = lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=True)  # d = 32: no FP8 tile takes it
    s_cpu, a_cpu = lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, return_argmax=True, backend="cpu")
    assert np.array_equal(s, s_cpu) and np.array_equal(a, a_cpu)

    def problem(dim, device=None):
        return types.SimpleNamespace(dtype="float8_e4m3fn", dim=dim, device=device)

    assert backend.scoring_on_gpu(problem(128), "auto")
    assert not backend.scoring_on_gpu(problem(32), "auto")
    assert not backend.scoring_on_gpu(problem(128), "cpu")
    # "gpu" and device arrays go on to the forward's choice, which names the tiles' rule (select.py)
    assert backend.scoring_on_gpu(problem(32), "gpu") and backend.scoring_on_gpu(problem(32, device=0), "auto")
    for args in ((problem(40), "gpu"), (problem(40, device=0), "auto")):
        with pytest.raises(ValueError, match=r"float8_e4m3fn scoring on the GPU needs dim a multiple of 16 .*; got dim 40"):
            backend.scoring_on_gpu(*args)
    assert not backend.scoring_on_gpu(problem(40), "auto")
    monkeypatch.setattr(backend, "device_properties", lambda d: DeviceProps("NVIDIA L4", 89, 58))
    assert backend.scoring_on_gpu(problem(32), "auto")  # sm_89's mma.sync takes d = 32
    monkeypatch.setattr(backend, "device_properties", lambda d: DeviceProps("NVIDIA A100-SXM4-80GB", 80, 108))
    assert not backend.scoring_on_gpu(problem(128), "auto")  # no FP8 instructions: the CPU
    assert backend.scoring_on_gpu(problem(128, device=0), "auto")  # device arrays: check_gpu_arch refuses them
    monkeypatch.setattr(backend, "device_properties", lambda d: DeviceProps("Tesla V100-SXM2-32GB", 70, 80))
    assert not backend.scoring_on_gpu(types.SimpleNamespace(dtype="float16", dim=128, device=None), "auto")


def test_the_dims_sm90_takes_are_the_ones_its_tiles_take():
    """``ElemSpec.dim_ok_on``, which keeps host arrays off a GPU that lacks their dim, against the
    forward's own choice (which raises where no tile takes the problem)."""
    spec = dispatch.elem_spec("float8_e4m3fn")
    for arch in (89, 90):
        for dim in range(16, 2049, 16):
            # (short queries with the argmax, alone or several a tile, by TMA or not: split-d's
            # one-warpgroup tiles leave a scaled type's argmax out, and sm_90 once refused them)
            for lq, argmax, shared, tma in ((32, False, 1, False), (1024, True, 1, False), (32, True, 1, True),
                                            (21, True, 3, False), (5, True, 9, True), (64, True, 1, False)):
                try:
                    dispatch.choose_forward(arch, spec.name, dim, lq, argmax, True, True, shared, 300, False, tma)
                    chosen = True
                except ValueError:
                    chosen = False
                assert spec.dim_ok_on(arch, dim) == chosen, (arch, dim, lq, argmax, shared, tma)


def test_dispatch_rows():
    spec = dispatch.elem_spec("float8_e4m3fn")
    assert spec.scaled and not spec.integer and spec.min_arch == 89 and spec.bytes == 1
    for arch in (80, 86):
        with pytest.raises(ValueError, match="needs sm_89 or newer"):
            dispatch.choose_forward(arch, "float8_e4m3fn", 128, 32, False, True)
    ada = dispatch.choose_forward(89, "float8_e4m3fn", 128, 32, True, True)
    assert not ada.wgmma and ada.target(89) == "89"
    hopper = dispatch.choose_forward(90, "float8_e4m3fn", 128, 1024, False, True, True, 1, 1024, False, True)
    int8 = dispatch.choose_forward(90, "int8", 128, 1024, False, True, True, 1, 1024, False, True)
    assert hopper.wgmma and not hopper.tokm and int8.tokm  # tokens on M read integer accumulators: INT8 only
    # sm_90 emulates FP8's mma.sync: what its wgmma tiles do not take is refused, not run slowly
    for args in ((96, 32, False, True), (128, 32, False, False), (128, 32, True, True, True, 1, 1024, False, False,
                                                                    False, True)):
        with pytest.raises(ValueError, match="float8_e4m3fn on sm_90 runs on its wgmma tiles only"):
            dispatch.choose_forward(90, "float8_e4m3fn", *args)
        dispatch.choose_forward(89, "float8_e4m3fn", *args)
    # the argmax tiles that spilled at two CTAs per SM run one on sm_90 (FP8 has no mma.sync to fall
    # back on there; INT8 takes mma.sync tiles), and the launch plan counts one; short queries at
    # d 384 and 512 take the two-warpgroup tiles
    for dim, lq, shared, packed in ((128, 32, 32, False), (256, 300, 1, True), (2048, 300, 1, False)):
        f = dispatch.choose_forward(90, "float8_e4m3fn", dim, lq, True, True, True, shared, 300, packed)
        i = dispatch.choose_forward(90, "int8", dim, lq, True, True, True, shared, 300, packed)
        assert f.wgmma and f.wide_registers and f.min_blocks == 1 and dispatch.ctas_per_sm(f, 90) == 1
        assert not i.wide_registers
    # one-warpgroup argmax tiles have 256 registers at two CTAs an SM and run two
    for shared, packed in ((1, True), (2, False), (2, True)):
        f = dispatch.choose_forward(90, "float8_e4m3fn", 128, 32, True, True, True, shared, 300, packed, True)
        assert f.warps == 4 and not f.wide_registers and f.min_blocks == 2
    # FP8 stages a short query's documents by TMA with the argmax, or when they are packed or padded
    # short; INT8's argmax never
    for ld, packed, tma in ((180, False, True), (300, False, True), (512, False, False), (1024, False, False),
                            (1024, True, True)):
        for argmax in (False, True):
            f = dispatch.choose_forward(90, "float8_e4m3fn", 128, 32, argmax, True, True, 1, ld, packed, True)
            assert f.tma == (tma or argmax), (ld, packed, argmax)
    assert not dispatch.choose_forward(90, "int8", 128, 1024, True, True, True, 1, 1024, True, True).tma
    for dim in (384, 512):
        assert dispatch.choose_forward(90, "float8_e4m3fn", dim, 32, False, True).warps == 8
    # INT8's tiles otherwise (FP8's rows are INT8's, unmeasured)
    for args in ((90, 128, 32, False), (90, 128, 300, True), (89, 256, 64, False), (90, 1024, 32, False)):
        f, i = (dispatch.choose_forward(a, t, *args[1:], True) for a, t in ((args[0], "float8_e4m3fn"), (args[0], "int8")))
        assert (f.dp, f.warps, f.mt, f.bn, f.stages, f.wgmma, f.split) == (i.dp, i.warps, i.mt, i.bn, i.stages, i.wgmma,
                                                                           i.split)
