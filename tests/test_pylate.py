"""lik_cupy.integrations.pylate against PyLate 1.6's own torch path, and patch_pylate (CPU torch).

The reference is PyLate's function itself (backend="torch") on float64 copies of the inputs. Every
input set has a query token whose true max is negative against every document, and masks with a
full row and an empty one, so the test fails if masked tokens are left out instead of scoring 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from reference import masked_maxsim_ref, negative_token_inputs, padding_mask

torch = pytest.importorskip("torch")
pylate_scores = pytest.importorskip("pylate.scores")

import lik_cupy  # noqa: E402
from lik_cupy.integrations import pylate as lp  # noqa: E402

MASKS = ["none", "queries", "documents", "both"]


def _inputs(rng, d_shape, masks, mask_dtype):
    Q, D = negative_token_inputs(rng, (5, 7, 24), d_shape)
    qm = padding_mask(rng, Q.shape[:-1]) if masks in ("queries", "both") else None
    dm = padding_mask(rng, D.shape[:-1]) if masks in ("documents", "both") else None
    if mask_dtype == "float":
        qm = None if qm is None else qm.astype(np.float32)
        dm = None if dm is None else dm.astype(np.float32)
    t = lambda x: None if x is None else torch.from_numpy(x)  # noqa: E731
    return torch.from_numpy(Q), torch.from_numpy(D), t(qm), t(dm)


def _double(*xs):
    return [None if x is None else x.double().detach().requires_grad_(x.dtype.is_floating_point) for x in xs]


def _check(out, ref, tol=1e-5):
    assert out.dtype == torch.float32 and out.shape == ref.shape
    err = (out.double() - ref.detach()).norm() / ref.detach().norm()
    assert err < tol, f"relative error {err:.2e}"


def _grads_match(ours, ref, Q, D, Q64, D64, rng):
    g = torch.from_numpy(rng.standard_normal(ref.shape))
    (ours * g.float()).sum().backward()
    (ref * g).sum().backward()
    for mine, theirs in ((Q.grad, Q64.grad), (D.grad, D64.grad)):
        assert mine is not None
        _check(mine, theirs)


@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
@pytest.mark.parametrize("masks", MASKS)
def test_colbert_scores_and_gradients_match_pylate(rng, masks, mask_dtype):
    Q, D, qm, dm = _inputs(rng, (6, 11, 24), masks, mask_dtype)
    Q64, D64 = _double(Q, D)
    ref = pylate_scores.colbert_scores(Q64, D64, qm, dm, backend="torch")
    assert torch.allclose(ref, masked_maxsim_ref(Q, D, qm, dm))  # the reference the GPU tests use is PyLate's
    Q.requires_grad_(True)
    D.requires_grad_(True)
    out = lp.colbert_scores(Q, D, qm, dm)
    _check(out, ref)
    if dm is not None:  # PyLate's convention is not lik-cupy's: the test would see masks leave tokens out
        left_out = lik_cupy.maxsim(Q.detach(), D.detach(), None if qm is None else qm != 0, dm != 0)
        assert not torch.allclose(left_out, out.detach())
    _grads_match(out, ref, Q, D, Q64, D64, rng)


@pytest.mark.parametrize("masks", MASKS)
def test_colbert_kd_scores_and_gradients_match_pylate(rng, masks):
    Q, D, qm, dm = _inputs(rng, (5, 3, 9, 24), masks, "bool")
    Q64, D64 = _double(Q, D)
    ref = pylate_scores.colbert_kd_scores(Q64, D64, qm, dm, backend="torch")
    assert torch.allclose(ref, masked_maxsim_ref(Q, D, qm, dm))
    Q.requires_grad_(True)
    D.requires_grad_(True)
    out = lp.colbert_kd_scores(Q, D, qm, dm)
    _check(out, ref)
    _grads_match(out, ref, Q, D, Q64, D64, rng)


@pytest.mark.parametrize("masks", MASKS)
def test_colbert_scores_class_matches_pylate(rng, masks):
    Q, D, qm, dm = _inputs(rng, (4, 3, 10, 24), masks, "float")
    Q64, D64 = _double(Q, D)
    ref = pylate_scores.ColBERTScores()(Q64, D64, qm, dm, backend="torch")
    Q.requires_grad_(True)
    D.requires_grad_(True)
    out = lp.ColBERTScores()(Q, D, qm, dm)
    _check(out, ref)
    _grads_match(out, ref, Q, D, Q64, D64, rng)


def test_pairwise_matches_pylate_on_tensors_and_ragged_lists(rng):
    Q, D = negative_token_inputs(rng, (5, 7, 24), (5, 9, 24))
    Q, D = torch.from_numpy(Q), torch.from_numpy(D)
    _check(lp.colbert_scores_pairwise(Q, D), pylate_scores.colbert_scores_pairwise(Q.double(), D.double(),
                                                                                    backend="torch"))
    qs = [torch.from_numpy(rng.standard_normal((n, 24)).astype(np.float32)) for n in (3, 8, 1, 5)]
    ds = [rng.standard_normal((n, 24)).astype(np.float32) for n in (6, 2, 9, 4, 7)]  # one more: ignored
    ref = pylate_scores.colbert_scores_pairwise([q.double() for q in qs], [torch.from_numpy(d).double() for d in ds],
                                                backend="torch")
    _check(lp.colbert_scores_pairwise(qs, ds), ref)


def test_pairwise_lists_are_padded_in_bounded_runs(rng, monkeypatch):
    # Every pair was zero-padded to the longest query and document of them all: 2,000 one-token
    # documents beside one of 1,000 tokens (d 128) took 1 GB, where PyLate scores pair by pair.
    # Runs of pairs are now padded in turn, each within _CHUNK_BYTES; scores and gradients as PyLate's.
    qs = [torch.from_numpy(rng.standard_normal((n, 16)).astype(np.float32)) for n in [2] * 20 + [3] * 21]
    ds = [torch.from_numpy(rng.standard_normal((n, 16)).astype(np.float32)) for n in [1] * 20 + [40] + [2] * 20]
    limit = 48 * 16 * 4
    monkeypatch.setattr(lp, "_CHUNK_BYTES", limit)
    padded = []
    maxsim = lp._lik.maxsim

    def recording(Q, D, *args, **kwargs):
        padded.append(Q.numel() * Q.element_size() + D.numel() * D.element_size())
        return maxsim(Q, D, *args, **kwargs)

    monkeypatch.setattr(lp._lik, "maxsim", recording)
    for x in qs + ds:
        x.requires_grad_(True)
    q64, d64 = _double(*qs), _double(*ds)
    out = lp.colbert_scores_pairwise(qs, ds)
    ref = pylate_scores.colbert_scores_pairwise(q64, d64, backend="torch")
    _check(out, ref)
    assert padded and max(padded) <= limit
    g = torch.from_numpy(rng.standard_normal(ref.shape))
    (out * g.float()).sum().backward()
    (ref * g).sum().backward()
    for x, x64 in zip(qs + ds, q64 + d64):
        _check(x.grad, x64.grad)


def test_masked_tokens_are_only_valid_or_not(rng):
    # The two differences from PyLate's torch path the module states: a mask value is valid (nonzero)
    # or not, never a weight; and a masked token is never read, where the torch path's 0 times a NaN
    # or infinite similarity is NaN.
    Q, D, qm, dm = _inputs(rng, (6, 11, 24), "both", "float")
    want = lp.colbert_scores(Q, D, qm != 0, dm != 0)
    assert torch.equal(lp.colbert_scores(Q, D, 3 * qm, 0.5 * dm), want)
    Qbad, Dbad = Q.clone(), D.clone()
    Qbad[qm == 0] = float("inf")
    Dbad[dm == 0] = float("nan")
    assert torch.equal(lp.colbert_scores(Qbad, Dbad, qm, dm), want) and torch.isfinite(want).all()
    assert torch.isnan(pylate_scores.colbert_scores(Qbad, Dbad, qm, dm, backend="torch")).any()


def test_documented_differences_at_masked_tokens():
    # The module docstring's other two: a valid query token's infinite similarity with a masked
    # token is NaN through PyLate's torch path (inf * 0) and never computed here; and a valid token
    # whose similarity is exactly 0 ties the masked token's 0: the gradient goes to it here, to the
    # first of the two (the masked one, so none) in PyLate's max. The scores agree.
    dm = torch.tensor([[0, 1]])
    Q, D = torch.tensor([[[float("inf"), 0.0]]]), torch.tensor([[[5.0, 5.0], [1.0, 1.0]]])
    assert torch.equal(lp.colbert_scores(Q, D, None, dm), torch.tensor([[float("inf")]]))
    assert torch.isnan(pylate_scores.colbert_scores(Q, D, None, dm, backend="torch")).all()
    Q, D = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[5.0, 5.0], [0.0, 1.0]]])
    grads = []
    for fn in (lp.colbert_scores, lambda *a: pylate_scores.colbert_scores(*a, backend="torch")):
        q, d = Q.clone().requires_grad_(True), D.clone().requires_grad_(True)
        out = fn(q, d, None, dm)
        assert out.item() == 0.0
        out.sum().backward()
        grads.append((q.grad, d.grad))
    assert torch.equal(grads[0][0], torch.tensor([[[0.0, 1.0]]])) and grads[0][1][0, 1].tolist() == [1.0, 0.0]
    assert not grads[1][0].any() and not grads[1][1].any()


def test_masked_scores_compile_and_match_eager(rng):
    # While torch.compile traces, masked tokens are scored as zero vectors (the operators take no
    # zero-padding flags): the eager call's scores and gradients.
    Q, D, qm, dm = _inputs(rng, (6, 11, 24), "both", "bool")
    fn = torch.compile(lambda q, d: lp.colbert_scores(q, d, qm, dm), fullgraph=True, backend="aot_eager")
    grads = []
    for f in (fn, lambda q, d: lp.colbert_scores(q, d, qm, dm)):
        q, d = Q.clone().requires_grad_(True), D.clone().requires_grad_(True)
        out = f(q, d)
        out.sum().backward()
        grads.append((out.detach(), q.grad, d.grad))
    for mine, theirs in zip(*grads):
        assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_masked_scores_under_vmap_match_a_loop(rng):
    # torch.func.vmap of colbert_scores with a documents_mask (batched or not, no gradient) read the
    # batched tensors' data: "Cannot access data pointer of Tensor that doesn't have storage".
    Q, D, qm, dm = _inputs(rng, (6, 11, 24), "both", "float")
    Qs, qms = torch.stack([Q, Q.flip(0)]), torch.stack([qm, qm.flip(0)])
    loop = torch.stack([lp.colbert_scores(q, D, m, dm) for q, m in zip(Qs, qms)])
    assert torch.equal(torch.func.vmap(lambda q, m: lp.colbert_scores(q, D, m, dm))(Qs, qms), loop)
    dms = torch.stack([dm, dm.flip(0)])
    loop = torch.stack([lp.colbert_scores(Q, D, qm, m) for m in dms])
    assert torch.equal(torch.func.vmap(lambda m: lp.colbert_scores(Q, D, qm, m))(dms), loop)
    per_q = torch.func.vmap(torch.func.grad(lambda q, m: lp.colbert_scores(q, D, qm[:1], m).sum()))(Qs[:, :1], dms)
    for b in range(2):
        q = Qs[b, :1].clone().requires_grad_(True)
        lp.colbert_scores(q, D, qm[:1], dms[b]).sum().backward()
        assert torch.equal(per_q[b], q.grad)


def test_numpy_and_list_inputs_like_convert_to_tensor(rng):
    Q, D = negative_token_inputs(rng, (3, 4, 16), (5, 6, 16))
    ref = pylate_scores.colbert_scores(torch.from_numpy(Q).double(), torch.from_numpy(D).double(), backend="torch")
    _check(lp.colbert_scores(Q, list(D)), ref)


def test_float64_inputs_give_float64_scores(rng):
    Q, D = (torch.from_numpy(x).double() for x in negative_token_inputs(rng, (2, 3, 8), (4, 5, 8)))
    out = lp.colbert_scores(Q, D)
    assert out.dtype == torch.float64
    assert torch.allclose(out, pylate_scores.colbert_scores(Q, D, backend="torch"), rtol=1e-5)


def test_backend_names_pick_pylate_or_lik_cupy(rng, monkeypatch):
    Q, D = (torch.from_numpy(x).half() for x in negative_token_inputs(rng, (2, 3, 8), (4, 5, 8)))
    theirs = pylate_scores.colbert_scores(Q, D, backend="torch")
    assert theirs.dtype == torch.float16  # PyLate's torch path keeps the inputs' dtype; we return float32
    assert torch.equal(lp.colbert_scores(Q, D, backend="torch"), theirs)
    assert lp.colbert_scores(Q, D, backend="lik").dtype == torch.float32
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "torch")
    assert torch.equal(lp.colbert_scores(Q, D), theirs)
    assert lp.colbert_scores(Q, D, backend="auto").dtype == torch.float32  # the argument wins over the variable
    monkeypatch.setenv("PYLATE_SCORES_BACKEND", "cuda")
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'torch', 'flash', 'lik'; got 'cuda'"):
        lp.colbert_scores(Q, D)


def test_bad_shapes_and_dtypes_are_named():
    with pytest.raises(ValueError, match=r"documents_embeddings must be \[Nd, Ld, H\], got shape \[2, 3, 4, 8\]"):
        lp.colbert_scores(torch.zeros(1, 2, 8), torch.zeros(2, 3, 4, 8))
    with pytest.raises(TypeError, match="queries are torch.float32 but documents are torch.float16"):
        lp.colbert_kd_scores(torch.zeros(1, 2, 8), torch.zeros(1, 3, 4, 8, dtype=torch.float16))


def test_colbert_scores_class_refuses_a_documents_mask_of_another_shape(rng):
    # The mask was reshaped to [Dn * N, Ld] unchecked: one of [N, Dn, Ld] or [Dn, N * Ld] (as many
    # values) masked other documents' tokens and scored without a word, where PyLate's raises.
    Q, D, qm, dm = _inputs(rng, (4, 3, 10, 24), "both", "float")
    for bad in (dm.transpose(0, 1), dm.reshape(4, 30), dm[None]):
        with pytest.raises(ValueError, match=r"documents_mask has shape \[.*\]; expected \[4, 3, 10\]"):
            lp.ColBERTScores()(Q, D, qm, bad)


def test_pairwise_lists_and_backend_are_checked_by_name():
    # A three-dimensional entry of a list raised pad_sequence's 'The size of tensor a (3) must match
    # the size of tensor b (2) at non-singleton dimension 1', an entry of another dim the same of dim
    # 1, and backend=3 AttributeError "'int' object has no attribute 'lower'".
    qs, ds = [torch.ones(3, 8), torch.ones(2, 8)], [torch.ones(4, 8), torch.ones(5, 8)]
    with pytest.raises(ValueError, match=r"queries_embeddings\[0\] must be \[L, H\], got shape \[1, 3, 8\]"):
        lp.colbert_scores_pairwise([q[None] for q in qs], ds)
    with pytest.raises(ValueError, match=r"documents_embeddings\[1\] has dim 4 but documents_embeddings\[0\] "
                                         r"has dim 8"):
        lp.colbert_scores_pairwise(qs, [ds[0], ds[1][:, :4]])
    with pytest.raises(TypeError, match="backend must be a string or None, got int"):
        lp.colbert_scores(qs[0][None], ds[0][None], backend=3)


def test_embeddings_of_a_dtype_the_kernels_do_not_score_are_named():
    # float8 passed the floating-point check and failed in torch.promote_types ('Promotion for Float8
    # Types is not supported'); the drop-ins (colpali's too) take float16, bfloat16, float32 and float64.
    Q, D = torch.ones(1, 2, 8).to(torch.float8_e4m3fn), torch.ones(2, 3, 8).to(torch.float8_e4m3fn)
    match = "embeddings must be float16, bfloat16, float32 or float64, got torch.float8_e4m3fn"
    with pytest.raises(TypeError, match=match):
        lp.colbert_scores(Q, D)
    with pytest.raises(TypeError, match=match):
        lp.colbert_scores_pairwise(Q, D[:1])
    with pytest.raises(TypeError, match="embeddings must be float16, bfloat16, float32 or float64, got torch.int32"):
        lp.colbert_scores(Q.int(), D.int())


# ---------------------------------------------------------------- patch_pylate


class _TinyColBERT(torch.nn.Module):
    """What PyLate's losses read from a model: token embeddings of the features' input ids, a
    skiplist and the query-expansion flag (an embedding table stands in for the encoder)."""

    def __init__(self, vocab=50, dim=24, seed=0):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        torch.nn.init.normal_(self.emb.weight, generator=torch.Generator().manual_seed(seed))
        self.skiplist = [3, 4]  # "punctuation": masked out of the documents
        self.do_query_expansion = False

    def forward(self, features):
        return {"token_embeddings": self.emb(features["input_ids"])}


def _features(rng, n, length, vocab=50):
    ids = rng.integers(5, vocab, (n, length))
    ids[rng.random((n, length)) < 0.2] = 3
    lengths = rng.integers(2, length + 1, n)
    att = np.arange(length)[None, :] < lengths[:, None]
    ids[~att] = 0
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(att.astype(np.int64))}


def _margins(features, group):
    """How far the float32 scoring is from changing a winner: the smallest gap between a query
    token's best and second-best distinct document token (a masked one scoring 0, as through
    PyLate's torch path) over every query-document pair, valid query tokens only; and, where each query has ``group``
    candidates of its own (Distillation), the smallest gap between two scores and the smallest max - min (the Distillation
    loss divides by it)."""
    W = _TinyColBERT().emb.weight.detach().double().numpy()
    W = W / np.linalg.norm(W, axis=1, keepdims=True)
    q_ids = features[0]["input_ids"].numpy()
    q_valid = features[0]["attention_mask"].numpy().astype(bool)  # padded query tokens count for nothing
    docs = [(f["input_ids"].numpy(), f["attention_mask"].numpy().astype(bool)) for f in features[1:]]
    d_ids = np.concatenate([ids for ids, _ in docs])
    d_valid = np.concatenate([att for _, att in docs]) & ~np.isin(d_ids, _TinyColBERT().skiplist)
    token_gap, scores = np.inf, np.zeros((len(q_ids), len(d_ids)))
    for j, (ids, valid) in enumerate(zip(d_ids, d_valid)):
        distinct = np.unique(ids[valid])  # a repeated token ties with itself: the same row gets the gradient
        sims = W[q_ids] @ W[distinct].T  # [Nq, Lq, distinct]
        if not valid.all():
            sims = np.concatenate([sims, np.zeros(sims.shape[:2] + (1,))], axis=2)
        top = -np.sort(-sims, axis=2)
        if top.shape[2] > 1:
            token_gap = min(token_gap, (top[..., 0] - top[..., 1])[q_valid].min())
        scores[:, j] = (top[..., 0] * q_valid).sum(axis=1)
    if group is None:
        return token_gap, None, None
    ordered = np.sort(np.stack([scores[i, i * group:(i + 1) * group] for i in range(len(q_ids))]), axis=1)
    return token_gap, np.diff(ordered, axis=1).min(), (ordered[:, -1] - ordered[:, 0]).min()


def _well_conditioned_features(rng, draw, group=None):
    """Features whose float32 loss step is decided away from ties: a token winner or (for
    Distillation, ``group`` candidates per query) a score order that float32 rounding could flip
    sends the gradient elsewhere, and scores close together are divided by their spread."""
    for _ in range(200):
        feats = draw()
        token_gap, score_gap, spread = _margins(feats, group)
        if token_gap > 1e-4 and (group is None or (score_gap > 1e-3 and spread > 0.1)):
            return feats
    raise AssertionError("no well-conditioned features in 200 draws")


def _loss_step(make_loss, features, labels=None):
    model = _TinyColBERT()
    loss = make_loss(model)(features, labels) if labels is not None else make_loss(model)(features)
    loss.backward()
    return loss.detach(), model.emb.weight.grad.clone()


def test_patching_from_many_threads_at_once_restores_pylate():
    """Threads entering patch_pylate() at once both applied it, the second setting aside the first's
    replacements as PyLate's own: PyLate stayed patched after every context had exited, and its
    torch backend recursed into lik-cupy."""
    import sys
    import threading

    colbert = pytest.importorskip("pylate.scores.colbert")
    for module in ("pylate.rank.rank", "pylate.models.colbert", "pylate.losses.distillation"):
        pytest.importorskip(module)  # (each patched too: more to set and undo)
    own = colbert.colbert_scores
    Q, D = torch.randn(2, 3, 8), torch.randn(4, 5, 8)
    errors = []

    def worker():
        for _ in range(300):
            try:
                with lp.patch_pylate():
                    colbert.colbert_scores(Q, D, backend="torch")
            except BaseException as e:  # noqa: BLE001 - any failure inside a thread is the finding
                errors.append(repr(e)[:200])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as it can be
    try:
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert colbert.colbert_scores is own
    assert torch.equal(colbert.colbert_scores(Q, D, backend="torch"), own(Q, D, backend="torch"))


@pytest.mark.parametrize("loss", ["Contrastive", "CachedContrastive", "Distillation"])
def test_patched_loss_step_matches_pylate(rng, loss, monkeypatch):
    losses = pytest.importorskip("pylate.losses")
    calls = []

    def counting(orig):  # masked scores go through the zero-vector padding form
        return lambda *a, **k: calls.append(1) or orig(*a, **k)

    if loss == "Distillation":
        feats = _well_conditioned_features(rng, lambda: [_features(rng, 4, 6), _features(rng, 4 * 3, 9)], group=3)
        labels = torch.from_numpy(rng.standard_normal((4, 3)).astype(np.float32))
        make = losses.Distillation
    else:
        feats = _well_conditioned_features(rng, lambda: [_features(rng, 4, 6), _features(rng, 4, 9),
                                                         _features(rng, 4, 9)])
        labels = None
        make = losses.Contrastive if loss == "Contrastive" else (lambda m: losses.CachedContrastive(m, mini_batch_size=3))
    ref_loss, ref_grad = _loss_step(make, feats, labels)
    import lik_cupy._torch_autograd

    for mod, name in ((lik_cupy.torch, "maxsim"), (lik_cupy._torch_autograd, "maxsim_zero_pad_grad")):
        monkeypatch.setattr(mod, name, counting(getattr(mod, name)))
    with lp.patch_pylate():
        out_loss, out_grad = _loss_step(make, feats, labels)
    assert calls, "the patched loss did not score through lik-cupy"
    assert torch.allclose(out_loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert torch.allclose(out_grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_patched_rerank_matches_pylate(rng):
    from pylate import rank

    queries = [rng.standard_normal((6, 16)).astype(np.float32) for _ in range(3)]
    docs = [[rng.standard_normal((n, 16)).astype(np.float32) for n in rng.integers(1, 12, k)] for k in (4, 7, 2)]
    # Query 0's token 1 has a negative max over the first (padded) document: its zero padding counts.
    queries[0][1] = 0.0
    queries[0][1, 0] = -1.0
    docs[0][0] = np.abs(docs[0][0][:2]) + np.eye(1, 16, dtype=np.float32)
    docs[0][1] = docs[0][1][:1].repeat(9, axis=0)
    ids = [[f"d{i}-{j}" for j in range(len(d))] for i, d in enumerate(docs)]
    ref = rank.rerank(ids, queries, docs)
    with lp.patch_pylate():
        assert rank.rerank.__globals__["colbert_scores"] is lp.colbert_scores
        out = rank.rerank(ids, queries, docs)
    for mine, theirs in zip(out, ref):
        assert [r["id"] for r in mine] == [r["id"] for r in theirs]
        assert np.allclose([r["score"] for r in mine], [r["score"] for r in theirs], rtol=1e-5, atol=1e-5)


def test_patch_covers_every_copy_and_unpatch_restores_them():
    import pylate.evaluation.colbert_distillation as ev_dist
    import pylate.evaluation.colbert_triplet as ev_trip
    import pylate.losses.distillation as distillation
    import pylate.models.colbert as models
    import pylate.rank.rank as rank
    import pylate.scores.colbert as colbert

    places = [(colbert, "colbert_scores"), (colbert, "colbert_scores_pairwise"), (colbert, "colbert_kd_scores"),
              (pylate_scores, "colbert_scores"), (pylate_scores, "colbert_kd_scores"), (rank, "colbert_scores"),
              (distillation, "colbert_kd_scores"), (ev_dist, "colbert_kd_scores"),
              (ev_trip, "colbert_scores_pairwise")]
    before = {(m.__name__, n): getattr(m, n) for m, n in places}
    call_before = colbert.ColBERTScores.__call__
    old = distillation.Distillation.__new__(distillation.Distillation)  # made before the patch
    torch.nn.Module.__init__(old)
    old.score_metric = colbert.colbert_kd_scores
    model = models.ColBERT.__new__(models.ColBERT)  # a model's stored similarity, without loading weights
    torch.nn.Module.__init__(model)
    model.similarity_fn_name = "MaxSim"
    assert model.similarity is colbert.colbert_scores

    handle = lp.patch_pylate()
    try:
        assert lp.patch_pylate() is not None  # twice is harmless
        for m, n in places:
            assert getattr(m, n) is getattr(lp, n), f"{m.__name__}.{n} not patched"
        assert colbert.ColBERTScores.__call__ is lp.ColBERTScores.__call__
        assert old.score_metric is lp.colbert_kd_scores
        assert model.similarity is lp.colbert_scores and model.similarity_pairwise is lp.colbert_scores_pairwise
        with lp.patch_pylate():  # a with-block inside a patch leaves it in place
            pass
        assert rank.colbert_scores is lp.colbert_scores
    finally:
        lp.unpatch_pylate()
    for m, n in places:
        assert getattr(m, n) is before[(m.__name__, n)]
    assert colbert.ColBERTScores.__call__ is call_before
    assert old.score_metric is colbert.colbert_kd_scores and "score_metric" not in vars(distillation.Distillation)
    assert model.similarity is colbert.colbert_scores and "similarity" not in vars(models.ColBERT)
    with handle:
        pass  # exiting the first handle after unpatch_pylate changes nothing
    assert rank.colbert_scores is before[("pylate.rank.rank", "colbert_scores")]


def test_a_loss_score_metric_can_be_deleted_while_patched():
    # The patch's descriptor over Distillation.score_metric took reads and writes but no deletion:
    # `del loss.score_metric` raised AttributeError('__delete__'), where unpatched it removes it.
    import pylate.losses.distillation as distillation

    loss = distillation.Distillation.__new__(distillation.Distillation)
    torch.nn.Module.__init__(loss)
    loss.score_metric = distillation.colbert_kd_scores
    with lp.patch_pylate():
        del loss.score_metric
        assert not hasattr(loss, "score_metric")
        with pytest.raises(AttributeError, match="score_metric"):
            del loss.score_metric
        loss.score_metric = distillation.colbert_kd_scores
        assert loss.score_metric is lp.colbert_kd_scores
