"""The PyLate and colpali-engine drop-ins on CUDA tensors, against the float64 reference of their
torch paths (``masked_maxsim_ref``; tests/test_pylate.py and tests/test_colpali.py check it is
PyLate's and colpali-engine's own), and PyLate's patched rerank on the GPU where PyLate imports.
"""

from __future__ import annotations

import numpy as np
import pytest

from reference import masked_maxsim_ref, negative_token_inputs, padding_mask

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

from lik_cupy.integrations import colpali as lc  # noqa: E402
from lik_cupy.integrations import pylate as lp  # noqa: E402

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Scores are float32 (fp16/bf16 products are exact in fp32; float32 inputs run on TF32 tensor cores);
# gradients come back in the inputs' dtype.
SCORE_TOL = {"float16": 1e-4, "bfloat16": 1e-4, "float32": 2e-3}
GRAD_TOL = {"float16": 2e-3, "bfloat16": 1e-2}


def _cuda(rng, q_shape, d_shape, dtype, masks):
    Q, D = negative_token_inputs(rng, q_shape, d_shape)
    Q, D = (torch.from_numpy(x).to("cuda", DTYPES[dtype]) for x in (Q, D))
    qm = torch.from_numpy(padding_mask(rng, Q.shape[:-1])).cuda() if masks else None
    dm = torch.from_numpy(padding_mask(rng, D.shape[:-1])).cuda().float() if masks else None
    return Q, D, qm, dm


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("masks", [False, True])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["inbatch", "kd", "groups"])
def test_pylate_scores_on_cuda(rng, layout, dtype, masks):
    d_shape = {"inbatch": (37, 45, 128), "kd": (9, 5, 45, 128), "groups": (6, 3, 45, 128)}[layout]
    Q, D, qm, dm = _cuda(rng, (9, 32, 128), d_shape, dtype, masks)
    if layout == "inbatch":
        out = lp.colbert_scores(Q, D, qm, dm)
        ref = masked_maxsim_ref(Q, D, qm, dm)
    elif layout == "kd":
        out = lp.colbert_kd_scores(Q, D, qm, dm)
        ref = masked_maxsim_ref(Q, D, qm, dm)
    else:
        out = lp.ColBERTScores()(Q, D, qm, dm)
        flat_mask = None if dm is None else dm.reshape(-1, dm.shape[-1])
        ref = masked_maxsim_ref(Q, D.reshape(-1, *D.shape[2:]), qm, flat_mask)
    assert out.is_cuda and out.dtype == torch.float32
    assert _rel(out, ref) < SCORE_TOL[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pylate_gradients_on_cuda(rng, dtype):
    Q, D, qm, dm = _cuda(rng, (7, 32, 96), (23, 61, 96), dtype, True)
    Q.requires_grad_(True)
    D.requires_grad_(True)
    Q64, D64 = (x.detach().double().requires_grad_(True) for x in (Q, D))
    out = lp.colbert_scores(Q, D, qm, dm)
    ref = masked_maxsim_ref(Q64, D64, qm, dm)
    g = torch.randn(ref.shape, device="cuda", dtype=torch.float64, generator=torch.Generator("cuda").manual_seed(3))
    (out * g.float()).sum().backward()
    (ref * g).sum().backward()
    assert _rel(Q.grad, Q64.grad) < GRAD_TOL[dtype]
    assert _rel(D.grad, D64.grad) < GRAD_TOL[dtype]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_pylate_pairwise_on_cuda(rng, dtype):
    qs = [torch.from_numpy(rng.standard_normal((n, 64))).to("cuda", DTYPES[dtype]) for n in (3, 32, 17, 1)]
    ds = [torch.from_numpy(rng.standard_normal((n, 64))).to("cuda", DTYPES[dtype]) for n in (130, 2, 77, 300)]
    out = lp.colbert_scores_pairwise(qs, ds)
    ref = torch.stack([masked_maxsim_ref(q[None], d[None])[0, 0] for q, d in zip(qs, ds)])
    assert out.is_cuda and _rel(out, ref) < SCORE_TOL[dtype]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["inbatch", "kd"])
def test_colpali_maxsim_on_cuda(rng, layout, dtype):
    d_shape = (33, 1030, 128) if layout == "inbatch" else (4, 6, 300, 128)
    Q, D, _, _ = _cuda(rng, (4, 20, 128), d_shape, dtype, False)
    D[..., 700 if layout == "inbatch" else 200:, :] = 0  # zero pads: they score 0
    out = lc.maxsim_inbatch(Q, D) if layout == "inbatch" else lc.maxsim_kd(Q, D)
    assert out.is_cuda and out.dtype == torch.float32
    assert _rel(out, masked_maxsim_ref(Q, D)) < SCORE_TOL[dtype]


def test_colpali_score_multi_vector_on_cuda(rng, monkeypatch):
    qs = [torch.from_numpy(rng.standard_normal((n, 128))).to(torch.bfloat16) for n in (20, 23, 17)]
    ps = [torch.from_numpy(rng.standard_normal((n, 128))).to(torch.bfloat16) for n in rng.integers(900, 1031, 10)]
    monkeypatch.setattr(lc, "_CHUNK_BYTES", 4 * 1030 * 128 * 2)  # several calls
    out = lc.score_multi_vector(qs, ps, batch_size=3, device="cuda")
    assert out.device.type == "cpu" and out.dtype == torch.float32
    Q = torch.nn.utils.rnn.pad_sequence(qs, batch_first=True)
    ref = torch.cat([masked_maxsim_ref(Q, torch.nn.utils.rnn.pad_sequence(ps[b:b + 3], batch_first=True))
                     for b in range(0, len(ps), 3)], dim=1)  # colpali-engine's batches of zero-padded pages
    assert _rel(out, ref) < 1e-4


def test_patched_pylate_rerank_on_cuda(rng, monkeypatch):
    try:
        from pylate import rank
    except Exception as e:  # noqa: BLE001  (absent, or its dependencies incomplete, as on a machine given only wheels)
        pytest.skip(f"pylate.rank does not import here: {e!r}")
    queries = [torch.from_numpy(rng.standard_normal((32, 128)).astype(np.float32)) for _ in range(2)]
    docs = [[torch.from_numpy(rng.standard_normal((n, 128)).astype(np.float32)) for n in rng.integers(5, 300, 50)]
            for _ in range(2)]
    ids = [list(range(50))] * 2
    with monkeypatch.context() as m:
        m.setenv("PYLATE_SCORES_BACKEND", "torch")  # PyLate's own torch path, in float64
        ref = rank.rerank(ids, [q.double() for q in queries], [[d.double() for d in ds] for ds in docs],
                          device="cuda")
    with lp.patch_pylate():
        out = rank.rerank(ids, queries, docs, device="cuda")
    for mine, theirs in zip(out, ref):
        assert np.allclose(sorted(r["score"] for r in mine), sorted(r["score"] for r in theirs), rtol=2e-3)
