"""INT8 corpora in retrieve on the CPU path: layouts, query dtypes, NaN, argument checks (run in CI)."""

import ml_dtypes
import numpy as np
import pytest

import lik_cupy
from lik_cupy import _cpu as cpu
from lik_cupy._cpu import quantize_numpy


def _ragged(rng, nd, lo, hi, empty_frac=0.2):
    lens = rng.integers(lo, hi + 1, size=nd)
    lens[rng.random(nd) < empty_frac] = 0
    return lens


def _pad(tokens, lens):
    """Packed [T, ...] -> padded [Nd, Lmax, ...] (zeros past each length) and the validity mask."""
    lmax = max(1, int(lens.max()) if lens.size else 1)
    out = np.zeros((lens.size, lmax) + tokens.shape[1:], tokens.dtype)
    valid = np.arange(lmax)[None, :] < lens[:, None]
    out[valid] = tokens
    return out, valid


def _ref(q8, qs, qv, d8, ds, dv):
    """float64 MaxSim of the dequantized queries [Nq, Lq, d] and padded documents [Nd, Ld, d].

    Returns the scores [Nq, Nd] and the sum of |terms| behind each: the library rounds each
    term to float32 a few times, so its error is bounded by a few ulp of that sum."""
    q = q8.astype(np.float64) * qs[..., None]
    d = d8.astype(np.float64) * ds[..., None]
    sim = np.einsum("isk,jtk->ijst", q, d)
    sim = np.where(dv[None, :, None, :], sim, -np.inf)
    best = sim.max(axis=3) if sim.shape[3] else np.full(sim.shape[:3], -np.inf)
    best = np.where(qv[:, None, :], best, 0.0)
    with np.errstate(invalid="ignore"):
        return best.sum(axis=2), np.abs(np.where(np.isfinite(best), best, 0)).sum(axis=2)


def _close(out, ref, mag):
    out = np.asarray(out, np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(out), fin) and np.array_equal(out[~fin], ref[~fin])
    assert np.all(np.abs(out[fin] - ref[fin]) <= 1e-6 * mag[fin] + 1e-30), np.max(np.abs(out[fin] - ref[fin]))


def _ranked(scores, k):
    """The library's order: score descending, NaN last, lower index first."""
    idx = np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
    nan = np.isnan(scores)
    order = np.lexsort((idx, -np.where(nan, 0, scores), nan), axis=1)[:, :k]
    return np.take_along_axis(scores, order, 1), order


def _corpus(rng, nd=157, dim=40, lo=0, hi=37):
    """A ragged INT8 corpus: float tokens quantized per token; lengths with empty documents."""
    lens = _ragged(rng, nd, lo, hi)
    lens[nd // 3] = 0  # at least one empty document
    off = np.concatenate([[0], np.cumsum(lens)])
    tok8, tscale = quantize_numpy(rng.standard_normal((int(off[-1]), dim)).astype(np.float32))
    return tok8, tscale, off, lens


@pytest.mark.parametrize("qdtype", ["float16", "bfloat16", "float32", "int8"])
def test_retrieve_int8_layouts_vs_float64(rng, qdtype):
    nq, lq, dim, k = 5, 9, 40, 23
    tok8, tscale, off, lens = _corpus(rng, dim=dim)
    q = rng.standard_normal((nq, lq, dim)).astype(np.float32)
    q = q.astype(ml_dtypes.bfloat16 if qdtype == "bfloat16" else qdtype if qdtype != "int8" else np.float32)
    q8, qs = quantize_numpy(q)  # what retrieve must quantize a float Q to
    extra = {}
    if qdtype == "int8":
        q, extra = q8, {"q_scales": qs}
    qmask = rng.random((nq, lq)) < 0.8
    qmask[3] = False  # a query with no valid token scores 0 everywhere
    d8, dv = _pad(tok8, lens)
    ds, _ = _pad(tscale, lens)
    ref, mag = _ref(q8, qs, qmask, d8, ds, dv)

    got = {
        "packed": lik_cupy.retrieve(q, tok8, k, qmask, d_offsets=off, d_scales=tscale, backend="cpu", **extra),
        "mask": lik_cupy.retrieve(q, d8, k, qmask, d_mask=dv, d_scales=ds, backend="cpu", **extra),
        "lengths": lik_cupy.retrieve(q, d8, k, qmask, d_lengths=lens, d_scales=ds, backend="cpu", **extra),
        "shards": lik_cupy.retrieve(q, [(tok8[: off[60]], off[:61], tscale[: off[60]]),
                                        (tok8[off[60]:], off[60:] - off[60], tscale[off[60]:])], k, qmask,
                                    backend="cpu", **extra),
    }
    full = lik_cupy.maxsim_int8_varlen(q, tok8, tscale, off, qmask, backend="cpu", **extra)
    _close(full, ref, mag)
    want_s, want_i = _ranked(full, k)
    for name, (s, i) in got.items():
        assert s.dtype == np.float32 and i.dtype == np.int64 and s.shape == (nq, k), name
        # Same arithmetic as the full matrix whatever the chunking: the same ranking, bit for bit.
        np.testing.assert_array_equal(i, want_i, err_msg=name)
        np.testing.assert_array_equal(s, want_s, err_msg=name)
        _close(s, np.take_along_axis(ref, i, 1), np.take_along_axis(mag, i, 1))
    assert np.all(got["packed"][0][3] == 0) and got["packed"][1][3].tolist() == list(range(k))


def test_retrieve_int8_padded_shards_and_generator(rng):
    # Padded INT8 shards (docs, scales) have every row valid; indices run on across shards.
    nq, lq, dim, k = 3, 6, 24, 12
    a8, a_s = quantize_numpy(rng.standard_normal((30, 11, dim)).astype(np.float32))
    b8, b_s = quantize_numpy(rng.standard_normal((17, 5, dim)).astype(np.float32))
    q = rng.standard_normal((nq, lq, dim)).astype(np.float16)
    q8, qs = quantize_numpy(q)
    qv = np.ones((nq, lq), bool)
    ra, ma = _ref(q8, qs, qv, a8, a_s, np.ones((30, 11), bool))
    rb, mb = _ref(q8, qs, qv, b8, b_s, np.ones((17, 5), bool))
    ref, mag = np.concatenate([ra, rb], 1), np.concatenate([ma, mb], 1)
    for corpus in ([(a8, a_s), (b8, b_s)], iter([(a8, a_s), (b8[:0], b_s[:0]), (b8, b_s)])):
        s, i = lik_cupy.retrieve(q, corpus, k, backend="cpu")
        want = np.sort(ref, axis=1)[:, ::-1][:, :k]
        _close(s, want, np.take_along_axis(mag, i, 1))
        _close(s, np.take_along_axis(ref, i, 1), np.take_along_axis(mag, i, 1))
    s1, i1 = lik_cupy.retrieve(q[0], [(a8, a_s), (b8, b_s)], 4, backend="cpu")  # 2-D Q: 1-D results
    assert s1.shape == (4,) and i1.tolist() == i[0, :4].tolist()


def test_retrieve_int8_nan_query_tokens(rng):
    tok8, tscale, off, lens = _corpus(rng, nd=40, dim=16)
    q = rng.standard_normal((3, 5, 16)).astype(np.float32)
    qmask = np.ones((3, 5), bool)
    qmask[2, 4] = False
    clean_s, clean_i = lik_cupy.retrieve(q, tok8, 40, qmask, d_offsets=off, d_scales=tscale, backend="cpu")
    q[1, 2, 7] = np.nan  # valid token: query 1 scores NaN against every non-empty document (as on the device)
    q[2, 4, :] = np.inf  # masked token: ignored
    s, i = lik_cupy.retrieve(q, tok8, 40, qmask, d_offsets=off, d_scales=tscale, backend="cpu")
    empty = np.flatnonzero(lens == 0)
    assert empty.size and (lens > 0).any()
    # Empty documents have no similarity to be NaN: -inf, ranked before NaN; each group by index.
    assert i[1].tolist() == empty.tolist() + np.flatnonzero(lens > 0).tolist()
    assert np.all(s[1, : empty.size] == -np.inf) and np.isnan(s[1, empty.size :]).all()
    np.testing.assert_array_equal(s[[0, 2]], clean_s[[0, 2]])
    np.testing.assert_array_equal(i[[0, 2]], clean_i[[0, 2]])
    assert np.all(s[0, lens[i[0]] == 0] == -np.inf)  # empty documents score -inf


def test_mixed_corpus_is_refused_before_scoring(rng, monkeypatch):
    tok8, tscale, off, _ = _corpus(rng, nd=20, dim=16)
    ftok = rng.standard_normal((int(off[-1]), 16)).astype(np.float16)
    q = rng.standard_normal((2, 3, 16)).astype(np.float16)
    calls = []
    real = cpu.maxsim_packed_numpy
    monkeypatch.setattr(cpu, "maxsim_packed_numpy", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with pytest.raises(TypeError, match=r"^shard 1 has dtype float16 but earlier shards are int8: a corpus is all INT8 or all float"):
        lik_cupy.retrieve(q, [(tok8, off, tscale), (ftok, off)], 3, backend="cpu")
    assert calls == []  # a list is checked whole before any shard is scored
    with pytest.raises(TypeError, match=r"^shard 2 has dtype int8 but earlier shards are float16"):
        lik_cupy.retrieve(q, iter([(ftok, off), (ftok, off), (tok8, off, tscale)]), 3, backend="cpu")


def _int8_args():
    rng = np.random.default_rng(0)
    d8, ds = quantize_numpy(rng.standard_normal((6, 4, 16)).astype(np.float32))
    t8, ts = d8.reshape(24, 16), ds.reshape(24)
    return d8, ds, t8, ts


@pytest.mark.parametrize(
    "kwargs,err,msg",
    [
        (dict(D="d8"), TypeError, r"the corpus is int8 but has no scales: pass d_scales"),
        (dict(D="f16", d_scales="ds"), TypeError, r"d_scales go with int8 tokens, but the corpus has dtype float16"),
        (dict(d_scales="ts"), ValueError, r"d_scales has shape \[24\]; expected \[6, 4\]"),
        (dict(d_scales="ds64"), TypeError, "d_scales has dtype float64; expected float32"),
        (dict(D="t8", d_offsets=np.array([0, 10, 24]), d_scales="ds"), ValueError, r"d_scales has shape \[6, 4\]; expected \[24\]"),
        (dict(D="t8", d_offsets=np.array([0, 10, 23]), d_scales="ts"), ValueError, "ends at 23 but there are 24"),
        (dict(D="d8", d_scales="ds", d_lengths=[1, 2, 3, 4, 5, 6]), ValueError, r"every length must be in \[0, 4\]"),
        (dict(D=["shard"], d_scales="ds"), TypeError, "d_scales go with a single array D"),
        (dict(D=["packed_no_scales"]), TypeError, "shard 0 is int8 but has no scales"),
        (dict(D=["bad_scales"]), ValueError, r"shard 0 scales has shape \[23\]; expected \[24\]"),
        (dict(D=[("t8", np.array([0, 24]), "ts", "ts")]), TypeError, "shard 0 must be a padded array"),
        (dict(Q="q8"), TypeError, "Q is int8 but q_scales is missing"),
        (dict(Q="q8", q_scales="qs_shape"), ValueError, r"q_scales has shape \[3\]; expected \[2, 3\]"),
        (dict(Q="q8", q_scales="qs", D="f16"), TypeError, "Q is int8 but the corpus has dtype float16: int8 queries score INT8 corpora only"),
        (dict(q_scales="qs"), ValueError, "q_scales goes with an int8 Q, but Q is float16"),
        (dict(Q="q32"), TypeError, "Q has dtype int32"),
        (dict(Q="q_dim"), ValueError, "corpus has dim 16 but Q has dim 8"),
    ],
)
def test_retrieve_int8_argument_errors(kwargs, err, msg):
    d8, ds, t8, ts = _int8_args()
    q = np.zeros((2, 3, 16), np.float16)
    q8, qs = quantize_numpy(q.astype(np.float32))
    named = {
        "d8": d8, "ds": ds, "t8": t8, "ts": ts, "ds64": ds.astype(np.float64), "f16": d8.astype(np.float16),
        "shard": (d8, ds), "packed_no_scales": (t8, np.array([0, 24])), "bad_scales": (t8, np.array([0, 24]), ts[:-1]),
        "q8": q8, "qs": qs, "qs_shape": qs[0], "qs_neg": -np.ones_like(qs), "q32": q.astype(np.int32),
        "q_dim": np.zeros((2, 3, 8), np.float16),
    }

    def resolve(v):
        if isinstance(v, str):
            return named[v]
        if isinstance(v, (list, tuple)):
            return type(v)(resolve(x) for x in v)
        return v

    args = {"Q": q, "D": d8} if "D" in kwargs else {"Q": q, "D": d8, "d_scales": ds}  # a D given brings its own
    args.update({key: resolve(v) for key, v in kwargs.items()})
    with pytest.raises(err, match=msg):
        lik_cupy.retrieve(args.pop("Q"), args.pop("D"), 2, backend="cpu", **args)


def test_retrieve_negative_query_scale_scores_nan_like_maxsim_int8(rng):
    # a query scale multiplies a max, so a negative one cannot be honoured: NaN scores (ranked
    # last), as maxsim_int8 gives, never a silently wrong ranking
    t8, ts = quantize_numpy(rng.standard_normal((40, 32)).astype(np.float32))
    off = np.array([0, 9, 25, 40])
    q8, qs = quantize_numpy(rng.standard_normal((2, 5, 32)).astype(np.float32))
    qs[1, 2] = -1.0
    s, _ = lik_cupy.retrieve(q8, t8, 3, q_scales=qs, d_offsets=off, d_scales=ts, backend="cpu")
    want = lik_cupy.maxsim_int8_varlen(q8, t8, ts, off, q_scales=qs, backend="cpu")
    assert np.all(np.isnan(s[1])) and np.all(np.isnan(want[1])) and np.all(np.isfinite(s[0]))


def _int8_docs(rng, nd=5, ld=6, dim=16):
    d8, ds = quantize_numpy(rng.standard_normal((nd, ld, dim)).astype(np.float32))
    return d8, ds


@pytest.mark.parametrize("bad", [-0.5, np.nan, np.inf])
def test_host_document_scales_are_checked_on_every_path(rng, bad):
    """A negative, NaN or infinite scale of a valid token raises (a negative one once ranked its document
    first); the same scale in padding is never read."""
    Q = rng.standard_normal((2, 3, 16)).astype(np.float32)
    d8, ds = _int8_docs(rng)
    lens = np.array([6, 6, 4, 6, 6])
    ds[2, 1] = bad
    packed, pscales = d8[np.arange(6)[None] < lens[:, None]], ds[np.arange(6)[None] < lens[:, None]]
    off = np.concatenate([[0], np.cumsum(lens)])
    calls = {
        "maxsim_int8": lambda: lik_cupy.maxsim_int8(Q, d8, ds, backend="cpu"),
        "maxsim_int8 lengths": lambda: lik_cupy.maxsim_int8(Q, d8, ds, d_lengths=lens, backend="cpu"),
        "maxsim_int8_varlen": lambda: lik_cupy.maxsim_int8_varlen(Q, packed, pscales, off, backend="cpu"),
        "retrieve": lambda: lik_cupy.retrieve(Q, d8, 2, d_scales=ds, backend="cpu"),
        "retrieve shards": lambda: lik_cupy.retrieve(Q, [(packed, off, pscales)], 2, backend="cpu"),
        "Corpus": lambda: lik_cupy.Corpus(d8, d_scales=ds, device="cpu"),
        "Corpus packed": lambda: lik_cupy.Corpus(packed, d_offsets=off, d_scales=pscales, device="cpu"),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"scales(\[| 0 scales\[)[0-9, ]+\] is .*finite and >= 0"):
            call()
            pytest.fail(f"{name} accepted a scale of {bad}")
    # in padding (document 2 has 4 valid tokens), the scale is never read: scores as with a good one
    ds[2, 5], ds[2, 1] = bad, ds[2, 0]
    ref = lik_cupy.maxsim_int8(Q, d8, np.where(np.isfinite(ds) & (ds >= 0), ds, 1), d_lengths=lens, backend="cpu")
    np.testing.assert_array_equal(lik_cupy.maxsim_int8(Q, d8, ds, d_lengths=lens, backend="cpu"), ref)
    corpus = lik_cupy.Corpus(d8, d_lengths=lens, d_scales=ds, device="cpu")
    np.testing.assert_array_equal(corpus.score(Q), ref)


def test_auto_keeps_a_host_int8_corpus_the_gpu_cannot_take_on_the_cpu(rng, monkeypatch):
    """On a GPU host, ``backend="auto"`` scores float host queries against a host INT8 corpus on the
    CPU where the GPU's INT8 kernels lack its dim (as it does for int8 queries, and as maxsim_int8
    does): the corpus's element type decides, not the float queries'."""
    from lik_cupy._base.device import DeviceProps
    from lik_cupy._dispatch import backend

    monkeypatch.setattr(backend, "gpu_available", lambda: True)
    monkeypatch.setattr(backend, "_current_device", lambda: 0)
    monkeypatch.setattr(backend, "device_properties", lambda d: DeviceProps("NVIDIA H200", 90, 132))
    q = rng.standard_normal((2, 3, 8)).astype(np.float32)  # d = 8: float kernels take it, INT8 ones do not
    d8, ds = quantize_numpy(rng.standard_normal((5, 4, 8)).astype(np.float32))
    want = lik_cupy.retrieve(q, d8, 3, d_scales=ds, backend="cpu")
    for got in (lik_cupy.retrieve(q, d8, 3, d_scales=ds), lik_cupy.retrieve(q, [(d8[:2], ds[:2]), (d8[2:], ds[2:])], 3)):
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    with pytest.raises(ValueError, match=r"int8 scoring on the GPU needs dim a multiple of 16 .*; got dim 8"):
        lik_cupy.retrieve(q, d8, 3, d_scales=ds, backend="gpu")
