"""lik_cupy.integrations.colpali against colpali-engine 0.3's own torch reference, and
patch_colpali_engine (CPU torch).

The reference is colpali-engine's torch path on float64 copies of the inputs. The inputs hold a
query token whose true max is negative against every document, with zero-padded documents, where
colpali-engine's zero pads (which count, scoring 0) and left-out padding differ.
"""

from __future__ import annotations

import numpy as np
import pytest

from reference import masked_maxsim_ref, negative_token_inputs

torch = pytest.importorskip("torch")
colpali_maxsim = pytest.importorskip("colpali_engine.utils.maxsim")

import lik_cupy  # noqa: E402
from lik_cupy.integrations import colpali as lc  # noqa: E402


@pytest.fixture(autouse=True)
def _no_backend_variable(monkeypatch):
    monkeypatch.delenv("COLPALI_SCORES_BACKEND", raising=False)


def _zero_padded(rng, d_shape):
    """Q, D with each document's tail zeroed (colpali-engine's padding), the first document whole."""
    Q, D = negative_token_inputs(rng, (5, 7, 24), d_shape)
    lengths = rng.integers(1, d_shape[-2] + 1, d_shape[:-2])
    lengths.reshape(-1)[0] = d_shape[-2]
    D[np.arange(d_shape[-2]) >= lengths[..., None]] = 0.0
    return torch.from_numpy(Q), torch.from_numpy(D)


def _check(out, ref, tol=1e-5):
    assert out.dtype == torch.float32 and out.shape == ref.shape
    err = (out.double() - ref.detach()).norm() / ref.detach().norm()
    assert err < tol, f"relative error {err:.2e}"


def _check_doc_grad(out, ref, D):
    """dD, where a max shared by several zero pads goes to the first of them (the argmax) and torch's
    ``amax`` splits it between them: equal on every other token, and in sum over each document's pads."""
    pads = (D == 0).all(-1, keepdim=True)
    _check(torch.where(pads, 0, out), torch.where(pads, 0, ref))
    per_doc = lambda g: torch.where(pads, g, 0).sum(-2)  # noqa: E731
    assert torch.allclose(per_doc(out).double(), per_doc(ref).double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["inbatch", "kd"])
def test_maxsim_and_gradients_match_colpali(rng, layout):
    if layout == "inbatch":
        Q, D = _zero_padded(rng, (6, 11, 24))
        ours, theirs = lc.maxsim_inbatch, colpali_maxsim._torch_maxsim
    else:
        Q, D = _zero_padded(rng, (5, 3, 9, 24))
        ours, theirs = lc.maxsim_kd, colpali_maxsim._torch_maxsim_kd
    Q64, D64 = (x.double().requires_grad_(True) for x in (Q, D))
    ref = theirs(Q64, D64)
    assert torch.allclose(ref, masked_maxsim_ref(Q, D))  # the reference the GPU tests use is colpali-engine's
    Q.requires_grad_(True)
    D.requires_grad_(True)
    out = ours(Q, D)
    _check(out, ref)
    g = torch.from_numpy(rng.standard_normal(ref.shape))
    (out * g.float()).sum().backward()
    (ref * g).sum().backward()
    _check(Q.grad, Q64.grad)
    _check_doc_grad(D.grad, D64.grad, D.detach())


def test_maxsim_names_embeddings_that_are_no_tensors():
    # A NumPy array raised AttributeError ("'numpy.dtypes.Float32DType' object has no attribute
    # 'is_floating_point'"), a list or None "'list' object has no attribute 'ndim'"; colpali-engine's
    # own raises a TypeError.
    Q, D = np.ones((2, 3, 4), np.float32), np.ones((3, 5, 4), np.float32)
    with pytest.raises(TypeError, match="query must be a torch tensor, got ndarray"):
        lc.maxsim_inbatch(Q, torch.from_numpy(D))
    with pytest.raises(TypeError, match="doc must be a torch tensor, got list"):
        lc.maxsim_kd(torch.from_numpy(Q), D[:2, None].tolist())


def test_zero_pads_count_as_tokens(rng):
    Q, D = _zero_padded(rng, (6, 11, 24))
    pads = (D == 0).all(-1)
    assert pads.any()
    # lik-cupy's own masks would leave the pads out; colpali-engine's convention keeps them.
    assert not torch.allclose(lik_cupy.maxsim(Q, D, d_mask=~pads), lc.maxsim_inbatch(Q, D))


@pytest.mark.parametrize("form", ["lists", "tensors", "mixed"])
def test_score_multi_vector_matches_colpali(rng, form, monkeypatch):
    # "mixed": a run of pages of one length (chunks of them stacked, the others packed)
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    qs = [torch.from_numpy(rng.standard_normal((n, 16)).astype(np.float32)) for n in (3, 7, 5)]
    qs[0][1] = 0.0
    qs[0][1, 0] = -1.0
    lens = list(rng.integers(1, 13, 11)) if form != "mixed" else [9] * 6 + list(rng.integers(1, 13, 7))
    ps = [torch.from_numpy((0.3 * rng.standard_normal((n, 16))).astype(np.float32)) for n in lens]
    for p in ps:
        p[:, 0] = p[:, 0].abs() + 1.0  # query 0's token 1 has a negative max on every page
    if form == "tensors":
        qs = torch.nn.utils.rnn.pad_sequence(qs, batch_first=True)
        ps = torch.nn.utils.rnn.pad_sequence(ps, batch_first=True)
    monkeypatch.setattr(lc, "_CHUNK_BYTES", 2 * 13 * 16 * 4)  # pages scored in several calls
    for batch_size in (1, 3, 4, 128):
        ref = BaseVisualRetrieverProcessor.score_multi_vector(
            [q.double() for q in qs], [p.double() for p in ps], batch_size=batch_size, device="cpu")
        out = lc.score_multi_vector(qs, ps, batch_size=batch_size, device="cpu")
        assert out.device.type == "cpu"
        _check(out, ref)


def test_score_multi_vector_compiles_and_matches_colpali(rng):
    # Under torch.compile the zero-padding flags of the packed pages raised "zero-vector padding
    # flags are for eager calls", where colpali-engine's own function compiles: the short pages are
    # scored as zero-padded there, as colpali-engine pads them.
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    Q = torch.from_numpy(rng.standard_normal((3, 5, 16)).astype(np.float32))
    P = torch.from_numpy(rng.standard_normal((7, 9, 16)).astype(np.float32))
    Q[0, 1] = 0.0
    Q[0, 1, 0] = -1.0
    P[..., 0] = P[..., 0].abs() + 1.0  # query 0's token 1 has a negative max on every page
    lens = [9, 2, 5, 9, 1, 3, 6]

    def score(fn, q, p):
        return fn([q[0, :2], q[1], q[2, :4]], [p[j, :n] for j, n in enumerate(lens)], batch_size=3, device="cpu")

    compiled = torch.compile(lambda q, p: score(lc.score_multi_vector, q, p), backend="aot_eager")
    try:
        q, p = Q.clone().requires_grad_(True), P.clone().requires_grad_(True)
        out = compiled(q, p)
        out.sum().backward()
    finally:
        torch._dynamo.reset()
    q64, p64 = Q.double().requires_grad_(True), P.double().requires_grad_(True)
    ref = score(BaseVisualRetrieverProcessor.score_multi_vector, q64, p64)
    ref.sum().backward()
    assert out.device.type == "cpu"
    _check(out, ref)
    _check(q.grad, q64.grad)
    _check(p.grad, p64.grad)


def test_score_multi_vector_never_reads_padding():
    # The documented difference: colpali-engine multiplies an infinite embedding by its padding's
    # zeros (inf * 0 = NaN), of a short page's batch or of a short query's; none is read here.
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    inf = float("inf")
    qs = [torch.tensor([[inf, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]])]
    ps = [torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 1.0], [1.0, -1.0]])]
    out = lc.score_multi_vector(qs, ps, device="cpu")
    assert torch.equal(out, torch.tensor([[inf, inf], [2.0, 2.0]]))
    theirs = BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, device="cpu")
    assert torch.isnan(theirs[0, 0]) and torch.equal(theirs[1], out[1])
    ps[1][0, 1] = inf  # the padded query 0's zero token against it
    assert lc.score_multi_vector(qs, ps, device="cpu")[0, 1] == inf
    assert torch.isnan(BaseVisualRetrieverProcessor.score_multi_vector(qs, ps, device="cpu")[0, 1])


def test_score_multi_vector_pads_queries_in_bounded_runs(rng, monkeypatch):
    # Every query was zero-padded to the longest of them all in one buffer: 4,000 one-token queries
    # beside one of 1,000 tokens (2.5 MB) took 2 GB, where colpali-engine pads a batch of queries at a
    # time. Runs of queries are now padded in turn, each within _CHUNK_BYTES.
    from colpali_engine.utils.processing_utils import BaseVisualRetrieverProcessor

    qs = [torch.from_numpy(rng.standard_normal((n, 16)).astype(np.float32)) for n in [1] * 30 + [40] + [2] * 30]
    ps = [torch.from_numpy(rng.standard_normal((n, 16)).astype(np.float32)) for n in (3, 5, 5, 1)]
    limit = 48 * 16 * 4
    monkeypatch.setattr(lc, "_CHUNK_BYTES", limit)
    padded = []

    def recording(xs, device):
        X, lengths = _padded(xs, device)
        padded.append(X.numel() * X.element_size())
        return X, lengths

    _padded = lc._padded
    monkeypatch.setattr(lc, "_padded", recording)
    for batch_size in (2, 128):
        out = lc.score_multi_vector(qs, ps, batch_size=batch_size, device="cpu")
        ref = BaseVisualRetrieverProcessor.score_multi_vector(
            [q.double() for q in qs], [p.double() for p in ps], batch_size=batch_size, device="cpu")
        _check(out, ref)
    assert padded and max(padded) <= limit


def test_score_multi_vector_refuses_empty_inputs():
    with pytest.raises(ValueError, match="No queries provided"):
        lc.score_multi_vector([], [torch.ones(2, 4)])
    with pytest.raises(ValueError, match="No passages provided"):
        lc.score_multi_vector([torch.ones(2, 4)], [])


def test_score_multi_vector_names_a_bad_embedding_or_batch_size():
    # A one-dimensional page raised IndexError ('Dimension out of range'), pages of two dims torch.cat's
    # 'Sizes of tensors must match except in dimension 0', and batch_size=None "'<' not supported
    # between instances of 'NoneType' and 'int'": none named the argument.
    qs, ps = [torch.ones(2, 4), torch.ones(3, 4)], [torch.ones(5, 4), torch.ones(1, 4)]
    with pytest.raises(ValueError, match=r"ps\[1\] must be a \[L, d\] tensor, got shape \[4\]"):
        lc.score_multi_vector(qs, [ps[0], ps[1][0]], device="cpu")
    with pytest.raises(ValueError, match=r"qs\[0\] must be a \[L, d\] tensor, got shape \[1, 2, 4\]"):
        lc.score_multi_vector([qs[0][None]], ps, device="cpu")
    with pytest.raises(ValueError, match=r"ps\[1\] has dim 3 but ps\[0\] has dim 4"):
        lc.score_multi_vector(qs, [ps[0], torch.ones(2, 3)], device="cpu")
    with pytest.raises(ValueError, match=r"ps have dim 3 but qs have dim 4"):
        lc.score_multi_vector(qs, [torch.ones(2, 3)], device="cpu")
    with pytest.raises(TypeError, match=r"qs\[1\] must be a torch tensor, got ndarray"):
        lc.score_multi_vector([qs[0], np.ones((2, 4), np.float32)], ps, device="cpu")
    with pytest.raises(TypeError, match="batch_size must be an integer, got NoneType"):
        lc.score_multi_vector(qs, ps, batch_size=None, device="cpu")


def test_backend_variable_picks_colpali_or_lik_cupy(rng, monkeypatch):
    Q, D = (x.half() for x in _zero_padded(rng, (4, 5, 24)))
    theirs = colpali_maxsim.maxsim_inbatch(Q, D)
    assert theirs.dtype == torch.float16  # the torch reference keeps the inputs' dtype; we return float32
    assert lc.maxsim_inbatch(Q, D).dtype == torch.float32
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "torch")
    assert torch.equal(lc.maxsim_inbatch(Q, D), theirs)
    monkeypatch.setenv("COLPALI_SCORES_BACKEND", "flash")
    with pytest.raises(ValueError, match="COLPALI_SCORES_BACKEND must be one of"):
        lc.maxsim_kd(Q, D[:, None])


def _unit(rng, shape):
    x = rng.standard_normal(shape)
    return torch.from_numpy((x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32))


@pytest.mark.parametrize("loss", ["ColbertLoss", "ColbertNegativeCELoss", "ColbertPairwiseNegativeCELoss",
                                  "ColbertSigmoidLoss"])
def test_patched_loss_step_matches_colpali(rng, loss, monkeypatch):
    from colpali_engine import loss as losses

    q, d, neg = _unit(rng, (4, 6, 16)), _unit(rng, (4, 9, 16)), _unit(rng, (4, 2, 9, 16))
    q[:, 5:] = 0.0  # zero-padded queries and documents, as colpali-engine's collator leaves them
    d[1, 4:] = 0.0
    neg[0, 1, 3:] = 0.0
    args = (q, d, neg) if "Negative" in loss else (q, d)

    def step():
        xs = [x.clone().requires_grad_(True) for x in args]
        out = getattr(losses, loss)()(*xs)
        out.backward()
        return out.detach(), [x.grad for x in xs]

    ref_loss, ref_grads = step()
    calls = []
    orig = lik_cupy.torch.maxsim
    monkeypatch.setattr(lik_cupy.torch, "maxsim", lambda *a, **k: calls.append(1) or orig(*a, **k))
    with lc.patch_colpali_engine():
        out_loss, out_grads = step()
    assert calls, "the patched loss did not score through lik-cupy"
    assert torch.allclose(out_loss, ref_loss, rtol=1e-5, atol=1e-6)
    # A zero query pad ties on every document token: its gradient is D at the first token here and
    # the mean over all of them in torch (colpali-engine's models zero the pads' gradient anyway).
    real = ~(q == 0).all(-1, keepdim=True)
    assert torch.allclose(torch.where(real, out_grads[0], 0), torch.where(real, ref_grads[0], 0), rtol=1e-4, atol=1e-6)
    for mine, theirs, x in zip(out_grads[1:], ref_grads[1:], args[1:]):
        _check_doc_grad(mine, theirs, x)


def test_patch_covers_every_copy_and_unpatch_restores_them(rng):
    import colpali_engine.loss.late_interaction_losses as losses
    import colpali_engine.utils.processing_utils as processing
    from colpali_engine.models import ColQwen2Processor

    places = [(colpali_maxsim, "maxsim_inbatch"), (colpali_maxsim, "maxsim_kd"), (losses, "maxsim_inbatch"),
              (losses, "maxsim_kd"), (processing, "maxsim_inbatch")]
    before = {(m.__name__, n): getattr(m, n) for m, n in places}
    smv = vars(processing.BaseVisualRetrieverProcessor)["score_multi_vector"]
    qs = [_unit(rng, (n, 16)) for n in (4, 6)]
    ps = [_unit(rng, (n, 16)) for n in (9, 3, 5)]
    ref = ColQwen2Processor.score_multi_vector(qs, ps, batch_size=2, device="cpu")
    with lc.patch_colpali_engine():
        for m, n in places:
            assert getattr(m, n) is getattr(lc, n), f"{m.__name__}.{n} not patched"
        assert ColQwen2Processor.score_multi_vector is lc.score_multi_vector
        assert torch.allclose(ColQwen2Processor.score_multi_vector(qs, ps, batch_size=2, device="cpu"), ref,
                              rtol=1e-5, atol=1e-6)
    for m, n in places:
        assert getattr(m, n) is before[(m.__name__, n)]
    assert vars(processing.BaseVisualRetrieverProcessor)["score_multi_vector"] is smv


def test_packed_zero_pad_calls_under_vmap_match_a_loop():
    """torch.func.vmap over the packed zero-padding call (behind score_multi_vector's packed pages) with no
    gradient read the batched tensors' data, "Cannot access data pointer of Tensor that doesn't have
    storage", where its padded sibling goes through the autograd Function's vmap rule; vmap of grad too."""
    from lik_cupy._torch_autograd import maxsim_varlen_zero_pad_grad

    gen = torch.Generator().manual_seed(0)
    Q, D = torch.randn(3, 2, 5, 16, generator=gen), torch.randn(20, 16, generator=gen)
    off, zp = torch.tensor([0, 4, 4, 11, 20]), torch.tensor([True, False, True, False])

    def f(q):
        return maxsim_varlen_zero_pad_grad(q, D, off, zp)

    assert torch.equal(torch.func.vmap(f)(Q), torch.stack([f(q) for q in Q]))
    grads = torch.func.vmap(torch.func.grad(lambda q: f(q).sum()))(Q)
    for b in range(3):
        q = Q[b].clone().requires_grad_(True)
        f(q).sum().backward()
        assert torch.equal(grads[b], q.grad)
