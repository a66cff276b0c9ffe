"""End-to-end tests of the ``lik`` command line (cli.py), CPU only.

Every ranking is checked against a float64 NumPy MaxSim reference computed here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest

from lik_command import child_pythonpath
from lik_command import run_lik as run
from lik_cupy import cli
from lik_cupy._ranking import merge_ranked
from lik_cupy._base import env
import lik_cupy
from lik_cupy import _shard_format as fmt
from lik_cupy import shards

REPO = pathlib.Path(__file__).resolve().parents[1]
NQ, LQ, DIM = 3, 7, 20
Q_LEN = [7, 4, 0]  # query 2 has no valid token: it scores 0 against every document
SHARD_DOCS = (11, 6)  # 17 documents; global 14 (shard 1's doc 3) is empty and scores -inf
EMPTY_DOC = 14
# The README's main job on the bundled example shards.
MAIN_JOB = "lik score --queries examples/queries.npy --docs examples/shard0 examples/shard1 --top-k 5 --out /tmp/lik-top5.tsv"


# --------------------------------------------------------------------------- helpers


def ref_scores(Q, q_len, docs):
    """float64 MaxSim of padded queries [Nq, Lq, d] (first q_len[i] rows valid) against ragged docs -> [Nq, Ndocs]."""
    Q = np.asarray(Q, np.float64)
    S = np.empty((Q.shape[0], len(docs)))
    for i in range(Q.shape[0]):
        q = Q[i, : Q.shape[1] if q_len is None else q_len[i]]
        for j, d in enumerate(docs):
            d = np.asarray(d, np.float64)
            S[i, j] = 0.0 if not len(q) else -np.inf if not len(d) else np.einsum("sd,td->st", q, d).max(axis=1).sum()
    return S


def assert_ranking(positions, scores, S, k, tol):
    """positions/scores [Nq, k] from the CLI. Robust to near-ties closer than ``tol``: the reference
    score of the CLI's document at each rank must equal the reference's rank-th best score."""
    positions = np.asarray(positions)
    assert positions.shape == (S.shape[0], min(k, S.shape[1]))
    expected = -np.sort(-S, axis=1)[:, : positions.shape[1]]
    got = np.take_along_axis(S, positions, axis=1)
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)
    if scores is not None:
        np.testing.assert_allclose(np.asarray(scores, np.float64), got, rtol=tol, atol=tol)
    for row in positions:
        assert len(set(row.tolist())) == len(row), "a document appears twice in one ranking"


def read_tsv(path, doc_type=int, query_type=int):
    lines = pathlib.Path(path).read_text().splitlines()
    assert lines[0] == "query\trank\tdoc\tscore"
    rows = [line.split("\t") for line in lines[1:]]
    queries = list(dict.fromkeys(query_type(r[0]) for r in rows))
    k = max(int(r[1]) for r in rows)
    docs = np.empty((len(queries), k), object)
    scores = np.full((len(queries), k), np.nan)
    for q, r, d, s in rows:
        docs[queries.index(query_type(q)), int(r) - 1] = doc_type(d)
        scores[queries.index(query_type(q)), int(r) - 1] = float(s)
    assert all(d is not None for d in docs.ravel())
    return queries, docs, scores


def listing(path):
    return sorted(p.name for p in pathlib.Path(path).iterdir())


class Corpus:
    """Queries (padded .npy + lengths) and two shard directories of ragged documents, with the reference."""

    def __init__(self, tmp_path, dtype="float32", ids=None, seed=0, dim=DIM):
        rng = np.random.default_rng(seed)
        Q = rng.standard_normal((NQ, LQ, dim)).astype(np.float32)
        lengths = rng.integers(1, 10, size=sum(SHARD_DOCS))
        lengths[EMPTY_DOC] = 0
        npdt = fmt.numpy_dtype(dtype)
        self.docs = [rng.standard_normal((int(n), dim)).astype(np.float32).astype(npdt) for n in lengths]
        self.q = str(tmp_path / "q.npy")
        self.ql = str(tmp_path / "ql.npy")
        np.save(self.q, Q)
        np.save(self.ql, np.array(Q_LEN, np.int32))
        self.ids = None if ids is None else [ids(j) for j in range(len(self.docs))]
        self.shards, first = [], 0
        for s, n in enumerate(SHARD_DOCS):
            part = self.docs[first : first + n]
            offsets = np.concatenate([[0], np.cumsum([len(d) for d in part])])
            self.shards.append(str(tmp_path / f"shard{s}"))
            shards.write_shard(self.shards[-1], np.concatenate(part), offsets,
                               ids=None if ids is None else self.ids[first : first + n])
            first += n
        # the CLI casts float32 queries to the corpus dtype
        self.S = ref_scores(Q.astype(npdt), Q_LEN, self.docs)

    def args(self, out, *extra):
        return ["score", "--queries", self.q, "--q-lengths", self.ql, "--docs", *self.shards, "--out", out, "--cpu", *extra]


# --------------------------------------------------------------------------- correct results


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_shards_tsv_matches_reference(tmp_path, dtype):
    # The reference scores the queries cast to the corpus's dtype, the values the CLI scores: the
    # NumPy path lies within float32 rounding of it whatever the dtype (a tolerance of the dtype's own
    # rounding passed a CLI that scored the float32 queries uncast).
    tol = 1e-5
    c = Corpus(tmp_path, dtype)
    out = tmp_path / "res.tsv"
    before = {p: listing(p) for p in [tmp_path, *c.shards]}
    r = run(*c.args(out, "--top-k", 5))
    assert r.exit_code == 0, r.output + r.stderr
    assert r.stderr == ""  # not a TTY: no progress bar; --cpu: no fallback note
    assert {p: listing(p) for p in before} == {**before, tmp_path: sorted(before[tmp_path] + ["res.tsv"])}  # nothing else
    queries, docs, scores = read_tsv(out)
    assert queries == [0, 1, 2]
    assert_ranking(docs.astype(np.int64), scores, c.S, 5, tol)
    assert docs[2].tolist() == [0, 1, 2, 3, 4]  # query 2: all 0, ties to the lower position
    assert (scores[2] == 0).all()


def test_top_k_larger_than_corpus_puts_the_empty_doc_last(tmp_path):
    c = Corpus(tmp_path)
    out = tmp_path / "res.tsv"
    r = run(*c.args(out, "--top-k", 100))
    assert r.exit_code == 0, r.stderr
    _, docs, scores = read_tsv(out)
    docs = docs.astype(np.int64)
    assert docs.shape == (NQ, 17)
    assert_ranking(docs, scores, c.S, 100, 1e-4)
    assert docs[0, -1] == EMPTY_DOC and scores[0, -1] == -np.inf
    assert docs[2].tolist() == list(range(17))  # every doc scores 0 for the empty query, the empty one too


def test_doc_ids_read_each_result_position_once_however_many_shards():
    """Results -> ids over many shards: a mask of every position for each shard hit made a block of
    results take time growing as their number times the shards; count the positions read instead."""
    import types

    class Positions(np.ndarray):
        read = 0

        def __getitem__(self, index):
            Positions.read += np.asarray(index).size
            return super().__getitem__(index)

    shards_, per = 50, 7
    corpus = [types.SimpleNamespace(ids=np.array([f"d{j}.{i}" for i in range(per)]), num_docs=per, path=f"s{j}")
              for j in range(shards_)]
    rng = np.random.default_rng(0)
    pos = rng.integers(0, shards_ * per, (40, 10))
    got = cli._DocIds(corpus)(pos.view(Positions))
    assert got.shape == pos.shape
    assert got.tolist() == [[f"d{p // per}.{p % per}" for p in row] for row in pos.tolist()]
    assert Positions.read <= 4 * pos.size  # (np.unique indexes each shard's own positions too)


def test_jsonl_with_string_ids(tmp_path):
    c = Corpus(tmp_path, ids=lambda j: f"doc-{j:02d}")
    out = tmp_path / "res.jsonl"
    r = run(*c.args(out, "--top-k", 17))
    assert r.exit_code == 0, r.stderr
    objs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(objs) == NQ * 17 and set(objs[0]) == {"query", "rank", "doc", "score"}
    for q in range(NQ):
        mine = [o for o in objs if o["query"] == q]
        assert [o["rank"] for o in mine] == list(range(1, 18))
        positions = np.array([[c.ids.index(o["doc"]) for o in mine]])
        scores = np.array([[-np.inf if o["score"] is None else o["score"] for o in mine]])
        assert_ranking(positions, scores, c.S[q : q + 1], 17, 1e-4)
    assert objs[16]["doc"] == f"doc-{EMPTY_DOC}" and objs[16]["score"] is None  # -inf is JSON null


@pytest.mark.parametrize("ids", [None, "int", "str"])
def test_npy_output_holds_doc_ids(tmp_path, ids):
    make = {None: None, "int": lambda j: 1000 + j, "str": lambda j: f"d{j}"}[ids]
    c = Corpus(tmp_path, ids=make)
    out = tmp_path / "top.npy"
    r = run(*c.args(out, "-k", 4))
    assert r.exit_code == 0, r.stderr
    top = np.load(out, allow_pickle=False)
    assert top.shape == (NQ, 4)
    if ids is None:
        positions = top
        assert top.dtype == np.int64
    elif ids == "int":
        assert top.dtype == np.int64
        positions = top - 1000
    else:
        assert top.dtype.kind == "U"
        positions = np.vectorize(lambda s: int(s[1:]))(top)
    assert_ranking(positions, None, c.S, 4, 1e-4)


def test_full_matrix_equals_reference(tmp_path):
    c = Corpus(tmp_path)
    out = tmp_path / "full.npy"
    r = run(*c.args(out, "--full-matrix"))
    assert r.exit_code == 0, r.stderr
    M = np.load(out)
    assert M.dtype == np.float32 and M.shape == (NQ, 17)
    np.testing.assert_allclose(M, c.S, rtol=1e-5, atol=1e-5)
    assert M[0, EMPTY_DOC] == -np.inf and (M[2] == 0).all()


def test_padded_flat_and_shard_inputs_mix(tmp_path):
    """Docs 0..5 as a padded .npy + lengths, 6..10 as ColBERT flat tokens + doclens.json, 11..16 as a shard."""
    c = Corpus(tmp_path)
    pad = np.zeros((6, 9, DIM), np.float32)
    for j in range(6):
        pad[j, : len(c.docs[j])] = c.docs[j]
        pad[j, len(c.docs[j]) :] = np.nan  # padding is never read
    np.save(tmp_path / "pad.npy", pad)
    np.save(tmp_path / "pad_len.npy", np.array([len(d) for d in c.docs[:6]]))
    np.save(tmp_path / "flat.npy", np.concatenate(c.docs[6:11]))
    (tmp_path / "doclens.0.json").write_text(json.dumps([len(d) for d in c.docs[6:11]]))
    out = tmp_path / "full.npy"
    args = ["score", "-q", c.q, "--q-lengths", c.ql, "--docs", tmp_path / "pad.npy", tmp_path / "flat.npy", c.shards[1],
            "--d-lengths", tmp_path / "pad_len.npy", tmp_path / "doclens.0.json", "--full-matrix", "-o", out, "--cpu"]
    r = run(*args)
    assert r.exit_code == 0, r.stderr
    np.testing.assert_allclose(np.load(out), c.S, rtol=1e-5, atol=1e-5)
    top = tmp_path / "top.tsv"
    r = run(*[top if a == out else a for a in args if a != "--full-matrix"], "-k", 6)
    assert r.exit_code == 0, r.stderr
    _, docs, scores = read_tsv(top)
    assert_ranking(docs.astype(np.int64), scores, c.S, 6, 1e-4)


def test_padded_docs_without_lengths_and_repeated_docs_option(tmp_path):
    rng = np.random.default_rng(3)
    Q = rng.standard_normal((2, 5, 8)).astype(np.float16)
    D0 = rng.standard_normal((7, 6, 8)).astype(np.float16)
    D1 = rng.standard_normal((3, 2, 8)).astype(np.float16)
    for name, arr in (("q", Q), ("d0", D0), ("d1", D1)):
        np.save(tmp_path / f"{name}.npy", arr)
    S = ref_scores(Q, None, list(D0) + list(D1))
    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    r = run("score", "-q", tmp_path / "q.npy", "-d", tmp_path / "d0.npy", tmp_path / "d1.npy", "-k", 10, "-o", a, "--cpu")
    assert r.exit_code == 0, r.stderr
    r = run("score", "-q", tmp_path / "q.npy", "-d", tmp_path / "d0.npy", "--docs", tmp_path / "d1.npy", "-k", 10, "-o", b, "--cpu")
    assert r.exit_code == 0, r.stderr
    assert a.read_text() == b.read_text()
    _, docs, scores = read_tsv(a)
    assert_ranking(docs.astype(np.int64), scores, S, 10, 2e-3)


def test_query_shard_names_the_queries(tmp_path):
    c = Corpus(tmp_path)
    Q = np.load(c.q)
    qdocs = [Q[i, : Q_LEN[i]] for i in range(NQ)]
    shards.write_shard(tmp_path / "queries", np.concatenate(qdocs), np.concatenate([[0], np.cumsum(Q_LEN)]),
                       ids=["what", "who", "empty"])
    out = tmp_path / "res.tsv"
    r = run("score", "--queries", tmp_path / "queries", "--docs", *c.shards, "-k", 3, "-o", out, "--cpu")
    assert r.exit_code == 0, r.stderr
    queries, docs, scores = read_tsv(out, query_type=str)
    assert queries == ["what", "who", "empty"]
    assert_ranking(docs.astype(np.int64), scores, c.S, 3, 1e-4)


def test_mixed_dtypes_are_scored_in_float32(tmp_path):
    c = Corpus(tmp_path)
    first = c.docs[: SHARD_DOCS[0]]
    half = [d.astype(np.float16) for d in first]
    shards.write_shard(tmp_path / "shard0", np.concatenate(half), shards.open_shard(c.shards[0]).offsets, overwrite=True)
    S = ref_scores(np.load(c.q), Q_LEN, half + c.docs[SHARD_DOCS[0] :])
    out = tmp_path / "full.npy"
    r = run(*c.args(out, "--full-matrix"))
    assert r.exit_code == 0, r.stderr
    np.testing.assert_allclose(np.load(out), S, rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lower_global_position(tmp_path):
    # Small-integer data: every dot product is exact in any precision and any order.
    rng = np.random.default_rng(7)
    Q = rng.integers(-1, 2, size=(2, 3, DIM)).astype(np.float32)
    base = [rng.integers(-1, 2, size=(4, DIM)).astype(np.float32) for _ in range(5)]
    groups = [base + base[:2], base[::-1] + base]  # positions 5, 6 repeat 0, 1; shard 1 repeats them all
    np.save(tmp_path / "q.npy", Q)
    for s, g in enumerate(groups):
        shards.write_shard(tmp_path / f"s{s}", np.concatenate(g), np.arange(len(g) + 1) * 4)
    S = ref_scores(Q, None, groups[0] + groups[1])
    out = tmp_path / "r.tsv"
    r = run("score", "-q", tmp_path / "q.npy", "-d", tmp_path / "s0", tmp_path / "s1", "-k", 17, "-o", out, "--cpu")
    assert r.exit_code == 0, r.stderr
    _, docs, scores = read_tsv(out)
    np.testing.assert_array_equal(docs.astype(np.int64), np.argsort(-S, axis=1, kind="stable"))
    np.testing.assert_array_equal(scores, np.take_along_axis(S, docs.astype(np.int64), 1))


@pytest.mark.parametrize("seed", range(20))
def test_merge_ranked_matches_a_full_sort(seed):
    rng = np.random.default_rng(seed)
    nq, n, k = 3, int(rng.integers(1, 40)), int(rng.integers(1, 12))
    S = rng.integers(-3, 4, size=(nq, n)).astype(np.float32)  # many ties
    for value, share in ((-np.inf, 0.1), (np.nan, 0.05), (-0.0, 0.05), (np.inf, 0.05)):
        S[rng.random((nq, n)) < share] = value
    perm = rng.permutation(n)  # parts arrive in any order of positions (several GPUs)
    vals, ids = np.empty((nq, 0), np.float32), np.empty((nq, 0), np.int64)
    for cut in np.array_split(perm, 3):
        vals, ids = merge_ranked(vals, ids, S[:, cut], np.broadcast_to(cut, (nq, cut.size)).astype(np.int64), min(k, n))
    key = np.where(np.isnan(S), np.inf, -S)
    expect = np.array([np.lexsort((np.arange(n), key[q], np.isnan(S[q])))[: min(k, n)] for q in range(nq)])
    np.testing.assert_array_equal(ids, expect)


def test_devices_spread_shards_and_merge(tmp_path, monkeypatch):
    """--devices 0,1 on a pretend two-GPU machine: shards go to both devices; the merged result equals --cpu's."""
    c = Corpus(tmp_path)
    c.shards.append(str(tmp_path / "shard2"))  # a third shard: the same documents again (positions 17..33)
    shards.write_shard(c.shards[-1], np.concatenate(c.docs), np.concatenate([[0], np.cumsum([len(d) for d in c.docs])]))
    expected = tmp_path / "cpu.tsv"
    assert run(*c.args(expected, "-k", 8)).exit_code == 0

    seen = []
    real = lik_cupy.retrieve

    def retrieve_on_cpu(*args, **kwargs):
        assert kwargs["backend"] == "gpu"
        seen.append((current.device, args[1].shape[0]))
        return real(*args, **{**kwargs, "backend": "cpu"})

    current = threading.local()  # each device's thread has its own scope

    @contextlib.contextmanager
    def scope(device):
        current.device = device
        yield

    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    monkeypatch.setattr(cli, "_gpu_count", lambda: 2)
    monkeypatch.setattr(cli, "_device_scope", scope)
    monkeypatch.setattr(cli, "_dask_cuda_installed", lambda: False)  # the threads, not a LocalCUDACluster
    monkeypatch.setattr(lik_cupy, "retrieve", retrieve_on_cpu)
    out = tmp_path / "gpus.tsv"
    args = [a for a in c.args(out, "-k", 8, "--devices", "0,1") if a != "--cpu"]
    r = run(*args)
    assert r.exit_code == 0, r.stderr
    assert out.read_text() == expected.read_text()
    # Whole shards, each to the least-loaded GPU: shard 0 -> GPU 0, shard 1 -> GPU 1, shard 2 -> GPU 1 (6 docs < 11).
    tokens = [shards.open_shard(s).tokens.shape[0] for s in c.shards]
    assert sorted(seen) == [(0, tokens[0]), (1, tokens[1]), (1, tokens[2])]
    r = run(*[a for a in args if a != "--devices" and a != "0,1"], "--devices", "0,2")
    assert r.exit_code == 2 and "lik: error: --devices: no GPU 2; 2 visible (0..1)" in r.stderr


@pytest.mark.parametrize("visible,expected", [(None, "0,2"), ("2,3,5", "2,5"), ("GPU-a, GPU-b,GPU-c", "GPU-a,GPU-c")])
def test_devices_name_the_gpus_this_process_sees_to_a_local_cuda_cluster(tmp_path, monkeypatch, visible, expected):
    """--devices 0,2 with dask-cuda installed starts a LocalCUDACluster, which hands its
    CUDA_VISIBLE_DEVICES to each worker as it is: under CUDA_VISIBLE_DEVICES=2,3,5 (where --devices
    counts GPUs, as --device and the threads do) the workers must get 2,5, not the driver's GPUs 0 and 2."""
    import types

    class Started(Exception):
        pass

    seen = {}

    def cluster(**kwargs):
        seen.update(kwargs)
        raise Started

    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=cluster))
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    monkeypatch.setattr(cli, "_gpu_count", lambda: 3)
    monkeypatch.setattr(cli, "_dask_cuda_installed", lambda: True)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    c = Corpus(tmp_path)
    r = run(*[a for a in c.args(tmp_path / "r.tsv", "--devices", "0,2") if a != "--cpu"])
    assert r.exit_code == 1 and "Started" in r.stderr, r.stderr
    assert seen["CUDA_VISIBLE_DEVICES"] == expected and seen["n_workers"] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("float32", 1e-2)])  # float32 runs on TF32
@pytest.mark.parametrize("device", [[], ["--device", "0"], ["--devices", "0"]])
def test_gpu_score_matches_reference(tmp_path, dtype, tol, device):
    c = Corpus(tmp_path, dtype)
    top, full = tmp_path / "top.tsv", tmp_path / "full.npy"
    r = run(*[a for a in c.args(top, "-k", 17) if a != "--cpu"], *device)
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    _, docs, scores = read_tsv(top)
    assert_ranking(docs.astype(np.int64), scores, c.S, 17, tol)
    r = run(*[a for a in c.args(full, "--full-matrix") if a != "--cpu"], *device)
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    np.testing.assert_allclose(np.load(full), c.S, rtol=tol, atol=tol)


def test_precision_holds_for_the_run_only(tmp_path, monkeypatch):
    """--precision sets LIK_PRECISION for the run's library calls (and the workers a run starts), then
    gives a process that called main its own back."""
    c = Corpus(tmp_path)
    monkeypatch.delenv("LIK_PRECISION", raising=False)
    seen = []
    real = lik_cupy.retrieve

    def retrieve(*args, **kwargs):
        seen.append(os.environ.get("LIK_PRECISION"))
        return real(*args, **kwargs)

    monkeypatch.setattr(lik_cupy, "retrieve", retrieve)
    r = run(*c.args(tmp_path / "r.tsv", "--precision", "tf32"))
    assert r.exit_code == 0, r.stderr
    assert seen and set(seen) == {"tf32"} and "LIK_PRECISION" not in os.environ
    monkeypatch.setenv("LIK_PRECISION", "fp32")
    r = run(*c.args(tmp_path / "r.tsv", "--precision", "tf32"))
    assert r.exit_code == 0 and os.environ["LIK_PRECISION"] == "fp32"


def test_precision_is_refused_with_a_scheduler(tmp_path):
    """A --scheduler's workers are already running and never see this process's LIK_PRECISION: --precision
    is refused there, before anything is opened, rather than ignored."""
    c = Corpus(tmp_path)
    r = run(*c.args(tmp_path / "s.tsv", "--precision", "tf32", "--scheduler", "tcp://127.0.0.1:1"))
    assert r.exit_code == 2 and r.stderr.startswith("lik: error: --precision: ") and len(r.stderr.splitlines()) == 1
    assert "LIK_PRECISION" in r.stderr and not (tmp_path / "s.tsv").exists()


def test_a_bad_lik_precision_is_named_not_blamed_on_a_shard(tmp_path, monkeypatch):
    """LIK_PRECISION=bogus failed the first library call, and the error named the shard being scored
    ('shard0/tokens.npy: lik_cupy rejected documents 0..10: LIK_PRECISION must be ...')."""
    c = Corpus(tmp_path)
    monkeypatch.setenv("LIK_PRECISION", "bogus")
    for extra in ([], ["--full-matrix"]):
        out = tmp_path / ("r.npy" if extra else "r.tsv")
        r = run(*c.args(out, *extra))
        assert r.exit_code == 2 and not out.exists()
        assert r.stderr == ("lik: error: LIK_PRECISION: must be 'fp32' or 'tf32' (or unset), got 'bogus'; it is the "
                            "process default of the float32 precision, which --precision sets for one run\n"), r.stderr
    assert run(*c.args(tmp_path / "r.tsv", "--precision", "fp32")).exit_code == 0  # --precision takes its place


@pytest.mark.parametrize("name", ["LIK_VALIDATE", "LIK_POISON", "LIK_DISABLE_WGMMA", "LIK_DISABLE_TMA"])
def test_a_bad_gpu_switch_is_named_before_any_work(tmp_path, monkeypatch, name):
    """The GPU path's on/off variables are read by its calls: LIK_VALIDATE=on failed the first one, and
    the error named the shard being scored ('shard0/tokens.npy: lik_cupy rejected documents 0..10:
    environment variable LIK_VALIDATE is 'on'; ...'). A GPU run now reads them first; a CPU run never
    reads them."""
    c = Corpus(tmp_path)
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    called = []
    monkeypatch.setattr(lik_cupy, "retrieve", lambda *a, **k: called.append(1))
    monkeypatch.setenv(name, "on")
    out = tmp_path / "r.tsv"
    r = run(*[a for a in c.args(out) if a != "--cpu"])
    assert r.exit_code == 2 and not called and not out.exists()
    assert r.stderr == (f"lik: error: {name}: is 'on'; expected 1, true or yes (on), or 0, false, no or empty (off)\n")
    if name in env._OLD_NAMES:  # its value read under its old name
        monkeypatch.delenv(name)
        monkeypatch.setenv(env._OLD_NAMES[name], "on")
        monkeypatch.setattr(env, "_warned", set())  # (warned once per process)
        with pytest.warns(DeprecationWarning):
            r = run(*[a for a in c.args(out) if a != "--cpu"])
        assert r.exit_code == 2 and r.stderr.startswith(f"lik: error: {name}: is 'on'; expected 1"), r.stderr
    monkeypatch.undo()
    monkeypatch.setenv(name, "on")
    assert run(*c.args(out)).exit_code == 0


def test_cpu_fallback_note(tmp_path, monkeypatch):
    monkeypatch.setattr(lik_cupy, "gpu_available", lambda: False)
    c = Corpus(tmp_path)
    out = tmp_path / "r.tsv"
    r = run(*[a for a in c.args(out, "-k", 3) if a != "--cpu"])
    assert r.exit_code == 0, r.stderr
    assert r.stderr == "lik: no usable GPU found, falling back to CPU (pass --cpu to silence this)\n"
    _, docs, scores = read_tsv(out)
    assert_ranking(docs.astype(np.int64), scores, c.S, 3, 1e-4)
    r = run(*[a for a in c.args(out, "-k", 3) if a != "--cpu"], "--device", 0)
    assert r.exit_code == 2 and r.stderr.startswith("lik: error: --device: no usable GPU found")


def test_check_refuses_nan_but_plain_runs_rank_it_last(tmp_path):
    c = Corpus(tmp_path)
    tokens = np.array(shards.open_shard(c.shards[1]).tokens)
    tokens[0, 3] = np.nan  # shard 1, document 0 = global 11
    offsets = shards.open_shard(c.shards[1]).offsets
    shards.write_shard(c.shards[1], tokens, offsets, overwrite=True)
    out = tmp_path / "r.tsv"
    r = run(*c.args(out, "--check"))
    assert r.exit_code == 2 and not out.exists()
    assert r.stderr == f"lik: error: {c.shards[1]}/tokens.npy: document 0, token 0 holds NaN or inf; embeddings must be finite\n"
    r = run(*c.args(out, "-k", 17))
    assert r.exit_code == 0, r.stderr
    _, docs, scores = read_tsv(out)
    assert docs[0, -1] == 11 and np.isnan(scores[0, -1])  # NaN ranks after everything, -inf included


# --------------------------------------------------------------------------- pack / inspect / info / help


def test_pack_padded_then_score(tmp_path):
    c = Corpus(tmp_path)
    pad = np.zeros((17, 9, DIM), np.float32)
    for j, d in enumerate(c.docs):
        pad[j, : len(d)] = d
    np.save(tmp_path / "pad.npy", pad)
    np.save(tmp_path / "lens.npy", np.array([len(d) for d in c.docs]))
    np.save(tmp_path / "ids.npy", np.array([f"p{j}" for j in range(17)]))
    r = run("pack", tmp_path / "pad.npy", "--lengths", tmp_path / "lens.npy", "--ids", tmp_path / "ids.npy",
            "--model", "test-model", "--dtype", "float16", "--out", tmp_path / "packed")
    assert r.exit_code == 0, r.stderr
    assert r.output == f"wrote {tmp_path / 'packed'}: 17 docs, {sum(map(len, c.docs))} tokens, d={DIM}, float16, not normalized, with ids\n"
    m = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert (m["model"], m["dtype"], m["normalized"]) == ("test-model", "float16", False)
    out = tmp_path / "r.tsv"
    r = run("score", "-q", c.q, "--q-lengths", c.ql, "-d", tmp_path / "packed", "-k", 5, "-o", out, "--cpu")
    assert r.exit_code == 0, r.stderr
    _, docs, scores = read_tsv(out, doc_type=str)
    S16 = ref_scores(np.load(c.q).astype(np.float16), Q_LEN, [d.astype(np.float16) for d in c.docs])
    assert_ranking(np.vectorize(lambda s: int(s[1:]))(docs), scores, S16, 5, 2e-3)
    r = run("pack", tmp_path / "pad.npy", "--out", tmp_path / "packed")
    assert r.exit_code == 2 and "already exists" in r.stderr
    r = run("pack", tmp_path / "pad.npy", "--out", tmp_path / "packed", "--force")
    assert r.exit_code == 0 and "153 tokens" in r.output  # 17 docs x 9 rows: no lengths, every row counts


def test_pack_colbert_doclens_and_per_doc_files(tmp_path):
    c = Corpus(tmp_path)
    np.save(tmp_path / "embs.npy", np.concatenate(c.docs))
    (tmp_path / "doclens.0.json").write_text(json.dumps([len(d) for d in c.docs]))
    r = run("pack", tmp_path / "embs.npy", "--lengths", tmp_path / "doclens.0.json", "--out", tmp_path / "colbert")
    assert r.exit_code == 0, r.stderr
    files = []
    for j, d in enumerate(c.docs):
        files.append(tmp_path / f"page-{j:02d}.npy")
        np.save(files[-1], d)
    r = run("pack", "--per-doc", *files, "--out", tmp_path / "pages")
    assert r.exit_code == 0, r.stderr
    assert shards.open_shard(tmp_path / "pages").ids.tolist() == [f"page-{j:02d}" for j in range(17)]
    for shard in ("colbert", "pages"):
        out = tmp_path / f"{shard}.npy"
        r = run("score", "-q", c.q, "--q-lengths", c.ql, "-d", tmp_path / shard, "--full-matrix", "-o", out, "--cpu")
        assert r.exit_code == 0, r.stderr
        np.testing.assert_allclose(np.load(out), c.S, rtol=1e-5, atol=1e-5)


def test_pack_bad_input_writes_nothing(tmp_path):
    D = np.ones((3, 2, 4), np.float32)
    D[1, 0, 2] = np.inf
    np.save(tmp_path / "d.npy", D)
    before = listing(tmp_path)
    cases = [
        (["pack", tmp_path / "d.npy", "--check", "-o", tmp_path / "s"], f"{tmp_path / 'd.npy'}: document 1, token 0 holds NaN or inf"),
        (["pack", tmp_path / "d.npy", tmp_path / "d.npy", "-o", tmp_path / "s"], "SOURCE: got 2 inputs"),
        (["pack", "--per-doc", tmp_path / "d.npy", "-o", tmp_path / "s"], f"{tmp_path / 'd.npy'}: expected one document's token embeddings"),
        (["pack", tmp_path / "d.npy", "--ids", tmp_path / "nope.npy", "-o", tmp_path / "s"], f"{tmp_path / 'nope.npy'}: no such file"),
        (["pack", tmp_path / "d.npy", "-o", tmp_path / "no" / "s"], "parent directory"),
        (["pack", tmp_path / "d.npy", "-o", tmp_path, "--force"], "exists and is not a lik shard"),
    ]
    for args, message in cases:
        r = run(*args)
        assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and message in r.stderr, (args, r.stderr)
    assert listing(tmp_path) == before


def test_inspect(tmp_path):
    c = Corpus(tmp_path, ids=lambda j: f"doc-{j:02d}")
    r = run("inspect", c.shards[1], "--check")
    assert r.exit_code == 0, r.stderr
    assert "docs       6" in r.output and "dtype      float32" in r.output and "'doc-11' .. 'doc-16'" in r.output
    assert '"format": "lik-shard"' in r.output and "values     all finite; not L2-normalised" in r.output
    assert "1 empty" in r.output
    r = run("inspect", c.shards[1])
    assert "not read (pass --check)" in r.output

    # a manifest that claims unit vectors is caught by --check
    mpath = pathlib.Path(c.shards[1]) / "manifest.json"
    m = json.loads(mpath.read_text())
    mpath.write_text(json.dumps({**m, "normalized": True}))
    r = run("inspect", c.shards[1], "--check")
    assert r.exit_code == 2 and r.stderr.startswith(f"lik: error: {mpath}: says normalized: true but document 0, token 0 has L2 norm")
    # structural problems are reported without --check
    np.save(pathlib.Path(c.shards[1]) / "offsets.npy", np.array([0, 5, 4, 9, 9, 12, 20]))
    r = run("inspect", c.shards[1])
    assert r.exit_code == 2 and "offsets.npy: offsets are not monotone" in r.stderr and r.stdout == ""
    # a padded .npy with lengths
    r = run("inspect", c.q, "--lengths", c.ql, "--check")
    assert r.exit_code == 0 and f"padded .npy [{NQ}, {LQ}, {DIM}]" in r.output and "tokens     11 (0..7 per doc" in r.output
    assert "structure  ok (header, shape, dtype, lengths in [0, L])" in r.output  # a .npy has no manifest to check
    assert "structure  ok (manifest, shapes" in run("inspect", c.shards[0]).output


def test_inspect_shows_a_manifests_control_characters_escaped(tmp_path):
    """The manifest's model name and file names were printed as they are, so a shard could forge
    lines of the report (a model "x\\nstructure  ok ...") or hide them with terminal escapes; a
    string that does not print as it is is shown as its repr now."""
    model = "colbert\nvalues     all finite; every token has norm 1\x1b[2K"
    s = shards.write_shard(tmp_path / "s", np.ones((2, 4), np.float32), [0, 2], model=model)
    os.rename(tmp_path / "s" / "tokens.npy", tmp_path / "s" / "tok\rens.npy")
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    m["files"]["tokens"] = "tok\rens.npy"
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(m))
    r = run("inspect", s.path)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f"model      {model!r}" in lines and not any(line.startswith("values     all") for line in lines)
    assert "'tok\\rens.npy' 160 B" in r.stdout and "\r" not in r.stdout and "\x1b" not in r.stdout


@pytest.mark.parametrize("cmd", [[], ["score"], ["pack"], ["inspect"], ["info"]])
def test_help_explains_the_format_with_an_example(cmd):
    r = run(*cmd, "--help")
    assert r.exit_code == 0 and "Usage: " in r.output
    for words in ("manifest.json", "tokens.npy", "offsets.npy", "[N+1] int64", "[N, L, d]", "doclens", "Example"):
        assert words in r.output, words
    if cmd in ([], ["score"]):
        assert "lik score --queries examples/queries.npy" in r.output


def test_info_without_gpu_or_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    r = run("info")
    assert r.exit_code == 0, r.output
    for words in ("lik-cupy", "numpy", "numba", "cupy", "GPU", "kernel cache", "shard format  lik-shard v2 (reads v1..v2; dtypes float16, float32, bfloat16, int8)"):
        assert words in r.output


@pytest.mark.parametrize("installed, disabled, words", [
    (False, "", "not installed (the CPU path runs NumPy's passes; the [cpu] extra adds the compiled fold, GEMM and "
                "PLAID decompression)"),
    (True, "", "0.99.0 (the CPU path's compiled fold, GEMM and PLAID decompression)"),
    (True, "1", "0.99.0 (not used: LIK_DISABLE_NUMBA is set)")])
def test_info_says_whether_the_cpu_path_folds_compiled(monkeypatch, installed, disabled, words):
    import importlib.metadata

    real = importlib.metadata.version

    def version(dist):
        if dist != "numba":
            return real(dist)
        if not installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return "0.99.0"
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setenv("LIK_DISABLE_NUMBA", disabled)
    r = run("info")
    assert r.exit_code == 0, r.output
    assert f"numba         {words}" in r.output


def test_info_says_when_the_kernel_cache_cannot_be_written(tmp_path, monkeypatch):
    """Where LIK_CACHE_DIR cannot be written, every process compiles into a directory of its own
    (docs/environment.md); lik info showed the directory as the cache in use all the same."""
    (tmp_path / "afile").write_text("x")
    for cache, problem in ((tmp_path / "afile" / "kernels", f"{tmp_path / 'afile'} is not a directory"),
                           (tmp_path / "afile", f"{tmp_path / 'afile'} is not a directory")):
        monkeypatch.setenv("LIK_CACHE_DIR", str(cache))
        r = run("info")
        assert r.exit_code == 0, r.stderr
        assert (f"kernel cache  {cache} (cannot be written: {problem}; each process compiles its kernels into a "
                "directory of its own, removed at exit)\n") in r.output, r.output
    for cache in (tmp_path / "new" / "kernels", tmp_path):  # made on first use; there
        monkeypatch.setenv("LIK_CACHE_DIR", str(cache))
        assert f"kernel cache  {cache}\n" in run("info").output
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("status, loadable, words", [
    (35, False, "none: no NVIDIA driver on this machine (libcuda.so.1 cannot be loaded)"),
    (100, True, "none: the NVIDIA driver sees no GPU"),
    (35, True, "CUDA driver version is insufficient"),  # a driver is there, and too old
])
def test_info_says_when_there_is_no_driver_or_no_gpu(monkeypatch, status, loadable, words):
    cupy = pytest.importorskip("cupy")

    def count():
        raise cupy.cuda.runtime.CUDARuntimeError(status)

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", count)
    monkeypatch.setattr(cli, "_driver_loadable", lambda: loadable)
    r = run("info")
    assert r.exit_code == 0, r.output
    gpu = next(line for line in r.output.splitlines() if line.startswith("GPU  "))
    assert words in gpu
    assert ("insufficient" in gpu) == (words == "CUDA driver version is insufficient")


# --------------------------------------------------------------------------- INT8 shards


def quantized_reference(c: Corpus, int8_shards):
    """float64 scores of the INT8 corpus: dequantized stored tokens against the queries as the
    library quantizes them (per token, from their float32 values)."""
    from lik_cupy._cpu import quantize_numpy

    q8, qs = quantize_numpy(np.load(c.q))
    Q = q8.astype(np.float64) * qs[..., None]
    docs = []
    for path in int8_shards:
        s = shards.open_shard(path)
        x = np.asarray(s.tokens).astype(np.float64) * np.asarray(s.scales)[:, None]
        docs += [x[s.offsets[j] : s.offsets[j + 1]] for j in range(s.num_docs)]
    return ref_scores(Q, Q_LEN, docs)


def pack_int8(c: Corpus, tmp_path):
    """`lik pack SHARD --int8` for each of the corpus's float shards; returns the INT8 shard paths."""
    out = []
    for i, src in enumerate(c.shards):
        out.append(str(tmp_path / f"int8_{i}"))
        r = run("pack", src, "--int8", "--out", out[-1])
        assert r.exit_code == 0, r.stderr
        n, t = SHARD_DOCS[i], sum(len(d) for d in c.docs[sum(SHARD_DOCS[:i]) : sum(SHARD_DOCS[: i + 1])])
        assert r.output == f"wrote {out[-1]}: {n} docs, {t} tokens, d={shards.open_shard(src).dim}, int8, not normalized\n"
    return out


def test_pack_int8_then_score(tmp_path):
    c = Corpus(tmp_path)
    int8 = pack_int8(c, tmp_path)
    S = quantized_reference(c, int8)
    # INT8 scores are exact up to float32 rounding; far from the float scores they approximate.
    fin = np.isfinite(c.S)
    assert np.array_equal(np.isfinite(S), fin) and np.abs(S[fin] - c.S[fin]).max() > 1e-3
    top, full = tmp_path / "top.tsv", tmp_path / "full.npy"
    r = run("score", "-q", c.q, "--q-lengths", c.ql, "-d", *int8, "-k", 17, "-o", top, "--cpu")
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    _, docs, scores = read_tsv(top)
    assert_ranking(docs.astype(np.int64), scores, S, 17, 1e-5)
    assert docs[0, -1] == EMPTY_DOC and scores[0, -1] == -np.inf and (scores[2] == 0).all()
    r = run("score", "-q", c.q, "--q-lengths", c.ql, "-d", *int8, "--full-matrix", "-o", full, "--cpu")
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    np.testing.assert_allclose(np.load(full), S, rtol=1e-5, atol=1e-5)
    assert np.load(full)[0, EMPTY_DOC] == -np.inf

    # A padded .npy packed straight to INT8 gives the same shard bytes as packing its float shard.
    pad = np.zeros((SHARD_DOCS[0], 9, DIM), np.float32)
    for j, d in enumerate(c.docs[: SHARD_DOCS[0]]):
        pad[j, : len(d)] = d
    np.save(tmp_path / "pad.npy", pad)
    np.save(tmp_path / "lens.npy", np.array([len(d) for d in c.docs[: SHARD_DOCS[0]]]))
    r = run("pack", tmp_path / "pad.npy", "--lengths", tmp_path / "lens.npy", "--int8", "-o", tmp_path / "from_pad")
    assert r.exit_code == 0, r.stderr
    for name in ("tokens.npy", "scales.npy", "offsets.npy", "manifest.json"):
        assert (tmp_path / "from_pad" / name).read_bytes() == (pathlib.Path(int8[0]) / name).read_bytes(), name

    # INT8 queries (a query shard) are read dequantized and score a float corpus as float32.
    Q = np.load(c.q)
    qdocs = [Q[i, : Q_LEN[i]] for i in range(NQ)]
    shards.write_shard(tmp_path / "q8", np.concatenate(qdocs), np.concatenate([[0], np.cumsum(Q_LEN)]), dtype="int8")
    q8 = shards.open_shard(tmp_path / "q8")
    deq = np.asarray(q8.tokens).astype(np.float64) * np.asarray(q8.scales)[:, None]
    Sq = ref_scores(np.stack([np.pad(deq[q8.offsets[i] : q8.offsets[i + 1]], ((0, LQ - Q_LEN[i]), (0, 0)))
                              for i in range(NQ)]), Q_LEN, c.docs)
    r = run("score", "-q", tmp_path / "q8", "-d", *c.shards, "--full-matrix", "-o", tmp_path / "qfull.npy", "--cpu")
    assert r.exit_code == 0, r.stderr
    np.testing.assert_allclose(np.load(tmp_path / "qfull.npy"), Sq, rtol=1e-5, atol=1e-5)


def test_int8_and_float_shards_do_not_mix(tmp_path):
    c = Corpus(tmp_path)
    int8 = pack_int8(c, tmp_path)
    before = listing(tmp_path)
    for docs, odd, first in (([int8[0], c.shards[1]], c.shards[1], int8[0]), ([c.shards[0], int8[1]], int8[1], c.shards[0])):
        r = run("score", "-q", c.q, "-d", *docs, "-o", tmp_path / "r.tsv", "--cpu")
        kinds = ("float32", "int8") if odd == c.shards[1] else ("int8", "float32")
        assert r.exit_code == 2 and r.stderr == (
            f"lik: error: {odd}: holds {kinds[0]} tokens but {first} holds {kinds[1]}; a corpus is all INT8 or all "
            "float (convert a shard with `lik pack SHARD --int8` or --dtype)\n"), r.stderr
    assert listing(tmp_path) == before


def test_int8_dim_the_gpu_cannot_take(tmp_path, monkeypatch):
    c = Corpus(tmp_path)  # d=20: no multiple of 16
    int8 = pack_int8(c, tmp_path)
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)  # refused before any GPU work
    before = listing(tmp_path)
    r = run("score", "-q", c.q, "-d", *int8, "-o", tmp_path / "r.tsv")
    assert r.exit_code == 2 and r.stderr == (
        f"lik: error: {int8[0]}: INT8 shards of d=20 cannot be scored on the GPU (the INT8 kernels take d a multiple "
        "of 16 up to 4096); pass --cpu\n"), r.stderr
    assert listing(tmp_path) == before


def test_pack_int8_refusals_write_nothing(tmp_path):
    D = np.ones((3, 2, 4), np.float32)
    D[2, 1, 3] = np.nan
    np.save(tmp_path / "d.npy", D)
    np.save(tmp_path / "d8.npy", np.ones((3, 2, 4), np.int8))
    before = listing(tmp_path)
    cases = [
        (["pack", tmp_path / "d.npy", "--int8", "-o", tmp_path / "s"],
         f"lik: error: {tmp_path / 'd.npy'}: document 2, token 1 holds NaN or inf; INT8 quantization needs finite values"),
        (["pack", tmp_path / "d.npy", "--int8", "--dtype", "float16", "-o", tmp_path / "s"],
         "lik: error: --int8: conflicts with --dtype float16; give one of them"),
        (["pack", tmp_path / "d8.npy", "-o", tmp_path / "s"],
         f"lik: error: {tmp_path / 'd8.npy'}: dtype int8 needs its per-token scales"),
    ]
    for args, message in cases:
        r = run(*args)
        assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith(message), (args, r.stderr)
    assert listing(tmp_path) == before


def test_inspect_int8_shard(tmp_path):
    c = Corpus(tmp_path)
    int8 = pack_int8(c, tmp_path)
    r = run("inspect", int8[1], "--check")
    assert r.exit_code == 0, r.stderr
    for words in ("dtype      int8 (one float32 scale per token)", f"token size {DIM + 4} bytes ({DIM} int8 values + a float32 scale)",
                  "scales.npy ", "scales finite and >= 0", '"version": 2',
                  "values     all finite; not L2-normalised"):
        assert words in r.output, words
    r = run("inspect", c.shards[1])
    assert f"token size {DIM * 4} bytes\n" in r.output
    scales = pathlib.Path(int8[1]) / "scales.npy"
    s = np.load(scales)
    s[2] = -1.0
    np.save(scales, s)
    r = run("inspect", int8[1])
    assert r.exit_code == 2 and r.stderr.startswith(f"lik: error: {scales}: scale of token 2 (document 0, token 2) is -1.0")


@pytest.mark.gpu
def test_gpu_score_int8_matches_reference(tmp_path):
    c = Corpus(tmp_path, dim=48)  # the INT8 kernels take dims that are multiples of 16
    int8 = pack_int8(c, tmp_path)
    S = quantized_reference(c, int8)
    top, full = tmp_path / "top.tsv", tmp_path / "full.npy"
    r = run("score", "-q", c.q, "--q-lengths", c.ql, "-d", *int8, "-k", 17, "-o", top)
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    _, docs, scores = read_tsv(top)
    assert_ranking(docs.astype(np.int64), scores, S, 17, 1e-5)
    assert docs[0, -1] == EMPTY_DOC and scores[0, -1] == -np.inf and (scores[2] == 0).all()
    r = run("score", "-q", c.q, "--q-lengths", c.ql, "-d", *int8, "--full-matrix", "-o", full, "--devices", "0")
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    np.testing.assert_allclose(np.load(full), S, rtol=1e-5, atol=1e-5)
    r = run("score", "-q", c.q, "--q-lengths", c.ql, "-d", *int8, "-k", 17, "-o", tmp_path / "cpu.tsv", "--cpu")
    _, cdocs, cscores = read_tsv(tmp_path / "cpu.tsv")
    np.testing.assert_allclose(scores, cscores, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- bad input


def _bad_cases(t, c):
    """(name, args, file named first on the error line). Every case must exit 2 and write nothing."""
    s0, s1 = map(pathlib.Path, c.shards)
    out = str(t / "out.tsv")

    def bad_shard(name, edit):
        d = t / name
        shards.write_shard(d, np.array(shards.open_shard(s1).tokens), shards.open_shard(s1).offsets)
        edit(d)
        return d

    raw = (s0 / "tokens.npy").read_bytes()
    trunc = bad_shard("trunc", lambda d: (d / "tokens.npy").write_bytes(raw[:-37]))
    trunchdr = bad_shard("trunchdr", lambda d: (d / "tokens.npy").write_bytes(raw[:40]))
    notmono = bad_shard("notmono", lambda d: np.save(d / "offsets.npy", np.array([0, 5, 3, 9, 9, 12, 20])))
    short = bad_shard("short", lambda d: np.save(d / "offsets.npy", np.array([0, 5, 6, 9, 9, 12, 19])))
    escape = bad_shard("escape", lambda d: (d / "manifest.json").write_text(
        (d / "manifest.json").read_text().replace('"tokens.npy"', '"../shard0/tokens.npy"')))
    nomanifest = bad_shard("nomanifest", lambda d: (d / "manifest.json").unlink())
    shards.write_shard(t / "dim21", np.zeros((4, 21), np.float32), np.array([0, 4]))
    shards.write_shard(t / "ided", np.array(shards.open_shard(s1).tokens), shards.open_shard(s1).offsets, ids=np.arange(6))
    shards.write_shard(t / "strided", np.array(shards.open_shard(s1).tokens), shards.open_shard(s1).offsets,
                       ids=[str(i) for i in range(6)])
    (t / "text.npy").write_text("this is not numpy\n")
    (t / "empty.npy").write_bytes(b"")
    np.save(t / "obj.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    np.save(t / "q2d.npy", np.zeros((3, 20), np.float32))
    np.save(t / "q64.npy", np.zeros((3, 7, 20), np.float64))
    np.save(t / "qint.npy", np.zeros((3, 7, 20), np.int32))
    np.save(t / "qu16.npy", np.zeros((3, 7, 20), np.uint16))
    np.save(t / "qdim.npy", np.zeros((3, 7, 21), np.float32))
    np.save(t / "q0.npy", np.zeros((0, 7, 20), np.float32))
    np.save(t / "ql_short.npy", np.array([1, 2], np.int32))
    np.save(t / "ql_big.npy", np.array([1, 2, 8], np.int32))
    np.save(t / "pad.npy", np.zeros((4, 5, 20), np.float32))
    np.save(t / "flat.npy", np.zeros((4, 20), np.float32))
    (t / "afile").write_text("x")
    (t / "outdir.tsv").mkdir()

    def S(*extra, queries=c.q, docs=(s0, s1), o=out):
        return ["score", "--queries", queries, "--docs", *docs, "--out", o, "--cpu", *extra]

    p = lambda name: str(t / name)  # noqa: E731
    return [
        ("missing queries", S(queries=p("nope.npy")), p("nope.npy")),
        ("missing shard", S(docs=(s0, p("nope_shard"))), p("nope_shard")),
        ("shard without manifest", S(docs=(s0, nomanifest)), f"{nomanifest}/manifest.json"),
        ("queries not npy", S(queries=p("text.npy")), p("text.npy")),
        ("empty queries file", S(queries=p("empty.npy")), p("empty.npy")),
        ("object dtype", S(queries=p("obj.npy")), p("obj.npy")),
        ("truncated tokens", S(docs=(s0, trunc)), f"{trunc}/tokens.npy"),
        ("truncated header", S(docs=(trunchdr,)), f"{trunchdr}/tokens.npy"),
        ("offsets not monotone", S(docs=(s0, notmono)), f"{notmono}/offsets.npy"),
        ("offsets not ending at T", S(docs=(short,)), f"{short}/offsets.npy"),
        ("manifest path escapes", S(docs=(escape,)), f"{escape}/manifest.json"),
        ("queries rank", S(queries=p("q2d.npy")), p("q2d.npy")),
        ("queries float64", S(queries=p("q64.npy")), p("q64.npy")),
        ("queries int32", S(queries=p("qint.npy")), p("qint.npy")),
        ("uint16 without --bf16-bits", S(queries=p("qu16.npy")), p("qu16.npy")),
        ("no queries", S(queries=p("q0.npy")), p("q0.npy")),
        ("dim queries vs docs", S(queries=p("qdim.npy")), f"{s0}/tokens.npy"),
        ("dim between shards", S(docs=(s0, s1, t / "dim21")), f"{t / 'dim21'}/tokens.npy"),
        ("q lengths count", S("--q-lengths", p("ql_short.npy")), p("ql_short.npy")),
        ("q lengths too big", S("--q-lengths", p("ql_big.npy")), p("ql_big.npy")),
        ("q lengths missing", S("--q-lengths", p("noql.npy")), p("noql.npy")),
        ("lengths for a shard dir", S("--d-lengths", p("ql_short.npy")), "--d-lengths"),
        ("flat docs without doclens", S(docs=(p("flat.npy"),)), p("flat.npy")),
        ("some shards without ids", S(docs=(s0, t / "ided")), str(s0)),
        ("int and str ids", S(docs=(t / "ided", t / "strided")), str(t / "strided")),
        ("no such out dir", S(o=p("nodir/out.tsv")), p("nodir/out.tsv")),
        ("out parent is a file", S(o=p("afile/out.tsv")), p("afile/out.tsv")),
        ("out is a directory", S(o=p("outdir.tsv")), p("outdir.tsv")),
        ("out replaces an input", S(o=c.q), c.q),
        ("out inside a shard", S(o=f"{s0}/res.tsv"), f"{s0}/res.tsv"),
        ("unknown suffix", S(o=p("out.csv")), p("out.csv")),
        ("no suffix", S(o=p("out")), p("out")),
        ("top-k zero", S("--top-k", 0), "--top-k"),
        ("top-k over the limit", S("--top-k", 5000), "--top-k"),
        ("full matrix to tsv", S("--full-matrix"), out),
        ("top-k with the full matrix", S("--full-matrix", "-k", 5, o=p("m.npy")), "--top-k"),
        ("devices and cpu", S("--devices", "0,1"), "--devices"),
        ("devices malformed", [a for a in S("--devices", "0,x") if a != "--cpu"], "--devices"),
        ("device and devices", S("--device", 0, "--devices", "0,1"), "--devices"),
    ]


@pytest.mark.parametrize("text", ["+1", "1_0", "-1", "0,", "", " ", "0,x", "\u0661"])
def test_devices_take_digits_only_as_lik_serve_does(text):
    """int() took "+1" and "1_0" as GPU 1 and 10 (lik serve refused them), and "-1" got as far as the
    GPU count."""
    with pytest.raises(cli.LikError, match="--devices: expected comma-separated GPU indices such as 0,1"):
        cli._parse_devices(text)
    assert cli._parse_devices(" 1,0 ") == [1, 0]


def test_bad_inputs(tmp_path):
    c = Corpus(tmp_path)
    cases = _bad_cases(tmp_path, c)
    before = {p: sorted(os.listdir(p)) for p in [tmp_path, *c.shards]}
    failures = []
    for name, args, culprit in cases:
        r = run(*args)
        lines = r.stderr.splitlines()
        ok = (r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"lik: error: {culprit}: ")
              and "Traceback" not in r.stderr + r.output)
        if not ok:
            failures.append(f"{name}: exit {r.exit_code}, stderr {r.stderr!r}, stdout {r.output!r}")
    assert not failures, "\n".join(failures)
    assert {p: sorted(os.listdir(p)) for p in before} == before, "a failed run left a file behind"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write anywhere")
def test_read_only_output_dir(tmp_path):
    c = Corpus(tmp_path)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = run(*c.args(ro / "out.tsv"))
        assert r.exit_code == 2 and r.stderr == f"lik: error: {ro / 'out.tsv'}: output directory {ro} is not writable\n"
    finally:
        ro.chmod(0o755)


def test_unwritable_output_path(tmp_path, monkeypatch):
    """The same check as above for any user, root included: the directory reports no write access."""
    c = Corpus(tmp_path)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    out = tmp_path / "out.tsv"
    r = run(*c.args(out))
    assert r.exit_code == 2 and r.stderr == f"lik: error: {out}: output directory {tmp_path} is not writable\n"
    assert not out.exists()


def test_debug_shows_traceback(tmp_path):
    r = run("score", "--queries", tmp_path / "nope.npy", "--docs", tmp_path, "--out", tmp_path / "o.tsv", "--debug")
    assert r.exit_code == 2
    assert "Traceback" in r.stderr and "lik: error: " in r.stderr


# --------------------------------------------------------------------------- atomic output


class _Boom:
    """Wraps a library function; raises ``exc`` on call number ``at``."""

    def __init__(self, real, exc, at=2):
        self.real, self.exc, self.at, self.calls = real, exc, at, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        if self.calls == self.at:
            raise self.exc
        return self.real(*a, **kw)


@pytest.mark.parametrize("suffix,extra,fn", [(".tsv", (), "retrieve"), (".jsonl", (), "retrieve"),
                                             (".npy", ("--full-matrix",), "maxsim_varlen")])
@pytest.mark.parametrize("exc,code", [(KeyboardInterrupt(), 130), (RuntimeError("kernel exploded"), 1)])
def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch, suffix, extra, fn, exc, code):
    c = Corpus(tmp_path)
    boom = _Boom(getattr(lik_cupy, fn), exc)
    monkeypatch.setattr(lik_cupy, fn, boom)
    before = listing(tmp_path)
    out = tmp_path / f"res{suffix}"
    r = run(*c.args(out, *extra))
    assert boom.calls == 2  # one call per shard: the second one fails
    assert r.exit_code == code
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("lik: ") and "Traceback" not in r.stderr
    assert listing(tmp_path) == before  # neither the output nor its temporary file


def test_failed_run_keeps_previous_output(tmp_path, monkeypatch):
    c = Corpus(tmp_path)
    out = tmp_path / "res.tsv"
    out.write_text("previous results\n")
    monkeypatch.setattr(lik_cupy, "retrieve", _Boom(lik_cupy.retrieve, KeyboardInterrupt(), at=1))
    r = run(*c.args(out))
    assert r.exit_code == 130
    assert out.read_text() == "previous results\n"


def test_output_file_permissions_follow_umask(tmp_path):
    c = Corpus(tmp_path)
    out = tmp_path / "res.tsv"
    old = os.umask(0o022)
    try:
        assert run(*c.args(out)).exit_code == 0
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o644


# --------------------------------------------------------------------------- real processes


def _env():
    return dict(os.environ, PYTHONPATH=child_pythonpath())


def _lik_command():
    """The installed `lik` console script next to this Python, else `python -m cli`."""
    lik = pathlib.Path(sys.executable).parent / "lik"
    return [str(lik)] if lik.exists() else [sys.executable, "-m", "cli"]


def test_subprocess_run_and_bad_input(tmp_path):
    c = Corpus(tmp_path)
    out = tmp_path / "res.jsonl"
    p = subprocess.run([*_lik_command(), *map(str, c.args(out, "-k", 3))], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    objs = [json.loads(line) for line in out.read_text().splitlines()]
    assert_ranking(np.array([[o["doc"] for o in objs if o["query"] == q] for q in range(NQ)]), None, c.S, 3, 1e-4)
    args = [*_lik_command(), "score", "--queries", str(tmp_path / "missing.npy"), "--docs", *c.shards, "--out", str(out)]
    p = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr == f"lik: error: {tmp_path / 'missing.npy'}: no such file\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses a Linux pty")
def test_progress_bar_only_on_a_tty(tmp_path):
    import pty

    c = Corpus(tmp_path)
    master, slave = pty.openpty()
    args = [sys.executable, "-m", "cli", *map(str, c.args(tmp_path / "r.tsv"))]
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
    assert b"scoring" in b"".join(chunks) and b"docs/s" in b"".join(chunks)
    piped = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, timeout=300)
    assert piped.returncode == 0 and piped.stderr == b"" and piped.stdout == b""


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_sigterm_mid_run_leaves_nothing(tmp_path):
    import signal
    import time

    c = Corpus(tmp_path)
    out = tmp_path / "res.tsv"
    before = listing(tmp_path)
    # Slow every lik_cupy.retrieve call down so the signal lands mid-run.
    code = (
        "import sys, time, lik_cupy, cli\n"
        "real = lik_cupy.retrieve\n"
        "def slow(*a, **k):\n"
        "    time.sleep(0.5)\n"
        "    return real(*a, **k)\n"
        "lik_cupy.retrieve = slow\n"
        "cli.main(sys.argv[1:], prog_name='lik')\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, *map(str, c.args(out))], cwd=tmp_path, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(".lik-tmp." in n for n in listing(tmp_path)):  # scoring has started
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err == "lik: interrupted; no output written\n"
    assert listing(tmp_path) == before


# --------------------------------------------------------------------------- bundled examples


def _examples_module():
    spec = importlib.util.spec_from_file_location("make_examples", REPO / "examples" / "make_examples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bundled_examples_are_reproducible_and_small(tmp_path):
    _examples_module().generate(tmp_path)
    bundled = REPO / "examples"
    names = ["queries.npy", *(f"shard{s}/{f}" for s in (0, 1) for f in ("manifest.json", "tokens.npy", "offsets.npy", "ids.npy"))]
    for name in names:
        assert (bundled / name).read_bytes() == (tmp_path / name).read_bytes(), f"examples/{name} differs from make_examples.py's"
    assert sum((bundled / n).stat().st_size for n in names) < 400_000


def test_readme_main_job_on_the_bundled_examples(tmp_path):
    assert MAIN_JOB in (REPO / "README.md").read_text(), "the README must show the main-job command"
    argv = MAIN_JOB.split()[1:]
    out = tmp_path / "top5.tsv"
    argv[argv.index("--out") + 1] = str(out)
    p = subprocess.run([*_lik_command(), *argv], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr in ("", "lik: no usable GPU found, falling back to CPU (pass --cpu to silence this)\n")
    queries, docs, scores = read_tsv(out, doc_type=str)
    corpus = [shards.open_shard(REPO / "examples" / f"shard{s}") for s in (0, 1)]
    ids = [i for s in corpus for i in s.ids.tolist()]
    ragged = [np.asarray(s.tokens[s.offsets[j] : s.offsets[j + 1]]) for s in corpus for j in range(s.num_docs)]
    S = ref_scores(np.load(REPO / "examples" / "queries.npy"), None, ragged)
    assert_ranking(np.vectorize(ids.index)(docs), scores, S, 5, 2e-3)
    assert docs[:, 0].tolist() == list(_examples_module().PLANTED)
