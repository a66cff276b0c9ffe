"""The float64 references the GPU suites check their contenders against, run on the CPU: each is float64
MaxSim of the inputs a contender scores, exactly as it reads them (bench/lib/reference.py; the FP8
suite's dequantised inputs, the PLAID suite's decompressed documents, the training steps' gradients)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lik_cupy  # noqa: E402
from bench.lib.reference import exact_grads, exact_scores, max_rel_err  # noqa: E402
from bench_scripts import load as _load  # noqa: E402
from lik_cupy.plaid import decompress_residuals  # noqa: E402


def _unit(*shape, gen):
    x = torch.randn(*shape, generator=gen)
    return (x / x.norm(dim=-1, keepdim=True)).half()


@pytest.mark.parametrize("per", ["token", "tensor"])
def test_fp8_reference_is_float64_of_the_dequantised_inputs(per):
    bench = _load("bench/suites/bench_fp8.py")
    gen = torch.Generator().manual_seed(8)
    q, d = _unit(8, 32, gen=gen), _unit(6, 12, 32, gen=gen)
    q8, qs = lik_cupy.quantize_fp8(q, per=per, backend="cpu")
    d8, ds = lik_cupy.quantize_fp8(d, per=per, backend="cpu")
    ours = lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs, backend="cpu")  # exact dot products, rounded to float32
    assert max_rel_err(ours, bench.exact(torch, q8, d8, qs, ds)) < 1e-6
    # the fp16 inputs' scores (what the suite compared with) differ by the quantisation, not the arithmetic
    assert max_rel_err(ours, bench.exact(torch, q, d)) > 1e-4


def _plaid_corpus(nbits, gen):
    lens = torch.randint(1, 9, (12,), generator=gen)
    off = torch.zeros(13, dtype=torch.int64)
    off[1:] = lens.cumsum(0)
    t, n_cent = int(off[-1]), 16
    cen = torch.nn.functional.normalize(torch.randn(n_cent, 128, generator=gen), dim=-1).half()
    w = torch.sort(torch.randn(1 << nbits, generator=gen) * 0.03).values.half().float()
    return dict(lens=lens, off=off, codes=torch.randint(0, n_cent, (t,), generator=gen, dtype=torch.int32),
                bits=torch.randint(0, 256, (t, 128 * nbits // 8), generator=gen, dtype=torch.uint8),
                cen=cen, w=w, nbits=nbits)


@pytest.mark.parametrize("nbits", [2, 4])
def test_plaid_reference_decodes_the_format_lik_cupy_plaid_documents(nbits):
    bench = _load("bench/suites/bench_residual.py")
    gen = torch.Generator().manual_seed(nbits)
    c = _plaid_corpus(nbits, gen)
    tables = bench.fastplaid_tables(torch, nbits, device="cpu")
    ids = torch.tensor([3, 0, 7, 11])
    docs, valid = bench.exact_docs(torch, c, ids, bench.plaid_buckets(tables))
    want = decompress_residuals(c["codes"].numpy(), c["bits"].numpy(), c["cen"].numpy(), c["w"].numpy(), nbits)
    for k, j in enumerate(ids.tolist()):
        n = int(c["lens"][j])
        assert valid[k].sum() == n
        np.testing.assert_allclose(docs[k, :n].numpy(), want[int(c["off"][j]):int(c["off"][j + 1])], rtol=0, atol=1e-7)
    q = torch.nn.functional.normalize(torch.randn(2, 8, 128, generator=gen), dim=-1).half()
    cand = torch.stack([ids, ids.flip(0)])
    ref = bench.reference(torch, c, q, cand, bench.plaid_buckets(tables))
    ours = lik_cupy.maxsim_residual_varlen(q, c["codes"], c["bits"], c["off"], c["cen"], c["w"], nbits,
                                           candidates=cand, backend="cpu")
    assert (ours.double() - ref).abs().max() < 1e-5
    # fast-plaid's exact stage, its float16 operations on the CPU: within the suite's bound of float64
    fast = torch.stack([bench.fastplaid_exact(torch, c, q[i], cand[i], tables) for i in range(2)])
    assert (bench.scores_of(torch, list(fast)) - ref).abs().max() <= bench.ERR_BOUND


def test_lik_reads_each_residual_byte_from_its_low_bits():
    bench = _load("bench/suites/bench_residual.py")
    two = torch.zeros(1, 32, dtype=torch.uint8)
    two[0, 0] = 0b11_10_01_00
    assert bench.lik_buckets(torch, 2)(two)[0, :5].tolist() == [0, 1, 2, 3, 0]
    four = torch.zeros(1, 64, dtype=torch.uint8)
    four[0, 1] = 0x21
    assert bench.lik_buckets(torch, 4)(four)[0, :4].tolist() == [0, 0, 1, 2]


def test_exact_grads_is_float64_autograd_of_the_whole_step():
    gen = torch.Generator().manual_seed(3)
    q, d, w = _unit(3, 5, 16, gen=gen), _unit(4, 7, 16, gen=gen), torch.randn(3, 4, generator=gen)
    dq, dd, scores = exact_grads(torch, q, d, w, chunk=1)  # one document at a time
    q64, d64 = q.double().requires_grad_(True), d.double().requires_grad_(True)
    s64 = torch.einsum("isk,jtk->ijst", q64, d64).amax(-1).sum(-1)
    (s64 * w.double()).sum().backward()
    assert dq.dtype == dd.dtype == torch.float64
    assert torch.allclose(dq, q64.grad, rtol=0, atol=1e-12) and torch.allclose(dd, d64.grad, rtol=0, atol=1e-12)
    assert torch.allclose(scores, s64.detach(), rtol=0, atol=1e-12)
    assert torch.allclose(scores, exact_scores(torch, q, d, chunk=2), rtol=0, atol=1e-12)


def test_exact_scores_masks_and_scales():
    gen = torch.Generator().manual_seed(4)
    q, d = _unit(2, 5, 16, gen=gen), _unit(3, 6, 16, gen=gen)
    mask = torch.rand(3, 6, generator=gen) < 0.6
    mask[:, 0] = True
    want = torch.stack([torch.stack([(q[i].double() @ d[j][mask[j]].double().T).amax(1).sum() for j in range(3)])
                        for i in range(2)])
    assert torch.allclose(exact_scores(torch, q, d, d_mask=mask), want, rtol=0, atol=1e-12)
    qs, ds = torch.rand(2, 5, generator=gen), torch.tensor(0.5)
    scaled = exact_scores(torch, q, d, q_scales=qs, d_scales=ds)
    assert torch.allclose(scaled, exact_scores(torch, q.double() * qs.double()[..., None], d.double() * 0.5),
                          rtol=0, atol=1e-12)
