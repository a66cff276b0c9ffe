"""The device-value contract (docs/api.md, Semantics: "Invalid device values"): invalid device lengths,
offsets and document scales make exactly the scores they touch NaN, with no host synchronisation;
strict mode raises; every other score is bitwise what valid inputs give. And the repeat-call path
(``lik_cupy._runtime.prepared_calls``): a repeat call gives what the first gave. Skipped without a GPU.
"""

import sys

import numpy as np
import pytest

import lik_cupy
from test_forward_gpu import _np, _unit
from threads import run_threads

pytestmark = pytest.mark.gpu


def _conv(framework):
    if framework == "torch":
        torch = pytest.importorskip("torch")
        return lambda a: torch.as_tensor(np.ascontiguousarray(a), device="cuda")
    import cupy

    return cupy.asarray


def _expect(scores_ok, amax_ok, bad_cells, scores, amax=None):
    """NaN exactly in ``bad_cells`` (bool, scores' shape), and elsewhere bitwise the valid call's
    results; -1 argmax rows in the bad cells."""
    s = _np(scores)
    assert np.array_equal(np.isnan(s), bad_cells), (np.argwhere(np.isnan(s) != bad_cells)[:5])
    assert np.array_equal(s[~bad_cells], _np(scores_ok)[~bad_cells])
    if amax is not None:
        a = _np(amax)
        assert (a[bad_cells] == -1).all()
        assert np.array_equal(a[~bad_cells], _np(amax_ok)[~bad_cells])


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("ldtype", [np.int32, np.int64])
def test_padded_lengths(rng, framework, ldtype):
    conv = _conv(framework)
    nq, lq, nd, ld, dim = 5, 9, 37, 23, 64
    q = conv(_unit(rng, nq, lq, dim).astype(np.float16))
    d = conv(_unit(rng, nd, ld, dim).astype(np.float16))
    ql = rng.integers(0, lq + 1, nq).astype(ldtype)
    dl = rng.integers(0, ld + 1, nd).astype(ldtype)
    ok, ok_a = lik_cupy.maxsim(q, d, q_lengths=conv(ql), d_lengths=conv(dl), return_argmax=True)
    qb, db = ql.copy(), dl.copy()
    qb[1], db[[0, 17, 36]] = lq + 1, [-1, ld + 1, np.iinfo(ldtype).min]
    for _ in range(2):  # the first call and the repeat path
        s, a = lik_cupy.maxsim(q, d, q_lengths=conv(qb), d_lengths=conv(db), return_argmax=True)
        bad = np.zeros((nq, nd), bool)
        bad[1, :] = True
        bad[:, [0, 17, 36]] = True
        _expect(ok, ok_a, bad, s, a)
    with pytest.raises(ValueError, match="q_lengths"):
        lik_cupy.maxsim(q, d, q_lengths=conv(qb), d_lengths=conv(db), validate=True)
    # validate=False: no check, no marking; nothing is read out of bounds and valid cells are unchanged
    s = _np(lik_cupy.maxsim(q, d, q_lengths=conv(qb), d_lengths=conv(db), validate=False))
    keep = np.ones((nq, nd), bool)
    keep[1, :] = False
    keep[:, [0, 17, 36]] = False
    assert np.array_equal(s[keep], _np(ok)[keep])


def test_candidates_and_pairs_mark_single_cells(rng):
    import cupy

    nq, k, lq, ld, dim = 4, 6, 8, 19, 128
    q = cupy.asarray(_unit(rng, nq, lq, dim).astype(np.float16))
    d = cupy.asarray(_unit(rng, nq, k, ld, dim).astype(np.float16))
    dl = rng.integers(0, ld + 1, (nq, k)).astype(np.int64)
    ok, ok_a = lik_cupy.maxsim(q, d, d_lengths=cupy.asarray(dl), return_argmax=True)
    dl[2, 3] = -5
    s, a = lik_cupy.maxsim(q, d, d_lengths=cupy.asarray(dl), return_argmax=True)
    bad = np.zeros((nq, k), bool)
    bad[2, 3] = True
    _expect(ok, ok_a, bad, s, a)
    dp = cupy.ascontiguousarray(d[:, 0])
    pl = rng.integers(0, ld + 1, nq).astype(np.int32)
    ok = lik_cupy.maxsim_pairs(q, dp, d_lengths=cupy.asarray(pl))
    pl[0] = ld + 1
    _expect(ok, None, np.array([True, False, False, False]), lik_cupy.maxsim_pairs(q, dp, d_lengths=cupy.asarray(pl)))


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("odtype", [np.int32, np.int64])
def test_packed_offsets(rng, framework, odtype):
    conv = _conv(framework)
    nq, lq, dim = 3, 7, 96
    lens = rng.integers(0, 40, 50)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(odtype)
    T = int(off[-1])
    q = conv(_unit(rng, nq, lq, dim).astype(np.float16))
    tok = conv(_unit(rng, T, dim).astype(np.float16))
    ok, ok_a = lik_cupy.maxsim_varlen(q, tok, conv(off), return_argmax=True)
    for k, v in ((10, -1), (30, T + 5)):  # documents k - 1 and k: negative / decreasing, past T / decreasing
        b = off.copy()
        b[k] = v
        s, a = lik_cupy.maxsim_varlen(q, tok, conv(b), return_argmax=True)
        bad = np.zeros((nq, 50), bool)
        bad[:, [k - 1, k]] = True
        _expect(ok, ok_a, bad, s, a)
    for whole in ([1] + list(off[1:]), list(off[:-1]) + [T - 1]):  # not from 0, or not to T: all NaN
        s = lik_cupy.maxsim_varlen(q, tok, conv(np.array(whole, odtype)))
        assert np.isnan(_np(s)).all()


def test_int8_negative_document_scale_and_lengths(rng):
    import cupy

    nq, lq, nd, ld, dim = 3, 16, 20, 24, 128
    q = cupy.asarray(_unit(rng, nq, lq, dim).astype(np.float16))
    d = _unit(rng, nd, ld, dim).astype(np.float32)
    d8, sc = lik_cupy.quantize_int8(cupy.asarray(d))
    lengths = rng.integers(1, ld + 1, nd).astype(np.int32)
    lengths[6] = min(lengths[6], ld - 1)  # document 6 has padding (at full length its last token is valid)
    dl = cupy.asarray(lengths)
    ok, ok_a = lik_cupy.maxsim_int8(q, d8, sc, d_lengths=dl, return_argmax=True)
    sc2 = sc.copy()
    sc2[4, 0] = -1.0  # a valid token of document 4
    sc2[6, ld - 1] = -1.0  # a padding token: no effect
    dl2 = dl.copy()
    dl2[11] = ld + 3
    s, a = lik_cupy.maxsim_int8(q, d8, sc2, d_lengths=dl2, return_argmax=True)
    bad = np.zeros((nq, nd), bool)
    bad[:, [4, 11]] = True
    _expect(ok, ok_a, bad, s, a)
    # packed
    lens = _np(dl)
    off = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    tok8 = cupy.concatenate([d8[j, :lens[j]] for j in range(nd)])
    tsc = cupy.concatenate([sc[j, :lens[j]] for j in range(nd)])
    ok = lik_cupy.maxsim_int8_varlen(q, tok8, tsc, off)
    tsc[int(off[7]) + 1 if lens[7] > 1 else int(off[7])] = float("nan")
    bad = np.zeros((nq, nd), bool)
    bad[:, 7] = True
    _expect(ok, None, bad, lik_cupy.maxsim_int8_varlen(q, tok8, tsc, off))


def test_marking_is_captured_in_cuda_graphs_and_reads_each_replays_values(rng):
    torch = pytest.importorskip("torch")
    nq, lq, nd, ld, dim = 2, 8, 30, 16, 64
    q = torch.randn(nq, lq, dim, device="cuda", dtype=torch.float16)
    d = torch.randn(nd, ld, dim, device="cuda", dtype=torch.float16)
    dl = torch.full((nd,), ld, device="cuda", dtype=torch.int64)
    lik_cupy.maxsim(q, d, d_lengths=dl)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        lik_cupy.maxsim(q, d, d_lengths=dl)
        with torch.cuda.graph(g, stream=s):
            out = lik_cupy.maxsim(q, d, d_lengths=dl)
    g.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    dl[5] = ld + 1
    g.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[:, 5]).all() and torch.isfinite(out[:, :5]).all() and torch.isfinite(out[:, 6:]).all()


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_repeat_calls_match_the_first_and_follow_changed_arguments(rng, framework):
    from lik_cupy._runtime import prepared_calls

    conv = _conv(framework)
    prepared_calls.clear()
    nq, lq, nd, ld, dim = 3, 32, 100, 48, 128
    q = conv(_unit(rng, nq, lq, dim).astype(np.float16))
    d = conv(_unit(rng, nd, ld, dim).astype(np.float16))
    mask = conv(rng.random((nd, ld)) < 0.8)
    first = [_np(x) for x in lik_cupy.maxsim(q, d, d_mask=mask, return_argmax=True)]
    assert len(prepared_calls._calls) == 1
    for _ in range(3):
        again = [_np(x) for x in lik_cupy.maxsim(q, d, d_mask=mask, return_argmax=True)]
        assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert len(prepared_calls._calls) == 1
    # new data in the same buffers is read afresh; a different shape is a new signature
    q2 = conv(_unit(rng, nq, lq, dim).astype(np.float16))
    ref = _np(lik_cupy.maxsim(q2, d, d_mask=mask, backend="gpu", validate=True))  # strict: the general path
    assert np.array_equal(_np(lik_cupy.maxsim(q2, d, d_mask=mask)), ref)
    assert len(prepared_calls._calls) == 2  # return_argmax=False: a signature of its own
    lik_cupy.maxsim(q2[:2], d, d_mask=mask)
    assert len(prepared_calls._calls) == 3
    # a misaligned view (another signature) is scored right too
    flat = conv(np.zeros(nq * lq * dim + 4, np.float16))
    view = flat[4:].reshape(nq, lq, dim)
    view[...] = q
    assert np.array_equal(_np(lik_cupy.maxsim(view, d, d_mask=mask)), first[0])


def test_repeat_calls_from_many_threads(rng):
    import cupy

    nq, lq, nd, ld, dim = 2, 32, 300, 64, 128
    qs = [cupy.asarray(_unit(rng, nq, lq, dim).astype(np.float16)) for _ in range(8)]
    d = cupy.asarray(_unit(rng, nd, ld, dim).astype(np.float16))
    want = [_np(lik_cupy.maxsim(q, d, validate=True)) for q in qs]

    def work(i):
        with cupy.cuda.Stream(non_blocking=True) as s:
            for _ in range(50):
                got = lik_cupy.maxsim(qs[i], d)
            s.synchronize()
            assert np.array_equal(_np(got), want[i])

    run_threads(8, work)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("corpus", ["device", "host", "Corpus"])
def test_retrieve_and_search_rank_an_invalid_query_last(rng, monkeypatch, framework, corpus):
    """retrieve and Corpus.search: a device query length outside [0, Lq] makes that query's every
    score NaN (its top-k: NaN scores, the lowest indices) with no host wait; the other queries
    rank as with valid lengths; strict mode raises."""
    conv = _conv(framework)
    nq, lq, nd, ld, dim, k = 4, 11, 300, 19, 32, 7
    q = conv(_unit(rng, nq, lq, dim).astype(np.float16))
    dn = _unit(rng, nd, ld, dim).astype(np.float16)
    d = conv(dn) if corpus == "device" else dn
    good = rng.integers(1, lq + 1, nq)
    bad = good.copy()
    bad[2] = lq + 1

    def top(lengths):
        if corpus == "Corpus":
            return lik_cupy.Corpus(d).search(q, k, q_lengths=conv(lengths))
        return lik_cupy.retrieve(q, d, k, q_lengths=conv(lengths))

    ok_s, ok_i = (_np(x) for x in top(good))
    s, i = (_np(x) for x in top(bad))
    assert np.isnan(s[2]).all() and np.array_equal(i[2], np.arange(k))
    keep = np.arange(nq) != 2
    assert np.array_equal(s[keep], ok_s[keep]) and np.array_equal(i[keep], ok_i[keep])
    monkeypatch.setenv("LIK_VALIDATE", "1")
    with pytest.raises(ValueError, match=rf"q_lengths holds {lq + 1}"):
        top(bad)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_retrieve_ranks_invalid_device_documents_last(rng, monkeypatch, layout, chunks):
    """retrieve over a device corpus: a document whose length is outside [0, Ld], or whose offsets
    are negative, decrease or pass T, scores NaN for every query and ranks last, with no host
    wait; offsets that do not run from 0 to T make every score NaN; every chunk of the corpus
    (``max_gpu_bytes`` cuts it in several) marks its own documents. Strict mode raises."""
    import cupy

    nq, lq, nd, ld, dim = 3, 9, 240, 17, 32
    q = cupy.asarray(_unit(rng, nq, lq, dim).astype(np.float16))
    dn = _unit(rng, nd, ld, dim).astype(np.float16)
    lens = rng.integers(1, ld + 1, nd)
    monkeypatch.setattr(sys.modules["lik_cupy._streaming.gpu"], "MAX_CHUNK_DOCS", -(-nd // chunks))
    bad_docs = [5, 77, 200]
    tok = cupy.asarray(np.concatenate([dn[j, :lens[j]] for j in range(nd)]))

    def top(lengths=None, offsets=None):
        if layout == "padded":
            return lik_cupy.retrieve(q, cupy.asarray(dn), nd, d_lengths=cupy.asarray(lengths))
        return lik_cupy.retrieve(q, tok, nd, d_offsets=cupy.asarray(offsets))

    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    ok_s, ok_i = (_np(x) for x in top(lens, off))
    if layout == "padded":
        bad = lens.copy()
        bad[bad_docs] = [-1, ld + 1, ld + 5]
        s, i = (_np(x) for x in top(bad))
    else:
        bad = off.copy()
        bad[78] = off[-1] + 5  # documents 77 (its end past T) and 78 (its start past its end)
        bad[5] = -3  # documents 4 (its end before its start) and 5 (a negative start)
        s, i = (_np(x) for x in top(offsets=bad))
        bad_docs = [4, 5, 77, 78]
    # every query: the bad documents NaN, ranked after every other document, the rest as before
    for r in range(nq):
        nan = np.isnan(s[r])
        assert sorted(i[r][nan].tolist()) == sorted(bad_docs)
        assert not nan[: nd - len(bad_docs)].any()
        keep = ~np.isin(ok_i[r], bad_docs)
        assert np.array_equal(i[r][~nan], ok_i[r][keep]) and np.array_equal(s[r][~nan], ok_s[r][keep])
    if layout == "packed":  # offsets that end short of T: every score NaN
        short = off.copy()
        short[-1] -= 1
        s, _ = top(offsets=short)
        assert np.isnan(_np(s)).all()
    monkeypatch.setenv("LIK_VALIDATE", "1")
    with pytest.raises(ValueError, match="d_lengths" if layout == "padded" else "d_offsets"):
        top(bad) if layout == "padded" else top(offsets=bad)


def test_int8_infinite_document_scale_is_invalid_and_a_device_corpus_refuses_bad_scales(rng):
    import cupy

    nq, lq, nd, ld, dim = 2, 8, 6, 16, 128
    q = cupy.asarray(_unit(rng, nq, lq, dim).astype(np.float16))
    d8, sc = lik_cupy.quantize_int8(cupy.asarray(_unit(rng, nd, ld, dim).astype(np.float32)))
    ok, ok_a = lik_cupy.maxsim_int8(q, d8, sc, return_argmax=True)
    sc2 = sc.copy()
    sc2[3, 2] = float("inf")
    s, a = lik_cupy.maxsim_int8(q, d8, sc2, return_argmax=True)
    bad = np.zeros((nq, nd), bool)
    bad[:, 3] = True
    _expect(ok, ok_a, bad, s, a)
    for v in (-1.0, float("nan"), float("inf")):
        sc2[3, 2] = v
        with pytest.raises(ValueError, match=r"d_scales\[3, 2\] is"):
            lik_cupy.Corpus(d8, d_scales=sc2)
    mask = cupy.ones((nd, ld), bool)
    mask[3, 2] = False  # the same scale in padding is never read
    lik_cupy.Corpus(d8, d_mask=mask, d_scales=sc2)
