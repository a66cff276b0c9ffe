"""lik_cupy.jax under jax.jit, jax.grad and jax.vmap: the NumPy path through jax.pure_callback on the
CPU (CI), the kernels through jax.experimental.buffer_callback on a CUDA device (marked gpu)."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from reference import maxsim_ref, rel_err

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy's pool needs room beside XLA's
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import lik_cupy  # noqa: E402
from lik_cupy import _batched_calls, _jax_ops  # noqa: E402
from lik_cupy._dispatch import jax_paths  # noqa: E402
from lik_cupy.jax import maxsim, maxsim_int8, maxsim_int8_varlen, maxsim_varlen  # noqa: E402

NP_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# Gradients come back in the inputs' dtype: their rounding, relative to the largest entry.
GRAD_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-12}


def _x64():
    enable = getattr(jax, "enable_x64", None)  # jax >= 0.9; jax.experimental.enable_x64 before
    if enable is None:
        from jax.experimental import enable_x64 as enable
    return enable(True)


def _inputs(rng, dtype, *shapes):
    return [rng.standard_normal(s).astype(np.float32).astype(NP_DTYPES.get(dtype, dtype)) for s in shapes]


def _valid(lengths, n):
    return np.arange(n)[None, :] < np.asarray(lengths)[:, None]


def _grads_ref(Q, D, qv, dv, W):
    """float64 dQ, dD of sum(W * maxsim(Q, D)) for Q [Nq, Lq, d], D [Nd, Ld, d]: each query token's
    gradient is its winning document token (the first of equal maxima) and vice versa."""
    Q, D, W = (np.asarray(x, np.float64) for x in (Q, D, W))
    sim = np.einsum("isk,jtk->ijst", Q, D)
    sim = np.where(dv[None, :, None, :], sim, -np.inf)
    win = sim.argmax(axis=3)  # [Nq, Nd, Lq]
    live = qv[:, None, :] & dv.any(axis=1)[None, :, None]
    dQ, dD = np.zeros_like(Q), np.zeros_like(D)
    for i, j, s in zip(*np.nonzero(live)):
        dQ[i, s] += W[i, j] * D[j, win[i, j, s]]
        dD[j, win[i, j, s]] += W[i, j] * Q[i, s]
    return dQ, dD


def _close(out, ref, dtype, tol=None):
    out = np.asarray(out, np.float64)
    scale = max(float(np.abs(ref).max()), 1e-30)
    assert np.abs(out - ref).max() <= (tol or GRAD_TOL[dtype]) * scale, (np.abs(out - ref).max(), scale)


# ---------------------------------------------------------------- CPU (the NumPy path, in CI)


@pytest.fixture(autouse=True)
def _cpu_unless_gpu_test(request):
    """Tests not marked gpu run on JAX's CPU device, where "auto" takes the NumPy path, also on
    a machine whose jax sees a GPU."""
    if request.node.get_closest_marker("gpu"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LIK_JAX_PATH", "kernel")  # the kernels under test, not XLA's einsum where the rule prefers it
            yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_jit_scores_match_float64(rng, dtype):
    nq, lq, nd, ld, dim = 3, 7, 5, 11, 13
    q, d = _inputs(rng, dtype, (nq, lq, dim), (nd, ld, dim))
    ql, dl = np.array([7, 1, 4]), np.array([11, 0, 3, 9, 1])
    ref, _ = maxsim_ref(q, d, _valid(ql, lq), _valid(dl, ld))
    out = jax.jit(lambda a, b, x, y: maxsim(a, b, q_lengths=x, d_lengths=y))(q, d, ql, dl)
    assert out.dtype == jnp.float32 and out.shape == (nq, nd)
    assert rel_err(out, ref) < 1e-6
    qm, dm = rng.random((nq, lq)) < 0.7, rng.random((nd, ld)) < 0.6
    ref, _ = maxsim_ref(q, d, qm, dm)
    assert rel_err(jax.jit(maxsim)(q, d, qm, dm), ref) < 1e-6


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_jit_grad_matches_float64(rng, dtype):
    nq, lq, nd, ld, dim = 4, 9, 6, 5, 7
    q, d = _inputs(rng, dtype, (nq, lq, dim), (nd, ld, dim))
    ql, dl = np.array([9, 3, 0, 5]), np.array([5, 1, 0, 4, 2, 5])
    w = rng.standard_normal((nq, nd)).astype(np.float32)

    def loss(a, b):
        return (maxsim(a, b, q_lengths=ql, d_lengths=dl) * w).sum()

    gq, gd = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, d)
    assert gq.dtype == q.dtype and gd.dtype == d.dtype and gq.shape == q.shape and gd.shape == d.shape
    rq, rd = _grads_ref(q, d, _valid(ql, lq), _valid(dl, ld), w)
    _close(gq, rq, dtype)
    _close(gd, rd, dtype)
    eager = jax.grad(loss, argnums=(0, 1))(q, d)  # not jitted: the same staged call
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(eager, (gq, gd)))


def test_value_and_grad_inside_jit(rng):
    """A contrastive step: in-batch cross-entropy over maxsim scores, loss and gradients in one jit."""
    b, lq, ld, dim = 5, 6, 8, 16
    q, d = _inputs(rng, "float32", (b, lq, dim), (b, ld, dim))
    dl = rng.integers(1, ld + 1, b)

    def from_scores(s):
        return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(s / 0.1, axis=1)))

    value, (gq, gd) = jax.jit(jax.value_and_grad(lambda a, c: from_scores(maxsim(a, c, d_lengths=dl)),
                                                 argnums=(0, 1)))(q, d)
    s = maxsim_ref(q, d, None, _valid(dl, ld))[0]
    assert abs(float(value) - float(from_scores(s))) <= 1e-6 * max(1.0, float(np.abs(s).max()) / 0.1)
    # The scores' gradient as JAX computes it in float32 from our scores; the rest is ours. That
    # gradient is a softmax of logits s / 0.1 of up to ~100, whose float32 rounding (6e-8 x 100) moves
    # it by ~6e-6 relative, and XLA's fused order inside the jit differs from this recomputation: the
    # gradients match to 2e-5 (300 seeds: at most 5e-6), not to float32 rounding.
    w = np.asarray(jax.grad(from_scores)(jax.jit(lambda a, c: maxsim(a, c, d_lengths=dl))(q, d)), np.float64)
    rq, rd = _grads_ref(q, d, np.ones((b, lq), bool), _valid(dl, ld), w)
    _close(gq, rq, "float32", tol=2e-5)
    _close(gd, rd, "float32", tol=2e-5)


def test_candidates_and_single_query_layouts(rng):
    nq, k, lq, ld, dim = 3, 4, 5, 6, 8
    q, d = _inputs(rng, "float32", (nq, lq, dim), (nq, k, ld, dim))
    dl = rng.integers(0, ld + 1, (nq, k))
    out = jax.jit(lambda a, b: maxsim(a, b, d_lengths=dl))(q, d)
    assert out.shape == (nq, k)
    np.testing.assert_array_equal(np.asarray(out), lik_cupy.maxsim(q, d, d_lengths=dl, backend="cpu"))
    one = jax.jit(maxsim)(q[0], d[0, 0])  # [Lq, d] against [Ld, d]: a scalar
    assert one.shape == () and float(one) == float(lik_cupy.maxsim(q[0], d[0, 0], backend="cpu"))


def test_lengths_out_of_range_give_nan_not_errors(rng):
    nq, lq, nd, ld, dim = 3, 4, 4, 5, 6
    q, d = _inputs(rng, "float32", (nq, lq, dim), (nd, ld, dim))
    ql, dl = jnp.array([4, -1, 2]), jnp.array([5, 2, 6, 0])
    out = np.asarray(jax.jit(lambda a, b, x, y: maxsim(a, b, q_lengths=x, d_lengths=y))(q, d, ql, dl))
    assert np.isnan(out[1]).all() and np.isnan(out[:, 2]).all()
    good = np.ix_([0, 2], [0, 1, 3])
    want = lik_cupy.maxsim(q, d, q_lengths=[4, 0, 2], d_lengths=[5, 2, 0, 0], backend="cpu")
    np.testing.assert_array_equal(out[good], want[good])
    # the gradient of the valid scores is untouched by the invalid ones
    gq = jax.grad(lambda a: jnp.where(jnp.isnan(out), 0.0, maxsim(a, d, q_lengths=ql, d_lengths=dl)).sum())(q)
    assert np.isfinite(np.asarray(gq)).all() and not np.asarray(gq)[1].any()


@pytest.mark.parametrize("path", ["kernel", "xla"])
def test_narrow_and_wide_integer_lengths_are_read_as_their_values(rng, monkeypatch, path):
    """uint8 lengths of documents longer than 255 tokens compared as uint8 (300 wrapped to 44), so
    valid lengths were NaN; NumPy int64 lengths past int32 wrapped into valid ones without x64."""
    monkeypatch.setenv("LIK_JAX_PATH", path)
    q, d = _inputs(rng, "float32", (2, 4, 8), (2, 300, 8))
    dl = np.array([200, 100], np.uint8)
    want = lik_cupy.maxsim(q, d, d_lengths=dl, backend="cpu")
    np.testing.assert_allclose(np.asarray(jax.jit(lambda a, b: maxsim(a, b, d_lengths=dl))(q, d)), want, rtol=1e-6)
    g = jax.grad(lambda a: maxsim(a, d, d_lengths=dl).sum())(q)
    assert np.isfinite(np.asarray(g)).all()
    out = np.asarray(maxsim(q, d, q_lengths=np.array([2**32 + 2, 1])))  # not 2: out of range, NaN
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


def test_host_results_stay_on_the_host_whatever_the_default_device():
    """Results of host JAX arrays went to JAX's default device (a GPU where there is one); a
    second CPU device made the default stands in for it here."""
    code = """if True:
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        import jax, numpy as np, lik_cupy
        cpu0, cpu1 = jax.devices("cpu")[:2]
        jax.config.update("jax_default_device", cpu1)
        q = jax.device_put(np.ones((2, 3, 8), np.float32), cpu0)
        d = jax.device_put(np.ones((4, 5, 8), np.float32), cpu0)
        s, a = lik_cupy.maxsim(q, d, return_argmax=True)
        q8, qs = lik_cupy.quantize_int8(q)
        assert {x.devices().pop() for x in (s, a, q8, qs)} == {cpu0}, [x.devices() for x in (s, a, q8, qs)]
    """
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-2000:]


def test_varlen_jit_and_grad_match_float64(rng):
    lens = np.array([3, 0, 7, 1, 5])
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    nq, lq, dim = 3, 6, 9
    q, t = _inputs(rng, "float32", (nq, lq, dim), (int(off[-1]), dim))
    ql = np.array([6, 2, 4])
    ld = int(lens.max())
    padded = np.zeros((len(lens), ld, dim), np.float32)
    for j, n in enumerate(lens):
        padded[j, :n] = t[off[j]:off[j + 1]]
    ref, _ = maxsim_ref(q, padded, _valid(ql, lq), _valid(lens, ld))
    out = jax.jit(lambda a, b, o: maxsim_varlen(a, b, o, q_lengths=ql))(q, t, off)
    assert out.shape == (nq, len(lens)) and rel_err(out, ref) < 1e-6
    w = rng.standard_normal((nq, len(lens))).astype(np.float32)
    gq, gt = jax.jit(jax.grad(lambda a, b: (maxsim_varlen(a, b, off, q_lengths=ql) * w).sum(), argnums=(0, 1)))(q, t)
    rq, rd = _grads_ref(q, padded, _valid(ql, lq), _valid(lens, ld), w)
    _close(gq, rq, "float32")
    _close(gt, np.concatenate([rd[j, :n] for j, n in enumerate(lens)]), "float32")


@pytest.mark.parametrize("bad", [[1, 2, 4], [0, 3, 2, 4], [0, 2, 5]])
def test_varlen_bad_offsets_give_nan(rng, bad):
    q, t = _inputs(rng, "float32", (2, 3, 4), (4, 4))
    out = np.asarray(jax.jit(maxsim_varlen)(q, t, jnp.array(bad)))
    assert out.shape == (2, len(bad) - 1) and np.isnan(out).all()


def _plans(monkeypatch):
    """The batching plans that the callbacks chose, in order."""
    seen = []
    real = _batched_calls.plan

    def spy(spec, arrays):
        seen.append(real(spec, arrays))
        return seen[-1]

    monkeypatch.setattr(_batched_calls, "plan", spy)
    return seen


def test_vmap_over_queries_is_one_call(rng, monkeypatch):
    b, nq, lq, nd, ld, dim = 4, 3, 5, 6, 7, 8
    q, d = _inputs(rng, "float32", (b, nq, lq, dim), (nd, ld, dim))
    ql = rng.integers(0, lq + 1, (b, nq))
    seen = _plans(monkeypatch)
    out = jax.jit(jax.vmap(lambda a, x: maxsim(a, d, q_lengths=x)))(q, ql)
    assert seen == ["queries"] and out.shape == (b, nq, nd)
    want = np.stack([lik_cupy.maxsim(q[i], d, q_lengths=ql[i], backend="cpu") for i in range(b)])
    np.testing.assert_array_equal(np.asarray(out), want)
    single = jax.vmap(lambda a: maxsim(a, d))(q[:, 0])  # single queries [Lq, d]: [B, Nd]
    np.testing.assert_array_equal(np.asarray(single), lik_cupy.maxsim(q[:, 0], d, backend="cpu"))
    # only the lengths mapped: the one (bfloat16) Q is repeated for the batch, still one call
    qb, db = q[0].astype(ml_dtypes.bfloat16), d.astype(ml_dtypes.bfloat16)
    lengths = jax.jit(jax.vmap(lambda x: maxsim(qb, db, q_lengths=x)))(ql)
    assert seen[-1] == "queries"
    np.testing.assert_array_equal(np.asarray(lengths), np.stack([lik_cupy.maxsim(qb, db, q_lengths=x, backend="cpu")
                                                                 for x in ql]))


def test_vmap_of_queries_with_own_documents_is_one_call_forward_and_backward(rng, monkeypatch):
    b, lq, nd, ld, dim = 5, 4, 3, 6, 8
    q, d = _inputs(rng, "float32", (b, lq, dim), (b, nd, ld, dim))
    dl = rng.integers(0, ld + 1, (b, nd))
    seen = _plans(monkeypatch)
    w = rng.standard_normal((b, nd)).astype(np.float32)
    f = jax.vmap(lambda a, c, y: maxsim(a, c, d_lengths=y))
    out = jax.jit(f)(q, d, dl)
    gq, gd = jax.jit(jax.grad(lambda a, c: (f(a, c, dl) * w).sum(), argnums=(0, 1)))(q, d)
    assert seen == ["pairs", "pairs", "pairs"]  # forward; forward with argmax, backward
    for i in range(b):
        np.testing.assert_array_equal(np.asarray(out[i]), lik_cupy.maxsim(q[i], d[i], d_lengths=dl[i], backend="cpu"))
        rq, rd = _grads_ref(q[i][None], d[i], np.ones((1, lq), bool), _valid(dl[i], ld), w[i][None])
        _close(gq[i], rq[0], "float32")
        _close(gd[i], rd, "float32")


def test_vmap_other_batches_loop_in_one_callback(rng, monkeypatch):
    b, nq, lq, nd, ld, dim = 3, 2, 4, 5, 3, 6
    q, d = _inputs(rng, "float32", (b, nq, lq, dim), (b, nd, ld, dim))
    seen = _plans(monkeypatch)
    out = jax.jit(jax.vmap(maxsim))(q, d)
    assert seen == ["loop"]
    np.testing.assert_array_equal(np.asarray(out), np.stack([lik_cupy.maxsim(q[i], d[i], backend="cpu")
                                                             for i in range(b)]))
    # nested: every query of q[0] alone against each batch element's documents, which are not
    # copied once per query (that would be "pairs"), so the b * nq calls loop
    nested = jax.jit(jax.vmap(jax.vmap(maxsim, in_axes=(0, None)), in_axes=(None, 0)))(q[0], d)
    assert seen == ["loop", "loop"] and nested.shape == (b, nq, nd)
    np.testing.assert_array_equal(np.asarray(nested), np.stack([lik_cupy.maxsim(q[0], d[i], backend="cpu")
                                                                for i in range(b)]))


def test_vmap_with_scalar_results_and_nested_vmap_match_float64(rng):
    """One query [Lq, d] against one document [Ld, d] is a scalar: vmapped over the documents, and
    nested over queries and documents, each batch element runs alone (the "loop" plan), writing
    and, in the backward, reading 0-d elements."""
    nq, lq, nd, ld, dim = 3, 5, 4, 6, 8
    q, d = _inputs(rng, "float32", (nq, lq, dim), (nd, ld, dim))
    ref, _ = maxsim_ref(q, d)
    one = jax.vmap(lambda c: maxsim(q[0], c))(d)
    assert one.shape == (nd,) and rel_err(one, ref[0]) < 1e-6

    def nested(a, c):
        return jax.vmap(lambda x: jax.vmap(lambda y: maxsim(x, y))(c))(a)

    both = jax.jit(nested)(q, d)
    assert both.shape == (nq, nd) and rel_err(both, ref) < 1e-6
    w = rng.standard_normal((nq, nd)).astype(np.float32)
    gq, gd = jax.jit(jax.grad(lambda a, c: (nested(a, c) * w).sum(), argnums=(0, 1)))(q, d)
    rq, rd = _grads_ref(q, d, np.ones((nq, lq), bool), np.ones((nd, ld), bool), w)
    _close(gq, rq, "float32")
    _close(gd, rd, "float32")


def test_vmap_of_grad_and_grad_of_vmap(rng):
    """Per-example gradients (vmap of grad) and the batch's gradient (grad of vmap), against shared
    documents: the backward runs once per batch element, each with its own dD."""
    b, nq, lq, nd, ld, dim = 3, 2, 5, 4, 6, 7
    q, d = _inputs(rng, "float32", (b, nq, lq, dim), (nd, ld, dim))
    w = rng.standard_normal((nq, nd)).astype(np.float32)

    def loss(a, c):
        return (maxsim(a, c) * w).sum()

    per_q, per_d = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(q, d)
    assert per_q.shape == q.shape and per_d.shape == (b,) + d.shape
    sum_q, sum_d = jax.jit(jax.grad(lambda a, c: jax.vmap(loss, in_axes=(0, None))(a, c).sum(), argnums=(0, 1)))(q, d)
    ok = np.ones((nq, lq), bool), np.ones((nd, ld), bool)
    refs = [_grads_ref(q[i], d, *ok, w) for i in range(b)]
    for i in range(b):
        _close(per_q[i], refs[i][0], "float32")
        _close(per_d[i], refs[i][1], "float32")
        _close(sum_q[i], refs[i][0], "float32")
    _close(sum_d, sum(r[1] for r in refs), "float32")


@pytest.mark.parametrize("value", [-1.0, np.nan, np.inf])
def test_int8_bad_document_scales_give_nan_not_an_internal_error(rng, value):
    """A valid token's negative, NaN or infinite scale reached the NumPy path's check inside the
    callback: an XLA INTERNAL error from the run. Its document's scores are NaN now; a masked
    token's scale is not read."""
    q = rng.standard_normal((2, 3, 16)).astype(np.float32)
    d8, ds = lik_cupy.quantize_int8(rng.standard_normal((4, 5, 16)).astype(np.float32), backend="cpu")
    want = lik_cupy.maxsim_int8(q, d8, ds, backend="cpu")
    bad = ds.copy()
    bad[1, 2] = value
    out = np.asarray(jax.jit(lambda a, b, s: maxsim_int8(a, b, s))(q, d8, bad))
    assert np.isnan(out[:, 1]).all() and np.array_equal(np.delete(out, 1, 1), np.delete(want, 1, 1))
    bad = ds.copy()
    bad[1, 4] = value  # past document 1's length
    dl = np.array([5, 4, 5, 5])
    out = np.asarray(maxsim_int8(q, d8, bad, d_lengths=dl))
    np.testing.assert_array_equal(out, lik_cupy.maxsim_int8(q, d8, ds, d_lengths=dl, backend="cpu"))
    flat = ds.reshape(-1).copy()
    flat[7] = value  # packed: token 7 is document 1's
    off = np.array([0, 5, 10, 15, 20])
    out = np.asarray(jax.jit(lambda a, b, s, o: maxsim_int8_varlen(a, b, s, o))(q, d8.reshape(-1, 16), flat, off))
    assert np.isnan(out[:, 1]).all() and np.array_equal(np.delete(out, 1, 1), np.delete(want, 1, 1))
    one = np.array(0.01, np.float32)  # one scale for all of D
    for kw in ({}, {"d_lengths": dl}, {"d_mask": np.ones((4, 5), bool)}):
        np.testing.assert_array_equal(np.asarray(maxsim_int8(q, d8, one, **kw)),
                                      lik_cupy.maxsim_int8(q, d8, one, backend="cpu", **kw))
        assert np.isnan(np.asarray(maxsim_int8(q, d8, np.array(value, np.float32), **kw))).all()
    np.testing.assert_array_equal(np.asarray(maxsim_int8_varlen(q, d8.reshape(-1, 16), one, off)),
                                  lik_cupy.maxsim_int8_varlen(q, d8.reshape(-1, 16), one, off, backend="cpu"))


def test_int8_jit_vmap_and_no_gradient(rng):
    nq, lq, nd, ld, dim = 3, 5, 4, 7, 32
    q, d = _inputs(rng, "float32", (nq, lq, dim), (nd, ld, dim))
    d8, ds = lik_cupy.quantize_int8(d, backend="cpu")
    dl = np.array([7, 0, 3, 5])
    want = lik_cupy.maxsim_int8(q, d8, ds, d_lengths=dl, backend="cpu")
    out = jax.jit(lambda a, x, s: maxsim_int8(a, x, s, d_lengths=dl))(q, d8, ds)
    np.testing.assert_array_equal(np.asarray(out), want)
    batched = jax.jit(jax.vmap(lambda a: maxsim_int8(a, d8, ds, d_lengths=dl)))(q[:, None])
    np.testing.assert_array_equal(np.asarray(batched)[:, 0], want)
    with pytest.raises(TypeError, match="no gradient"):
        jax.grad(lambda a: maxsim_int8(a, d8, ds).sum())(q)
    q8, qs = lik_cupy.quantize_int8(q, backend="cpu")
    off = np.array([0, 2, 2, 9], np.int32)
    t8, ts = lik_cupy.quantize_int8(rng.standard_normal((9, dim)).astype(np.float32), backend="cpu")
    packed = jax.jit(lambda a, s: maxsim_int8_varlen(a, t8, ts, off, q_scales=s))(q8, qs)
    np.testing.assert_array_equal(np.asarray(packed), lik_cupy.maxsim_int8_varlen(q8, t8, ts, off, q_scales=qs,
                                                                                   backend="cpu"))


def test_int8_vmap_with_a_scale_per_tensor(rng, monkeypatch):
    """A scale per tensor ([]) under jax.vmap: the "queries" plan folded a mapped or shared [] q_scales
    into the queries' axis, and "pairs" a mapped [] d_scales into the documents', an IndexError or
    ValueError inside the callback (an XLA INTERNAL error). A mapped one loops now; a shared one stays
    one call."""
    b, dim = 3, 16
    q8 = rng.integers(-127, 128, (b, 2, 3, dim)).astype(np.int8)
    d8 = rng.integers(-127, 128, (b, 4, 5, dim)).astype(np.int8)
    s = np.array([0.01, 0.02, 0.03], np.float32)
    one = [np.asarray(x) for x in s]  # 0-d arrays (the top-level functions take no NumPy scalars)
    ds = rng.random((4, 5)).astype(np.float32)
    off = np.array([0, 5, 12, 20])
    seen = _plans(monkeypatch)
    out = jax.jit(jax.vmap(lambda a, x: maxsim_int8(a, d8[0], ds, q_scales=x)))(q8, s)  # both mapped
    np.testing.assert_array_equal(np.asarray(out), np.stack([lik_cupy.maxsim_int8(q8[i], d8[0], ds, q_scales=one[i],
                                                                                   backend="cpu") for i in range(b)]))
    assert seen == ["loop"]
    out = jax.vmap(lambda x: maxsim_int8(q8[0], d8[0], ds, q_scales=x))(s)  # only the scale mapped
    np.testing.assert_array_equal(np.asarray(out), np.stack([lik_cupy.maxsim_int8(q8[0], d8[0], ds, q_scales=x,
                                                                                   backend="cpu") for x in one]))
    ql = np.array([3, 1, 0])  # with a 0-d length per single query, mapped (folded as the queries' lengths)
    out = jax.vmap(lambda a, n: maxsim_int8(a, d8[0], ds, q_scales=s[1], q_lengths=n))(q8[:, 0], ql)
    assert seen[-1] == "queries"  # shared: still one call
    np.testing.assert_array_equal(np.asarray(out), lik_cupy.maxsim_int8(q8[:, 0], d8[0], ds, q_scales=one[1],
                                                                        q_lengths=ql, backend="cpu"))
    out = jax.vmap(lambda a, x: maxsim_int8_varlen(a, d8[0].reshape(-1, dim), ds.reshape(-1), off, q_scales=x))(q8, s)
    np.testing.assert_array_equal(np.asarray(out), np.stack([
        lik_cupy.maxsim_int8_varlen(q8[i], d8[0].reshape(-1, dim), ds.reshape(-1), off, q_scales=one[i], backend="cpu")
        for i in range(b)]))
    q = rng.standard_normal((b, 3, dim)).astype(np.float32)
    out = jax.vmap(maxsim_int8)(q, d8, s)  # single queries, own documents and own [] d_scales
    np.testing.assert_array_equal(np.asarray(out), np.stack([lik_cupy.maxsim_int8(q[i], d8[i], one[i], backend="cpu")
                                                             for i in range(b)]))


def test_int8_vmap_over_documents_with_a_shared_scale_per_tensor(rng, monkeypatch):
    """Single queries [Lq, d] against their own documents under jax.vmap with a shared scale per
    tensor ([]): the "pairs" plan broadcast a shared q_scales to [B] beside Q [B, Lq, d] (an XLA
    INTERNAL error from the callback's shape check), and a shared d_scales sent the batch to "loop".
    Both stay one scale for the one call now."""
    b, dim = 3, 16
    q8 = rng.integers(-127, 128, (4, dim)).astype(np.int8)
    qf = rng.standard_normal((b, 4, dim)).astype(np.float32)
    d8 = rng.integers(-127, 128, (b, 5, 6, dim)).astype(np.int8)
    qs, one = np.array(0.02, np.float32), np.array(0.01, np.float32)
    ds = rng.random((b, 5, 6)).astype(np.float32)
    seen = _plans(monkeypatch)
    out = jax.jit(jax.vmap(lambda d, s: maxsim_int8(q8, d, s, q_scales=qs)))(d8, ds)
    np.testing.assert_array_equal(np.asarray(out), np.stack([lik_cupy.maxsim_int8(q8, d8[i], ds[i], q_scales=qs,
                                                                                   backend="cpu") for i in range(b)]))
    out = jax.vmap(lambda q, d: maxsim_int8(q, d, one))(qf, d8)
    np.testing.assert_array_equal(np.asarray(out), np.stack([lik_cupy.maxsim_int8(qf[i], d8[i], one, backend="cpu")
                                                             for i in range(b)]))
    assert seen == ["pairs", "pairs"]


def test_float64_with_x64(rng):
    with _x64():
        q, d = rng.standard_normal((2, 5, 6)), rng.standard_normal((3, 4, 6))
        out = jax.jit(maxsim)(q, d)
        assert out.dtype == jnp.float64
        assert rel_err(out, maxsim_ref(q, d)[0]) < 1e-14
        gq, gd = jax.jit(jax.grad(lambda a, b: maxsim(a, b).sum(), argnums=(0, 1)))(q, d)
        assert gq.dtype == jnp.float64
        rq, rd = _grads_ref(q, d, np.ones((2, 5), bool), np.ones((3, 4), bool), np.ones((2, 3)))
        _close(gq, rq, "float64")
        _close(gd, rd, "float64")


def test_empty_problems(rng):
    q, d = _inputs(rng, "float32", (2, 3, 4), (0, 5, 4))
    out = jax.jit(maxsim)(q, d)
    assert out.shape == (2, 0)
    assert not np.asarray(jax.grad(lambda a: maxsim(a, d).sum())(q)).any()
    docs = np.zeros((0, 4), np.float32)  # three empty packed documents
    np.testing.assert_array_equal(np.asarray(jax.jit(maxsim_varlen)(q, docs, np.zeros(4, np.int32))),
                                  np.full((2, 3), -np.inf, np.float32))


def test_argument_errors_at_trace_time(rng):
    q, d = _inputs(rng, "float32", (2, 3, 8), (4, 5, 6))
    with pytest.raises(ValueError, match="D has dim 6 but Q has dim 8"):
        jax.jit(maxsim)(q, d)
    q, d = _inputs(rng, "float32", (2, 3, 8), (4, 5, 8))
    with pytest.raises(ValueError, match="d_lengths has shape"):
        maxsim(q, d, d_lengths=jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="method"):
        maxsim(q, d, method="fast")
    with pytest.raises(ValueError, match="method must be one of"):  # (not NumPy's "truth value ... ambiguous")
        maxsim(q, d, method=np.array(["csr", "auto"]))
    with pytest.raises(ValueError, match="backend"):
        maxsim(q, d, backend="tpu")
    with pytest.raises(ValueError, match="precision"):
        maxsim(q, d, precision="fp16")
    with pytest.raises(TypeError, match="D has dtype float16 but Q has float32"):
        maxsim(q, d.astype(np.float16))


@pytest.mark.parametrize("where, bad", [("Q", np.zeros((3, 8), object)), ("Q", np.zeros((3, 8), "M8[s]")),
                                        ("q_lengths", ["1", "2"]), ("q_lengths", [None, 1]), ("d_offsets", "0, 5")])
def test_arrays_jax_cannot_hold_are_named(rng, where, bad):
    # (JAX's own error named neither the argument nor what was expected: "Error interpreting
    # argument to stage as a JAX value ... passed to stage at position 0")
    q, d = _inputs(rng, "float32", (2, 3, 8), (4, 5, 8))
    call = (lambda: maxsim_varlen(q, d.reshape(20, 8), bad)) if where == "d_offsets" else \
        (lambda: maxsim(bad, d)) if where == "Q" else (lambda: maxsim(q, d, q_lengths=bad))
    with pytest.raises(TypeError, match=f"^{where}: expected a JAX array, or an array or list of numbers JAX holds"):
        call()


def test_missing_buffer_callback_names_the_jax_needed(rng, monkeypatch):
    monkeypatch.setattr(_jax_ops, "_buffer_callback", lambda: None)
    monkeypatch.setattr(lik_cupy._dispatch.backend, "gpu_available", lambda: True)  # past the no-GPU error
    monkeypatch.setenv("LIK_JAX_PATH", "kernel")
    q, d = _inputs(rng, "float32", (2, 3, 8), (4, 5, 8))
    with pytest.raises(RuntimeError, match=f"jax >= {_jax_ops.BUFFER_CALLBACK_JAX}"):
        maxsim(q, d, backend="gpu")
    if jax.default_backend() == "cpu":  # "auto" on a CPU-only jax still scores, through the NumPy path
        np.testing.assert_array_equal(np.asarray(maxsim(q, d)), lik_cupy.maxsim(q, d, backend="cpu"))


def test_backend_gpu_without_cupy_raises_the_documented_error_when_traced(rng, monkeypatch):
    """Not an error from inside XLA's run (a JaxRuntimeError naming the missing module)."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    q, d = _inputs(rng, "float32", (2, 3, 8), (4, 5, 8))
    for run in (lambda: maxsim(q, d, backend="gpu"), lambda: jax.jit(lambda a: maxsim(a, d, backend="gpu"))(q),
                lambda: jax.grad(lambda a: maxsim(a, d, backend="gpu").sum())(q)):
        with pytest.raises(RuntimeError, match="backend='gpu' but no CUDA GPU is visible") as error:
            jax.block_until_ready(run())
        assert type(error.value) is RuntimeError


def test_a_tracer_given_to_the_top_level_functions_points_at_lik_cupy_jax():
    """A tracer reaching lik_cupy.maxsim (under jax.jit, grad or vmap) raised JAX's error from inside its
    own message (AttributeError: 'str' object has no attribute '_error_repr'), naming no fix."""
    Q, D = jnp.ones((1, 2, 8)), jnp.ones((3, 4, 8))
    for call in (lambda: jax.jit(lambda q: lik_cupy.maxsim(q, D))(Q),
                 lambda: jax.jit(lambda n: lik_cupy.maxsim(Q, D, d_lengths=n))(jnp.array([1, 2, 3])),
                 lambda: jax.grad(lambda q: lik_cupy.retrieve(q, D, 2)[0].sum())(Q),
                 lambda: jax.vmap(lambda q: lik_cupy.maxsim_varlen(q, D.reshape(12, 8), jnp.array([0, 4, 12])))(Q)):
        with pytest.raises(TypeError, match=r"(Q|d_lengths): a JAX tracer .* use lik_cupy\.jax\.maxsim"):
            call()
    np.testing.assert_array_equal(np.asarray(lik_cupy.maxsim(Q, D)), np.full((1, 3), 16, np.float32))  # concrete
    with pytest.raises(ValueError, match="d_lengths holds 1180591620717411303424; every entry must fit int64"):
        maxsim(Q, D, d_lengths=[2**70, 1, 1])  # (was jnp's OverflowError: Python int too large to convert to C long)


@pytest.mark.gpu
def test_backend_gpu_refuses_a_computation_on_the_cpu(rng):
    q, d = _inputs(rng, "float32", (2, 3, 8), (4, 5, 8))
    with jax.default_device(jax.devices("cpu")[0]), \
            pytest.raises(RuntimeError, match="needs the computation on a CUDA device"):
        jax.block_until_ready(maxsim(q, d, backend="gpu"))


def test_precision_is_resolved_when_traced(rng, monkeypatch):
    """float32 precision follows jax_default_matmul_precision as it is while tracing."""
    asked = []
    real = _jax_ops.call

    def spy(fn, arrays, outs, kwargs, backend, warm=None):
        asked.append(kwargs.get("precision"))
        return real(fn, arrays, outs, kwargs, backend, warm)

    monkeypatch.setattr(_jax_ops, "call", spy)
    monkeypatch.setenv("LIK_JAX_PATH", "kernel")  # one staged call per trace (no XLA branch beside it)
    q, d = _inputs(rng, "float32", (2, 3, 17), (4, 5, 17))  # dims no other test traces, one per step
    with jax.default_matmul_precision("tensorfloat32"):
        jax.jit(maxsim)(q, d)
    jax.jit(maxsim)(q[..., :16], d[..., :16])
    maxsim(q[..., :15], d[..., :15], precision="tf32")
    assert asked == ["tf32", "fp32", "tf32"]
    np.testing.assert_array_equal(np.asarray(maxsim(q, d, precision="fp32")), lik_cupy.maxsim(q, d, backend="cpu"))


def test_batched_call_plans_without_jax_arrays(rng):
    """run_batched on NumPy arrays with batch axes in front, as the callbacks see them."""
    spec = _batched_calls.CallSpec("maxsim", ("Q", "D", "d_lengths"), (3, 3, 1), (("backend", "cpu"),))
    q, d = _inputs(rng, "float32", (2, 3, 4, 5, 8), (1, 1, 6, 7, 8))
    dl = rng.integers(0, 8, (1, 1, 6))
    outs = [np.empty((2, 3, 4, 6), np.float32)]

    def write(out, r):
        out[...] = r

    assert _batched_calls.plan(spec, {"Q": q, "D": d, "d_lengths": dl}) == "queries"
    _batched_calls.run_batched(spec, lambda **kw: lik_cupy.maxsim(**kw, backend="cpu"), [q, d, dl], outs, write, np)
    want = lik_cupy.maxsim(q.reshape(24, 5, 8), d[0, 0], d_lengths=dl[0, 0], backend="cpu").reshape(2, 3, 4, 6)
    np.testing.assert_array_equal(outs[0], want)
    d2 = np.broadcast_to(d, (2, 1, 6, 7, 8))
    assert _batched_calls.plan(spec, {"Q": q, "D": d2, "d_lengths": dl}) == "loop"
    one = np.empty((1, 1, 4, 6), np.float32)
    assert _batched_calls.plan(spec, {"Q": q[:1, :1], "D": d, "d_lengths": dl}) == "single"
    _batched_calls.run_batched(spec, lambda **kw: lik_cupy.maxsim(**kw, backend="cpu"), [q[:1, :1], d, dl], [one],
                               write, np)
    np.testing.assert_array_equal(one, want[:1, :1])


# ---------------------------------------------------------------- XLA's einsum where the measured rule prefers it


def test_grad_through_the_path_rule_on_both_sides_matches_float64(rng, monkeypatch):
    """A rule of two measured cells for XLA on the CPU: the small step takes XLA's einsum (no
    callback), the large one the NumPy path; each step's scores and gradients match float64."""
    monkeypatch.delenv("LIK_JAX_PATH", raising=False)
    monkeypatch.setattr(jax_paths, "JAX_PATHS", {"cpu": ((4, 8, 8, "xla"), (16, 16, 64, "kernel"))})
    seen = _plans(monkeypatch)  # one per callback run (the CUDA branch is traced too, never run)
    for (n, lq, ld), want in (((4, 8, 8), []), ((8, 16, 48), ["single", "single"])):
        q, d = _inputs(rng, "float32", (n, lq, 16), (n, ld, 16))
        ql, dl = rng.integers(1, lq + 1, n), rng.integers(1, ld + 1, n)
        w = rng.standard_normal((n, n)).astype(np.float32)
        seen.clear()
        scores, (gq, gd) = jax.jit(jax.value_and_grad(
            lambda a, b: (maxsim(a, b, q_lengths=ql, d_lengths=dl) * w).sum(), argnums=(0, 1)))(q, d)
        assert seen == want
        qv, dv = _valid(ql, lq), _valid(dl, ld)
        ref, _ = maxsim_ref(q, d, qv, dv)
        assert abs(float(scores) - float((ref * w).sum())) <= 1e-5 * float(np.abs(ref * w).sum())
        rq, rd = _grads_ref(q, d, qv, dv, w)
        _close(gq, rq, "float32")
        _close(gd, rd, "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_xla_path_has_the_kernels_semantics(rng, monkeypatch, dtype):
    """Differentiated calls forced onto XLA's einsum, the scores of the NumPy path: every layout,
    masks and lengths (empty documents and queries, bad lengths), NaN in masked tokens (ignored)
    and in valid ones (a NaN score); ties (integer tokens) give the gradient to the first winner,
    as the argmax does. A call not differentiated keeps the kernels (here the NumPy path)."""
    nq, lq, nd, ld, dim = 3, 6, 4, 7, 8
    q, d = _inputs(rng, dtype, (nq, lq, dim), (nd, ld, dim))
    qm, dm = rng.random((nq, lq)) < 0.7, rng.random((nd, ld)) < 0.6
    qm[1], dm[2] = False, False
    q[0, ~qm[0]], d[0, ~dm[0]] = np.nan, np.nan
    d[3, np.argmax(dm[3])] = np.nan
    cand = _inputs(rng, dtype, (nq, 2, ld, dim))[0]

    def trained(f, a, b):  # the scores of a differentiated call (jax.vjp's forward), as a training step sees them
        return jax.vjp(f, a, b)[0]

    calls = [lambda: jax.jit(lambda a, b: trained(lambda x, y: maxsim(x, y, qm, dm), a, b))(q, d),
             lambda: trained(maxsim, q, d),
             lambda: trained(lambda a, b: maxsim(a, b, q_lengths=np.array([6, 0, 9]), d_lengths=np.array([7, 0, -1, 3])),
                             q, d),
             lambda: trained(maxsim, q, cand), lambda: trained(maxsim, q, d[1]), lambda: trained(maxsim, q[2], d),
             lambda: trained(maxsim, q[2], d[1])]
    seen = _plans(monkeypatch)
    monkeypatch.setenv("LIK_JAX_PATH", "xla")
    xla = [np.asarray(f()) for f in calls]
    assert seen == []
    monkeypatch.setenv("LIK_JAX_PATH", "kernel")
    # XLA's float32 einsum against the exact path: each of a score's lq terms within (dim + 2) float32
    # roundings of the largest |q| |d| (a score near 0 would fail any relative tolerance)
    norms = [np.nanmax(np.linalg.norm(np.asarray(x, np.float64), axis=-1)) for x in (q, np.concatenate([d, cand[0]]))]
    atol = lq * (dim + 2) * float(np.finfo(np.float32).eps) * norms[0] * norms[1]
    for got, f in zip(xla, calls):
        np.testing.assert_allclose(got, np.asarray(f()), rtol=1e-6, atol=atol)
    # the cases are there: an all-masked query, an empty document, a NaN in a valid token, bad lengths
    assert (xla[0][1] == 0).all() and (xla[0][[0, 2], 2] == -np.inf).all() and np.isnan(xla[0][[0, 2], 3]).all()
    assert np.isnan(xla[2][2]).all() and np.isnan(xla[2][:, 2]).all()
    monkeypatch.setenv("LIK_JAX_PATH", "xla")
    seen.clear()
    np.testing.assert_array_equal(np.asarray(maxsim(q, d, qm, dm)), lik_cupy.maxsim(q, d, qm, dm, backend="cpu"))
    assert seen == ["single"]
    qi = rng.integers(-2, 3, (nq, lq, dim)).astype(NP_DTYPES[dtype])  # many equal maxima
    di = rng.integers(-2, 3, (nd, ld, dim)).astype(NP_DTYPES[dtype])
    w = rng.standard_normal((nq, nd)).astype(np.float32)
    gq, gd = jax.grad(lambda a, b: (maxsim(a, b, qm, dm) * w).sum(), argnums=(0, 1))(qi, di)
    rq, rd = _grads_ref(qi, di, qm, dm, w)
    _close(gq, rq, dtype)
    _close(gd, rd, dtype)


def test_xla_path_gradient_goes_to_the_first_nan(rng, monkeypatch):
    """A NaN in valid document tokens: the XLA path's gradients are the kernels' (the NumPy path's),
    NaN where theirs are: each query token's gradient goes to the document's first NaN token only."""
    q, d = _inputs(rng, "float32", (3, 5, 8), (4, 6, 8))
    d[1, [2, 4]] = np.nan
    d[3, 0, 3] = np.nan
    w = rng.standard_normal((3, 4)).astype(np.float32)
    grads = {}
    for path in ("xla", "kernel"):
        monkeypatch.setenv("LIK_JAX_PATH", path)
        grads[path] = [np.asarray(g) for g in jax.grad(lambda a, b: (maxsim(a, b) * w).sum(), argnums=(0, 1))(q, d)]
    for got, want in zip(grads["xla"], grads["kernel"]):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=1e-5, atol=1e-5)
    dq, dd = grads["xla"]
    assert np.isnan(dq).any(axis=-1).all()  # every query token's winner in document 1 is a NaN token
    assert (dd[1, 2] != 0).all() and (dd[1, 4] == 0).all()  # the first NaN token takes the gradient, not the second
    # A NaN gradient of one score reaches its winners only, as through the kernels' backward.
    q, d = _inputs(rng, "float32", (3, 5, 8), (4, 6, 8))
    w[0, 2] = np.nan
    for path in ("xla", "kernel"):
        monkeypatch.setenv("LIK_JAX_PATH", path)
        grads[path] = [np.asarray(g) for g in jax.grad(lambda a, b: (maxsim(a, b) * w).sum(), argnums=(0, 1))(q, d)]
    for got, want in zip(grads["xla"], grads["kernel"]):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert 0 < np.isnan(grads["xla"][1][2]).any(axis=-1).sum() < 6  # document 2: its winners only


def test_path_rule_takes_the_nearest_cell_and_never_xla_beyond_it(monkeypatch):
    monkeypatch.delenv("LIK_JAX_PATH", raising=False)
    cells = {"gpu": ((8, 32, 80, "xla"), (64, 32, 80, "kernel"), (32, 128, 256, "xla"))}
    monkeypatch.setattr(jax_paths, "JAX_PATHS", cells)
    choose = jax_paths.choose_jax_path
    assert choose("gpu", 8, 8, 32, 80) == "xla"
    assert choose("gpu", 64, 64, 32, 80) == "kernel"
    assert choose("gpu", 16, 16, 32, 100) == "xla"  # nearer (8, 32, 80) than (64, 32, 80)
    assert choose("gpu", 32, 32, 128, 256) == "xla"
    assert choose("gpu", 32, 32, 128, 257) == "kernel"  # more similarities than any cell XLA won
    assert choose("cpu", 8, 8, 32, 80) == "kernel"  # no cells: the NumPy path
    assert choose("gpu", 8, 8, 32, 0) == "kernel"  # no document tokens: nothing to materialise
    monkeypatch.setenv("LIK_JAX_PATH", "xla")
    assert choose("cpu", 64, 64, 32, 80) == "xla"
    monkeypatch.setenv("LIK_JAX_PATH", "fast")
    with pytest.raises(ValueError, match="LIK_JAX_PATH must be one of"):
        choose("gpu", 8, 8, 32, 80)


# ---------------------------------------------------------------- GPU (jax with CUDA; the kernels on XLA's stream)


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax sees no CUDA device (install jax[cuda12])")


TOL = {"float16": 2e-5, "bfloat16": 2e-5, "float32": 1e-5}  # float32: 3xTF32 ("fp32", jax's default)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_jit_and_grad_match_float64(rng, dtype):
    gpu = _gpu()
    nq, lq, nd, ld, dim = 5, 33, 70, 45, 128
    q, d = _inputs(rng, dtype, (nq, lq, dim), (nd, ld, dim))
    ql, dl = rng.integers(1, lq + 1, nq), rng.integers(0, ld + 1, nd)
    Q, D, QL, DL = (jax.device_put(x, gpu) for x in (q, d, ql, dl))
    out = jax.jit(lambda a, b: maxsim(a, b, q_lengths=QL, d_lengths=DL))(Q, D)
    assert next(iter(out.devices())).platform == "gpu"
    ref, _ = maxsim_ref(q, d, _valid(ql, lq), _valid(dl, ld))
    assert rel_err(out, ref) < TOL[dtype]

    # gradients: few enough argmaxes that a near tie (which float32 may break the other way) is unlikely
    nq, lq, nd, ld, dim = 3, 9, 11, 13, 64
    q, d = _inputs(rng, dtype, (nq, lq, dim), (nd, ld, dim))
    ql, dl = rng.integers(1, lq + 1, nq), rng.integers(0, ld + 1, nd)
    w = rng.standard_normal((nq, nd)).astype(np.float32)
    Q, D, QL, DL, W = (jax.device_put(x, gpu) for x in (q, d, ql, dl, w))

    def loss(a, b):
        return (maxsim(a, b, q_lengths=QL, d_lengths=DL) * W).sum()

    gq, gd = jax.jit(jax.grad(loss, argnums=(0, 1)))(Q, D)
    assert gq.dtype == Q.dtype and gd.dtype == D.dtype
    rq, rd = _grads_ref(q, d, _valid(ql, lq), _valid(dl, ld), w)
    _close(gq, rq, dtype if dtype != "float32" else "float16")  # fp32 accumulation on the device
    _close(gd, rd, dtype if dtype != "float32" else "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_xla_path_grad_matches_float64(rng, monkeypatch, dtype):
    """The XLA path on a CUDA device (forced, as the measured rule takes it for small steps): a
    jitted value_and_grad with lengths runs no callback and matches float64."""
    gpu = _gpu()
    monkeypatch.setenv("LIK_JAX_PATH", "xla")
    seen = _plans(monkeypatch)
    nq, lq, nd, ld, dim = 4, 16, 6, 40, 128
    q, d = _inputs(rng, dtype, (nq, lq, dim), (nd, ld, dim))
    ql, dl = rng.integers(1, lq + 1, nq), rng.integers(0, ld + 1, nd)
    w = rng.standard_normal((nq, nd)).astype(np.float32)
    Q, D, QL, DL, W = (jax.device_put(x, gpu) for x in (q, d, ql, dl, w))
    step = jax.jit(jax.value_and_grad(lambda a, b: (jnp.where(DL > 0, maxsim(a, b, q_lengths=QL, d_lengths=DL), 0)
                                                     * W).sum(), argnums=(0, 1)))
    value, (gq, gd) = step(Q, D)
    assert seen == [] and next(iter(gq.devices())).platform == "gpu"
    ref, _ = maxsim_ref(q, d, _valid(ql, lq), _valid(dl, ld))
    want = float((np.where(dl > 0, ref, 0) * w).sum())
    assert abs(float(value) - want) <= 1e-4 * float(np.abs(np.where(dl > 0, ref, 0) * w).sum())
    rq, rd = _grads_ref(q, d, _valid(ql, lq), _valid(dl, ld), w)
    _close(gq, rq, "float16")
    _close(gd, rd, "float16")


@pytest.mark.gpu
def test_gpu_back_to_back_calls_on_xla_stream(rng):
    """Many jitted calls queued without blocking, each reading what an XLA kernel just wrote and
    feeding the next XLA kernel: any read off XLA's stream order would show in some result."""
    gpu = _gpu()
    n, nq, lq, nd, ld, dim = 200, 2, 32, 300, 64, 128
    q, d = _inputs(rng, "float16", (nq, lq, dim), (nd, ld, dim))
    Q, D = jax.device_put(q, gpu), jax.device_put(d, gpu)

    @jax.jit
    def step(q, d, i):
        d = d * (1 + i).astype(d.dtype)  # written by XLA right before the custom call reads it
        return maxsim(q, d) * 2 + 1  # read by XLA right after

    outs = [step(Q, D, jnp.float16(i % 3)) for i in range(n)]
    got = np.stack([np.asarray(o) for o in jax.block_until_ready(outs)])
    for k in range(3):
        ref = maxsim_ref(q, (d.astype(np.float32) * np.float16(1 + k)).astype(np.float16))[0] * 2 + 1
        for i in range(k, n, 3):
            assert rel_err(got[i], ref) < 1e-4, i


@pytest.mark.gpu
@pytest.mark.parametrize("fn", ["maxsim", "maxsim_varlen"])
def test_gpu_repeat_runs_write_xla_buffers_directly(rng, monkeypatch, fn):
    """A repeat run of a signature takes the forward's prepared call: it makes no CuPy view of XLA's
    buffers, and writes the scores (under grad, with the argmax) into XLA's outputs."""
    gpu = _gpu()
    nq, lq, nd, ld, dim = 3, 21, 40, 17, 64
    ql = rng.integers(1, lq + 1, nq).astype(np.int32)
    lens = rng.integers(0, ld + 1, nd)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    QL, OFF, DL = (jax.device_put(x, gpu) for x in (ql, off, lens.astype(np.int32)))
    if fn == "maxsim":
        def score(a, b):
            return maxsim(a, b, q_lengths=QL, d_lengths=DL)
    else:
        def score(a, b):
            return maxsim_varlen(a, b, OFF, q_lengths=QL)
    run = jax.jit(score)
    grad = jax.jit(jax.grad(lambda a, b: score(a, b).sum()))
    views = []
    real = _jax_ops._cupy_view
    monkeypatch.setattr(_jax_ops, "_cupy_view", lambda b, dev: views.append(b.shape) or real(b, dev))
    for i in range(4):
        q, d = _inputs(rng, "float16", (nq, lq, dim), (nd, ld, dim))
        Q, D = jax.device_put(q, gpu), jax.device_put(d if fn == "maxsim" else d[_valid(lens, ld)], gpu)
        views.clear()
        out = jax.block_until_ready(run(Q, D))
        assert bool(views) == (i == 0), (i, views)  # only the first run views XLA's buffers
        assert rel_err(out, maxsim_ref(q, d, _valid(ql, lq), _valid(lens, ld))[0]) < TOL["float16"], i
        gq = grad(Q, D)  # its forward writes the argmax into XLA's buffer as well
        _close(gq, _grads_ref(q, d, _valid(ql, lq), _valid(lens, ld), np.ones((nq, nd)))[0], "float16")


@pytest.mark.gpu
def test_gpu_repeat_runs_narrow_int64_lengths_under_x64(rng):
    """With x64 on, lengths stay int64: a repeat run's prepared call narrows them to int32 from XLA's
    buffer itself, which has no astype (every repeat run with int64 query lengths raised)."""
    gpu = _gpu()
    nq, lq, nd, ld, dim = 3, 21, 40, 17, 64
    with _x64():
        ql = rng.integers(1, lq + 1, nq).astype(np.int64)
        lens = rng.integers(0, ld + 1, nd).astype(np.int64)
        QL, DL = jax.device_put(ql, gpu), jax.device_put(lens, gpu)
        run = jax.jit(lambda a, b: maxsim(a, b, q_lengths=QL, d_lengths=DL))
        grad = jax.jit(jax.grad(lambda a, b: maxsim(a, b, q_lengths=QL, d_lengths=DL).sum()))
        for i in range(3):  # the first run prepares the call, the next ones take it
            q, d = _inputs(rng, "float16", (nq, lq, dim), (nd, ld, dim))
            Q, D = jax.device_put(q, gpu), jax.device_put(d, gpu)
            out = jax.block_until_ready(run(Q, D))
            assert rel_err(out, maxsim_ref(q, d, _valid(ql, lq), _valid(lens, ld))[0]) < TOL["float16"], i
            _close(grad(Q, D), _grads_ref(q, d, _valid(ql, lq), _valid(lens, ld), np.ones((nq, nd)))[0], "float16")


@pytest.mark.gpu
def test_gpu_varlen_vmap_and_bad_values(rng):
    gpu = _gpu()
    lens = rng.integers(0, 40, 50)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, t = _inputs(rng, "bfloat16", (6, 20, 64), (int(off[-1]), 64))
    Q, T, OFF = (jax.device_put(x, gpu) for x in (q, t, off))
    out = jax.jit(maxsim_varlen)(Q, T, OFF)
    want = lik_cupy.maxsim_varlen(q, t, off, backend="cpu")
    assert rel_err(out, want) < TOL["bfloat16"]
    gt = jax.jit(jax.grad(lambda b: maxsim_varlen(Q, b, OFF).sum()))(T)
    assert gt.dtype == T.dtype and np.isfinite(np.asarray(gt, np.float32)).all()
    bad = jax.jit(maxsim_varlen)(Q, T, OFF.at[3].set(-5))
    assert np.isnan(np.asarray(bad)).all()
    per = jax.jit(jax.vmap(lambda a: maxsim_varlen(a, T, OFF)))(Q[:, None])  # "queries": one launch
    assert rel_err(np.asarray(per)[:, 0], want) < TOL["bfloat16"]
    d = _inputs(rng, "bfloat16", (6, 9, 30, 64))[0]
    pairs = jax.jit(jax.vmap(maxsim))(Q, jax.device_put(d, gpu))  # single queries, own documents
    assert rel_err(pairs, np.stack([lik_cupy.maxsim(q[i], d[i], backend="cpu") for i in range(6)])) < TOL["bfloat16"]
    loop = jax.jit(jax.vmap(maxsim))(Q.reshape(3, 2, 20, 64), jax.device_put(d[:3], gpu))
    assert rel_err(loop, np.stack([lik_cupy.maxsim(q[2 * i:2 * i + 2], d[i], backend="cpu")
                                   for i in range(3)])) < TOL["bfloat16"]
    ql = jnp.array([20, 21, 0, -1, 5, 20])
    masked = np.asarray(jax.jit(lambda a: maxsim(a, jax.device_put(d[0], gpu), q_lengths=ql))(Q))
    assert np.isnan(masked[[1, 3]]).all() and np.isfinite(masked[[0, 2, 4, 5]]).all()


@pytest.mark.gpu
def test_gpu_int8_jit(rng):
    gpu = _gpu()
    q, d = _inputs(rng, "float16", (4, 32, 128), (60, 50, 128))
    d8, ds = lik_cupy.quantize_int8(d, backend="cpu")
    dl = rng.integers(0, 51, 60)
    Q, D8, DS, DL = (jax.device_put(x, gpu) for x in (q, d8, ds, dl))
    out = jax.jit(lambda a: maxsim_int8(a, D8, DS, d_lengths=DL))(Q)
    want = lik_cupy.maxsim_int8(q, d8, ds, d_lengths=dl, backend="cpu")
    assert rel_err(out, want) < 1e-5


@pytest.mark.gpu
def test_gpu_float64_with_x64(rng):
    gpu = _gpu()
    with _x64():
        q, d = rng.standard_normal((3, 20, 64)), rng.standard_normal((30, 25, 64))
        Q, D = jax.device_put(q, gpu), jax.device_put(d, gpu)
        out = jax.jit(maxsim)(Q, D)
        assert out.dtype == jnp.float64 and rel_err(out, maxsim_ref(q, d)[0]) < TOL["float32"]
        gq = jax.jit(jax.grad(lambda a: maxsim(a, D).sum()))(Q)
        assert gq.dtype == jnp.float64 and gq.shape == Q.shape


@pytest.mark.gpu
def test_gpu_arrays_on_another_device_are_the_first_devices_call(rng, other_gpu):
    """lik_cupy.jax under jit (forward and gradients) and the top-level lik_cupy.maxsim with JAX arrays on the
    second GPU, the first one JAX's default and CuPy's current: the results lie on the second GPU, scores and
    argmax bit for bit as on the first, gradients to the atomics' rounding, and CuPy's device stays the first."""
    import cupy

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        pytest.skip("jax sees no CUDA device (install jax[cuda12])")
    if len(gpus) < 2:
        pytest.skip("jax sees one CUDA device")
    q, d = _inputs(rng, "float16", (3, 9, 64), (7, 13, 64))
    ql, dl = rng.integers(1, 10, 3), rng.integers(1, 14, 7)
    w = rng.standard_normal((3, 7)).astype(np.float32)

    def run(dev):
        Q, D, QL, DL, W = (jax.device_put(x, dev) for x in (q, d, ql, dl, w))
        jitted = jax.jit(lambda a, b, x, y: maxsim(a, b, q_lengths=x, d_lengths=y))(Q, D, QL, DL)
        grads = jax.jit(jax.grad(lambda a, b: (maxsim(a, b, q_lengths=QL, d_lengths=DL) * W).sum(),
                                 argnums=(0, 1)))(Q, D)
        jax.block_until_ready((jitted, grads))
        # JAX's own dispatch leaves its device's context current (jax.devices() and a jit on the
        # second GPU do, with no lik_cupy call in them); lik_cupy restores whatever the caller had.
        cupy.cuda.runtime.setDevice(0)
        top = lik_cupy.maxsim(Q, D, q_lengths=QL, d_lengths=DL, return_argmax=True)
        jax.block_until_ready(top)
        assert cupy.cuda.runtime.getDevice() == 0
        return jitted, top, grads

    want = run(gpus[0])
    for _ in range(2):  # the first call, then the callback's prepared call
        got = run(gpus[1])
        cupy.cuda.runtime.setDevice(0)  # (for the fixture's check: JAX's own dispatch may have moved it)
        for x in jax.tree_util.tree_leaves(got):
            assert x.devices() == {gpus[1]}
        for x, y in zip(jax.tree_util.tree_leaves(got[:2]), jax.tree_util.tree_leaves(want[:2])):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(got[2], want[2]):
            _close(x, np.asarray(y, np.float64), "float16")
