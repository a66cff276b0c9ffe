"""Sweep the INT8 tokens-on-M tiles against the standard INT8 tiles: time lik_cupy.maxsim_int8
with each configuration forced in turn (one query, pre-quantised Q and D, d = 128, TMA staging),
next to the fp16 kernel dispatch picks.

    python bench/sweeps/sweep_int8_tokm.py --out DIR      -> DIR/sweep_int8_tokm_<gpu>.json + a table

The H100 JSON is committed as tests/data/sweep_int8_tokm_nvidia-h100-80gb-hbm3.json, the measurement behind
lik_cupy's dispatch _TOKM_MIN_LD and _TOKM_STAGES (a CPU test in tests/test_compile.py reads it).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402

from bench.lib.sweep import forced, sweep_setup, time_ms, write_sweep  # noqa: E402

# (bn, stages) of the standard two-warpgroup INT8 tile, and stages of the tokens-on-M one.
STANDARD = [(128, 2), (64, 3)]
TOKM_STAGES = [2, 3, 4, 5]
SHAPES = [(1024, 1024, 2000), (1024, 768, 2500), (1024, 512, 4000), (1024, 300, 6000), (1024, 180, 10000),
          (128, 1024, 10000), (100, 1024, 10000), (256, 1024, 5000), (512, 600, 5000)]


def main():
    out, props, rng = sweep_setup()
    rows = []
    for lq, ld, b in SHAPES:
        q = rng.standard_normal((lq, 128), dtype=cupy.float32)
        d = rng.standard_normal((b, ld, 128), dtype=cupy.float32)
        q8, qs = lik_cupy.quantize_int8(q)
        d8, ds = lik_cupy.quantize_int8(d)
        d16 = d.astype(cupy.float16)
        del d
        ops = 2.0 * lq * ld * 128 * b
        fp16 = time_ms(lambda: lik_cupy.maxsim(q.astype(cupy.float16), d16))
        d16 = None  # rebound, not deleted: the timed lambda closes over the name
        print(f"{lq}x{ld}@{b}  fp16 (dispatch) {fp16:.4f} ms", flush=True)
        rows.append({"lq": lq, "ld": ld, "B": b, "config": "fp16-dispatch", "ms": fp16})
        tile = dict(elem=3, dp=128, warps=8, mt=1, qreg=False, argmax=False, vec=True, wgmma=True, tma=True)
        cands = [dispatch.FwdConfig(**tile, bn=bn, stages=st) for bn, st in STANDARD]
        cands += [dispatch.FwdConfig(**tile, bn=128, stages=st, tokm=True) for st in TOKM_STAGES]
        for cfg in cands:
            try:
                ms = forced(cfg, lambda: lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs))
            except Exception as e:  # a candidate that fails to build or launch is reported
                print(f"  {cfg.name:55s} failed: {str(e)[:200]}", flush=True)
                continue
            rows.append({"lq": lq, "ld": ld, "B": b, "config": cfg.name, "tokm": cfg.tokm, "ms": ms,
                         "tops": ops / ms / 1e9, "vs_fp16": ms / fp16})
            print(f"  {cfg.name:55s} {ms:.4f} ms  {ops / ms / 1e9:7.1f} TOPS  {ms / fp16:5.2f} x fp16", flush=True)
        q8 = d8 = ds = None
        cupy.get_default_memory_pool().free_all_blocks()
    write_sweep(out, "sweep_int8_tokm", props, rows)


if __name__ == "__main__":
    main()
