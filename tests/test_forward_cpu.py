"""The NumPy path (``backend="cpu"`` and the automatic fallback without a GPU) against a float64 reference.

Runs everywhere: nothing here needs a GPU.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import lik_cupy
from lik_cupy import _cpu as cpu
from lik_cupy._dispatch import backend
from lik_cupy._runtime import launch
from reference import assert_within_rounding, maxsim_ref, rel_err, rounding_bound

REPO = pathlib.Path(__file__).resolve().parents[1]
NP_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
TOL = 1e-5  # float32 scores of exactly-rounded inputs


def _cast(x, dtype):
    """Round to the input dtype; returns (array to pass, float64 of exactly what the library sees)."""
    a = np.asarray(x).astype(NP_DTYPES[dtype])
    return a, a.astype(np.float64)


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _cpu(*args, **kw):
    return lik_cupy.maxsim(*args, backend="cpu", **kw)


def _ref_argmax(q64, d64, q_valid=None, d_valid=None):
    """Exact argmax from the float64 similarities: lowest index on ties, -1 for masked query tokens / empty docs."""
    nq, lq, _ = q64.shape
    nd, ld, _ = d64.shape
    qv = np.ones((nq, lq), bool) if q_valid is None else q_valid
    dv = np.ones((nd, ld), bool) if d_valid is None else d_valid
    _, sim = maxsim_ref(q64, d64, qv, dv)  # [nq, nd, lq, ld], masked doc tokens -inf
    a = sim.argmax(axis=3).astype(np.int32) if ld else np.zeros((nq, nd, lq), np.int32)
    a[:, ~dv.any(axis=1), :] = -1
    a[np.broadcast_to(~qv[:, None, :], a.shape)] = -1
    return a


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(
    "nq,lq,nd,ld,dim",
    [(1, 1, 1, 1, 1), (3, 17, 29, 45, 33), (2, 65, 7, 130, 100), (2, 5, 3, 9, 600), (4, 31, 11, 1, 7)],
)
def test_dtypes_and_awkward_shapes_vs_float64(rng, dtype, nq, lq, nd, ld, dim):
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    d, d64 = _cast(_unit(rng, nd, ld, dim), dtype)
    out = _cpu(q, d)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (nq, nd)
    assert rel_err(out, maxsim_ref(q64, d64)[0]) < TOL


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_masks_lengths_empty_docs_and_empty_queries(rng, dtype):
    nq, lq, nd, ld, dim = 5, 23, 19, 37, 40
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    d, d64 = _cast(_unit(rng, nd, ld, dim), dtype)
    q_mask = rng.random((nq, lq)) < 0.7
    q_mask[2] = False  # a query with no valid token
    d_mask = rng.random((nd, ld)) < 0.6
    d_mask[[0, 7, 18]] = False  # empty documents
    ref = maxsim_ref(q64, d64, q_mask, d_mask)[0]
    s, a = _cpu(q, d, q_mask, d_mask, return_argmax=True)
    assert rel_err(s, ref) < TOL
    assert np.all(s[2] == 0)  # empty query: 0, also against an empty document (the empty sum wins over -inf)
    assert not np.signbit(s[2]).any()  # +0.0, as Lq = 0 gives: the bits do not depend on the padding
    others = np.delete(np.arange(nq), 2)
    assert np.all(s[np.ix_(others, [0, 7, 18])] == -np.inf)
    assert np.isfinite(np.delete(np.delete(s, 2, 0), [0, 7, 18], 1)).all()
    assert a.dtype == np.int32 and a.shape == (nq, nd, lq)
    assert np.all(a[2] == -1) and np.all(a[:, [0, 7, 18]] == -1)
    assert np.all(a[np.broadcast_to(~q_mask[:, None, :], a.shape)] == -1)  # masked query tokens

    q_len = rng.integers(0, lq + 1, nq)
    q_len[1] = 0
    d_len = rng.integers(0, ld + 1, nd)
    d_len[[3, 4]] = 0
    qv = np.arange(lq)[None] < q_len[:, None]
    dv = np.arange(ld)[None] < d_len[:, None]
    ref = maxsim_ref(q64, d64, qv, dv)[0]
    s, a = _cpu(q, d, q_lengths=q_len, d_lengths=d_len, return_argmax=True)
    assert rel_err(s, ref) < TOL
    assert np.all(s[1] == 0) and not np.signbit(s[1]).any()
    # lengths and the equivalent masks give bit-identical results, whatever the integer type
    s2, a2 = _cpu(q, d, qv, dv, return_argmax=True)
    np.testing.assert_array_equal(s, s2)
    np.testing.assert_array_equal(a, a2)
    for t in (np.int32, np.uint16, np.int8):
        np.testing.assert_array_equal(_cpu(q, d, q_lengths=q_len.astype(t), d_lengths=d_len.astype(t)), s)


def test_python_list_lengths(rng):
    q, q64 = _cast(_unit(rng, 3, 12, 24), "float16")
    d, d64 = _cast(_unit(rng, 4, 20, 24), "float16")
    q_len, d_len = [12, 0, 5], [20, 3, 0, 1]
    s = _cpu(q, d, q_lengths=q_len, d_lengths=d_len)
    qv = np.arange(12)[None] < np.array(q_len)[:, None]
    dv = np.arange(20)[None] < np.array(d_len)[:, None]
    assert rel_err(s, maxsim_ref(q64, d64, qv, dv)[0]) < TOL
    np.testing.assert_array_equal(s, _cpu(q, d, q_lengths=tuple(q_len), d_lengths=np.array(d_len)))
    # nested lists for per-query candidates, a plain int for a 2-D query
    dc, dc64 = _cast(_unit(rng, 3, 2, 20, 24), "float16")
    sc = _cpu(q, dc, d_lengths=[[20, 0], [1, 7], [3, 3]])
    assert sc.shape == (3, 2) and np.all(sc[0, 1] == -np.inf)
    s1 = _cpu(q[0], d, q_lengths=5)
    np.testing.assert_allclose(s1, maxsim_ref(q64[:1, :5], d64)[0][0], rtol=TOL)


def test_nan_propagates_unless_masked(rng):
    q = _unit(rng, 3, 20, 32).astype(np.float16)
    d = _unit(rng, 6, 40, 32).astype(np.float16)
    d[2, 7, 3] = np.nan
    d[4, 39, 0] = np.nan
    d_mask = np.ones((6, 40), bool)
    d_mask[4, 39] = False  # a NaN in a masked document token is never seen
    q[1, 4, 5] = np.nan
    q[2, 19, 0] = np.nan
    q_mask = np.ones((3, 20), bool)
    q_mask[2, 19] = False  # nor one in a masked query token
    s = _cpu(q, d, q_mask, d_mask)
    assert np.isnan(s[:, 2]).all()
    assert np.isnan(s[1]).all()
    assert np.isfinite(np.delete(np.delete(s, 1, 0), 2, 1)).all()
    # an empty document has no unmasked similarity, so a NaN query token meets no NaN: -inf
    d_mask[5] = False
    s = _cpu(q, d, q_mask, d_mask)
    assert np.all(s[:, 5] == -np.inf)
    # a query token that is NaN but masked leaves the row finite even with lengths
    s = _cpu(q[2:], d, q_lengths=[19])
    assert np.isnan(s[0, [2, 4]]).all()  # no d_mask now: both NaN document tokens count
    assert np.isfinite(np.delete(s, [2, 4], 1)).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_argmax_exact_with_ties(rng, dtype):
    # small integers: every product and sum is exact in float32, so the winner is exact and ties are frequent
    nq, lq, nd, ld, dim = 3, 21, 9, 33, 6
    q, q64 = _cast(rng.integers(-2, 3, (nq, lq, dim)), dtype)
    d, d64 = _cast(rng.integers(-2, 3, (nd, ld, dim)), dtype)
    q_mask = rng.random((nq, lq)) < 0.8
    d_mask = rng.random((nd, ld)) < 0.7
    d_mask[4] = False
    s, a = _cpu(q, d, q_mask, d_mask, return_argmax=True)
    ref = maxsim_ref(q64, d64, q_mask, d_mask)[0]
    np.testing.assert_array_equal(s, ref.astype(np.float32))  # exact
    np.testing.assert_array_equal(a, _ref_argmax(q64, d64, q_mask, d_mask))
    # without masks too
    s, a = _cpu(q, d, return_argmax=True)
    np.testing.assert_array_equal(a, _ref_argmax(q64, d64))


def test_argmax_ties_take_lowest_index(rng):
    # exact ties (small-integer tokens, so every similarity is exact in float32), also at the tail positions
    dim, ld = 64, 150
    d = rng.integers(-3, 4, (2, ld, dim)).astype(np.float16)
    for j, (src, dst) in enumerate([(5, 100), (70, 149), (0, 130), (64, 148)]):
        d[j % 2, dst] = d[j % 2, src]
    q = np.stack([d[0, [5, 70, 149]], d[1, [0, 64, 127]]])  # [2, 3, dim]
    s, a = _cpu(q, d, return_argmax=True)
    _, sim = maxsim_ref(q.astype(np.float64), d.astype(np.float64))
    np.testing.assert_array_equal(a, sim.argmax(axis=3))  # first index of the max
    assert a[0, 0, :2].tolist() == [5, 70]
    assert a[1, 1, :2].tolist() == [0, 64]
    # masking the first copy moves the winner to the second
    dm = np.ones((2, ld), bool)
    dm[0, 5] = False
    _, a = _cpu(q, d, d_mask=dm, return_argmax=True)
    assert a[0, 0, 0] == 100


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_argmax_ties_between_identical_tokens_with_inexact_products(dtype):
    # Like the GPU test_argmax_ties_take_lowest_index, but with random (inexact) values: every token of a document is
    # the same vector, which is also query token 0, so token 0 must win. Several (Lq, Ld) shapes, because which rows
    # round differently depends on the BLAS kernel (SkylakeX: M-tail rows for small Lq; Haswell: rows 6-11 mod 12
    # for Lq = 30).
    rng = np.random.default_rng(1234)
    wrong = []
    for lq in (2, 3, 8, 30, 64):
        for ld in (37, 150):
            b, dim = 24, 64
            v = rng.standard_normal((b, 1, dim)).astype(NP_DTYPES[dtype])
            d = np.repeat(v, ld, axis=1)
            q = np.concatenate([v, rng.standard_normal((b, lq - 1, dim)).astype(NP_DTYPES[dtype])], axis=1)
            _, a = lik_cupy.maxsim_pairs(q, d, return_argmax=True, backend="cpu")
            wrong += [(lq, ld, int(x)) for x in a[:, 0] if x != 0]
    assert not wrong, wrong[:10]


# ---------------------------------------------------------------- shapes


def test_rank_variants(rng):
    lq, nd, ld, dim = 12, 5, 30, 64
    q, q64 = _cast(_unit(rng, lq, dim), "bfloat16")
    d, d64 = _cast(_unit(rng, nd, ld, dim), "bfloat16")
    ref = maxsim_ref(q64[None], d64)[0][0]

    s, a = _cpu(q, d, return_argmax=True)  # Q 2-D -> [Nd]
    assert s.shape == (nd,) and a.shape == (nd, lq)
    assert rel_err(s, ref) < TOL
    np.testing.assert_array_equal(a, _cpu(q[None], d, return_argmax=True)[1][0])

    s, a = _cpu(q, d[2], return_argmax=True)  # Q 2-D, D 2-D -> scalar
    assert s.shape == () and a.shape == (lq,)
    assert abs(float(s) - ref[2]) <= TOL * abs(ref[2])

    q3, q364 = _cast(_unit(rng, 4, lq, dim), "bfloat16")
    s, a = _cpu(q3, d[3], return_argmax=True)  # Q 3-D, D 2-D -> [Nq]
    assert s.shape == (4,) and a.shape == (4, lq)
    assert rel_err(s, maxsim_ref(q364, d64[3:4])[0][:, 0]) < TOL

    qm = rng.random(lq) < 0.5  # 2-D Q with a 1-D mask / scalar length
    s = _cpu(q, d, q_mask=qm)
    assert rel_err(s, maxsim_ref(q64[None], d64, qm[None])[0][0]) < TOL
    s = _cpu(q, d, q_lengths=np.int64(4), d_lengths=np.arange(nd) * 3)
    dv = np.arange(ld)[None] < (np.arange(nd) * 3)[:, None]
    assert rel_err(s, maxsim_ref(q64[None, :4], d64, None, dv)[0][0]) < TOL


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_candidates_4d(rng, dtype):
    nq, k, lq, ld, dim = 3, 7, 25, 60, 48
    q, q64 = _cast(_unit(rng, nq, lq, dim), dtype)
    d, d64 = _cast(_unit(rng, nq, k, ld, dim), dtype)
    dl = rng.integers(0, ld + 1, (nq, k))
    dl[1, 2] = 0
    s, a = _cpu(q, d, d_lengths=dl, return_argmax=True)
    assert s.shape == (nq, k) and a.shape == (nq, k, lq)
    dm = np.arange(ld)[None, None] < dl[..., None]
    s2, a2 = _cpu(q, d, d_mask=dm, return_argmax=True)
    np.testing.assert_array_equal(s, s2)
    np.testing.assert_array_equal(a, a2)
    for i in range(nq):
        ref = maxsim_ref(q64[i : i + 1], d64[i], None, dm[i])[0]
        assert rel_err(s[i : i + 1], ref) < TOL
        np.testing.assert_array_equal(a[i : i + 1], _ref_argmax(q64[i : i + 1], d64[i], None, dm[i]))
    assert s[1, 2] == -np.inf and np.all(a[1, 2] == -1)


def test_maxsim_pairs(rng):
    b, lq, ld, dim = 6, 19, 41, 40
    q, q64 = _cast(_unit(rng, b, lq, dim), "float16")
    d, d64 = _cast(_unit(rng, b, ld, dim), "float16")
    ql = rng.integers(0, lq + 1, b)
    dl = rng.integers(1, ld + 1, b)
    dl[4] = 0
    s, a = lik_cupy.maxsim_pairs(q, d, q_lengths=ql, d_lengths=dl, return_argmax=True, backend="cpu")
    assert s.shape == (b,) and a.shape == (b, lq) and s.dtype == np.float32 and a.dtype == np.int32
    qv = np.arange(lq)[None] < ql[:, None]
    dv = np.arange(ld)[None] < dl[:, None]
    for i in range(b):
        ref = maxsim_ref(q64[i : i + 1], d64[i : i + 1], qv[i : i + 1], dv[i : i + 1])[0][0, 0]
        if np.isfinite(ref):
            assert abs(s[i] - ref) <= TOL * max(1.0, abs(ref))
        else:
            assert s[i] == ref
        np.testing.assert_array_equal(a[i], _ref_argmax(q64[i : i + 1], d64[i : i + 1], qv[i : i + 1], dv[i : i + 1])[0, 0])
    s2 = lik_cupy.maxsim_pairs(q, d, qv, dv, backend="cpu")
    np.testing.assert_array_equal(s, s2)


@pytest.mark.parametrize(
    "nq,lq,nd,ld",
    [(0, 5, 4, 6), (3, 5, 0, 6), (3, 0, 4, 6), (3, 5, 4, 0), (3, 0, 4, 0), (0, 0, 0, 0)],
)
@pytest.mark.parametrize("valid", [None, "mask", "lengths"])
def test_zero_size_dims(rng, nq, lq, nd, ld, valid):
    dim = 8
    q, q64 = _cast(rng.standard_normal((nq, lq, dim)), "float16")
    d, d64 = _cast(rng.standard_normal((nd, ld, dim)), "float16")
    kw = {}
    if valid == "mask":
        kw = dict(q_mask=np.ones((nq, lq), bool), d_mask=np.ones((nd, ld), bool))
    elif valid == "lengths":
        kw = dict(q_lengths=np.full(nq, lq), d_lengths=np.full(nd, ld))
    s, a = _cpu(q, d, return_argmax=True, **kw)
    assert s.shape == (nq, nd) and s.dtype == np.float32
    assert a.shape == (nq, nd, lq) and a.dtype == np.int32
    if lq == 0 or ld == 0:  # empty query: 0 (wins over an empty doc); empty doc: -inf
        np.testing.assert_array_equal(s, np.full((nq, nd), 0.0 if lq == 0 else -np.inf))
        assert np.all(a == -1)
    assert rel_err(s, maxsim_ref(q64, d64)[0]) < TOL
    # the same holds for the other layouts
    assert _cpu(q[0] if nq else np.zeros((lq, dim), np.float16), d).shape == (nd,)
    assert lik_cupy.maxsim_pairs(q[:0], d[:0], backend="cpu").shape == (0,)
    dc = np.zeros((nq, 0, ld, dim), np.float16)
    sc, ac = _cpu(q, dc, return_argmax=True)
    assert sc.shape == (nq, 0) and ac.shape == (nq, 0, lq)


def test_bounded_memory_blocking(rng, monkeypatch):
    nq, lq, nd, ld, dim = 2, 32, 1500, 50, 16
    q, q64 = _cast(_unit(rng, nq, lq, dim), "float16")
    d, d64 = _cast(_unit(rng, nd, ld, dim), "float16")
    dm = rng.random((nd, ld)) < 0.8
    dm[[0, 777, 1499]] = False
    full_s, full_a = _cpu(q, d, d_mask=dm, return_argmax=True)

    calls = []
    orig = cpu.maxsim_numpy
    tiny = 3 * lq * ld * 4 * 2  # three documents per block with argmax (sim + argmax temporaries)

    def small_blocks(*a, **kw):
        calls.append(kw)
        return orig(*a, **{**kw, "block_bytes": tiny})

    monkeypatch.setattr(cpu, "maxsim_numpy", small_blocks)
    s, a = _cpu(q, d, d_mask=dm, return_argmax=True)
    assert calls, "forward did not go through cpu.maxsim_numpy"
    np.testing.assert_array_equal(a, full_a)  # the argmax is float64's, whatever the blocks
    np.testing.assert_array_equal(s, full_s)  # and each score its winners' float64 similarities
    assert_within_rounding(s, maxsim_ref(q64, d64, None, dm)[0], rounding_bound(q64, d64, None, dm))

    # the peak allocation follows block_bytes, not the corpus size
    qv = np.ones((nq, lq), bool)

    def peak(block_bytes):
        tracemalloc.start()
        try:
            orig(q, d, qv, dm, candidates=False, nd=nd, return_argmax=False, block_bytes=block_bytes)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    whole = nd * lq * ld * 4  # the similarity tensor of the whole corpus: 9.6 MB
    assert peak(1 << 30) > whole  # one block: the whole tensor at once
    assert peak(64 << 10) < whole / 8


def test_auto_falls_back_to_cpu_without_gpu(rng, monkeypatch):
    q, _ = _cast(_unit(rng, 2, 13, 24), "float16")
    d, _ = _cast(_unit(rng, 5, 17, 24), "float16")
    want = _cpu(q, d, return_argmax=True)
    monkeypatch.setattr(backend, "gpu_available", lambda: False)
    got = lik_cupy.maxsim(q, d, return_argmax=True)
    assert isinstance(got[0], np.ndarray)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(lik_cupy.maxsim_pairs(q, d[:2]), lik_cupy.maxsim_pairs(q, d[:2], backend="cpu"))


def test_gpu_available_false_on_this_machine(rng):
    from conftest import HAS_GPU

    if HAS_GPU:
        pytest.skip("a GPU is present")
    assert lik_cupy.gpu_available() is False
    q, _ = _cast(_unit(rng, 2, 13, 24), "float32")
    d, _ = _cast(_unit(rng, 5, 17, 24), "float32")
    np.testing.assert_array_equal(lik_cupy.maxsim(q, d), _cpu(q, d))  # no monkeypatching: the real fallback


def test_import_does_not_import_torch_jax_or_cupy(tmp_path):
    # Importable stand-ins, so the check means something even where torch/jax are not installed.
    for name in ("torch", "jax"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import lik_cupy
        bad = [m for m in ("torch", "jax", "jaxlib", "cupy", "numba") if m in sys.modules]
        assert not bad, f"import lik_cupy imported {bad}"
        q = np.ones((2, 3, 4), np.float16)
        lik_cupy.maxsim(q, q, backend="cpu")
        bad = [m for m in ("torch", "jax", "jaxlib") if m in sys.modules]
        assert not bad, f"a NumPy CPU call imported {bad}"
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_forward_launch_packs_the_kernels_parameters_in_order():
    # launch._launch_forward hands the driver raw parameter slots by _FWD_SIGNATURE: it must
    # name the forward kernel's parameters (the TMA descriptors after them aside) by C type, in
    # order, or every launch would read its arguments from the wrong slots.
    src = (REPO / "cuda_src" / "maxsim_fwd.cu").read_text()
    params = src[src.index("LIK_NAME(") + len("LIK_NAME("):]
    params = params[:params.index("#if LIK_TMA")]
    kinds = []
    for decl in (d.strip() for d in params.split(",") if d.strip()):
        ctype = decl.rsplit(None, 1)[0]
        kinds.append("p" if "*" in decl else {"long long": "q", "int": "i", "unsigned": "u"}.get(ctype, "?" + ctype))
    assert "".join(kinds) == launch._FWD_SIGNATURE
    assert launch._FWD_PARAMS.size == 8 * len(launch._FWD_SIGNATURE)
