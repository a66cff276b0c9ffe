"""The one ranked merge (lik_cupy._ranking): score descending, lower position first, NaN last,
bit for bit the order of a three-key sort, whatever the values and however wide the positions."""

from __future__ import annotations

import numpy as np
import pytest

from lik_cupy._ranking import merge_ranked, merge_rankings

ODD = np.array([np.nan, -np.inf, np.inf, 0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 0.5, 0.5], np.float32)


def _three_keys(va, ia, vb, ib, k):
    v, i = np.concatenate([va, vb], axis=1), np.concatenate([ia, ib], axis=1)
    nan = np.isnan(v)
    order = np.lexsort((i, -np.where(nan, 0, v), nan), axis=1)[:, :k]
    return np.take_along_axis(v, order, 1), np.take_along_axis(i, order, 1)


@pytest.mark.parametrize("offset", [0, 1 << 33])  # positions within 32 bits, and past them
def test_merge_is_the_three_key_sort(rng, offset):
    for trial in range(200):
        nq, na, nb, k = (int(x) for x in rng.integers(1, [5, 25, 25, 40]))
        if trial % 2:  # ties, NaN, infinities, signed zeros, subnormals
            va, vb = rng.choice(ODD, (nq, na)), rng.choice(ODD, (nq, nb))
        else:
            va, vb = (np.round(rng.standard_normal((nq, n)), 1).astype(np.float32) for n in (na, nb))
        perm = rng.permutation(na + nb) + offset
        ia, ib = (np.broadcast_to(p, (nq, p.size)).astype(np.int64) for p in (perm[:na], perm[na:]))
        got, want = merge_ranked(va, ia, vb, ib, k), _three_keys(va, ia, vb, ib, k)
        assert np.array_equal(got[1], want[1])
        assert np.array_equal(got[0].view(np.uint32), want[0].view(np.uint32))  # -0.0 stays -0.0


@pytest.mark.parametrize("offset", [0, 1 << 33])
def test_merging_many_at_once_is_merging_pairs_in_turn(rng, offset):
    """The client merges all workers' rankings in one pass: the result of pairwise merges, bit for bit."""
    for trial in range(100):
        nq, parts, k = int(rng.integers(1, 5)), int(rng.integers(1, 6)), int(rng.integers(1, 40))
        widths = rng.integers(0, 20, parts)
        perm = rng.permutation(int(widths.sum())) + offset
        rankings = []
        for a, b in zip(np.cumsum(widths) - widths, np.cumsum(widths)):
            v = rng.choice(ODD, (nq, b - a)) if trial % 2 else np.round(rng.standard_normal((nq, b - a)), 1)
            i = np.broadcast_to(perm[a:b], (nq, b - a)).astype(np.int64)
            rankings.append(merge_ranked(v.astype(np.float32), i, np.empty((nq, 0), np.float32),
                                         np.empty((nq, 0), np.int64), int(widths.max())))  # each sorted already
        want = rankings[0]
        want = (want[0][:, :k], want[1][:, :k])
        for v, i in rankings[1:]:
            want = merge_ranked(*want, v, i, k)
        got = merge_rankings(rankings, k)
        assert np.array_equal(got[1], want[1])
        assert np.array_equal(got[0].view(np.uint32), want[0].view(np.uint32))


def test_float64_scores_keep_their_order_past_float32():
    """float64 scores apart by less than float32 resolves, or past its range, stay in order."""
    import lik_cupy

    v = np.array([[1.0, 1.0 + 1e-12, 0.5]])
    i = np.arange(3, dtype=np.int64)[None]
    s, p = merge_rankings([(v[:, :1], i[:, :1]), (v[:, 1:], i[:, 1:])], 3)
    assert p.tolist() == [[1, 0, 2]] and s.dtype == np.float64
    Q = np.ones((1, 1, 1))
    D = np.array([[[1.0]], [[1.0 + 1e-12]], [[1e39]], [[2e39]], [[0.5]]])
    s, p = lik_cupy.retrieve(Q, D, k=4, backend="cpu")
    assert p.tolist() == [[3, 2, 1, 0]] and (np.diff(s[0]) < 0).all()
