"""lik_cupy.serving on the GPU: batched requests bitwise the unbatched Corpus calls (float16, bfloat16,
float32 at both precisions, INT8; queries of one length and of mixed lengths; a corpus in GPU memory and
one in page-locked host memory), requests scored inline bitwise the queued ones, and routing over two
GPUs. The CPU side: tests/test_serve.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import lik_cupy
from lik_cupy.serving import Batcher, Observer
from lik_cupy._shard_format import numpy_dtype
from threads import run_threads

pytestmark = pytest.mark.gpu

DIM = 128


class _Devices(Observer):
    def __init__(self):
        self.batches, self.lock = [], threading.Lock()

    def batch(self, device, op, requests, queries, compute_s):
        with self.lock:
            self.batches.append((device, queries))


def _corpus(rng, dtype, device=0, nd=3000, max_gpu_bytes=None):
    lens = rng.integers(1, 200, nd)
    off = np.concatenate([[0], np.cumsum(lens)])
    D = rng.standard_normal((int(off[-1]), DIM)).astype(np.float32)
    D /= np.linalg.norm(D, axis=1, keepdims=True)
    if dtype == "int8":
        D8, s8 = lik_cupy.quantize_int8(D, backend="cpu")
        return lik_cupy.Corpus(D8, d_offsets=off, d_scales=s8, device=device, max_gpu_bytes=max_gpu_bytes)
    return lik_cupy.Corpus(D.astype(numpy_dtype(dtype)), d_offsets=off, device=device, max_gpu_bytes=max_gpu_bytes)


def _check_batched_equals_single(corpus, qs, precision, replicas=None, workers=16):
    rng = np.random.default_rng(3)
    cands = [rng.integers(0, len(corpus), 100) for _ in qs]
    seen = _Devices()
    with Batcher(replicas or corpus, max_batch=32, max_delay_us=2000, observer=seen) as b:
        b.warm()
        def client(t):
            for j in range(t, len(qs), workers):
                q, kw = qs[j], {"precision": precision}
                if j % 3 == 0:
                    s, i = b.search(q, 10, **kw)
                    s1, i1 = corpus.search(q, 10, **kw)
                    assert np.array_equal(s, s1, equal_nan=True) and np.array_equal(i, i1), f"search, query {j}"
                elif j % 3 == 1:
                    got, want = b.rerank(q, cands[j], **kw), corpus.rerank(q, cands[j], **kw)
                    assert np.array_equal(got, want, equal_nan=True), f"rerank, query {j}"
                else:
                    got, want = b.score(q, **kw), corpus.score(q, **kw)
                    assert np.array_equal(got, want, equal_nan=True), f"score, query {j}"

        run_threads(workers, client)
    assert max(n for _, n in seen.batches) > 1  # some requests did share a call
    return seen


@pytest.mark.parametrize("dtype,precision", [("float16", None), ("bfloat16", None), ("float32", "fp32"),
                                             ("float32", "tf32"), ("int8", None)])
@pytest.mark.parametrize("lengths", ["32", "mixed"])
def test_batched_requests_are_bitwise_the_unbatched_calls(dtype, precision, lengths):
    rng = np.random.default_rng(1)
    corpus = _corpus(rng, dtype)
    lq = np.full(96, 32) if lengths == "32" else rng.integers(1, 300, 96)
    qdtype = "float32" if dtype == "int8" else dtype
    qs = [rng.standard_normal((int(n), DIM)).astype(numpy_dtype(qdtype)) for n in lq]
    _check_batched_equals_single(corpus, qs, precision)


def test_batched_requests_on_a_page_locked_corpus_are_bitwise_the_unbatched_calls():
    rng = np.random.default_rng(2)
    corpus = _corpus(rng, "float16", max_gpu_bytes=0)
    assert corpus.where == "pinned host memory"
    qs = [rng.standard_normal((32, DIM)).astype(np.float16) for _ in range(48)]
    _check_batched_equals_single(corpus, qs, None)


@pytest.mark.parametrize("dtype,precision", [("float16", None), ("float32", "fp32"), ("int8", None)])
def test_inline_requests_are_bitwise_the_queued_ones_and_the_calls(dtype, precision, monkeypatch):
    """A request scored inline runs on the worker's stream and buffers from another thread (while the
    worker waits): the same bits as through the worker and as the Corpus call, then the worker goes on."""
    from lik_cupy.serving import _queue

    monkeypatch.setattr(_queue, "INLINE_MAX_S", 60.0)  # (the rule's time cap, apart from what is tested here)
    rng = np.random.default_rng(8)
    corpus = _corpus(rng, dtype, nd=500)
    qdtype = "float32" if dtype == "int8" else dtype
    qs = [rng.standard_normal((int(n), DIM)).astype(numpy_dtype(qdtype)) for n in (32, 7, 100)]
    cand = rng.integers(0, len(corpus), 64)
    kw = {"precision": precision}
    with Batcher(corpus) as b:
        b.warm()
        for q in qs:
            calls = {"search": (10, corpus.search(q, 10, **kw)), "rerank": (cand, corpus.rerank(q, cand, **kw)),
                     "score": (None, corpus.score(q, **kw))}
            for op, (arg, want) in calls.items():
                queued = b.submit(op, q, arg, **kw).result()
                f = b.submit(op, q, arg, inline=True, **kw)
                assert f.done(), op  # scored before submit returned
                got = f.result()
                for x, y, z in (zip(queued, got, want) if op == "search" else [(queued, got, want)]):
                    assert np.array_equal(x, y, equal_nan=True) and np.array_equal(y, z, equal_nan=True), op
        assert np.array_equal(b.score(qs[0], **kw), corpus.score(qs[0], **kw))  # the worker after them


def test_two_gpus_share_the_load():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    rng = np.random.default_rng(4)
    replicas = [_corpus(np.random.default_rng(5), "float16", device=d) for d in (0, 1)]
    qs = [rng.standard_normal((32, DIM)).astype(np.float16) for _ in range(192)]
    seen = _check_batched_equals_single(replicas[0], qs, None, replicas=replicas, workers=32)
    assert {d for d, _ in seen.batches} == {"cuda:0", "cuda:1"}


def test_two_workers_on_one_gpu_each_on_its_own_stream():
    rng = np.random.default_rng(6)
    corpus = _corpus(rng, "float16")
    qs = [rng.standard_normal((32, DIM)).astype(np.float16) for _ in range(96)]
    seen = _check_batched_equals_single(corpus, qs, None, replicas=[corpus, corpus], workers=32)
    assert {d for d, _ in seen.batches} == {"cuda:0", "cuda:0#1"}


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]], ids=["two parts on one GPU", "two GPUs"])
def test_a_partition_answers_as_the_whole_corpus(devices):
    """A corpus split in two parts (on one GPU, or one part a GPU): scores within float rounding of the
    whole corpus's (each part's call takes the kernels its own size selects), search's ids equal
    wherever the scores do not tie within that rounding, rerank and score column for column."""
    import cupy

    from lik_cupy.serving._partition import Partition

    if max(devices) >= cupy.cuda.runtime.getDeviceCount():
        pytest.skip(f"needs {max(devices) + 1} GPUs")
    rng = np.random.default_rng(41)
    lens = rng.integers(1, 200, 2500)
    off = np.concatenate([[0], np.cumsum(lens)])
    D = rng.standard_normal((int(off[-1]), DIM)).astype(np.float32)
    D = (D / np.linalg.norm(D, axis=1, keepdims=True)).astype(np.float16)
    ids = np.arange(len(lens)) * 7 + 1
    whole = lik_cupy.Corpus(D, d_offsets=off, ids=ids, device=0)
    cut = 1100
    parts = [lik_cupy.Corpus(D[:off[cut]], d_offsets=off[:cut + 1], device=devices[0]),
             lik_cupy.Corpus(D[off[cut]:], d_offsets=off[cut:] - off[cut], device=devices[1])]
    queries = [rng.standard_normal((int(n), DIM)).astype(np.float16) for n in rng.integers(4, 64, 12)]
    with Batcher(Partition(parts, ids), max_batch=8, max_delay_us=1000) as b:
        b.warm()
        for q in queries:
            s, i = b.search(q, 20)
            s1, i1 = whole.search(q, 20)
            np.testing.assert_allclose(s, s1, rtol=1e-5, atol=1e-5)
            apart = np.abs(np.diff(s1)) > 1e-4  # no tie within rounding: the order is decided
            same = np.concatenate([[True], apart]) & np.concatenate([apart, [True]])
            assert np.array_equal(i[same], i1[same])
            cand = rng.integers(0, len(lens), 300)
            np.testing.assert_allclose(b.rerank(q, cand), whole.rerank(q, cand), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(b.score(q), whole.score(q), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]], ids=["two parts on one GPU", "two GPUs"])
def test_a_partitions_staged_batches_are_bitwise_its_calls(devices):
    """A queued batch on GPU parts moves by each part's Staging (Partition.staged) instead of the packed
    host path: a request alone gets the bits of the partition's own call of its query, in whichever
    thread the parts run (the rule picks threads first, then the calling thread for short calls)."""
    from concurrent.futures import Future

    import cupy

    from lik_cupy.serving import _partition
    from lik_cupy.serving._queue import Request, scored
    from lik_cupy.serving._staging import Staging

    if max(devices) >= cupy.cuda.runtime.getDeviceCount():
        pytest.skip(f"needs {max(devices) + 1} GPUs")
    rng = np.random.default_rng(43)
    parts = [_corpus(rng, "float16", device=d, nd=n) for d, n in zip(devices, (700, 1300))]
    P = _partition.Partition(parts, np.arange(2000) * 3 + 1)
    assert P.stageable(np.dtype(np.float16)) and not P.stageable(np.dtype(np.float64))
    try:
        for n, q in enumerate(rng.standard_normal((int(m), DIM)).astype(np.float16) for m in (32, 5, 32, 77, 32, 32)):
            off = np.array([0, len(q)])
            cand = rng.integers(0, 2000 if n % 2 else 700, (1, 300))  # odd: both parts; even: the first only
            for op, arg, want in (("search", 25, P.search(q, 25, q_offsets=off)),
                                  ("rerank", cand, (P.rerank(q, cand, q_offsets=off),)),
                                  ("score", None, (P.score(q, q_offsets=off),))):
                got = scored(P, [Request(op, q[None], arg, None, True, None, Future(), 0.0)], Staging())[0]
                for x, y in zip(got if op == "search" else (got,), want):
                    assert np.array_equal(x, y[0], equal_nan=True), (op, n)
    finally:
        P.close()
