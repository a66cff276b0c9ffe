"""lik_cupy.torch under torch.compile: its torch.library operators (lik_cupy::maxsim,
lik_cupy::maxsim_varlen, lik_cupy::maxsim_backward) pass ``torch.library.opcheck``, and training
steps compile with ``fullgraph=True`` (no graph break), matching the eager step and a float64
autograd reference. CPU tensors here; the tests marked gpu repeat this on CUDA tensors, compile a
ColBERT step with inductor and let inductor's CUDA graphs take a compiled step (the eager and
the compiled step captured with torch.cuda.graph: tests/test_backward_gpu.py).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

import lik_cupy  # noqa: E402
import lik_cupy.torch as lt  # noqa: E402

OPS = torch.ops.lik_cupy
TAU = 0.05  # ColBERT's temperature, for the GPU step's L2-normalised tokens
# The small steps' raw Gaussian tokens give scores spread over about +-20: at ColBERT's temperature
# their softmax saturates, a batch's loss falls to 1e-4 or below, and float32's cross-entropy then
# rounds the loss and its gradients by more than the 1e-5 these tests allow the operators (about
# one seed in 200). At 5 the losses stay near 0.3-10 and the rounding near 5e-7.
TAU_RAW = 5.0


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _t(rng, *shape, dtype=torch.float32, device="cpu", grad=False):
    x = torch.from_numpy(rng.standard_normal(shape)).to(device=device, dtype=dtype)
    return x.requires_grad_(grad)


def _lengths(rng, shape, hi, device="cpu", empty=()):
    n = torch.from_numpy(rng.integers(1, hi + 1, size=shape)).to(device)
    for i in empty:
        n.view(-1)[i] = 0
    return n


def _valid(lengths, size):
    return torch.arange(size, device=lengths.device) < lengths[..., None]


# ---------------------------------------------------------------- the float64 reference


def ref_scores(Q, D, q_valid=None, d_valid=None):
    """float64 ``sum_s max_t <Q[i, s], D[j, t]>`` by plain torch ops (autograd through the max):
    D ``[Nd, Ld, d]`` in-batch or ``[Nq, K, Ld, d]`` candidates; valid masks as in lik_cupy.maxsim."""
    Q, D = Q.double(), D.double()
    cand = D.dim() == 4
    sim = torch.einsum("isk,ijtk->ijst" if cand else "isk,jtk->ijst", Q, D)
    if d_valid is not None:
        sim = sim.masked_fill(~(d_valid[:, :, None, :] if cand else d_valid[None, :, None, :]), float("-inf"))
    best = sim.amax(-1)
    if q_valid is not None:
        best = torch.where(q_valid[:, None, :], best, torch.zeros((), dtype=best.dtype))
    return best.sum(-1)


def unpack(tokens, offsets):
    """Packed documents as padded ``[Nd, Lmax, d]`` and their valid mask (autograd flows to ``tokens``)."""
    lens = (offsets[1:] - offsets[:-1]).long()
    lmax = max(int(lens.max()), 1) if lens.numel() else 1
    valid = _valid(lens, lmax)
    pad = tokens.new_zeros(len(lens), lmax, tokens.shape[-1])
    pad[valid] = tokens
    return pad, valid


def _rel(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


# ---------------------------------------------------------------- the steps compiled


def _recording(graphs):
    """An aot_eager-like backend that keeps each forward and backward graph AOTAutograd makes."""
    def keep(kind):
        def compiler(gm, example_inputs):
            graphs.setdefault(kind, []).append(gm)
            return make_boxed_func(gm.forward)
        return compiler
    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))


def _targets(graphs, kind):
    return {n.target for gm in graphs.get(kind, ()) for n in gm.graph.nodes if n.op == "call_function"}


def _in_batch_loss(Q, D, q_mask, d_lengths, method):
    s = lt.maxsim(Q, D, q_mask, d_lengths=d_lengths, method=method)
    return F.cross_entropy(s / TAU_RAW, torch.arange(Q.shape[0], device=Q.device))


def _candidates_loss(Q, D, q_lengths, d_lengths, method):
    s = lt.maxsim(Q, D, q_lengths=q_lengths, d_lengths=d_lengths, method=method)
    return F.cross_entropy(s / TAU_RAW, torch.zeros(Q.shape[0], dtype=torch.long, device=Q.device))  # the first is the positive


def _varlen_loss(Q, tokens, offsets, q_mask, method):
    s = lt.maxsim_varlen(Q, tokens, offsets, q_mask, method=method)
    return F.cross_entropy(s / TAU_RAW, torch.arange(Q.shape[0], device=Q.device))


def _grads(loss_fn, tensors, rest):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    loss = loss_fn(*leaves, *rest)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


def _training_case(rng, kind, dtype):
    """(loss function, differentiable inputs, other arguments, the float64 reference's loss function)."""
    nq, lq, dim = 4, 9, 24
    Q = _t(rng, nq, lq, dim, dtype=dtype)
    q_len = _lengths(rng, (nq,), lq)
    if kind == "in-batch":  # two extra negatives, one of them empty
        nd, ld = nq + 2, 13
        D = _t(rng, nd, ld, dim, dtype=dtype)
        d_len = _lengths(rng, (nd,), ld, empty=(nd - 1,))
        qm = _valid(q_len, lq)
        ref = lambda q, d: F.cross_entropy(ref_scores(q, d, qm, _valid(d_len, ld)) / TAU_RAW,  # noqa: E731
                                           torch.arange(nq))
        return _in_batch_loss, (Q, D), (qm, d_len.tolist()), ref
    if kind == "candidates":
        k, ld = 5, 11
        D = _t(rng, nq, k, ld, dim, dtype=dtype)
        d_len = _lengths(rng, (nq, k), ld, empty=(3,))
        ref = lambda q, d: F.cross_entropy(ref_scores(q, d, _valid(q_len, lq), _valid(d_len, ld)) / TAU_RAW,  # noqa: E731
                                           torch.zeros(nq, dtype=torch.long))
        return _candidates_loss, (Q, D), (q_len, d_len), ref
    lens = _lengths(rng, (nq + 1,), 17, empty=(nq,))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    tokens = _t(rng, int(offsets[-1]), dim, dtype=dtype)
    qm = _valid(q_len, lq)

    def ref(q, toks):
        pad, valid = unpack(toks, offsets)
        return F.cross_entropy(ref_scores(q, pad, qm, valid) / TAU_RAW, torch.arange(nq))

    return _varlen_loss, (Q, tokens), (offsets.to(torch.int32), qm), ref


@pytest.mark.parametrize("kind", ["in-batch", "candidates", "varlen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_training_step_matches_eager_and_float64(rng, kind, dtype):
    """scores -> cross-entropy -> backward, compiled whole: the forward graph holds the forward
    operator, the backward graph the backward operator, and loss and gradients are the eager step's
    and the float64 reference's."""
    loss_fn, tensors, rest, ref_fn = _training_case(rng, kind, dtype)
    method = "csr"
    graphs = {}
    compiled = torch.compile(loss_fn, fullgraph=True, backend=_recording(graphs))
    loss_c, grads_c = _grads(compiled, tensors, (*rest, method))
    loss_e, grads_e = _grads(loss_fn, tensors, (*rest, method))
    loss_r, grads_r = _grads(ref_fn, [t.double() for t in tensors], ())

    forward = OPS.maxsim_varlen.default if kind == "varlen" else OPS.maxsim.default
    assert forward in _targets(graphs, "fw")
    assert OPS.maxsim_backward.default in _targets(graphs, "bw")
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(loss_c, loss_e, rtol=tol, atol=0)
    assert abs(float(loss_c) - float(loss_r)) <= 10 * tol * abs(float(loss_r))
    for gc, ge, gr in zip(grads_c, grads_e, grads_r):
        assert gc.dtype == dtype and gc.shape == gr.shape
        torch.testing.assert_close(gc, ge, rtol=tol, atol=tol)
        assert _rel(gc, gr) < 10 * tol


@pytest.mark.parametrize("kind", ["in-batch", "candidates", "varlen"])
def test_compiled_step_graphs_are_cudagraph_safe(rng, kind):
    """What inductor checks before it takes a graph into CUDA graphs (mode="reduce-overhead"): no
    operator tagged cudagraph_unsafe or in its forbidden set, and no output of data-dependent
    shape. The operators' fake implementations give static shapes, so both graphs of each step pass."""
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    loss_fn, tensors, rest, _ = _training_case(rng, kind, torch.float32)
    graphs = {}
    _grads(torch.compile(loss_fn, fullgraph=True, backend=_recording(graphs)), tensors, (*rest, "auto"))
    for op in (OPS.maxsim.default, OPS.maxsim_varlen.default, OPS.maxsim_backward.default):
        assert torch.Tag.cudagraph_unsafe not in op.tags
    assert graphs["fw"] and graphs["bw"]
    for gm in graphs["fw"] + graphs["bw"]:
        assert get_first_incompatible_cudagraph_node(gm) is None, gm.graph


def test_compiled_lengths_as_lists_and_tensors_agree(rng):
    """Lengths given as a Python list become a tensor inside the compiled graph."""
    Q, D = _t(rng, 3, 6, 16), _t(rng, 5, 8, 16)
    d_len = _lengths(rng, (5,), 8)
    fn = torch.compile(lambda q, d, n: lt.maxsim(q, d, d_lengths=n, return_argmax=True), fullgraph=True,
                       backend="aot_eager")
    s_list, a_list = fn(Q, D, d_len.tolist())
    s_t, a_t = fn(Q, D, d_len)
    s_e, a_e = lik_cupy.maxsim(Q, D, d_lengths=d_len, return_argmax=True, backend="cpu")
    assert torch.equal(s_list, s_e) and torch.equal(s_t, s_e)
    assert torch.equal(a_list, a_e) and torch.equal(a_t, a_e)


def test_compiled_inference_keeps_no_argmax(rng):
    """Without a gradient to keep, the compiled call asks the operator for no argmax (an int32
    ``scores.shape + (0,)`` stands in), and its scores are the eager call's."""
    Q, D = _t(rng, 2, 7, 12), _t(rng, 2, 3, 9, 12)
    graphs = {}
    fn = torch.compile(lambda q, d: lt.maxsim(q, d), fullgraph=True, backend=_recording(graphs))
    with torch.no_grad():
        out = fn(Q, D)
    assert torch.equal(out, lik_cupy.maxsim(Q, D, backend="cpu"))
    calls = [n for gm in graphs["fw"] for n in gm.graph.nodes if n.target is OPS.maxsim.default]
    assert len(calls) == 1 and calls[0].args[7] is False


def test_arrays_of_other_frameworks_are_a_type_error_naming_them(rng):
    """A NumPy array reached ``requires_grad``: an AttributeError that named no argument."""
    q, d = _t(rng, 2, 3, 16), _t(rng, 4, 5, 16)
    calls = [(lambda: lt.maxsim(q.numpy(), d), "Q is a numpy.ndarray"), (lambda: lt.maxsim(q, d.numpy()), "D is a"),
             (lambda: lt.maxsim_varlen(q, [[0.0] * 16], [0, 1]), "D_tokens is a builtins.list"),
             (lambda: lt.maxsim_from_hidden(q, d, d[0].numpy()), "W is a numpy.ndarray")]
    calls += [(lambda: lt.maxsim(None, d), "Q is None"), (lambda: lt.maxsim(q, None), "D is None"),
              (lambda: lt.maxsim_varlen(q, None, [0]), "D_tokens is None")]  # (an AttributeError on requires_grad)
    for call, words in calls:
        with pytest.raises(TypeError, match=words + ".*lik_cupy.torch takes torch tensors"):
            call()


def test_compiled_call_raises_the_validation_error(rng):
    """The fake implementations are lik_cupy's own checks, so a bad call fails at trace time with
    lik_cupy's message."""
    fn = torch.compile(lambda q, d: lt.maxsim(q, d), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="D has dim 12 but Q has dim 16"):
        fn(_t(rng, 2, 3, 16), _t(rng, 4, 5, 12))
    fn = torch.compile(lambda q, t, o: lt.maxsim_varlen(q, t, o), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="d_offsets must be int32 or int64"):
        fn(_t(rng, 2, 3, 16), _t(rng, 7, 16), torch.tensor([0.0, 7.0]))
    fn = torch.compile(lambda q, d: lt.maxsim(q, d, precision="fp16"), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="precision must be one of"):
        fn(_t(rng, 2, 3, 16), _t(rng, 4, 5, 16))
    with pytest.raises(Exception, match="method must be one of"):
        torch.compile(lambda q, d: lt.maxsim(q, d, method="fast"), fullgraph=True, backend="aot_eager")(
            _t(rng, 2, 3, 16), _t(rng, 4, 5, 16))
    with pytest.raises(ValueError, match="method must be one of"):  # (not NumPy's "truth value ... ambiguous")
        lt.maxsim(_t(rng, 2, 3, 16), _t(rng, 4, 5, 16), method=np.array(["csr", "auto"]))


def test_fake_tensors_take_the_operators(rng):
    """Under a FakeTensorMode (torch.export's tracing, shape propagation) the public functions go
    through the operators' fake implementations: outputs shaped as lik_cupy.maxsim shapes them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        Q = torch.empty(3, 5, 8, requires_grad=True)
        s, a = lt.maxsim(Q, torch.empty(3, 4, 6, 8, dtype=torch.float32), return_argmax=True)
        assert s.shape == (3, 4) and s.dtype == torch.float32 and a.shape == (3, 4, 5) and a.dtype == torch.int32
        s = lt.maxsim_varlen(torch.empty(5, 8, dtype=torch.float64), torch.empty(11, 8, dtype=torch.float64),
                             torch.empty(4, dtype=torch.int64))
        assert s.shape == (3,) and s.dtype == torch.float64


def test_operator_schema_carries_every_argument():
    """The non-tensor arguments are schema arguments (compile guards on them, never bakes one in)."""
    for op, names in ((OPS.maxsim.default, ["Q", "D", "q_mask", "d_mask", "q_lengths", "d_lengths", "method",
                                             "return_argmax", "precision"]),
                      (OPS.maxsim_varlen.default, ["Q", "D_tokens", "d_offsets", "q_mask", "q_lengths", "method",
                                                    "return_argmax", "precision"]),
                      (OPS.maxsim_backward.default, ["grad_scores", "Q", "D", "argmax", "d_offsets", "method"])):
        assert [a.name for a in op._schema.arguments] == names
        schema = str(op._schema)
        assert "str method" in schema
        assert op is OPS.maxsim_backward.default or ("bool return_argmax" in schema and "str? precision" in schema)
        assert torch.Tag.pt2_compliant_tag in op.tags


def test_operator_gradient_needs_the_argmax(rng):
    Q, D = _t(rng, 2, 3, 8, grad=True), _t(rng, 4, 5, 8, grad=True)
    s, a = OPS.maxsim.default(Q, D, None, None, None, None, "auto", False, None)
    assert a.shape == (2, 4, 0) and a.dtype == torch.int32
    with pytest.raises(RuntimeError, match="return_argmax=True"):
        s.sum().backward()


# ---------------------------------------------------------------- opcheck


def _forward_cases(rng, dtype, device="cpu"):
    """(name, operator, arguments) of forward calls on inputs that take gradients."""
    nq, lq, nd, ld, k, dim = 3, 6, 5, 9, 4, 20
    g = {"dtype": dtype, "device": device, "grad": True}
    q_len, d_len = _lengths(rng, (nq,), lq, device), _lengths(rng, (nd,), ld, device, empty=(2,))
    yield "plain", OPS.maxsim.default, (_t(rng, nq, lq, dim, **g), _t(rng, nd, ld, dim, **g), None, None, None, None)
    yield "masks", OPS.maxsim.default, (_t(rng, nq, lq, dim, **g), _t(rng, nd, ld, dim, **g), _valid(q_len, lq),
                                        _valid(d_len, ld), None, None)
    yield "lengths", OPS.maxsim.default, (_t(rng, nq, lq, dim, **g), _t(rng, nd, ld, dim, **g), None, None,
                                          q_len.to(torch.int32), d_len)
    yield "one query", OPS.maxsim.default, (_t(rng, lq, dim, **g), _t(rng, nd, ld, dim, **g), None, None, None, d_len)
    yield "candidates", OPS.maxsim.default, (_t(rng, nq, lq, dim, **g), _t(rng, nq, k, ld, dim, **g), None, None,
                                             q_len, _lengths(rng, (nq, k), ld, device, empty=(5,)))
    lens = _lengths(rng, (nd,), 13, device, empty=(1,))
    off = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), lens.cumsum(0)])
    tokens = _t(rng, int(off[-1]), dim, **g)
    yield "varlen", OPS.maxsim_varlen.default, (_t(rng, nq, lq, dim, **g), tokens, off, _valid(q_len, lq), None)
    yield "varlen int32", OPS.maxsim_varlen.default, (_t(rng, nq, lq, dim, **g), tokens, off.to(torch.int32), None,
                                                      q_len)


def _opcheck_forward_and_backward(op, args, method, **tol):
    torch.library.opcheck(op, (*args, method, True, None), **tol)
    no_grad = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)  # no argmax, so no gradient
    torch.library.opcheck(op, (*no_grad, method, False, "fp32"), **tol)
    scores, amax = op(*args, method, True, None)
    Q, D = args[0].detach(), args[1].detach()
    off = args[2] if op is OPS.maxsim_varlen.default else None
    g = torch.randn(scores.shape, device=Q.device, dtype=torch.float32)
    torch.library.opcheck(OPS.maxsim_backward.default, (g, Q, D, amax, off, method), **tol)
    return scores, amax


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_cpu(rng, dtype):
    for name, op, args in _forward_cases(rng, dtype):
        scores, amax = _opcheck_forward_and_backward(op, args, "auto")
        Q, D = args[0].detach(), args[1].detach()
        if op is OPS.maxsim.default:
            ref = lik_cupy.maxsim(Q, D, *args[2:4], q_lengths=args[4], d_lengths=args[5], return_argmax=True,
                                  backend="cpu")
        else:
            ref = lik_cupy.maxsim_varlen(Q, D, *args[2:4], q_lengths=args[4], return_argmax=True, backend="cpu")
        assert torch.equal(scores, ref[0]) and torch.equal(amax, ref[1]), name
        assert scores.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


# ---------------------------------------------------------------- inductor on the CPU


@pytest.fixture(scope="module")
def cpu_inductor():
    """Skips unless inductor can build CPU code here (it needs a working C++ compiler)."""
    try:
        f = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="inductor", fullgraph=True)
        x = torch.randn(33)
        assert torch.allclose(f(x), torch.sin(x) * 2 + 1)
    except Exception as e:  # noqa: BLE001  (no compiler, or one inductor cannot drive)
        pytest.skip(f"inductor cannot compile CPU code here: {type(e).__name__}: {str(e)[:200]}")
    finally:
        torch._dynamo.reset()


def test_inductor_training_step_cpu(rng, cpu_inductor):
    loss_fn, tensors, rest, ref_fn = _training_case(rng, "in-batch", torch.float32)
    compiled = torch.compile(loss_fn, fullgraph=True, backend="inductor")
    loss_c, grads_c = _grads(compiled, tensors, (*rest, "auto"))
    loss_e, grads_e = _grads(loss_fn, tensors, (*rest, "auto"))
    loss_r, grads_r = _grads(ref_fn, [t.double() for t in tensors], ())
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=0)
    assert abs(float(loss_c) - float(loss_r)) <= 1e-5 * abs(float(loss_r))
    for gc, ge, gr in zip(grads_c, grads_e, grads_r):
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
        assert _rel(gc, gr) < 1e-5


# ---------------------------------------------------------------- on the GPU


def _unit(gen, *shape, dtype):
    x = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64)
    return F.normalize(x, dim=-1).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_opcheck_cuda(rng, dtype):
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    for name, op, args in _forward_cases(rng, dtype, "cuda"):
        scores, amax = _opcheck_forward_and_backward(op, args, "csr", atol=tol, rtol=tol)  # csr: reproducible dD
        assert scores.is_cuda and amax.dtype == torch.int32, name


class _Encoder(torch.nn.Module):
    """A ColBERT-like head: project hidden states, normalise each token (in float32, then back to
    the model's dtype, so inductor's fused normalisation rounds as eager's does but for rare ulps)."""

    def __init__(self, hidden, dim):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, h):
        return F.normalize(self.proj(h).float(), dim=-1).to(h.dtype)


def _colbert_loss(model, hq, hd, q_mask, d_lengths):
    Q, D = model(hq), model(hd)
    s = lt.maxsim(Q, D, q_mask, d_lengths=d_lengths, method="csr")
    return F.cross_entropy(s / TAU, torch.arange(hq.shape[0], device=hq.device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inductor_colbert_step_matches_eager(dtype):
    """An in-batch ColBERT step (projection, normalisation, MaxSim, cross-entropy, backward) compiled
    whole by inductor gives the eager step's loss and weight gradient (an embedding an ulp apart
    may turn a near tie to another token: a tolerance above rounding)."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    nq, lq, nd, ld, hidden, dim = 16, 32, 24, 120, 96, 128
    model = _Encoder(hidden, dim).to(device="cuda", dtype=dtype)
    hq = torch.randn(nq, lq, hidden, generator=gen, device="cuda").to(dtype)
    hd = torch.randn(nd, ld, hidden, generator=gen, device="cuda").to(dtype)
    q_mask = torch.rand(nq, lq, generator=gen, device="cuda") < 0.9
    d_len = torch.randint(1, ld + 1, (nd,), generator=gen, device="cuda")
    graphs = {}

    def run(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(model, hq, hd, q_mask, d_len)
        loss.backward()
        return loss.detach().float(), model.proj.weight.grad.clone()

    compiled = torch.compile(_colbert_loss, fullgraph=True, backend="inductor")
    loss_c, grad_c = run(compiled)
    loss_e, grad_e = run(_colbert_loss)
    assert abs(float(loss_c - loss_e)) <= 1e-2 * abs(float(loss_e))
    assert _rel(grad_c, grad_e) < (1e-2 if dtype == torch.float16 else 3e-2)
    # the step from the embeddings on, compiled without inductor: the operators in both graphs, and
    # the eager step's results but for the loss gradient's last bits
    Q, D = model(hq).detach(), model(hd).detach()
    fn = torch.compile(_in_batch_loss, fullgraph=True, backend=_recording(graphs))
    loss_c, grads_c = _grads(fn, (Q, D), (q_mask, d_len, "csr"))
    loss_e, grads_e = _grads(_in_batch_loss, (Q, D), (q_mask, d_len, "csr"))
    assert OPS.maxsim.default in _targets(graphs, "fw") and OPS.maxsim_backward.default in _targets(graphs, "bw")
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)
    for gc, ge in zip(grads_c, grads_e):
        assert _rel(gc, ge) < 1e-3


@pytest.mark.gpu
def test_reduce_overhead_captures_the_operators_and_replays_no_host_code(monkeypatch):
    """``torch.compile(mode="reduce-overhead")``: inductor's CUDA graphs take the step, operators
    included (no cudagraph skip); once it has warmed up and recorded them, a step is the graphs
    alone: lik_cupy's Python (validation, kernel choice, launches) never runs in a replay. Every
    replay, on new inputs, gives the eager step's loss and gradients."""
    from torch._dynamo.utils import counters

    from lik_cupy import _torch_autograd as ops  # the operators' implementations

    calls = []
    for name in ("_maxsim", "_maxsim_backward"):  # what the operators' CUDA implementations call
        real = getattr(ops, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, counted)
    gen = torch.Generator(device="cuda").manual_seed(37)
    nq, lq, nd, ld, dim = 6, 24, 10, 64, 96
    d_len = torch.randint(1, ld + 1, (nd,), generator=gen, device="cuda")
    counters.clear()
    fn = torch.compile(_in_batch_loss, fullgraph=True, mode="reduce-overhead")
    during = []
    for _ in range(6):
        Q = _unit(gen, nq, lq, dim, dtype=torch.float16)
        D = _unit(gen, nd, ld, dim, dtype=torch.float16)
        torch.compiler.cudagraph_mark_step_begin()
        before = len(calls)
        loss_c, grads_c = _grads(fn, (Q, D), (None, d_len, "csr"))
        during.append(calls[before:])
        loss_e, grads_e = _grads(_in_batch_loss, (Q, D), (None, d_len, "csr"))
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=0)  # inductor's cross-entropy: last bits
        for gc, ge in zip(grads_c, grads_e):
            assert _rel(gc, ge) < 1e-3
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert "_maxsim" in during[0] and "_maxsim_backward" in during[0]  # the warm-up ran them
    assert during[-3:] == [[], [], []], during


def test_a_gradient_of_the_gradients_is_refused_not_zero(rng):
    """create_graph=True and then a gradient through lik-cupy's gradients: a clear error on every path
    (eager, the operators, the fused head), where the gradients had come back detached and a penalty
    on them was differentiated as a constant."""
    q = torch.from_numpy(rng.standard_normal((2, 3, 4))).requires_grad_()
    d = torch.from_numpy(rng.standard_normal((3, 5, 4))).requires_grad_()
    calls = [lambda: lik_cupy.torch.maxsim(q, d),
             lambda: OPS.maxsim.default(q, d, None, None, None, None, "auto", True, None)[0]]
    for call in calls:
        s = call()
        (gq,) = torch.autograd.grad(s.sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice|no second derivative"):
            (s.sum() + (gq**2).sum()).backward()
    h = torch.from_numpy(rng.standard_normal((3, 5, 6))).requires_grad_()
    w = torch.from_numpy(rng.standard_normal((4, 6))).requires_grad_()
    s = lik_cupy.torch.maxsim_from_hidden(q, h, w)
    (gw,) = torch.autograd.grad(s.sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        (gw**2).sum().backward()
    # a single backward is unchanged
    s = lik_cupy.torch.maxsim(q, d)
    s.sum().backward()
    assert q.grad is not None and d.grad is not None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_func_transforms(rng, device):
    """torch.func's vmap, grad, vmap of grad (per-sample gradients) and jacrev through
    lik_cupy.torch.maxsim and maxsim_varlen, against a loop of eager calls and autograd; a
    batched mask or document; a second derivative still refused. (On the GPU dD's atomic sums
    leave the order of the gradients' additions free: equal to rounding there.)"""

    def same(a, b):
        return torch.equal(a, b) if device == "cpu" else torch.allclose(a, b, rtol=1e-6, atol=1e-6)

    q = _t(rng, 4, 2, 5, 16, dtype=torch.float64, device=device)
    d = _t(rng, 3, 7, 16, dtype=torch.float64, device=device)
    m = torch.from_numpy(rng.random((4, 2, 5)) < 0.7).to(device)
    dl = torch.tensor([7, 2, 5], device=device)
    loop = torch.stack([lt.maxsim(a, d, d_lengths=dl) for a in q])
    assert torch.equal(torch.func.vmap(lambda a: lt.maxsim(a, d, d_lengths=dl))(q), loop)
    assert torch.equal(torch.func.vmap(lambda a: lt.maxsim(a, d))(q[:, 0]), torch.stack([lt.maxsim(a, d) for a in q[:, 0]]))
    s, a = torch.func.vmap(lambda x, y: lt.maxsim(x, d, q_mask=y, return_argmax=True))(q, m)
    for b in range(4):
        sb, ab = lt.maxsim(q[b], d, q_mask=m[b], return_argmax=True)
        assert torch.equal(s[b], sb) and torch.equal(a[b], ab)
    dd = _t(rng, 2, 3, 7, 16, dtype=torch.float64, device=device)
    assert torch.equal(torch.func.vmap(lambda x: lt.maxsim(q[0], x))(dd), torch.stack([lt.maxsim(q[0], x) for x in dd]))
    nested = torch.func.vmap(torch.func.vmap(lambda a, x: lt.maxsim(a, x), in_dims=(0, None)), in_dims=(None, 0))(q, dd)
    assert torch.equal(nested, torch.stack([torch.stack([lt.maxsim(a, x) for a in q]) for x in dd]))
    empty = torch.func.vmap(lambda a: lt.maxsim(a, d, return_argmax=True))(q[:0])
    assert empty[0].shape == (0, 2, 3) and empty[1].shape == (0, 2, 3, 5) and empty[1].dtype == torch.int32
    tokens, off = _t(rng, 10, 16, dtype=torch.float64, device=device), torch.tensor([0, 3, 3, 10], device=device)
    assert torch.equal(torch.func.vmap(lambda x: lt.maxsim_varlen(x, tokens, off))(q),
                       torch.stack([lt.maxsim_varlen(x, tokens, off) for x in q]))

    def loss(x, y):
        return lt.maxsim(x, y, d_lengths=dl).logsumexp(-1).sum()

    def eager_grads(x, y):
        x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
        loss(x, y).backward()
        return x.grad, y.grad

    gq, gd = torch.func.grad(loss, argnums=(0, 1))(q[0], d)
    eq, ed = eager_grads(q[0], d)
    assert same(gq, eq) and same(gd, ed)
    per_q, per_d = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None))(q, d)
    for b in range(4):
        eq, ed = eager_grads(q[b], d)
        assert same(per_q[b], eq) and same(per_d[b], ed)
    jac = torch.func.jacrev(lambda x: lt.maxsim(x, d))(q[0])
    assert jac.shape == (2, 3, 2, 5, 16)
    for i, j in ((0, 0), (1, 2)):
        x = q[0].clone().requires_grad_()
        lt.maxsim(x, d)[i, j].backward()
        assert same(jac[i, j], x.grad)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.func.grad(lambda x: torch.func.grad(lambda y: lt.maxsim(y, d).sum())(x).sum())(q[0])


def test_torch_func_takes_lengths_as_python_lists(rng):
    """Lengths as Python lists (as eager calls take them) under vmap, vmap of grad and an empty batch:
    torch.func gives a list's in_dims as a list, which the vmap rule sliced as a tensor (an
    AttributeError: 'list' object has no attribute 'select')."""
    q = _t(rng, 3, 2, 5, 16, dtype=torch.float64)
    d = _t(rng, 4, 7, 16, dtype=torch.float64)
    d_len, q_len = [7, 0, 3, 5], (5, 2)
    out = torch.func.vmap(lambda a: lt.maxsim(a, d, q_lengths=q_len, d_lengths=d_len))(q)
    assert torch.equal(out, torch.stack([lt.maxsim(a, d, q_lengths=q_len, d_lengths=d_len) for a in q]))
    assert torch.func.vmap(lambda a: lt.maxsim(a, d, d_lengths=d_len))(q[:0]).shape == (0, 2, 4)
    tokens = _t(rng, 12, 16, dtype=torch.float64)
    out = torch.func.vmap(lambda a: lt.maxsim_varlen(a, tokens, [0, 5, 5, 12], q_lengths=[4, 1]))(q)
    assert torch.equal(out, torch.stack([lt.maxsim_varlen(a, tokens, [0, 5, 5, 12], q_lengths=[4, 1]) for a in q]))

    def loss(x, y):
        return lt.maxsim(x, y, q_lengths=q_len, d_lengths=d_len).logsumexp(-1).sum()

    per_q, per_d = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None))(q, d)
    for b in range(3):
        x, y = q[b].clone().requires_grad_(), d.clone().requires_grad_()
        loss(x, y).backward()
        assert torch.equal(per_q[b], x.grad) and torch.equal(per_d[b], y.grad)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning",
                            "ignore::torch.jit.TracerWarning")  # (the lengths given as lists are constants)
def test_jit_trace_records_the_operators(rng):
    """torch.jit.trace of a model that scores with lik_cupy.torch: the eager call ran lik_cupy on the host and
    the trace kept its scores as a constant (the traced model gave the example's scores for any input); the
    calls now record the operators, the argmax kept whatever the grad mode (jit.trace's check re-runs under
    no_grad), so the traced model scores new inputs and trains as the eager one does."""

    class Scorer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(12, 8, dtype=torch.float64)

        def forward(self, x, d, tokens, h):
            q = self.proj(x)
            return (lt.maxsim(q, d, d_lengths=[5, 1, 0, 2]), lt.maxsim_varlen(q, tokens, [0, 3, 7]),
                    lt.maxsim_from_hidden(q, h, self.proj.weight, self.proj.bias))

    model = Scorer()

    def inputs():
        return (_t(rng, 2, 3, 12, dtype=torch.float64), _t(rng, 4, 5, 8, dtype=torch.float64),
                _t(rng, 7, 8, dtype=torch.float64), _t(rng, 4, 5, 12, dtype=torch.float64))

    traced = torch.jit.trace(model, inputs())
    for x in (inputs(), inputs()):
        got, want = traced(*x), model(*x)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        grads = []
        for out in (got, want):
            model.zero_grad()
            sum(s.masked_fill(torch.isinf(s), 0).sum() for s in out).backward()
            grads.append(model.proj.weight.grad.clone())
        assert torch.equal(*grads)


def test_make_fx_records_the_operators(rng):
    """make_fx in its default real tracing mode (the tensors are plain, with their data): the eager call
    ran lik_cupy on the host and the graph held its scores as a constant; the calls now record the
    operators, backward included, so the graph scores and differentiates new inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, d, tokens, h, w):
        q = q.detach().requires_grad_()
        s = (lt.maxsim(q, d, d_lengths=[5, 1, 3, 2]).sum() + lt.maxsim_varlen(q, tokens, [0, 3, 7]).sum()
             + lt.maxsim_from_hidden(q, h, w).sum())
        return s, torch.autograd.grad(s, q)[0]

    def inputs():
        return (_t(rng, 2, 3, 8), _t(rng, 4, 5, 8), _t(rng, 7, 8), _t(rng, 4, 5, 6), _t(rng, 8, 6))

    graph = make_fx(step)(*inputs())
    targets = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    assert {OPS.maxsim.default, OPS.maxsim_varlen.default, OPS.maxsim_from_hidden.default,
            OPS.maxsim_backward.default, OPS.maxsim_from_hidden_backward.default} <= targets
    x = inputs()
    for got, want in zip(graph(*x), step(*x)):
        assert torch.equal(got, want)


def test_batched_grad_outputs_take_one_backward_each(rng):
    """``torch.autograd.grad(..., is_grads_batched=True)`` (``jacobian(..., vectorize=True)``) batches the
    gradients with torch's legacy vmap, whose data the kernels cannot read: the backward takes them
    through its operator, one element at a time, as the unbatched calls give them (the eager call had
    raised "Batching rule not implemented for aten::detach")."""
    q = _t(rng, 2, 3, 4, dtype=torch.float64, grad=True)
    d = _t(rng, 3, 5, 4, dtype=torch.float64, grad=True)
    t = _t(rng, 6, 4, dtype=torch.float64, grad=True)
    h = _t(rng, 3, 5, 6, dtype=torch.float64, grad=True)
    w = _t(rng, 4, 6, dtype=torch.float64, grad=True)
    m = torch.from_numpy(rng.random((3, 5)) < 0.7)
    calls = [(lambda q, d: lt.maxsim(q, d, d_mask=m), (q, d)),
             (lambda q, t: lt.maxsim_varlen(q, t, [0, 2, 2, 6]), (q, t)),
             (lambda q, h, w: lt.maxsim_from_hidden(q, h, w), (q, h, w))]
    for fn, inputs in calls:
        want = torch.autograd.functional.jacobian(fn, inputs)
        got = torch.autograd.functional.jacobian(fn, inputs, vectorize=True)
        for x, y in zip(got, want):
            assert torch.equal(x, y)
        basis = torch.eye(6, dtype=torch.float64).reshape(6, 2, 3)
        got = torch.autograd.grad(fn(*inputs), inputs, basis, is_grads_batched=True)
        for x, y in zip(got, want):
            assert torch.equal(x, y.reshape(x.shape))  # the jacobian's rows, one a score
