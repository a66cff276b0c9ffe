"""Sweep the d=128 tile tables: time lik_cupy.maxsim for each candidate forced in turn,
one query against B documents: Hopper (wgmma) tiles (bn, stages) at Lq = 128, 512, 1024,
and the portable short-query tiles (warps, mt, bn, stages) at Lq = 32.

    python bench/sweeps/sweep_tiles.py --out DIR      -> DIR/sweep_tiles_<gpu>.json + a table

The winning order becomes lik_cupy/_dispatch/tables.py's WGMMA_BN_COST (and the stage counts in
lik_cupy/_dispatch/select.py's _wgmma_tiles); the JSON is committed under bench/results/archive/ as the
measurement behind it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402

from bench.lib.sweep import forced, sweep_setup, write_sweep  # noqa: E402

CANDIDATES = [(64, 4), (64, 3), (128, 2), (128, 3)]
SHAPES = [(128, 1024, 1000), (512, 1024, 1000), (1024, 1024, 1000)]
# Short queries (one query, portable mma.sync tiles): (warps, mt, bn, stages).
SHORT_CANDIDATES = [(2, 1, 64, 3), (2, 1, 64, 4), (2, 1, 128, 3), (2, 1, 128, 2), (2, 1, 32, 4)]
SHORT_SHAPES = [(32, 300, 1000), (32, 1024, 1000)]


def main():
    out, props, rng = sweep_setup()
    rows = []
    for kind, shapes, cands in (("wgmma", SHAPES, CANDIDATES), ("short", SHORT_SHAPES, SHORT_CANDIDATES)):
        for lq, ld, b in shapes:
            q = rng.standard_normal((lq, 128), dtype=cupy.float32).astype(cupy.float16)
            d = rng.standard_normal((b, ld, 128), dtype=cupy.float32).astype(cupy.float16)
            flops = 2.0 * lq * ld * 128 * b
            for cand in cands:
                if kind == "wgmma":
                    bn, stages = cand
                    cfg = dispatch.FwdConfig(elem=0, dp=128, warps=8, mt=1, bn=bn, stages=stages, qreg=False,
                                             argmax=False, vec=True, wgmma=True)
                else:
                    w, mt, bn, stages = cand
                    cfg = dispatch.FwdConfig(elem=0, dp=128, warps=w, mt=mt, bn=bn, stages=stages,
                                             qreg=dispatch.select._qreg(dispatch.elem_spec("float16"), 128, mt),
                                             argmax=False, vec=True)
                ms = forced(cfg, lambda: lik_cupy.maxsim(q, d))
                rows.append({"kind": kind, "lq": lq, "ld": ld, "B": b, "config": cfg.name, "bn": bn,
                             "stages": stages, "ms": ms, "tflops": flops / ms / 1e9,
                             "gbs": b * ld * 128 * 2 / ms / 1e6})
                print(f"{kind:5s} {lq}x{ld}@{b}  {cfg.name:50s} {ms:.4f} ms  {flops / ms / 1e9:6.1f} TF/s", flush=True)

    write_sweep(out, "sweep_tiles", props, rows)


if __name__ == "__main__":
    main()
