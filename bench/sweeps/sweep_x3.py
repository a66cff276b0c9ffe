"""3xTF32 tiles (precision "fp32"): the portable fp32 tiles dispatch picks for TF32 against wider ones.

    python bench/sweeps/sweep_x3.py --out DIR      -> DIR/sweep_x3_<gpu>.json + a table

A 3xTF32 tile splits every staged element into two TF32 parts in the tile loop: each warp splits
the whole document tile for its own rows, so tiles with more query rows per warp (mt = 2) split
it once for twice the MMAs. For each shape (d = 128, one query against B documents) the
configuration dispatch picks is timed, then every candidate (warps, mt, bn, stages) forced in
turn; each candidate's scores must equal the pick's up to float32 rounding (the JSON records the
largest relative difference). The fastest rows back ``dispatch.tables.X3_TABLE``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402

from bench.lib.forcing import forcing, picked  # noqa: E402
from bench.lib.sweep import forced, sweep_setup, write_sweep  # noqa: E402

# (warps, mt, bn, stages)
CANDIDATES = [(2, 1, 64, 3), (4, 1, 64, 3), (1, 2, 64, 3), (2, 2, 64, 3), (4, 2, 64, 3), (2, 2, 32, 3),
              (4, 2, 32, 3), (2, 2, 128, 2), (4, 2, 128, 2), (2, 4, 64, 2), (4, 1, 128, 2), (8, 1, 64, 3)]
SHAPES = ((32, 300, 5000), (32, 1024, 1000), (128, 1024, 300), (1024, 1024, 100))


def main():
    out, props, rng = sweep_setup()
    rows = []
    for lq, ld, b in SHAPES:
        q = rng.standard_normal((lq, 128), dtype=cupy.float32)
        d = rng.standard_normal((b, ld, 128), dtype=cupy.float32)

        def call(q=q, d=d):
            return lik_cupy.maxsim(q, d, precision="fp32")

        base_cfg = picked(call)
        ref = call()
        flops = 2 * lq * ld * 128 * b
        row = {"Lq": lq, "Ld": ld, "B": b, "picked": base_cfg.name, "picked_ms": forced(base_cfg, call), "tiles": []}
        for warps, mt, bn, stages in CANDIDATES:
            if warps * mt * 16 > max(lq, 32) * 2:
                continue
            cfg = dispatch.FwdConfig(elem=2, dp=128, warps=warps, mt=mt, bn=bn, stages=stages, qreg=False,
                                     argmax=False, vec=True, x3=True)
            if cfg.smem_bytes > dispatch.SMEM_PER_BLOCK.get(props.cc, 99 * 1024):
                continue
            try:
                with forcing(cfg):
                    got = call()
                diff = float(cupy.abs(got - ref).max() / cupy.abs(ref).max())
                ms = forced(cfg, call)
                row["tiles"].append({"warps": warps, "mt": mt, "bn": bn, "stages": stages, "ms": ms,
                                     "tflops": flops / ms / 1e9, "rel_diff": diff})
            except Exception as e:  # noqa: BLE001  (a tile that fails to build or launch is recorded)
                row["tiles"].append({"warps": warps, "mt": mt, "bn": bn, "stages": stages,
                                     "error": f"{type(e).__name__}: {str(e)[:160]}"})
        best = min((t for t in row["tiles"] if "ms" in t), key=lambda t: t["ms"])
        print(f"{lq}x{ld} B={b}: picked {row['picked']} {row['picked_ms']:.4f} ms; best "
              f"w{best['warps']}m{best['mt']} n{best['bn']}s{best['stages']} {best['ms']:.4f} ms "
              f"({best['tflops']:.0f} TF/s)", flush=True)
        rows.append(row)
    print("wrote", write_sweep(out, "sweep_x3", props, rows))


if __name__ == "__main__":
    main()
