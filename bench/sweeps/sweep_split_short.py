"""Split-d tiles for one short query on Hopper: 64 or 32 query rows staged per stage.

    python bench/sweeps/sweep_split_short.py --out DIR   -> DIR/sweep_split_short_<gpu>.json + a table

One query of at most 32 tokens against wide documents (Ld=180, d = 768..4096) is memory-bound:
its time is the time to stream D. The one-warpgroup split-d tile stages a 64-row query chunk
with every document chunk; with ``qhalf`` it stages 32 rows (the wgmma's other 32 rows read
whatever follows into result rows that are never used), so a stage shrinks from 16 to 12 KB at
64 tokens x 64 dims and more stages or CTAs fit on an SM. Every candidate is forced in turn,
two rounds, next to flash-maxsim when it is installed; each candidate's scores are compared
bitwise with the dispatch pick's. The fastest rows back ``dispatch.tables.WGMMA_SPLIT_SHORT_QHALF``; the committed
H100 run is tests/data/sweep_split_short_nvidia-h100-80gb-hbm3.json.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402

from bench.lib import baselines  # noqa: E402
from bench.lib.forcing import forcing  # noqa: E402
from bench.lib.sweep import forced, sweep_setup, time_ms, write_sweep  # noqa: E402

# (bn, dim chunk, stages, qhalf)
CANDIDATES = [(64, 64, 6, False), (64, 64, 4, False), (64, 64, 4, True), (64, 64, 6, True), (64, 64, 8, True),
              (64, 128, 3, True), (64, 128, 4, True), (128, 64, 3, True)]
SHAPES = [(32, 180, 768, 1024), (32, 180, 1024, 1024), (32, 180, 2048, 1024), (32, 180, 4096, 512),
          (20, 180, 2048, 1024)]


def main():
    out, props, rng = sweep_setup()
    flash_maxsim, _ = baselines.load(baselines.FLASH)
    if flash_maxsim is not None:
        import torch
    rows = []
    for lq, ld, dim, b in SHAPES:
        q = rng.standard_normal((lq, dim), dtype=cupy.float32).astype(cupy.float16)
        d = rng.standard_normal((b, ld, dim), dtype=cupy.float32).astype(cupy.float16)
        gb = d.nbytes / 1e9
        want = lik_cupy.maxsim(q, d)
        picked = dispatch.choose_forward(props.cc, "float16", dim, lq, False, True, ld=ld, tma=True).name
        for rnd in range(2):
            if flash_maxsim is not None:
                tq, td = torch.as_tensor(q, device="cuda"), torch.as_tensor(d, device="cuda")
                ms = time_ms(lambda: flash_maxsim.flash_maxsim(tq, td))
                rows.append({"lq": lq, "ld": ld, "dim": dim, "B": b, "round": rnd, "config": "flash_maxsim",
                             "ms": ms, "gbs": gb / ms * 1e3})
                print(f"{lq}x{ld} d={dim} B={b} round {rnd}: flash-maxsim {ms:.4f} ms {gb / ms * 1e3:.0f} GB/s",
                      flush=True)
            ms = time_ms(lambda: lik_cupy.maxsim(q, d))
            rows.append({"lq": lq, "ld": ld, "dim": dim, "B": b, "round": rnd, "config": "dispatch", "picked": picked,
                         "ms": ms, "gbs": gb / ms * 1e3})
            print(f"  dispatch ({picked}) {ms:.4f} ms {gb / ms * 1e3:.0f} GB/s", flush=True)
            for bn, bk, stages, qhalf in CANDIDATES:
                cfg = dispatch.FwdConfig(elem=0, dp=bk, warps=4, mt=1, bn=bn, stages=stages, qreg=False, argmax=False,
                                         vec=True, wgmma=True, multi=False, packed=False, split=True, tma=False,
                                         qhalf=qhalf)
                ms = forced(cfg, lambda: lik_cupy.maxsim(q, d))
                with forcing(cfg):
                    same = bool(cupy.array_equal(lik_cupy.maxsim(q, d), want))
                rows.append({"lq": lq, "ld": ld, "dim": dim, "B": b, "round": rnd, "config": cfg.name, "ms": ms,
                             "gbs": gb / ms * 1e3, "ctas_per_sm": dispatch.ctas_per_sm(cfg, props.cc),
                             "bitwise_equal_to_dispatch": same})
                print(f"  {cfg.name:55s} {ms:.4f} ms {gb / ms * 1e3:5.0f} GB/s  "
                      f"{dispatch.ctas_per_sm(cfg, props.cc)} CTAs/SM  {'same bits' if same else 'DIFFERENT'}",
                      flush=True)
        d = want = None  # free before the next shape is allocated
    print(write_sweep(out, "sweep_split_short", props, rows))


if __name__ == "__main__":
    main()
