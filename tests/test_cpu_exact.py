"""The CPU path's promises at BLAS speed (``lik_cupy._cpu``): the argmax is float64's with ties to the
lowest index on every path, however the float32 GEMM rounds; each score is its winners' float64
similarities summed, so it depends on the query and the document alone (bit for bit, whatever the
blocks, layout, padding or other documents) and lies within float64 rounding of the float64 MaxSim;
float64 in, float64 out; temporaries bounded in bytes, however long one document is."""

from __future__ import annotations

import contextlib
import importlib
import queue
import threading
import tracemalloc
import warnings
from concurrent.futures import Future

import ml_dtypes
import numpy as np
import pytest

import lik_cupy
from lik_cupy import _cpu as cpu
from lik_cupy._cpu import cores
from reference import assert_within_rounding, maxsim_ref, rounding_bound
from threads import run_threads

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
NUMPY_BUFFERS = 256 << 10  # NumPy's own: a casting ufunc or reduction buffers 8192 elements, whatever the sizes


_maxsim_module = importlib.import_module("lik_cupy._cpu.maxsim")


def _before_each_call(monkeypatch, module, name: str, hook) -> None:
    """``module.name`` calls ``hook`` with its positional arguments first."""
    real = getattr(module, name)

    def patched(*a, **kw):
        hook(*a)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, patched)


def _thread_counts(monkeypatch) -> list:
    """The thread counts that blocks' chunks run with from now on, as they run."""
    counts = []
    _before_each_call(monkeypatch, cores, "run_chunks", lambda items, work, threads: counts.append(threads))
    return counts


def _share_chunks(monkeypatch) -> list:
    """Every block's chunks shared by three threads, however small the block, in chunks of a few
    documents; returns the thread counts the blocks ran with."""
    monkeypatch.setattr(cores, "chunk_threads", lambda: 3)
    monkeypatch.setattr(_maxsim_module, "_SPLIT_MACS", 1)
    monkeypatch.setattr(_maxsim_module, "_CACHE_BYTES", 64 << 10)
    return _thread_counts(monkeypatch)


@pytest.fixture(params=["one-thread", "chunk-threads"])
def chunk_threads(request, monkeypatch):
    """The test runs twice: as the machine has it (small blocks: one thread), and with every
    block's chunks shared by three threads."""
    if request.param == "one-thread":
        yield
        return
    counts = _share_chunks(monkeypatch)
    yield
    assert max(counts, default=1) > 1, "no block's chunks were shared by threads"


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _argmax64(q, d, q_valid=None, d_valid=None):
    """The float64 argmax (lowest index on ties; -1 for masked query tokens and empty documents)."""
    q64, d64 = np.asarray(q, np.float64), np.asarray(d, np.float64)
    nq, lq, _ = q64.shape
    nd, ld, _ = d64.shape
    qv = np.ones((nq, lq), bool) if q_valid is None else q_valid
    dv = np.ones((nd, ld), bool) if d_valid is None else d_valid
    _, sim = maxsim_ref(q64, d64, qv, dv)
    a = sim.argmax(axis=3) if ld else np.zeros((nq, nd, lq), np.int64)
    a[:, ~dv.any(axis=1)] = -1
    a[np.broadcast_to(~qv[:, None, :], a.shape)] = -1
    return a


# ---------------------------------------------------------------- ties and near-ties on every path


def _copies(rng, dtype, nd=40, ld=90, lq=6, dim=64):
    """Random documents each holding several bitwise-identical copies of the vector that wins for
    query token 0 (the query token itself), at scattered positions: the first copy must win."""
    d = _unit(rng, nd, ld, dim).astype(dtype)
    q = _unit(rng, 2, lq, dim).astype(dtype)
    first = rng.integers(0, ld // 2, nd)
    for j in range(nd):
        for t in (first[j], first[j] + 1 + rng.integers(0, ld // 2 - 1), ld - 1):
            d[j, t] = q[0, 0]
    return q, d, first


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_identical_tokens_take_the_lowest_index_on_every_path(rng, dtype, chunk_threads):
    q, d, first = _copies(rng, DTYPES[dtype])
    nd, ld, dim = d.shape
    want = np.broadcast_to(first, (nd,))
    _, a = lik_cupy.maxsim(q, d, return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(a[0, :, 0], want)
    np.testing.assert_array_equal(a, _argmax64(q, d))
    lens = np.full(nd, ld)  # lengths and masks: the same
    _, a = lik_cupy.maxsim(q, d, d_lengths=lens, return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(a[0, :, 0], want)
    _, a = lik_cupy.maxsim(q, np.stack([d, d[::-1]]), return_argmax=True, backend="cpu")  # candidates
    np.testing.assert_array_equal(a[0, :, 0], want)
    np.testing.assert_array_equal(a[1, :, 0], _argmax64(q[1:], d[::-1])[0, :, 0])
    _, a = lik_cupy.maxsim_pairs(np.repeat(q[:1], nd, axis=0), d, return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(a[:, 0], want)
    off = np.arange(nd + 1) * ld  # packed
    _, a = lik_cupy.maxsim_varlen(q, d.reshape(-1, dim), off, return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(a[0, :, 0], want)
    # the backward follows the argmax: only the first copy gets the gradient
    s, a = lik_cupy.maxsim(q[:1], d, return_argmax=True, backend="cpu")
    _, dD = lik_cupy.maxsim_backward(np.ones_like(s), q[:1], d, a, backend="cpu")
    for j in range(nd):
        got = set(np.flatnonzero(np.any(dD[j] != 0, axis=1)))
        copies = {t for t in range(ld) if np.array_equal(d[j, t], q[0, 0])}
        assert first[j] in got and not (got & copies) - {first[j]}


def test_identical_tokens_int8_and_retrieve(rng):
    q, d, first = _copies(rng, np.float32)
    nd, ld, dim = d.shape
    d8, ds = lik_cupy.quantize_int8(d, backend="cpu")
    _, a = lik_cupy.maxsim_int8(q, d8, ds, return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(a[0, :, 0], first)
    _, a = lik_cupy.maxsim_int8_varlen(q, d8.reshape(-1, dim), ds.reshape(-1), np.arange(nd + 1) * ld,
                                       return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(a[0, :, 0], first)
    # retrieve scores with the same functions (and INT8 is exact: every layout agrees bit for bit)
    s, i = lik_cupy.retrieve(q, d8, 5, d_scales=ds, backend="cpu")
    full = lik_cupy.maxsim_int8(q, d8, ds, backend="cpu")
    np.testing.assert_array_equal(s, np.take_along_axis(full, i, 1))
    s, i = lik_cupy.retrieve(q, d, 5, backend="cpu")
    bound = rounding_bound(q, d)
    assert_within_rounding(s, np.take_along_axis(maxsim_ref(q, d)[0], i, 1), np.take_along_axis(bound, i, 1))


def _near_tie(dtype):
    """Query and document where tokens' exact similarities are base, base + 1 and base + 2 but round to
    one float32 value (base passes 2**24), the largest not first: the float32 GEMM alone would give the
    tie to the lowest index, the wrong token. float16 needs large products to pass 2**24."""
    q0, big = (2.0**15, 2.0**15) if dtype == np.float16 else (1.0, 2.0**25)
    dim = 16
    q = np.zeros((1, 3, dim))
    q[0, :, 0], q[0, :, 1] = q0, 1
    q[0, 2, 2] = 1  # query token 2 sees a third component, which every document token lacks
    d = np.zeros((1, 7, dim))
    d[0, :, 0] = big
    d[0, :, 1] = [0, 1, 0, 2, 1, 0, 0]  # base, base + 1, base, base + 2, base + 1, then two small ones
    d[0, 5:, 0] = 1
    return q.astype(dtype), d.astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_near_ties_resolve_as_float64_does(dtype):
    q, d = _near_tie(DTYPES[dtype])
    g = q.astype(np.float32)[0] @ d.astype(np.float32)[0].T
    assert g[0, 1] == g[0, 3]  # float32 rounds the two apart by nothing ...
    want = _argmax64(q, d)
    assert want[0, 0, 0] == 3  # ... but base + 2 wins
    _, a = lik_cupy.maxsim(q, d, return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(a, want)
    nd = 50  # many documents, the near-tie at every position, so BLAS's blocking varies
    dd = np.repeat(d, nd, axis=0)
    s, a = lik_cupy.maxsim(q, dd, return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(a, np.broadcast_to(want, a.shape))
    assert_within_rounding(s, maxsim_ref(q, dd)[0], rounding_bound(q, dd))
    _, a = lik_cupy.maxsim_varlen(q, dd.reshape(-1, 16), np.arange(nd + 1) * 7, return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(a, np.broadcast_to(want, a.shape))
    _, a = lik_cupy.maxsim(np.repeat(q, 3, 0), np.repeat(dd[None, :4], 3, 0), return_argmax=True, backend="cpu")
    np.testing.assert_array_equal(a, np.broadcast_to(want, a.shape))


@pytest.mark.parametrize("fill", [np.nan, np.inf, 1e30])
@pytest.mark.parametrize("layout", ["padded", "candidates"])
def test_masked_padding_of_any_value_refines_no_pair(rng, monkeypatch, fill, layout):
    """Masked tokens are never used: NaN, inf or huge padding changes no bit and, left out of the
    documents' norm bounds, sends no more pairs to float64 than zero padding (their rounding margin
    was infinite or huge, so every pair was refined: 20x the time of zero padding)."""
    refined = []
    real_add = _maxsim_module.Pending.add

    def add(self, S, runs, c0, j0, rows, docs, thr):
        refined.append(rows.size)
        return real_add(self, S, runs, c0, j0, rows, docs, thr)

    monkeypatch.setattr(_maxsim_module.Pending, "add", add)
    q = _unit(rng, 3, 8, 48).astype(np.float32)
    shape = (20, 40, 48) if layout == "padded" else (3, 7, 40, 48)
    d = _unit(rng, *shape).astype(np.float32)
    mask = np.arange(40) < rng.integers(1, 40, shape[:-2])[..., None]
    want = lik_cupy.maxsim(q, np.where(mask[..., None], d, 0), d_mask=mask, return_argmax=True, backend="cpu")
    zero_padded = sum(refined)  # (random near ties: a few, as a rule none)
    assert zero_padded < want[1].size // 8
    d[~mask] = fill
    got = lik_cupy.maxsim(q, d, d_mask=mask, return_argmax=True, backend="cpu")
    assert sum(refined) == 2 * zero_padded
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x, y)


def test_all_tied_documents_refine_within_the_memory_bound(rng):
    # every token of every document is zero: each query token ties over the whole document, all of it refined
    q = _unit(rng, 2, 8, 32).astype(np.float32)
    d = np.zeros((2000, 64, 32), np.float32)
    qv, dv = np.ones((2, 8), bool), np.ones((2000, 64), bool)
    block = 1 << 20
    tracemalloc.start()
    try:
        s, a = cpu.maxsim_numpy(q, d, qv, dv, candidates=False, nd=2000, return_argmax=True, block_bytes=block)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.all(s == 0) and np.all(a == 0)
    assert peak < s.nbytes + a.nbytes + block * 9 // 8 + NUMPY_BUFFERS


# ---------------------------------------------------------------- float64


def test_float64_in_float64_out(rng):
    nq, lq, nd, ld, dim = 3, 11, 17, 23, 40
    q, d = _unit(rng, nq, lq, dim), _unit(rng, nd, ld, dim)
    qm, dm = rng.random((nq, lq)) < 0.8, rng.random((nd, ld)) < 0.7
    dm[4] = False
    ref, bound = maxsim_ref(q, d, qm, dm)[0], rounding_bound(q, d, qm, dm, dtype=np.float64)
    s, a = lik_cupy.maxsim(q, d, qm, dm, return_argmax=True)  # "auto" with host float64: the CPU
    assert s.dtype == np.float64 and a.dtype == np.int32
    assert_within_rounding(s, ref, bound)
    fin = np.isfinite(ref)
    assert np.max(np.abs(s[fin] - ref[fin])) < 1e-13  # not float32
    np.testing.assert_array_equal(a, _argmax64(q, d, qm, dm))
    sp = lik_cupy.maxsim_pairs(q, d[:nq], backend="cpu")
    assert sp.dtype == np.float64
    assert_within_rounding(sp, np.diagonal(maxsim_ref(q, d[:nq])[0]),
                           np.diagonal(rounding_bound(q, d[:nq], dtype=np.float64)))
    lens = dm.sum(1)
    tok = np.concatenate([d[j, dm[j]] for j in range(nd)])
    off = np.concatenate([[0], np.cumsum(lens)])
    sv, av = lik_cupy.maxsim_varlen(q, tok, off, qm, return_argmax=True, backend="cpu")
    assert sv.dtype == np.float64
    assert_within_rounding(sv, ref, bound)
    g = rng.standard_normal((nq, nd))
    dQ, dD = lik_cupy.maxsim_backward(g, q, d, a, backend="cpu")
    assert dQ.dtype == np.float64 and dD.dtype == np.float64
    rows = np.where(a >= 0, np.arange(nd)[None, :, None] * ld + a, 0)
    want = np.einsum("ijs,ijsk->isk", np.where(a >= 0, g[:, :, None], 0), d.reshape(-1, dim)[rows])
    np.testing.assert_allclose(dQ, want, rtol=1e-12, atol=1e-12)
    rs, ri = lik_cupy.retrieve(q, d, 5, qm, d_mask=dm, backend="cpu")
    assert rs.dtype == np.float64 and ri.dtype == np.int64
    np.testing.assert_array_equal(rs, np.take_along_axis(s, ri, 1))  # the same arithmetic, same blocks
    d8, ds = lik_cupy.quantize_int8(d, backend="cpu")  # a float64 Q against INT8: quantised, float32 scores
    s8 = lik_cupy.maxsim_int8(q, d8, ds, backend="cpu")
    assert s8.dtype == np.float32
    np.testing.assert_array_equal(s8, lik_cupy.maxsim_int8(q.astype(np.float32), d8, ds, backend="cpu"))


# ---------------------------------------------------------------- INT8 past d = 1024


def test_int8_wide_dim_stays_exact(rng):
    dim = 1100  # partial sums of int8 products may pass 2**24: the GEMM runs in float64
    q8 = rng.integers(-127, 128, (2, 5, dim)).astype(np.int8)
    d8 = np.full((3, 7, dim), 127, np.int8)
    d8[1] = rng.integers(-127, 128, (7, dim))
    qs, ds = rng.random((2, 5)).astype(np.float32), rng.random((3, 7)).astype(np.float32)
    s, a = lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs, return_argmax=True, backend="cpu")
    exact = np.einsum("isk,jtk->ijst", q8.astype(np.int64), d8.astype(np.int64))
    sim = exact.astype(np.float32) * ds[None, :, None, :]  # the kernels' arithmetic
    np.testing.assert_array_equal(a, sim.argmax(axis=3))
    want = (sim.max(axis=3) * qs[:, None, :]).astype(np.float32).sum(axis=2, dtype=np.float64).astype(np.float32)
    np.testing.assert_array_equal(s, want)


# ---------------------------------------------------------------- memory


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class _LatePool:
    """A chunk-thread pool as a busy machine runs one: each of its two threads keeps its last work
    item (the function and arguments, done or cancelled) until it takes the next, which comes with
    the caller's next block. ``ThreadPoolExecutor`` lets go of an item a moment after completing it:
    on a loaded machine, a moment in which the caller may start its next block."""

    def __init__(self):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(2):
            threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while (item := self._items.get()) is not None:  # the last item stays referenced meanwhile
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(e)

    def submit(self, fn, *args) -> Future:
        future = Future()
        self._items.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = True) -> None:
        for _ in range(2):
            self._items.put(None)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_candidate_sets_of_converted_tokens_stay_within_block_bytes(rng, dtype):
    """Candidate sets whose tokens need converting for the GEMM kept the last block's converted
    tokens alive beside the next one's: 1.8x block_bytes."""
    nq, lq, dim, ld, k, block = 2, 8, 64, 300, 100, 3 << 20
    q = rng.standard_normal((nq, lq, dim)).astype(dtype)
    d = rng.standard_normal((nq * k, ld, dim)).astype(dtype)
    qv, dv = np.ones((nq, lq), bool), np.ones((nq * k, ld), bool)

    def run():
        return cpu.maxsim_numpy(q, d, qv, dv, candidates=True, nd=k, return_argmax=False, block_bytes=block)
    run()
    assert _peak(run) < nq * k * 4 + block * 9 // 8 + NUMPY_BUFFERS


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("what", ["tied", "nan"])
def test_one_pair_with_every_column_a_candidate_stays_within_block_bytes(rng, layout, what):
    """One long document whose tokens all tie (or hold a NaN) makes every column of a run a
    candidate of one pair: it was decided at once, 3-6x block_bytes. Now in slices, with the
    same winner: the first of the maxima, or the first NaN."""
    n, dim, block = 30_000, 129, 256 << 10
    tok = np.ones((n, dim), np.float32) if what == "tied" else rng.standard_normal((n, dim)).astype(np.float32)
    if what == "nan":
        tok[20_007, 3] = tok[25_000, 1] = np.nan
    q, qv = np.ones((1, 2, dim), np.float32), np.ones((1, 2), bool)

    def run(b):
        if layout == "packed":
            return cpu.maxsim_packed_numpy(q, qv, tok, np.array([0, n]), return_argmax=True, block_bytes=b)
        return cpu.maxsim_numpy(q, tok[None], qv, np.ones((1, n), bool), candidates=False, nd=1, return_argmax=True,
                                block_bytes=b)
    run(block)
    assert _peak(lambda: run(block)) < 2 * 4 + 2 * 4 + block * 9 // 8 + NUMPY_BUFFERS
    (s, a), (s1, a1) = run(block), run(1 << 30)
    np.testing.assert_array_equal(s, s1)
    np.testing.assert_array_equal(a, a1)
    assert (a == (0 if what == "tied" else 20_007)).all() and (np.isnan(s) if what == "nan" else s == 2 * dim).all()


@pytest.mark.parametrize("what", ["tied", "nan"])
def test_pairs_of_one_long_and_many_short_documents_stay_within_block_bytes(rng, what):
    """The pairs float64 decides, one packed document of 250 tokens among 2,000 of two: each piece of
    pairs was gathered as [pairs, its longest document], about 3x block_bytes, though the sum of their
    lengths fitted. Now a piece's pairs times its longest document fit, with the same winners."""
    lq, dim, block = 8, 16, 1 << 20
    lens = np.r_[250, np.full(2000, 2)]
    tok = rng.standard_normal((int(lens.sum()), dim)).astype(np.float32)
    off = np.concatenate([[0], np.cumsum(lens)])
    q = np.zeros((1, lq, dim), np.float32)  # tied: every similarity 0; nan: every one NaN
    if what == "nan":
        q[0, :, 0] = np.nan
    qv = np.ones((1, lq), bool)

    def run(b):
        return cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=True, block_bytes=b)
    run(block)
    outputs = lens.size * (4 + lq * 4)
    assert _peak(lambda: run(block)) < outputs + block * 9 // 8 + NUMPY_BUFFERS
    s, a = run(block)
    assert (a == 0).all() and (np.isnan(s) if what == "nan" else s == 0).all()


@pytest.fixture
def late_pool(request, monkeypatch):
    """With the chunk-threads variant: a ``_LatePool`` for the blocks' chunks."""
    if "chunk-threads" not in request.node.callspec.id:
        yield
        return
    pool = _LatePool()
    monkeypatch.setattr(cores, "_pool", pool)
    monkeypatch.setattr(cores, "_pool_size", 2)
    yield
    pool.shutdown()


@pytest.mark.parametrize("argmax", [False, True])
@pytest.mark.parametrize("layout", ["padded", "candidates", "packed", "int8"])
def test_temporaries_stay_within_block_bytes(rng, layout, argmax, chunk_threads, late_pool):
    """Deterministic on a busy machine too: the chunk threads hold what they ran for as long as they
    can (``_LatePool``); they once kept a finished block alive beside the next one."""
    nq, lq, nd, ld, dim = 3, 16, 3000, 40, 32
    q = _unit(rng, nq, lq, dim).astype(np.float16)
    qv = np.ones((nq, lq), bool)
    block = 1 << 20
    per_query = nd  # documents each query scores
    if layout == "candidates":
        nd *= 2  # a query's whole similarity matrix well past the block
        per_query = nd // nq
        d = _unit(rng, nd, ld, dim).astype(np.float16)
        dv = rng.random(d.shape[:2]) < 0.9

        def run(b):
            return cpu.maxsim_numpy(q, d, qv, dv, candidates=True, nd=per_query, return_argmax=argmax, block_bytes=b)
    elif layout == "packed":
        lens = rng.integers(0, 2 * ld, nd)
        tok = _unit(rng, int(lens.sum()), dim).astype(np.float16)
        off = np.concatenate([[0], np.cumsum(lens)])

        def run(b):
            return cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=argmax, block_bytes=b)
    else:
        d = _unit(rng, nd, ld, dim).astype(np.float16)
        dv = rng.random((nd, ld)) < 0.9
        kw = {}
        if layout == "int8":
            q8, qs = lik_cupy.quantize_int8(q, backend="cpu")
            d8, ds = lik_cupy.quantize_int8(d, backend="cpu")
            q, d, kw = q8, d8, {"q_scale": qs, "d_scale": ds}

        def run(b):
            return cpu.maxsim_numpy(q, d, qv, dv, candidates=False, nd=nd, return_argmax=argmax, block_bytes=b, **kw)
    outputs = nq * per_query * (4 + (lq * 4 if argmax else 0))  # scores and argmax
    one_query = per_query * lq * ld * 4  # a query's similarities with every document it scores
    run(block)  # (once first: the chunk threads' pool and NumPy's lazy imports are made once a process)
    small = _peak(lambda: run(block))
    assert small < outputs + block * 9 // 8 + NUMPY_BUFFERS, (small, outputs, block)
    assert small < one_query / 2
    assert _peak(lambda: run(1 << 30)) > one_query / 2  # one block: a query's whole similarity matrix at once


@pytest.mark.parametrize("argmax", [False, True])
@pytest.mark.parametrize("layout", ["padded", "packed", "int8"])
def test_a_long_document_stays_within_block_bytes(rng, layout, argmax):
    # one document of 100,000 tokens (3.2 MB as float32 similarities with 8 query tokens, 6.4 MB of tokens
    # in float32) among short ones: scored in runs of its tokens, with the whole document's scores and argmax
    lq, dim, long = 8, 16, 100_000
    q = _unit(rng, 2, lq, dim).astype(np.float16)
    qv = np.ones((2, lq), bool)
    lens = np.array([3, long, 0, 5])
    tok = _unit(rng, int(lens.sum()), dim).astype(np.float16)
    tok[50_000 + 3] = q[1, 2]  # a winner with a copy in a later run
    tok[90_000 + 3] = q[1, 2]
    off = np.concatenate([[0], np.cumsum(lens)])
    d, dv = cpu.unpack(tok, off)
    kw = {}
    if layout == "int8":
        q, qs = lik_cupy.quantize_int8(q, backend="cpu")
        d, ds = lik_cupy.quantize_int8(d, backend="cpu")
        kw = {"q_scale": qs, "d_scale": ds}
    block = 1 << 20

    def run(b):
        if layout == "packed":
            return cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=argmax, block_bytes=b)
        return cpu.maxsim_numpy(q, d, qv, dv, candidates=False, nd=4, return_argmax=argmax, block_bytes=b, **kw)
    small = _peak(lambda: run(block))
    assert small < block * 9 // 8 + NUMPY_BUFFERS, small
    s, a = run(block)
    s1, a1 = run(1 << 30)  # the whole document at once
    np.testing.assert_array_equal(s, s1)
    if argmax:
        np.testing.assert_array_equal(a, a1)
        assert a[1, 1, 2] == 50_000


@pytest.mark.parametrize("layout", ["padded", "candidates", "packed"])
def test_the_tokens_first_gemm_changes_no_bit_and_stays_within_block_bytes(rng, layout, chunk_threads, monkeypatch):
    """Without the compiled fold (``fold.py``), a GEMM of few query rows runs with the document tokens
    as its rows (``_TOKENS_FIRST_ROWS``), through a scratch counted in the block's budget: the same
    scores and argmax, bit for bit, as the plain GEMM (the reference similarities decide them), within
    the same memory bound."""
    monkeypatch.setenv("LIK_DISABLE_NUMBA", "1")
    lq, nd, ld, dim = 16, 1500, 60, 64  # three queries' 48 rows to one GEMM
    q = _unit(rng, 3, lq, dim).astype(np.float32)
    qv = rng.random((3, lq)) < 0.9
    d = _unit(rng, nd, ld, dim).astype(np.float32)
    d[7, 11] = d[7, 40]  # an exact tie: the lower index wins either way
    q[1, 3] = d[7, 11]
    dv = rng.random((nd, ld)) < 0.9
    qv[1, 3] = dv[7, 11] = dv[7, 40] = True
    lens = rng.integers(0, 2 * ld, nd)
    tok = _unit(rng, int(lens.sum()), dim).astype(np.float32)
    off = np.concatenate([[0], np.cumsum(lens)])
    # the smallest block that takes it with three chunk threads (the one-thread variant: as many as the machine has)
    block = 16 * max(3, cores.chunk_threads()) * _maxsim_module._TOKENS_FIRST_BYTES
    used = []
    _before_each_call(monkeypatch, _maxsim_module._Buffers, "scratch", lambda *a: used.append(1))

    def run():
        if layout == "packed":
            return cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=True, block_bytes=block)
        if layout == "candidates":
            return cpu.maxsim_numpy(q, d, qv, dv[:nd], candidates=True, nd=nd // 3, return_argmax=True,
                                    block_bytes=block)
        return cpu.maxsim_numpy(q, d, qv, dv, candidates=False, nd=nd, return_argmax=True, block_bytes=block)
    s, a = run()
    assert used
    outputs = s.nbytes + a.nbytes
    assert _peak(run) < outputs + block * 9 // 8 + NUMPY_BUFFERS
    monkeypatch.setattr(_maxsim_module, "_TOKENS_FIRST_ROWS", 0)
    used.clear()
    s1, a1 = run()
    assert not used
    np.testing.assert_array_equal(s, s1)
    np.testing.assert_array_equal(a, a1)
    if layout == "padded":
        assert a[1, 7, 3] == 11


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_blocks_are_evened_out(rng, layout, monkeypatch):
    """Documents that need several blocks go in as few, evened out: 16 documents of which 15 fit a
    block went 15 then 1, and the lone one ran on BLAS's threads, which then spin for a while and
    slowed the next call's chunk threads. The scores are those of one block."""
    lq, nd, ld, dim = 8, 16, 256, 32
    q = _unit(rng, 1, lq, dim).astype(np.float32)
    qv = np.ones((1, lq), bool)
    d = _unit(rng, nd, ld, dim).astype(np.float32)
    dv = np.ones((nd, ld), bool)
    off = np.arange(nd + 1, dtype=np.int64) * ld
    m = _maxsim_module
    ar = m._Arith.of(np.float32, dim, False)
    # (packed documents hold their passes' temporaries unless the compiled fold finds the winners)
    bu = m._Budget.of(lq, dim, np.float32, ar, False, packed=layout == "packed" and not m._folded(ar, 1))
    block = bu.fixed + 15 * (ld * bu.per_token + bu.per_doc)  # 15 documents
    assert m._Buffers(ar, block).reserved == 0  # (no tokens-first scratch taken out of so small a block)
    sizes = []
    _before_each_call(monkeypatch, m, "_block_maxima", lambda Q, v, blk, *a: sizes.append(blk.runs.count))

    def run(b):
        if layout == "packed":
            return cpu.maxsim_packed_numpy(q, qv, d.reshape(-1, dim), off, return_argmax=True, block_bytes=b)[0]
        return cpu.maxsim_numpy(q, d, qv, dv, candidates=False, nd=nd, return_argmax=True, block_bytes=b)[0]
    s = run(block)
    assert sizes == [8, 8], sizes
    sizes.clear()
    np.testing.assert_array_equal(s, run(1 << 30))
    assert sizes == [16]


def test_many_candidate_sets_take_the_plain_gemm(rng):
    """Pairs (one candidate set a query) whose rows together pass the tokens-first scratch keep the
    plain batched GEMM: its pieces hold one token of every set at least."""
    q = _unit(rng, 5000, 32, 16).astype(np.float32)
    d = _unit(rng, 5000, 5, 16).astype(np.float32)
    s, a = lik_cupy.maxsim_pairs(q, d, return_argmax=True, backend="cpu")
    sims = np.einsum("bqd,btd->bqt", q.astype(np.float64), d.astype(np.float64))
    np.testing.assert_array_equal(a, sims.argmax(-1))
    np.testing.assert_allclose(s, sims.max(-1).sum(-1), rtol=1e-6)


def test_backward_temporaries_stay_within_block_bytes(rng):
    nq, lq, nd, ld, dim = 4, 16, 3000, 40, 32
    q = _unit(rng, nq, lq, dim).astype(np.float32)
    d = _unit(rng, nd, ld, dim).astype(np.float32)
    _, a = lik_cupy.maxsim(q, d, return_argmax=True, backend="cpu")
    g = rng.standard_normal((nq, nd)).astype(np.float32)
    start = np.broadcast_to(np.arange(nd) * ld, (nq, nd))
    dflat = d.reshape(-1, dim)
    outputs = q.nbytes * 2 + dflat.nbytes * 2  # dQ and dD in float64
    block = 1 << 20
    peak = _peak(lambda: cpu.maxsim_backward_numpy(g, q, dflat, a, start, block_bytes=block))
    assert peak < outputs + block + NUMPY_BUFFERS
    assert peak < outputs + nq * nd * lq * dim * 8 / 4  # the old path gathered every entry's row in float64
    dq, dd = cpu.maxsim_backward_numpy(g, q, dflat, a, start, block_bytes=block)
    dq1, dd1 = cpu.maxsim_backward_numpy(g, q, dflat, a, start, block_bytes=1 << 30)
    np.testing.assert_allclose(dq, dq1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dd, dd1, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- what the scores promise


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scores_depend_on_the_query_and_the_document_alone(rng, dtype, chunk_threads):
    """The same query against the same document scores bit for bit alike whatever the blocks (a
    long document in runs of its tokens included), the layout (padded, masked, packed, candidate
    sets, pairs), the query's padding and the documents beside it: what the distributed scorer
    and lik score's chunks rely on. Near ties, identical tokens and NaN included."""
    nq, lq, nd, ld, dim = 3, 9, 60, 33, 24
    q = _unit(rng, nq, lq, dim).astype(DTYPES[dtype])
    d = _unit(rng, nd, ld, dim).astype(DTYPES[dtype])
    d[::7, 5:9] = d[::7, 2:3]  # identical tokens
    d[3::11, 4] = q[0, 1]  # winners with copies
    d[3::11, 20] = q[0, 1]
    d[5, 7, 0] = np.nan
    qv = rng.random((nq, lq)) < 0.8
    dv = rng.random((nd, ld)) < 0.75
    dv[9] = False
    s, a = lik_cupy.maxsim(q, d, qv, dv, return_argmax=True, backend="cpu")
    assert_within_rounding(s, maxsim_ref(q, d, qv, dv)[0], rounding_bound(q, d, qv, dv, dtype=s.dtype))
    np.testing.assert_array_equal(a, _argmax64(q, d, qv, dv))

    def same(got, argmax=None):
        np.testing.assert_array_equal(got, s)
        if argmax is not None:
            np.testing.assert_array_equal(argmax, a)

    for block in (3000, 40_000):  # runs of a few tokens, many documents per block
        same(*cpu.maxsim_numpy(q, d, qv, dv, candidates=False, nd=nd, return_argmax=True, block_bytes=block))
    got = cpu.maxsim_numpy(q, d[:8], qv, dv[:8], candidates=False, nd=8, return_argmax=True, block_bytes=1)
    np.testing.assert_array_equal(got[0], s[:, :8])  # a token at a time
    np.testing.assert_array_equal(got[1], a[:, :8])
    lens = dv.sum(1)
    tok = np.concatenate([d[j, dv[j]] for j in range(nd)])
    off = np.concatenate([[0], np.cumsum(lens)])
    local = np.where(a >= 0, np.cumsum(dv, axis=1)[np.arange(nd)[None, :, None], np.maximum(a, 0)] - 1, -1)
    for block in (3000, 1 << 26):
        got = cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=True, block_bytes=block)
        np.testing.assert_array_equal(got[0], s)
        np.testing.assert_array_equal(got[1], local)  # the same winners, counted among the valid tokens
    wide = np.zeros((nq, lq + 6, dim), q.dtype)  # padded further, the padding garbage
    wide[:, :lq] = q
    wide[:, lq:] = 7
    wv = np.zeros((nq, lq + 6), bool)
    wv[:, :lq] = qv
    same(lik_cupy.maxsim(wide, d, wv, dv, backend="cpu"))
    perm = np.stack([rng.permutation(nd) for _ in range(nq)])  # candidate sets: each query its own order
    sc = lik_cupy.maxsim(q, d[perm], qv, dv[perm], backend="cpu")
    np.testing.assert_array_equal(sc, np.take_along_axis(s, perm, 1))
    for i in range(nq):
        sp = lik_cupy.maxsim_pairs(np.repeat(q[i:i + 1], nd, 0), d, np.repeat(qv[i:i + 1], nd, 0), dv, backend="cpu")
        np.testing.assert_array_equal(sp, s[i])
        one = lik_cupy.maxsim(q[i, qv[i]], d[20:45], d_mask=dv[20:45], backend="cpu")  # the query alone, unpadded
        np.testing.assert_array_equal(one, s[i, 20:45])
    shards = [(tok[:off[25]], off[:26]), (tok[off[25]:], off[25:] - off[25])]  # a corpus in two shards
    rs, ri = lik_cupy.retrieve(q, shards, 10, qv, backend="cpu")
    np.testing.assert_array_equal(rs, np.take_along_axis(s, ri, 1))


def test_a_query_scores_alike_whatever_the_other_queries(rng):
    q = _unit(rng, 6, 20, 64).astype(np.float32)
    d = _unit(rng, 70, 50, 64).astype(np.float32)
    s, a = lik_cupy.maxsim(q, d, return_argmax=True, backend="cpu")
    for i in (0, 3, 5):
        si, ai = lik_cupy.maxsim(q[i:i + 1], d, return_argmax=True, backend="cpu")
        np.testing.assert_array_equal(si[0], s[i])
        np.testing.assert_array_equal(ai[0], a[i])


def test_nan_and_overflow_follow_float64():
    # 3e38 * 2 overflows float32 but not float64: the GEMM's inf max is recomputed, and the score is float64's
    q = np.zeros((1, 2, 4), np.float32)
    q[0, 0, :2] = [3e38, 3e38]
    q[0, 1, 0] = 1
    d = np.zeros((2, 3, 4), np.float32)
    d[0, 1, :2] = [2, -1.5]  # 3e38 * 0.5 exactly, after an overflowing partial sum
    d[1, 0, 0] = np.nan
    s, a = lik_cupy.maxsim(q, d, return_argmax=True, backend="cpu")
    ref = maxsim_ref(q, d)[0]
    assert np.isnan(s[0, 1]) and np.isnan(ref[0, 1])
    assert s[0, 0] == np.float32(ref[0, 0]) and np.isfinite(s[0, 0])
    assert a[0, 0].tolist() == [1, 1] and a[0, 1].tolist() == [0, 0]  # NaN wins, at its first index



def test_scores_round_to_their_dtype_whatever_numpys_error_state():
    """A float64 sum beyond float32's range rounds to inf, and one below its subnormals to 0 (INT8's
    maxima times a tiny query scale too): the documented rounding, whatever the caller's
    ``np.seterr`` (an over- or underflow raised FloatingPointError from the cast, or warned)."""
    q = np.zeros((1, 2, 4), np.float32)
    q[0, :, 0] = [3e19, 1e-25]
    d = np.zeros((2, 3, 4), np.float32)
    d[0, 1, 0] = 3e19  # 9e38: a float64 score past float32's largest
    d[1, 2, 0] = 1e-25  # 1e-50 + 9e-6: finite; a query of the tiny token alone underflows to 0
    with np.errstate(all="raise"):
        s, a = lik_cupy.maxsim(q, d, return_argmax=True, backend="cpu")
        s1 = lik_cupy.maxsim(q[:, 1:], d[1:], backend="cpu")
        sv = lik_cupy.maxsim_varlen(q, d.reshape(-1, 4), np.array([0, 3, 6]), backend="cpu")
        q8 = np.ones((1, 1, 4), np.int8)
        d8 = np.ones((1, 1, 4), np.int8)
        s8 = lik_cupy.maxsim_int8(q8, d8, np.full((1, 1), 1e-30, np.float32),
                                  q_scales=np.full((1, 1), 1e-30, np.float32), backend="cpu")
    ref = maxsim_ref(q, d)[0]
    assert s[0, 0] == np.inf and ref[0, 0] > np.finfo(np.float32).max
    assert s[0, 1] == np.float32(ref[0, 1])
    np.testing.assert_array_equal(s, sv)
    assert a[0, 0].tolist() == [1, 1] and a[0, 1].tolist() == [2, 2]
    assert s1[0, 0] == 0 and s1.dtype == np.float32
    assert s8[0, 0] == 0


# ---------------------------------------------------------------- chunk threads


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8"])
def test_chunk_threads_change_no_bit(rng, monkeypatch, dtype):
    """A block's chunks shared by threads: the same scores and argmax bit for bit on every layout,
    near ties, identical tokens, NaN and masks included."""
    nq, lq, nd, ld, dim = 3, 7, 150, 29, 24
    q = _unit(rng, nq, lq, dim)
    d = _unit(rng, nd, ld, dim)
    d[::5, 3:6] = d[::5, 1:2]  # identical tokens
    d[2::9, 4] = d[2::9, 20] = q[0, 1]  # winners with copies
    d[7, 2, 0] = np.nan
    qv = rng.random((nq, lq)) < 0.85
    dv = rng.random((nd, ld)) < 0.8
    dv[11] = False
    lens = dv.sum(1)
    off = np.concatenate([[0], np.cumsum(lens)])
    perm = np.stack([rng.permutation(nd) for _ in range(nq)])
    kw = {}
    if dtype == "int8":
        d[7, 2, 0] = 0
        q, qs = lik_cupy.quantize_int8(q.astype(np.float32), backend="cpu")
        d, ds = lik_cupy.quantize_int8(d.astype(np.float32), backend="cpu")
        kw = {"q_scale": qs, "d_scale": ds}
    else:
        q, d = q.astype(DTYPES[dtype]), d.astype(DTYPES[dtype])
    tok = np.concatenate([d[j, dv[j]] for j in range(nd)])

    def every_layout():
        out = [cpu.maxsim_numpy(q, d, qv, dv, candidates=False, nd=nd, return_argmax=True, **kw),
               cpu.maxsim_numpy(q, d, qv, dv, candidates=False, nd=nd, return_argmax=False, **kw),
               cpu.maxsim_numpy(q, d[:4], qv, dv[:4], candidates=False, nd=4, return_argmax=True,
                                block_bytes=3000, **{k: v[:4] if k == "d_scale" else v for k, v in kw.items()})]
        if dtype != "int8":
            out += [cpu.maxsim_numpy(q, d[perm].reshape(-1, ld, dim), qv, dv[perm].reshape(-1, ld),
                                     candidates=True, nd=nd, return_argmax=True),
                    cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=True),
                    cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=True, block_bytes=40_000)]
        return out

    want = every_layout()
    counts = _share_chunks(monkeypatch)
    got = every_layout()
    assert max(counts) > 1
    for (s0, a0), (s1, a1) in zip(want, got):
        np.testing.assert_array_equal(s1, s0)
        if a0 is not None:
            np.testing.assert_array_equal(a1, a0)
    if dtype != "int8":
        np.testing.assert_array_equal(got[0][1], _argmax64(q, d, qv, dv))


def _numpy_openblas():
    blas = cores._numpy_openblas()
    if blas is None or blas.get() < 2:
        pytest.skip("NumPy's BLAS is not a multithreaded OpenBLAS whose threads lik_cupy sets")
    return blas


def _one_query_corpus(rng, nq=1):
    return _unit(rng, nq, 8, 32).astype(np.float32), _unit(rng, 300, 20, 32).astype(np.float32)


def test_blas_threads_come_back_after_concurrent_calls(rng, monkeypatch):
    blas = _numpy_openblas()
    before = blas.get()
    _share_chunks(monkeypatch)
    during = []
    _before_each_call(monkeypatch, _maxsim_module, "margin", lambda *a: during.append(blas.get()))
    q, d = _one_query_corpus(rng, 2)
    want = lik_cupy.maxsim(q, d, return_argmax=True, backend="cpu")
    results = [None] * 4

    def call(k):
        results[k] = lik_cupy.maxsim(q, d, return_argmax=True, backend="cpu")

    run_threads(4, call)
    assert blas.get() == before
    assert set(during) == {1}  # every GEMM beside the chunk threads ran on one core
    for s, a in results:
        np.testing.assert_array_equal(s, want[0])
        np.testing.assert_array_equal(a, want[1])


def test_a_call_growing_the_pool_leaves_another_calls_pool_usable(monkeypatch):
    """A call that needs more chunk threads replaces the pool while another call, which has just
    taken the old one, is about to hand it its chunks: they still run (the old pool, shut down,
    raised RuntimeError 'cannot schedule new futures after shutdown' to that other call)."""
    real = cores._single_threaded_blas
    monkeypatch.setattr(cores, "_pool", None)
    monkeypatch.setattr(cores, "_pool_size", 0)
    done, entered = [], []

    def work(k, claims):
        done.extend(claims)

    @contextlib.contextmanager
    def another_call_first():
        entered.append(1)
        if len(entered) == 1:  # the first call, between taking the pool and submitting: a larger one runs meanwhile
            t = threading.Thread(target=cores.run_chunks, args=(["b"] * 4, work, 4))
            t.start()
            t.join()
        with real():
            yield

    monkeypatch.setattr(cores, "_single_threaded_blas", another_call_first)
    cores.run_chunks(["a"] * 4, work, 2)
    assert sorted(done) == ["a"] * 4 + ["b"] * 4


def test_blas_threads_come_back_after_an_error(rng, monkeypatch):
    blas = _numpy_openblas()
    before = blas.get()
    _share_chunks(monkeypatch)
    calls = []

    def fifth_fails(*a):
        calls.append(1)
        if len(calls) == 5:
            raise MemoryError("a chunk failed")

    _before_each_call(monkeypatch, _maxsim_module, "margin", fifth_fails)
    q, d = _one_query_corpus(rng)
    with pytest.raises(MemoryError, match="a chunk failed"):
        lik_cupy.maxsim(q, d, backend="cpu")
    assert blas.get() == before


def test_one_blas_thread_set_by_the_caller_runs_chunks_on_one_thread(rng, monkeypatch):
    blas = _numpy_openblas()
    before = blas.get()
    counts = _thread_counts(monkeypatch)
    monkeypatch.setattr(_maxsim_module, "_SPLIT_MACS", 1)
    q, d = _one_query_corpus(rng)
    want = lik_cupy.maxsim(q, d, backend="cpu")
    assert max(counts) > 1
    counts.clear()
    blas.set(1)
    try:
        got = lik_cupy.maxsim(q, d, backend="cpu")
        assert blas.get() == 1
    finally:
        blas.set(before)
    assert counts and set(counts) == {1}
    np.testing.assert_array_equal(got, want)


def test_a_block_too_small_to_share_runs_blas_on_one_thread(rng, monkeypatch):
    # Too small for chunk threads is too small for BLAS's own: their hand-over costs more than they
    # save (on a busy machine, many times the GEMM). BLAS's count comes back after.
    blas = _numpy_openblas()
    before = blas.get()
    monkeypatch.setattr(_maxsim_module, "_SPLIT_MACS", 1 << 40)
    during = []
    _before_each_call(monkeypatch, _maxsim_module, "margin", lambda *a: during.append(blas.get()))
    q, d = _one_query_corpus(rng)
    got = lik_cupy.maxsim(q, d, backend="cpu")
    assert during and set(during) == {1}
    assert blas.get() == before
    monkeypatch.undo()
    np.testing.assert_array_equal(got, lik_cupy.maxsim(q, d, backend="cpu"))


def test_runs_compare_a_float64_threshold_as_float32_does(rng):
    # float32 similarities against float64 thresholds near, on and between float32 values, huge and
    # tiny ones, NaN and infinities: the least float32 at or above each threshold answers alike
    from lik_cupy._cpu.runs import Runs

    lens = np.array([3, 0, 5, 1, 7])
    runs = Runs.packed(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    S = rng.standard_normal((4, lens.sum())).astype(np.float32)
    S[0, :3] = [np.inf, -np.inf, np.nan]
    base = S.astype(np.float64)
    thr = np.empty((4, lens.size))
    for j, (c0, n) in enumerate(zip(runs.start, lens)):
        v = base[:, c0] if n else np.zeros(4)
        thr[:, j] = v + rng.choice([-1.0, 0.0, 1.0], 4) * np.spacing(v.astype(np.float32)) / 3
    thr[1] = [1e39, -1e39, np.inf, -np.inf, np.nan]
    thr[2, :2] = [1e-46, -1e-46]
    want = S.astype(np.float64) >= np.repeat(thr, lens, axis=1)
    assert np.array_equal(runs.compare(S, thr), want)


@pytest.mark.parametrize("budget", [1 << 20, 64])  # the hits listed, or reduced per document
def test_runs_hits_match_first_and_second_hits(rng, budget):
    from lik_cupy._cpu.runs import Runs

    lens = rng.integers(0, 9, 40)
    lens[:3] = [0, 1, 8]
    runs = Runs.packed(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    m, n = 6, int(lens.sum())
    hit = rng.random((m, n)) < 0.15
    ok = (rng.random((m, lens.size)) < 0.8) & (lens > 0)
    cols_ok = np.repeat(ok, lens, axis=1)
    hit &= cols_ok  # no hit outside the ok documents, one at least in each of them
    for r, j in zip(*np.nonzero(ok)):
        hit[r, runs.start[j] + rng.integers(lens[j])] = True
    old = hit.copy()
    first_old = runs.first_hit(old)
    r_old, j_old = runs.second_hits(old, first_old, ok, budget)
    new = hit.copy()
    first, r, j = runs.hits(new, ok, budget)
    assert np.array_equal(first, first_old) and np.array_equal(new, old)
    assert np.array_equal(r, r_old) and np.array_equal(j, j_old)


def _mixed_calls(rng) -> list:
    """Calls of every CPU entry point over shapes, dtypes and layouts of their own: ``[fn() -> results]``."""
    calls = []
    for t, dt in enumerate(["float16", "bfloat16", "float32", "float64"] * 2):
        nq, lq, nd, ld, dim = (int(v) for v in (rng.integers(1, 4), rng.integers(1, 20), rng.integers(5, 90),
                                                rng.integers(1, 40), rng.choice([8, 24, 64])))
        q = _unit(rng, nq, lq, dim).astype(DTYPES[dt])
        d = _unit(rng, nd, ld, dim).astype(DTYPES[dt])
        d[::3, 1:] = d[::3, :1]  # identical tokens: ties to the lowest index
        dl = rng.integers(0, ld + 1, nd)
        off = np.concatenate([[0], np.cumsum(dl)])
        tok = np.concatenate([d[j, :dl[j]] for j in range(nd)])
        cand = _unit(rng, nq, 4, ld, dim).astype(DTYPES[dt])
        calls += [lambda q=q, d=d, dl=dl: lik_cupy.maxsim(q, d, d_lengths=dl, return_argmax=True, backend="cpu"),
                  lambda q=q, c=cand: lik_cupy.maxsim(q, c, return_argmax=True, backend="cpu"),
                  lambda q=q, tok=tok, off=off: lik_cupy.maxsim_varlen(q, tok, off, return_argmax=True, backend="cpu"),
                  lambda q=q, d=d, k=min(5, nd): lik_cupy.retrieve(q, d, k, backend="cpu")]
        if t < 2:
            continue
        q32 = q.astype(np.float32)
        d8, s8 = lik_cupy.quantize_int8(d.astype(np.float32), backend="cpu")
        f8, sf = lik_cupy.quantize_fp8(d.astype(np.float32), backend="cpu")
        calls += [lambda q=q32, d8=d8, s8=s8, dl=dl: lik_cupy.maxsim_int8(q, d8, s8, d_lengths=dl, return_argmax=True,
                                                                          backend="cpu"),
                  lambda q=q32, f8=f8, sf=sf: lik_cupy.maxsim_fp8(q, f8, sf, return_argmax=True, backend="cpu")]
        s, a = lik_cupy.maxsim(q, d, return_argmax=True, backend="cpu")
        g = rng.standard_normal(s.shape).astype(np.float32)
        calls.append(lambda g=g, q=q, d=d, a=a: lik_cupy.maxsim_backward(g, q, d, a, backend="cpu"))
    return calls


def test_sixteen_threads_of_mixed_calls_get_the_serial_results(rng, chunk_threads):
    """Calls from many threads at once (a service's workers, a thread pool), each of every entry point
    in turn over shapes and dtypes of its own, with the chunk threads shared between them: every
    result bit for bit the serial one."""
    calls = _mixed_calls(rng)
    want = [fn() for fn in calls]
    got: dict = {}
    orders = [rng.permutation(len(calls)) for _ in range(16)]  # each thread its own order

    def work(k):
        for i in orders[k]:
            got[k, i] = calls[i]()

    run_threads(16, work)
    assert len(got) == 16 * len(calls)
    for (_, i), res in got.items():
        for x, y in zip(res, want[i]):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("dtype,bits", [(np.float16, 0x7C01), (np.float32, 0x7F800001)])
@pytest.mark.parametrize("where", ["Q", "D"])
def test_a_signalling_nan_scores_nan_without_a_warning(dtype, bits, where):
    """A NaN is an input the CPU path takes (the NaN contract); a signalling one (a bit pattern a file
    can hold) made NumPy's conversions warn 'invalid value encountered in cast' (an error under
    -W error) in the forward, the winners' dot products, retrieve, the backward and the INT8
    quantiser. It scores NaN like any other."""
    rng = np.random.default_rng(5)
    Q = rng.standard_normal((2, 4, 16)).astype(dtype)
    D = rng.standard_normal((3, 5, 16)).astype(dtype)
    (Q if where == "Q" else D).view(np.uint16 if dtype == np.float16 else np.uint32)[0, 1, 3] = bits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s, a = lik_cupy.maxsim(Q, D, return_argmax=True, backend="cpu")
        lik_cupy.maxsim_varlen(Q, D.reshape(-1, 16), np.arange(0, 16, 5), backend="cpu")
        lik_cupy.retrieve(Q, D, 2, backend="cpu")
        lik_cupy.maxsim_backward(np.ones_like(s), Q, D, a, backend="cpu")
        with pytest.raises(ValueError, match="NaN or inf") if where == "D" else contextlib.nullcontext():
            lik_cupy.quantize_int8(D, backend="cpu")  # (a NaN token is refused: the error alone)
    assert np.isnan(s[0]).all() if where == "Q" else (np.isnan(s[:, 0]).all() and not np.isnan(s[:, 1:]).any())


def test_a_long_query_takes_square_blocks_of_a_short_document(monkeypatch):
    """A query too long for one block with a whole document took the document a few tokens at a time,
    each block with every query row, so each block's work on its rows (norms, float64 copies, maxima)
    came once per few tokens: a 512k-token query against 80 documents of 40 took 74 s where 128k took
    2.2. Blocks now take the query's rows in slices against runs at least as long (or the whole
    document), with the same bits as one block."""
    from lik_cupy._cpu import maxsim as cpu_maxsim

    rng = np.random.default_rng(3)
    Q = rng.standard_normal((1, 20000, 16)).astype(np.float32)
    D = rng.standard_normal((3, 200, 16)).astype(np.float32)
    qv, dv = np.ones((1, 20000), bool), rng.random((3, 200)) < 0.9
    blocks = []
    real = cpu_maxsim._block_maxima

    def recording(Q, q_valid, blk, *args):
        blocks.append((Q.shape[1], blk.T.shape[1]))
        return real(Q, q_valid, blk, *args)

    monkeypatch.setattr(cpu_maxsim, "_block_maxima", recording)
    small = cpu_maxsim.maxsim_numpy(Q, D, qv, dv, candidates=False, nd=3, return_argmax=True, block_bytes=1 << 20)
    assert blocks and all(tokens >= min(200, rows) for rows, tokens in blocks), sorted(set(blocks))[:5]
    whole = cpu_maxsim.maxsim_numpy(Q, D, qv, dv, candidates=False, nd=3, return_argmax=True, block_bytes=1 << 30)
    assert small[0].tobytes() == whole[0].tobytes() and np.array_equal(small[1], whole[1])


@pytest.mark.parametrize("layout", ["padded", "packed", "candidates"])
def test_a_long_query_against_short_documents_stays_within_block_bytes(rng, layout):
    """A query whose rows alone pass the bound, against documents of 0 to 3 tokens: a document that
    fitted one run was scored with all the query's rows at once, 9-45x block_bytes. Now in blocks of
    its rows, with the same scores and winners."""
    nq, lq, dim, block = 2, 6000, 128, 1 << 20
    q = rng.standard_normal((nq, lq, dim)).astype(np.float32)
    qv = rng.random((nq, lq)) < 0.9
    lens = np.array([1, 0, 3, 2])
    tok = rng.standard_normal((int(lens.sum()), dim)).astype(np.float32)
    off = np.concatenate([[0], np.cumsum(lens)])
    d, dv = cpu.unpack(tok, off)
    nd = lens.size

    def run(b):
        if layout == "packed":
            return cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=True, block_bytes=b)
        if layout == "candidates":
            return cpu.maxsim_numpy(q, np.concatenate([d, d]), qv, np.concatenate([dv, dv]), candidates=True, nd=nd,
                                    return_argmax=True, block_bytes=b)
        return cpu.maxsim_numpy(q, d, qv, dv, candidates=False, nd=nd, return_argmax=True, block_bytes=b)
    run(block)
    outputs = nq * nd * (4 + lq * 4)
    so_far = nq * lq * 16  # each query's maxima and winners over the document so far
    assert _peak(lambda: run(block)) < outputs + so_far + block * 9 // 8 + NUMPY_BUFFERS
    (s, a), (s1, a1) = run(block), run(1 << 30)
    np.testing.assert_array_equal(s, s1)
    np.testing.assert_array_equal(a, a1)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_long_query_with_a_wide_d_stays_within_block_bytes(rng, dtype):
    """Blocks of a long query's rows counted their tokens in the GEMM's dtype only, not their float64
    copy for the winners' dot products (8 bytes a dimension more): 1.4-1.6x block_bytes at d = 512."""
    lq, n, dim, block = 4000, 4000, 512, 2 << 20
    q = rng.standard_normal((1, lq, dim)).astype(dtype)
    tok = rng.standard_normal((n, dim)).astype(dtype)
    qv, off = np.ones((1, lq), bool), np.array([0, n])

    def run(b):
        return cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=True, block_bytes=b)
    run(block)
    assert _peak(lambda: run(block)) < lq * 4 + lq * 16 + block * 9 // 8 + NUMPY_BUFFERS


def _random_call(seed: int):
    """A seeded random call of the NumPy path: layout (padded, packed, candidates), dtype (float16,
    bfloat16, float32, float64, INT8, FP8), shapes from 1 to thousands of tokens (a long query or
    document now and then), d from 1 to 512, masks, argmax; returns (run(block_bytes), outputs' bytes,
    the queries' token count)."""
    rng = np.random.default_rng(seed)
    layout = ["padded", "packed", "candidates"][rng.integers(3)]
    dt = ["float16", "bfloat16", "float32", "float64", "int8", "fp8"][rng.integers(6)]
    dim = int(rng.choice([1, 2, 7, 16, 33, 64, 128, 256, 512]))
    nq, lq, nd, ld = (int(np.exp(rng.uniform(0, np.log(hi)))) for hi in (6, 6000, 40, 6000))
    while nq * lq * nd * ld * dim > 2e9 and nd > 1:
        nd //= 2
    argmax, masks = bool(rng.integers(2)), bool(rng.integers(2))

    def make(shape):
        if dt == "int8":
            return rng.integers(-127, 128, shape).astype(np.int8)
        x = rng.standard_normal(shape).astype(np.float32)
        return x.astype({"bfloat16": ml_dtypes.bfloat16, "fp8": ml_dtypes.float8_e4m3fn}.get(dt, dt))
    q = make((nq, lq, dim))
    qv = rng.random((nq, lq)) < 0.8 if masks else np.ones((nq, lq), bool)
    scaled = dt in ("int8", "fp8")
    qs = rng.random((nq, lq)).astype(np.float32) if scaled else None
    if layout == "packed":
        lens = rng.integers(0, 2 * ld + 1, nd)
        tok = make((int(lens.sum()), dim))
        off = np.concatenate([[0], np.cumsum(lens)])
        ds = rng.random(tok.shape[0]).astype(np.float32) if scaled else None

        def run(b):
            return cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=argmax, block_bytes=b, q_scale=qs, d_scale=ds)
    else:
        rows = nq * nd if layout == "candidates" else nd
        d = make((rows, ld, dim))
        dv = rng.random((rows, ld)) < 0.8 if masks else np.ones((rows, ld), bool)
        ds = rng.random((rows, ld)).astype(np.float32) if scaled else None

        def run(b):
            return cpu.maxsim_numpy(q, d, qv, dv, candidates=layout == "candidates", nd=nd, return_argmax=argmax,
                                    block_bytes=b, q_scale=qs, d_scale=ds)
    return run, nq * nd * (8 + (lq * 4 if argmax else 0)), nq * lq


@pytest.mark.parametrize("seed", [1, 35, 41, 44, 53, 70, 73, 88, 127, 142])
def test_random_calls_stay_within_block_bytes_and_are_blocking_independent(seed):
    """The module's bound on random shapes (the seeds include long queries against short documents,
    which passed it 3-45x; 70 and 127 held a long document's larger similarity block into the next
    block, 1.05x and 1.17x, and 142 alternates row blocks whose buffers must not be held both at once;
    53 gathered the winners' query rows outside their piece's share, 1.004x),
    and the same bits with a block as large as the call."""
    run, outputs, query_tokens = _random_call(seed)
    block = [256 << 10, 1 << 20, 4 << 20][seed % 3]
    run(block)
    assert _peak(lambda: run(block)) < outputs + query_tokens * 16 + block * 9 // 8 + NUMPY_BUFFERS
    (s, a), (s1, a1) = run(block), run(1 << 30)
    np.testing.assert_array_equal(s, s1)
    if a is not None:
        np.testing.assert_array_equal(a, a1)
