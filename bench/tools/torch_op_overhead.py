"""What each way of exposing an op to PyTorch costs per call, on the CPU, with a trivial payload.

``lik_cupy.torch`` can hand its forward and backward to PyTorch in several ways; each puts a
different amount of Python and dispatcher work in front of the kernels. This times, for a payload
that only allocates the outputs (the scores and the int32 argmax; dQ and dD for the backward):

- ``payload``: the payload called directly (the floor);
- ``autograd.Function``: a ``torch.autograd.Function`` around the payload, applied only when a
  gradient is needed;
- ``define/impl + autograd.Function``: ``torch.library.Library(...).define`` / ``impl`` for the
  CPU key, and an ``autograd.Function`` that re-enters the op below autograd, registered at the
  Autograd key;
- ``define/impl + register_autograd``: the same op with ``torch.library.register_autograd``;
- ``custom_op + register_autograd``: ``torch.library.custom_op`` with ``register_fake`` and
  ``register_autograd``;
- ``lik_cupy.torch.maxsim`` and ``torch.ops.lik_cupy.maxsim``: lik_cupy's own wrapper (its eager
  path: the ``torch.compiler.is_compiling()`` switch, then the autograd.Function) and its
  registered operator called directly, each with the payload standing in for ``lik_cupy.maxsim``
  and ``lik_cupy.maxsim_backward``.

For each: an eager call on inputs that need no gradient, and an eager forward + backward
(``torch.autograd.backward`` of the scores). The styles take turns within each round, so a busy
machine slows them alike; prints microseconds per call, the best of the rounds.

``--cuda`` then times lik_cupy's real work on a small float16 problem on the GPU, where the host is
the bottleneck (back-to-back calls, one synchronisation per round): ``lik_cupy.maxsim``,
``lik_cupy.torch.maxsim`` and ``torch.ops.lik_cupy.maxsim``, what a serving call (and a training
step) pays on the host in total.

``--compile`` times the compiled path instead, on the CPU, median of the rounds: lik_cupy's operators
called alone (each public operator, which has an autograd kernel, its ``_no_autograd`` twin, which the
graphs of ``torch.compile`` call, and the implementation without the dispatcher), and a training step
(``F.cross_entropy(lik_cupy.torch.maxsim(Q, D) / 0.05, arange)``, backward included) eager and under
``torch.compile(fullgraph=True)`` (inductor, default mode), its graphs calling the twins, and the same graphs
with the public operators put back by a post-grad pass (the graphs of ``torch.compile`` before the twins). Each
with two payloads: lik_cupy's NumPy path (what these CPU tensors run), and the GPU's repeat path: a stand-in
prepared call, stored under the CPU tensors' signature, that only allocates the outputs, so that a call runs
on the host what a repeat call on a GPU runs but its launches (``lik_cupy._runtime.prepared_calls``).
A round is ``--calls / 20`` operator calls or ``--calls / 100`` steps. inductor's and AOTAutograd's caches
are off, so each run compiles this tree's graphs.

    python bench/tools/torch_op_overhead.py [--calls 20000] [--rounds 7] [--cuda | --compile]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: this checkout's lik_cupy
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import lik_cupy._torch_autograd as lik_autograd  # noqa: E402
import lik_cupy.torch as lik_torch  # noqa: E402

NQ, LQ, ND, DIM = 4, 8, 6, 16
_NS = "lik_overhead_probe"


def _fwd(Q, D):
    return Q.new_empty((Q.shape[0], D.shape[0])), Q.new_empty((Q.shape[0], D.shape[0], Q.shape[1]), dtype=torch.int32)


def _bwd(g, Q, D, amax):
    return torch.empty_like(Q), torch.empty_like(D)


def _lik_forward(Q, D, *args, return_argmax=False, **kwargs):
    out = _fwd(Q, D)
    return out if return_argmax else out[0]


def _lik_backward(g, Q, D, argmax, **kwargs):
    return _bwd(g, Q, D, argmax)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, D, method):
        scores, amax = _fwd(Q, D)
        ctx.save_for_backward(Q, D, amax)
        ctx.method = method
        ctx.mark_non_differentiable(amax)
        return scores, amax

    @staticmethod
    def backward(ctx, g, _ga):
        Q, D, amax = ctx.saved_tensors
        return (*_bwd(g, Q, D, amax), None)


def autograd_function(Q, D):
    if torch.is_grad_enabled() and (Q.requires_grad or D.requires_grad):
        return _Fn.apply(Q, D, "auto")[0]
    return _fwd(Q, D)[0]


def _define_ops(lib, name):
    lib.define(f"{name}(Tensor Q, Tensor D, str method) -> (Tensor, Tensor)")
    lib.define(f"{name}_bwd(Tensor g, Tensor Q, Tensor D, Tensor amax, str method) -> (Tensor, Tensor)")
    lib.impl(name, lambda Q, D, method: _fwd(Q, D), "CPU")
    lib.impl(f"{name}_bwd", lambda g, Q, D, amax, method: _bwd(g, Q, D, amax), "CPU")
    torch.library.register_fake(f"{_NS}::{name}", lambda Q, D, method: _fwd(Q, D), lib=lib)
    torch.library.register_fake(f"{_NS}::{name}_bwd", lambda g, Q, D, amax, method: _bwd(g, Q, D, amax), lib=lib)
    return getattr(torch.ops, _NS)


def _setup(ctx, inputs, output):
    Q, D, method = inputs
    ctx.save_for_backward(Q, D, output[1])
    ctx.method = method


def build(lib):
    """The registration styles, each a function ``(Q, D) -> scores``."""
    ops = _define_ops(lib, "fn")  # define/impl + an autograd.Function at the Autograd key

    class _Redispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, Q, D, method):
            with torch._C._AutoDispatchBelowAutograd():
                scores, amax = ops.fn.default(Q, D, method)
            ctx.save_for_backward(Q, D, amax)
            ctx.method = method
            ctx.mark_non_differentiable(amax)
            return scores, amax

        @staticmethod
        def backward(ctx, g, _ga):
            Q, D, amax = ctx.saved_tensors
            return (*ops.fn_bwd.default(g, Q, D, amax, ctx.method), None)

    lib.impl("fn", _Redispatch.apply, "Autograd")

    _define_ops(lib, "reg")  # define/impl + register_autograd

    def reg_backward(ctx, g, _ga):
        Q, D, amax = ctx.saved_tensors
        return (*ops.reg_bwd.default(g, Q, D, amax, ctx.method), None)

    torch.library.register_autograd(f"{_NS}::reg", reg_backward, setup_context=_setup, lib=lib)

    @torch.library.custom_op(f"{_NS}::cop", mutates_args=())
    def cop(Q: torch.Tensor, D: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
        return _fwd(Q, D)

    @torch.library.custom_op(f"{_NS}::cop_bwd", mutates_args=())
    def cop_bwd(g: torch.Tensor, Q: torch.Tensor, D: torch.Tensor, amax: torch.Tensor,
                method: str) -> tuple[torch.Tensor, torch.Tensor]:
        return _bwd(g, Q, D, amax)

    cop.register_fake(lambda Q, D, method: _fwd(Q, D))
    cop_bwd.register_fake(lambda g, Q, D, amax, method: _bwd(g, Q, D, amax))

    def cop_backward(ctx, g, _ga):
        Q, D, amax = ctx.saved_tensors
        return (*cop_bwd(g, Q, D, amax, ctx.method), None)

    cop.register_autograd(cop_backward, setup_context=_setup)

    lik_op = torch.ops.lik_cupy.maxsim.default
    return {
        "payload": lambda Q, D: _fwd(Q, D)[0],
        "autograd.Function": autograd_function,
        "define/impl + autograd.Function": lambda Q, D: ops.fn.default(Q, D, "auto")[0],
        "define/impl + register_autograd": lambda Q, D: ops.reg.default(Q, D, "auto")[0],
        "custom_op + register_autograd": lambda Q, D: cop(Q, D, "auto")[0],
        "lik_cupy.torch.maxsim": lik_torch.maxsim,
        "torch.ops.lik_cupy.maxsim": lambda Q, D: lik_op(Q, D, None, None, None, None, "auto",
                                                         Q.requires_grad, None)[0],
    }


def best_us(fns: dict, calls: int, rounds: int, sync=lambda: None, pick=min) -> dict:
    """Per-call microseconds of each function, ``pick`` (the best, or the median) of ``rounds``, the
    functions taking turns (``sync()`` ends each timed loop)."""
    for fn in fns.values():
        for _ in range(min(calls, 500)):
            fn()
    sync()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: pick(t) for name, t in times.items()}


def cuda_table(calls: int, rounds: int) -> None:
    import lik_cupy

    gen = torch.Generator(device="cuda").manual_seed(0)
    Q = torch.randn(2, 32, 128, generator=gen, device="cuda", dtype=torch.float16)
    D = torch.randn(16, 64, 128, generator=gen, device="cuda", dtype=torch.float16)
    Qg, Dg = Q.clone().requires_grad_(True), D.clone().requires_grad_(True)
    g = torch.ones(2, 16, device="cuda")
    op = torch.ops.lik_cupy.maxsim.default
    fns = {
        "lik_cupy.maxsim": lambda Q, D: lik_cupy.maxsim(Q, D),
        "lik_cupy.torch.maxsim": lik_torch.maxsim,
        "torch.ops.lik_cupy.maxsim": lambda Q, D: op(Q, D, None, None, None, None, "auto", Q.requires_grad, None)[0],
    }
    call = best_us({n: (lambda f=f: f(Q, D)) for n, f in fns.items()}, calls, rounds, torch.cuda.synchronize)
    step = best_us({n: (lambda f=f: torch.autograd.backward(f(Qg, Dg), g)) for n, f in fns.items()
                    if n != "lik_cupy.maxsim"}, calls // 4, rounds, torch.cuda.synchronize)
    print(f"\n{torch.cuda.get_device_name()}: Q {list(Q.shape)}, D {list(D.shape)} float16; microseconds per call "
          "(host-bound: the kernels take a few)")
    print(f"{'call':34s} {'eager call':>10s} {'fwd + bwd':>10s}")
    for name in fns:
        print(f"{name:34s} {call[name]:10.2f} {step.get(name, float('nan')):10.2f}")


# ---------------------------------------------------------------- --compile: the compiled path

CN, CLQ, CLD, CDIM = 4, 8, 8, 16  # the compiled step's in-batch problem: Q [CN, CLQ, CDIM], D [CN, CLD, CDIM]


class _StandIn:
    """A prepared call (``lik_cupy._runtime.prepared_calls``) that only allocates its outputs (zeroed: nothing
    uninitialised reaches the loss)."""

    def __init__(self, outputs):
        self.outputs = outputs

    @staticmethod
    def current():
        return True

    def __call__(self, *args):
        return self.outputs(*args)


def stand_ins(Q, D) -> None:
    """Stand-ins stored under the signatures of the forward (``return_argmax=True``) and the backward of CPU
    tensors shaped as Q and D, as ``lik_cupy.torch`` and the operators make them."""
    from lik_cupy._maxsim_calls import maxsim_key
    from lik_cupy._runtime import prepared_calls

    scores_shape, argmax_shape = (Q.shape[0], D.shape[0]), (Q.shape[0], D.shape[0], Q.shape[1])
    fwd = _StandIn(lambda Q, *rest: (Q.new_zeros(scores_shape), Q.new_zeros(argmax_shape, dtype=torch.int32)))
    bwd = _StandIn(lambda g, Q, D, *rest: (torch.zeros_like(Q), torch.zeros_like(D)))
    prepared_calls.store(maxsim_key(Q, D, None, None, None, None, True, "cpu", None, None), fwd)
    g, amax = Q.new_zeros(scores_shape), Q.new_zeros(argmax_shape, dtype=torch.int32)
    prepared_calls.store(prepared_calls.call_key("backward", (False, "auto", "cpu"), g, (Q, D, amax, None),
                                                 precision=False), bwd)


def _numpy_ran(*args, **kwargs):
    raise RuntimeError("the NumPy path ran beside the stand-ins: a call's signature differs from theirs")


def _public_operators_back():
    """An inductor post-grad pass that puts the public operators back where the graphs call the twins."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    ops = torch.ops.lik_cupy
    back = {getattr(ops, f"{n}_no_autograd").default: getattr(ops, n).default
            for n in ("maxsim", "maxsim_varlen", "maxsim_backward")}

    class PublicOperators(CustomGraphPass):
        def __call__(self, graph):
            for node in graph.nodes:
                if node.op == "call_function" and node.target in back:
                    node.target = back[node.target]

        def uuid(self):
            return "lik_cupy public operators back"

    return PublicOperators()


def _payloads(fns: dict, Q, D, calls: int, rounds: int) -> dict:
    """``{name: (NumPy us, repeat path us)}``: each function timed (median of the rounds) with lik_cupy's NumPy
    path, then with the stand-ins, the NumPy path made to raise."""
    from lik_cupy import _cpu
    from lik_cupy._runtime import prepared_calls

    numpy = best_us(fns, calls, rounds, pick=statistics.median)
    stand_ins(Q, D)
    saved = _cpu.maxsim_numpy, _cpu.maxsim_backward_numpy
    _cpu.maxsim_numpy = _cpu.maxsim_backward_numpy = _numpy_ran
    try:
        repeat = best_us(fns, calls, rounds, pick=statistics.median)
    finally:
        _cpu.maxsim_numpy, _cpu.maxsim_backward_numpy = saved
        prepared_calls.clear()
    return {name: (numpy[name], repeat[name]) for name in fns}


def operator_rows(calls: int, rounds: int) -> dict:
    """Each operator called alone on CPU tensors that need no gradient (the forward with its argmax)."""
    Q, D = torch.randn(CN, CLQ, CDIM), torch.randn(CN, CLD, CDIM)
    fwd_args = (Q, D, None, None, None, None, "auto", True, None)
    scores, amax = lik_autograd._maxsim_op(*fwd_args)
    bwd_args = (torch.ones_like(scores), Q, D, amax, None, "auto")
    ops = torch.ops.lik_cupy
    fns = {}
    for name, args, impl in (("maxsim", fwd_args, lik_autograd._maxsim_op),
                             ("maxsim_backward", bwd_args, lik_autograd._maxsim_backward_op)):
        public, twin = getattr(ops, name).default, getattr(ops, f"{name}_no_autograd").default
        fns[f"lik_cupy::{name} (autograd kernel)"] = lambda op=public, a=args: op(*a)
        fns[f"lik_cupy::{name}_no_autograd"] = lambda op=twin, a=args: op(*a)
        fns[f"{name}: implementation alone"] = lambda f=impl, a=args: f(*a)
    return _payloads(fns, Q, D, calls, rounds)


def step_rows(steps: int, rounds: int) -> dict:
    """The training step, eager and compiled (the graphs calling the twins, or the public operators)."""
    # (they key a step by dynamo's graph, which names the public operators: another checkout's could be served)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    Q = torch.randn(CN, CLQ, CDIM, requires_grad=True)
    D = torch.randn(CN, CLD, CDIM, requires_grad=True)
    labels = torch.arange(CN)

    def loss(Q, D):
        return F.cross_entropy(lik_torch.maxsim(Q, D) / 0.05, labels)

    fns = {"eager": loss,
           "compiled: graphs call the twins": torch.compile(loss, fullgraph=True),
           "compiled: graphs call the public operators": torch.compile(
               loss, fullgraph=True, options={"post_grad_custom_post_pass": _public_operators_back()})}

    def step(fn):
        Q.grad = D.grad = None
        fn(Q, D).backward()

    return _payloads({name: (lambda f=fn: step(f)) for name, fn in fns.items()}, Q, D, steps, rounds)


def compile_tables(calls: int, rounds: int) -> None:
    ops = operator_rows(calls // 20, rounds)
    steps = step_rows(calls // 100, rounds)
    print(f"torch {torch.__version__}, CPU, Q [{CN}, {CLQ}, {CDIM}], D [{CN}, {CLD}, {CDIM}] float32; "
          f"microseconds, median of {rounds} rounds; payload: lik_cupy's NumPy path, or the GPU's repeat path "
          "with its prepared call a stand-in that allocates the outputs")
    for title, rows, n in (("operator call", ops, calls // 20), ("training step", steps, calls // 100)):
        print(f"\n{title + f' ({n} a round)':52s} {'NumPy':>9s} {'repeat path':>12s}")
        for name, (numpy, repeat) in rows.items():
            print(f"{name:52s} {numpy:9.2f} {repeat:12.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cuda", action="store_true", help="also time lik_cupy's real calls on the GPU")
    ap.add_argument("--compile", action="store_true", help="time the compiled path instead (CPU)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.compile:
        compile_tables(args.calls, args.rounds)
        return
    lib = torch.library.Library(_NS, "DEF")
    styles = build(lib)
    Q, D = torch.randn(NQ, LQ, DIM), torch.randn(ND, LQ, DIM)
    Qg, Dg = Q.clone().requires_grad_(True), D.clone().requires_grad_(True)
    g = torch.ones(NQ, ND)

    saved = lik_torch._maxsim, lik_autograd._maxsim, lik_autograd._maxsim_backward
    lik_torch._maxsim, lik_autograd._maxsim, lik_autograd._maxsim_backward = _lik_forward, _lik_forward, _lik_backward
    try:
        call = best_us({n: (lambda f=f: f(Q, D)) for n, f in styles.items()}, args.calls, args.rounds)
        step = best_us({n: (lambda f=f: torch.autograd.backward(f(Qg, Dg), g)) for n, f in styles.items()
                        if n != "payload"}, args.calls // 4, args.rounds)
    finally:
        lik_torch._maxsim, lik_autograd._maxsim, lik_autograd._maxsim_backward = saved

    print(f"torch {torch.__version__}, {NQ}x{LQ} queries, {ND} documents, d={DIM}; {args.calls} calls "
          f"({args.calls // 4} fwd + bwd) x {args.rounds} rounds, best round, microseconds per call")
    print(f"{'registration':34s} {'eager call':>10s} {'+ over payload':>15s} {'fwd + bwd':>10s} "
          f"{'+ over autograd.Function':>25s}")
    base_call, base_step = call["payload"], step["autograd.Function"]
    for name in styles:
        s = step.get(name, float("nan"))
        print(f"{name:34s} {call[name]:10.2f} {call[name] - base_call:15.2f} {s:10.2f} {s - base_step:25.2f}")
    del lib
    if args.cuda:
        cuda_table(args.calls // 4, args.rounds)


if __name__ == "__main__":
    main()
