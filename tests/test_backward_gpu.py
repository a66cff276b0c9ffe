"""Backward on the GPU against float64 autograd of the naive expression (needs torch and a GPU).

The reference takes the max at the token our forward chose, after checking that token
is a maximum up to rounding: a near-tie may break either way, and the gradient of
``max`` follows whichever token wins.
"""

import zlib

import numpy as np
import pytest

import lik_cupy

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}  # gradients come back in the input dtype
TDT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _unit(gen, *shape, dtype):
    x = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64)
    return torch.nn.functional.normalize(x, dim=-1).to(TDT[dtype])


def _ref(Q, Dpad, amax, g, d_valid, candidates):
    """float64 autograd of sum_s max_t <Q, D> with the max taken at ``amax``."""
    q = Q.double().detach().requires_grad_(True)
    d = Dpad.double().detach().requires_grad_(True)
    sim = torch.einsum("isk,ijtk->ijst", q, d) if candidates else torch.einsum("isk,jtk->ijst", q, d)
    dv = d_valid if candidates else d_valid[None]
    sim_m = sim.masked_fill(~dv[:, :, None, :], float("-inf"))
    a = amax.long()
    picked = torch.gather(sim_m, 3, a.clamp_min(0)[..., None])[..., 0]
    ok = a >= 0
    best = sim_m.max(dim=3).values
    assert torch.all(picked[ok] >= best[ok] - 1e-3 * (best[ok].abs() + 1)), "argmax is not a maximum"
    score = torch.where(ok, picked, torch.zeros_like(picked)).sum(-1)
    (score * g.double()).sum().backward()
    return q.grad, d.grad


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _cos(x, ref):
    return torch.nn.functional.cosine_similarity(x.double().flatten(), ref.double().flatten(), dim=0).item()


@pytest.mark.parametrize("method", ["atomic", "csr"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_in_batch_masks_empty_docs(method, dtype):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{method}{dtype}".encode()))
    nq, lq, nd, ld, dim = 5, 37, 6, 45, 96
    Q, D = _unit(gen, nq, lq, dim, dtype=dtype), _unit(gen, nd, ld, dim, dtype=dtype)
    qm = torch.rand(nq, lq, generator=gen, device="cuda") < 0.8
    dm = torch.rand(nd, ld, generator=gen, device="cuda") < 0.7
    dm[3] = False  # empty document
    s, a = lik_cupy.maxsim(Q, D, qm, dm, return_argmax=True)
    g = torch.randn(nq, nd, generator=gen, device="cuda")
    dQ, dD = lik_cupy.maxsim_backward(g, Q, D, a, method=method)
    assert dQ.dtype == Q.dtype and dD.dtype == D.dtype and dQ.shape == Q.shape and dD.shape == D.shape
    rq, rd = _ref(Q, D, a, g, dm, False)
    assert _rel(dQ, rq) < TOL[dtype] and _rel(dD, rd) < TOL[dtype]
    if dtype == "float32":
        assert _cos(dQ, rq) > 0.99999 and _cos(dD, rd) > 0.99999
    assert not dD[3].any() and not dQ[~qm].any()


@pytest.mark.parametrize("method", ["atomic", "csr"])
def test_candidates_layout_and_wide_dim(method):
    gen = torch.Generator(device="cuda").manual_seed(7)
    nq, k, lq, ld, dim = 3, 4, 21, 33, 300  # dim not a multiple of 128 (or of 4 for the loads)
    Q, D = _unit(gen, nq, lq, dim, dtype="float16"), _unit(gen, nq, k, ld, dim, dtype="float16")
    _, a = lik_cupy.maxsim(Q, D, return_argmax=True)
    g = torch.randn(nq, k, generator=gen, device="cuda")
    dQ, dD = lik_cupy.maxsim_backward(g, Q, D, a, method=method)
    rq, rd = _ref(Q, D, a, g, torch.ones(nq, k, ld, dtype=torch.bool, device="cuda"), True)
    assert _rel(dQ, rq) < TOL["float16"] and _rel(dD, rd) < TOL["float16"]


@pytest.mark.parametrize("method", ["atomic", "csr"])
def test_packed_documents(method):
    gen = torch.Generator(device="cuda").manual_seed(11)
    lens = torch.tensor([5, 0, 17, 1, 40, 9])
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).cuda()
    nq, lq, dim = 4, 19, 64
    Q, T = _unit(gen, nq, lq, dim, dtype="bfloat16"), _unit(gen, int(off[-1]), dim, dtype="bfloat16")
    _, a = lik_cupy.maxsim_varlen(Q, T, off, return_argmax=True)
    g = torch.randn(nq, len(lens), generator=gen, device="cuda")
    dQ, dT = lik_cupy.maxsim_backward(g, Q, T, a, d_offsets=off, method=method)
    ld = int(lens.max())
    pad = torch.zeros(len(lens), ld, dim, dtype=T.dtype, device="cuda")
    dv = torch.arange(ld, device="cuda")[None] < lens.cuda()[:, None]
    pad[dv] = T
    rq, rpad = _ref(Q, pad, a, g, dv, False)
    assert _rel(dQ, rq) < TOL["bfloat16"] and _rel(dT, rpad[dv]) < TOL["bfloat16"]


def test_csr_is_bitwise_reproducible_and_matches_atomic():
    gen = torch.Generator(device="cuda").manual_seed(3)
    nq, lq, nd, ld, dim = 16, 64, 16, 50, 128  # many collisions: 16 x 64 query tokens per 50 doc tokens
    Q, D = _unit(gen, nq, lq, dim, dtype="float32"), _unit(gen, nd, ld, dim, dtype="float32")
    _, a = lik_cupy.maxsim(Q, D, return_argmax=True)
    g = torch.randn(nq, nd, generator=gen, device="cuda")
    q1, d1 = lik_cupy.maxsim_backward(g, Q, D, a, method="csr")
    q2, d2 = lik_cupy.maxsim_backward(g, Q, D, a, method="csr")
    assert torch.equal(d1.view(torch.int32), d2.view(torch.int32)) and torch.equal(q1.view(torch.int32), q2.view(torch.int32))
    q3, d3 = lik_cupy.maxsim_backward(g, Q, D, a, method="atomic")
    assert torch.equal(q1, q3)  # dQ has one writer per row either way
    assert _rel(d3, d1) < 1e-6


@pytest.mark.parametrize("method", ["atomic", "csr"])
@pytest.mark.parametrize("bad", [7, -2])
def test_bad_argmax_makes_its_dq_row_nan_or_raises_in_strict_mode(method, bad):
    Q = torch.randn(2, 5, 32, device="cuda", dtype=torch.float16)
    D = torch.randn(3, 7, 32, device="cuda", dtype=torch.float16)
    _, a = lik_cupy.maxsim(Q, D, return_argmax=True)
    good = lik_cupy.maxsim_backward(torch.ones(2, 3, device="cuda"), Q, D, a, method=method)
    a[1, 2, 3] = bad
    with pytest.raises(ValueError):
        lik_cupy.maxsim_backward(torch.ones(2, 3, device="cuda"), Q, D, a, validate=True)
    # by default no host sync: that query token's dQ row is NaN, nothing is written outside dD
    dQ, dD = lik_cupy.maxsim_backward(torch.ones(2, 3, device="cuda"), Q, D, a, method=method)
    nan = torch.isnan(dQ)
    assert nan[1, 3].all() and nan.sum() == 32
    assert torch.isfinite(dD).all()
    keep = torch.ones(2, 5, dtype=torch.bool, device="cuda")
    keep[1, 3] = False
    assert torch.equal(dQ[keep], good[0][keep])


def _dq_in_order(Q, rows, g, a, row_of):
    """dQ as ``lik_bwd_dq`` sums it, bit for bit: each query token's float32 sum over its documents in
    ascending order, one fused multiply-add per element (the product is exact in float64; the sum is
    rounded once to float64, then to float32, which differs from one rounding only at a float32 tie,
    fixed by the seeds). ``row_of(j, a)``: document j's local token ``a`` as a row of ``rows``."""
    q = Q.detach().cpu().double().numpy()
    r = rows.detach().cpu().double().numpy()
    gs, am = g.detach().cpu().numpy().astype(np.float64), a.cpu().numpy()
    acc = np.zeros(q.shape, np.float32)
    for j in range(am.shape[1]):
        take = am[:, j, :] >= 0
        row = np.where(take, row_of(j, np.maximum(am[:, j, :], 0)), 0)
        step = (acc.astype(np.float64) + gs[:, j, None, None] * r[row]).astype(np.float32)
        acc = np.where(take[..., None], step, acc)
    return acc


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_many_documents_in_groups_of_32_with_a_bad_entry_past_the_first(dtype):
    """The dQ pass reads 32 documents' argmax entries at a time and gathers their rows two at a
    time: documents past 32 (a part group at the end), masked query tokens and empty documents in
    later groups; dQ summed in document order (bitwise), and a bad entry in the second group (its
    dQ row NaN, the rest of dQ unchanged, nothing of it in dD)."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"groups{dtype}".encode()))
    nq, lq, nd, ld, dim = 3, 11, 71, 13, 132  # 71 = 2 x 32 + 7; dim past one 128-column chunk
    Q, D = _unit(gen, nq, lq, dim, dtype=dtype), _unit(gen, nd, ld, dim, dtype=dtype)
    qm = torch.rand(nq, lq, generator=gen, device="cuda") < 0.85
    dm = torch.rand(nd, ld, generator=gen, device="cuda") < 0.6
    dm[[0, 33, 64, 70]] = False  # empty documents: in the first, second and last group
    s, a = lik_cupy.maxsim(Q, D, qm, dm, return_argmax=True)
    g = torch.randn(nq, nd, generator=gen, device="cuda")
    dQ, dD = lik_cupy.maxsim_backward(g, Q, D, a, method="atomic")
    rq, rd = _ref(Q, D, a, g, dm, False)
    assert _rel(dQ, rq) < TOL[dtype] and _rel(dD, rd) < TOL[dtype]
    want = _dq_in_order(Q, D.reshape(nd * ld, dim), g, a, lambda j, t: j * ld + t)
    got = dQ.cpu().numpy()
    assert np.array_equal(got, want.astype(got.dtype))  # (float16: rounded once, as the kernel stores it)
    qc, dc = lik_cupy.maxsim_backward(g, Q, D, a, method="csr")
    assert torch.equal(dQ, qc) and _rel(dD, dc) < TOL[dtype]
    i, t = 2, int(torch.nonzero(qm[2])[0])
    bad, dropped = a.clone(), a.clone()
    bad[i, 45, t] = ld  # past its document: as a row, document 46's first token, which must not get it
    dropped[i, 45, t] = -1
    dQb, dDb = lik_cupy.maxsim_backward(g, Q, D, bad, method="atomic")
    nan = torch.isnan(dQb)
    assert nan[i, t].all() and int(nan.sum()) == dim
    keep = torch.ones(nq, lq, dtype=torch.bool, device="cuda")
    keep[i, t] = False
    assert torch.equal(dQb[keep], dQ[keep])
    without = _ref(Q, D, dropped, g, dm, False)[1]
    assert _rel(dDb, without) < TOL[dtype]
    assert torch.allclose(dDb[46, 0].double(), without[46, 0], atol=TOL[dtype], rtol=0)


def test_many_packed_documents_in_groups_of_32():
    """Packed documents past 32 (offsets read a lane per document), dQ in document order bitwise, and
    a negative entry other than -1 in the second group: that row NaN, nothing of it in dD."""
    gen = torch.Generator(device="cuda").manual_seed(29)
    lens = torch.randint(0, 9, (45,), generator=gen, device="cuda").cpu()
    lens[[3, 40]] = 0
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).cuda()
    nq, lq, dim = 2, 7, 64
    Q, T = _unit(gen, nq, lq, dim, dtype="float32"), _unit(gen, int(off[-1]), dim, dtype="float32")
    _, a = lik_cupy.maxsim_varlen(Q, T, off, return_argmax=True)
    g = torch.randn(nq, len(lens), generator=gen, device="cuda")
    dQ, dT = lik_cupy.maxsim_backward(g, Q, T, a, d_offsets=off, method="atomic")
    starts = off.cpu().numpy()
    assert np.array_equal(dQ.cpu().numpy(), _dq_in_order(Q, T, g, a, lambda j, t: starts[j] + t))
    j = int(torch.nonzero(lens[32:] > 0)[0]) + 32
    bad, dropped = a.clone(), a.clone()
    bad[1, j, 4], dropped[1, j, 4] = -5, -1
    dQb, dTb = lik_cupy.maxsim_backward(g, Q, T, bad, d_offsets=off, method="atomic")
    assert torch.isnan(dQb[1, 4]).all() and int(torch.isnan(dQb).sum()) == dim
    _, want = lik_cupy.maxsim_backward(g, Q, T, dropped, d_offsets=off, method="csr")
    assert torch.allclose(dTb, want, atol=1e-6, rtol=0)


def test_torch_adapter_matches_naive_autograd():
    from lik_cupy.torch import maxsim

    gen = torch.Generator(device="cuda").manual_seed(5)
    Q = _unit(gen, 4, 13, 64, dtype="float16").requires_grad_(True)
    D = _unit(gen, 7, 29, 64, dtype="float16").requires_grad_(True)
    dl = torch.tensor([29, 3, 0, 10, 29, 1, 17], device="cuda")
    s = maxsim(Q, D, d_lengths=dl)
    w = torch.randn(4, 7, generator=gen, device="cuda")
    (s * w).sum().backward()
    dv = torch.arange(29, device="cuda")[None] < dl[:, None]
    _, a = lik_cupy.maxsim(Q.detach(), D.detach(), d_lengths=dl, return_argmax=True)
    rq, rd = _ref(Q.detach(), D.detach(), a, w, dv, False)
    assert _rel(Q.grad, rq) < TOL["float16"] and _rel(D.grad, rd) < TOL["float16"]
    with torch.no_grad():  # no graph, plain forward
        assert not maxsim(Q, D).requires_grad


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("method", ["atomic", "csr"])
def test_torch_step_replays_from_a_cuda_graph(method, compiled):
    """Forward and backward, eager or compiled whole by ``torch.compile(fullgraph=True)``
    (inductor, lik_cupy's torch.library operators inside), captured in one torch CUDA graph: each
    replay, with new values copied into the captured inputs (lengths included) and other
    allocations made between replays, gives the step's scores and gradients run outside the graph."""
    from lik_cupy.torch import maxsim

    gen = torch.Generator(device="cuda").manual_seed(11)
    nq, lq, nd, ld, dim = 6, 29, 9, 43, 96
    Q = _unit(gen, nq, lq, dim, dtype="float16").requires_grad_(True)
    D = _unit(gen, nd, ld, dim, dtype="float16").requires_grad_(True)
    dl = torch.full((nd,), ld, device="cuda", dtype=torch.int32)
    w = torch.randn(nq, nd, generator=gen, device="cuda")

    def loss(q, d):
        s = maxsim(q, d, d_lengths=dl, method=method)
        return s, (s * w).sum()

    fn = torch.compile(loss, fullgraph=True) if compiled else loss

    def step(q, d):
        s, total = fn(q, d)
        total.backward()
        return s

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(2):
            Q.grad = D.grad = None
            step(Q, D)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    Q.grad = D.grad = None
    with torch.cuda.graph(graph):
        scores = step(Q, D)
    for trial in range(3):
        with torch.no_grad():
            Q.copy_(_unit(gen, nq, lq, dim, dtype="float16"))
            D.copy_(_unit(gen, nd, ld, dim, dtype="float16"))
            w.copy_(torch.randn(nq, nd, generator=gen, device="cuda"))
            dl.copy_(torch.randint(0, ld + 1, (nd,), generator=gen, device="cuda"))
            dl[trial] = 0  # an empty document
        junk = torch.full((1 << 20,), float("nan"), device="cuda")  # must not land in the graph's buffers
        graph.replay()
        q2, d2 = Q.detach().clone().requires_grad_(True), D.detach().clone().requires_grad_(True)
        ref = step(q2, d2)
        torch.cuda.synchronize()
        del junk
        assert torch.equal(scores, ref.detach())
        assert torch.isinf(scores[:, trial]).all()
        assert torch.equal(Q.grad, q2.grad)  # dQ is deterministic
        if method == "csr":
            assert torch.equal(D.grad, d2.grad)
        else:  # fp32 atomics may add in another order
            assert _rel(D.grad, d2.grad) < 1e-3


def test_torch_training_loop_follows_naive_fp32():
    """200 steps of in-batch InfoNCE on a small random model: the lik_cupy loss curve
    follows the naive fp32 autograd curve to within 1e-3 per step."""
    from lik_cupy.torch import maxsim

    n, lq, ld, feat, dim, steps = 8, 16, 24, 32, 64, 200
    gen = torch.Generator(device="cuda").manual_seed(0)
    xq = torch.randn(n, lq, feat, generator=gen, device="cuda")
    xd = torch.randn(n, ld, feat, generator=gen, device="cuda")
    w0 = torch.randn(feat, dim, generator=gen, device="cuda") / feat**0.5

    def run(score_fn):
        wq, wd = w0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        opt = torch.optim.SGD([wq, wd], lr=0.5)
        losses = []
        for _ in range(steps):
            eq = torch.nn.functional.normalize(xq @ wq, dim=-1).half()
            ed = torch.nn.functional.normalize(xd @ wd, dim=-1).half()
            loss = torch.nn.functional.cross_entropy(score_fn(eq, ed) / 0.5, torch.arange(n, device="cuda"))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return np.array(losses)

    def naive(eq, ed):
        return torch.einsum("isk,jtk->ijst", eq.float(), ed.float()).amax(-1).sum(-1)

    ours, ref = run(maxsim), run(naive)
    assert ref[-1] < ref[0] * 0.9  # the model learns
    assert np.max(np.abs(ours - ref)) < 1e-3, np.max(np.abs(ours - ref))


@pytest.mark.parametrize("method", ["atomic", "csr"])
def test_masked_padding_never_reaches_the_gradients(method):
    # the CPU path's repro (tests/test_backward_cpu.py): the kernel skips argmax -1 entries outright
    Q = torch.tensor([[[1, 0], [5, 5]]], dtype=torch.float32, device="cuda")
    D = torch.tensor([[[float("nan")] * 2, [2, 0]], [[float("nan")] * 2] * 2], dtype=torch.float32, device="cuda")
    dm = torch.tensor([[False, True], [False, False]], device="cuda")
    _, a = lik_cupy.maxsim(Q, D, q_lengths=torch.tensor([1], device="cuda"), d_mask=dm, return_argmax=True)
    dQ, dD = lik_cupy.maxsim_backward(torch.ones(1, 2, device="cuda"), Q, D, a, method=method)
    assert dQ.tolist() == [[[2, 0], [0, 0]]]
    assert dD.tolist() == [[[0, 0], [1, 0]], [[0, 0], [0, 0]]]


# ---------------------------------------------------------------- tensors on another GPU than the current one


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("method", ["atomic", "csr"])
def test_backward_on_another_gpu_is_the_current_gpus_call(other_gpu, fw, method):
    """maxsim_backward (padded and packed documents) with its arrays on cuda:1 while cuda:0 is current: its
    gradients lie on cuda:1, bit for bit as on cuda:0 (dD of the atomic method, whose fp32 sums may add in
    another order, to rounding), the repeat path (the second call) included, and cuda:0 stays current."""
    from devices import assert_on, assert_same_bits, current, host, on_gpu

    gen = torch.Generator(device="cuda:0").manual_seed(7)
    Q = _unit(gen, 3, 20, 64, dtype="float16").to("cuda:0")
    D = _unit(gen, 6, 30, 64, dtype="float16").to("cuda:0")
    lens = torch.tensor([30, 0, 7, 30, 12, 1], device="cuda:0")
    off = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda:0"), lens.cumsum(0)])
    T = D.reshape(-1, 64)[: int(off[-1])].contiguous()
    _, a = lik_cupy.maxsim(Q, D, return_argmax=True)
    _, ap = lik_cupy.maxsim_varlen(Q, T, off, return_argmax=True)
    g = torch.randn(3, 6, device="cuda:0", generator=gen)
    here = {"g": g, "Q": Q, "D": D, "a": a, "T": T, "off": off, "ap": ap}
    if fw == "cupy":
        import cupy

        here = {k: cupy.asarray(v) for k, v in here.items()}
    there = on_gpu(here, other_gpu)
    calls = {"padded": lambda x: lik_cupy.maxsim_backward(x["g"], x["Q"], x["D"], x["a"], method=method),
             "packed": lambda x: lik_cupy.maxsim_backward(x["g"], x["Q"], x["T"], x["ap"], d_offsets=x["off"],
                                                          method=method)}
    for name, call in calls.items():
        want = current(call, here)
        for _ in range(2):  # the first call, then the repeat path's prepared call
            got = current(call, there)
            assert_on(got, other_gpu, name)
            if method == "csr":
                assert_same_bits(got, want, name)
            else:  # dQ has one writer per row; dD's atomics add in any order
                assert_same_bits(got[0], want[0], name)
                np.testing.assert_allclose(host(got[1]).astype(np.float32), host(want[1]).astype(np.float32),
                                           rtol=2e-3, atol=1e-3)


def test_backward_arrays_on_two_gpus_are_refused(other_gpu):
    from devices import current

    Q = torch.randn(2, 8, 32, device="cuda:1")
    D = torch.randn(3, 9, 32, device="cuda:1")
    _, a = lik_cupy.maxsim(Q, D, return_argmax=True)
    g = torch.ones(2, 3, device="cuda:1")
    with pytest.raises(ValueError, match="argmax is on cuda:0 but Q is on cuda:1"):
        current(lik_cupy.maxsim_backward, g, Q, D, a.to("cuda:0"))
    with pytest.raises(ValueError, match="grad_scores is on cuda:0 but Q is on cuda:1"):
        current(lik_cupy.maxsim_backward, g.to("cuda:0"), Q, D, a)


@pytest.mark.parametrize("packed", [False, True])
def test_autograd_on_another_gpu_is_the_current_gpus_step(other_gpu, packed):
    """lik_cupy.torch's forward and backward (autograd's device thread) with leaves on cuda:1 while cuda:0 is
    current: scores and gradients on cuda:1, bit for bit as on cuda:0 (method="csr"), twice."""
    from lik_cupy.torch import maxsim, maxsim_varlen

    from devices import assert_on, assert_same_bits, current, on_gpu

    gen = torch.Generator(device="cuda:0").manual_seed(11)
    Q0 = _unit(gen, 4, 16, 64, dtype="bfloat16").to("cuda:0")
    D0 = _unit(gen, 5, 24, 64, dtype="bfloat16").to("cuda:0")
    lens = torch.tensor([24, 3, 0, 17, 9], device="cuda:0")
    off = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda:0"), lens.cumsum(0)])
    T0 = D0.reshape(-1, 64)[: int(off[-1])].contiguous()
    w0 = torch.randn(4, 5, device="cuda:0", generator=gen)

    def step(Q, D, lengths_or_offsets, w):
        Q, D = Q.detach().requires_grad_(), D.detach().requires_grad_()
        if packed:
            s = maxsim_varlen(Q, D, lengths_or_offsets, method="csr")
        else:
            s = maxsim(Q, D, d_lengths=lengths_or_offsets, method="csr")
        (s.masked_fill(torch.isinf(s), 0) * w).sum().backward()
        return s.detach(), Q.grad, D.grad

    args0 = (Q0, T0, off, w0) if packed else (Q0, D0, lens, w0)
    want = current(step, *args0)
    args1 = on_gpu(args0, other_gpu)
    for _ in range(2):
        got = current(step, *args1)
        assert_on(got, other_gpu)
        assert_same_bits(got, want)
