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
        monkeypatch.setenv("LIK_DISABLE_WGMMA", "1")
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


def test_varlen_bad_offsets_raise_in_strict_mode(rng):
    tok = _cp(np.zeros((10, 64), np.float16))
    q = _cp(np.zeros((2, 4, 64), np.float16))
    for off, msg in (([0, 5, 3, 10], "non-decreasing"), ([1, 5, 10], "start at 0"), ([0, 5, 9], "ends at 9")):
        with pytest.raises(ValueError, match=msg):
            lik_cupy.maxsim_varlen(q, tok, _cp(np.array(off, np.int64)), validate=True)


@pytest.mark.parametrize("where", [1, 255, 256, 262_143, 299_998])
def test_varlen_offsets_check_finds_one_decrease_anywhere(where):
    # 300,000 documents: the check kernel strides over more offsets than it has threads, and
    # one decrease at a block or grid-stride boundary (or the very end) must still be seen.
    nd = 300_000
    off = np.arange(nd + 1, dtype=np.int64)
    tok = _cp(np.zeros((nd, 16), np.float16))
    q = _cp(np.zeros((1, 2, 16), np.float16))
    assert _np(lik_cupy.maxsim_varlen(q, tok, _cp(off.astype(np.int32)))).shape == (1, nd)
    off[where] = off[where + 1] + 1
    off[-1] = nd
    with pytest.raises(ValueError, match="non-decreasing"):
        lik_cupy.maxsim_varlen(q, tok, _cp(off), validate=True)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("off_dtype", [np.int32, np.int64])
def test_checks_see_the_values_the_caller_stream_writes_last(rng, framework, off_dtype):
    # The checks run on a side stream of their own: they must wait for the caller's stream, so
    # offsets and lengths written there just before the call (behind a long sleep) are the
    # values checked, good turned bad raises and bad turned good passes.
    if framework == "torch":
        torch = pytest.importorskip("torch")
        conv, sleep = (lambda a: torch.as_tensor(a, device="cuda")), (lambda: torch.cuda._sleep(200_000_000))
    else:
        import cupy

        sleep_k = cupy.RawKernel(r'''extern "C" __global__ void spin(long long n) {
            long long t0 = clock64(); while (clock64() - t0 < n) {} }''', "spin")
        conv, sleep = _cp, (lambda: sleep_k((1,), (1,), (np.int64(200_000_000),)))
    nd, dim = 50, 32
    lens = rng.integers(0, 9, size=nd)
    good = np.concatenate([[0], np.cumsum(lens)]).astype(off_dtype)
    bad = good.copy()
    bad[nd // 2] = good[-1] + 1
    tok = conv(_unit(rng, int(good[-1]), dim).astype(np.float16))
    q = conv(_unit(rng, 2, 5, dim).astype(np.float16))
    for before, after, raises in ((good, bad, True), (bad, good, False)):
        off, src = conv(before), conv(after)
        sleep()
        off[...] = src  # queued on the caller's stream behind the sleep
        if raises:
            with pytest.raises(ValueError, match="non-decreasing"):
                lik_cupy.maxsim_varlen(q, tok, off, validate=True)
        else:
            assert _np(lik_cupy.maxsim_varlen(q, tok, off, validate=True)).shape == (2, nd)
    dpad, _ = _pad(_np(tok), lens)
    dl = conv(lens.astype(np.int32))
    sleep()
    dl[...] = conv(np.full(nd, 99, np.int32))  # past Ld: must raise
    with pytest.raises(ValueError, match="d_lengths"):
        lik_cupy.maxsim(q, conv(dpad), d_lengths=dl, validate=True)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16])
@pytest.mark.parametrize("where", [0, 1023, 1024, 4999])
def test_device_lengths_range_check(dtype, where):
    # The single-block range kernel over more lengths than threads; the bad value anywhere.
    nd, ld = 5000, 6
    q, d = _cp(np.zeros((2, 3, 16), np.float16)), _cp(np.zeros((nd, ld, 16), np.float16))
    lens = np.full(nd, ld, dtype)
    assert _np(lik_cupy.maxsim(q, d, d_lengths=_cp(lens))).shape == (2, nd)
    for bad in (-1, ld + 1):
        lens[where] = bad
        with pytest.raises(ValueError, match=rf"d_lengths holds {bad}; every length must be in \[0, {ld}\]"):
            lik_cupy.maxsim(q, d, d_lengths=_cp(lens), validate=True)
        lens[where] = ld
    # both sides bad: the query side is reported (checked first)
    with pytest.raises(ValueError, match=r"q_lengths holds 4"):
        lik_cupy.maxsim(q, d, q_lengths=_cp(np.array([1, 4], dtype)), d_lengths=_cp(np.full(nd, 7, dtype)),
                        validate=True)


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


@pytest.mark.parametrize("chunk", [2500, 16884])
def test_topk_merge_kernel_ties_and_k(rng, chunk):
    # Heavy ties and every k up to the maximum the kernel supports. A chunk of more than 4096
    # scores takes the two-launch merge for k <= 1024 (4096-score slices ranked on their own
    # CTAs; 16884 = 4 * 4096 + 500 leaves a last slice shorter than k = 1000).
    nq, nd = 4, 16884
    scores = rng.integers(0, 20, size=(nq, nd)).astype(np.float32)
    scores[0, ::7] = np.nan
    scores[1, ::5] = -np.inf
    import cupy

    from lik_cupy._runtime.topk import merge_topk

    for k in (1, 2, 3, 100, 1000, 4096):
        want_s, want_i = _ranked(scores, k)
        run_s, run_i = cupy.empty((nq, 0), cupy.float32), cupy.empty((nq, 0), cupy.int64)
        for a in range(0, nd, chunk):  # one merge or several
            b = min(nd, a + chunk)
            run_s, run_i = merge_topk(cupy.cuda.runtime.getDevice(), run_s, run_i,
                                      cupy.ascontiguousarray(cupy.asarray(scores[:, a:b])), b - a, a, k)
        np.testing.assert_array_equal(cupy.asnumpy(run_i), want_i)
        np.testing.assert_array_equal(cupy.asnumpy(run_s), want_s)


@pytest.mark.parametrize("chunk", [5000, 1000])
def test_topk_merge_ties_negative_zero_with_zero(rng, chunk):
    """-0.0 and +0.0 are one score, tied by the lower index, as the CPU path ranks them (-0.0 can come
    from a scale of -0.0, which the scales' >= 0 check lets through); the merge keyed -0.0 below +0.0.
    The kept score is +0.0."""
    import cupy

    from lik_cupy._runtime.topk import merge_topk

    nq, nd, k = 2, 5000, 64
    scores = np.where(rng.random((nq, nd)) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    scores[:, ::97] = 1.0
    want_s, want_i = _ranked(scores, k)
    run_s, run_i = cupy.empty((nq, 0), cupy.float32), cupy.empty((nq, 0), cupy.int64)
    for a in range(0, nd, chunk):
        b = min(nd, a + chunk)
        run_s, run_i = merge_topk(cupy.cuda.runtime.getDevice(), run_s, run_i,
                                  cupy.ascontiguousarray(cupy.asarray(scores[:, a:b])), b - a, a, k)
    np.testing.assert_array_equal(cupy.asnumpy(run_i), want_i)
    np.testing.assert_array_equal(cupy.asnumpy(run_s), want_s)
    assert not np.signbit(cupy.asnumpy(run_s)).any()


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


@pytest.fixture
def pool_limit():
    """Makes every GPU allocation larger than a given size fail as CuPy's pool fails on a full GPU,
    until the test ends, so that retrieve runs out of memory as it would next to other work on
    the GPU. (A per-request cap through the allocator: on an H200, MemoryPool.set_limit did not
    make these requests fail.)"""
    import cupy

    pool = cupy.get_default_memory_pool()

    def cap(largest: int):
        def malloc(size):
            if size > largest:
                raise cupy.cuda.memory.OutOfMemoryError(size, pool.total_bytes())
            return pool.malloc(size)

        cupy.cuda.Device().synchronize()
        cupy.cuda.set_allocator(malloc)

    yield cap
    cupy.cuda.set_allocator(pool.malloc)


@pytest.mark.parametrize("layout", ["device", "host", "device_int8", "host_int8", "device_long_query"])
def test_retrieve_halves_its_chunk_when_gpu_memory_runs_out(rng, pool_limit, layout):
    import re
    import warnings

    import cupy

    from lik_cupy._cpu import quantize_numpy

    # A long query (two tiles) also needs a partial-scores buffer, allocated inside the forward
    # (a DeviceMemoryError rather than CuPy's own error when it does not fit).
    dim, nd, nq, ld, k = 64, 6007, 31, 41, 10
    lq = 200 if layout == "device_long_query" else 29
    d = _unit(rng, nd, ld, dim).astype(np.float16)
    q = _cp(_unit(rng, nq, lq, dim).astype(np.float16))
    lens = rng.integers(0, ld + 1, size=nd)
    kw = {}
    if layout.endswith("int8"):
        d, ds = quantize_numpy(d)
        kw["d_scales"] = _cp(ds) if layout.startswith("device") else ds
    D = _cp(d) if layout.startswith("device") else d
    kw["d_lengths"] = _cp(lens) if layout.startswith("device") else lens
    want_s, want_i = lik_cupy.retrieve(q, D, k, **kw)  # no limit (and the kernels are compiled)
    # Device corpora: one chunk of scores (745 KB) does not fit, a quarter does. Host corpora:
    # the default 1 GiB plan stages all 6007 documents (31.5 MB of fp16 tokens, 15.8 MB INT8)
    # in one device buffer, which does not fit; a quarter (an eighth for fp16) does.
    pool_limit((300 << 10) if layout.startswith("device") else (8 << 20))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s, i = lik_cupy.retrieve(q, D, k, **kw)
        cupy.cuda.Device().synchronize()
    warned = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    msgs = [str(w.message) for w in warned]
    assert len(msgs) == 1, msgs
    m = re.fullmatch(r"lik_cupy\.retrieve: out of GPU memory with (\d+) documents per chunk; continuing with (\d+) "
                     r"per chunk \(pass max_gpu_bytes to plan smaller chunks from the start\)", msgs[0])
    assert m and 1 <= int(m[2]) < int(m[1]) <= nd, msgs[0]
    assert warned[0].filename == __file__  # the warning points at the caller
    # Chunks never change a document's score: the same ranking, bit for bit.
    np.testing.assert_array_equal(_np(i), _np(want_i))
    assert _np(s).tobytes() == _np(want_s).tobytes()


def test_retrieve_memory_error_when_one_document_does_not_fit(rng, pool_limit):
    import re
    import warnings

    import cupy

    nq, lq, dim, nd, ld = 2000, 8, 64, 50, 7  # one document's scores: 2000 * 4 bytes
    q = _cp(_unit(rng, nq, lq, dim).astype(np.float16))
    d = _cp(_unit(rng, nd, ld, dim).astype(np.float16))
    want_s, want_i = lik_cupy.retrieve(q, d, 10)
    pool_limit(4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no chunk ever fitted: no warning, only the error
        with pytest.raises(MemoryError) as info:
            lik_cupy.retrieve(q, d, 10)
    msg = str(info.value)
    assert not isinstance(info.value, cupy.cuda.memory.OutOfMemoryError)
    # 8,000 bytes, or 8,192 as CuPy's pool rounds the request
    assert re.match(r"lik_cupy\.retrieve: out of GPU memory allocating 8,(000|192) bytes with one document per "
                    r"chunk, while the queries and the running top-k hold [\d,]+ bytes\.", msg), msg
    assert "Score fewer queries (or a smaller k) per call" in msg and "max_gpu_bytes" in msg
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    s, i = lik_cupy.retrieve(q, d, 10)  # usable again once memory is there
    np.testing.assert_array_equal(_np(i), _np(want_i))
    np.testing.assert_array_equal(_np(s), _np(want_s))


def _plans(monkeypatch, *, whole_documents: bool):
    """Record forward launch plans; ``whole_documents`` plans without a token split (the
    reference a token-split run must match bit for bit)."""
    from lik_cupy import _dispatch as dispatch

    plan, seen = dispatch.plan_launch, []

    def recording(*args):
        got = plan(*args[:7]) if whole_documents else plan(*args)
        seen.append(got)
        return got

    monkeypatch.setattr(dispatch, "plan_launch", recording)
    return seen


def _split_corpus(rng, case):
    """(lens, nq, lq, q_lengths) of a corpus whose documents cross token shares."""
    # (Few documents: dispatch splits only corpora of at most a quarter as many documents as CTAs.)
    if case == "ragged":  # empties, short documents and a few over several shares
        lens = _ragged(rng, 50, 1, 1500, empty_frac=0.2)
        lens[rng.choice(50, 4, replace=False)] = rng.integers(5000, 9000, size=4)
        return lens, 1, 32, None
    if case == "one_long":  # one document over every share, between empty ones
        return np.array([0, 3, 61_007, 0, 17, 0]), 1, 27, None
    if case == "long_query":  # query tiles on x, two queries
        return _ragged(rng, 12, 0, 9000, empty_frac=0.1), 2, 100, np.array([100, 71])
    if case == "one_long_query":  # query tiles on x, one query (INT8: tokens-on-M tiles whole)
        return _ragged(rng, 6, 0, 9000, empty_frac=0.2), 1, 300, np.array([277])
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["ragged", "one_long", "long_query"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("argmax", [False, True])
def test_token_split_matches_whole_documents_bitwise(rng, kernels, monkeypatch, case, dtype, argmax):
    # Documents cut over CTAs by token shares are merged from their pieces' row maxima: the
    # scores (and argmax) must be those of whole-document CTAs bit for bit, and right.
    dim = 128
    lens, nq, lq, qlen = _split_corpus(rng, case)
    off = np.concatenate([[0], np.cumsum(lens)])
    tok, tok64 = _cast(_unit(rng, int(lens.sum()), dim), dtype)
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    conv = _torch if dtype == "bfloat16" else _cp
    kw = dict(return_argmax=argmax, q_lengths=None if qlen is None else conv(qlen))
    runs = []
    for whole in (False, True):
        with monkeypatch.context() as m:
            seen = _plans(m, whole_documents=whole)
            got = lik_cupy.maxsim_varlen(conv(q), conv(tok), conv(off.astype(np.int32)), **kw)
        assert seen and all(p.token_split != whole for p in seen)
        runs.append([_np(x) for x in (got if argmax else (got,))])
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()
    qv = np.ones((nq, lq), bool) if qlen is None else np.arange(lq)[None, :] < qlen[:, None]
    dpad, dv = _pad(tok64, lens)
    ref, sim = maxsim_ref(q64, dpad, qv, dv)
    assert rel_err(runs[0][0], ref) < TOL[dtype]
    assert np.all(runs[0][0][:, lens == 0] == -np.inf)
    if argmax:
        _argmax_ok(runs[0][1], sim, qv, dv, 1e-3)


@pytest.mark.parametrize("case", ["ragged", "one_long", "one_long_query"])
@pytest.mark.parametrize("argmax", [False, True])
def test_int8_token_split_matches_whole_documents_bitwise(rng, kernels, monkeypatch, case, argmax):
    # Packed INT8 documents cut over CTAs: the pieces' row maxima (dequantised products) merged,
    # then scaled by the query token's scale, as a whole-document CTA does: the same bits. One
    # long query takes INT8's tokens-on-M tiles whole on Hopper, and their queries-on-M twins
    # split (with the argmax: the two-warpgroup argmax tile itself). (Two long queries share
    # multi-query tiles, which score whole documents.)
    dim = 128
    lens, nq, lq, qlen = _split_corpus(rng, case)
    off = _cp(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    tok = _unit(rng, int(lens.sum()), dim).astype(np.float32)
    t8, ts = lik_cupy.quantize_int8(_cp(tok))
    q = _unit(rng, nq, lq, dim).astype(np.float16)
    kw = dict(return_argmax=argmax, q_lengths=None if qlen is None else _cp(qlen))
    runs = []
    for whole in (False, True):
        with monkeypatch.context() as m:
            seen = _plans(m, whole_documents=whole)
            got = lik_cupy.maxsim_int8_varlen(_cp(q), t8, ts, off, **kw)
        # (a tokens-on-M tile is planned whole first, then its twin split)
        assert seen and seen[-1].token_split != whole and not (whole and any(p.token_split for p in seen))
        runs.append([_np(x) for x in (got if argmax else (got,))])
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()
    qv = np.ones((nq, lq), bool) if qlen is None else np.arange(lq)[None, :] < qlen[:, None]
    deq = _np(lik_cupy.dequantize_int8(t8, ts)).astype(np.float64)
    dpad, dv = _pad(deq, lens)
    ref, _ = maxsim_ref(q.astype(np.float64), dpad, qv, dv)
    assert rel_err(runs[0][0], ref) < 2e-2  # the queries are quantised per token too
    assert np.all(runs[0][0][:, lens == 0] == -np.inf)


def test_token_split_counts_survive_bad_offsets_and_streams(rng):
    # The pieces' arrival counts live in one buffer per stream and are never cleared: a launch
    # whose (unvalidated, wrong) offsets leave counts short, and launches on other streams, must
    # not change what the next good launch returns.
    import cupy

    dim = 128
    lens, nq, lq, _ = _split_corpus(rng, "ragged")
    off = np.concatenate([[0], np.cumsum(lens)])
    tok = _cp(_unit(rng, int(lens.sum()), dim).astype(np.float16))
    q = _cp(_unit(rng, nq, lq, dim).astype(np.float16))
    good = _cp(off)
    want = _np(lik_cupy.maxsim_varlen(q, tok, good)).tobytes()
    bad = off.copy()
    bad[1:-1] = rng.permutation(bad[1:-1])  # still in range, no longer sorted
    for _ in range(3):
        lik_cupy.maxsim_varlen(q, tok, _cp(bad), validate_offsets=False)
        assert _np(lik_cupy.maxsim_varlen(q, tok, good)).tobytes() == want
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
    outs = []
    for _ in range(4):
        for s in streams:
            with s:
                outs.append(lik_cupy.maxsim_varlen(q, tok, good, validate_offsets=False))
    cupy.cuda.Device().synchronize()
    assert all(_np(o).tobytes() == want for o in outs)


def test_token_split_is_left_out_of_graph_capture(rng):
    # A captured launch would replay one epoch (token_split.py): capture scores whole documents,
    # and its replays give the eager call's bits.
    import cupy

    dim = 128
    lens, nq, lq, _ = _split_corpus(rng, "one_long")
    off = _cp(np.concatenate([[0], np.cumsum(lens)]))
    tok = _cp(_unit(rng, int(lens.sum()), dim).astype(np.float16))
    q = _cp(_unit(rng, nq, lq, dim).astype(np.float16))
    want = _np(lik_cupy.maxsim_varlen(q, tok, off)).tobytes()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        out = lik_cupy.maxsim_varlen(q, tok, off)
        graph = s.end_capture()
        for _ in range(2):
            out.fill(0)
            graph.launch()
            s.synchronize()
            assert _np(out).tobytes() == want


def test_retrieve_one_query_token_split_equals_whole_documents(rng, monkeypatch):
    # Streamed chunks pass slices of the offsets (not starting at 0): their token shares must give
    # the same top-k, bit for bit, as whole-document CTAs over the whole corpus.
    dim = 128
    lens = _ragged(rng, 40, 0, 9000, empty_frac=0.1)
    off = np.concatenate([[0], np.cumsum(lens)])
    tok, _ = _cast(_unit(rng, int(lens.sum()), dim), "float16")
    q, _ = _cast(_unit(rng, 1, 32, dim), "float16")
    got = []
    for whole in (False, True):
        with monkeypatch.context() as m:
            seen = _plans(m, whole_documents=whole)
            for D, kw in ((_cp(tok), dict(d_offsets=_cp(off))), (tok, dict(d_offsets=off, max_gpu_bytes=12 << 20))):
                before = len(seen)
                s, i = lik_cupy.retrieve(_cp(q), D, 20, **kw)
                got.append((_np(s).tobytes(), _np(i).tobytes()))
                # A streamed chunk of too few tokens for two shares runs whole documents either way;
                # each call still has split launches to compare.
                assert len(seen) > before and any(p.token_split for p in seen[before:]) != whole
    assert len(set(got)) == 1


def _packed_ref(q64, qv, tok64, lens):
    """float64 scores [nq, nd] of packed documents: every token's dot products, maxed per
    document, summed over the valid query tokens (empty documents -inf)."""
    sim = np.einsum("qsk,tk->qst", q64, tok64)
    nz = lens > 0
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])[nz]
    best = np.full(q64.shape[:2] + (lens.size,), -np.inf)
    best[:, :, nz] = np.maximum.reduceat(sim, starts, axis=2)
    return np.where(qv[:, :, None], best, 0.0).sum(axis=1)


@pytest.mark.parametrize("order", ["short_first", "long_first", "empties_then_long"])
@pytest.mark.parametrize("nq", [1, 6])
def test_varlen_lengths_that_drift(rng, kernels, order, nq):
    # CTAs find their documents by sampling the offsets around where an even spread of the work
    # would put them; lengths that drift along the corpus put every CTA's documents outside that
    # window, and the search must go on from it to the right documents.
    dim = 128
    short, long_ = rng.integers(1, 20, size=900), rng.integers(400, 700, size=300)
    if order == "short_first":
        lens = np.concatenate([short, long_])
    elif order == "long_first":
        lens = np.concatenate([long_, short])
    else:
        lens = np.concatenate([np.zeros(700, np.int64), long_, short[:50]])
    off = np.concatenate([[0], np.cumsum(lens)])
    tok, tok64 = _cast(_unit(rng, int(lens.sum()), dim), "float16")
    q, q64 = _cast(_unit(rng, nq, 32, dim), "float16")
    qlen = rng.integers(1, 33, size=nq)
    out, amax = lik_cupy.maxsim_varlen(_cp(q), _cp(tok), _cp(off.astype(np.int32)), q_lengths=_cp(qlen),
                                       return_argmax=True)
    qv = np.arange(32)[None, :] < qlen[:, None]
    assert rel_err(_np(out), _packed_ref(q64, qv, tok64, lens)) < TOL["float16"]
    assert np.all(_np(out)[:, lens == 0] == -np.inf)
    amax = _np(amax)
    assert np.all(amax[:, lens == 0] == -1) and np.all(amax < lens[None, :, None])


def test_a_device_this_machine_lacks_is_named():
    """Corpus(device=N) and warmup(device=N) past the GPUs there got CUDA's "invalid device ordinal"."""
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    D = np.ones((3, 4, 64), np.float32)
    for call in (lambda: lik_cupy.Corpus(D, device=n), lambda: lik_cupy.warmup(device=n)):
        with pytest.raises(ValueError, match=f"^device {n} does not exist: this machine has {n} visible GPU"):
            call()


@pytest.mark.parametrize("where", ["host", "device"])
def test_an_empty_shards_bad_offsets_are_named_as_the_shards(where):
    # A shard of no documents is not scored, but its offsets are still checked: named as the shard's, not
    # d_offsets (which goes with a single array D), on host and device offsets alike.
    D = _cp(np.zeros((3, 2, 8), np.float16))
    off = np.array([1]) if where == "host" else _cp(np.array([1]))
    tokens = np.zeros((0, 8), np.float16) if where == "host" else _cp(np.zeros((0, 8), np.float16))
    with pytest.raises(ValueError, match=r"^shard 1 offsets"):
        lik_cupy.retrieve(_cp(np.ones((2, 8), np.float16)), [D, (tokens, off)], 2, backend="gpu")


# ---------------------------------------------------------------- retrieve on another GPU than the current one


def test_retrieve_on_another_gpu_is_the_current_gpus_call(rng, other_gpu):
    """retrieve with its queries, or its corpus, on cuda:1 while cuda:0 is current: a device corpus read in
    place (padded with lengths, packed, shards, INT8), a host corpus streamed to the queries' GPU, and host
    queries scored on the GPU of the corpus's device shards (they were refused: "Q is on cuda:0"); each bit for
    bit as on cuda:0, with cuda:0 current after it."""
    from devices import assert_on, assert_same_bits, current, on_gpu

    nq, lq, dim = 3, 12, 64
    lens = _ragged(rng, 40, 1, 20)
    off = np.concatenate([[0], np.cumsum(lens)])
    tok = _unit(rng, int(off[-1]), dim).astype(np.float16)
    pad, _ = _pad(tok, lens)
    q = _unit(rng, nq, lq, dim).astype(np.float16)
    t8, s8 = lik_cupy.quantize_int8(tok, backend="cpu")
    cut = int(off[25])
    shards = [(tok[:cut], off[:26]), (tok[cut:], off[25:] - cut)]
    cases = {
        "padded": lambda Q, on: lik_cupy.retrieve(Q, on(pad), 7, d_lengths=on(lens)),
        "packed": lambda Q, on: lik_cupy.retrieve(Q, on(tok), 7, d_offsets=on(off)),
        "shards": lambda Q, on: lik_cupy.retrieve(Q, on(shards), 7),
        "int8": lambda Q, on: lik_cupy.retrieve(Q, on(t8), 7, d_scales=on(s8), d_offsets=on(off)),
        "streamed": lambda Q, on: lik_cupy.retrieve(Q, tok, 7, d_offsets=off, max_gpu_bytes=1 << 20),
    }
    for name, call in cases.items():
        want = current(call, _cp(q), lambda x: on_gpu(x, 0))
        got = current(call, on_gpu(q, other_gpu), lambda x: on_gpu(x, other_gpu))
        assert_on(got, other_gpu, name)
        assert_same_bits(got, want, name)
        if name != "streamed":  # host queries, a device corpus: on the corpus's GPU
            got = current(call, q, lambda x: on_gpu(x, other_gpu))
            assert_on(got, None, name)
            assert_same_bits(got, want, name)


def test_retrieve_refuses_a_shard_on_another_gpu_before_reading_it(rng, other_gpu):
    """A shard on another GPU than the queries is a ValueError naming it and both GPUs, raised before any of it
    is read: an empty one's offsets were checked by a kernel of the queries' GPU reading the other GPU's memory."""
    from devices import current, on_gpu

    q = _unit(rng, 2, 8, 32).astype(np.float16)
    tok = _unit(rng, 10, 32).astype(np.float16)
    empty = (np.zeros((0, 32), np.float16), np.zeros(1, np.int64))
    full = (tok, np.array([0, 4, 10]))
    for shard in (empty, full):
        with pytest.raises(ValueError, match="shard 1 is on cuda:1 but Q is on cuda:0"):
            current(lik_cupy.retrieve, _cp(q), [on_gpu(full, 0), on_gpu(shard, other_gpu)], 3)
        with pytest.raises(ValueError, match="shard 1 is on cuda:1 but this call scores on cuda:0"):
            current(lik_cupy.retrieve, q, [on_gpu(full, 0), on_gpu(shard, other_gpu)], 3)
    with pytest.raises(ValueError, match="the corpus is on cuda:1 but Q is on cuda:0"):
        current(lik_cupy.retrieve, _cp(q), on_gpu(tok, other_gpu), 3, d_offsets=on_gpu(full[1], other_gpu))

