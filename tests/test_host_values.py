"""Host values follow the README's contract (Semantics, "Invalid device values"): ids and lengths given
as host arrays are checked on the host and raise, never reach a score reinterpreted. CPU only."""

import pathlib

import numpy as np
import pytest

from lik_cupy import plaid

INDEX = pathlib.Path(__file__).parent / "data" / "fast_plaid" / "fast_plaid_nbits2"


@pytest.mark.parametrize("bad", [np.array([[0.7, 1.2]]), np.array([[True, False]]), [[0.5, 3.0]]])
def test_plaid_ids_must_be_integers(bad):
    """A float or bool id was truncated to another document's and scored (exit 0)."""
    idx = plaid.PlaidIndex.open(INDEX)
    Q = np.random.default_rng(0).standard_normal((1, 4, idx.dim)).astype(np.float32)
    with pytest.raises(TypeError, match="candidate_ids must (be int32 or int64 document ids, got dtype|hold integers)"):
        idx.rerank(Q, bad, backend="cpu")
    for method in (idx.residuals, idx.embeddings):
        with pytest.raises(TypeError, match="doc_ids must be integer document ids, got dtype"):
            method(np.asarray(bad).reshape(-1))


def test_plaid_ids_past_int64_are_named_as_given():
    idx = plaid.PlaidIndex.open(INDEX)
    with pytest.raises(ValueError, match=r"doc_ids holds 9223372036854775809; every entry must be in \[0, "):
        idx.residuals(np.array([2**63 + 1], np.uint64))
    assert idx.residuals([])[2].tolist() == [0]


def test_lengths_past_int64_are_named_as_given():
    """A uint64 length past int64 was reported as a negative one (the value after the cast)."""
    import lik_cupy

    Q, D = np.ones((1, 2, 8), np.float32), np.ones((4, 5, 8), np.float32)
    lens = np.array([2**63 + 1, 1, 1, 1], np.uint64)
    calls = [lambda: lik_cupy.maxsim(Q, D, d_lengths=lens, backend="cpu"),
             lambda: lik_cupy.retrieve(Q, D, 2, d_lengths=lens, backend="cpu"),
             lambda: lik_cupy.Corpus(D, d_lengths=lens, device="cpu")]
    for call in calls:
        with pytest.raises(ValueError, match=r"d_lengths holds 9223372036854775809; every length must be in \[0, 5\]"):
            call()
