"""TMA against cp.async staging of the Hopper forward tiles, side by side in one process.

    python bench/sweeps/sweep_tma.py --out DIR      -> DIR/sweep_tma_<gpu>.json + a table

For each shape: the configuration dispatch picks, timed with document tiles staged by TMA
(tensor maps) and by per-thread cp.async (LIK_DISABLE_TMA=1), then a few forced
Hopper tile shapes with TMA. Scores of the two staging paths must agree bit for bit (same
arithmetic in the same order); the JSON records the largest difference seen.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy  # noqa: E402
import numpy as np  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402

from bench.lib.forcing import picked  # noqa: E402
from bench.lib.sweep import forced, sweep_setup, time_ms, write_sweep  # noqa: E402

TILES = [(128, 2), (128, 3), (128, 4), (64, 3), (64, 4), (96, 3), (256, 3)]  # Hopper (bn, stages)
PORTABLE = [(2, 1, 64, 4), (2, 1, 64, 6), (2, 1, 128, 3), (2, 1, 128, 4), (2, 1, 256, 2), (2, 1, 32, 8)]


def _cases(rng):
    def unit(*shape, dtype=cupy.float16):
        x = rng.standard_normal(shape, dtype=cupy.float32)
        return (x / cupy.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)

    for lq, ld, b in ((1024, 1024, 1000), (512, 1024, 1000), (128, 1024, 1000), (32, 1024, 1000), (32, 300, 1000)):
        q, d = unit(lq, 128), unit(b, ld, 128)
        yield f"fp16 {lq}x{ld} B={b}", 2.0 * lq * ld * 128 * b, (lambda q=q, d=d: lik_cupy.maxsim(q, d)), True
    q, d = unit(1024, 128), unit(1000, 1024, 128)
    yield "fp16 1024x1024 B=1000 argmax", 2.0 * 1024 * 1024 * 128 * 1000, (
        lambda: lik_cupy.maxsim(q, d, return_argmax=True)[0]), False
    for nd in (1024, 20000):
        qm, dm = unit(32, 32, 128), unit(nd, 180, 128)
        yield f"fp16 32q x 32 vs {nd} x 180", 2.0 * 32 * 32 * 180 * 128 * nd, (
            lambda qm=qm, dm=dm: lik_cupy.maxsim(qm, dm)), True
    lens = np.random.default_rng(1).integers(16, 513, size=1000)
    off = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    toks = unit(int(lens.sum()), 128)
    qr = unit(32, 32, 128)
    yield "fp16 ragged 32q x 1000 (16..512)", 2.0 * 32 * 32 * 128 * float(lens.sum()), (
        lambda: lik_cupy.maxsim_varlen(qr, toks, off)), False
    q8, qs = lik_cupy.quantize_int8(unit(1024, 128, dtype=cupy.float32))
    d8, ds = lik_cupy.quantize_int8(unit(2000, 1024, 128, dtype=cupy.float32))
    yield "int8 1024x1024 B=2000", 2.0 * 1024 * 1024 * 128 * 2000, (
        lambda: lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs)), False
    del d8, ds
    q8, qs = lik_cupy.quantize_int8(unit(32, 128, dtype=cupy.float32))
    d8, ds = lik_cupy.quantize_int8(unit(10000, 1024, 128, dtype=cupy.float32))
    yield "int8 32x1024 B=10000", 2.0 * 32 * 1024 * 128 * 10000, (
        lambda: lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs)), False


def main():
    out, props, rng = sweep_setup()
    rows = []
    for name, ops, fn, sweep in _cases(rng):
        os.environ["LIK_DISABLE_TMA"] = "1"
        base_cfg = picked(fn)
        ref = cupy.asnumpy(fn())
        off_ms = time_ms(fn)
        os.environ["LIK_DISABLE_TMA"] = ""
        cfg = picked(fn)
        got = cupy.asnumpy(fn())
        on_ms = time_ms(fn)
        diff = float(np.nanmax(np.abs(got - ref))) if got.size else 0.0
        same_nan = bool(np.array_equal(np.isnan(got), np.isnan(ref)))
        row = {"case": name, "cp_async": {"config": base_cfg.name, "ms": off_ms},
               "tma": {"config": cfg.name, "ms": on_ms}, "max_abs_diff": diff, "nan_pattern_equal": same_nan,
               "speedup": off_ms / on_ms, "tops_tma": ops / on_ms / 1e9}
        print(f"{name:36s} cp.async {off_ms:8.4f} ms  tma {on_ms:8.4f} ms  x{off_ms / on_ms:5.3f}  "
              f"diff {diff:.1e}  {cfg.name}", flush=True)
        if sweep and cfg.tma:
            row["tiles"] = []
            cands = ([(8, 1, bn, st) for bn, st in TILES] if cfg.wgmma else PORTABLE)
            for warps, mt, bn, stages in cands:
                c = dispatch.FwdConfig(elem=cfg.elem, dp=cfg.dp, warps=warps, mt=mt, bn=bn, stages=stages,
                                       qreg=cfg.qreg, argmax=cfg.argmax, vec=cfg.vec, wgmma=cfg.wgmma,
                                       multi=cfg.multi, packed=cfg.packed, tma=True)
                if c.smem_bytes > 227 * 1024:
                    continue
                try:
                    ms = forced(c, fn)
                except Exception as e:  # a tile that does not build or launch is reported, not fatal
                    row["tiles"].append({"config": c.name, "error": str(e)[:200]})
                    continue
                row["tiles"].append({"config": c.name, "warps": warps, "bn": bn, "stages": stages, "ms": ms})
                print(f"    {c.name:60s} {ms:8.4f} ms", flush=True)
        rows.append(row)
    os.environ.pop("LIK_DISABLE_TMA", None)
    print("wrote", write_sweep(out, "sweep_tma", props, rows))


if __name__ == "__main__":
    main()
