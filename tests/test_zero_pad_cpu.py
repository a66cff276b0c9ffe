"""Zero-vector padding on the NumPy path (``lik_cupy._maxsim_calls.maxsim_zero_pad`` and
``maxsim_varlen_zero_pad``: a flagged document's row maxima floored at 0, argmax -1 where the
floor wins), against the float64 reference of those semantics; its validation; and the repeat-call
path handing the flags to the kernel. The GPU side is in tests/test_zero_pad_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from lik_cupy import _cpu as cpu
from lik_cupy._maxsim_calls import maxsim_varlen_zero_pad as _maxsim_varlen_zero_pad
from lik_cupy._maxsim_calls import maxsim_zero_pad as _maxsim_zero_pad
from reference import zero_pad_ref

TOL = 1e-5  # float32 scores of exactly-rounded inputs


def _inputs(rng, nq, lq, nd, ld, dim, dtype=np.float32):
    """Q, D whose similarities straddle 0 (query 0's token 1 is below 0 against every token), float64
    copies of exactly what the library sees, query and document validity with an empty document
    (flagged and not), a full one and holes, and flags on about half the documents."""
    q = rng.standard_normal((nq, lq, dim))
    d = rng.standard_normal((nd, ld, dim))
    d[..., 0] = np.abs(d[..., 0]) + 0.5
    q[0, 1] = 0.0
    q[0, 1, 0] = -1.0
    q, d = q.astype(dtype), d.astype(dtype)
    qv = rng.random((nq, lq)) < 0.8
    qv[0, :2] = True
    dv = rng.random((nd, ld)) < 0.7
    dv[0] = True
    dv[1] = False
    dv[2] = False
    zp = rng.random(nd) < 0.5
    zp[[0, 1]] = True  # a full document flagged (no padding to it, but the flag floors it all the same)
    zp[2] = False  # an empty one unflagged: -inf
    return q, d, q.astype(np.float64), d.astype(np.float64), qv, dv, zp


def _check(s, a, ref, ref_a, near, qv=None):
    s = np.asarray(s, np.float64)
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(s), fin) and np.array_equal(s[~fin], ref[~fin], equal_nan=True)
    assert np.abs(s[fin] - ref[fin]).max(initial=0) <= TOL * (1 + np.abs(ref[fin]).max(initial=0))
    if a is not None:
        a = np.asarray(a)
        assert np.array_equal(a[~near], ref_a[~near])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("how", ["mask", "lengths"])
def test_padded_documents_score_their_zero_padding(rng, dtype, how):
    q, d, q64, d64, qv, dv, zp = _inputs(rng, 3, 7, 13, 17, 24, dtype)
    if how == "lengths":
        dlen = rng.integers(0, 18, 13)
        dlen[[0, 1, 2]] = (17, 0, 0)
        dv = np.arange(17)[None] < dlen[:, None]
        kw = {"d_lengths": dlen}
    else:
        kw = {"d_mask": dv}
    ref, ref_a, near = zero_pad_ref(q64, d64, qv, dv, zp)
    assert ref[:, 1].tolist() == [0.0] * 3 and (ref[:, 2] == -np.inf).all()  # empty: 0 flagged, -inf not
    assert (ref_a[0, :, 1][zp & dv.any(1)] == -1).all()  # the negative token's floor wins where flagged
    s, a = _maxsim_zero_pad(q, d, zp, qv, return_argmax=True, backend="cpu", **kw)
    _check(s, a, ref, ref_a, near)
    assert s.dtype == (np.float64 if dtype == np.float64 else np.float32)
    # no flag set: lik-cupy's own semantics, bit for bit
    import lik_cupy

    plain = lik_cupy.maxsim(q, d, qv, return_argmax=True, backend="cpu", **kw)
    got = _maxsim_zero_pad(q, d, np.zeros(13, bool), qv, return_argmax=True, backend="cpu", **kw)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(plain, got))


def test_a_max_of_exactly_zero_keeps_its_token(rng):
    """The floor wins only where the max is below 0 (the kernels' ``v < 0``, and PyLate's torch max,
    whose zero padding comes after the real tokens): a token whose similarity is exactly 0 keeps the
    argmax. _check leaves out maxima near 0, so small integers make the similarities exact here."""
    q = np.zeros((1, 3, 4), np.float32)
    q[0, :, 0] = [1, -1, 0]
    q[0, 2, 1] = -1
    d = np.zeros((2, 3, 4), np.float32)
    d[:, 0, 1] = 1  # orthogonal to query tokens 0 and 1: similarity 0 (-1 for token 2)
    d[:, 1, 0] = -2  # -2, 2 and 0
    d[1, 2, 0] = 3  # document 1 only: 3, -3 and 0
    zp = np.ones(2, bool)
    dm = np.array([[True, True, False], [True, True, True]])
    s, a = _maxsim_zero_pad(q, d, zp, d_mask=dm, return_argmax=True, backend="cpu")
    ref, ref_a, _ = zero_pad_ref(q.astype(np.float64), d.astype(np.float64), np.ones((1, 3), bool), dm, zp)
    assert a[0].tolist() == [[0, 1, 1], [2, 1, 1]] == ref_a[0].tolist()
    assert s.tolist() == [[2.0, 5.0]] == ref.tolist()
    d[:, 1, 0] = 2
    dm[0, 0] = False  # document 0 is token 1 alone: query token 1's max is -2, and the floor wins
    s, a = _maxsim_zero_pad(q, d, zp, d_mask=dm, return_argmax=True, backend="cpu")
    assert a[0, 0].tolist() == [1, -1, 1] and s[0, 0] == 2.0


def test_nan_stays_nan_and_padding_is_never_read(rng):
    q, d, q64, d64, qv, dv, zp = _inputs(rng, 2, 5, 6, 9, 16)
    zp[:] = True
    d[3, 4, 2] = d64[3, 4, 2] = np.nan  # a valid token: NaN scores (not floored away)
    dv[3, 4] = True
    d[4] = np.nan  # padding of every kind: never read
    dv[4] = False
    d[5, ~dv[5]] = np.inf
    ref, ref_a, near = zero_pad_ref(q64, d64, qv, dv, zp)
    s, a = _maxsim_zero_pad(q, d, zp, qv, dv, return_argmax=True, backend="cpu")
    assert np.isnan(s[:, 3]).all() and (s[:, 4] == 0).all() and np.isfinite(s[:, 5]).all()
    _check(s, a, ref, ref_a, near)
    assert (a[:, 3][qv] == 4).all()  # the NaN token wins every valid row


def test_candidates_and_long_documents(rng, monkeypatch):
    nq, k, ld, dim = 3, 5, 40, 16
    q, _, q64, _, qv, _, _ = _inputs(rng, nq, 6, 3, 1, dim)
    d = rng.standard_normal((nq, k, ld, dim)).astype(np.float32)
    dv = rng.random((nq, k, ld)) < 0.6
    dv[0, 0] = False
    zp = rng.random((nq, k)) < 0.5
    zp[0, 0] = True
    s, a = _maxsim_zero_pad(q, d, zp, qv, dv, return_argmax=True, backend="cpu")
    for i in range(nq):
        ref, ref_a, near = zero_pad_ref(q64[i:i + 1], d[i].astype(np.float64), qv[i:i + 1], dv[i], zp[i])
        _check(s[i:i + 1], a[i:i + 1], ref, ref_a, near)
    assert (s[0, 0] == 0).all()
    # blocks smaller than one document: its tokens in runs, the floor after they combine
    orig = cpu.maxsim_numpy
    monkeypatch.setattr(cpu, "maxsim_numpy", lambda *x, **kw: orig(*x, **{**kw, "block_bytes": 6 * 1024}))
    small = _maxsim_zero_pad(q, d, zp, qv, dv, return_argmax=True, backend="cpu")
    assert all(x.tobytes() == y.tobytes() for x, y in zip((s, a), small))


def test_packed_documents(rng, monkeypatch):
    q, d, q64, d64, qv, dv, zp = _inputs(rng, 3, 7, 11, 30, 16)
    lens = dv.sum(1)
    tokens = d[dv]  # each document's valid tokens, packed in order
    offsets = np.concatenate([[0], np.cumsum(lens)])
    packed_v = np.arange(30)[None] < lens[:, None]
    padded = np.zeros_like(d64)
    padded[packed_v] = tokens
    ref, ref_a, near = zero_pad_ref(q64, padded, qv, packed_v, zp)
    s, a = _maxsim_varlen_zero_pad(q, tokens, offsets, zp, qv, return_argmax=True, backend="cpu")
    _check(s, a, ref, ref_a, near)
    orig = cpu.maxsim_packed_numpy
    monkeypatch.setattr(cpu, "maxsim_packed_numpy", lambda *x, **kw: orig(*x, **{**kw, "block_bytes": 4 * 1024}))
    small = _maxsim_varlen_zero_pad(q, tokens, offsets, zp, qv, return_argmax=True, backend="cpu")
    assert all(x.tobytes() == y.tobytes() for x, y in zip((s, a), small))


@pytest.mark.parametrize("layout", ["padded", "candidates"])
def test_masked_flags_are_the_documents_with_a_masked_token(rng, layout):
    # zero_pad="masked" (PyLate's masks): the same scores, bit for bit, as flags computed from the mask
    q, d, _, _, qv, dv, _ = _inputs(rng, 3, 6, 8, 12, 16)
    if layout == "candidates":
        d, dv = np.stack([d, d[::-1]])[:, :, :, :], np.stack([dv, dv[::-1]])
        q, qv = q[:2], qv[:2]
    got = _maxsim_zero_pad(q, d, "masked", qv, dv, return_argmax=True, backend="cpu")
    want = _maxsim_zero_pad(q, d, ~dv.all(-1), qv, dv, return_argmax=True, backend="cpu")
    assert all(x.tobytes() == y.tobytes() for x, y in zip(got, want))


def test_bad_flags_are_named(rng):
    q, d = np.zeros((2, 3, 8), np.float32), np.zeros((4, 5, 8), np.float32)
    with pytest.raises(TypeError, match="zero_pad must be boolean"):
        _maxsim_zero_pad(q, d, np.zeros(4, np.uint8), backend="cpu")
    with pytest.raises(ValueError, match=r"zero_pad has shape \[5\]; expected \[4\]"):
        _maxsim_zero_pad(q, d, np.zeros(5, bool), backend="cpu")
    with pytest.raises(ValueError, match=r"zero_pad has shape \[4\]; expected \[3\]"):
        _maxsim_varlen_zero_pad(q, d.reshape(-1, 8), [0, 5, 9, 20], np.zeros(4, bool), backend="cpu")
    with pytest.raises(ValueError, match="zero_pad='masked' .* needs a d_mask"):
        _maxsim_zero_pad(q, d, "masked", d_lengths=np.array([1, 2, 3, 4]), backend="cpu")
    with pytest.raises(ValueError, match="zero_pad='masked' .* needs a d_mask"):
        _maxsim_varlen_zero_pad(q, d.reshape(-1, 8), [0, 5, 9, 20], "masked", backend="cpu")
    with pytest.raises(ValueError, match="zero_pad must be a boolean array or 'masked', got 'all'"):
        _maxsim_zero_pad(q, d, "all", d_mask=np.ones((4, 5), bool), backend="cpu")
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="zero_pad is a torch array but Q is a numpy array"):
        _maxsim_zero_pad(q, d, torch.zeros(4, dtype=torch.bool), backend="cpu")
