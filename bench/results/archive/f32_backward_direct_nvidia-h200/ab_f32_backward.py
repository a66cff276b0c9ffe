"""A/B of float32 backwards accumulating in dD itself (lik_cupy/_runtime/prepared_calls.py and backward.py)
against the float32 copy, cleared, summed into and cast back (as before), in one process on one GPU: eager
in-batch training steps (fp32 Q and D, cross entropy, backward) through lik_cupy.torch, default precision and
"tf32", the two ways alternating round by round. Wall ms per step (200 eager steps back to back, host included)
and GPU ms per step (the step captured in a CUDA graph, 200 replays between CUDA events), medians and bests of the
rounds; the gradients compared (dQ bitwise).

    python ab_f32_backward.py OUT.json
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import lik_cupy.torch as lt  # noqa: E402
from lik_cupy._runtime import prepared_calls as pc  # noqa: E402
from lik_cupy._runtime.raw_launch import launch_raw  # noqa: E402

new_call = pc.PreparedBackward.__call__


def old_call(self, g, Q, D, argmax, d_offsets):  # the float32 copy, for every dtype
    import cupy

    a, dev = self.a, self.device
    stream = a.stream_handle(dev)
    nq, nd, lq, ld, dim, cand, rows = self.dims
    dq = a.new_empty(self.q_shape, self.dtype, dev)
    dd = a.new_empty(self.d_shape, self.dtype, dev)
    dd32 = a.new_empty((rows * dim,), "float32", dev)
    dd32_ptr = a.address(dd32)
    cupy.cuda.runtime.memsetAsync(dd32_ptr, 0, rows * dim * 4, stream)
    launch_raw(self.dq, self.dq_grid, self.threads, 0, stream, pc._DQ_PARAMS,
               (a.address(Q), a.address(D), a.address(g), a.address(argmax),
                0 if d_offsets is None else a.address(d_offsets), a.address(dq), dd32_ptr,
                nq, nd, lq, ld, dim, cand, rows))
    launch_raw(self.cast, self.cast_grid, self.threads, 0, stream, pc._CAST_PARAMS,
               (dd32_ptr, a.address(dd), rows * dim))
    return dq, dd


calls = {"copy_and_cast": 0, "direct": 0}


def counted(way, fn):
    def call(*a):
        calls[way] += 1
        return fn(*a)
    return call


WAYS = {"copy_and_cast": counted("copy_and_cast", old_call), "direct": counted("direct", new_call)}
CELLS = [(32, 32, 80), (64, 32, 300), (128, 32, 300)]
ROUNDS = 11
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": ROUNDS, "rows": []}
gen = torch.Generator(device="cuda").manual_seed(0)


def rounds_of(fns: dict, run) -> dict:
    """run(fn) -> ms, ROUNDS times each, the ways alternating in a rotating order."""
    times = {w: [] for w in fns}
    for r in range(ROUNDS):
        for w in (list(fns) if r % 2 else list(fns)[::-1]):
            pc.PreparedBackward.__call__ = WAYS[w]
            times[w].append(run(fns[w]))
    return times


for n, lq, ld in CELLS:
    for precision in (None, "tf32"):
        q = F.normalize(torch.randn(n, lq, 128, device="cuda", generator=gen), dim=-1).requires_grad_()
        d = F.normalize(torch.randn(n, ld, 128, device="cuda", generator=gen), dim=-1).requires_grad_()
        labels = torch.arange(n, device="cuda")

        def step():
            q.grad = d.grad = None
            F.cross_entropy(lt.maxsim(q, d, precision=precision) / 0.05, labels).backward()

        grads, graphs = {}, {}
        for w, fn in WAYS.items():
            pc.PreparedBackward.__call__ = fn
            for _ in range(20):
                step()
            grads[w] = (q.grad.clone(), d.grad.clone())
            # GPU time alone: the whole step captured once, replayed (no host work on a replay)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            q.grad = d.grad = None
            with torch.cuda.graph(g):
                F.cross_entropy(lt.maxsim(q, d, precision=precision) / 0.05, labels).backward()
            graphs[w] = g

        def wall(fn):  # eager steps back to back, host included
            for _ in range(10):
                step()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                step()
            torch.cuda.synchronize()
            return (time.perf_counter() - t) / 200 * 1e3

        def replay(g):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.replay()
            e0.record()
            for _ in range(200):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            return e0.elapsed_time(e1) / 200

        walls = rounds_of({w: None for w in WAYS}, wall)
        gpus = rounds_of(graphs, replay)
        # dQ rows are summed in a fixed order; dD by atomics, whose order varies: compared within rounding
        same_dq = bool(torch.equal(grads["direct"][0], grads["copy_and_cast"][0]))
        dd_diff = float((grads["direct"][1] - grads["copy_and_cast"][1]).abs().max())
        row = {"n": n, "lq": lq, "ld": ld, "precision": precision or "default", "dq_bitwise": same_dq,
               "dd_max_abs_diff": dd_diff}
        for w in WAYS:
            row[w] = {"wall_median": float(np.median(walls[w])), "wall_best": float(np.min(walls[w])),
                      "gpu_median": float(np.median(gpus[w])), "gpu_best": float(np.min(gpus[w])),
                      "wall": walls[w], "gpu": gpus[w]}
        row["direct_over_copy_wall"] = row["direct"]["wall_median"] / row["copy_and_cast"]["wall_median"]
        row["direct_over_copy_gpu"] = row["direct"]["gpu_median"] / row["copy_and_cast"]["gpu_median"]
        out["rows"].append(row)
        c, t = row["copy_and_cast"], row["direct"]
        print(f"N={n} ({lq}x{ld}) {row['precision']:7s} wall {c['wall_median']:.4f} -> {t['wall_median']:.4f} ms "
              f"(x{row['direct_over_copy_wall']:.3f}; best {c['wall_best']:.4f} -> {t['wall_best']:.4f}); "
              f"gpu {c['gpu_median']:.4f} -> {t['gpu_median']:.4f} (x{row['direct_over_copy_gpu']:.3f}); "
              f"dQ bitwise {same_dq}, dD diff {dd_diff:.2e}", flush=True)
pc.PreparedBackward.__call__ = new_call
out["prepared_calls"] = calls  # the steps' backwards that took the repeat path, each way
print("prepared backward calls", calls)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
