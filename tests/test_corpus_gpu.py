"""GPU corpus scoring: multi-query tiles, packed documents, streaming top-k (skipped without a GPU)."""

import numpy as np
import pytest

import lik_cupy
from reference import maxsim_ref, rel_err
from test_forward_gpu import TOL, _argmax_ok, _cast, _cp, _np, _torch, _unit

pytestmark = pytest.mark.gpu


def _ragged(rng, nd, lo, hi, empty_frac=0.2):
    lens = rng.integers(lo, hi + 1, size=nd)
    lens[rng.random(nd) < empty_frac] = 0
    return lens


def _pad(tokens, lens):
    """Packed [T, d] -> padded [Nd, Lmax, d] with a validity mask (for the reference)."""
    nd, lmax = lens.size, max(1, int(lens.max()) if lens.size else 1)
    out = np.zeros((nd, lmax, tokens.shape[1]), tokens.dtype)
    valid = np.arange(lmax)[None, :] < lens[:, None]
    out[valid] = tokens
    return out, valid


def _grid(rng, *shape):
    """Values on a 1/8 grid: every dot product and score is exact in fp32, so ties are real
    and rankings can be compared exactly."""
    return rng.integers(-3, 4, size=shape) / 8.0


def _ranked(scores, k):
    """Full sort with the library's order: score descending, NaN last, lower index first."""
    idx = np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
    nan = np.isnan(scores)
    order = np.lexsort((idx, -np.where(nan, 0, scores), nan), axis=1)[:, :k]
    return np.take_along_axis(scores, order, 1), order


@pytest.fixture(params=[True, False], ids=["wgmma", "portable"])
def kernels(request, monkeypatch):
    if not request.param:
        monkeypatch.setenv("LIK_CUPY_DISABLE_WGMMA", "1")
    return request.param


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("nq,lq", [(32, 32), (37, 7), (5, 30), (9, 64), (3, 100), (40, 1)])
def test_multi_query_tiles(rng, kernels, dtype, nq, lq):
    dim, nd, ld = 128, 45, int(rng.integers(60, 260))
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    d, d64 = _cast(_unit(rng, nd, ld, dim), dtype)
    qlen = rng.integers(0, lq + 1, size=nq)
    dlen = rng.integers(0, ld + 1, size=nd)
    conv = _torch if dtype == "bfloat16" else _cp
    out, amax = lik_cupy.maxsim(conv(q), conv(d), q_lengths=conv(qlen), d_lengths=conv(dlen),
                                return_argmax=True)
    qv = np.arange(lq)[None, :] < qlen[:, None]
    dv = np.arange(ld)[None, :] < dlen[:, None]
    ref, sim = maxsim_ref(q64, d64, qv, dv)
    assert rel_err(_np(out), ref) < TOL[dtype]
    _argmax_ok(_np(amax), sim, qv, dv, 1e-2 if dtype == "float32" else 1e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("off_dtype", [np.int32, np.int64])
def test_varlen_vs_float64(rng, kernels, dtype, off_dtype):
    dim, nd, nq, lq = 128, 120, 6, 33
    lens = _ragged(rng, nd, 0, 1024, empty_frac=0.25)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(off_dtype)
    tok, tok64 = _cast(_unit(rng, int(lens.sum()), dim), dtype)
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    qmask = rng.random((nq, lq)) < 0.8
    conv = _torch if dtype == "bfloat16" else _cp
    out, amax = lik_cupy.maxsim_varlen(conv(q), conv(tok), conv(off), q_mask=conv(qmask), return_argmax=True)
    dpad, dv = _pad(tok64, lens)
    ref, sim = maxsim_ref(q64, dpad, qmask, dv)
    assert rel_err(_np(out), ref) < TOL[dtype]
    assert np.all(_np(out)[:, lens == 0] == -np.inf)
    _argmax_ok(_np(amax), sim, qmask, dv, 1e-2 if dtype == "float32" else 1e-3)


def test_varlen_packed_queries_and_odd_dim(rng, kernels):
    dim, nd = 72, 50
    lens = _ragged(rng, nd, 1, 300)
    off = np.concatenate([[0], np.cumsum(lens)])
    tok, tok64 = _cast(_unit(rng, int(lens.sum()), dim), "float16")
    qlens = np.array([5, 0, 31, 32, 17])
    qoff = np.concatenate([[0], np.cumsum(qlens)])
    qt, qt64 = _cast(_unit(rng, int(qlens.sum()), dim), "float16")
    out, amax = lik_cupy.maxsim_varlen(_cp(qt), _cp(tok), _cp(off), q_offsets=_cp(qoff), return_argmax=True)
    qpad, qv = _pad(qt64, qlens)
    dpad, dv = _pad(tok64, lens)
    ref, sim = maxsim_ref(qpad, dpad, qv, dv)
    assert _np(out).shape == (5, nd) and _np(amax).shape == (5, nd, 32)
    assert rel_err(_np(out), ref) < TOL["float16"]
    assert np.all(_np(out)[1] == 0)
    _argmax_ok(_np(amax), sim, qv, dv, 1e-3)


def test_varlen_matches_padded_bitwise(rng, kernels):
    # Same documents packed and padded: the per-pair score must not depend on the layout.
    dim, nd, nq, lq = 128, 200, 32, 32
    lens = _ragged(rng, nd, 16, 512, empty_frac=0.05)
    off = np.concatenate([[0], np.cumsum(lens)])
    tok, _ = _cast(_unit(rng, int(lens.sum()), dim), "float16")
    q, _ = _cast(_unit(rng, nq, lq, dim), "float16")
    dpad, _ = _pad(tok, lens)
    a = _np(lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off)))
    b = _np(lik_cupy.maxsim(_cp(q), _cp(dpad), d_lengths=_cp(lens)))
    assert rel_err(a, b) < 1e-6


def test_varlen_bad_offsets_raise_before_launch(rng):
    tok = _cp(np.zeros((10, 64), np.float16))
    q = _cp(np.zeros((2, 4, 64), np.float16))
    for off, msg in (([0, 5, 3, 10], "non-decreasing"), ([1, 5, 10], "start at 0"), ([0, 5, 9], "ends at 9")):
        with pytest.raises(ValueError, match=msg):
            lik_cupy.maxsim_varlen(q, tok, _cp(np.array(off, np.int64)))


@pytest.mark.parametrize("layout", ["padded", "packed", "shards", "host", "host_packed", "host_shards"])
def test_retrieve_exact_ranking(rng, kernels, layout):
    import cupy

    dim, nd, nq, lq, k = 64, 700, 9, 13, 50
    lens = _ragged(rng, nd, 0, 90, empty_frac=0.1)
    ld = int(lens.max())
    tok = _grid(rng, int(lens.sum()), dim).astype(np.float16)
    dpad, dv = _pad(tok, lens)
    dpad = dpad[:, :ld]
    dv = dv[:, :ld]
    dpad[nd // 2] = dpad[nd // 3]  # exact duplicate documents: a tie broken by index
    dv[nd // 2] = dv[nd // 3]
    lens[nd // 2] = lens[nd // 3]
    tok = dpad[dv]
    off = np.concatenate([[0], np.cumsum(lens)])
    q = _grid(rng, nq, lq, dim).astype(np.float16)
    ref, _ = maxsim_ref(q, dpad, None, dv)
    want_s, want_i = _ranked(ref.astype(np.float32), k)

    budget = 200_000  # forces many chunks for the host layouts
    if layout == "padded":
        s, i = lik_cupy.retrieve(_cp(q), _cp(dpad), k, d_lengths=_cp(lens))
    elif layout == "packed":
        s, i = lik_cupy.retrieve(_cp(q), _cp(tok), k, d_offsets=_cp(off))
    elif layout == "shards":
        cut = off[300]
        s, i = lik_cupy.retrieve(_cp(q), [(_cp(tok[:cut]), _cp(off[:301])), (_cp(tok[cut:]), _cp(off[300:] - cut))], k)
    elif layout == "host":
        s, i = lik_cupy.retrieve(_cp(q), dpad, k, d_mask=dv, max_gpu_bytes=budget)
    elif layout == "host_packed":
        s, i = lik_cupy.retrieve(_cp(q), tok, k, d_offsets=off, max_gpu_bytes=budget)
    else:
        s, i = lik_cupy.retrieve(q, [dpad[:123], (tok[off[123]:], off[123:] - off[123])], k, max_gpu_bytes=budget)
        assert isinstance(s, np.ndarray)
    s, i = _np(s), _np(i)
    assert i.dtype == np.int64 and s.shape == (nq, k)
    np.testing.assert_array_equal(i, want_i)
    np.testing.assert_array_equal(s, want_s)
    cupy.cuda.Device().synchronize()


def test_retrieve_streamed_equals_in_memory_bitwise(rng):
    dim, nd, nq, lq, ld = 128, 3000, 16, 32, 96
    d, _ = _cast(_unit(rng, nd, ld, dim), "float16")
    q, _ = _cast(_unit(rng, nq, lq, dim), "float16")
    lens = rng.integers(0, ld + 1, size=nd)
    a_s, a_i = lik_cupy.retrieve(_cp(q), _cp(d), 100, d_lengths=_cp(lens))
    b_s, b_i = lik_cupy.retrieve(_cp(q), d, 100, d_lengths=lens, max_gpu_bytes=8 << 20)
    np.testing.assert_array_equal(_np(a_i), _np(b_i))
    assert _np(a_s).tobytes() == _np(b_s).tobytes()
    full = _np(lik_cupy.maxsim(_cp(q), _cp(d), d_lengths=_cp(lens)))
    want_s, want_i = _ranked(full, 100)
    np.testing.assert_array_equal(_np(a_i), want_i)


def test_retrieve_nan_last_and_small_corpus(rng):
    dim = 32
    d = _unit(rng, 6, 5, dim).astype(np.float32)
    d[2, 1, 0] = np.nan
    q = _unit(rng, 3, 4, dim).astype(np.float32)
    s, i = lik_cupy.retrieve(_cp(q), _cp(d), 10, d_lengths=_cp(np.array([5, 5, 5, 0, 5, 5])))
    s, i = _np(s), _np(i)
    assert s.shape == (3, 6)
    assert np.all(i[:, -1] == 2) and np.all(np.isnan(s[:, -1]))
    assert np.all(i[:, -2] == 3) and np.all(s[:, -2] == -np.inf)


def test_topk_merge_kernel_ties_and_k(rng):
    # Heavy ties and every k up to the maximum the kernel supports.
    nq, nd = 4, 9000
    scores = rng.integers(0, 20, size=(nq, nd)).astype(np.float32)
    scores[0, ::7] = np.nan
    scores[1, ::5] = -np.inf
    for k in (1, 2, 3, 100, 1000, 4096):
        want_s, want_i = _ranked(scores, k)
        from lik_cupy.retrieve import _Gpu

        r = object.__new__(_Gpu)
        import cupy

        r.qp = type("P", (), {"nq": nq})()
        r.k, r.device, r.base = k, cupy.cuda.runtime.getDevice(), 0
        r.s, r.i = cupy.empty((nq, 0), cupy.float32), cupy.empty((nq, 0), cupy.int64)
        for a in range(0, nd, 2500):  # several merges
            b = min(nd, a + 2500)
            r._merge(cupy.ascontiguousarray(cupy.asarray(scores[:, a:b])), b - a)
        np.testing.assert_array_equal(cupy.asnumpy(r.i), want_i)
        np.testing.assert_array_equal(cupy.asnumpy(r.s), want_s)


def test_retrieve_memory_budget_respected(rng):
    import cupy

    dim, nd, nq, lq, ld = 128, 20000, 32, 32, 64
    d = rng.standard_normal((nd, ld, dim)).astype(np.float16)
    q = _cp(rng.standard_normal((nq, lq, dim)).astype(np.float16))
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    budget = 64 << 20  # the corpus is 328 MB
    lik_cupy.retrieve(q, d, 10, max_gpu_bytes=budget)
    cupy.cuda.Device().synchronize()
    # total_bytes is the pool's high-water mark of allocations still cached by the pool.
    assert pool.total_bytes() - before <= budget


def test_varlen_unvalidated_bad_offsets_stay_in_bounds(rng):
    # validate_offsets=False: garbage offsets may give garbage scores, but every read is
    # clamped to D_tokens and the library stays usable.
    import cupy

    tok = _cp(_unit(rng, 10, 64).astype(np.float16))
    q = _cp(_unit(rng, 2, 4, 64).astype(np.float16))
    for off in ([0, 5, 10**9, 10], [-(10**9), 3, 2, 10**12], [0, 10, 10, 10]):
        out = lik_cupy.maxsim_varlen(q, tok, _cp(np.array(off, np.int64)), validate_offsets=False)
        cupy.cuda.Device().synchronize()
        assert out.shape == (2, 3)
    good = lik_cupy.maxsim_varlen(q, tok, _cp(np.array([0, 4, 10])))
    assert np.isfinite(_np(good)).all()
