"""The float64 references the GPU suites check their contenders against, run on the CPU: each is float64
MaxSim of the inputs a contender scores, exactly as it reads them (bench/lib/reference.py; the FP8
suite's dequantised inputs, the PLAID suite's decompressed documents, the training steps' gradients)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lik_cupy  # noqa: E402
from bench.lib.reference import exact_grads, exact_query_scores, exact_scores, max_rel_err  # noqa: E402
from bench_scripts import REPO, load as _load  # noqa: E402
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


class _FlashInt8:
    """flash-maxsim 0.3.0's INT8 forms as its flash_maxsim_quant.py has them (per-token symmetric
    quantisers: float16 scales ``[B, Ld, 1]`` and ``[Lq]``), its int8x8 kernel as what it computes:
    MaxSim of the int8 values times their scales (here in float64, rounded to float32)."""

    @staticmethod
    def quantize_int8_symmetric(D):
        scales = D.abs().amax(dim=-1, keepdim=True).to(torch.float32).clamp_min(1e-8) / 127.0
        return (D / scales.to(D.dtype)).round().clamp(-127, 127).to(torch.int8), scales.half()

    @staticmethod
    def quantize_query_int8(Q):
        absmax = Q.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-8)
        return (Q.float() / absmax * 127.0).round().clamp(-127, 127).to(torch.int8), (absmax / 127.0).half().squeeze(-1)

    @staticmethod
    def flash_maxsim_int8x8(Q, D_int8, d_scales, Q_int8, q_scales):
        q = Q_int8.double() * q_scales.double()[:, None]
        d = D_int8.double() * d_scales.double()
        return torch.einsum("sk,jtk->jst", q, d).amax(dim=2).sum(dim=1).float()


def test_int8_errors_are_against_float64_of_the_dequantised_inputs():
    """bench_int8.py reported rel_diff_vs_fp16, the distance of each contender's scores from our own fp16
    path's: neither float64 nor the inputs the contender scores. Its errors are now bench_fp8.py's:
    max_rel_err against float64 MaxSim of each contender's inputs as it reads them (int8 values times
    their scales), and rel_l2_vs_fp16 against float64 MaxSim of the fp16 inputs before quantisation."""
    bench = _load("bench/suites/bench_int8.py")
    gen = torch.Generator().manual_seed(7)
    q, d = _unit(24, 64, gen=gen), _unit(50, 20, 64, gen=gen)
    calls, inputs = bench.contenders(lik_cupy, q, d, _FlashInt8())
    assert set(calls) == {"ours_int8", "ours_int8_f16q", "ours_fp16", "flash_int8x8"} == set(inputs)
    before = exact_query_scores(torch, q, d[:40])  # the suite's --check-docs: the first 40 documents here
    for name, call in calls.items():
        err, l2 = bench.checked(torch, call(), inputs[name], before)
        assert err < 1e-6, (name, err)  # the NumPy path's arithmetic (the stub's rounding to float32) alone
        assert (l2 > 1e-4) == (name != "ours_fp16"), (name, l2)  # quantising moved the scores; fp16 did not
    # the old field's comparison: our fp16 scores are no reference for quantised inputs
    ours = calls["ours_int8"]().double()
    assert max_rel_err(ours, calls["ours_fp16"]()) > 1e-4
    assert max_rel_err(ours, bench.exact_query_scores(torch, *inputs["ours_int8"])) < 1e-6


def test_int8_table_reads_results_with_and_without_the_errors():
    bench = _load("bench/suites/bench_int8.py")
    old = json.loads((REPO / "bench/results/latest/int8_nvidia-h200.json").read_text())
    assert "colpali" in bench.table(old)
    row = dict(old["shapes"]["colpali"], max_rel_err={"ours_int8": 1.2e-7}, wrong=["flash_int8x8"])
    line = bench.table({"shapes": {"colpali": row}}).splitlines()[1]
    assert "1.2e-07" in line and "flash_int8x8" in line


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
