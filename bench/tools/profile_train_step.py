"""Where an eager in-batch training step's time goes, on one GPU (issue 29's training rows).

The step of ``bench_e2e.py``: ``(lik_cupy.torch.maxsim(Q, D) * W).sum().backward()`` with
in-batch documents, float16, d = 128. For each shape this times, back to back (best of three
rounds of 300, one sync a round):

- ``step``: the whole step; ``step_backward_g``: ``maxsim(Q, D).backward(G)``, without torch's
  multiply and sum;
- ``torch_only``: the same multiply, sum and backward on a leaf ``[N, N]`` tensor (what torch's
  autograd costs around our op);
- ``forward_argmax`` and ``backward``: our two calls alone;
- ``step_one_thread``: ``step`` with autograd's multithreading off (the backward runs on the calling
  thread, not handed to autograd's CUDA device thread and back), and ``flash_step`` /
  ``flash_step_one_thread``: flash-maxsim's training call in the same step, both ways (where it
  imports), to show what the hand-over costs every backend;

and, for each, ``gpu_ms``: the GPU time of the same calls queued behind a sleep (the host runs
ahead; median of three rounds of 50), so ``wall - gpu`` is what the host adds. Writes ``profile_train_step_<gpu>.json`` to $OUT
(or bench/results) and prints a table.

    python bench/tools/profile_train_step.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import lik_cupy  # noqa: E402
import lik_cupy.torch as lt  # noqa: E402
from lik_cupy._base.device import device_properties  # noqa: E402

from bench.lib import baselines  # noqa: E402
from bench.lib.gpu import unit_tokens  # noqa: E402
from bench.lib.results import out_dir, write_result  # noqa: E402
from bench.lib.timing import per_call_ms, wall_ms  # noqa: E402

SHAPES = {"n32_32x80": (32, 32, 80), "n64_32x300": (64, 32, 300)}


def _one_thread(fn):
    """``fn`` with autograd's multithreading off while it runs."""
    def call():
        torch.autograd.set_multithreading_enabled(False)
        try:
            fn()
        finally:
            torch.autograd.set_multithreading_enabled(True)
    return call


def main():
    flash, _ = baselines.load(baselines.FLASH)
    train = getattr(flash, "flash_maxsim_batched_train", None)
    rows = []
    for name, (n, lq, ld) in SHAPES.items():
        q, d = unit_tokens(torch, n, lq, 128).requires_grad_(), unit_tokens(torch, n, ld, 128).requires_grad_()
        w, g = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
        leaf = torch.randn(n, n, device="cuda", requires_grad=True)
        qd, dd = q.detach(), d.detach()
        _, amax = lik_cupy.maxsim(qd, dd, return_argmax=True)

        def step():
            q.grad = d.grad = None
            (lt.maxsim(q, d) * w).sum().backward()

        def step_backward_g():
            q.grad = d.grad = None
            lt.maxsim(q, d).backward(g)

        def torch_only():
            leaf.grad = None
            (leaf * w).sum().backward()

        calls = {"step": step, "step_backward_g": step_backward_g, "torch_only": torch_only,
                 "forward_argmax": lambda: lik_cupy.maxsim(qd, dd, return_argmax=True),
                 "backward": lambda: lik_cupy.maxsim_backward(g, qd, dd, amax),
                 "step_one_thread": _one_thread(step)}
        if train is not None:
            def flash_step():
                q.grad = d.grad = None
                (train(q, d, shared_docs=True) * w).sum().backward()

            calls.update(flash_step=flash_step, flash_step_one_thread=_one_thread(flash_step))
        for call, fn in calls.items():
            # GPU time: 50 calls behind a sleep of 0.1 s, which outlasts their host time
            rows.append({"shape": name, "call": call, "wall_ms": wall_ms(torch, fn, 300),
                         "gpu_ms": per_call_ms(torch, fn, 50, spin_cycles=200_000_000)})
    path = write_result(out_dir(), "profile_train_step", device_properties(0), torch=torch.__version__, rows=rows)
    print(f"wrote {path}")
    print(f"{'shape':12s} {'call':16s} {'wall ms':>8s} {'gpu ms':>8s}")
    for r in rows:
        print(f"{r['shape']:12s} {r['call']:16s} {r['wall_ms']:8.4f} {r['gpu_ms']:8.4f}")


if __name__ == "__main__":
    main()
