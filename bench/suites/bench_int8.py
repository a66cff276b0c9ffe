"""INT8 scoring benchmark: speed against flash-maxsim's INT8xINT8 kernel and our fp16 path,
and ranking fidelity against exact float scores, side by side in one run on one GPU.

Speed (one query against B documents, torch CUDA events, device time):
  ours_int8      lik_cupy.maxsim_int8 on pre-quantised Q and D (quantize_int8)
  ours_int8_f16q the same with an fp16 Q, quantised on the device inside the call
  ours_fp16      lik_cupy.maxsim on the fp16 inputs
  flash_int8x8   flash_maxsim.flash_maxsim_int8x8 (0.3.0) on its own pre-quantised Q and D
Ratios are times (ours / other: below 1 is faster). TOPS counts 2 * Lq * Ld * d * B integer
ops; the ceiling is torch._int_mm (cuBLAS INT8 GEMM) measured in the same run.

Errors, each contender's result checked once before it is timed, on its first ``--check-docs``
documents (``checked_docs``: float64 MaxSim of all 10,000 ColPali pages, 2.7 PFLOP, would take about a
minute per set of inputs): ``max_rel_err``, the max over the scores of |score - exact| / |exact|, exact = float64
MaxSim of the inputs that contender scores, as it reads them (its INT8 values times its scales,
dequantised in float64, where they are exact; the fp16 inputs for ours_fp16): its own arithmetic's
error (bench_fp8.py's). A contender past ``bench.lib.results.WRONG_REL_ERR`` (1e-2) or with a NaN
score is listed in ``wrong`` and given no ratio. ``rel_l2_vs_fp16``: the relative L2 distance of its
scores from float64 MaxSim of the fp16 inputs before quantisation, what quantising costs the scores.
(Results before this carried ``rel_diff_vs_fp16``, the distance from our own fp16 path's scores.)

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
from bench.lib.reference import exact_query_scores, exact_scores, max_rel_err  # noqa: E402
from bench.lib.results import counts, slugify, write_json  # noqa: E402
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


def contenders(lk, q, d, flash_maxsim=None):
    """One cell's contenders on one query ``q [Lq, d]`` and documents ``d [B, Ld, d]`` (fp16): ``{name:
    call}``, and ``{name: the inputs it scores, as it reads them}``, ``(q, d)`` or ``(q8, d8, q_scales,
    d_scales)`` as :func:`bench.lib.reference.exact_query_scores` takes them."""
    q8, qs = lk.quantize_int8(q)
    d8, ds = lk.quantize_int8(d)
    calls = {"ours_int8": lambda: lk.maxsim_int8(q8, d8, ds, q_scales=qs),
             "ours_int8_f16q": lambda: lk.maxsim_int8(q, d8, ds),  # (q quantised by quantize_int8's quantiser)
             "ours_fp16": lambda: lk.maxsim(q, d)}
    inputs = {"ours_int8": (q8, d8, qs, ds), "ours_int8_f16q": (q8, d8, qs, ds), "ours_fp16": (q, d)}
    if flash_maxsim is not None:
        fd8, fds = flash_maxsim.quantize_int8_symmetric(d)  # int8 [B, Ld, d], float16 scales [B, Ld, 1]
        fq8, fqs = flash_maxsim.quantize_query_int8(q)  # int8 [Lq, d], float16 scales [Lq]
        calls["flash_int8x8"] = lambda: flash_maxsim.flash_maxsim_int8x8(q, fd8, fds, Q_int8=fq8, q_scales=fqs)
        inputs["flash_int8x8"] = (fq8, fd8, fqs, fds.squeeze(-1))  # (its values: int8 times scale)
    return calls, inputs


def checked(torch, out, inputs, before) -> tuple[float, float]:
    """(max_rel_err, rel_l2_vs_fp16) of a contender's scores ``out`` ([B], any dtype) on the first
    ``before.numel()`` documents: against float64 MaxSim of ``inputs`` (what it scores), and the relative
    L2 distance from ``before``, float64 MaxSim of the fp16 inputs."""
    n = before.numel()
    out = out.double().reshape(-1)[:n]
    q, d, *scales = inputs
    exact = exact_query_scores(torch, q, d[:n], *(scales[:1] + [s[:n] if s.dim() else s for s in scales[1:]]))
    return max_rel_err(out, exact), float((out - before).norm() / before.norm())


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
        impls, inputs = contenders(lk, q, d, flash_maxsim)
        n = min(b, args.check_docs)
        row = {"Lq": lq, "Ld": ld, "dim": dim, "B": b,
               "bytes_per_token": {"int8": dim + 4, "fp16": 2 * dim, "flash_int8": dim + 2}, "ms": {},
               "checked_docs": n, "max_rel_err": {}, "rel_l2_vs_fp16": {}}
        before = exact_query_scores(torch, q, d[:n])  # float64 of the fp16 inputs, before quantisation
        for impl, fn in impls.items():
            try:
                row["max_rel_err"][impl], row["rel_l2_vs_fp16"][impl] = checked(torch, fn(), inputs[impl], before)
                row["ms"][impl] = per_call_ms(torch, fn, args.reps, spin_cycles=20_000_000)
            except Exception as e:
                row["ms"][impl] = None
                row.setdefault("errors", {})[impl] = f"{type(e).__name__}: {str(e)[:200]}"
        ops = 2 * lq * ld * dim * b
        ms = {k: v for k, v in row["ms"].items() if counts(v, row["max_rel_err"].get(k, float("nan")))}
        row["wrong"] = sorted(k for k, v in row["ms"].items() if v and k not in ms)
        row["tops"] = {k: ops / v / 1e9 for k, v in ms.items()}
        row["frac_int8_ceiling"] = row["tops"].get("ours_int8", 0) / res["int8_ceiling_tops"]
        for a, o in (("ours_int8", "flash_int8x8"), ("ours_int8_f16q", "flash_int8x8"), ("ours_int8", "ours_fp16")):
            if a in ms and o in ms:  # (only contenders that count: timed, and not wrong)
                row[f"{a}_over_{o}"] = ms[a] / ms[o]
        del q, d, impls, inputs, before
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
             f"{'/flash':>6s} {'/fp16':>6s} {'TOPS':>6s} {'ceil':>5s} {'int8 err':>8s}  wrong  "
             f"fidelity (spearman / top-20)"]
    for name, r in res["shapes"].items():
        ms = r["ms"]
        err = r.get("max_rel_err", {}).get("ours_int8")  # (files before it: none)

        def f(k):
            return f"{ms[k]:8.3f}" if ms.get(k) else f"{'-':>8s}"

        fid = "  ".join(f"{k}: {v['spearman']:.4f}/{v['top20_overlap']:.2f}" for k, v in r.get("fidelity", {}).items())
        lines.append(f"{name:9s} {r['B']:6d} {f('ours_int8')} {f('ours_int8_f16q')} {f('ours_fp16')} {f('flash_int8x8')} "
                     f"{r.get('ours_int8_over_flash_int8x8', float('nan')):6.2f} "
                     f"{r.get('ours_int8_over_ours_fp16', float('nan')):6.2f} "
                     f"{r['tops'].get('ours_int8', 0):6.0f} {r['frac_int8_ceiling']:5.2f} "
                     f"{f'{err:8.1e}' if err is not None else '-':>8s}  {','.join(r.get('wrong', [])) or '-':5s}  {fid}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for int8_<gpu>.json")
    ap.add_argument("--shapes", default="colpali,long-doc,textual")
    ap.add_argument("--docs", type=int, default=10_000, help="documents B per timed call")
    ap.add_argument("--fidelity-docs", type=int, default=2000)
    ap.add_argument("--check-docs", type=int, default=1000,
                    help="documents of each timed call whose scores are checked against float64")
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
