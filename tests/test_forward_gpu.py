"""GPU forward against a float64 reference (skipped without a GPU)."""

import numpy as np
import pytest

import lik_cupy
from reference import maxsim_ref, rel_err

pytestmark = pytest.mark.gpu

TOL = {"float16": 2e-5, "bfloat16": 2e-5, "float32": 3e-3}  # fp32 runs on TF32 tensor cores


def _cast(x, dtype):
    """Round to the input dtype; returns (array to pass, float64 of exactly what the kernel sees)."""
    import ml_dtypes

    npd = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    a = np.asarray(x).astype(npd)
    return a, a.astype(np.float64)


def _cp(a):
    import cupy

    return cupy.asarray(a)


def _torch(a):
    torch = pytest.importorskip("torch")
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(a).cuda()


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _argmax_ok(amax, sim, q_valid, d_valid, rtol):
    """Each argmax is a valid token whose similarity equals the row max up to rounding."""
    nq, nd, lq, ld = sim.shape
    amax = np.asarray(amax)
    for i in range(nq):
        for j in range(nd):
            empty = not d_valid[j].any()
            for s in range(lq):
                a = amax[i, j, s]
                if not q_valid[i, s] or empty:
                    assert a == -1, (i, j, s, a)
                    continue
                assert 0 <= a < ld and d_valid[j, a], (i, j, s, a)
                best = sim[i, j, s].max()
                assert sim[i, j, s, a] >= best - rtol * (abs(best) + 1), (i, j, s, a, sim[i, j, s, a], best)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("dim", [32, 64, 96, 128, 256, 512])
def test_random_shapes_vs_float64(rng, dtype, dim):
    nq, lq, nd, ld = 3, int(rng.integers(1, 150)), 37, int(rng.integers(1, 200))
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    d, d64 = _cast(_unit(rng, nd, ld, dim), dtype)
    conv = _torch if dtype == "bfloat16" else _cp  # NumPy has no native bf16 array to hand to CuPy
    out = lik_cupy.maxsim(conv(q), conv(d))
    ref, _ = maxsim_ref(q64, d64)
    assert rel_err(_np(out), ref) < TOL[dtype]


@pytest.mark.parametrize("lq", [1, 17, 33, 63, 65, 129, 300, 1000])
def test_query_lengths_and_splits(rng, lq):
    dim, nd, ld = 128, 29, 77
    q, q64 = _cast(_unit(rng, 2, lq, dim), "float16")
    d, d64 = _cast(_unit(rng, nd, ld, dim), "float16")
    out = lik_cupy.maxsim(_cp(q), _cp(d))
    assert rel_err(_np(out), maxsim_ref(q64, d64)[0]) < TOL["float16"]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("dim", [1, 3, 20, 33, 100])
def test_dims_not_multiple_of_16(rng, dtype, dim):
    q, q64 = _cast(rng.standard_normal((2, 19, dim)), dtype)
    d, d64 = _cast(rng.standard_normal((13, 45, dim)), dtype)
    out = lik_cupy.maxsim(_cp(q), _cp(d))
    assert rel_err(_np(out), maxsim_ref(q64, d64)[0]) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("lq", [45, 77])  # short-query tiles, and the Hopper tiles where they apply
def test_masks_lengths_empty_docs_and_argmax(rng, dtype, lq):
    nq, nd, ld, dim = 4, 23, 131, 64
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    d, d64 = _cast(_unit(rng, nd, ld, dim), dtype)
    q_mask = rng.random((nq, lq)) < 0.8
    q_mask[1] = False  # a query with no valid token scores 0
    d_mask = rng.random((nd, ld)) < 0.7
    d_mask[[0, 5, 22]] = False  # empty documents score -inf
    ref, sim = maxsim_ref(q64, d64, q_mask, d_mask)
    torch = pytest.importorskip("torch")
    tq, td = _torch(q), _torch(d)
    s, a = lik_cupy.maxsim(tq, td, torch.from_numpy(q_mask).cuda(), torch.from_numpy(d_mask).cuda(), return_argmax=True)
    assert isinstance(s, torch.Tensor) and s.is_cuda and s.dtype == torch.float32
    assert a.dtype == torch.int32 and tuple(a.shape) == (nq, nd, lq)
    assert rel_err(s.cpu().numpy(), ref) < TOL[dtype]
    assert np.all(s.cpu().numpy()[1] == 0)
    _argmax_ok(a.cpu().numpy(), sim, q_mask, d_mask, 1e-3 if dtype == "float32" else 1e-5)

    q_len = rng.integers(0, lq + 1, nq)
    d_len = rng.integers(0, ld + 1, nd)
    d_len[[3, 4]] = 0
    qv = np.arange(lq)[None] < q_len[:, None]
    dv = np.arange(ld)[None] < d_len[:, None]
    ref, sim = maxsim_ref(q64, d64, qv, dv)
    s, a = lik_cupy.maxsim(tq, td, q_lengths=torch.from_numpy(q_len).cuda(), d_lengths=torch.from_numpy(d_len).cuda(),
                           return_argmax=True)
    assert rel_err(s.cpu().numpy(), ref) < TOL[dtype]
    _argmax_ok(a.cpu().numpy(), sim, qv, dv, 1e-3 if dtype == "float32" else 1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("nq,lq,dim,ld", [(1, 64, 128, 300), (1, 5, 64, 1030), (2, 31, 128, 77), (1, 33, 128, 1024)])
def test_short_query_tiles_masks_nan_and_argmax(rng, dtype, nq, lq, dim, ld):
    # One query (or two sharing a tile) of at most 64 rows: the one-warpgroup tiles on Hopper
    # (64- and 128-token document tiles by Ld), the portable ones elsewhere.
    import cupy

    nd = 29
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    d, d64 = _cast(_unit(rng, nd, ld, dim), dtype)
    d[7, ld // 2, 3] = np.nan
    d64[7, ld // 2, 3] = np.nan
    q_mask = rng.random((nq, lq)) < 0.8
    d_mask = rng.random((nd, ld)) < 0.7
    d_mask[[0, 11]] = False
    ref, sim = maxsim_ref(q64, d64, q_mask, d_mask)
    s, a = lik_cupy.maxsim(_cp(q), _cp(d), cupy.asarray(q_mask), cupy.asarray(d_mask), return_argmax=True)
    s = _np(s)
    assert np.array_equal(np.isnan(s), np.isnan(ref))
    fin = ~np.isnan(ref)
    assert rel_err(np.where(fin, s, 0), np.where(fin, ref, 0)) < TOL[dtype]
    _argmax_ok(_np(a)[:, fin.all(axis=0)], sim[:, fin.all(axis=0)], q_mask, d_mask[fin.all(axis=0)], 1e-5)
    s1 = _np(lik_cupy.maxsim(_cp(q[0]), _cp(d)))  # 2-D Q: a single query, no masks
    ref1, _ = maxsim_ref(q64[:1], d64)
    assert np.array_equal(np.isnan(s1), np.isnan(ref1[0]))
    assert rel_err(np.nan_to_num(s1), np.nan_to_num(ref1[0])) < TOL[dtype]


def _span_masks(rng, nd, ld):
    """Document masks of every shape the spans distinguish, and the spans they should give."""
    lens = rng.integers(0, ld + 1, nd)
    mask = np.arange(ld)[None] < lens[:, None]  # prefixes (the usual attention mask), some empty
    holes = rng.random(nd) < 0.3  # some rows with holes inside their span
    mask[holes] &= rng.random((int(holes.sum()), ld)) < 0.6
    if nd >= 4:
        mask[0] = False
        mask[1] = True
        mask[2] = False
        mask[2, ld - 1] = True  # only the last token
        mask[3] = False
        mask[3, 0] = True  # only the first: a prefix of one
    last = np.where(mask.any(1), ld - np.argmax(mask[:, ::-1], axis=1), 0)
    prefix = mask.sum(1) == last
    return mask, np.where(prefix, last, ~last).astype(np.int32)


def test_mask_spans_kernel(rng):
    import cupy

    from lik_cupy._runtime.masks import mask_spans

    for nd, ld in ((300, 131), (1, 1), (70_000, 3), (5, 1000)):
        mask, want = _span_masks(rng, nd, ld)
        got = mask_spans(cupy.asarray(mask).view(cupy.uint8), cupy.cuda.runtime.getDevice())
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


@pytest.mark.parametrize("nq,lq", [(1, 32), (32, 32), (3, 200)])
def test_masks_skip_padding_past_the_span(rng, nq, lq):
    # A mask is scored through its spans: documents whose valid tokens come first as if given a
    # length (bitwise the same scores and argmax), the others under the mask up to their last
    # valid token. NaN past every document's last valid token must not reach any score.
    import cupy

    nd, ld, dim = 257, 181, 128
    q, q64 = _cast(_unit(rng, nq, lq, dim), "float16")
    d, d64 = _cast(_unit(rng, nd, ld, dim), "float16")
    mask, spans = _span_masks(rng, nd, ld)
    end = np.where(spans >= 0, spans, ~spans)
    for j in range(nd):
        d[j, end[j]:, 5] = np.nan
        d64[j, end[j]:, 5] = np.nan
    ref, sim = maxsim_ref(q64, d64, None, mask)
    s, a = lik_cupy.maxsim(_cp(q), _cp(d), None, cupy.asarray(mask), return_argmax=True)
    assert rel_err(_np(s), ref) < TOL["float16"]
    _argmax_ok(_np(a), sim, np.ones((nq, lq), bool), mask, 1e-5)

    prefix = spans >= 0  # the same documents with lengths: the same bits
    s_len, a_len = lik_cupy.maxsim(_cp(q), _cp(d[prefix]), d_lengths=cupy.asarray(spans[prefix]), return_argmax=True)
    assert np.array_equal(_np(s)[:, prefix], _np(s_len))
    assert np.array_equal(_np(a)[:, prefix], _np(a_len))

    k = 7  # candidate sets per query: masks [Nq, K, Ld] take spans per (query, candidate)
    cand = rng.integers(0, nd, (nq, k))
    s_c = lik_cupy.maxsim(_cp(q), _cp(d[cand]), None, cupy.asarray(mask[cand]))
    assert rel_err(_np(s_c), np.take_along_axis(ref, cand, axis=1)) < TOL["float16"]

    top_s, top_i = lik_cupy.retrieve(_cp(q), _cp(d), 10, d_mask=cupy.asarray(mask))
    want = np.argsort(-_np(s), axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(_np(top_i), want)


@pytest.mark.parametrize("nq,lq", [(4, 32), (2, 100)])  # several queries per tile; one query per two warpgroups
def test_int8_masks_match_lengths(rng, nq, lq):
    import cupy

    nd, ld, dim = 90, 140, 128
    q = _unit(rng, nq, lq, dim).astype(np.float16)
    d8, ds = lik_cupy.quantize_int8(_unit(rng, nd, ld, dim).astype(np.float32), backend="cpu")
    lens = rng.integers(0, ld + 1, nd)
    mask = np.arange(ld)[None] < lens[:, None]
    for argmax in (False, True):  # INT8 argmax tiles read a prefix mask rather than skip it (registers)
        got = lik_cupy.maxsim_int8(_cp(q), _cp(d8), _cp(ds), None, cupy.asarray(mask), return_argmax=argmax)
        want = lik_cupy.maxsim_int8(_cp(q), _cp(d8), _cp(ds), d_lengths=cupy.asarray(lens), return_argmax=argmax)
        for a, b in zip(got, want) if argmax else [(got, want)]:
            assert np.array_equal(_np(a), _np(b))

def test_many_ragged_documents(rng):
    nq, lq, nd, ld, dim = 2, 40, 3000, 70, 128
    q, q64 = _cast(_unit(rng, nq, lq, dim), "bfloat16")
    d, d64 = _cast(_unit(rng, nd, ld, dim), "bfloat16")
    dl = rng.integers(0, ld + 1, nd)
    dl[rng.random(nd) < 0.3] = 0  # runs of empty documents inside one CTA's range
    torch = pytest.importorskip("torch")
    s = lik_cupy.maxsim(_torch(q), _torch(d), d_lengths=torch.from_numpy(dl).cuda()).cpu().numpy()
    dv = np.arange(ld)[None] < dl[:, None]
    ref = np.concatenate([maxsim_ref(q64, d64[j : j + 500], None, dv[j : j + 500])[0] for j in range(0, nd, 500)], 1)
    assert rel_err(s, ref) < 2e-5


def test_argmax_ties_take_lowest_index(rng):
    import cupy

    dim, ld = 64, 150
    d = _unit(rng, 2, ld, dim).astype(np.float16)
    q = np.stack([d[0, [5, 70, 149]], d[1, [0, 64, 127]]]).astype(np.float16)  # [2, 3, dim]
    d[0, 100] = d[0, 5]  # exact duplicates later in the document: ties
    d[0, 140] = d[0, 70]
    d[1, 130] = d[1, 0]
    d[1, 149] = d[1, 64]
    s, a = lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d), return_argmax=True)
    a = a.get()
    # query i token s was copied from document i; on a tie the earlier token wins
    assert a[0, 0].tolist() == [5, 70, 149]
    assert a[1, 1].tolist() == [0, 64, 127]


@pytest.mark.parametrize("dtype,precision", [("float16", None), ("bfloat16", None), ("float32", "tf32"),
                                             ("float32", None)])
@pytest.mark.parametrize("nq,lq,ld", [(0, 1, 64), (0, 7, 80), (0, 32, 127), (0, 64, 300), (0, 130, 256),
                                      (0, 1024, 200), (3, 32, 180), (5, 9, 96), (2, 64, 1000)])
def test_argmax_on_a_grid_is_the_first_exact_winner(rng, dtype, precision, nq, lq, ld):
    # Values on a 1/8 grid make every similarity exact in every tile type, so rows are full of
    # exact ties: the argmax must be the first token of the float64 maximum, over whole and
    # partial tiles alike (ld takes both), and a NaN planted in a document's last tokens must
    # take every row of that document from its first occurrence.
    nd, dim = 7, 64
    qs = (nq, lq, dim) if nq else (lq, dim)
    q, q64 = _cast(rng.integers(-3, 4, size=qs) / 8.0, dtype)
    d, d64 = _cast(rng.integers(-3, 4, size=(nd, ld, dim)) / 8.0, dtype)
    lengths = rng.integers(1, ld + 1, size=nd)
    lengths[0] = ld
    nan_doc, t_nan = 3, int(lengths[3]) - 1
    d[nan_doc, t_nan, 5] = np.nan
    if t_nan > 0:
        d[nan_doc, t_nan - 1, 9] = np.nan  # the first NaN of the document wins
    s, a = lik_cupy.maxsim(_cp(q), _cp(d), d_lengths=_cp(lengths.astype(np.int32)), return_argmax=True,
                           precision=precision)
    s, a = s.get(), a.get()
    valid = np.arange(ld)[None] < lengths[:, None]
    want_s, sim = maxsim_ref(q64.reshape(-1, lq, dim), np.nan_to_num(d64), None, valid)
    want_a = sim.argmax(axis=-1)
    first_nan = t_nan - 1 if t_nan > 0 else t_nan
    want_a[:, nan_doc] = first_nan
    s, a = s.reshape(-1, nd), a.reshape(-1, nd, lq)
    np.testing.assert_array_equal(a, want_a)
    assert np.isnan(s[:, nan_doc]).all()
    keep = np.arange(nd) != nan_doc
    np.testing.assert_array_equal(s[:, keep], want_s[:, keep].astype(np.float32))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("nq,lq,ld", [(0, 1, 64), (0, 32, 127), (0, 130, 256), (0, 1024, 200), (3, 32, 180),
                                      (5, 9, 96), (2, 64, 1000)])
def test_scaled_argmax_on_a_grid_is_the_first_exact_winner(rng, kind, packed, nq, lq, ld):
    # The INT8 and FP8 tiles scale each similarity by its tokens' scales before the fold. Integers
    # in [-6, 6] (exact in both) with power-of-two scales keep every scaled similarity and every
    # score exact, and document scales of 1/8 and 1/4 tie tokens whose dot products differ by 2x:
    # the argmax must be the first token of the float64 maximum over whole and partial tiles, and
    # (FP8, which has a NaN code) a NaN in a document's last tokens takes every row from its first.
    import cupy
    import ml_dtypes

    if kind == "fp8" and int(cupy.cuda.Device().compute_capability) < 89:
        pytest.skip("FP8 tensor cores need sm_89 or newer")
    nd, dim = 7, 128
    qshape = (nq, lq) if nq else (lq,)
    qv = rng.integers(-3, 4, size=qshape + (dim,))
    dv = rng.integers(-3, 4, size=(nd, ld, dim))
    q_scale = rng.choice([0.5, 1.0], size=qshape).astype(np.float32)
    d_scale = rng.choice([0.125, 0.25], size=(nd, ld)).astype(np.float32)
    for t in range(0, ld - 1, 3):  # token t + 1: twice token t's values at half its scale, a tie
        dv[1, t + 1] = 2 * dv[1, t]
        d_scale[1, t], d_scale[1, t + 1] = 0.25, 0.125
    lengths = rng.integers(1, ld + 1, size=nd)
    lengths[0] = ld
    nan_doc, t_nan = 3, int(lengths[3]) - 1
    if kind == "int8":
        q8, d8 = qv.astype(np.int8), dv.astype(np.int8)
    else:
        q8 = qv.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        d8 = dv.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        d8[nan_doc, t_nan, 5] = 0x7F  # e4m3 NaN
        if t_nan > 0:
            d8[nan_doc, t_nan - 1, 9] = 0x7F  # the first NaN of the document wins
    keep = np.arange(ld)[None] < lengths[:, None]
    qd = qv * q_scale[..., None].astype(np.float64)
    want_s, sim = maxsim_ref(qd.reshape(-1, lq, dim), dv * d_scale[..., None].astype(np.float64), None, keep)
    want_a = sim.argmax(axis=-1)
    score, score_varlen = ((lik_cupy.maxsim_int8, lik_cupy.maxsim_int8_varlen) if kind == "int8"
                           else (lik_cupy.maxsim_fp8, lik_cupy.maxsim_fp8_varlen))
    if packed:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        s, a = score_varlen(_cp(q8), _cp(d8[keep]), _cp(d_scale[keep]), _cp(offsets), q_scales=_cp(q_scale),
                            return_argmax=True)
    else:
        s, a = score(_cp(q8), _cp(d8), _cp(d_scale), q_scales=_cp(q_scale),
                     d_lengths=_cp(lengths.astype(np.int32)), return_argmax=True)
    s, a = s.get().reshape(-1, nd), a.get().reshape(-1, nd, lq)
    if kind == "fp8":
        want_a[:, nan_doc] = t_nan - 1 if t_nan > 0 else t_nan
        assert np.isnan(s[:, nan_doc]).all()
        want_s[:, nan_doc] = np.nan
    np.testing.assert_array_equal(a, want_a)
    np.testing.assert_array_equal(s, want_s.astype(np.float32))


def test_nan_propagates_unless_masked(rng):
    import cupy

    q = _unit(rng, 2, 20, 32).astype(np.float16)
    d = _unit(rng, 6, 40, 32).astype(np.float16)
    d[2, 7, 3] = np.nan
    d[4, 39, 0] = np.nan
    mask = np.ones((6, 40), bool)
    mask[4, 39] = False  # a NaN in a masked token is never seen
    s = lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d), d_mask=cupy.asarray(mask)).get()
    assert np.isnan(s[:, 2]).all()
    assert np.isfinite(np.delete(s, 2, axis=1)).all()


@pytest.mark.parametrize("lq", [20, 130])  # short-query tiles, and the Hopper tiles
def test_argmax_with_nan_and_infinite_rows(rng, lq):
    # full document tiles (Ld = 256): the fast argmax path must hand NaN tiles to the exact
    # loop (first NaN wins) and give an all -inf row its first token
    import cupy

    q = _unit(rng, 1, lq, 64).astype(np.float16)
    d = _unit(rng, 3, 256, 64).astype(np.float16)
    d[0, 200, 5] = np.nan
    d[0, 150, 9] = np.nan
    d[1] = 0  # all-zero document: every similarity 0, every token ties
    q[0, 0] = -np.inf  # query token 0 against doc 2: -inf wherever the product is defined
    d[2, :, :] = np.abs(d[2]) + 0.01
    s, a = lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d), return_argmax=True)
    a = a.get()
    assert (a[0, 0, 1:] == 150).all()  # the lowest-index NaN token wins every valid row
    assert (a[0, 1] == 0).all()  # ties: the lowest index
    assert a[0, 2, 0] == 0  # every similarity -inf: the first token


def test_frameworks_round_trip(rng):
    q, q64 = _cast(_unit(rng, 2, 21, 48), "float16")
    d, d64 = _cast(_unit(rng, 9, 33, 48), "float16")
    ref = maxsim_ref(q64, d64)[0]
    import cupy

    out = lik_cupy.maxsim(q, d)  # NumPy in -> NumPy out (runs on the GPU)
    assert isinstance(out, np.ndarray) and rel_err(out, ref) < 2e-5
    out = lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d))
    assert isinstance(out, cupy.ndarray) and rel_err(out.get(), ref) < 2e-5
    torch = pytest.importorskip("torch")
    out = lik_cupy.maxsim(torch.from_numpy(q), torch.from_numpy(d))  # torch CPU in -> torch CPU out
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu" and rel_err(out.numpy(), ref) < 2e-5
    jnp = pytest.importorskip("jax.numpy")
    import jax

    gpus = [x for x in jax.devices() if x.platform != "cpu"]
    if gpus:
        jq, jd = jax.device_put(jnp.asarray(q), gpus[0]), jax.device_put(jnp.asarray(d), gpus[0])
        out = lik_cupy.maxsim(jq, jd)
        assert isinstance(out, jax.Array) and list(out.devices())[0].platform != "cpu"
        assert rel_err(np.asarray(out), ref) < 2e-5
        jq16 = jax.device_put(jnp.asarray(q.astype(np.float32)).astype(jnp.bfloat16), gpus[0])
        jd16 = jax.device_put(jnp.asarray(d.astype(np.float32)).astype(jnp.bfloat16), gpus[0])
        ref16 = maxsim_ref(np.asarray(jq16.astype(jnp.float32)), np.asarray(jd16.astype(jnp.float32)))[0]
        assert rel_err(np.asarray(lik_cupy.maxsim(jq16, jd16)), ref16) < 2e-5


def test_non_contiguous_inputs(rng):
    torch = pytest.importorskip("torch")
    q = torch.randn(3, 40, 64, device="cuda", dtype=torch.float16)
    big = torch.randn(40, 11, 64, device="cuda", dtype=torch.float16)
    d = big.transpose(0, 1)  # [11, 40, 64] with strides that are not C-contiguous
    dt = torch.randn(3, 64, 40, device="cuda", dtype=torch.float16).transpose(1, 2)
    out = lik_cupy.maxsim(q, d)
    ref = maxsim_ref(q.double().cpu().numpy(), d.double().cpu().numpy())[0]
    assert rel_err(out.cpu().numpy(), ref) < 2e-5
    out = lik_cupy.maxsim(dt, d)
    ref = maxsim_ref(dt.double().cpu().numpy(), d.double().cpu().numpy())[0]
    assert rel_err(out.cpu().numpy(), ref) < 2e-5


def test_torch_non_default_stream(rng):
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q = torch.randn(4, 50, 128, device="cuda", dtype=torch.float16)
        d = torch.randn(300, 90, 128, device="cuda", dtype=torch.float16)
        out = lik_cupy.maxsim(q, d)
        out2 = out * 2  # consumed on the same stream without a host sync
    s.synchronize()
    ref = maxsim_ref(q.double().cpu().numpy(), d.double().cpu().numpy())[0]
    assert rel_err(out2.cpu().numpy() / 2, ref) < 2e-5


def test_candidates_and_pairs(rng):
    import cupy

    nq, k, lq, ld, dim = 3, 7, 25, 60, 96
    q, q64 = _cast(_unit(rng, nq, lq, dim), "float16")
    d, d64 = _cast(_unit(rng, nq, k, ld, dim), "float16")
    dl = rng.integers(0, ld + 1, (nq, k))
    s, a = lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d), d_lengths=cupy.asarray(dl), return_argmax=True)
    assert s.shape == (nq, k) and a.shape == (nq, k, lq)
    for i in range(nq):
        dv = np.arange(ld)[None] < dl[i][:, None]
        ref, sim = maxsim_ref(q64[i : i + 1], d64[i], None, dv)
        assert rel_err(s[i : i + 1].get(), ref) < 2e-5
        _argmax_ok(a[i : i + 1].get(), sim, np.ones((1, lq), bool), dv, 1e-5)
    b = 5
    q, q64 = _cast(_unit(rng, b, lq, dim), "float16")
    d, d64 = _cast(_unit(rng, b, ld, dim), "float16")
    out = lik_cupy.maxsim_pairs(cupy.asarray(q), cupy.asarray(d)).get()
    ref = np.array([maxsim_ref(q64[i : i + 1], d64[i : i + 1])[0][0, 0] for i in range(b)])
    assert out.shape == (b,) and rel_err(out, ref) < 2e-5


def test_rank_variants(rng):
    import cupy

    q, q64 = _cast(_unit(rng, 12, 64), "float16")
    d, d64 = _cast(_unit(rng, 5, 30, 64), "float16")
    out = lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d))
    assert out.shape == (5,)
    assert rel_err(out.get(), maxsim_ref(q64[None], d64)[0][0]) < 2e-5
    one = lik_cupy.maxsim(cupy.asarray(q), cupy.asarray(d[2]))
    assert one.shape == () and abs(float(one) - out.get()[2]) <= 1e-5 * abs(out.get()[2])


def test_deterministic_bits(rng):
    import cupy

    q = cupy.asarray(_unit(rng, 2, 700, 128).astype(np.float16))
    d = cupy.asarray(_unit(rng, 400, 200, 128).astype(np.float16))
    a = lik_cupy.maxsim(q, d)
    b = lik_cupy.maxsim(q, d)
    assert cupy.array_equal(a.view(cupy.uint32), b.view(cupy.uint32))


def test_cpu_backend_matches_gpu(rng):
    q, _ = _cast(_unit(rng, 3, 40, 80), "float16")
    d, _ = _cast(_unit(rng, 17, 70, 80), "float16")
    dm = rng.random((17, 70)) < 0.9
    g, ga = lik_cupy.maxsim(q, d, d_mask=dm, return_argmax=True, backend="gpu")
    c, ca = lik_cupy.maxsim(q, d, d_mask=dm, return_argmax=True, backend="cpu")
    assert rel_err(g, c) < 2e-5


def _np(x):
    if hasattr(x, "get"):
        return x.get()
    if hasattr(x, "cpu"):
        return x.cpu().numpy()
    return np.asarray(x)


def test_torch_negative_bit_views_score_as_their_values(rng):
    # A negative-bit view holds its values' negations in memory, which a pointer (or torch's DLPack
    # export of it) gives as they lie: the first call and a repeat must both score the values it shows.
    torch = pytest.importorskip("torch")
    q = _torch(_unit(rng, 2, 32, 128).astype(np.float16))
    d = _torch(_unit(rng, 50, 180, 128).astype(np.float16))
    want = lik_cupy.maxsim(-q, d)
    view = torch._neg_view(q)
    assert view.is_neg() and view.is_contiguous()
    for _ in range(2):  # the first call, then the repeat path's lookup
        assert torch.equal(lik_cupy.maxsim(view, d), want)
    assert torch.equal(lik_cupy.maxsim(d[0], torch._neg_view(d)), lik_cupy.maxsim(d[0], -d))


# ---------------------------------------------------------------- arrays on another GPU than the current one


def _framework(fw, a, device=0):
    """NumPy ``a`` as a CuPy array or torch tensor on GPU ``device``."""
    from devices import on_gpu

    if fw == "torch":
        torch = pytest.importorskip("torch")
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(f"cuda:{device}")
        return torch.from_numpy(np.ascontiguousarray(a)).to(f"cuda:{device}")
    return on_gpu(a, device)


@pytest.mark.parametrize("fw,dtype", [("cupy", "float16"), ("cupy", "float32"), ("torch", "bfloat16")])
def test_maxsim_on_another_gpu_is_the_current_gpus_call(rng, other_gpu, fw, dtype):
    """maxsim, maxsim_pairs and per-query candidates with their arrays on cuda:1 while cuda:0 is current:
    each runs on cuda:1 (its results there), bit for bit as on cuda:0, strict validation and the repeat
    path (the second call) included, and leaves cuda:0 current."""
    from devices import assert_calls_match, on_gpu

    nq, lq, nd, ld, dim = 3, 20, 9, 33, 64
    q, _ = _cast(_unit(rng, nq, lq, dim), dtype)
    d, _ = _cast(_unit(rng, nd, ld, dim), dtype)
    c, _ = _cast(_unit(rng, nq, 4, ld, dim), dtype)
    qm = rng.random((nq, lq)) < 0.8
    dl = rng.integers(0, ld + 1, nd)
    calls = {
        "maxsim": lambda a: lik_cupy.maxsim(a["q"], a["d"], a["qm"], d_lengths=a["dl"], return_argmax=True),
        "strict": lambda a: lik_cupy.maxsim(a["q"], a["d"], d_lengths=a["dl"], validate=True),
        "mask": lambda a: lik_cupy.maxsim(a["q"], a["d"], d_mask=a["dm"]),
        "pairs": lambda a: lik_cupy.maxsim_pairs(a["q"], a["d"][:nq], return_argmax=True),
        "candidates": lambda a: lik_cupy.maxsim(a["q"], a["c"], return_argmax=True),
    }
    arrays = {"q": q, "d": d, "c": c, "qm": qm, "dl": dl, "dm": np.arange(ld)[None, :] < dl[:, None]}
    here = {k: _framework(fw, v) for k, v in arrays.items()}
    there = on_gpu(here, other_gpu)
    assert_calls_match(calls, here, there, other_gpu)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_maxsim_varlen_on_another_gpu_is_the_current_gpus_call(rng, other_gpu, fw):
    """maxsim_varlen (device offsets and query lengths, packed queries, strict checks) on cuda:1 while cuda:0 is current."""
    from devices import assert_calls_match, on_gpu

    nq, lq, dim = 3, 24, 64
    lens = rng.integers(0, 40, 11)
    off = np.concatenate([[0], np.cumsum(lens)])
    tok, _ = _cast(_unit(rng, int(off[-1]), dim), "float16")
    q, _ = _cast(_unit(rng, nq, lq, dim), "float16")
    q_off = np.array([0, 5, 24, 30])
    ql = rng.integers(1, lq + 1, nq)
    calls = {
        "padded queries": lambda a: lik_cupy.maxsim_varlen(a["q"], a["tok"], a["off32"], q_lengths=a["ql"],
                                                           return_argmax=True),
        "strict": lambda a: lik_cupy.maxsim_varlen(a["q"], a["tok"], a["off"], validate=True),
        "packed queries": lambda a: lik_cupy.maxsim_varlen(a["qt"], a["tok"], a["off"], q_offsets=a["q_off"],
                                                           return_argmax=True),
    }
    arrays = {"q": q, "tok": tok, "off": off, "off32": off.astype(np.int32), "ql": ql, "qt": q.reshape(-1, dim)[:30],
              "q_off": q_off}
    here = {k: _framework(fw, v) for k, v in arrays.items()}
    there = on_gpu(here, other_gpu)
    assert_calls_match(calls, here, there, other_gpu)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_arrays_on_two_gpus_are_refused(rng, other_gpu, fw):
    """A call whose arrays lie on two GPUs raises a ValueError naming both, before any kernel reads them."""
    from devices import current, on_gpu

    q, _ = _cast(_unit(rng, 2, 8, 32), "float16")
    d, _ = _cast(_unit(rng, 5, 9, 32), "float16")
    Q0, D0 = _framework(fw, q), _framework(fw, d)
    Q1, D1 = on_gpu(Q0, other_gpu), on_gpu(D0, other_gpu)
    lens1 = on_gpu(_framework(fw, np.array([3, 9, 0, 1, 9])), other_gpu)
    off0 = _framework(fw, np.array([0, 10, 45]))
    for call, message in [(lambda: lik_cupy.maxsim(Q0, D1), "Q is on cuda:0 but D is on cuda:1"),
                          (lambda: lik_cupy.maxsim(Q1, D0), "Q is on cuda:1 but D is on cuda:0"),
                          (lambda: lik_cupy.maxsim(Q0, D0, d_lengths=lens1), "d_lengths is on cuda:1 but Q is on cuda:0"),
                          (lambda: lik_cupy.maxsim_varlen(Q1, D1.reshape(45, 32), off0),
                           "d_offsets is on cuda:0 but Q is on cuda:1")]:
        with pytest.raises(ValueError, match=message):
            current(call)
