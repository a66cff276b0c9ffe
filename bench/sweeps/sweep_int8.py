"""Sweep the INT8 tiles: time lik_cupy.maxsim_int8 for each candidate configuration forced in
turn (one query, pre-quantised Q and D, d = 128), next to the fp16 kernel dispatch picks.

    python bench/sweeps/sweep_int8.py --out DIR      -> DIR/sweep_int8_<gpu>.json + a table

Hopper candidates are (bn, stages); the portable ones (warps, mt, bn, stages). The winners
become the INT8 choices of lik_cupy's dispatch; the JSON is committed under bench/results/archive/ as
the measurement behind them.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402

from bench.lib.sweep import forced, sweep_setup, time_ms, write_sweep  # noqa: E402

WGMMA = [(128, 2), (128, 3), (128, 4), (64, 3), (64, 4), (256, 2), (256, 3)]
PORTABLE = [(2, 1, 64, 4), (2, 1, 128, 3), (4, 1, 64, 3), (4, 2, 64, 3)]
SHAPES = [(1024, 1024, 2000, WGMMA), (512, 1024, 2000, WGMMA), (32, 1024, 10000, PORTABLE), (32, 300, 10000, PORTABLE)]


def main():
    out, props, rng = sweep_setup()
    rows = []
    for lq, ld, b, cands in SHAPES:
        q = rng.standard_normal((lq, 128), dtype=cupy.float32)
        d = rng.standard_normal((b, ld, 128), dtype=cupy.float32)
        q8, qs = lik_cupy.quantize_int8(q)
        d8, ds = lik_cupy.quantize_int8(d)
        q16, d16 = q.astype(cupy.float16), d.astype(cupy.float16)
        del d
        ops = 2.0 * lq * ld * 128 * b
        fp16 = time_ms(lambda: lik_cupy.maxsim(q16, d16))
        auto = time_ms(lambda: lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs))
        print(f"{lq}x{ld}@{b}  fp16 (dispatch) {fp16:.4f} ms   int8 (dispatch) {auto:.4f} ms", flush=True)
        rows.append({"lq": lq, "ld": ld, "B": b, "config": "fp16-dispatch", "ms": fp16})
        rows.append({"lq": lq, "ld": ld, "B": b, "config": "int8-dispatch", "ms": auto})
        for cand in cands:
            if len(cand) == 2:
                bn, stages = cand
                cfg = dispatch.FwdConfig(elem=3, dp=128, warps=8, mt=1, bn=bn, stages=stages, qreg=False, argmax=False,
                                         vec=True, wgmma=True)
            else:
                w, mt, bn, stages = cand
                cfg = dispatch.FwdConfig(elem=3, dp=128, warps=w, mt=mt, bn=bn, stages=stages,
                                         qreg=dispatch.select._qreg(dispatch.elem_spec("int8"), 128, mt), argmax=False, vec=True)
            try:
                ms = forced(cfg, lambda: lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs))
            except Exception as e:  # a candidate that fails to build or launch is reported
                print(f"  {cfg.name:55s} failed: {str(e)[:200]}", flush=True)
                continue
            rows.append({"lq": lq, "ld": ld, "B": b, "config": cfg.name, "ms": ms, "tops": ops / ms / 1e9,
                         "vs_fp16": ms / fp16})
            print(f"  {cfg.name:55s} {ms:.4f} ms  {ops / ms / 1e9:7.1f} TOPS  {ms / fp16:5.2f} x fp16", flush=True)
    write_sweep(out, "sweep_int8", props, rows)


if __name__ == "__main__":
    main()
