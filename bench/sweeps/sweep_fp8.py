"""Sweep the FP8 (e4m3) tiles on Hopper: time lik_cupy.maxsim_fp8 with each candidate (tokens per
tile, stages) forced in turn on bench_fp8.py's cells, beside the tile dispatch picks, our fp16
dispatch and late-interaction-kernels' per-token FP8 (``maxsim_inference_fp8``) in the same run.

    python bench/sweeps/sweep_fp8.py --out DIR      -> DIR/sweep_fp8_<gpu>.json + a table

Each candidate is the dispatched configuration with its tile's tokens and stages replaced, so it keeps
the rest of what dispatch picks for the cell (warps, TMA). FP8 takes INT8's tile rows
(``tables.SHORT_WGMMA_COST``); this sweep measured them (tests/data/sweep_fp8_nvidia-h200.json: the
picks within 1% of the best candidate in each cell).
"""

import dataclasses
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402

from bench.lib import baselines  # noqa: E402
from bench.lib.sweep import forced, sweep_setup, time_ms, write_sweep  # noqa: E402

# (Lq, Ld, B): bench_fp8.py's textual, long-doc and ColPali cells
SHAPES = [(32, 300, 10_000), (32, 1024, 10_000), (1024, 1030, 1_000)]
CANDIDATES = [(64, 3), (64, 4), (128, 2), (128, 3), (128, 4), (256, 2), (256, 3)]


def main():
    import torch

    out, props, rng = sweep_setup()
    lik, _ = baselines.load(baselines.LIK)
    f8 = importlib.import_module(lik.__name__ + ".fp8") if lik is not None else None
    rows = []
    for lq, ld, b in SHAPES:
        q = rng.standard_normal((lq, 128), dtype=cupy.float32)
        d = rng.standard_normal((b, ld, 128), dtype=cupy.float32)
        q /= cupy.linalg.norm(q, axis=-1, keepdims=True)
        d /= cupy.linalg.norm(d, axis=-1, keepdims=True)
        q8, qs = lik_cupy.quantize_fp8(q)
        d8, ds = lik_cupy.quantize_fp8(d)
        q16, d16 = q.astype(cupy.float16), d.astype(cupy.float16)
        del d
        flops = 2.0 * lq * ld * 128 * b
        cell = {"lq": lq, "ld": ld, "B": b}
        timed = {"fp16-dispatch": lambda: lik_cupy.maxsim(q16, d16),
                 "fp8-dispatch": lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs)}
        if f8 is not None:
            tq, td = torch.as_tensor(q16, device="cuda"), torch.as_tensor(d16, device="cuda")
            lq8, lqs = f8.quantize_fp8_per_token(tq)
            ld8, lds = f8.quantize_fp8_per_token(td)
            timed["lik-fp8-token"] = lambda: f8.maxsim_inference_fp8(lq8, ld8, scale_Q=lqs, scale_D=lds)
        for name, fn in timed.items():
            ms = time_ms(fn)
            rows.append({**cell, "config": name, "ms": ms, "tflops": flops / ms / 1e9})
            print(f"{lq}x{ld}@{b}  {name:55s} {ms:.4f} ms", flush=True)
        base = dispatch.choose_forward(props.cc, "float8_e4m3fn", 128, lq, False, True, True, 1, ld, False, True)
        for bn, stages in CANDIDATES:
            if base.tma and bn + 4 > 256:  # a TMA box carries at most 256 scales (fwd/config.cuh)
                continue
            cfg = dataclasses.replace(base, bn=bn, stages=stages)
            try:
                ms = forced(cfg, lambda: lik_cupy.maxsim_fp8(q8, d8, ds, q_scales=qs))
            except Exception as e:  # noqa: BLE001  (a candidate that fails to build or launch is reported)
                print(f"  {cfg.name:55s} failed: {str(e)[:200]}", flush=True)
                continue
            rows.append({**cell, "config": cfg.name, "ms": ms, "tflops": flops / ms / 1e9})
            print(f"  {cfg.name:55s} {ms:.4f} ms  {flops / ms / 1e9:7.1f} TFLOPS", flush=True)
        write_sweep(out, "sweep_fp8", props, rows)  # after every cell: a cut-off run keeps what it measured


if __name__ == "__main__":
    main()
