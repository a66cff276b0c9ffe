"""lik_cupy.Corpus on the NumPy path (``device="cpu"``): every layout against maxsim / retrieve / a
float64 reference, candidate ids, external ids, shards, threads. tests/test_corpus_object_gpu.py
holds the GPU side."""

import os
import re
from dataclasses import replace

import numpy as np
import pytest

import lik_cupy
from lik_cupy import shards
from reference import assert_within_rounding, maxsim_ref, rounding_bound
from threads import run_threads

LAYOUTS = ["padded-mask", "padded-lengths", "padded", "packed", "int8-padded", "int8-packed"]


def _ragged(rng, nd, hi):
    lens = rng.integers(1, hi + 1, nd)
    lens[rng.random(nd) < 0.15] = 0  # some documents without tokens: -inf
    return lens


def corpus_case(rng, layout, nd=23, ld=13, dim=24, dtype=np.float32):
    """(Corpus keyword arguments, D as padded [nd, ld, dim] float64 values, its valid tokens, its lengths)."""
    lens = _ragged(rng, nd, ld)
    valid = np.arange(ld)[None, :] < lens[:, None]
    if layout == "padded-mask":  # holes anywhere, not just a prefix
        valid = rng.random((nd, ld)) < 0.6
        valid[0] = False
    D = rng.standard_normal((nd, ld, dim)).astype(dtype)
    if layout.startswith("int8"):
        D8, s8 = lik_cupy.quantize_int8(D, backend="cpu")
        values = D8.astype(np.float64) * s8[..., None]
        if layout == "int8-padded":
            return dict(D=D8, d_scales=s8, d_lengths=lens), values, valid, lens
        off = np.concatenate([[0], np.cumsum(lens)])
        return dict(D=D8[valid], d_scales=s8[valid], d_offsets=off), values, valid, lens
    values = D.astype(np.float64)
    if layout == "padded-mask":
        return dict(D=D, d_mask=valid), values, valid, None
    if layout == "padded-lengths":
        return dict(D=D, d_lengths=lens), values, valid, lens
    if layout == "padded":
        return dict(D=D), values, np.ones((nd, ld), bool), None
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return dict(D=D[valid], d_offsets=off), values, valid, lens


def direct_scores(kw, Q, q_lengths):
    """The same scores from the stateless functions (backend="cpu")."""
    kw = dict(kw)
    D = kw.pop("D")
    if "d_scales" in kw:
        if "d_offsets" in kw:
            return lik_cupy.maxsim_int8_varlen(Q, D, kw["d_scales"], kw["d_offsets"], q_lengths=q_lengths,
                                               backend="cpu")
        return lik_cupy.maxsim_int8(Q, D, kw["d_scales"], d_lengths=kw.get("d_lengths"), q_lengths=q_lengths,
                                    backend="cpu")
    if "d_offsets" in kw:
        return lik_cupy.maxsim_varlen(Q, D, kw["d_offsets"], q_lengths=q_lengths, backend="cpu")
    return lik_cupy.maxsim(Q, D, d_mask=kw.get("d_mask"), d_lengths=kw.get("d_lengths"), q_lengths=q_lengths,
                           backend="cpu")


def retrieve_direct(kw, Q, k, q_lengths):
    kw = dict(kw)
    return lik_cupy.retrieve(Q, kw.pop("D"), k, q_lengths=q_lengths, backend="cpu", **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_matches_maxsim_retrieve_and_float64(rng, layout):
    kw, values, valid, _ = corpus_case(rng, layout)
    nq, lq = 5, 7
    Q = rng.standard_normal((nq, lq, 24)).astype(np.float32)
    ql = rng.integers(0, lq + 1, nq)
    corpus = lik_cupy.Corpus(**kw, device="cpu")
    assert corpus.where == "host memory" and corpus.device is None
    s = corpus.score(Q, q_lengths=ql)
    assert s.dtype == np.float32 and s.shape == (nq, 23)
    np.testing.assert_array_equal(s, direct_scores(kw, Q, ql))  # one NumPy path: the same bits
    qv = np.arange(lq)[None, :] < ql[:, None]
    if layout.startswith("int8"):  # quantised queries: near the float64 MaxSim of the dequantised corpus
        ref = maxsim_ref(Q, values, qv, valid)[0]
        fin = np.isfinite(ref)
        assert np.array_equal(np.isfinite(s), fin) and np.array_equal(s[~fin], ref[~fin])
        assert np.abs(s[fin] - ref[fin]).max() < 0.02 * np.abs(ref[fin]).max()
    else:
        assert_within_rounding(s, maxsim_ref(Q, values, qv, valid)[0], rounding_bound(Q, values, qv, valid))

    for k in (1, 6, 40):
        got_s, got_i = corpus.search(Q, k, q_lengths=ql)
        want_s, want_i = retrieve_direct(kw, Q, k, ql)
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_array_equal(got_s, want_s)
        assert got_i.dtype == np.int64

    cand = rng.integers(0, 23, (nq, 9))
    cand[0, :3] = cand[0, 3]  # duplicates are scored each time
    r = corpus.rerank(Q, cand, q_lengths=ql)
    assert r.dtype == np.float32 and r.shape == (nq, 9)
    np.testing.assert_array_equal(r, np.take_along_axis(s, cand, 1))
    np.testing.assert_array_equal(corpus.rerank(Q, cand.astype(np.int32).tolist(), q_lengths=ql), r)


@pytest.mark.parametrize("layout", ["padded-mask", "packed", "int8-packed"])
def test_one_query_and_query_masks(rng, layout):
    kw, *_ = corpus_case(rng, layout, nd=11, ld=5, dim=16)
    corpus = lik_cupy.Corpus(**kw, device="cpu")
    Q = rng.standard_normal((6, 16)).astype(np.float32)
    qm = rng.random(6) < 0.7
    s = corpus.score(Q, qm)
    assert s.shape == (11,)
    np.testing.assert_array_equal(s, corpus.score(Q[None], qm[None])[0])
    sv, si = corpus.search(Q, 4, qm)
    assert sv.shape == (4,) and si.shape == (4,)
    np.testing.assert_array_equal(si, corpus.search(Q[None], 4, qm[None])[1][0])
    r = corpus.rerank(Q, [3, 0, 10], qm)
    np.testing.assert_array_equal(r, s[[3, 0, 10]])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_queries_score_as_each_query_alone(rng, layout):
    kw, _, _, _ = corpus_case(rng, layout)
    corpus = lik_cupy.Corpus(**kw, device="cpu")
    qs = [rng.standard_normal((int(n), 24)).astype(np.float32) for n in (3, 9, 1, 13, 6)]
    off = np.concatenate([[0], np.cumsum([len(q) for q in qs])])
    tokens = np.concatenate(qs)
    cand = rng.integers(0, len(corpus), (len(qs), 8))
    S, (s, i), R = (corpus.score(tokens, q_offsets=off), corpus.search(tokens, 4, q_offsets=off),
                    corpus.rerank(tokens, cand, q_offsets=off))
    for j, q in enumerate(qs):
        assert np.array_equal(S[j], corpus.score(q))
        s1, i1 = corpus.search(q, 4)
        assert np.array_equal(s[j], s1) and np.array_equal(i[j], i1)
        assert np.array_equal(R[j], corpus.rerank(q, cand[j]))
    with pytest.raises(ValueError, match="take no q_mask or q_lengths"):
        corpus.score(tokens, q_lengths=[1], q_offsets=off)
    with pytest.raises(ValueError, match="must be packed tokens"):
        corpus.score(tokens[None], q_offsets=off)
    with pytest.raises(ValueError, match="q_offsets must start at 0"):
        corpus.score(tokens, q_offsets=off + 1)


@pytest.mark.parametrize("framework,layout", [("numpy", "packed"), ("numpy", "int8-padded"), ("torch", "packed")])
def test_packed_queries_are_padded_a_group_at_a_time(rng, monkeypatch, framework, layout):
    """One long query among many short ones padded them all to its length (518 MB for a 273 KB input):
    score, search and rerank now pad a group of similar lengths at a time (within twice its tokens'
    bytes or a fixed chunk, here 1 KiB) and put each query's results in its place, bit for bit those
    of the queries padded to the longest."""
    from lik_cupy._cpu import maxsim as cpu_maxsim
    from test_cpu_exact import _peak as peak

    to = (lambda a: a) if framework == "numpy" else pytest.importorskip("torch").from_numpy
    monkeypatch.setattr(cpu_maxsim, "QUERY_CHUNK", 1 << 10, raising=False)
    kw, *_ = corpus_case(rng, layout, nd=12, ld=8, dim=16)
    corpus = lik_cupy.Corpus(**kw, ids=[f"doc{j}" for j in range(12)], device="cpu")

    def queries(short, long):
        lens = rng.integers(0, 4, short + 1)
        lens[short // 2] = long
        off = np.concatenate([[0], np.cumsum(lens)])
        return rng.standard_normal((int(off[-1]), 16)).astype(np.float32), off, lens

    tokens, off, lens = queries(40, 64)
    padded = np.zeros((41, 64, 16), np.float32)
    padded[np.arange(64) < lens[:, None]] = tokens
    cand = rng.integers(0, 12, (41, 5))
    got = (corpus.score(to(tokens), q_offsets=to(off)), *corpus.search(to(tokens), 3, q_offsets=to(off)),
           corpus.rerank(to(tokens), to(cand), q_offsets=to(off)))
    want = (corpus.score(padded, q_lengths=lens), *corpus.search(padded, 3, q_lengths=lens),
            corpus.rerank(padded, cand, q_lengths=lens))
    for g, w in zip(got, want):
        assert type(g).__module__.split(".")[0] == ("numpy" if w.dtype.kind == "U" else framework)
        np.testing.assert_array_equal(np.asarray(g), w)
    tokens, off, _ = queries(300, 512)  # 64 KB of tokens; padded to 512 tokens, 9.9 MB
    corpus.score(to(tokens), q_offsets=to(off))  # (NumPy's lazy imports, once)
    held = peak(lambda: corpus.score(to(tokens), q_offsets=to(off)))
    assert held < 301 * 512 * 16 * 4 / 2, held


def test_rerank_ids_outside_the_corpus_raise(rng):
    for layout in ("padded-lengths", "packed"):
        kw, *_ = corpus_case(rng, layout, nd=10, ld=4, dim=8)
        corpus = lik_cupy.Corpus(**kw, device="cpu")
        Q = rng.standard_normal((2, 3, 8)).astype(np.float32)
        for bad, shown in (([[0, 10], [1, 2]], 10), ([[0, 1], [-1, 2]], -1), ([[0, 1], [2, 2**40]], 2**40)):
            with pytest.raises(ValueError, match=rf"candidates holds {shown}; every entry must be in \[0, 9\] "
                                                 r"\(indices of the 10 documents of the corpus\)"):
                corpus.rerank(Q, np.array(bad))
        with pytest.raises(ValueError, match=r"candidates has shape \[3, 2\]; expected \[Nq, K\] with Nq = 2"):
            corpus.rerank(Q, np.zeros((3, 2), np.int64))
        with pytest.raises(ValueError, match=r"expected \[K\] \(Q is one query\)"):
            corpus.rerank(Q[0], np.zeros((1, 2), np.int64))
        with pytest.raises(TypeError, match="candidates must be integer document indices"):
            corpus.rerank(Q, np.zeros((2, 2), np.float32))
        assert corpus.rerank(Q, np.zeros((2, 0), np.int64)).shape == (2, 0)


def test_ids_map_search_results(rng):
    kw, *_ = corpus_case(rng, "packed", nd=30, ld=6, dim=8)
    Q = rng.standard_normal((3, 4, 8)).astype(np.float32)
    plain = lik_cupy.Corpus(**kw, device="cpu")
    s, i = plain.search(Q, 7)
    for ids in (np.arange(30) * 7 + 1000, [f"doc-{j}" for j in range(30)], np.arange(30, dtype=np.uint16)):
        corpus = lik_cupy.Corpus(**kw, ids=ids, device="cpu")
        s2, i2 = corpus.search(Q, 7)
        np.testing.assert_array_equal(s2, s)
        np.testing.assert_array_equal(i2, np.asarray(ids)[i])
        # rerank and score stay by position
        np.testing.assert_array_equal(corpus.score(Q), plain.score(Q))
        np.testing.assert_array_equal(corpus.rerank(Q, i), s)
    assert lik_cupy.Corpus(**kw, ids=[f"d{j}" for j in range(30)], device="cpu").search(Q, 2)[1].dtype.kind == "U"
    with pytest.raises(ValueError, match=r"ids has shape \[29\]; expected \[30\] \(one per document\)"):
        lik_cupy.Corpus(**kw, ids=np.arange(29), device="cpu")
    with pytest.raises(TypeError, match="ids must be integers or strings, got dtype float64"):
        lik_cupy.Corpus(**kw, ids=np.zeros(30), device="cpu")


def test_a_list_of_ids_of_mixed_kinds_is_refused():
    """NumPy turns a list of ids of mixed kinds into one kind: 1 beside "b" became the string "1" (a search
    returned "1", not 1), 2.5 beside strings "2.5", True beside integers 1; bytes beside text that is
    no ASCII raised "a ragged list". Each is now a TypeError naming the first id of another kind."""
    D = np.zeros((3, 2, 4), np.float32)
    for ids, first, other in (([1, "b", 2], "an integer", "ids[1] is a string"),
                              (["a", 2.5, "c"], "a string", "ids[1] is a float"),
                              ([True, 1, 2], "a bool", "ids[1] is an integer"),
                              ([b"\xff", "a", "b"], "a byte string", "ids[1] is a string"),
                              ((np.int64(1), "x", 3), "an integer", "ids[1] is a string")):
        with pytest.raises(TypeError, match=rf"ids\[0\] is {first} but {re.escape(other)}: ids are all integers, all "
                                            "str or all bytes"):
            lik_cupy.Corpus(D, ids=ids, device="cpu")
    for ids in ([5, np.int32(6), np.uint8(7)], ["a", np.str_("b"), "c"], [b"a", b"b", np.bytes_(b"c")]):
        np.testing.assert_array_equal(lik_cupy.Corpus(D, ids=ids, device="cpu").ids, np.asarray(ids))


def test_len_dim_dtype_nbytes(rng):
    nd, ld, dim = 9, 5, 16
    D = rng.standard_normal((nd, ld, dim)).astype(np.float16)
    lens = rng.integers(0, ld + 1, nd)
    valid = np.arange(ld)[None, :] < lens[:, None]
    c = lik_cupy.Corpus(D, d_mask=valid, device="cpu")
    assert (len(c), c.dim, c.dtype, c.nbytes) == (nd, dim, "float16", D.nbytes + valid.nbytes)
    c = lik_cupy.Corpus(D, d_lengths=lens, device="cpu")
    assert c.nbytes == D.nbytes + 8 * nd
    tok, off = D[valid], np.concatenate([[0], np.cumsum(lens)])
    c = lik_cupy.Corpus(tok, d_offsets=off, device="cpu")
    assert (len(c), c.dim, c.dtype, c.nbytes) == (nd, dim, "float16", tok.nbytes + 8 * (nd + 1))
    t8, s8 = lik_cupy.quantize_int8(tok.astype(np.float32), backend="cpu")
    c = lik_cupy.Corpus(t8, d_scales=s8, d_offsets=off, device="cpu")
    assert (len(c), c.dim, c.dtype, c.nbytes) == (nd, dim, "int8", t8.nbytes + s8.nbytes + 8 * (nd + 1))
    assert "9 documents, packed" in repr(c) and "host memory" in repr(c)


def test_bfloat16_and_float16_corpora(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dt in (np.float16, ml_dtypes.bfloat16):
        kw, *_ = corpus_case(rng, "padded-lengths", nd=8, ld=6, dim=16, dtype=dt)
        Q = rng.standard_normal((2, 3, 16)).astype(dt)
        corpus = lik_cupy.Corpus(**kw, device="cpu")
        assert corpus.dtype == np.dtype(dt).name
        np.testing.assert_array_equal(corpus.score(Q), direct_scores(kw, Q, None))
        np.testing.assert_array_equal(corpus.search(Q, 3)[1], retrieve_direct(kw, Q, 3, None)[1])


def test_empty_corpus_and_empty_queries(rng):
    corpus = lik_cupy.Corpus(np.zeros((0, 8), np.float32), d_offsets=np.array([0]), device="cpu")
    Q = rng.standard_normal((2, 3, 8)).astype(np.float32)
    assert len(corpus) == 0 and corpus.score(Q).shape == (2, 0)
    s, i = corpus.search(Q, 5)
    assert s.shape == (2, 0) and i.shape == (2, 0)
    kw, *_ = corpus_case(rng, "packed", nd=6, ld=4, dim=8)
    corpus = lik_cupy.Corpus(**kw, device="cpu")
    np.testing.assert_array_equal(corpus.score(np.zeros((2, 0, 8), np.float32)), np.zeros((2, 6), np.float32))


def test_from_shards(rng, tmp_path):
    dim = 16
    parts, ids = [], []
    for n, (nd, first) in enumerate(((7, 0), (5, 100))):
        lens = _ragged(rng, nd, 9)
        tok = rng.standard_normal((int(lens.sum()), dim)).astype(np.float16)
        off = np.concatenate([[0], np.cumsum(lens)])
        parts.append((tok, off))
        ids.append(np.arange(nd) + first)
        shards.write_shard(tmp_path / f"s{n}", tok, off, ids=ids[-1])
    tok = np.concatenate([t for t, _ in parts])
    off = np.concatenate([[0], np.cumsum(np.concatenate([np.diff(o) for _, o in parts]))])
    corpus = lik_cupy.Corpus.from_shards([tmp_path / "s0", str(tmp_path / "s1")], device="cpu")
    assert (len(corpus), corpus.dim, corpus.dtype) == (12, dim, "float16")
    Q = rng.standard_normal((3, 5, dim)).astype(np.float16)
    np.testing.assert_array_equal(corpus.score(Q), lik_cupy.maxsim_varlen(Q, tok, off, backend="cpu"))
    s, i = corpus.search(Q, 4)
    want_s, want_i = lik_cupy.retrieve(Q, tok, 4, d_offsets=off, backend="cpu")
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(i, np.concatenate(ids)[want_i])
    one = lik_cupy.Corpus.from_shards(tmp_path / "s1", device="cpu")
    np.testing.assert_array_equal(one.score(Q), lik_cupy.maxsim_varlen(Q, *parts[1], backend="cpu"))
    # INT8 shards keep their scales; a padded .npy input (no ids) joins no shard that has ids
    shards.write_shard(tmp_path / "q8", parts[0][0], parts[0][1], dtype="int8")
    q8 = lik_cupy.Corpus.from_shards([tmp_path / "q8"], device="cpu")
    assert q8.dtype == "int8"
    t8 = shards.open_shard(tmp_path / "q8")
    np.testing.assert_array_equal(q8.score(Q.astype(np.float32)),
                                  lik_cupy.maxsim_int8_varlen(Q.astype(np.float32), t8.tokens, t8.scales, t8.offsets,
                                                              backend="cpu"))
    np.save(tmp_path / "padded.npy", rng.standard_normal((4, 3, dim)).astype(np.float16))
    with pytest.raises(ValueError, match="has no ids but"):
        lik_cupy.Corpus.from_shards([tmp_path / "s0", tmp_path / "padded.npy"], device="cpu")
    with pytest.raises(ValueError, match="a corpus has one dtype and dim"):
        lik_cupy.Corpus.from_shards([tmp_path / "s0", tmp_path / "q8"], device="cpu")
    with pytest.raises(lik_cupy.ShardError, match="missing: no such file"):
        lik_cupy.Corpus.from_shards([tmp_path / "missing"], device="cpu")
    with pytest.raises(ValueError, match="at least one shard"):
        lik_cupy.Corpus.from_shards([], device="cpu")


def test_from_shards_names_a_path_that_is_none():
    """from_shards(None) raised Python's "'NoneType' object is not iterable", and [None] "expected str, bytes
    or os.PathLike object", neither naming the argument: both now say what paths takes."""
    for paths, msg in ((None, "got NoneType"), (5, "got int"), ([None], r"paths\[0\] is NoneType"),
                       (["a", 3.5], r"paths\[1\] is float")):
        with pytest.raises(TypeError, match=rf"^from_shards' paths must be a path or a sequence of paths.*{msg}"):
            lik_cupy.Corpus.from_shards(paths, device="cpu")


def test_from_shards_reads_shards_opened_already_without_opening_them_again(rng, tmp_path, monkeypatch):
    for n in range(2):
        shards.write_shard(tmp_path / f"s{n}", rng.standard_normal((6, 8)).astype(np.float16), np.array([0, 2, 6]),
                           ids=np.array([10 * n, 10 * n + 1]))
    want = lik_cupy.Corpus.from_shards([tmp_path / "s0", tmp_path / "s1"], device="cpu")
    first = shards.open_input(tmp_path / "s0")
    opened = []
    open_input = shards.open_input
    monkeypatch.setattr(shards, "open_input", lambda p, *a, **k: opened.append(p) or open_input(p, *a, **k))
    got = lik_cupy.Corpus.from_shards([first, tmp_path / "s1"], device="cpu")
    assert opened == [tmp_path / "s1"]
    q = rng.standard_normal((3, 8)).astype(np.float16)
    assert np.array_equal(got.score(q), want.score(q)) and got.ids.tolist() == [0, 1, 10, 11]
    assert lik_cupy.Corpus.from_shards(first, device="cpu").ids.tolist() == [0, 1]


def test_from_shards_joins_byte_and_text_ids(rng, tmp_path):
    """Shards whose ids.npy hold byte strings beside shards with text ids passed the one-kind check and
    then failed in NumPy's join (UnicodeDecodeError on a non-ASCII id; ASCII ones were decoded as
    ASCII). The byte ids are now read as UTF-8, as `lik score` shows them."""
    tok = rng.standard_normal((6, 8)).astype(np.float16)
    off = np.array([0, 2, 4, 6])
    shards.write_shard(tmp_path / "b", tok, off, ids=np.array(["é-1".encode(), b"b-2", b"\xff"]))
    shards.write_shard(tmp_path / "u", tok, off, ids=["u-1", "u-2", "ü-3"])
    corpus = lik_cupy.Corpus.from_shards([tmp_path / "b", tmp_path / "u"], device="cpu")
    assert corpus.ids.tolist() == ["é-1", "b-2", "\\xff", "u-1", "u-2", "ü-3"]
    Q = rng.standard_normal((2, 3, 8)).astype(np.float16)
    s, i = corpus.search(Q, 4)
    want_s, want_i = lik_cupy.retrieve(Q, [(tok, off), (tok, off)], 4, backend="cpu")
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(i, corpus.ids[want_i])
    assert lik_cupy.Corpus.from_shards(tmp_path / "b", device="cpu").ids.dtype.kind == "S"  # alone: as stored


def test_eight_threads_get_the_serial_results(rng):
    kw, *_ = corpus_case(rng, "padded-lengths", nd=200, ld=20, dim=32)
    corpus = lik_cupy.Corpus(**kw, device="cpu")
    queries = [rng.standard_normal((3, 6, 32)).astype(np.float32) for _ in range(8)]
    cands = [rng.integers(0, 200, (3, 15)) for _ in range(8)]

    def run(t):
        return corpus.score(queries[t]), corpus.search(queries[t], 10), corpus.rerank(queries[t], cands[t])

    want = [run(t) for t in range(8)]
    got = [None] * 8

    def work(t):
        got[t] = [run(t) for _ in range(3)]

    run_threads(8, work)
    for t in range(8):
        for s, (ss, si), r in got[t]:
            np.testing.assert_array_equal(s, want[t][0])
            np.testing.assert_array_equal(ss, want[t][1][0])
            np.testing.assert_array_equal(si, want[t][1][1])
            np.testing.assert_array_equal(r, want[t][2])


@pytest.mark.parametrize(
    "make,call,err,msg",
    [
        (dict(D=np.zeros((3, 2, 4), np.float64)), None, TypeError, "a Corpus holds float16, bfloat16, float32 or int8"),
        (dict(D=np.zeros((3, 2, 4), np.float32), d_lengths=[1, 2, 3]), None, ValueError,
         r"every length must be in \[0, 2\]"),
        (dict(D=np.zeros((3, 4), np.float32), d_offsets=np.array([0, 2])), None, ValueError,
         "ends at 2 but there are 3"),
        (dict(D=np.zeros((3, 2, 4), np.int8)), None, TypeError, "is int8 but has no scales"),
        (dict(D="docs.npy"), None, TypeError, "D: expected a NumPy"),
        (dict(D=np.zeros((3, 2, 4), np.float32), max_gpu_bytes=-1), None, ValueError, "max_gpu_bytes must be"),
        (dict(D=np.zeros((3, 2, 4), np.float32)), ("score", np.zeros((1, 2, 5), np.float32)), ValueError,
         "corpus has dim 4 but Q has dim 5"),
        (dict(D=np.zeros((3, 2, 4), np.float32)), ("score", np.zeros((1, 2, 4), np.float16)), TypeError,
         "corpus has dtype float32 but Q has float16"),
        (dict(D=np.zeros((3, 2, 4), np.float32)), ("score", np.zeros((1, 2, 4), np.int8)), TypeError,
         "a Corpus takes float queries"),
        (dict(D=np.zeros((3, 2, 4), np.float32)), ("search", np.zeros((1, 2, 4), np.float32), 0), ValueError,
         r"k must be an integer in \[1, 4096\]"),
        (dict(D=np.zeros((3, 2, 4), np.float32)), ("score", np.zeros((1, 1, 2, 4), np.float32)), ValueError,
         r"Q must be \[Nq, Lq, d\] or \[Lq, d\]"),
    ],
)
def test_argument_errors(make, call, err, msg):
    with pytest.raises(err, match=msg):
        corpus = lik_cupy.Corpus(**make, device="cpu")
        getattr(corpus, call[0])(*call[1:])


def test_candidate_ids_kernel_parameter_layout():
    # CandSrc in cuda_src/fwd/config.cuh: a pointer, an int64 and an int (24 bytes with its padding)
    from lik_cupy._runtime.candidates import _SRC

    assert _SRC.size == 24
    src = open(os.path.join(os.path.dirname(__file__), "..", "cuda_src", "fwd", "config.cuh")).read()
    body = src[src.index("struct CandSrc {"):src.index("};", src.index("struct CandSrc {"))]
    fields = [line.split("//")[0].strip() for line in body.splitlines()[1:] if line.split("//")[0].strip()]
    assert [f.split()[0] for f in fields] == ["const", "i64", "int"], fields


def test_candidate_tiles_are_enumerated_and_keep_the_rows_of_the_same_problem():
    from lik_cupy import _dispatch as dispatch

    names = {c.name for c in dispatch.all_forward_configs(90)}  # sm_90 has every family sm_80 has, and wgmma
    for arch in (80, 90):
        for dtype, dim in (("float16", 128), ("bfloat16", 256), ("float32", 64), ("int8", 96), ("float16", 2048)):
            for lq in (8, 32, 200):
                for packed in (False, True):
                    for argmax in (False, True):
                        c = dispatch.choose_forward(arch, dtype, dim, lq, argmax, True, True, 1, 180, packed, False,
                                                    True, True)
                        plain = dispatch.choose_forward(arch, dtype, dim, lq, argmax, True, True, 1, 180, packed,
                                                        False, True)
                        assert c.cand and not (c.multi or c.tma or c.token_split) and c.strided_tile is None, c.name
                        assert arch != 90 or c.name in names, c.name
                        # Several queries or TMA asked for: still one query a tile, staged by cp.async.
                        assert dispatch.choose_forward(arch, dtype, dim, lq, argmax, True, True, 4, 180, packed, True,
                                                       True, True) == c
                        if dtype == "int8" and argmax and arch == 90:
                            assert not c.wgmma  # INT8's argmax over ids spilled on the wgmma tiles
                            continue
                        # The tile the same problem takes without ids, or (padded split-d tiles of two
                        # m-tiles, which spilled) one of the same warps and rows per warp: the same scores.
                        assert (c.warps, c.mt, c.wgmma, c.split, c.elem) == (plain.warps, plain.mt, plain.wgmma,
                                                                              plain.split, plain.elem), c.name
                        if not (c.split and c.mt > 1 and not packed):
                            assert replace(c, cand=False) == plain


@pytest.mark.parametrize("layout", ["packed", "int8-packed"])
@pytest.mark.parametrize("block", [None, 300])
def test_packed_rerank_of_shared_candidates_shares_calls_bit_for_bit(rng, layout, block, monkeypatch):
    """Packed documents were reranked with one NumPy call per query, even where the queries named the same
    documents. Queries whose candidates overlap enough now score their candidates' union together, in one
    call per run of about ``_RERANK_BLOCK`` bytes (300: runs of a few documents, a long one alone), bit for
    bit each query's scores alone (empty queries and documents, repeated ids, a NaN token); queries whose
    candidates are their own keep a call each."""
    from lik_cupy import _cpu
    from lik_cupy import corpus as corpus_module

    kw, *_ = corpus_case(rng, layout, nd=41, ld=17, dim=24, dtype=np.float16)
    lens = np.diff(kw["d_offsets"])
    if layout == "packed":
        kw["D"][int(kw["d_offsets"][np.flatnonzero(lens)[1]])] = np.nan
    corpus = lik_cupy.Corpus(**kw, device="cpu")
    nq, lq = 7, 11
    Q = rng.standard_normal((nq, lq, 24)).astype(np.float16 if layout == "packed" else np.float32)
    ql = rng.integers(1, lq + 1, nq)
    ql[2] = 0
    pool = np.r_[np.flatnonzero(lens == 0)[:1], np.flatnonzero(lens)[:8]]  # an empty document, the NaN one
    shared = np.stack([rng.permutation(np.r_[pool, pool[:3]]) for _ in range(nq)])  # 12 each, repeats
    own = rng.permutation(41)[:nq * 5].reshape(nq, 5)
    calls = []
    real = _cpu.maxsim_packed_numpy
    monkeypatch.setattr(_cpu, "maxsim_packed_numpy", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    if block:
        monkeypatch.setattr(corpus_module, "_RERANK_BLOCK", block)
    for cand, together in ((shared, True), (own, False)):
        want = [corpus.rerank(Q[i:i + 1], cand[i:i + 1], q_lengths=ql[i:i + 1]) for i in range(nq)]
        calls.clear()
        got = corpus.rerank(Q, cand, q_lengths=ql)
        np.testing.assert_array_equal(got, np.concatenate(want))
        if together:
            assert np.isnan(got).any() == (layout == "packed")
            assert set(calls) == {nq} and (len(calls) > 1 if block else len(calls) == 1), calls
        else:
            assert set(calls) == {1} and len(calls) >= nq, calls
    for _ in range(6):  # awkward shapes: few or many queries and tokens, candidates from a small pool
        nq, lq = int(rng.integers(2, 9)), int(rng.integers(1, 20))
        pool = rng.choice(41, int(rng.integers(1, 8)), replace=False)
        k = int(rng.integers(2 * pool.size, 3 * pool.size + 1))
        # each query names the whole pool once, then any of it: the union is never more than the calls
        # per query would score (random picks alone could skip a long document that another query named,
        # and then the queries rightly go one call each: _SHARED_WASTE)
        cand = np.stack([rng.permutation(np.r_[pool, rng.choice(pool, k - pool.size)]) for _ in range(nq)])
        Q = rng.standard_normal((nq, lq, 24)).astype(np.float16 if layout == "packed" else np.float32)
        ql = rng.integers(0, lq + 1, nq)
        want = [corpus.rerank(Q[i:i + 1], cand[i:i + 1], q_lengths=ql[i:i + 1]) for i in range(nq)]
        calls.clear()
        np.testing.assert_array_equal(corpus.rerank(Q, cand, q_lengths=ql), np.concatenate(want))
        assert set(calls) == {nq}, calls


@pytest.mark.parametrize("layout", ["packed", "int8-packed", "padded-mask", "int8-padded"])
def test_rerank_gathers_its_candidates_within_the_rerank_block(rng, layout, monkeypatch):
    """100 candidates of one 100,000-token document once peaked at 2.5 GB (every candidate's tokens
    gathered at once), against 10 MB for score: a query's candidates now go in runs of about
    ``_RERANK_BLOCK`` bytes (packed: a document past it alone read where it lies)."""
    from lik_cupy import corpus as corpus_module
    from test_cpu_exact import _peak as peak

    kw, *_ = corpus_case(rng, layout, nd=23, ld=7, dim=16)
    corpus = lik_cupy.Corpus(**kw, device="cpu")
    Q = rng.standard_normal((3, 5, 16)).astype(np.float32)
    s = corpus.score(Q)
    cand = rng.integers(0, 23, (3, 30))
    monkeypatch.setattr(corpus_module, "_RERANK_BLOCK", 300)  # runs of one to a few documents
    np.testing.assert_array_equal(corpus.rerank(Q, cand), np.take_along_axis(s, cand, 1))

    tokens = rng.standard_normal((20_000, 16)).astype(np.float16)  # 640 KB
    if "packed" in layout:
        long = lik_cupy.Corpus(tokens, d_offsets=np.array([0, 20_000]), device="cpu")
    else:
        long = lik_cupy.Corpus(tokens[None], d_mask=np.ones((1, 20_000), bool), device="cpu")
    monkeypatch.setattr(corpus_module, "_RERANK_BLOCK", 1 << 20)
    q = Q[:1].astype(np.float16)
    long.rerank(q, np.zeros((1, 1), np.int64))  # (NumPy's lazy imports and the chunk threads' pool, once)
    one = peak(lambda: long.rerank(q, np.zeros((1, 1), np.int64)))
    many = peak(lambda: long.rerank(q, np.zeros((1, 40), np.int64)))  # 40 copies: 25.6 MB gathered at once
    assert many < one + (1 << 20), (many, one)


def test_a_host_corpus_checks_precision_and_takes_empty_ids():
    c = lik_cupy.Corpus(np.ones((3, 2, 4), np.float32), device="cpu")
    q = np.ones((1, 2, 4), np.float32)
    for call in (lambda: c.score(q, precision="bogus"), lambda: c.search(q, 2, precision="bogus"),
                 lambda: c.rerank(q, [[0, 1]], precision="bogus")):
        with pytest.raises(ValueError, match="precision must be one of 'fp32', 'tf32', got 'bogus'"):
            call()
    empty = lik_cupy.Corpus(np.zeros((0, 2, 4), np.float32), ids=[], device="cpu")
    assert len(empty) == 0 and empty.score(q).shape == (1, 0)


def test_a_precision_of_no_string_value_is_named_by_every_call():
    # With torch queries a call's signature holds its options; a list (unhashable) raised "unhashable type:
    # 'list'" from the corpus's own repeat-call lookup, for score and search (float16: nothing resolves the
    # precision before the lookup). Every call now names the argument.
    torch = pytest.importorskip("torch")
    c = lik_cupy.Corpus(np.ones((3, 2, 4), np.float16), device="cpu")
    q = torch.ones(1, 2, 4, dtype=torch.float16)
    for call in (lambda: c.score(q, precision=["fp32"]), lambda: c.search(q, 2, precision=["fp32"]),
                 lambda: c.rerank(q, [[0, 1]], precision=["fp32"])):
        with pytest.raises(ValueError, match=re.escape("precision must be one of 'fp32', 'tf32', got ['fp32']")):
            call()


def test_the_repeat_path_cache_replaces_a_kept_signature_in_place(rng):
    """Corpus._keep: at the bound (corpus._MAX_CALLS) a new signature evicts the oldest kept; one kept
    already (made again after its prepared call went stale, or a search that fell back to streaming
    on a MemoryError) is replaced, and evicts nothing."""
    from lik_cupy import corpus as corpus_module

    kw, *_ = corpus_case(rng, "packed")
    corpus = lik_cupy.Corpus(**kw, device="cpu")
    n = corpus_module._MAX_CALLS
    for i in range(n):
        corpus._keep(("key", i), f"call {i}")
    corpus._keep(("key", 5), "call 5 again")
    assert len(corpus._calls) == n and ("key", 0) in corpus._calls
    corpus._keep(("key", 0), "call 0 again")  # the oldest, kept: replaced, not evicted
    assert len(corpus._calls) == n and set(corpus._calls) == {("key", i) for i in range(n)}
    assert corpus._calls[("key", 5)] == "call 5 again" and corpus._calls[("key", 0)] == "call 0 again"
    corpus._keep(("key", n), f"call {n}")  # a new one: the oldest stored goes
    assert len(corpus._calls) == n and ("key", 0) not in corpus._calls and corpus._calls[("key", n)] == f"call {n}"
    corpus._keep(("key", n + 1), None)  # no prepared call: nothing kept, nothing evicted
    assert len(corpus._calls) == n and ("key", 1) in corpus._calls
