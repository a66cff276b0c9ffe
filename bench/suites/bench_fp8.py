"""FP8 scoring benchmark: our FP8 e4m3 path against our fp16 path and late-interaction-kernels'
``maxsim_inference_fp8`` (0.4.5), side by side in one run on one GPU.

Cells (one query against B documents, device time by torch CUDA events; bench_int8.py's forward
cells, ColPali's pages at ~1,030 tokens):
  textual   Lq 32,   Ld 300,  d 128, B 10,000
  long-doc  Lq 32,   Ld 1024, d 128, B 10,000
  colpali   Lq 1024, Ld 1030, d 128, B 1,000 (0.27 TFLOP a call: at 10,000 pages, 2.7 TFLOP a
            call, the run did not finish this cell within a 170 s device command)
Implementations:
  ours_fp8      lik_cupy.maxsim_fp8, Q and D quantised per token beforehand (quantize_fp8)
  ours_fp16     lik_cupy.maxsim on the fp16 inputs
  lik_fp8_tok   late_interaction_kernels.maxsim_inference_fp8, its per-token quantisers
  lik_fp8_ten   the same with its per-tensor quantisers (one scale each for Q and D)
Ratios are times (ours / other: below 1 is faster); "best peer" is the faster right LIK form.

Errors, each contender's result checked once before it is timed: ``max_rel_err``, the max over the
scores of |score - exact| / |exact|, exact = float64 MaxSim of the inputs that contender scores, as
it reads them (its FP8 values times its scales, dequantised in float64, where they are exact; the
fp16 inputs for ours_fp16): its own arithmetic's error. A contender past
``bench.lib.results.WRONG_REL_ERR`` (1e-2) or with a NaN score is listed in ``wrong`` and given no
ratio. ``rel_l2_vs_fp16``: the relative L2 distance of its scores from float64 MaxSim of the fp16
inputs before quantisation, what quantising costs the scores.

    python bench/suites/bench_fp8.py            # JSON: $OUT (or bench/results)/fp8_<gpu>.json, after every cell
    python bench/suites/bench_fp8.py --table-from bench/results/fp8_nvidia-h200.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
from bench.lib import baselines  # noqa: E402
from bench.lib.reference import exact_query_scores as exact, max_rel_err  # noqa: E402
from bench.lib.results import counts, out_dir, text_table, write_result  # noqa: E402
from bench.lib.timing import per_call_ms  # noqa: E402

CELLS = {"textual": (32, 300, 128, 10_000), "long-doc": (32, 1024, 128, 10_000), "colpali": (1024, 1030, 128, 1_000)}
PEERS = ("lik_fp8_tok", "lik_fp8_ten")


def unit(torch, shape, gen):
    x = torch.randn(*shape, device="cuda", generator=gen)
    return (x / x.norm(dim=-1, keepdim=True)).half()


def run(args):
    import torch

    import lik_cupy as lk
    from lik_cupy._base.device import device_properties

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    props = device_properties(torch.cuda.current_device())
    lik, err = baselines.load(baselines.LIK)
    res = {"seed": args.seed, "docs": args.docs, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
           "late_interaction_kernels": getattr(lik, "__version__", "0.4.5") if lik else f"import failed: {err}",
           "complete": False, "cells": {}}
    t_end = time.time() + args.time_budget
    for name in args.cells.split(","):
        if time.time() > t_end:
            res["cells"][name] = {"skipped": f"past the {args.time_budget:.0f} s budget"}
            continue
        lq, ld, dim, docs = CELLS[name]
        docs = args.docs or docs
        q, d = unit(torch, (lq, dim), gen), unit(torch, (docs, ld, dim), gen)
        q8, qs = lk.quantize_fp8(q)
        d8, ds = lk.quantize_fp8(d)
        impls = {"ours_fp8": lambda: lk.maxsim_fp8(q8, d8, ds, q_scales=qs), "ours_fp16": lambda: lk.maxsim(q, d)}
        inputs = {"ours_fp8": (q8, d8, qs, ds), "ours_fp16": (q, d)}  # what each contender scores
        if lik is not None:
            f8 = importlib.import_module(lik.__name__ + ".fp8")  # LIK's FP8 API is not re-exported at its top
            lq8, lqs = f8.quantize_fp8_per_token(q)
            ld8, lds = f8.quantize_fp8_per_token(d)
            tq8, tqs = f8.quantize_fp8_per_tensor(q)
            td8, tds = f8.quantize_fp8_per_tensor(d)
            impls["lik_fp8_tok"] = lambda: f8.maxsim_inference_fp8(lq8, ld8, scale_Q=lqs, scale_D=lds)
            impls["lik_fp8_ten"] = lambda: f8.maxsim_inference_fp8(tq8, td8, scale_Q=tqs, scale_D=tds)
            # LIK reads its FP8 values back as X_fp8.to(float32) * scale (per token: scale[..., None])
            inputs.update(lik_fp8_tok=(lq8, ld8, lqs, lds), lik_fp8_ten=(tq8, td8, tqs, tds))
        cell = {"Lq": lq, "Ld": ld, "dim": dim, "B": docs, "ms": {}, "max_rel_err": {}, "rel_l2_vs_fp16": {}}
        before = exact(torch, q, d)  # float64 of the fp16 inputs, before quantisation
        for impl, fn in impls.items():
            try:
                out = fn().double().reshape(-1)
                cell["max_rel_err"][impl] = max_rel_err(out, exact(torch, *inputs[impl]))
                cell["rel_l2_vs_fp16"][impl] = float((out - before).norm() / before.norm())
                cell["ms"][impl] = per_call_ms(torch, fn, args.reps, spin_cycles=20_000_000)
            except Exception as e:  # noqa: BLE001  (a failing implementation is reported, not fatal)
                cell["ms"][impl] = None
                cell.setdefault("errors", {})[impl] = f"{type(e).__name__}: {str(e)[:200]}"
        ms = {k: v for k, v in cell["ms"].items() if counts(v, cell["max_rel_err"].get(k, float("nan")))}
        cell["wrong"] = sorted(k for k, v in cell["ms"].items() if v and k not in ms)
        peers = [ms[p] for p in PEERS if p in ms]
        if "ours_fp8" in ms:
            cell["tflops_fp8"] = 2 * lq * ld * dim * docs / ms["ours_fp8"] / 1e9
            if "ours_fp16" in ms:
                cell["ours_fp8_over_ours_fp16"] = ms["ours_fp8"] / ms["ours_fp16"]
            if peers:
                cell["ours_fp8_over_best_peer"] = ms["ours_fp8"] / min(peers)
        res["cells"][name] = cell
        write_result(out_dir(args.out), "fp8", props, **res)  # after every cell: a cut-off run keeps what it measured
        del q, d, q8, qs, d8, ds, impls, inputs, before
        torch.cuda.empty_cache()
        timed = [f"{k} {v:.3f} ms (err {cell['max_rel_err'][k]:.1e})" for k, v in cell["ms"].items() if v]
        wrong = f"; wrong: {', '.join(cell['wrong'])}" if cell["wrong"] else ""
        print(f"{name}: " + ", ".join(timed) + wrong, flush=True)
    res["complete"] = True
    return props, res


def table(res) -> str:
    head = ["cell", "B", "fp8 ms", "fp16 ms", "lik tok", "lik ten", "fp8/fp16", "fp8/peer", "TFLOPS", "wrong"]
    body, keys = [], []
    for name, c in res["cells"].items():
        if "ms" not in c:
            body.append([name, "-", c.get("skipped", "-"), "", "", "", "", "", "", ""])
            keys.append(name)
            continue
        ms = c["ms"]

        def f(k, fmt="{:.3f}"):
            v = ms.get(k) if k in ms else c.get(k)
            return fmt.format(v) if v else "-"

        body.append([name, c["B"], f("ours_fp8"), f("ours_fp16"), f("lik_fp8_tok"), f("lik_fp8_ten"),
                     f("ours_fp8_over_ours_fp16", "{:.2f}"), f("ours_fp8_over_best_peer", "{:.2f}"),
                     f("tflops_fp8", "{:.0f}"), ", ".join(c.get("wrong", [])) or "-"])
        keys.append(name)
    return "\n".join(text_table(head, body, keys))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for fp8_<gpu>.json (default $OUT, else bench/results)")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--docs", type=int, default=None, help="documents B per timed call (default: each cell's)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    ap.add_argument("--time-budget", type=float, default=120, help="cells not started after this many seconds are skipped")
    ap.add_argument("--table-from", default=None)
    args = ap.parse_args()
    if args.table_from:
        print(table(json.loads(Path(args.table_from).read_text())))
        return
    props, res = run(args)
    path = write_result(out_dir(args.out), "fp8", props, **res)
    print(f"wrote {path}")
    print(table(res))


if __name__ == "__main__":
    main()
