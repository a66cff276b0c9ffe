"""INT8 scoring benchmark: speed against flash-maxsim's INT8xINT8 kernel and our fp16 path,
and ranking fidelity against exact float scores, side by side in one run on one GPU.

Speed (one query against B documents, torch CUDA events, device time):
  ours_int8      lik_cupy.maxsim_int8 on pre-quantised Q and D (quantize_int8)
  ours_int8_f16q the same with an fp16 Q, quantised on the device inside the call
  ours_fp16      lik_cupy.maxsim on the fp16 inputs
  flash_int8x8   flash_maxsim.flash_maxsim_int8x8 (0.3.0) on its own pre-quantised Q and D
Ratios are times (ours / other: below 1 is faster). TOPS counts 2 * Lq * Ld * d * B integer
ops; the ceiling is torch._int_mm (cuBLAS INT8 GEMM) measured in the same run.

Fidelity (per shape, 8 queries, fresh inputs): Spearman rank correlation of the INT8 scores
with float64 scores of the float inputs, and top-20 overlap, averaged over queries, for
unit-normalised random tokens and clustered tokens (64 centres, spread 0.1, and the
harder 16 centres, spread 0.05).

    python bench/suites/bench_int8.py --out bench/results      # JSON: int8_<gpu>.json
    python bench/suites/bench_int8.py --shapes wide-1024,wide-2048,wide-4096 --docs 500 --out bench/results/wide
    python bench/suites/bench_int8.py --table-from bench/results/latest/int8_nvidia-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.reference import exact_scores  # noqa: E402
from bench.lib.results import slugify, write_json  # noqa: E402
from bench.lib.timing import per_call_ms  # noqa: E402

SHAPES = {"colpali": (1024, 1024, 128), "long-doc": (32, 1024, 128), "textual": (32, 300, 128),
          # wide embeddings run split-d (dim chunks accumulated in int32); time them with --docs 500
          "wide-1024": (1024, 1024, 1024), "wide-2048": (1024, 1024, 2048), "wide-4096": (1024, 512, 4096)}
FIDELITY_KINDS = {"unit": None, "clustered-64-0.1": (64, 0.1), "clustered-16-0.05": (16, 0.05)}


def embeddings(torch, shape, kind, gen):
    """Unit-normalised float32 tokens on the GPU: random, or crowded around a few centres."""
    x = torch.randn(*shape, device="cuda", generator=gen)
    if FIDELITY_KINDS[kind] is not None:
        centres, spread = FIDELITY_KINDS[kind]
        c = torch.randn(centres, shape[-1], device="cuda", generator=gen)
        idx = torch.randint(0, centres, shape[:-1], device="cuda", generator=gen)
        x = c[idx] + spread * x
    return x / x.norm(dim=-1, keepdim=True)


def spearman_rows(torch, a, b):
    ra = a.argsort(dim=1).argsort(dim=1).double()
    rb = b.argsort(dim=1).argsort(dim=1).double()
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    return (ra * rb).sum(1) / (ra.norm(dim=1) * rb.norm(dim=1))


def fidelity(torch, lk, lq, ld, dim, nd, kind, gen):
    q = embeddings(torch, (8, lq, dim), kind, gen)
    d = embeddings(torch, (nd, ld, dim), kind, gen)
    exact = exact_scores(torch, q, d, chunk=32)
    d8, ds = lk.quantize_int8(d)
    got = lk.maxsim_int8(q, d8, ds).double()
    rho = spearman_rows(torch, got, exact)
    top = [len(set(got[i].topk(20).indices.tolist()) & set(exact[i].topk(20).indices.tolist())) / 20
           for i in range(q.shape[0])]
    return {"docs": nd, "queries": q.shape[0], "spearman": float(rho.mean()), "spearman_min": float(rho.min()),
            "top20_overlap": float(np.mean(top)), "top20_overlap_min": float(np.min(top)),
            "meets_bar": bool(rho.mean() >= 0.999 and np.mean(top) >= 0.95)}


def int8_ceiling(torch):
    a = torch.randint(-127, 128, (8192, 8192), device="cuda", dtype=torch.int8)
    b = torch.randint(-127, 128, (8192, 8192), device="cuda", dtype=torch.int8).t()
    ms = per_call_ms(torch, lambda: torch._int_mm(a, b), 10)
    return 2 * 8192**3 / ms / 1e9


def run(args):
    import torch

    import lik_cupy as lk

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    gpu = torch.cuda.get_device_name()
    res = {"gpu": gpu, "torch": torch.__version__, "python": platform.python_version(), "seed": args.seed,
           "when": time.strftime("%Y-%m-%d %H:%M:%S"), "shapes": {}}
    flash_maxsim, err = baselines.load(baselines.FLASH)  # a missing baseline is reported, not fatal
    res["flash_maxsim"] = getattr(flash_maxsim, "__version__", "0.3.0") if flash_maxsim else f"import failed: {err}"
    res["int8_ceiling_tops"] = int8_ceiling(torch)
    print(f"{gpu}: cuBLAS INT8 GEMM {res['int8_ceiling_tops']:.0f} TOPS", flush=True)
    t_end = time.time() + args.time_budget
    for name in args.shapes.split(","):
        lq, ld, dim = SHAPES[name]
        b = args.docs
        q = embeddings(torch, (lq, dim), "unit", gen).half()
        d = embeddings(torch, (b, ld, dim), "unit", gen).half()
        q8, qs = lk.quantize_int8(q)
        d8, ds = lk.quantize_int8(d)
        impls = {
            "ours_int8": lambda: lk.maxsim_int8(q8, d8, ds, q_scales=qs),
            "ours_int8_f16q": lambda: lk.maxsim_int8(q, d8, ds),
            "ours_fp16": lambda: lk.maxsim(q, d),
        }
        if flash_maxsim is not None:
            fd8, fds = flash_maxsim.quantize_int8_symmetric(d)
            fq8, fqs = flash_maxsim.quantize_query_int8(q)
            impls["flash_int8x8"] = lambda: flash_maxsim.flash_maxsim_int8x8(q, fd8, fds, Q_int8=fq8, q_scales=fqs)
        row = {"Lq": lq, "Ld": ld, "dim": dim, "B": b,
               "bytes_per_token": {"int8": dim + 4, "fp16": 2 * dim, "flash_int8": dim + 2}, "ms": {}}
        ref = lk.maxsim(q, d).double()
        for impl, fn in impls.items():
            try:
                out = fn().double()
                row.setdefault("rel_diff_vs_fp16", {})[impl] = float((out - ref).norm() / ref.norm())
                row["ms"][impl] = per_call_ms(torch, fn, args.reps, spin_cycles=20_000_000)
            except Exception as e:
                row["ms"][impl] = None
                row.setdefault("errors", {})[impl] = f"{type(e).__name__}: {str(e)[:200]}"
        ops = 2 * lq * ld * dim * b
        ms = row["ms"]
        row["tops"] = {k: ops / v / 1e9 for k, v in ms.items() if v}
        row["frac_int8_ceiling"] = row["tops"].get("ours_int8", 0) / res["int8_ceiling_tops"]
        if ms.get("ours_int8") and ms.get("flash_int8x8"):
            row["ours_int8_over_flash_int8x8"] = ms["ours_int8"] / ms["flash_int8x8"]
            row["ours_int8_f16q_over_flash_int8x8"] = ms["ours_int8_f16q"] / ms["flash_int8x8"]
        if ms.get("ours_int8") and ms.get("ours_fp16"):
            row["ours_int8_over_ours_fp16"] = ms["ours_int8"] / ms["ours_fp16"]
        del q, d, q8, qs, d8, ds, impls
        torch.cuda.empty_cache()
        row["fidelity"] = {}
        for kind in FIDELITY_KINDS:
            if time.time() > t_end:
                break
            row["fidelity"][kind] = fidelity(torch, lk, lq, ld, dim, args.fidelity_docs, kind, gen)
        torch.cuda.empty_cache()
        res["shapes"][name] = row
        print(table({"shapes": {name: row}}), flush=True)
    return res


def table(res) -> str:
    lines = [f"{'shape':9s} {'B':>6s} {'int8 ms':>8s} {'f16q ms':>8s} {'fp16 ms':>8s} {'flash8':>8s} "
             f"{'/flash':>6s} {'/fp16':>6s} {'TOPS':>6s} {'ceil':>5s}  fidelity (spearman / top-20)"]
    for name, r in res["shapes"].items():
        ms = r["ms"]

        def f(k):
            return f"{ms[k]:8.3f}" if ms.get(k) else f"{'-':>8s}"

        fid = "  ".join(f"{k}: {v['spearman']:.4f}/{v['top20_overlap']:.2f}" for k, v in r.get("fidelity", {}).items())
        lines.append(f"{name:9s} {r['B']:6d} {f('ours_int8')} {f('ours_int8_f16q')} {f('ours_fp16')} {f('flash_int8x8')} "
                     f"{r.get('ours_int8_over_flash_int8x8', float('nan')):6.2f} "
                     f"{r.get('ours_int8_over_ours_fp16', float('nan')):6.2f} "
                     f"{r['tops'].get('ours_int8', 0):6.0f} {r['frac_int8_ceiling']:5.2f}  {fid}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for int8_<gpu>.json")
    ap.add_argument("--shapes", default="colpali,long-doc,textual")
    ap.add_argument("--docs", type=int, default=10_000, help="documents B per timed call")
    ap.add_argument("--fidelity-docs", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    ap.add_argument("--time-budget", type=float, default=240, help="fidelity runs stop after this many seconds")
    ap.add_argument("--table-from", default=None)
    args = ap.parse_args()
    if args.table_from:
        print(table(json.loads(Path(args.table_from).read_text())))
        return
    res = run(args)
    if args.out:
        path = Path(args.out) / f"int8_{slugify(res['gpu'])}.json"
        write_json(path, res)
        print(f"wrote {path}")
    print(table(res))


if __name__ == "__main__":
    main()
