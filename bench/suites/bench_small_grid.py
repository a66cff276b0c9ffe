"""Few long documents (issue 30): kernel time of lik_cupy against late-interaction-kernels and
flash-maxsim where the grid is small, one run on one GPU.

Cells: B documents of Ld tokens against Nq queries of Lq tokens, d = 128, fp16, inputs on the GPU:
  padded     lik_cupy.maxsim(Q, D [B, Ld, d])
  packed     lik_cupy.maxsim_varlen(Q, tokens, offsets) (the same documents, unchecked offsets)
  lik        late_interaction_kernels.maxsim(Q, D)
  flash      flash_maxsim.flash_maxsim(Q, D)
With --dtype int8, ours score the documents and queries quantised once, outside the timed calls
(lik_cupy.quantize_int8; maxsim_int8 and maxsim_int8_varlen with q_scales), so that a cell times
the INT8 kernel alone; the peers stay float16 (they have no INT8 path here): the cells then
compare byte budgets, and --ab decides the INT8 split rule.
With --ab, the padded call twice more, A/B of the padded token split (bench/lib/forcing.padded_split):
  padded_split  split wherever the launch plan's grid rule allows, whatever Ld
  padded_whole  never split (whole documents, one CTA each)
Kernel time: back-to-back calls behind a spin kernel (host cost hidden; the other issue's). Each cell
records the configuration and grid lik_cupy chose. ``ratio`` = ours (padded) / the faster peer;
TFLOP/s counts 2 * Nq * Lq * Ld * d * B, and ``frac_cublas`` compares it with a cuBLAS fp16 GEMM
measured in the same run.

    python bench/suites/bench_small_grid.py --out bench/results     # JSON: small_grid_<gpu>.json
    python bench/suites/bench_small_grid.py --ab --queries 1 --out $OUT  # small_grid_ab_<gpu>.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib import baselines, forcing  # noqa: E402
from bench.lib.results import slugify, text_table, write_json  # noqa: E402
from bench.lib.timing import per_call_ms  # noqa: E402

os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")

BS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LQS = (32, 256, 1024)
LDS = (1024, 4096, 32768)
DIM = 128
MAX_WORK = 1 << 33  # Nq * Lq * Ld * B of the largest cell timed (2.2 TFLOP)


def _reps(ms_one: float) -> int:
    return max(3, min(50, int(20 / max(ms_one, 1e-3))))


def _cublas_tflops(torch):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    ms = per_call_ms(torch, lambda: a @ b, 10, spin_cycles=20_000_000)
    return 2 * 8192 ** 3 / ms / 1e9


def run_cell(torch, lk, mods, nq, lq, ld, b, gen, ab, dtype="float16"):
    q = torch.randn(nq, lq, DIM, device="cuda", generator=gen, dtype=torch.float16)
    d = torch.randn(b, ld, DIM, device="cuda", generator=gen, dtype=torch.float16)
    toks = d.reshape(-1, DIM)
    off = torch.arange(0, (b + 1) * ld, ld, device="cuda", dtype=torch.int64)
    q1 = q[0] if nq == 1 else q
    if dtype == "int8":
        d8, ds = lk.quantize_int8(d)
        q8, qs = lk.quantize_int8(q)
        t8, ts = d8.reshape(-1, DIM), ds.reshape(-1)
        impls = {"padded": lambda: lk.maxsim_int8(q8, d8, ds, q_scales=qs),
                 "packed": lambda: lk.maxsim_int8_varlen(q8, t8, ts, off, q_scales=qs, validate_offsets=False)}
    else:
        impls = {"padded": lambda: lk.maxsim(q, d),
                 "packed": lambda: lk.maxsim_varlen(q, toks, off, validate_offsets=False)}
    if ab:
        impls["padded_split"] = impls["padded_whole"] = impls["padded"]
    if mods.get("lik"):
        impls["lik"] = lambda: mods["lik"].maxsim(q, d)
    if mods.get("flash"):
        impls["flash"] = lambda: mods["flash"].flash_maxsim(q1, d)
    cell = {"case": f"{nq}x{lq} vs {b}x{ld}", "Nq": nq, "B": b, "Lq": lq, "Ld": ld, "dim": DIM, "dtype": dtype,
            "ms": {}, "errors": {}}
    ref = None
    ours = ("padded", "packed", "padded_split", "padded_whole")
    for name, fn in impls.items():
        split = {"padded_split": True, "padded_whole": False}.get(name)
        try:
            with forcing.padded_split(split) if split is not None else contextlib.nullcontext():
                if name in ours:
                    cell[f"{name}_config"], cell[f"{name}_grid"] = forcing.planned(fn)
                out = fn().float().reshape(nq, b)
                if ref is None:
                    ref = out
                elif name in ours:
                    cell[f"{name}_bitwise_padded"] = bool(torch.equal(out, ref))
                elif dtype == "int8":  # a float16 peer against INT8 scores: their agreement, for the record
                    cell[f"{name}_rel_diff"] = float((out - ref).abs().max() / ref.abs().max())
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                cell["ms"][name] = per_call_ms(torch, fn, _reps((time.perf_counter() - t0) * 1e3),
                                               spin_cycles=20_000_000)
        except Exception as e:  # noqa: BLE001  (a peer that cannot run a cell is reported)
            cell["errors"][name] = f"{type(e).__name__}: {str(e)[:200]}"
    ms = cell["ms"]
    peers = [ms[p] for p in ("lik", "flash") if p in ms]
    cell["ours_ms"] = ms.get("padded")
    cell["best_peer_ms"] = min(peers) if peers else None
    cell["ratio"] = cell["ours_ms"] / cell["best_peer_ms"] if peers and cell["ours_ms"] else None
    cell["tflops"] = 2 * nq * lq * ld * DIM * b / cell["ours_ms"] / 1e9 if cell["ours_ms"] else None
    return cell


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--queries", default="1,8", help="Nq values (each crossed with every Lq, Ld, B)")
    ap.add_argument("--lq", default=",".join(map(str, LQS)))
    ap.add_argument("--ld", default=",".join(map(str, LDS)))
    ap.add_argument("--b", default=",".join(map(str, BS)))
    ap.add_argument("--time-budget", type=float, default=400)
    ap.add_argument("--ab", action="store_true", help="also time the padded call forced split and forced whole")
    ap.add_argument("--dtype", default="float16", choices=("float16", "int8"), help="our documents' dtype")
    args = ap.parse_args()

    import torch

    import lik_cupy as lk

    gen = torch.Generator(device="cuda").manual_seed(30)
    mods = baselines.load_peers()
    cublas = _cublas_tflops(torch)
    print(f"cuBLAS fp16 {cublas:.0f} TFLOP/s", flush=True)
    t_end = time.time() + args.time_budget
    cells = []
    for nq in map(int, args.queries.split(",")):
        for ld in map(int, args.ld.split(",")):
            for lq in map(int, args.lq.split(",")):
                for b in map(int, args.b.split(",")):
                    if nq * lq * ld * b > MAX_WORK or time.time() > t_end:
                        continue
                    c = run_cell(torch, lk, mods, nq, lq, ld, b, gen, args.ab, args.dtype)
                    c["frac_cublas"] = c["tflops"] / cublas if c["tflops"] else None
                    cells.append(c)
                    torch.cuda.empty_cache()
                    print(c["case"], {k: round(v, 4) for k, v in c["ms"].items()},
                          f"ratio {c['ratio']:.2f}" if c["ratio"] else "", c.get("padded_config"),
                          c.get("padded_grid"), c["errors"] or "", flush=True)
    gpu = torch.cuda.get_device_name()
    if args.out:
        kind = ("_ab" if args.ab else "") + ("_int8" if args.dtype == "int8" else "")
        path = Path(args.out) / f"small_grid{kind}_{slugify(gpu)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"gpu": gpu, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "cublas_fp16_tflops": cublas,
                          "dtype": args.dtype, "cells": cells})
        print(f"wrote {path}")
    shown = ("padded", "packed") + (("padded_split", "padded_whole") if args.ab else ()) + ("lik", "flash")
    header = ["case", "ours", "packed"] + (["split", "whole"] if args.ab else []) + ["lik", "flash", "ratio", "TF/s",
                                                                                    "of cuBLAS"]
    body = [[c["case"]] + [f"{c['ms'][k]:.4f}" if k in c["ms"] else "-" for k in shown]
            + [f"{c['ratio']:.2f}" if c["ratio"] else "-", f"{c['tflops'] or 0:.0f}", f"{c['frac_cublas'] or 0:.2f}"]
            for c in cells]
    print("\n".join(text_table(header, body, [(c["Nq"], c["Ld"], c["Lq"]) for c in cells])))


if __name__ == "__main__":
    main()
