"""maxsim_from_hidden on the GPU: float16, bfloat16 and float32 (torch, CuPy) and float64 against
the unfused ``F.linear -> F.normalize -> maxsim`` pipeline, gradients included; chunked calls;
peak memory below the unfused pipeline's; JAX on a CUDA device; and late-interaction-kernels'
own fused-head tests through the adapter in tests/lik_fused_head_adapter.py."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lik_cupy

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import lik_cupy.torch as lt  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or not lik_cupy.gpu_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# scores of unit vectors: the projected tokens' rounding to the dtype, relative to Lq
SCORE_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5}
GRAD_TOL = {"float16": 5e-2, "bfloat16": 1e-1, "float32": 1e-4}  # relative RMS, as LIK's own tests measure it


def _data(dtype, nq=3, lq=16, nd=20, ld=40, hid=192, dim=64, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Q = F.normalize(torch.randn(nq, lq, dim, device="cuda", generator=g), dim=-1)
    H = torch.randn(nd, ld, hid, device="cuda", generator=g)
    W = torch.randn(dim, hid, device="cuda", generator=g) / hid**0.5
    b = torch.randn(dim, device="cuda", generator=g) * 0.05
    return [x.to(dtype).requires_grad_(grad) for x in (Q, H, W, b)]


def _unfused(Q, H, W, b, **kw):
    D = F.normalize(F.linear(H, W, b), dim=-1)
    return lt.maxsim(Q, D, **kw)


def _no_collection(peak):
    """A peak-memory measurement with the garbage of earlier tests collected first and none collected
    during it: tensors freed mid-call lower the peak it reads below what the call itself takes (once the
    unfused pipeline read 84 MB, under its own 100 MB dH, and the test failed)."""
    def measured(fn):
        gc.collect()
        gc.disable()
        try:
            return peak(fn)
        finally:
            gc.enable()
    return measured


def _rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item()


# Documents of random lengths with a bias, and whole documents with and without one. The scores are
# checked against float64's; the gradients against float64's through the same winners (the call's
# own argmax). At 16 bits the rounding of the projected tokens moves some query tokens' winners
# against float64's near ties, and a moved winner changes that token's gradient wholly: against
# float64's own winners, bfloat16's dQ relative RMS exceeded 0.1 in two of three runs.
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("chunk", [None, 40 * 64 * 4 * 3])  # three float32 documents, six 16-bit ones
@pytest.mark.parametrize("lengths,bias", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("dim", [64, 128])  # 128: the one-pass kernel's, on Hopper, where it takes the call
def test_matches_unfused_with_gradients(dtype, chunk, lengths, bias, dim):
    torch.manual_seed(5)
    leaves = _data(DTYPES[dtype], grad=True, dim=dim)
    if not bias:
        leaves[3] = None
    d_len = None
    if lengths:
        d_len = torch.randint(1, 41, (20,), device="cuda")
        d_len[3] = 0
    s = lt.maxsim_from_hidden(*leaves, d_lengths=d_len, max_chunk_bytes=chunk)
    _, amax = lt.maxsim_from_hidden(*[None if x is None else x.detach() for x in leaves], d_lengths=d_len,
                                    max_chunk_bytes=chunk, return_argmax=True)
    ref_leaves = [None if x is None else x.detach().double().cpu().requires_grad_() for x in leaves]
    ref = _unfused(*ref_leaves, d_lengths=None if d_len is None else d_len.cpu())
    assert s.dtype == torch.float32 and s.shape == (3, 20)
    assert torch.isneginf(s[:, 3]).all() == lengths
    keep = ~torch.isinf(ref)
    err = (s.double().cpu()[keep] - ref.detach()[keep]).abs().max().item()
    assert err <= SCORE_TOL[dtype] * 16, err
    Q, H, W, b = ref_leaves
    D = F.normalize(F.linear(H, W, b), dim=-1)  # [nd, ld, dim]
    a = amax.long().cpu()  # [nq, nd, lq]: each query token's winner, -1 for none
    win = D[torch.arange(D.shape[0])[None, :, None], a.clamp_min(0)]  # [nq, nd, lq, dim]
    fixed = (Q[:, None] * win).sum(-1).masked_fill(a < 0, 0).sum(-1)
    g = torch.randn(s.shape, device="cuda").masked_fill(~keep.cuda(), 0)
    grads = torch.autograd.grad((s.masked_fill(~keep.cuda(), 0) * g).sum(), [x for x in leaves if x is not None])
    want = torch.autograd.grad((fixed.masked_fill(~keep, 0) * g.double().cpu()).sum(),
                               [x for x in ref_leaves if x is not None])
    for x, y, name in zip(grads, want, "Q H W bias".split()):
        assert x.dtype == DTYPES[dtype]
        assert _rel_rms(x.cpu(), y) < GRAD_TOL[dtype], name


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_training_and_inference_calls_score_alike(dtype):
    """A call that keeps the argmax for the backward scores bit for bit as one that does not."""
    Q, H, W, b = _data(DTYPES[dtype])
    plain = lt.maxsim_from_hidden(Q, H, W, b)
    trained = lt.maxsim_from_hidden(Q.clone().requires_grad_(), H, W, b).detach()
    assert torch.equal(plain, trained)


def test_masks_no_bias_no_normalisation_and_2d_query():
    Q, H, W, _ = _data(torch.float32)
    q_mask = torch.rand(3, 16, device="cuda") < 0.7
    d_mask = torch.rand(20, 40, device="cuda") < 0.6
    H[~d_mask] = float("nan")  # masked tokens are never scored
    s, a = lt.maxsim_from_hidden(Q, H, W, None, q_mask, d_mask, normalize=False, return_argmax=True)
    ref, ref_a = lt.maxsim(Q, F.linear(H, W), q_mask, d_mask, return_argmax=True, precision="fp32")
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-5)
    assert (a == ref_a).float().mean() > 0.99  # near ties may fall apart on the projection's rounding
    one = lt.maxsim_from_hidden(Q[0], H, W, None, q_mask[0], d_mask, normalize=False)
    torch.testing.assert_close(one, s[0])


def test_cupy_arrays_and_the_cpu_path_agree():
    import cupy

    Q, H, W, b = (cupy.asarray(x.detach().cpu().numpy()) for x in _data(torch.float32))
    s, a = lik_cupy.maxsim_from_hidden(Q, H, W, b, return_argmax=True, precision="fp32")
    want = lik_cupy.maxsim_from_hidden(*(x.get() for x in (Q, H, W, b)), backend="cpu")
    np.testing.assert_allclose(s.get(), want, rtol=1e-5, atol=1e-5)
    g = cupy.ones(s.shape, cupy.float32)
    got = lik_cupy.maxsim_from_hidden_backward(g, Q, H, W, b, a)
    ref = lik_cupy.maxsim_from_hidden_backward(g.get(), *(x.get() for x in (Q, H, W, b)), a.get(), backend="cpu")
    for x, y in zip(got, ref):
        assert isinstance(x, cupy.ndarray)
        assert _rel_rms(torch.as_tensor(x.get()), torch.as_tensor(y)) < 1e-4
    Q16, H16, W16, b16 = (x.astype(cupy.float16) for x in (Q, H, W, b))
    s16 = lik_cupy.maxsim_from_hidden(Q16, H16, W16, b16)
    np.testing.assert_allclose(s16.get(), want, atol=SCORE_TOL["float16"] * 16)


def test_a_row_exactly_at_eps_takes_torchs_gradient():
    """A projected token of norm exactly eps is divided by eps, and its gradient goes through the
    norm as F.normalize's does (clamp_min passes it at eps itself); the kernel took the floor's."""
    Q, H, _, _ = _data(torch.float32)
    eps = 2.0**-10
    W = torch.zeros(64, 192, device="cuda")
    W[:, :64] = torch.eye(64, device="cuda")
    with torch.no_grad():
        H[1, 2] = 0
        H[1, 2, 0] = eps  # projected to (eps, 0, ...): its sum of squares and square root are exact
        Q[0, 0] = 0
        Q[0, 0, 0] = 1.0  # and it wins this query token
    leaves = [x.detach().clone().requires_grad_(True) for x in (Q, H, W)]
    ref = lt.maxsim(leaves[0], F.normalize(F.linear(leaves[1], leaves[2]), dim=-1, eps=eps), precision="fp32")
    s, a = lt.maxsim_from_hidden(Q, H, W, None, eps=eps, return_argmax=True, precision="fp32")
    assert int(a[0, 1, 0]) == 2
    g = torch.randn(s.shape, device="cuda")
    want = torch.autograd.grad((ref * g).sum(), leaves)
    got = lik_cupy.maxsim_from_hidden_backward(g, Q, H, W, None, a, eps=eps)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_documents_without_tokens_give_zero_weight_gradients(dtype):
    """H [Nd, 0, h]: no token is projected, so dW and dbias are zeros. Their GEMMs have no products, and
    their outputs are empty memory: it was multiplied by beta = 0 (NaN here, from the freed buffers;
    a TypeError for the 16-bit types, whose outputs are bits)."""
    Q, H, W, b = _data(DTYPES[dtype], ld=0)
    # freed NaN blocks of the outputs' sizes, which the caching allocator hands to the call
    junk = [torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda") for x in (W, b) for _ in range(16)]
    del junk
    a = torch.full((3, 20, 16), -1, dtype=torch.int32, device="cuda")
    g = torch.ones(3, 20, device="cuda")
    dq, dh, dw, db = lik_cupy.maxsim_from_hidden_backward(g, Q, H, W, b, a)
    assert dh.shape == H.shape and dw.dtype == W.dtype and db.dtype == b.dtype
    for x in (dq, dw, db):
        assert not x.any()  # (NaN is nonzero)


def test_float64_on_the_gpu_matches_the_cpu_path():
    Q, H, W, b = _data(torch.float64)
    s = lt.maxsim_from_hidden(Q, H, W, b)
    assert s.dtype == torch.float64
    torch.testing.assert_close(s.cpu(), lt.maxsim_from_hidden(Q.cpu(), H.cpu(), W.cpu(), b.cpu()), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("train", [False, True])
def test_peak_memory_below_unfused(train):
    """The unfused pipeline holds the projected tensor (twice: before and after normalisation); the
    fused head one chunk of it."""
    Q, H, W, b = _data(torch.float16, nq=1 if not train else 8, lq=32, nd=512, ld=128, hid=768, dim=128, grad=train)

    @_no_collection
    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        if train:
            torch.autograd.grad(out.sum(), (Q, H, W, b))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    chunk = 128 * 128 * 2 * 64  # 64 documents' projection
    lt.maxsim_from_hidden(Q, H, W, b, max_chunk_bytes=chunk)  # compile first
    ours = peak(lambda: lt.maxsim_from_hidden(Q, H, W, b, max_chunk_bytes=chunk))
    unfused = peak(lambda: _unfused(Q, H, W, b))
    assert ours < unfused, (ours, unfused)


def test_jax_on_a_cuda_device():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("jax has no CUDA device here")
    import lik_cupy.jax as lj

    Q, H, W, b = (x.detach().cpu().numpy() for x in _data(torch.float32))
    loss = jax.jit(jax.value_and_grad(lambda *a: lj.maxsim_from_hidden(*a, precision="fp32").sum(), argnums=(0, 1, 2, 3)))
    v, grads = loss(Q, H, W, b)
    s, a = lik_cupy.maxsim_from_hidden(Q, H, W, b, return_argmax=True, backend="cpu")
    np.testing.assert_allclose(float(v), s.sum(), rtol=1e-5)
    for x, y in zip(grads, lik_cupy.maxsim_from_hidden_backward(np.ones_like(s), Q, H, W, b, a, backend="cpu")):
        assert _rel_rms(torch.as_tensor(np.asarray(x)), torch.as_tensor(y)) < 1e-4


def test_lik_own_fused_head_tests_through_the_adapter():
    """LIK's test_fused_head.py and test_fused_head_train.py against lik_cupy (LIK_TESTS_DIR: a
    directory holding them, from late-interaction-kernels' repository; its wheel carries no tests)."""
    pytest.importorskip("triton")
    pytest.importorskip("late_interaction_kernels")
    where = os.environ.get("LIK_TESTS_DIR")
    if not where or not (Path(where) / "test_fused_head.py").is_file():
        pytest.skip("LIK_TESTS_DIR does not name a directory with late-interaction-kernels' test_fused_head.py")
    files = [str(Path(where) / f) for f in ("test_fused_head.py", "test_fused_head_train.py")
             if (Path(where) / f).is_file()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "lik_fused_head_adapter", "-p", "no:cacheprovider",
                          "--rootdir", where, *files], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


# The torch path (lik_cupy/_torch_hidden.py): float16 and bfloat16 CUDA calls of one chunk, on torch's
# GEMMs; eager training keeps its projection for the backward, the operator projects again.
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_path_eager_and_operator_agree_and_match_cupy(dtype):
    leaves = _data(DTYPES[dtype], grad=True)
    d_len = torch.randint(0, 41, (20,), device="cuda")
    s = lt.maxsim_from_hidden(*leaves, d_lengths=d_len)
    g = torch.randn_like(s).masked_fill(torch.isinf(s), 0)
    eager = torch.autograd.grad((s.masked_fill(torch.isinf(s), 0) * g).sum(), leaves)
    op_s, _ = torch.ops.lik_cupy.maxsim_from_hidden.default(*leaves, None, None, None, d_len, True, 1e-12, True, None,
                                                            None)
    assert torch.equal(op_s, s)
    op = torch.autograd.grad((op_s.masked_fill(torch.isinf(op_s), 0) * g).sum(), leaves)
    for x, y in zip(eager, op):  # the same projection, kept or made again (dD's atomics may order sums apart)
        assert _rel_rms(x.float(), y.float()) < 1e-3
    if dtype == "bfloat16":  # CuPy has no bfloat16 type to take these tensors as
        return
    # the CuPy path (lik_cupy.fused_head's chunks) to the dtype's rounding
    import cupy

    cp = [cupy.asarray(x.detach()) for x in leaves]
    ref_s, ref_a = lik_cupy.maxsim_from_hidden(*cp, d_lengths=cupy.asarray(d_len), return_argmax=True)
    torch.testing.assert_close(s.detach(), torch.as_tensor(ref_s, device="cuda"), rtol=0, atol=SCORE_TOL[dtype] * 16)
    ref = lik_cupy.maxsim_from_hidden_backward(cupy.asarray(g), *cp, ref_a, d_lengths=cupy.asarray(d_len))
    for x, y in zip(eager, ref):
        assert _rel_rms(x.float().cpu(), torch.as_tensor(y, device="cuda").float().cpu()) < GRAD_TOL[dtype]


def test_torch_path_repeat_calls_keep_their_checks_per_signature(monkeypatch):
    """A repeat call of the torch path skips check_hidden for a signature seen before; any other
    signature (a wrong W or bias, a new shape, a mask) is checked in full, and repeats score alike."""
    import lik_cupy._torch_hidden as th
    from lik_cupy._validate import check_hidden

    checks = []
    monkeypatch.setattr(th, "check_hidden", lambda *a: checks.append(1) or check_hidden(*a))
    th._CHECKED.clear()
    Q, H, W, b = _data(torch.bfloat16, grad=True)
    first = lt.maxsim_from_hidden(Q, H, W, b)
    assert len(th._CHECKED) == 1 and len(checks) == 1
    assert torch.equal(lt.maxsim_from_hidden(Q, H, W, b), first)
    assert len(th._CHECKED) == 1 and len(checks) == 1  # (the repeat: not checked again)
    with pytest.raises(ValueError, match=r"W must be \[d, h\]"):
        lt.maxsim_from_hidden(Q, H, W[:, :128].contiguous(), b)
    with pytest.raises(TypeError, match="bias has dtype float16"):
        lt.maxsim_from_hidden(Q, H, W, b.detach().half())
    with pytest.raises(ValueError, match="bias has shape"):
        lt.maxsim_from_hidden(Q, H, W, b.detach()[:32])
    ragged = lt.maxsim_from_hidden(Q, H, W, b, d_mask=torch.ones(H.shape[:2], dtype=torch.bool, device="cuda"))
    assert len(th._CHECKED) == 1  # (masks are checked every call)
    torch.testing.assert_close(ragged, first)
    other = lt.maxsim_from_hidden(Q[:2], H[:5], W, b)
    assert len(th._CHECKED) == 2
    torch.testing.assert_close(other, first[:2, :5])
    th._CHECKED.update({(i,): None for i in range(th._CHECKED_MAX)})  # full: the next new signature empties it
    lt.maxsim_from_hidden(Q[:1], H, W, b)
    assert len(th._CHECKED) == 1
    # an eps past float32's range (the options take any finite one) is inf to the row kernels: every row under it
    huge = lt.maxsim_from_hidden(Q, H, W, b, eps=1e39)
    assert torch.equal(huge, torch.zeros_like(huge))
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(huge.sum(), (Q, H, W, b)))


def test_torch_path_peak_memory_below_unfused_in_training():
    Q, H, W, b = _data(torch.bfloat16, nq=8, lq=32, nd=512, ld=128, hid=768, dim=128, grad=True)

    @_no_collection
    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.autograd.grad(fn().sum(), (Q, H, W, b))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    lt.maxsim_from_hidden(Q, H, W, b)  # compile first
    assert peak(lambda: lt.maxsim_from_hidden(Q, H, W, b)) < peak(lambda: _unfused(Q, H, W, b))


def test_torch_path_training_step_replays_in_a_cuda_graph():
    leaves = _data(torch.bfloat16, grad=True)
    d_len = torch.randint(1, 41, (20,), device="cuda")

    def step():
        s = lt.maxsim_from_hidden(*leaves, d_lengths=d_len)
        return torch.autograd.grad(torch.nn.functional.cross_entropy(s, torch.arange(3, device="cuda")), leaves)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        want = step()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(got, want):
        assert torch.isfinite(x).all() and _rel_rms(x.float(), y.float()) < 1e-3


@pytest.mark.parametrize("normalize", [True, False])
def test_torch_path_matches_the_chunked_path_with_masks_and_a_2d_query(normalize):
    Q, H, W, _ = _data(torch.bfloat16, grad=True)
    q, q_mask = Q[0], torch.rand(16, device="cuda") < 0.7
    d_mask = torch.rand(20, 40, device="cuda") < 0.6
    d_mask[5] = False  # a document with every token masked: -inf
    outs = []
    for chunk in (None, 40 * 64 * 2):  # one chunk (the torch path), one document a chunk (lik_cupy.fused_head)
        s = lt.maxsim_from_hidden(q, H, W, None, q_mask, d_mask, normalize=normalize, max_chunk_bytes=chunk)
        keep = ~torch.isinf(s)
        grads = torch.autograd.grad(s[keep].sum(), (Q, H, W))
        outs.append((s, grads))
    (s1, g1), (s2, g2) = outs
    assert s1.shape == (20,) and torch.isneginf(s1[5]) and torch.equal(torch.isinf(s1), torch.isinf(s2))
    keep = ~torch.isinf(s1)
    torch.testing.assert_close(s1[keep], s2[keep], rtol=0, atol=SCORE_TOL["bfloat16"] * 16)
    for x, y in zip(g1, g2):
        assert _rel_rms(x.float().cpu(), y.float().cpu()) < GRAD_TOL["bfloat16"]
    assert not g1[1][~d_mask].any()  # masked tokens take no gradient


# The one-pass kernel (cuda_src/hidden_maxsim.cu, lik_cupy/_runtime/hidden_maxsim.py): Hopper, float16 and
# bfloat16, d = 128, up to 64 query rows, no query masks or lengths and no document lengths. Its reference
# is float64 of the arithmetic it follows: the projection rounded to the dtype, the bias added, the row
# normalised and rounded again; the products and sums then in float64. Only the float32 accumulation
# order of the projection and the norm differs, which may move a rounding by one unit.
HOPPER = torch.cuda.get_device_capability() == (9, 0)
ONE_PASS_TOL = {"float16": 4e-3, "bfloat16": 3e-2}


def _one_pass_reference(Q, H, W, b, d_mask, normalize, eps=1e-12):
    dt = H.dtype
    P = H.double() @ W.double().T
    if normalize:
        v = P.to(dt).double() + (0 if b is None else b.double())
        y = (v / v.norm(dim=-1, keepdim=True).clamp_min(eps)).to(dt).double()
    else:
        y = (P + (0 if b is None else b.double())).to(dt).double()
    q = Q.double() if Q.dim() == 3 else Q.double()[None]
    sims = torch.einsum("isk,jtk->ijst", q, y)
    if d_mask is not None:
        sims = sims.masked_fill(~d_mask[None, :, None, :], float("-inf"))
    top2 = sims.topk(2, dim=-1).values if sims.shape[-1] > 1 else torch.cat([sims, sims.new_full(sims.shape, -1e9)], -1)
    best, arg = sims.max(-1)
    empty = torch.isneginf(best)
    arg = arg.masked_fill(empty, -1)
    scores = best.masked_fill(empty, 0).sum(-1).masked_fill(empty.any(-1), float("-inf"))
    return scores, arg, top2[..., 0] - top2[..., 1]


@pytest.mark.skipif(not HOPPER, reason="the one-pass kernel runs on sm_90")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("nq,lq,nd,ld,hid,bias,mask,normalize", [
    (1, 32, 37, 45, 192, True, False, True),  # 1,665 rows: documents across warps, tiles and the last tile's end
    (2, 19, 13, 300, 768, False, True, True),  # 38 query rows: the 64-wide product; one document all masked
    (3, 7, 50, 5, 64, True, True, False),  # several documents in a warp; no normalisation
    (1, 64, 9, 1, 128, True, False, True),  # one token a document
])
def test_one_pass_kernel_against_float64(dtype, nq, lq, nd, ld, hid, bias, mask, normalize):
    from lik_cupy._runtime import hidden_maxsim

    Q, H, W, b = _data(DTYPES[dtype], nq=nq, lq=lq, nd=nd, ld=ld, hid=hid, dim=128, seed=nd)
    b = b if bias else None
    d_mask = None
    if mask:
        d_mask = torch.rand(nd, ld, device="cuda") < 0.7
        d_mask[1] = False
        H[~d_mask] = float("nan")  # masked tokens are never scored
    calls = []
    real = hidden_maxsim.score_hidden

    def spy(**kw):
        calls.append(kw["qn"])
        return real(**kw)

    hidden_maxsim.score_hidden = spy
    try:
        s, a = lt.maxsim_from_hidden(Q, H, W, b, d_mask=d_mask, normalize=normalize, return_argmax=True)
        plain = lt.maxsim_from_hidden(Q, H, W, b, d_mask=d_mask, normalize=normalize)
        trained = lt.maxsim_from_hidden(Q.clone().requires_grad_(), H, W, b, d_mask=d_mask, normalize=normalize)
    finally:
        hidden_maxsim.score_hidden = real
    assert calls == [32 if nq * lq <= 32 else 64] * 3
    torch.cuda.synchronize()
    ref, ref_a, gap = _one_pass_reference(Q.cpu(), H.cpu(), W.cpu(), None if b is None else b.cpu(),
                                          None if d_mask is None else d_mask.cpu(), normalize)
    assert s.shape == (nq, nd) and a.shape == (nq, nd, lq) and a.dtype == torch.int32
    assert torch.equal(s, plain) and torch.equal(s, trained.detach())
    s, a = s.double().cpu(), a.long().cpu()
    assert torch.equal(torch.isneginf(s), torch.isneginf(ref))
    keep = ~torch.isinf(ref)
    torch.testing.assert_close(s[keep], ref[keep], rtol=0, atol=ONE_PASS_TOL[dtype] * lq)
    assert (a[~keep] == -1).all()
    clear = keep[..., None] & (gap > ONE_PASS_TOL[dtype])
    assert torch.equal(a[clear], ref_a[clear])


@pytest.mark.skipif(not HOPPER, reason="the one-pass kernel runs on sm_90")
def test_one_pass_kernel_nan_2d_query_and_cupy():
    import cupy

    Q, H, W, b = _data(torch.float16, nq=1, lq=32, nd=30, ld=200, hid=256, dim=128, seed=3)
    H[2, 77, 5] = float("nan")  # document 2's token 77: a NaN similarity with every query token
    s, a = lt.maxsim_from_hidden(Q, H, W, b, return_argmax=True)
    assert torch.isnan(s[0, 2]) and (a[0, 2] == 77).all()
    assert torch.isfinite(s[0, [0, 1, 3]]).all()
    one, one_a = lt.maxsim_from_hidden(Q[0], H, W, b, return_argmax=True)
    assert one.shape == (30,)
    torch.testing.assert_close(one, s[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(one_a, a[0])
    cs, ca = lik_cupy.maxsim_from_hidden(*(cupy.asarray(x) for x in (Q, H, W, b)), return_argmax=True)
    np.testing.assert_array_equal(cs.get(), s.cpu().numpy())  # the same kernel: the same bits
    np.testing.assert_array_equal(ca.get(), a.cpu().numpy())


@pytest.mark.skipif(not HOPPER, reason="the one-pass kernel runs on sm_90")
def test_one_pass_kernel_scratch_within_max_chunk_bytes(monkeypatch):
    """The one-pass kernel's scratch (8 bytes a query token and document) counts against ``max_chunk_bytes``:
    a call whose scratch would pass it takes the streamed path, to the dtype's rounding of the same scores."""
    from lik_cupy._runtime import hidden_maxsim

    Q, H, W, b = _data(torch.bfloat16, nq=1, lq=32, nd=40, ld=50, hid=128, dim=128, seed=4)
    calls = []
    real = hidden_maxsim.score_hidden
    monkeypatch.setattr(hidden_maxsim, "score_hidden", lambda **kw: (calls.append(kw["qn"]), real(**kw))[1])
    fits = lt.maxsim_from_hidden(Q, H, W, b, max_chunk_bytes=8 * 32 * 40)
    streamed = lt.maxsim_from_hidden(Q, H, W, b, max_chunk_bytes=8 * 32 * 40 - 1)
    assert calls == [32]
    torch.testing.assert_close(fits, streamed, rtol=0, atol=ONE_PASS_TOL["bfloat16"] * 32)


@pytest.mark.skipif(not HOPPER, reason="the one-pass kernel runs on sm_90")
def test_one_pass_kernel_reads_negative_bit_views_as_their_values(monkeypatch):
    # The one-pass kernel reads Q, H, W and bias by pointer: a negative-bit view (torch._neg_view) holds
    # its values' negations in memory, so it must score as the same negations materialised.
    from lik_cupy._runtime import hidden_maxsim

    Q, H, W, b = _data(torch.bfloat16, nq=1, lq=32, nd=9, ld=40, hid=128, dim=128)
    views = [torch._neg_view(x) for x in (Q, H, W, b)]
    assert all(v.is_neg() for v in views)
    calls = []
    real = hidden_maxsim.score_hidden
    monkeypatch.setattr(hidden_maxsim, "score_hidden", lambda **kw: calls.append(1) or real(**kw))
    got = lt.maxsim_from_hidden(*views)
    want = lt.maxsim_from_hidden(-Q, -H, -W, -b)
    assert len(calls) == 2 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bias_gradients_row_of_ones_is_ready_on_every_stream(monkeypatch, dtype):
    # The bias gradient sums rows by a GEMM with a cached row of ones (hidden._ones), which threads on
    # streams of their own share. Made on stream a behind a long kernel, in a block of its size just
    # freed there holding NaN (the pool hands it straight back), it is read at once by a GEMM on
    # stream b: that must see ones, not the NaN the fill queued on a had not yet replaced.
    import cupy

    from lik_cupy._runtime import hidden

    monkeypatch.setattr(hidden, "_ones_cache", {})
    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long n) {
        long long t0 = clock64(); while (clock64() - t0 < n) {} }''', "spin")
    n, d = 4096, 8
    bits = {"float32": (cupy.float32, np.float32(1), np.float32(np.nan)),
            "bfloat16": (cupy.uint16, np.uint16(0x3F80), np.uint16(0x7FC0))}  # (element, one, NaN)
    kind, one, nan = bits[dtype]
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with a:
        x = cupy.full((n, d), one, kind)
        out_a = cupy.empty(d, cupy.float32)
        junk = cupy.full((1, n), nan, kind)
        a.synchronize()
        del junk
        spin((1,), (1,), (np.int64(2_000_000_000),))  # about a second
        hidden.row_sums(x, out_a, dtype)
    with b:
        out_b = cupy.empty(d, cupy.float32)
        hidden.row_sums(x, out_b, dtype)
        b.synchronize()
    a.synchronize()
    assert (out_a == n).all() and (out_b == n).all(), (out_a, out_b)


# ---------------------------------------------------------------- tensors on another GPU than the current one


@pytest.mark.parametrize("path", ["one-pass", "torch", "cupy-chunks", "cupy-float32"])
def test_fused_head_on_another_gpu_is_the_current_gpus_call(other_gpu, path):
    """maxsim_from_hidden and its gradients with every array on cuda:1 while cuda:0 is current, by each path
    (the one-pass kernel: float16 d = 128 without lengths, on Hopper; the torch path: float16 with document
    lengths; the CuPy chunks, and float32): on cuda:1, scores and argmax bit for bit as on cuda:0, gradients to
    the atomics' rounding (dD's fp32 sums add in any order), and cuda:0 current after each call."""
    import cupy

    from devices import assert_on, assert_same_bits, current, host, on_gpu

    dtype = torch.float32 if path == "cupy-float32" else torch.float16
    Q, H, W, b = (x.to("cuda:0") for x in _data(dtype, dim=128 if path == "one-pass" else 64, seed=3))
    d_len = None if path == "one-pass" else torch.randint(0, 41, (20,), device="cuda:0")
    chunk = 40 * 64 * 2 * 6 if path == "cupy-chunks" else None  # six documents a chunk
    g = torch.randn(3, 20, device="cuda:0")
    if path.startswith("cupy"):
        Q, H, W, b, g = (cupy.asarray(x.detach()) for x in (Q, H, W, b, g))
        d_len = cupy.asarray(d_len)

        def call(Q, H, W, b, d_len, g):
            s, a = lik_cupy.maxsim_from_hidden(Q, H, W, b, d_lengths=d_len, return_argmax=True, max_chunk_bytes=chunk)
            with s.device:  # (CuPy's own kernels run on the current device)
                gs = cupy.where(cupy.isinf(s), 0, g)
            grads = lik_cupy.maxsim_from_hidden_backward(gs, Q, H, W, b, a, d_lengths=d_len, max_chunk_bytes=chunk)
            return (s, a), grads
    else:
        def call(Q, H, W, b, d_len, g):
            leaves = [x.detach().requires_grad_() for x in (Q, H, W, b)]
            s = lt.maxsim_from_hidden(*leaves, d_lengths=d_len)
            _, a = lt.maxsim_from_hidden(*(x.detach() for x in leaves), d_lengths=d_len, return_argmax=True)
            grads = torch.autograd.grad((s.masked_fill(torch.isinf(s), 0) * g).sum(), leaves)
            return (s.detach(), a), grads

    args = (Q, H, W, b, d_len, g)
    want = current(call, *args)
    for _ in range(2):
        got = current(call, *on_gpu(args, other_gpu))
        assert_on(got, other_gpu)
        assert_same_bits(got[0], want[0])
        for x, y in zip(got[1], want[1]):
            assert _rel_rms(torch.as_tensor(host(x)).float(), torch.as_tensor(host(y)).float()) < 2e-3
