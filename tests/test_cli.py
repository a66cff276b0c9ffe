"""End-to-end tests of the ``lik`` command line (cli.py), CPU only.

Every ranking is checked against a float64 NumPy MaxSim reference computed here.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import cli

REPO = pathlib.Path(__file__).resolve().parents[1]

NQ, LQ, DIM = 3, 7, 20
SHARDS = ((11, 9), (6, 5))  # (docs, padded length) per shard


# --------------------------------------------------------------------------- helpers


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click 8.1
    except TypeError:
        return CliRunner()  # click >= 8.2 keeps stderr apart by default


def run(*args, **kw):
    return _runner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False, **kw)


def ref_scores(Q, shards, q_len=None, d_lens=None):
    """float64 MaxSim reference: [Nq, total docs]."""
    Q = np.asarray(Q, np.float64)
    nq, lq, _ = Q.shape
    qmask = np.ones((nq, lq), bool) if q_len is None else np.arange(lq)[None] < np.asarray(q_len)[:, None]
    cols = []
    for i, D in enumerate(shards):
        D = np.asarray(D, np.float64)
        n, ld, _ = D.shape
        dl = None if d_lens is None else d_lens[i]
        dmask = np.ones((n, ld), bool) if dl is None else np.arange(ld)[None] < np.asarray(dl)[:, None]
        sim = np.einsum("qsd,ntd->qnst", Q, D)
        sim = np.where(dmask[None, :, None, :], sim, -np.inf)
        best = sim.max(axis=-1)
        best = np.where(qmask[:, None, :], best, 0.0)
        cols.append(best.sum(axis=-1))
    return np.concatenate(cols, axis=1)


def ref_ranking(S, k):
    """Best first, ties -> lower doc id (stable sort on the negated score)."""
    return np.argsort(-S, axis=1, kind="stable")[:, :k]


def assert_ranking(docs, scores, S, k, tol):
    """docs/scores: [Nq, k] from the CLI.  Robust to near-ties closer than ``tol``:
    the reference score of the CLI's doc at each rank must equal the reference's
    k-th best value at that rank."""
    docs = np.asarray(docs)
    assert docs.shape == (S.shape[0], min(k, S.shape[1]))
    expected = -np.sort(-S, axis=1)[:, : docs.shape[1]]
    got = np.take_along_axis(S, docs, axis=1)
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    if scores is not None:
        np.testing.assert_allclose(np.asarray(scores, np.float64), got, rtol=tol, atol=tol)
    for row in docs:
        assert len(set(row.tolist())) == len(row), "a doc appears twice in one ranking"


def read_tsv(path):
    lines = pathlib.Path(path).read_text().splitlines()
    assert lines[0] == "query\trank\tdoc\tscore"
    rows = [line.split("\t") for line in lines[1:]]
    nq = max(int(r[0]) for r in rows) + 1
    k = max(int(r[1]) for r in rows)
    docs = np.full((nq, k), -1, np.int64)
    scores = np.full((nq, k), np.nan)
    for q, r, d, s in rows:
        docs[int(q), int(r) - 1] = int(d)
        scores[int(q), int(r) - 1] = float(s)
    assert (docs >= 0).all()
    return docs, scores


def write(path, arr):
    np.save(path, arr)
    return str(path)


def make_data(tmp_path, dtype=np.float32, seed=0):
    """Awkward sizes: Nq=3, Lq=7, d=20; shards of 11 docs (L=9) and 6 docs (L=5).
    Query 2 has no valid token (scores 0 everywhere); shard 1's doc 3 (global 14) is empty (-inf)."""
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((NQ, LQ, DIM)).astype(np.float32)
    q_len = np.array([7, 4, 0], np.int32)
    shards, d_lens = [], []
    for n, L in SHARDS:
        shards.append(rng.standard_normal((n, L, DIM)).astype(np.float32))
        d_lens.append(rng.integers(1, L + 1, size=n).astype(np.int64))
    d_lens[1][3] = 0
    Qs = Q.astype(dtype)
    Ds = [D.astype(dtype) for D in shards]
    f = {
        "q": write(tmp_path / "q.npy", Qs),
        "ql": write(tmp_path / "ql.npy", q_len),
        "d": [write(tmp_path / f"d{i}.npy", D) for i, D in enumerate(Ds)],
        "dl": [write(tmp_path / f"dl{i}.npy", L) for i, L in enumerate(d_lens)],
    }
    S = ref_scores(Qs.astype(np.float64), [D.astype(np.float64) for D in Ds], q_len, d_lens)
    return f, S


def score_args(f, out, *extra, lengths=True):
    args = ["score", "--queries", f["q"], "--docs", *f["d"]]
    if lengths:
        args += ["--q-lengths", f["ql"], "--d-lengths", *f["dl"]]
    return [*args, "--out", out, "--cpu", *extra]


def listing(path):
    return sorted(p.name for p in pathlib.Path(path).iterdir())


# --------------------------------------------------------------------------- correct results


@pytest.mark.parametrize("chunk", [0, 1, 4])
def test_tsv_matches_reference(tmp_path, chunk):
    f, S = make_data(tmp_path)
    out = tmp_path / "res.tsv"
    r = run(*score_args(f, out, "--top-k", 5, "--chunk-docs", chunk))
    assert r.exit_code == 0, r.output
    assert r.stderr == ""  # not a TTY: no progress bar, and --cpu: no fallback note
    docs, scores = read_tsv(out)
    assert_ranking(docs, scores, S, 5, 1e-4)
    # query 2 has no valid token: every doc scores 0 (beats the empty doc's -inf),
    # and ties go to the lower global doc id.
    assert docs[2].tolist() == [0, 1, 2, 3, 4]
    assert (scores[2] == 0).all()


def test_top_k_larger_than_corpus_includes_empty_doc_last(tmp_path):
    f, S = make_data(tmp_path)
    out = tmp_path / "res.tsv"
    r = run(*score_args(f, out, "--top-k", 100, "--chunk-docs", 3))
    assert r.exit_code == 0, r.output
    docs, scores = read_tsv(out)
    assert docs.shape == (NQ, 17)
    assert_ranking(docs, scores, S, 100, 1e-4)
    assert docs[0, -1] == 14 and scores[0, -1] == -np.inf  # empty doc: -inf, ranked last
    assert docs[1, -1] == 14
    assert docs[2].tolist() == list(range(17))  # all 0, ties by id (the empty doc too: 0 wins over -inf)


def test_jsonl_output(tmp_path):
    f, S = make_data(tmp_path)
    out = tmp_path / "res.jsonl"
    r = run(*score_args(f, out, "--top-k", 17))
    assert r.exit_code == 0, r.output
    objs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(objs) == NQ * 17
    assert set(objs[0]) == {"query", "rank", "doc", "score"}
    docs = np.array([[o["doc"] for o in objs if o["query"] == q] for q in range(NQ)])
    ranks = [[o["rank"] for o in objs if o["query"] == q] for q in range(NQ)]
    assert all(rk == list(range(1, 18)) for rk in ranks)
    scores = np.array([[-np.inf if o["score"] is None else o["score"] for o in objs if o["query"] == q] for q in range(NQ)])
    assert_ranking(docs, scores, S, 17, 1e-4)
    assert objs[16]["score"] is None  # the empty doc's -inf is JSON null


def test_npy_topk_indices(tmp_path):
    f, S = make_data(tmp_path)
    out = tmp_path / "top.npy"
    r = run(*score_args(f, out, "-k", 4, "--chunk-docs", 5))
    assert r.exit_code == 0, r.output
    idx = np.load(out)
    assert idx.shape == (NQ, 4) and idx.dtype == np.int64
    assert_ranking(idx, None, S, 4, 1e-4)


def test_full_matrix_fp32_equals_reference(tmp_path):
    f, S = make_data(tmp_path)
    out = tmp_path / "full.npy"
    r = run(*score_args(f, out, "--full-matrix", "--chunk-docs", 4))
    assert r.exit_code == 0, r.output
    M = np.load(out)
    assert M.dtype == np.float32 and M.shape == (NQ, 17)
    np.testing.assert_allclose(M, S, rtol=1e-5, atol=1e-5)
    assert M[0, 14] == -np.inf and (M[2] == 0).all()


def test_full_matrix_without_lengths(tmp_path):
    rng = np.random.default_rng(3)
    Q = rng.standard_normal((2, 5, 8)).astype(np.float32)
    D = rng.standard_normal((7, 6, 8)).astype(np.float32)
    f = {"q": write(tmp_path / "q.npy", Q), "d": [write(tmp_path / "d.npy", D)]}
    out = tmp_path / "m.npy"
    r = run(*score_args(f, out, "--full-matrix", lengths=False))
    assert r.exit_code == 0, r.output
    np.testing.assert_allclose(np.load(out), ref_scores(Q, [D]), rtol=1e-5, atol=1e-5)


def test_float16_inputs(tmp_path):
    f, S = make_data(tmp_path, dtype=np.float16)
    out = tmp_path / "res.tsv"
    r = run(*score_args(f, out, "--top-k", 6))
    assert r.exit_code == 0, r.output
    docs, scores = read_tsv(out)
    assert_ranking(docs, scores, S, 6, 2e-3)


def test_bfloat16_bits_inputs(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(5)
    Q = rng.standard_normal((NQ, LQ, DIM)).astype(ml_dtypes.bfloat16)
    Ds = [rng.standard_normal((n, L, DIM)).astype(ml_dtypes.bfloat16) for n, L in SHARDS]
    f = {
        "q": write(tmp_path / "q.npy", Q.view(np.uint16)),
        "d": [write(tmp_path / f"d{i}.npy", D.view(np.uint16)) for i, D in enumerate(Ds)],
    }
    S = ref_scores(Q.astype(np.float64), [D.astype(np.float64) for D in Ds])
    out = tmp_path / "full.npy"
    r = run(*score_args(f, out, "--bf16-bits", "--full-matrix", lengths=False))
    assert r.exit_code == 0, r.output
    np.testing.assert_allclose(np.load(out), S, rtol=1e-2, atol=1e-2)
    out2 = tmp_path / "res.tsv"
    r = run(*score_args(f, out2, "--bf16-bits", "-k", 5, lengths=False))
    assert r.exit_code == 0, r.output
    docs, scores = read_tsv(out2)
    assert_ranking(docs, scores, S, 5, 1e-2)


def test_mixed_dtypes_are_scored_in_float32(tmp_path):
    f, S = make_data(tmp_path)
    Q = np.load(f["q"]).astype(np.float16)
    f["q"] = write(tmp_path / "q16.npy", Q)
    S = ref_scores(Q.astype(np.float64), [np.load(p).astype(np.float64) for p in f["d"]],
                   np.load(f["ql"]), [np.load(p) for p in f["dl"]])
    out = tmp_path / "full.npy"
    r = run(*score_args(f, out, "--full-matrix"))
    assert r.exit_code == 0, r.output
    np.testing.assert_allclose(np.load(out), S, rtol=1e-5, atol=1e-5)


def test_repeated_docs_option_equals_list_form(tmp_path):
    f, _ = make_data(tmp_path)
    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    assert run(*score_args(f, a, "-k", 5)).exit_code == 0
    args = ["score", "-q", f["q"], "-d", f["d"][0], "--docs", f["d"][1], "--q-lengths", f["ql"],
            "--d-lengths", f["dl"][0], "--d-lengths", f["dl"][1], "-k", 5, "-o", b, "--cpu"]
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert a.read_text() == b.read_text()


def test_ties_go_to_lower_global_doc_id(tmp_path):
    # Small-integer data: every dot product is exact in any precision and any order.
    rng = np.random.default_rng(7)
    Q = rng.integers(-1, 2, size=(2, 3, DIM)).astype(np.float32)
    base = rng.integers(-1, 2, size=(5, 4, DIM)).astype(np.float32)
    D0 = np.concatenate([base, base[:2]])  # ids 0..6: 5,6 duplicate 0,1
    D1 = np.concatenate([base[::-1], base])  # ids 7..16
    f = {"q": write(tmp_path / "q.npy", Q), "d": [write(tmp_path / "d0.npy", D0), write(tmp_path / "d1.npy", D1)]}
    S = ref_scores(Q, [D0, D1])
    out = tmp_path / "r.tsv"
    r = run(*score_args(f, out, "-k", 17, "--chunk-docs", 3, lengths=False))
    assert r.exit_code == 0, r.output
    docs, scores = read_tsv(out)
    np.testing.assert_array_equal(docs, ref_ranking(S, 17))
    np.testing.assert_array_equal(scores, np.take_along_axis(S, docs, 1))


@pytest.mark.parametrize("seed", range(20))
def test_merge_topk_matches_full_sort(seed):
    rng = np.random.default_rng(seed)
    nq, n, k = 3, int(rng.integers(1, 40)), int(rng.integers(1, 12))
    S = rng.integers(-3, 4, size=(nq, n)).astype(np.float32)  # many ties
    S[rng.random((nq, n)) < 0.1] = -np.inf
    S[rng.random((nq, n)) < 0.05] = np.nan
    S[rng.random((nq, n)) < 0.05] = -0.0
    S[rng.random((nq, n)) < 0.05] = np.inf
    vals, ids = np.empty((nq, 0), np.float32), np.empty((nq, 0), np.int64)
    cuts = sorted(set(rng.integers(0, n, size=3).tolist()) | {0, n})
    for s, e in zip(cuts[:-1], cuts[1:]):
        vals, ids = cli._merge_topk(vals, ids, S[:, s:e], s, min(k, n))
    key = np.where(np.isnan(S), np.inf, -S)  # NaN last; -inf before NaN
    nan_last = np.isnan(S).astype(np.int8)
    expect = np.array([np.lexsort((np.arange(n), key[q], nan_last[q]))[: min(k, n)] for q in range(nq)])
    np.testing.assert_array_equal(ids, expect)


def test_demo_runs_and_finds_planted_docs(tmp_path):
    r = run("demo", tmp_path / "demo", "--cpu")
    assert r.exit_code == 0, r.output + r.stderr
    assert "4/4" in r.output
    assert {"queries.npy", "docs_0.npy", "docs_1.npy", "results.tsv"} <= set(listing(tmp_path / "demo"))
    docs, _ = read_tsv(tmp_path / "demo" / "results.tsv")
    assert docs[:, 0].tolist() == [5, 30, 17, 38]


def test_cpu_fallback_note(tmp_path, monkeypatch):
    import lik_cupy

    monkeypatch.setattr(lik_cupy, "gpu_available", lambda: False, raising=False)
    f, S = make_data(tmp_path)
    out = tmp_path / "r.tsv"
    args = [a for a in score_args(f, out, "-k", 3) if a != "--cpu"]
    r = run(*args)
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "falling back to CPU" in lines[0]
    docs, scores = read_tsv(out)
    assert_ranking(docs, scores, S, 3, 1e-4)


# --------------------------------------------------------------------------- help / info


@pytest.mark.parametrize("cmd", [[], ["score"], ["demo"], ["info"]])
def test_help(cmd):
    r = run(*cmd, "--help")
    assert r.exit_code == 0
    assert "Usage: " in r.output
    if cmd != ["info"]:
        assert "[Nq, Lq, d]" in r.output and "Example" in r.output and "np.save" in r.output


def test_info_without_gpu_or_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    r = run("info")
    assert r.exit_code == 0, r.output
    for word in ("lik-cupy", "numpy", "cupy", "GPU", "kernel cache"):
        assert word in r.output


def test_info_real():
    r = run("info")
    assert r.exit_code == 0, r.output
    assert "kernel cache" in r.output


# --------------------------------------------------------------------------- bad input


def _bad_cases(tmp_path):
    f, _ = make_data(tmp_path)
    t = tmp_path
    out = str(t / "out.tsv")
    good = np.load(f["d"][0])
    raw = pathlib.Path(f["d"][0]).read_bytes()
    (t / "text.npy").write_text("this is not numpy\n")
    (t / "empty.npy").write_bytes(b"")
    (t / "trunc.npy").write_bytes(raw[:-37])
    (t / "trunchdr.npy").write_bytes(raw[:40])
    np.savez(t / "arch.npz", a=good)
    os.replace(t / "arch.npz", t / "arch.npy")
    np.save(t / "obj.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    write(t / "q2d.npy", np.zeros((3, 20), np.float32))
    write(t / "d4d.npy", np.zeros((2, 3, 4, 20), np.float32))
    write(t / "dimbad.npy", np.zeros((4, 5, 21), np.float32))
    write(t / "q64.npy", np.zeros((3, 7, 20), np.float64))
    write(t / "dint.npy", np.zeros((4, 5, 20), np.int32))
    write(t / "du16.npy", np.zeros((4, 5, 20), np.uint16))
    write(t / "ql_short.npy", np.array([1, 2], np.int32))
    write(t / "ql_2d.npy", np.ones((3, 1), np.int32))
    write(t / "dl_big.npy", np.full(11, 10, np.int32))  # shard 0 has L = 9
    write(t / "dl_neg.npy", np.array([1] * 10 + [-1], np.int32))
    write(t / "dl_float.npy", np.ones(11, np.float32))
    (t / "afile").write_text("x")
    (t / "outdir.tsv").mkdir()
    q, d0, d1, dl0, dl1 = f["q"], f["d"][0], f["d"][1], f["dl"][0], f["dl"][1]

    def S(*extra, queries=q, docs=(d0, d1), o=out):
        return ["score", "--queries", queries, "--docs", *docs, "--out", o, "--cpu", *extra]

    p = lambda name: str(t / name)  # noqa: E731
    return [
        ("missing queries", S(queries=p("nope.npy")), p("nope.npy")),
        ("missing shard", S(docs=(d0, p("nope1.npy"))), p("nope1.npy")),
        ("not npy", S(queries=p("text.npy")), p("text.npy")),
        ("empty file", S(docs=(p("empty.npy"),)), p("empty.npy")),
        ("truncated data", S(docs=(d1, p("trunc.npy"))), p("trunc.npy")),
        ("truncated header", S(docs=(p("trunchdr.npy"),)), p("trunchdr.npy")),
        ("npz", S(docs=(p("arch.npy"),)), p("arch.npy")),
        ("object dtype", S(docs=(p("obj.npy"),)), p("obj.npy")),
        ("queries rank", S(queries=p("q2d.npy")), p("q2d.npy")),
        ("docs rank", S(docs=(d0, p("d4d.npy"))), p("d4d.npy")),
        ("dim vs queries", S(docs=(p("dimbad.npy"),)), p("dimbad.npy")),
        ("dim between shards", S(docs=(d0, d1, p("dimbad.npy"))), p("dimbad.npy")),
        ("float64", S(queries=p("q64.npy")), p("q64.npy")),
        ("int32", S(docs=(d0, p("dint.npy"))), p("dint.npy")),
        ("uint16 without --bf16-bits", S(docs=(p("du16.npy"),)), p("du16.npy")),
        ("q lengths count", S("--q-lengths", p("ql_short.npy")), p("ql_short.npy")),
        ("q lengths rank", S("--q-lengths", p("ql_2d.npy")), p("ql_2d.npy")),
        ("d lengths too big", S("--d-lengths", p("dl_big.npy"), dl1), p("dl_big.npy")),
        ("d lengths negative", S("--d-lengths", p("dl_neg.npy"), dl1), p("dl_neg.npy")),
        ("d lengths float", S("--d-lengths", p("dl_float.npy"), dl1), p("dl_float.npy")),
        ("d lengths wrong shard", S("--d-lengths", dl1, dl0), dl1),
        ("d lengths missing file", S("--d-lengths", dl0, p("nol.npy")), p("nol.npy")),
        ("d lengths count", S("--d-lengths", dl0), "--d-lengths"),
        ("q lengths missing", S("--q-lengths", p("noql.npy")), p("noql.npy")),
        ("no such out dir", S(o=p("nodir/out.tsv")), p("nodir/out.tsv")),
        ("out parent is a file", S(o=p("afile/out.tsv")), p("afile/out.tsv")),
        ("out is a directory", S(o=p("outdir.tsv")), p("outdir.tsv")),
        ("unknown suffix", S(o=p("out.csv")), p("out.csv")),
        ("no suffix", S(o=p("out")), p("out")),
        ("top-k zero", S("--top-k", 0), "--top-k"),
        ("top-k negative", S("--top-k", -3), "--top-k"),
        ("full matrix to tsv", S("--full-matrix"), out),
    ]


def test_bad_inputs(tmp_path):
    cases = _bad_cases(tmp_path)
    assert len(cases) >= 30
    before = listing(tmp_path)
    failures = []
    for name, args, culprit in cases:
        r = run(*args)
        err = r.stderr
        lines = err.splitlines()
        ok = (
            r.exit_code == 2
            and len(lines) == 1
            and lines[0].startswith("lik: error: ")
            and f"lik: error: {culprit}: " in lines[0]
            and "Traceback" not in err + r.output
        )
        if not ok:
            failures.append(f"{name}: exit {r.exit_code}, stderr {err!r}, stdout {r.output!r}")
    assert not failures, "\n".join(failures)
    assert listing(tmp_path) == before, "a failed run left a file behind"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write anywhere")
def test_read_only_output_dir(tmp_path):
    f, _ = make_data(tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = run(*score_args(f, ro / "out.tsv"))
        assert r.exit_code == 2 and f"lik: error: {ro / 'out.tsv'}: " in r.stderr
    finally:
        ro.chmod(0o755)


def test_debug_shows_traceback(tmp_path):
    r = run("score", "--queries", tmp_path / "nope.npy", "--docs", tmp_path / "d.npy", "--out", tmp_path / "o.tsv", "--debug")
    assert r.exit_code == 2
    assert "Traceback" in r.stderr and "lik: error: " in r.stderr


def test_bf16_bits_flag_accepts_uint16(tmp_path):
    # the same uint16 file that is rejected without the flag scores with it
    rng = np.random.default_rng(1)
    Q = rng.integers(0x3C00, 0x3F80, size=(2, 3, 4)).astype(np.uint16)  # positive finite bf16
    D = rng.integers(0x3C00, 0x3F80, size=(5, 2, 4)).astype(np.uint16)
    f = {"q": write(tmp_path / "q.npy", Q), "d": [write(tmp_path / "d.npy", D)]}
    assert run(*score_args(f, tmp_path / "a.tsv", lengths=False)).exit_code == 2
    assert run(*score_args(f, tmp_path / "a.tsv", "--bf16-bits", lengths=False)).exit_code == 0


# --------------------------------------------------------------------------- atomic output


class _Boom:
    """Wraps lik_cupy.maxsim; raises ``exc`` on call number ``at``."""

    def __init__(self, real, exc, at=2):
        self.real, self.exc, self.at, self.calls = real, exc, at, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        if self.calls == self.at:
            raise self.exc
        return self.real(*a, **kw)


@pytest.mark.parametrize("suffix,extra", [(".tsv", ()), (".npy", ("--full-matrix",)), (".jsonl", ())])
@pytest.mark.parametrize("exc,code", [(KeyboardInterrupt(), 130), (RuntimeError("kernel exploded"), 1)])
def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch, suffix, extra, exc, code):
    import lik_cupy

    f, _ = make_data(tmp_path)
    boom = _Boom(lik_cupy.maxsim, exc)
    monkeypatch.setattr(lik_cupy, "maxsim", boom)
    before = listing(tmp_path)
    out = tmp_path / f"res{suffix}"
    r = run(*score_args(f, out, "--chunk-docs", 4, *extra))
    assert boom.calls == 2
    assert r.exit_code == code
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("lik: ")
    assert "Traceback" not in r.stderr
    assert not out.exists()
    assert listing(tmp_path) == before  # no temp file either


def test_failed_run_keeps_previous_output(tmp_path, monkeypatch):
    import lik_cupy

    f, _ = make_data(tmp_path)
    out = tmp_path / "res.tsv"
    out.write_text("previous results\n")
    monkeypatch.setattr(lik_cupy, "maxsim", _Boom(lik_cupy.maxsim, KeyboardInterrupt(), at=1))
    r = run(*score_args(f, out))
    assert r.exit_code == 130
    assert out.read_text() == "previous results\n"


def test_output_file_permissions_follow_umask(tmp_path):
    f, _ = make_data(tmp_path)
    out = tmp_path / "res.tsv"
    old = os.umask(0o022)
    try:
        assert run(*score_args(f, out)).exit_code == 0
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o644


# --------------------------------------------------------------------------- real processes


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_subprocess_python_m_cli(tmp_path):
    f, S = make_data(tmp_path)
    out = tmp_path / "res.tsv"
    args = [sys.executable, "-m", "cli"] + [str(a) for a in score_args(f, out, "--top-k", 5)]
    p = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    docs, scores = read_tsv(out)
    assert_ranking(docs, scores, S, 5, 1e-4)


def test_subprocess_bad_input_has_no_traceback(tmp_path):
    args = [sys.executable, "-m", "cli", "score", "--queries", str(tmp_path / "missing.npy"),
            "--docs", str(tmp_path / "d.npy"), "--out", str(tmp_path / "o.tsv")]
    p = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr == f"lik: error: {tmp_path / 'missing.npy'}: no such file\n"


def test_console_script_if_installed(tmp_path):
    lik = pathlib.Path(sys.executable).parent / "lik"
    if not lik.exists():
        pytest.skip("the `lik` entry point is not installed next to this Python (pip install -e .)")
    f, S = make_data(tmp_path)
    out = tmp_path / "res.jsonl"
    p = subprocess.run([str(lik), *map(str, score_args(f, out, "-k", 3))], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    objs = [json.loads(line) for line in out.read_text().splitlines()]
    docs = np.array([[o["doc"] for o in objs if o["query"] == q] for q in range(NQ)])
    assert_ranking(docs, None, S, 3, 1e-4)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses a Linux pty")
def test_progress_bar_only_on_a_tty(tmp_path):
    import pty

    f, _ = make_data(tmp_path)
    master, slave = pty.openpty()
    args = [sys.executable, "-m", "cli"] + [str(a) for a in score_args(f, tmp_path / "r.tsv", "--chunk-docs", 2)]
    try:
        p = subprocess.run(args, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=slave, timeout=300)
    finally:
        os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert p.returncode == 0
    assert b"scoring" in b"".join(chunks)  # click.progressbar's label on the TTY


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_sigterm_mid_run_leaves_nothing(tmp_path):
    import signal
    import time

    f, _ = make_data(tmp_path)
    out = tmp_path / "res.tsv"
    before = listing(tmp_path)
    argv = [str(a) for a in score_args(f, out, "--chunk-docs", 1)]
    # Slow every lik_cupy.maxsim call down so the signal lands mid-run.
    code = (
        "import sys, time, lik_cupy, cli\n"
        "real = lik_cupy.maxsim\n"
        "def slow(*a, **k):\n"
        "    time.sleep(0.25)\n"
        "    return real(*a, **k)\n"
        "lik_cupy.maxsim = slow\n"
        "cli.main(sys.argv[1:], prog_name='lik')\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, *argv], cwd=tmp_path, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(n.endswith(".part") for n in listing(tmp_path)):  # scoring has started
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err == "lik: interrupted; no output written\n"
    assert listing(tmp_path) == before
