"""TMA-staged document tiles against cp.async staging (GPU; the TMA kernels need sm_90).

Both paths do the same arithmetic in the same order, so scores and argmax must agree bit
for bit; the rest of the GPU suite checks the default path (TMA on Hopper) against float64.
"""

import numpy as np
import pytest

import lik_cupy
from lik_cupy import _dispatch as dispatch

pytestmark = pytest.mark.gpu


def _hopper():
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def record_forward_choices(monkeypatch) -> list:
    """From now on, each forward configuration dispatch picks is appended to the list returned."""
    picked = []
    chosen = dispatch.choose_forward

    def spy(*a, **k):
        picked.append(chosen(*a, **k))
        return picked[-1]

    monkeypatch.setattr(dispatch, "choose_forward", spy)
    return picked


def _both(monkeypatch, fn):
    """fn() with TMA staging and with cp.async staging, and the configurations each ran."""
    import cupy

    picked = record_forward_choices(monkeypatch)
    runs = []
    for off in ("1", ""):
        monkeypatch.setenv("LIK_DISABLE_TMA", off)
        out = fn()
        if not isinstance(out, tuple):  # scores only
            out = (out, None)
        runs.append(tuple(cupy.asnumpy(x) if x is not None else None for x in out))
    return runs, picked


def _check(runs, picked):
    (ref, ref_a), (got, got_a) = runs
    assert not picked[0].tma and picked[-1].tma, (picked[0].name, picked[-1].name)
    assert np.array_equal(ref, got, equal_nan=True)
    if ref_a is not None:
        assert np.array_equal(ref_a, got_a)


CASES = [  # (nq, lq, nd, ld, dim): one query tile, several, long queries, shared tiles (two
    # warpgroups, then one), short portable tiles (single short queries at d <= 128 take the
    # one-warpgroup tiles, which stage by cp.async)
    (1, 1024, 37, 333, 128),
    (2, 300, 23, 1024, 256),
    (32, 32, 45, 181, 128),
    (3, 32, 29, 77, 64),
    (2, 30, 29, 77, 128),
    (2, 300, 19, 130, 192),
    (1, 20, 29, 77, 256),
    # split-d (query and document chunks both by TMA, two warpgroups): a long query over three
    # tiles (the last one's rows run past Q), several short queries per tile, and a dim whose
    # last chunk runs past the row (zeros from the map)
    (2, 77, 23, 130, 768),
    (1, 300, 7, 200, 2048),
    (9, 13, 31, 57, 1024),
    (3, 40, 17, 99, 1000),
]


@pytest.mark.parametrize("nq,lq,nd,ld,dim", CASES)
@pytest.mark.parametrize("argmax", [False, True])
def test_padded_with_lengths_and_nan(rng, monkeypatch, nq, lq, nd, ld, dim, argmax):
    # fp16 stands for both 16-bit types: staging moves bytes, bf16 differs only in the mma.
    if not _hopper():
        pytest.skip("TMA staging runs on compute capability 9.0")
    import cupy

    q = cupy.asarray(_unit(rng, nq, lq, dim).astype(np.float16))
    d = _unit(rng, nd, ld, dim).astype(np.float16)
    d[3, 5, 7] = np.nan  # a NaN token: NaN scores in both paths (where it is inside the length)
    d = cupy.asarray(d)
    dlen = rng.integers(0, ld + 1, size=nd)
    dlen[1] = 0
    qlen = rng.integers(1, lq + 1, size=nq)
    runs, picked = _both(monkeypatch, lambda: lik_cupy.maxsim(
        q, d, q_lengths=cupy.asarray(qlen), d_lengths=cupy.asarray(dlen), return_argmax=argmax))
    _check(runs, picked)


@pytest.mark.parametrize("nq,lq", [(32, 32), (2, 700)])
def test_packed_documents(rng, monkeypatch, nq, lq):
    if not _hopper():
        pytest.skip("TMA staging runs on compute capability 9.0")
    import cupy

    lens = rng.integers(0, 400, size=57)
    lens[[0, 9, 10]] = 0
    off = np.concatenate([[0], np.cumsum(lens)])
    toks = cupy.asarray(_unit(rng, int(off[-1]), 128).astype(np.float16))
    q = cupy.asarray(_unit(rng, nq, lq, 128).astype(np.float16))
    runs, picked = _both(monkeypatch, lambda: lik_cupy.maxsim_varlen(
        q, toks, cupy.asarray(off), return_argmax=True))
    _check(runs, picked)


@pytest.mark.parametrize("nq,lq,ld", [(1, 1024, 1024), (3, 150, 63), (4, 40, 130), (2, 32, 301)])
def test_int8_scales_at_unaligned_offsets(rng, monkeypatch, standard_tiles, nq, lq, ld):
    # Documents of 63 or 130 tokens start their scales at offsets that are not 16-byte aligned.
    # The standard tiles throughout: with TMA, Ld = 1024 would take the tokens-on-M ones, whose
    # sums run in another order (tests/test_int8_gpu.py checks those).
    if not _hopper():
        pytest.skip("TMA staging runs on compute capability 9.0")
    import cupy

    standard_tiles()

    q8, qs = lik_cupy.quantize_int8(_unit(rng, nq, lq, 128))
    d8, ds = lik_cupy.quantize_int8(_unit(rng, 41, ld, 128))
    args = [cupy.asarray(x) for x in (q8, d8, ds, qs)]
    runs, picked = _both(monkeypatch, lambda: lik_cupy.maxsim_int8(*args[:3], q_scales=args[3]))
    _check(runs, picked)
