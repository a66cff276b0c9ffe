"""The CPU path's compiled fold (``lik_cupy/_cpu/fold.py``, the ``cpu`` extra): each document's argmax,
max, second max and winners' reference similarities in one pass over the tokens-first GEMM, with the
NumPy passes' results bit for bit, and NumPy's passes wherever Numba is missing, broken or switched off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import lik_cupy
from lik_cupy import _cpu as cpu
from lik_cupy._cpu import cores, fold
from lik_cupy._cpu.refine import dot64
from test_cpu_exact import NUMPY_BUFFERS, _peak

pytest.importorskip("numba")

REPO = Path(__file__).resolve().parents[1]
_maxsim_module = sys.modules["lik_cupy._cpu.maxsim"]


def _pieces(monkeypatch) -> list:
    """The pieces folded from now on (rows, p0, p1), as they are."""
    seen = []
    real = fold.DocumentFold.piece

    def piece(self, St, p0, p1):
        seen.append((St.shape[1], p0, p1))
        return real(self, St, p0, p1)

    monkeypatch.setattr(fold.DocumentFold, "piece", piece)
    return seen


def _both(monkeypatch, run):
    """``run()`` with the NumPy passes, then with the compiled fold (which must have run)."""
    monkeypatch.setenv("LIK_DISABLE_NUMBA", "1")
    plain = run()
    monkeypatch.setenv("LIK_DISABLE_NUMBA", "0")
    seen = _pieces(monkeypatch)
    folded = run()
    assert seen, "the compiled fold did not run"
    return plain, folded


def _assert_same(a, b):
    a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _awkward(rng, shape, dtype):
    """Unit-ish tokens with the cases the fold must get right: copies of a token (exact ties, and a
    second max equal to the max), a NaN, infinities of both signs and a zero vector."""
    x = rng.standard_normal(shape)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    flat = x.reshape(-1, shape[-1])
    n = flat.shape[0]
    if n > 8:
        flat[1::5] = flat[0::5][:flat[1::5].shape[0]]
        flat[rng.integers(n)] = 0
        flat[rng.integers(n), 0] = np.nan
        flat[rng.integers(n), -1] = np.inf
        flat[rng.integers(n), 0] = -np.inf
    return x.astype(dtype)


DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("lq", [1, 32, 100])  # 100: more rows than a token's int64 offsets serve (_WIDE_ROWS)
@pytest.mark.parametrize("threads", ["one", "three"])
def test_padded_documents_fold_to_the_numpy_passes_bits(rng, monkeypatch, dtype, lq, threads):
    if threads == "three":
        monkeypatch.setattr(cores, "chunk_threads", lambda: 3)
        monkeypatch.setattr(_maxsim_module, "_SPLIT_MACS", 1)
        monkeypatch.setattr(_maxsim_module, "_CACHE_BYTES", 64 << 10)
        monkeypatch.setattr(_maxsim_module, "_PIECE_COLUMNS", 48)  # pieces ending inside documents
    q = _awkward(rng, (2, lq, 24), DTYPES[dtype])
    d = _awkward(rng, (150, 37, 24), DTYPES[dtype])
    d_lengths = rng.integers(0, 38, 150)
    q_lengths = np.array([lq, max(1, lq // 2)])
    plain, folded = _both(monkeypatch, lambda: lik_cupy.maxsim(q, d, q_lengths=q_lengths, d_lengths=d_lengths,
                                                               backend="cpu", return_argmax=True))
    _assert_same(plain, folded)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_packed_documents_fold_to_the_numpy_passes_bits(rng, monkeypatch, dtype):
    monkeypatch.setattr(_maxsim_module, "_PIECE_COLUMNS", 64)
    lens = rng.integers(0, 90, 400)
    lens[[3, 4, 5]] = 0  # empty documents, back to back
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tok = _awkward(rng, (int(off[-1]), 40), DTYPES[dtype])
    q = _awkward(rng, (3, 20, 40), DTYPES[dtype])
    for argmax in (False, True):
        plain, folded = _both(monkeypatch, lambda: lik_cupy.maxsim_varlen(q, tok, off, backend="cpu",
                                                                          return_argmax=argmax))
        _assert_same(plain, folded)


def test_a_long_document_in_runs_folds_to_the_numpy_passes_bits(rng, monkeypatch):
    """A document past ``block_bytes`` goes in runs of its tokens against blocks of the query's rows."""
    q = _awkward(rng, (1, 300, 64), np.float32)
    tok = _awkward(rng, (5000, 64), np.float32)
    off = np.array([0, 10, 4990, 5000], np.int64)
    qv = np.ones((1, 300), bool)

    def run():
        return cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=True, block_bytes=1 << 20)
    plain, folded = _both(monkeypatch, run)
    _assert_same(plain, folded)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_folded_blocks_count_their_chunk_buffers_not_every_similarity(rng, monkeypatch, layout):
    """A block the fold scores holds each chunk thread's buffer of one chunk, not a similarity per
    query row and token: with few threads its budget takes more documents a block, within the bound and
    with the same bits as one block; with many threads (buffers past the bound) the per-token count stays."""
    monkeypatch.setattr(_maxsim_module, "_CACHE_BYTES", 64 << 10)
    monkeypatch.setattr(_maxsim_module, "_SPLIT_MACS", 1)
    nq, lq, nd, ld, dim, block = 4, 32, 300, 60, 32, 2 << 20
    q = rng.standard_normal((nq, lq, dim)).astype(np.float32)
    qv = np.ones((nq, lq), bool)
    if layout == "padded":
        d = rng.standard_normal((nd, ld, dim)).astype(np.float32)
        dv = np.ones((nd, ld), bool)

        def run(b):
            return cpu.maxsim_numpy(q, d, qv, dv, candidates=False, nd=nd, return_argmax=True, block_bytes=b)
    else:
        lens = rng.integers(1, 2 * ld, nd)
        tok = rng.standard_normal((int(lens.sum()), dim)).astype(np.float32)
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)

        def run(b):
            return cpu.maxsim_packed_numpy(q, qv, tok, off, return_argmax=True, block_bytes=b)
    blocks = []
    real = _maxsim_module._block_maxima
    monkeypatch.setattr(_maxsim_module, "_block_maxima", lambda *a: blocks.append(a[2].runs.count) or real(*a))
    whole = run(1 << 30)
    counts = {}
    for threads in (3, 64):  # 64 threads' buffers of 64 KiB pass the 2 MiB bound
        monkeypatch.setattr(cores, "chunk_threads", lambda: threads)
        run(block)
        blocks.clear()
        peak = _peak(lambda: _assert_same(run(block), whole))
        counts[threads] = len(blocks)
        assert peak < whole[0].nbytes + whole[1].nbytes + block * 9 // 8 + NUMPY_BUFFERS, (threads, peak)
    sims = nq * lq * 4 * (nd * ld if layout == "padded" else int(lens.sum()))  # the per-token count's share alone
    assert counts[64] >= sims // block  # per token: at least one block per block_bytes of similarities
    assert counts[3] < counts[64], counts


def _plain_fold(St, valid, start, length, A64, T):
    """The fold's results by a loop over the columns (module docstring of ``fold.py``)."""
    rows, nb = St.shape[1], start.size
    first = np.zeros((rows, nb), np.int64)
    best = np.full((rows, nb), -np.inf, St.dtype)
    second = np.full((rows, nb), -np.inf, St.dtype)
    win = np.full((rows, nb), -np.inf)
    for j in range(nb):
        cols = [c for c in range(start[j], start[j] + length[j]) if valid is None or valid[c]]
        for r in range(rows):
            vals = [St[c, r] for c in cols]
            finite = [v for v in vals if not np.isnan(v)]
            if finite and max(finite) > -np.inf:
                k = int(np.argmax(finite))
                first[r, j] = [c for c in cols if not np.isnan(St[c, r])][k] - start[j]
                best[r, j] = finite[k]
                second[r, j] = max(finite[:k] + finite[k + 1:], default=-np.inf)
            if any(np.isnan(v) for v in vals):
                best[r, j] = np.nan
            if length[j]:
                win[r, j] = np.add.reduce(A64[r] * T[start[j] + first[r, j]].astype(np.float64))
    return first, best, second, win


@pytest.mark.parametrize("rows", [1, 7, 65])
@pytest.mark.parametrize("masked", [False, True])
def test_the_fold_against_a_loop_over_the_columns(rng, rows, masked):
    assert fold.available()
    lens = rng.integers(0, 12, 40)
    start = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    n = int(lens.sum())
    St = np.round(rng.standard_normal((n, rows)), 1).astype(np.float32)  # rounded: many exact ties
    St[rng.integers(n, size=3), rng.integers(rows, size=3)] = np.nan
    St[rng.integers(n, size=3), rng.integers(rows, size=3)] = -np.inf
    valid = rng.random(n) < 0.8 if masked else None
    T = rng.standard_normal((n, 33)).astype(np.float32)
    A64 = rng.standard_normal((rows, 33)) * np.exp2(rng.integers(-20, 20, (rows, 33)))
    f = fold.DocumentFold(start, lens.astype(np.int64), valid, A64, T, np.float32)
    cuts = sorted({0, n, *rng.integers(0, n + 1, 6).tolist()})  # pieces that split documents anywhere
    for p0, p1 in zip(cuts[:-1], cuts[1:]):
        f.piece(St, p0, p1)
    want = _plain_fold(St, valid, start, lens, A64, T)
    got = (f.first, f.best, f.second, f.win)
    for name, w, g in zip(("first", "best", "second", "win"), want, got):
        np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("d", [1, 5, 8, 9, 64, 127, 128, 129, 300, 1024, 5000])
def test_the_compiled_sums_are_numpys_pairwise_sums(rng, d):
    """``refine.dot64`` (NumPy) and the fold's winners (compiled) sum alike, at the lengths where NumPy's
    pairwise summation changes shape, on products whose sums round at every step."""
    from lik_cupy._cpu.fold_kernels import dot, scratch
    for _ in range(50):
        a = rng.standard_normal(d) * np.exp2(rng.integers(-60, 60, d))
        b = rng.standard_normal(d).astype(np.float32)
        assert dot(a, b, *scratch(d)) == dot64(a, b)


def test_without_numba_the_numpy_passes_run(rng, monkeypatch):
    q = _awkward(rng, (1, 9, 16), np.float32)
    d = _awkward(rng, (30, 20, 16), np.float32)
    want = lik_cupy.maxsim(q, d, backend="cpu", return_argmax=True)
    monkeypatch.setattr(fold, "_kernel", None)
    monkeypatch.setattr(fold.importlib.util, "find_spec", lambda name, *a: None if name == "numba" else 1)
    seen = _pieces(monkeypatch)
    assert not fold.available()
    _assert_same(lik_cupy.maxsim(q, d, backend="cpu", return_argmax=True), want)
    assert not seen


def test_a_numba_that_fails_warns_once_and_leaves_the_numpy_passes(rng, monkeypatch):
    q = _awkward(rng, (1, 9, 16), np.float32)
    d = _awkward(rng, (30, 20, 16), np.float32)
    want = lik_cupy.maxsim(q, d, backend="cpu")
    monkeypatch.setattr(fold, "_kernel", None)
    monkeypatch.setitem(sys.modules, "lik_cupy._cpu.fold_kernels", None)  # its import raises ImportError
    monkeypatch.delattr(cpu, "fold_kernels", raising=False)
    with pytest.warns(RuntimeWarning, match="compiled fold is not used .ModuleNotFoundError"):
        got = lik_cupy.maxsim(q, d, backend="cpu")
    np.testing.assert_array_equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(lik_cupy.maxsim(q, d, backend="cpu"), want)


def test_a_numba_whose_sums_differ_from_numpys_is_not_used(monkeypatch):
    from lik_cupy._cpu import fold_kernels

    real = fold_kernels.dot
    monkeypatch.setattr(fold, "_kernel", None)
    monkeypatch.setattr(fold_kernels, "dot", lambda a, b, *s: np.nextafter(real(a, b, *s), np.inf))
    with pytest.warns(RuntimeWarning, match="differ from NumPy's"):
        assert not fold.available()


@pytest.mark.parametrize("value, on", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_lik_disable_numba(monkeypatch, value, on):
    monkeypatch.setenv("LIK_DISABLE_NUMBA", value)
    assert fold.available() is not on


def test_lik_disable_numba_refuses_a_near_miss(monkeypatch):
    monkeypatch.setenv("LIK_DISABLE_NUMBA", "on")
    with pytest.raises(ValueError, match="LIK_DISABLE_NUMBA"):
        fold.available()


def test_numba_is_imported_by_a_cpu_call_not_by_the_package(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import lik_cupy
        assert "numba" not in sys.modules
        q = np.ones((1, 3, 4), np.float32)
        lik_cupy.maxsim(q, q, backend="cpu")
        assert "numba" in sys.modules
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "LIK_DISABLE_NUMBA"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_tokens_widen_as_their_own_cast(monkeypatch, dtype):
    """Every float16 or bfloat16 value (NaNs, infinities, subnormals, -0.0 among them), bit for bit
    their own cast."""
    assert fold.available()
    x = np.arange(1 << 16, dtype=np.uint16).view(DTYPES[dtype]).reshape(2, 256, 128)
    with np.errstate(invalid="ignore"):
        want = x.astype(np.float32)
    got = fold.float32_tokens(x[:, ::2])  # (a strided view: copied first)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got.view(np.uint32), np.ascontiguousarray(want[:, ::2]).view(np.uint32))
    big = np.random.default_rng(0).integers(0, 1 << 16, 3 << 20, dtype=np.uint16).view(DTYPES[dtype])
    seen = []
    real = cores.run_chunks
    monkeypatch.setattr(cores, "run_chunks", lambda items, work, threads, **kw: (seen.append(threads),
                                                                                 real(items, work, threads, **kw)))
    monkeypatch.setattr(cores, "chunk_threads", lambda: 3)  # parts shared by three threads, whatever the machine
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(fold.float32_tokens(big).view(np.uint32), big.astype(np.float32).view(np.uint32))
    assert seen == [3]


# ---------------------------------------------------------------- PLAID decompression


def _codec(rng, n_cent, dim, nbits, dtype):
    """Centroids with what decompression must carry bit for bit: tiny and huge values, a zero centroid,
    a NaN and an infinity; weights of both signs."""
    cen = rng.standard_normal((n_cent, dim)) * np.exp2(rng.integers(-16, 8, (n_cent, dim)))
    cen[0] = 0
    cen[1] = 2.0**-14  # a norm far below 1: scaled to unit length
    cen[2, 0] = np.nan
    cen[3, -1] = np.inf
    w = rng.standard_normal(1 << nbits).astype(np.float32)
    return cen.astype(dtype), w


@pytest.mark.parametrize("nbits, dim", [(1, 8), (2, 128), (4, 96), (2, 200)])
@pytest.mark.parametrize("cdtype", [np.float16, np.float32])
@pytest.mark.parametrize("normalize", [True, False])
def test_compiled_decompression_has_numpys_bits(rng, monkeypatch, nbits, dim, cdtype, normalize):
    from lik_cupy import plaid
    from lik_cupy._cpu import residual

    cen, w = _codec(rng, 9, dim, nbits, cdtype)
    codes = rng.integers(0, 9, 5000)  # past _SHARED_TOKENS: the chunk threads share it
    bits = rng.integers(0, 256, (5000, dim * nbits // 8), dtype=np.uint8)
    monkeypatch.setattr(cores, "chunk_threads", lambda: 3)
    seen = []
    real = residual._compiled

    def compiled():
        k = real()
        seen.append(k is not None)
        return k
    monkeypatch.setattr(residual, "_compiled", compiled)

    def run():
        with np.errstate(invalid="ignore", over="ignore"):
            return plaid.decompress_residuals(codes, bits, cen, w, nbits, normalize=normalize)
    monkeypatch.setenv("LIK_DISABLE_NUMBA", "1")
    plain = run()
    monkeypatch.setenv("LIK_DISABLE_NUMBA", "0")
    folded = run()
    assert seen == [False, True]
    np.testing.assert_array_equal(plain.view(np.uint32), folded.view(np.uint32))
    with np.errstate(invalid="ignore", over="ignore"):
        want = residual.decompress(codes, bits, cen, w, nbits, normalize).astype(np.float32)
    np.testing.assert_array_equal(folded.view(np.uint32), want.view(np.uint32))


def test_residual_scoring_with_compiled_decompression_has_the_numpy_bits(rng, monkeypatch):
    from lik_cupy import plaid

    dim, nbits = 64, 2
    cen, w = _codec(rng, 17, dim, nbits, np.float16)
    cen[2, 0] = cen[3, -1] = 1  # finite documents: the scores compared, not NaN
    lens = rng.integers(0, 40, 300)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    codes = rng.integers(0, 17, int(off[-1]))
    bits = rng.integers(0, 256, (int(off[-1]), dim * nbits // 8), dtype=np.uint8)
    q = _awkward(rng, (4, 16, dim), np.float32)
    cand = rng.integers(0, 300, (4, 50))

    def run():
        return plaid.maxsim_residual_varlen(q, codes, bits, off, cen, w, nbits, candidates=cand,
                                            return_argmax=True, backend="cpu")
    from lik_cupy._cpu import residual_kernels

    calls, real = [], residual_kernels.rows16
    monkeypatch.setattr(residual_kernels, "rows16", lambda *a: calls.append(1) or real(*a))
    _assert_same(*_both(monkeypatch, run))
    assert calls, "the compiled decompression did not run"


def test_a_decompression_that_differs_from_numpys_is_not_used(monkeypatch):
    from lik_cupy._cpu import residual, residual_kernels

    real = residual_kernels.rows16

    def wrong(rows, codes, res, bits, table, per_byte, normalize, out):
        real(rows, codes, res, bits, table, per_byte, normalize, out)
        out[0, 0] = np.nextafter(out[0, 0], np.float32(np.inf))
    monkeypatch.setattr(residual, "_kernels", None)
    monkeypatch.setattr(residual_kernels, "rows16", wrong)
    with pytest.warns(RuntimeWarning, match="differ from NumPy's"):
        assert residual._compiled() is None
