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

    python bench/tools/torch_op_overhead.py [--calls 20000] [--rounds 7] [--cuda]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: this checkout's lik_cupy
import torch  # noqa: E402

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


def best_us(fns: dict, calls: int, rounds: int, sync=lambda: None) -> dict:
    """Per-call microseconds of each function, the best of ``rounds``, the functions taking turns
    (``sync()`` ends each timed loop)."""
    for fn in fns.values():
        for _ in range(min(calls, 500)):
            fn()
    sync()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    return best


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cuda", action="store_true", help="also time lik_cupy's real calls on the GPU")
    args = ap.parse_args()
    torch.set_num_threads(1)
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
