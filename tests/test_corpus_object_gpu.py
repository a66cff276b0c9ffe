"""lik_cupy.Corpus on the GPU (skipped without one): resident and page-locked corpora against the
stateless functions, rerank in place against a gathered copy (bit for bit), candidate ids outside
the corpus, torch queries, threads."""

import numpy as np
import pytest

import lik_cupy
from reference import maxsim_ref, rel_err
from test_corpus_object import LAYOUTS, corpus_case
from test_forward_gpu import _cp, _np, _torch
from threads import run_threads

pytestmark = pytest.mark.gpu


@pytest.fixture
def same_tiles(monkeypatch):
    """Candidate-id tiles stage by cp.async; keep the calls compared with them off TMA too, so both
    run the same tile (TMA changes no bits of a tile's arithmetic, but INT8 takes other tiles with it)."""
    monkeypatch.setenv("LIK_DISABLE_TMA", "1")


def _on_gpu(kw):
    """The corpus arguments as CuPy arrays (lists as they are)."""
    return {k: (_cp(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}


def _gathered(kw, cand):
    """The candidates' documents copied out, as the stateless calls take them: padded
    [Nq, K, Ld, d] (+ masks, lengths, scales) or, packed, per query (tokens, offsets, scales)."""
    D = kw["D"]
    if "d_offsets" not in kw:
        out = {"D": D[cand]}
        for name in ("d_mask", "d_lengths", "d_scales"):
            if name in kw:
                out[name] = np.asarray(kw[name])[cand]
        return out
    off = np.asarray(kw["d_offsets"], np.int64)
    per_query = []
    for row in cand:
        rows = np.concatenate([np.arange(off[j], off[j + 1]) for j in row]).astype(np.int64)
        o = np.concatenate([[0], np.cumsum(off[row + 1] - off[row])])
        per_query.append((D[rows], o, None if "d_scales" not in kw else kw["d_scales"][rows]))
    return per_query


def _stateless(kw, Q, ql):
    """The corpus's scores from maxsim / maxsim_varlen / maxsim_int8(_varlen), on the GPU."""
    kw = _on_gpu(kw)
    D = kw.pop("D")
    if "d_scales" in kw:
        if "d_offsets" in kw:
            return lik_cupy.maxsim_int8_varlen(Q, D, kw["d_scales"], kw["d_offsets"], q_lengths=ql)
        return lik_cupy.maxsim_int8(Q, D, kw["d_scales"], d_lengths=kw.get("d_lengths"), q_lengths=ql)
    if "d_offsets" in kw:
        return lik_cupy.maxsim_varlen(Q, D, kw["d_offsets"], q_lengths=ql)
    return lik_cupy.maxsim(Q, D, d_mask=kw.get("d_mask"), d_lengths=kw.get("d_lengths"), q_lengths=ql)


def _rerank_gathered(kw, Q, ql, cand):
    """maxsim on a gathered copy of each query's candidates: the reference rerank must equal bit for bit."""
    g = _gathered(kw, cand)
    if isinstance(g, dict):
        g = _on_gpu(g)
        if "d_scales" in g:
            return _np(lik_cupy.maxsim_int8(Q, g["D"], g["d_scales"], d_lengths=g.get("d_lengths"), q_lengths=ql))
        return _np(lik_cupy.maxsim(Q, g["D"], d_mask=g.get("d_mask"), d_lengths=g.get("d_lengths"), q_lengths=ql))
    rows = []
    for i, (tok, off, sc) in enumerate(g):
        qi, li = Q[i:i + 1], ql[i:i + 1]
        if sc is None:
            rows.append(_np(lik_cupy.maxsim_varlen(qi, _cp(tok), _cp(off), q_lengths=li)))
        else:
            rows.append(_np(lik_cupy.maxsim_int8_varlen(qi, _cp(tok), _cp(sc), _cp(off), q_lengths=li)))
    return np.concatenate(rows)


@pytest.mark.parametrize("where", ["gpu", "host-to-gpu", "pinned"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_against_the_stateless_calls(rng, same_tiles, layout, where):
    dim = 64 if layout.startswith("int8") else 40  # INT8 kernels take multiples of 16
    kw, values, valid, _ = corpus_case(rng, layout, nd=300, ld=37, dim=dim)
    nq, lq = 6, 19
    Q = _cp(rng.standard_normal((nq, lq, dim)).astype(np.float32))
    ql = _cp(rng.integers(0, lq + 1, nq))
    if where == "gpu":
        corpus = lik_cupy.Corpus(**_on_gpu(kw))
    else:
        corpus = lik_cupy.Corpus(**kw, max_gpu_bytes=0 if where == "pinned" else None)
    assert corpus.where == {"gpu": "GPU", "host-to-gpu": "GPU", "pinned": "pinned host memory"}[where]
    assert len(corpus) == 300 and corpus.dim == dim and corpus.device == 0
    want = _np(_stateless(kw, Q, ql))
    s = corpus.score(Q, q_lengths=ql)
    assert type(s) is type(Q) and s.shape == (nq, 300)
    np.testing.assert_array_equal(_np(s), want)  # the same kernel on the same operands
    qv = np.arange(lq)[None, :] < _np(ql)[:, None]
    ref = maxsim_ref(_np(Q), values, qv, valid)[0]
    assert rel_err(_np(s), ref) < (2e-2 if layout.startswith("int8") else 3e-5)

    for k in (1, 10, 300):
        got_s, got_i = corpus.search(Q, k, q_lengths=ql)
        want_s, want_i = lik_cupy.retrieve(Q, k=k, q_lengths=ql, **_on_gpu(kw))
        np.testing.assert_array_equal(_np(got_s), _np(want_s))
        np.testing.assert_array_equal(_np(got_i), _np(want_i))

    cand = rng.integers(0, 300, (nq, 33))
    cand[1, :5] = cand[1, 5]
    r = corpus.rerank(Q, _cp(cand), q_lengths=ql)
    assert r.shape == (nq, 33)
    np.testing.assert_array_equal(_np(r), _rerank_gathered(kw, Q, ql, cand))
    # score ran tiles of several queries, which sum a query's rows in another order: a rounding
    # of the largest row maximum apart (a score near 0 is a sum of rows that cancel)
    scale = np.abs(want[np.isfinite(want)]).max()
    np.testing.assert_allclose(_np(r), np.take_along_axis(want, cand, 1), rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_array_equal(_np(corpus.rerank(Q, cand.astype(np.int32), q_lengths=ql)), _np(r))  # host ids


@pytest.mark.parametrize("layout", ["padded-mask", "padded-lengths", "packed", "int8-packed"])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_device_ids_outside_the_corpus_score_nan_exactly_there(rng, same_tiles, layout, id_dtype):
    dim = 32
    kw, *_ = corpus_case(rng, layout, nd=50, ld=20, dim=dim)
    Q = _cp(rng.standard_normal((4, 150, dim)).astype(np.float32))  # 150 tokens: several query tiles
    ql = _cp(np.array([150, 0, 77, 1]))  # query 1 has no token: 0, or NaN for a bad id
    for corpus in (lik_cupy.Corpus(**_on_gpu(kw)), lik_cupy.Corpus(**kw, max_gpu_bytes=0)):
        cand = rng.integers(0, 50, (4, 40))
        bad = rng.random(cand.shape) < 0.25
        cand[bad] = rng.choice([-1, -(2**31), 50, 51, 2**31 - 1], int(bad.sum()))
        r = _np(corpus.rerank(Q, _cp(cand.astype(id_dtype)), q_lengths=ql))
        assert np.array_equal(np.isnan(r), bad)
        good = np.where(bad, 0, cand)
        want = np.take_along_axis(_np(corpus.score(Q, q_lengths=ql)), good, 1)
        np.testing.assert_array_equal(r[~bad], want[~bad])
        with pytest.raises(ValueError, match=r"candidates holds 50; every entry must be in \[0, 49\]"):
            corpus.rerank(Q, np.where(bad, 50, cand), q_lengths=ql)  # host ids are checked


def test_empty_queries_and_documents_with_device_ids(rng):
    kw, *_ = corpus_case(rng, "padded", nd=5, ld=4, dim=16)
    corpus = lik_cupy.Corpus(**_on_gpu(kw))
    cand = _cp(np.array([[0, 7, 4]]))
    r = _np(corpus.rerank(_cp(np.zeros((1, 0, 16), np.float32)), cand))  # no query token: 0, NaN for id 7
    assert r[0, 0] == 0 and np.isnan(r[0, 1]) and r[0, 2] == 0
    empty = lik_cupy.Corpus(_cp(np.zeros((0, 16), np.float32)), d_offsets=_cp(np.array([0, 0, 0])))
    r = _np(empty.rerank(_cp(np.ones((1, 2, 16), np.float32)), _cp(np.array([[1, 2, -1]]))))
    assert r[0, 0] == -np.inf and np.isnan(r[0, 1]) and np.isnan(r[0, 2])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_queries(rng, dtype):
    torch = pytest.importorskip("torch")
    import ml_dtypes

    npd = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    kw, *_ = corpus_case(rng, "packed", nd=120, ld=30, dim=64, dtype=npd)
    corpus = lik_cupy.Corpus(**kw)  # host arrays (bfloat16 as ml_dtypes) uploaded
    Qn = rng.standard_normal((3, 9, 64)).astype(npd)
    Q = _torch(Qn)
    s = corpus.score(Q)
    assert isinstance(s, torch.Tensor) and s.is_cuda and s.dtype == torch.float32
    want = _np(lik_cupy.maxsim_varlen(Q, _torch(kw["D"]), _torch(kw["d_offsets"])))
    np.testing.assert_array_equal(s.cpu().numpy(), want)
    vals, ids = corpus.search(Q, 5)
    assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int64
    cand = torch.tensor(rng.integers(0, 120, (3, 11)), device="cuda")
    r = corpus.rerank(Q, cand)  # score ran tiles of several queries, which sum a query's rows in another order
    np.testing.assert_allclose(r.cpu().numpy(), np.take_along_axis(want, cand.cpu().numpy(), 1), rtol=1e-5, atol=1e-6)
    if dtype != "bfloat16":  # CuPy holds no bfloat16: host bfloat16 queries are torch's to upload
        host = corpus.score(Qn)  # host queries: host results
        assert isinstance(host, np.ndarray)
        np.testing.assert_array_equal(host, want)


def test_ids_and_one_query(rng):
    kw, *_ = corpus_case(rng, "padded-lengths", nd=80, ld=10, dim=32)
    Q = _cp(rng.standard_normal((7, 32)).astype(np.float32))
    plain = lik_cupy.Corpus(**_on_gpu(kw))
    s, i = plain.search(Q, 6)
    assert s.shape == (6,) and i.shape == (6,)
    for ids in (np.arange(80) + 10**12, np.array([f"p{j}" for j in range(80)])):
        named = lik_cupy.Corpus(**_on_gpu(kw), ids=ids)
        s2, i2 = named.search(Q, 6)
        np.testing.assert_array_equal(_np(s2), _np(s))
        np.testing.assert_array_equal(_np(i2), ids[_np(i)])
        assert isinstance(i2, np.ndarray) == (ids.dtype.kind == "U")
    np.testing.assert_array_equal(_np(plain.rerank(Q, _cp(np.array([4, 2])))), _np(plain.score(Q))[[4, 2]])


def test_small_budget_keeps_the_corpus_in_pinned_memory(rng):
    kw, *_ = corpus_case(rng, "padded-mask", nd=400, ld=33, dim=48)
    big = lik_cupy.Corpus(**kw, max_gpu_bytes=kw["D"].nbytes // 2)
    resident = lik_cupy.Corpus(**kw)
    assert big.where == "pinned host memory" and resident.where == "GPU"
    from lik_cupy._runtime.pinned import span_page_locked

    assert span_page_locked(big._host.tokens)
    Q = _cp(rng.standard_normal((5, 12, 48)).astype(np.float32))
    np.testing.assert_array_equal(_np(big.score(Q)), _np(resident.score(Q)))
    for a, b in zip(big.search(Q, 20), resident.search(Q, 20)):
        np.testing.assert_array_equal(_np(a), _np(b))
    cand = _cp(rng.integers(0, 400, (5, 64)))
    np.testing.assert_array_equal(_np(big.rerank(Q, cand)), _np(resident.rerank(Q, cand)))


def test_eight_threads_get_the_serial_results(rng):
    kw, *_ = corpus_case(rng, "packed", nd=2000, ld=60, dim=64)
    corpora = [lik_cupy.Corpus(**_on_gpu(kw)), lik_cupy.Corpus(**kw, max_gpu_bytes=0)]
    queries = [_cp(rng.standard_normal((4, 20, 64)).astype(np.float32)) for _ in range(8)]
    cands = [_cp(rng.integers(-2, 2002, (4, 50))) for _ in range(8)]  # a few outside: NaN

    def run(corpus, t):
        s = corpus.score(queries[t])
        v, i = corpus.search(queries[t], 10)
        return [_np(x) for x in (s, v, i, corpus.rerank(queries[t], cands[t]))]

    for corpus in corpora:
        want = [run(corpus, t) for t in range(8)]
        got = [None] * 8

        def work(t, corpus=corpus):
            got[t] = [run(corpus, t) for _ in range(3)]

        run_threads(8, work)
        for t in range(8):
            for rep in got[t]:
                for a, b in zip(rep, want[t]):
                    np.testing.assert_array_equal(a, b)


def test_from_shards_on_the_gpu(rng, tmp_path):
    from lik_cupy import shards

    lens = rng.integers(0, 40, 90)
    tok = rng.standard_normal((int(lens.sum()), 64)).astype(np.float16)
    off = np.concatenate([[0], np.cumsum(lens)])
    shards.write_shard(tmp_path / "a", tok[: off[50]], off[:51], ids=np.arange(50))
    shards.write_shard(tmp_path / "b", tok[off[50]:], off[50:] - off[50], ids=np.arange(50, 90))
    corpus = lik_cupy.Corpus.from_shards([tmp_path / "a", tmp_path / "b"])
    assert corpus.where == "GPU" and len(corpus) == 90
    Q = _cp(rng.standard_normal((2, 8, 64)).astype(np.float16))
    np.testing.assert_array_equal(_np(corpus.score(Q)), _np(lik_cupy.maxsim_varlen(Q, _cp(tok), _cp(off))))


def test_queries_on_another_framework_or_device_are_refused(rng):
    kw, *_ = corpus_case(rng, "packed", nd=10, ld=5, dim=16)
    corpus = lik_cupy.Corpus(**_on_gpu(kw))
    with pytest.raises(TypeError, match="corpus has dtype float32 but Q has float16"):
        corpus.score(_cp(np.zeros((1, 2, 16), np.float16)))
    with pytest.raises(ValueError, match=r"D is on cuda:0 but device=1"):
        lik_cupy.Corpus(**_on_gpu(kw), device=1)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("where", ["gpu", "pinned"])
@pytest.mark.parametrize("layout", ["padded-mask", "padded-lengths", "padded", "packed"])
def test_repeat_calls_read_each_calls_arrays(rng, same_tiles, layout, where, fw):
    """score and rerank keep a prepared call per signature (the repeat path): a repeat call scores
    the values its arrays hold now, with the NaN contract of device query lengths and ids, exactly
    as a fresh corpus's first call does."""
    to = _cp if fw == "cupy" else _torch
    kw, *_ = corpus_case(rng, layout, nd=210, ld=29, dim=48)
    corpus = lik_cupy.Corpus(**kw, max_gpu_bytes=0 if where == "pinned" else None)
    nq, lq = 5, 23
    Q = to(rng.standard_normal((nq, lq, 48)).astype(np.float32))
    ql = to(rng.integers(0, lq + 1, nq))  # int64
    cand = to(rng.integers(0, 210, (nq, 17)).astype(np.int32))
    corpus.score(Q, q_lengths=ql)
    corpus.rerank(Q, cand, q_lengths=ql)
    assert len(corpus._calls) == (1 if where == "pinned" else 2)  # score streams a page-locked corpus
    for _ in range(2):  # new values in the same arrays: the prepared calls read them
        Q[...] = to(rng.standard_normal((nq, lq, 48)).astype(np.float32))
        new_ql = rng.integers(0, lq + 1, nq)
        new_ql[2] = lq + 1  # invalid: NaN in its row, nowhere else
        ql[...] = to(new_ql)
        c = rng.integers(0, 210, (nq, 17))
        c[0, 3], c[4, 0] = 210, -1  # outside the corpus: NaN exactly there
        cand[...] = to(c.astype(np.int32))
        fresh = lik_cupy.Corpus(**kw, max_gpu_bytes=0 if where == "pinned" else None)
        bad = np.zeros((nq, 17), bool)
        bad[2] = bad[0, 3] = bad[4, 0] = True
        for got, want, nan in ((corpus.score(Q, q_lengths=ql), fresh.score(Q, q_lengths=ql), bad[:, 5:6]),  # row 2 alone
                               (corpus.rerank(Q, cand, q_lengths=ql), fresh.rerank(Q, cand, q_lengths=ql), bad)):
            got, want = _np(got), _np(want)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(np.isnan(got), np.broadcast_to(nan, got.shape))
    assert len(corpus._calls) == (1 if where == "pinned" else 2)
    one = Q[1]  # one query [Lq, d] and its [K] ids: a signature of its own
    for _ in range(2):
        np.testing.assert_array_equal(_np(corpus.rerank(one, cand[1])), _np(corpus.rerank(Q[1:2], cand[1:2]))[0])


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("ids", [None, "integer", "string"])
@pytest.mark.parametrize("layout,nd,k", [("padded-mask", 210, 7), ("padded-lengths", 210, 300), ("packed", 210, 1),
                                         ("packed", 9000, 40), ("padded", 9000, 1500)])
def test_repeat_searches_rank_each_calls_scores(rng, same_tiles, layout, nd, k, ids, fw):
    """A search whose corpus was scored in one chunk keeps a prepared call (scores by the repeat
    path, then the top-k merge by kernel handle; 9,000 documents take the two-launch merge at k = 40
    and one launch at 1,500): each repeat ranks the values its arrays hold now exactly as a fresh
    corpus's first (streamed) call does, ties to the lower index, NaN last (an invalid device query
    length), with the corpus's integer ids in place of positions. String ids come back through the
    host and keep the streamed path."""
    from lik_cupy._runtime.prepared_calls import PreparedSearch

    to = _cp if fw == "cupy" else _torch
    kw, *_ = corpus_case(rng, layout, nd=nd, ld=29 if nd < 1000 else 6, dim=48)
    kw["D"][..., :] = np.round(kw["D"] * 4) / 4  # coarse values: tied scores
    if ids is not None:
        kw["ids"] = np.arange(nd) * 7 + 10**12 if ids == "integer" else np.array([f"d{j}" for j in range(nd)])
    corpus = lik_cupy.Corpus(**kw)
    nq, lq = 3, 23
    Q = to(np.round(rng.standard_normal((nq, lq, 48)) * 2).astype(np.float32) / 2)
    ql = to(rng.integers(1, lq + 1, nq).astype(np.int32))
    corpus.search(Q, k, q_lengths=ql)
    prepared = [c for c in corpus._calls.values() if isinstance(c, PreparedSearch)]
    assert len(prepared) == (0 if ids == "string" else 1)
    for _ in range(2):  # new values in the same arrays: the prepared call reads them
        Q[...] = to(np.round(rng.standard_normal((nq, lq, 48)) * 2).astype(np.float32) / 2)
        new_ql = rng.integers(1, lq + 1, nq).astype(np.int32)
        new_ql[1] = lq + 1  # invalid: every score of query 1 NaN, ranked by index
        ql[...] = to(new_ql)
        fresh = lik_cupy.Corpus(**kw)
        (got_s, got_i), (want_s, want_i) = corpus.search(Q, k, q_lengths=ql), fresh.search(Q, k, q_lengths=ql)
        assert type(got_s) is type(want_s) and (type(got_i) is type(want_i))
        assert got_s.shape == (nq, min(k, nd)) and got_i.shape == got_s.shape
        np.testing.assert_array_equal(_np(got_s), _np(want_s))
        np.testing.assert_array_equal(_np(got_i), _np(want_i))
        assert np.isnan(_np(got_s)[1]).all() and not np.isnan(_np(got_s)[[0, 2]]).any()
        positions = np.arange(min(k, nd)) if ids is None else np.asarray(kw["ids"])[:min(k, nd)]
        np.testing.assert_array_equal(_np(got_i)[1], positions)
    one = Q[2]  # one query [Lq, d]: a signature of its own, its results without the query axis
    for _ in range(2):
        s1, i1 = corpus.search(one, k)
        s3, i3 = corpus.search(Q[2:3], k)
        assert s1.shape == (min(k, nd),)
        np.testing.assert_array_equal(_np(s1), _np(s3)[0])
        np.testing.assert_array_equal(_np(i1), _np(i3)[0])


def test_a_repeat_search_out_of_memory_takes_the_streamed_path(rng, monkeypatch):
    """The repeat path holds every score at once; when that does not fit, the call streams them in
    chunks as a first call does."""
    from lik_cupy._runtime import prepared_calls

    kw, *_ = corpus_case(rng, "packed", nd=300, ld=20, dim=32)
    corpus = lik_cupy.Corpus(**_on_gpu(kw))
    Q = _cp(rng.standard_normal((2, 9, 32)).astype(np.float32))
    want = [_np(x) for x in corpus.search(Q, 5)]

    def no_memory(self, *args):
        raise MemoryError("out of GPU memory")

    monkeypatch.setattr(prepared_calls.PreparedSearch, "__call__", no_memory)
    for got, w in zip(corpus.search(Q, 5), want):
        np.testing.assert_array_equal(_np(got), w)


@pytest.mark.parametrize("dtype,to", [("float16", _cp), ("bfloat16", _torch), ("float16", np.asarray)])
def test_packed_queries_are_the_padded_call(rng, dtype, to):
    """Packed queries with q_offsets (device or host) score as the same queries padded with q_lengths."""
    from lik_cupy._shard_format import numpy_dtype

    nd, dim = 200, 64
    lens = rng.integers(1, 40, nd)
    D = rng.standard_normal((int(lens.sum()), dim)).astype(numpy_dtype(dtype))
    corpus = lik_cupy.Corpus(D, d_offsets=np.concatenate([[0], np.cumsum(lens)]))
    ql = np.array([5, 32, 1, 17])
    padded = rng.standard_normal((len(ql), ql.max(), dim)).astype(numpy_dtype(dtype))
    tokens = np.concatenate([padded[j, :n] for j, n in enumerate(ql)])
    off = np.concatenate([[0], np.cumsum(ql)])
    cand = rng.integers(0, nd, (len(ql), 16))
    for j, n in enumerate(ql):
        padded[j, n:] = 0  # unpacking pads with zeros
    got = (corpus.score(to(tokens), q_offsets=to(off)), corpus.search(to(tokens), 5, q_offsets=to(off)),
           corpus.rerank(to(tokens), to(cand), q_offsets=to(off)))
    want = (corpus.score(to(padded), q_lengths=to(ql)), corpus.search(to(padded), 5, q_lengths=to(ql)),
            corpus.rerank(to(padded), to(cand), q_lengths=to(ql)))
    assert np.array_equal(_np(got[0]), _np(want[0]))
    assert all(np.array_equal(_np(a), _np(b)) for a, b in zip(got[1], want[1]))
    assert np.array_equal(_np(got[2]), _np(want[2]))


@pytest.mark.parametrize("layout", ["padded-mask", "packed", "int8-packed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_queries_move_in_one_copy_each_way(rng, monkeypatch, layout, dtype):
    """NumPy queries (and host ids) of a GPU-resident corpus go through one page-locked copy each
    way (host_staging) and give the bits of the plain path and of CuPy queries: NumPy's float32
    default precision (not CUPY_TF32's), host ids still checked, new arrays that own their memory."""
    import cupy

    from lik_cupy import corpus as corpus_module
    from lik_cupy._runtime import host_staging

    monkeypatch.setenv("CUPY_TF32", "1")  # CuPy's default: a NumPy call must not follow it
    dim = 64 if layout.startswith("int8") else 40
    kw, *_ = corpus_case(rng, layout, nd=300, ld=37, dim=dim, dtype=np.float32 if layout.startswith("int8") else dtype)
    corpora = [lik_cupy.Corpus(**_on_gpu(kw)), lik_cupy.Corpus(**_on_gpu(kw), ids=np.arange(300) * 7 + 5),
               lik_cupy.Corpus(**_on_gpu(kw), ids=np.array([f"d{j}" for j in range(300)]))]
    Q = rng.standard_normal((5, 19, dim)).astype(dtype)
    Q[1, 3] = Q[1, 4]  # a repeated token
    cand = rng.integers(0, 300, (5, 33))
    staged = []
    real = corpus_module.staged_call
    monkeypatch.setattr(corpus_module, "staged_call", lambda *a: staged.append(1) or real(*a))
    exact = {"precision": "fp32"} if Q.dtype == np.float32 else {}

    def calls(c, q, ids, **p):
        out = [c.score(q, **p), *c.search(q, 10, **p), c.rerank(q, ids, **p)]
        return out + [c.rerank(q, ids.tolist(), **p)] if isinstance(ids, np.ndarray) else out

    for c in corpora:
        for q, ids in ((Q, cand), (Q[2], cand[2]), (Q[:, :1], cand[:, :1])):
            before = len(staged)
            got = calls(c, q, ids)
            assert len(staged) - before == 4
            for a in got:
                assert isinstance(a, np.ndarray) and (a.dtype.kind == "U" or a.flags.owndata)
            on_device = calls(c, _cp(q), _cp(ids), **exact)
            with monkeypatch.context() as m:
                m.setattr(host_staging, "MAX_BYTES", 0)  # the plain path
                plain = calls(c, q, ids)
            assert len(staged) - before == 4
            for a, b, d in zip(got, plain, on_device):
                np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(a, _np(d))
            if Q.dtype == np.float32:  # an explicit precision is the call's
                for a, d in zip(calls(c, q, ids, precision="tf32"), calls(c, _cp(q), _cp(ids), precision="tf32")):
                    np.testing.assert_array_equal(a, _np(d))
    with pytest.raises(ValueError, match="candidates"):
        corpora[0].rerank(Q, cand + 300)  # host ids are checked before anything moves
    with pytest.raises(TypeError, match="float64"):
        corpora[0].score(Q.astype(np.float64))  # not staged: the plain path refuses it
    with pytest.raises(ValueError, match="precision"):
        corpora[0].score(Q, precision="bogus")  # (float16: raised by the CuPy call, after the upload)
    big = rng.standard_normal((host_staging.MAX_BYTES // (19 * dim * Q.itemsize) + 1, 19, dim)).astype(Q.dtype)
    before = len(staged)
    np.testing.assert_array_equal(corpora[0].rerank(big, np.zeros((len(big), 2), int)),
                                  _np(corpora[0].rerank(_cp(big), _cp(np.zeros((len(big), 2), int)), **exact)))
    assert len(staged) == before  # past MAX_BYTES: the plain path
    results = [None] * 8  # threads, each on a stream of its own: each its own buffers and rows

    def work(t):
        with cupy.cuda.Stream(non_blocking=True):
            results[t] = [corpora[1].rerank(Q, (cand + t) % 300), corpora[1].search(Q, 5 + t)[1],
                          corpora[1].score(Q[t % 5])]

    run_threads(8, work)
    for t in range(8):
        np.testing.assert_array_equal(results[t][0], corpora[1].rerank(Q, (cand + t) % 300))
        np.testing.assert_array_equal(results[t][1], corpora[1].search(Q, 5 + t)[1])
        np.testing.assert_array_equal(results[t][2], corpora[1].score(Q[t % 5]))


@pytest.mark.parametrize("layout", ["padded-mask", "packed"])
def test_jax_queries_take_the_cupy_call_through_dlpack(rng, monkeypatch, layout):
    """JAX queries and ids on the corpus's GPU are shared with the CuPy call through DLPack: the bits
    of the plain path and of CuPy queries, JAX's precision default, JAX results on that GPU (string
    ids as NumPy), device ids outside the corpus NaN."""
    jax = pytest.importorskip("jax")
    import cupy

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("JAX has no GPU here")
    kw, *_ = corpus_case(rng, layout, nd=300, ld=37, dim=128)
    with cupy.cuda.Device(gpus[0].id):  # (JAX's first jax.devices() leaves its last GPU current)
        corpora = [lik_cupy.Corpus(**_on_gpu(kw)),
                   lik_cupy.Corpus(**_on_gpu(kw), ids=np.array([f"d{j}" for j in range(300)]))]
    Q = rng.standard_normal((5, 19, 128)).astype(np.float32)
    cand = rng.integers(0, 300, (5, 33)).astype(np.int32)
    cand[0, 0] = 300  # outside the corpus: NaN there
    qj, cj = jax.device_put(Q, gpus[0]), jax.device_put(cand, gpus[0])
    through = []

    def calls(c, q, ids, **p):
        return [c.score(q, **p), *c.search(q, 10, **p), c.rerank(q, ids, **p)]

    for c in corpora:
        real = c._through_cupy
        monkeypatch.setattr(c, "_through_cupy", lambda *a, real=real: through.append(1) or real(*a))
        for tf32 in (False, True):
            with jax.default_matmul_precision("tensorfloat32" if tf32 else "float32"):
                for q, ids in ((qj, cj), (qj[2], cj[2])):
                    before = len(through)
                    got = calls(c, q, ids)
                    # score, rerank and (where the CuPy search repeats: no string ids) search
                    assert len(through) - before == (2 if c._ids is not None else 3)
                    on_device = calls(c, _cp(np.asarray(q)), _cp(np.asarray(ids)),
                                      precision="tf32" if tf32 else "fp32")
                    with monkeypatch.context() as m:
                        m.setattr(c, "_stand_in", lambda *a: None)  # the plain path
                        plain = calls(c, q, ids)
                    for a, b, d in zip(got, plain, on_device):
                        assert type(a) is type(b)
                        if isinstance(a, jax.Array):
                            assert list(a.devices()) == [gpus[0]]
                        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
                        np.testing.assert_array_equal(np.asarray(a), _np(d).astype(np.asarray(a).dtype))
                    assert np.isnan(np.asarray(got[-1])[0, 0] if q.ndim == 3 else np.nan)


def test_a_corpus_is_ready_for_any_stream_when_built(rng, monkeypatch):
    """Its copies and the mask-spans kernel are queued on the building thread's stream, and other
    threads call on non-blocking streams of their own, which do not wait for that one: the
    constructor returns once they are done (a spin kernel before the spans holds them back here)."""
    import cupy

    from lik_cupy import corpus as corpus_module

    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long n) {
        long long t0 = clock64(); while (clock64() - t0 < n) {} }''', "spin")
    spans = corpus_module._with_spans

    def held_back(docs, device):
        spin((1,), (1,), (np.int64(500_000_000),))  # a few tenths of a second
        return spans(docs, device)

    monkeypatch.setattr(corpus_module, "_with_spans", held_back)
    d = rng.standard_normal((50, 40, 64)).astype(np.float16)
    mask = rng.random((50, 40)) < 0.7
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        c = lik_cupy.Corpus(_cp(d), d_mask=_cp(mask), ids=np.arange(50) * 2)
        assert stream.done  # nothing of the corpus is still queued there
    other = cupy.cuda.Stream(non_blocking=True)
    q = rng.standard_normal((2, 8, 64)).astype(np.float16)
    with other:
        got = _np(c.score(_cp(q)))
    np.testing.assert_allclose(got, maxsim_ref(q, d, d_valid=mask)[0], rtol=2e-3,
                               atol=2e-3)


# ---------------------------------------------------------------- a corpus on another GPU than the current one


def _queries(fw, a, device):
    """NumPy ``a`` as the queries of framework ``fw`` ("numpy", "cupy", "torch") on GPU ``device``."""
    from devices import on_gpu

    if fw == "numpy":
        return a
    if fw == "torch":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(a).to(f"cuda:{device}")
    return on_gpu(a, device)


@pytest.mark.parametrize("where", ["gpu", "host-to-gpu", "pinned"])
@pytest.mark.parametrize("layout", ["padded-mask", "packed", "int8-padded"])
def test_corpus_on_another_gpu_is_the_current_gpus_corpus(rng, other_gpu, layout, where):
    """A Corpus resident on cuda:1 (device arrays there, host arrays uploaded with device=1, or page-locked for
    it) while cuda:0 is current: score, search (integer ids) and rerank of NumPy, CuPy and torch queries run on
    cuda:1, their results in the queries' place, bit for bit as the same corpus's on cuda:0, the repeat path
    (the second call) included, and cuda:0 stays current."""
    from devices import assert_on, assert_same_bits, current, on_gpu

    dim = 64 if layout.startswith("int8") else 40
    kw, *_ = corpus_case(rng, layout, nd=60, ld=13, dim=dim)
    ids = np.arange(60) * 7 + 3

    def make(device):
        if where == "gpu":
            return lik_cupy.Corpus(**on_gpu(kw, device), ids=ids)
        return lik_cupy.Corpus(**kw, ids=ids, device=device, max_gpu_bytes=0 if where == "pinned" else None)

    c0, c1 = current(make, 0), current(make, other_gpu)
    assert (c0.device, c1.device) == (0, other_gpu) and c0.where == c1.where
    nq, lq = 3, 11
    q = rng.standard_normal((nq, lq, dim)).astype(np.float32)
    ql = rng.integers(1, lq + 1, nq)
    cand = rng.integers(0, 60, (nq, 9))
    for fw in ("numpy", "cupy", "torch"):
        calls = {
            "score": lambda c, a: c.score(a["q"]),
            "score q_lengths": lambda c, a: c.score(a["q"], q_lengths=a["ql"]),
            "search": lambda c, a: c.search(a["q"], 5),
            "search q_lengths": lambda c, a: c.search(a["q"], 5, q_lengths=a["ql"]),
            "rerank": lambda c, a: c.rerank(a["q"], a["cand"]),
            "rerank q_lengths": lambda c, a: c.rerank(a["q"], a["cand"], q_lengths=a["ql"]),
            "one query": lambda c, a: c.search(a["q"][0], 4),
        }
        here = {k: _queries(fw, v, 0) for k, v in (("q", q), ("ql", ql), ("cand", cand))}
        there = {k: _queries(fw, v, other_gpu) for k, v in (("q", q), ("ql", ql), ("cand", cand))}
        for name, call in calls.items():
            want = current(call, c0, here)
            for _ in range(2):  # the first call, then the repeat path's prepared call
                got = current(call, c1, there)
                assert_on(got, None if fw == "numpy" else other_gpu, f"{fw} {name}")
                assert_same_bits(got, want, f"{fw} {name}")


def test_corpus_on_another_gpu_refuses_arrays_of_the_current_one(rng, other_gpu):
    from devices import current, on_gpu

    kw, *_ = corpus_case(rng, "packed", nd=10, ld=5, dim=16)
    corpus = lik_cupy.Corpus(**on_gpu(kw, other_gpu))
    assert corpus.device == other_gpu
    Q0 = _cp(np.ones((2, 3, 16), np.float32))
    Q1 = on_gpu(Q0, other_gpu)
    with pytest.raises(ValueError, match="corpus is on cuda:1 but Q is on cuda:0"):
        current(corpus.score, Q0)
    with pytest.raises(ValueError, match="corpus is on cuda:1 but Q is on cuda:0"):
        current(corpus.search, Q0, 3)
    with pytest.raises(ValueError, match="candidates are on cuda:0 but the corpus is on cuda:1"):
        current(corpus.rerank, Q1, _cp(np.zeros((2, 4), np.int64)))
    with pytest.raises(ValueError, match="D is on cuda:1 but device=0"):
        lik_cupy.Corpus(**on_gpu(kw, other_gpu), device=0)
