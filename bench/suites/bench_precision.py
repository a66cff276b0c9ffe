"""float32 precision benchmark (issue 34): lik_cupy at precision "fp32" (3xTF32) and "tf32", float64
inputs, and our fp16 path, against the peers' float32 paths, side by side in one run on one GPU.

Per cell (d = 128 unless named), one query against B documents, inputs already on the GPU:
  ours_fp32     lik_cupy.maxsim(Q32, D32, precision="fp32")   float32 accuracy
  ours_tf32     lik_cupy.maxsim(Q32, D32, precision="tf32")
  ours_f64      lik_cupy.maxsim(Q64, D64)                      float64 in and out (fp32 path)
  ours_fp16     lik_cupy.maxsim(Q16, D16)                      the 16-bit inputs' own speed
  lik_f32       late_interaction_kernels.maxsim(Q32, D32)      Triton tl.dot on float32 (TF32)
  flash_f32     flash_maxsim.flash_maxsim(Q32, D32)            converts float32 tiles to fp16 as it loads them
Each gets kernel time (back-to-back calls behind a spin kernel: the GPU's time) and call time (the
same without the spin: a loop's wall time per call, host included), and its relative error
against float64 MaxSim of the float32 inputs (``err``). ``ratio`` = ours_fp32 / the faster peer
float32 path. TFLOP/s counts 2 * Lq * Ld * d * B.

    python bench/suites/bench_precision.py --out bench/results   # JSON: precision_<gpu>.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib import baselines  # noqa: E402
from bench.lib.reference import exact_scores  # noqa: E402
from bench.lib.results import slugify, text_table, write_json  # noqa: E402
from bench.lib.timing import per_call_ms  # noqa: E402

os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")

# name -> (Lq, Ld, B, d, kind): "compute" cells are tensor-core bound, "memory" ones HBM bound.
CELLS = {
    "colpali-16": (1024, 1024, 16, 128, "compute"),
    "colpali-256": (1024, 1024, 256, 128, "compute"),
    "colpali-1000": (1024, 1024, 1000, 128, "compute"),
    "text-1000": (32, 300, 1000, 128, "memory"),
    # 40,000 x 180 x 128 elements stay under 2^31: the peers index float32 elements in int32 (100,000
    # documents made one of them read out of bounds).
    "text-40k": (32, 180, 40_000, 128, "memory"),
    "wide-d1024": (32, 300, 2000, 1024, "memory"),
}
PEERS = ("lik_f32", "flash_f32")


def run_cell(torch, lk, mods, name, lq, ld, b, dim, reps, gen):
    q = torch.randn(lq, dim, device="cuda", generator=gen)
    d = torch.randn(b, ld, dim, device="cuda", generator=gen)
    q, d = q / q.norm(dim=-1, keepdim=True), d / d.norm(dim=-1, keepdim=True)
    exact = exact_scores(torch, q[None], d)[0]
    q16, d16 = q.half(), d.half()
    impls = {
        "ours_fp32": lambda: lk.maxsim(q, d, precision="fp32"),
        "ours_tf32": lambda: lk.maxsim(q, d, precision="tf32"),
        "ours_fp16": lambda: lk.maxsim(q16, d16),
    }
    if b * ld * dim * 8 <= 8 << 30:
        q64, d64 = q.double(), d.double()
        impls["ours_f64"] = lambda: lk.maxsim(q64, d64)
    if mods.get("lik"):
        impls["lik_f32"] = lambda: mods["lik"].maxsim(q, d)
    if mods.get("flash"):
        impls["flash_f32"] = lambda: mods["flash"].flash_maxsim(q, d)
    row = {"case": name, "Lq": lq, "Ld": ld, "B": b, "dim": dim, "kind": CELLS[name][4],
           "kernel_ms": {}, "call_ms": {}, "err": {}, "errors": {}}
    for impl, fn in impls.items():
        try:
            out = fn().double().reshape(-1)
            row["err"][impl] = float((out - exact).norm() / exact.norm())
            row["kernel_ms"][impl] = per_call_ms(torch, fn, reps, spin_cycles=20_000_000)
            row["call_ms"][impl] = per_call_ms(torch, fn, reps)
        except Exception as e:  # noqa: BLE001  (a peer that cannot run a cell is reported)
            row["errors"][impl] = f"{type(e).__name__}: {str(e)[:200]}"
    flops = 2 * lq * ld * dim * b
    row["tflops"] = {k: flops / v / 1e9 for k, v in row["kernel_ms"].items()}
    for fig in ("kernel_ms", "call_ms"):
        peers = [row[fig][p] for p in PEERS if p in row[fig]]
        if peers and "ours_fp32" in row[fig]:
            row[f"ratio_{fig[:-3]}"] = row[fig]["ours_fp32"] / min(peers)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    import torch

    import lik_cupy as lk

    gen = torch.Generator(device="cuda").manual_seed(34)
    mods = baselines.load_peers()
    cells = []
    for name in args.cells.split(","):
        lq, ld, b, dim, _ = CELLS[name]
        cells.append(run_cell(torch, lk, mods, name, lq, ld, b, dim, args.reps, gen))
        torch.cuda.empty_cache()
        c = cells[-1]
        print(name, {k: round(v, 4) for k, v in c["kernel_ms"].items()}, c.get("errors") or "", flush=True)
    gpu = torch.cuda.get_device_name()
    header = ["case", "fp32 ms", "tf32 ms", "f64 ms", "fp16 ms", "lik f32", "flash f32", "ratio", "call ratio",
              "fp32 TF/s", "err fp32", "err tf32", "err flash"]
    body = []
    for c in cells:
        k, e = c["kernel_ms"], c["err"]
        body.append([c["case"]] + [f"{k[i]:.4f}" if i in k else "-" for i in
                                   ("ours_fp32", "ours_tf32", "ours_f64", "ours_fp16", "lik_f32", "flash_f32")]
                    + [f"{c.get('ratio_kernel', float('nan')):.2f}", f"{c.get('ratio_call', float('nan')):.2f}",
                       f"{c['tflops'].get('ours_fp32', 0):.0f}"]
                    + [f"{e[i]:.1e}" if i in e else "-" for i in ("ours_fp32", "ours_tf32", "flash_f32")])
    if args.out:
        path = Path(args.out) / f"precision_{slugify(gpu)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"gpu": gpu, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
                          "lik_cupy_precision_default": "fp32", "cells": cells})
        print(f"wrote {path}")
    print("\n".join(text_table(header, body, [c["kind"] for c in cells])))


if __name__ == "__main__":
    main()
