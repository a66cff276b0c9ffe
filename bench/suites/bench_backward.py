"""Training step (forward + backward) of in-batch MaxSim: ours against LIK and flash-maxsim.

Per case, one process, one GPU, the same inputs: Q [N, Lq, d] and D [N, Ld, d] (fp16,
unit-normalised tokens, requires_grad), step = scores [N, N] -> (scores * W).sum() ->
backward. Implementations:
  ours_atomic / ours_csr   lik_cupy.torch.maxsim(Q, D, method=...)
  lik                      late_interaction_kernels.maxsim(Q, D) (0.4.5, autograd)
  flash                    flash_maxsim.flash_maxsim_batched_train(Q, D) (0.3.0)
  naive                    torch einsum + amax + sum (fp16 autograd), where it fits
  <impl>_graph             the same step captured in one torch CUDA graph and replayed
                           (GRAPH_CASES only: the launch-bound ColBERT shape)
Reported: median step ms (CUDA events around back-to-back steps, host included: the
step is what a training loop pays), peak extra GPU memory over one step (CuPy allocates
through torch's allocator, so everything is counted), and dQ/dD error (``rel_err_dq``,
``rel_err_dd``: relative in the Frobenius norm) against the float64 gradients of the same
fp16 inputs (``bench.lib.reference.exact_grads``, chunked over documents: every case). A row
past ``bench.lib.results.WRONG_REL_ERR`` (1e-2) in either is marked ``wrong`` and takes no
part in the ratios.

    python bench/suites/bench_backward.py [--out DIR] [--cases colpali64,colbert32,colpali128]

Writes backward_<gpu>.json and prints a table (ratio = best baseline / ours, above 1
means ours is faster: against the best eager baseline, and against the best baseline
counting its graph-captured steps too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.gpu import setup_cupy  # noqa: E402
from bench.lib.reference import exact_grads  # noqa: E402
from bench.lib.results import WRONG_REL_ERR, out_dir, slugify, write_json  # noqa: E402
from bench.lib.timing import per_call_ms  # noqa: E402

CASES = {"colpali64": (64, 1024, 1024), "colbert32": (32, 32, 80), "colpali128": (128, 1024, 1024)}
D_MODEL = 128


def impls(torch):
    import lik_cupy.torch as lt

    out = {
        "ours_atomic": lambda q, d: lt.maxsim(q, d, method="atomic"),
        "ours_csr": lambda q, d: lt.maxsim(q, d, method="csr"),
    }
    likk, err = baselines.load(baselines.LIK)
    if likk is not None:
        out["lik"] = lambda q, d: likk.maxsim(q, d)
    else:
        print("lik unavailable:", err)
    flash, err = baselines.load(baselines.FLASH)
    train = getattr(flash, "flash_maxsim_batched_train", None)
    if train is not None:
        out["flash"] = lambda q, d: train(q, d, shared_docs=True)
    else:
        print("flash unavailable:", err or "no flash_maxsim_batched_train")
    out["naive"] = lambda q, d: torch.einsum("isk,jtk->ijst", q, d).amax(-1).float().sum(-1)
    return out


def step_fn(fn, q, d, w):
    """One training step: scores -> weighted sum -> backward."""
    def step():
        q.grad = d.grad = None
        (fn(q, d) * w).sum().backward()

    return step


# Cases whose step is launch-bound, where each implementation is also timed captured in a CUDA
# graph (impl name + "_graph"): one replay launches the whole step.
GRAPH_CASES = ("colbert32",)


def graphed(torch, fn, q, d, w):
    """The step captured in a torch CUDA graph (after a warm-up on a side stream, as torch's
    docs ask); returns the replay. The gradients land in q.grad and d.grad at every replay."""
    def body():
        (fn(q, d) * w).sum().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            q.grad = d.grad = None
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    q.grad = d.grad = None
    with torch.cuda.graph(graph):
        body()
    return graph.replay


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=str(out_dir()))
    ap.add_argument("--table-from", default=None)
    args = ap.parse_args(argv)
    if args.table_from:
        print(table(json.loads(Path(args.table_from).read_text())))
        return 0

    import torch

    class _Ctx:
        pass

    ctx = _Ctx()
    ctx.torch, ctx.cupy, ctx.cupy_err = torch, None, None
    setup_cupy(ctx)  # CuPy allocates through torch: one peak-memory counter for all
    from lik_cupy._base.device import device_properties

    props = device_properties(torch.cuda.current_device())
    slug = slugify(props.name)
    meta = {"gpu": props.name, "cc": props.cc, "rows": []}
    path = Path(args.out) / f"backward_{slug}.json"
    fns = impls(torch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases.split(","):
        n, lq, ld = CASES[case]
        q0 = torch.nn.functional.normalize(torch.randn(n, lq, D_MODEL, device="cuda", generator=gen), dim=-1).half()
        d0 = torch.nn.functional.normalize(torch.randn(n, ld, D_MODEL, device="cuda", generator=gen), dim=-1).half()
        w = torch.randn(n, n, device="cuda", generator=gen)
        naive_bytes = n * n * lq * ld * 2 * 3  # sim, its masked copy / grad, in fp16
        naive_fits = naive_bytes < 0.5 * torch.cuda.mem_get_info()[0]
        ref = exact_grads(torch, q0, d0, w)[:2]  # float64 dQ, dD
        torch.cuda.empty_cache()
        runs = list(fns.items())
        if case in GRAPH_CASES:
            runs += [(name + "_graph", fn) for name, fn in fns.items() if name != "ours_csr"]
        for name, fn in runs:
            row = {"case": case, "N": n, "lq": lq, "ld": ld, "d": D_MODEL, "impl": name}
            if name == "naive" and not naive_fits:
                row["error"] = f"skipped: the [N, N, Lq, Ld] tensor needs {naive_bytes / 2**30:.1f} GiB"
                meta["rows"].append(row)
                print(_line(row), flush=True)
                continue
            q, d = q0.clone().requires_grad_(True), d0.clone().requires_grad_(True)
            try:
                step = graphed(torch, fn, q, d, w) if name.endswith("_graph") else step_fn(fn, q, d, w)
                est = per_call_ms(torch, step, 2, rounds=1)
                ms = per_call_ms(torch, step, max(3, min(50, int(300 / max(est, 1e-3)))))
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                row.update(ms=ms, peak_extra_gb=(torch.cuda.max_memory_allocated() - base) / 1e9)
                if name == "ours_atomic":  # where the step's time goes
                    import lik_cupy

                    _, amax = lik_cupy.maxsim(q.detach(), d.detach(), return_argmax=True)
                    row["fwd_argmax_ms"] = per_call_ms(torch, lambda: lik_cupy.maxsim(
                        q.detach(), d.detach(), return_argmax=True), 10)
                    row["bwd_ms"] = per_call_ms(torch, lambda: lik_cupy.maxsim_backward(
                        w, q.detach(), d.detach(), amax, validate=False), 10)
                row["rel_err_dq"] = ((q.grad.double() - ref[0]).norm() / ref[0].norm()).item()
                row["rel_err_dd"] = ((d.grad.double() - ref[1]).norm() / ref[1].norm()).item()
                row["wrong"] = not (row["rel_err_dq"] <= WRONG_REL_ERR and row["rel_err_dd"] <= WRONG_REL_ERR)
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
            q = d = None
            torch.cuda.empty_cache()
            meta["rows"].append(row)
            print(_line(row), flush=True)
            write_json(path, meta)
        del q0, d0, ref
        torch.cuda.empty_cache()
    write_json(path, meta)
    print(table(meta))
    return 0


def _line(r):
    if "error" in r:
        return f"{r['case']:11s} {r['impl']:18s} {r['error'][:140]}"
    e = f" err dQ {r['rel_err_dq']:.1e} dD {r['rel_err_dd']:.1e}" if "rel_err_dq" in r else ""
    e += " WRONG" if r.get("wrong") else ""
    split = f" (forward+argmax {r['fwd_argmax_ms']:.3f}, backward {r['bwd_ms']:.3f})" if "bwd_ms" in r else ""
    return f"{r['case']:11s} {r['impl']:18s} {r['ms']:9.3f} ms  peak +{r['peak_extra_gb']:.3f} GB{e}{split}"


def table(meta):
    lines = [f"GPU {meta['gpu']}: forward + backward step, in-batch, d={D_MODEL}, fp16",
             f"{'case':14s} {'impl':18s} {'ms':>9s} {'peak GB':>8s} {'vs best eager':>17s} {'vs any (graphs)':>14s}"]
    by = {}
    for r in meta["rows"]:
        by.setdefault(r["case"], []).append(r)
    for case, rs in by.items():
        def best(names):  # (a row whose gradients are wrong against float64 is no baseline)
            ms = [r["ms"] for r in rs if r["impl"] in names and "ms" in r and not r.get("wrong")]
            return min(ms) if ms else None

        eager = best(("lik", "flash", "naive"))
        anyway = best(("lik", "flash", "naive", "lik_graph", "flash_graph", "naive_graph"))
        for r in rs:
            if "ms" not in r:
                lines.append(f"{case:14s} {r['impl']:18s} {'-':>9s} {'-':>8s}  {r['error'][:60]}")
                continue
            ours = r["impl"].startswith("ours") and not r.get("wrong")
            ratio = f"{eager / r['ms']:.2f}x" if eager and ours else ""
            ratio_any = f"{anyway / r['ms']:.2f}x" if anyway and ours and anyway != eager else ""
            lines.append(f"{case:14s} {r['impl']:18s} {r['ms']:9.3f} {r['peak_extra_gb']:8.3f} {ratio:>17s}"
                         f" {ratio_any:>14s}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
