"""Host values follow the README's contract (Semantics, "Invalid device values"): ids and lengths given
as host arrays are checked on the host and raise, never reach a score reinterpreted. CPU only."""

import pathlib

import numpy as np
import pytest

import lik_cupy
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


def test_uint64_ids_past_int64_are_refused_and_named():
    """Corpus ids as a uint64 array are kept as int64: one past int64 would wrap to a negative id."""
    D = np.ones((3, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"^ids holds 18446744073709551615; every entry must fit int64$"):
        lik_cupy.Corpus(D, device="cpu", ids=np.array([0, 2**64 - 1, 1], np.uint64))
    c = lik_cupy.Corpus(D, device="cpu", ids=np.array([0, 2**63 - 1, 1], np.uint64))
    assert c.ids.dtype == np.int64 and c.ids.tolist() == [0, 2**63 - 1, 1]


def test_unsigned_and_signed_ints_in_one_list_are_taken():
    """np.uint64 beside a Python int makes NumPy's float64 array; every value fits int64, so the list
    is taken as int64 (the search for one that did not fit raised a bare StopIteration)."""
    import lik_cupy

    Q, D = np.ones((1, 2, 8), np.float32), np.ones((3, 4, 8), np.float32)
    c = lik_cupy.Corpus(D, device="cpu", ids=[np.uint64(7), 1, 2])
    np.testing.assert_array_equal(c.rerank(Q, [[np.uint64(1), 0]]), c.rerank(Q, [[1, 0]]))
    got = lik_cupy.maxsim(Q, D, d_lengths=[np.uint64(1), 2, 2], backend="cpu")
    np.testing.assert_array_equal(got, lik_cupy.maxsim(Q, D, d_lengths=[1, 2, 2], backend="cpu"))


def test_residual_varlen_validate_none_is_the_default():
    """validate=None means the default wherever validate is taken: maxsim_residual_varlen refused it."""
    index = plaid.PlaidIndex.open(INDEX)
    Q = np.random.default_rng(0).standard_normal((1, 4, index.dim)).astype(np.float32)
    args = (Q, index.codes, index.residual_bits, index.offsets, index.centroids, index.bucket_weights, index.nbits)
    np.testing.assert_array_equal(plaid.maxsim_residual_varlen(*args, validate=None, backend="cpu"),
                                  plaid.maxsim_residual_varlen(*args, backend="cpu"))


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (NumPy's own, on making a matrix)
def test_numpy_subclasses_score_as_plain_arrays():
    # np.matrix stays 2-D whatever it is reshaped to: a one-query call raised "not enough values to
    # unpack (expected 3, got 2)" from deep inside the CPU path
    q = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    d = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    want = lik_cupy.maxsim(q, d, backend="cpu")
    np.testing.assert_array_equal(lik_cupy.maxsim(np.matrix(q), d, backend="cpu"), want)
    np.testing.assert_array_equal(lik_cupy.maxsim(q, np.matrix(d[0]), backend="cpu"),
                                  lik_cupy.maxsim(q, d[0], backend="cpu"))
