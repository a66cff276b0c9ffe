"""Tile sweep of the float32 wgmma forward (TF32, and TF32 refined to float32 accuracy) on Hopper.

For each cell, every one-shot wgmma tile shape that fits (warpgroups, document tokens per stage,
stages, TMA or cp.async staging) is timed with the configuration forced, at precision "tf32" and
"fp32" (refined), with the same inputs; the kernels are compiled in parallel first. Device time per
call (back-to-back calls behind a spin kernel). The JSON backs the float32 rows of
``lik_cupy/_dispatch/tables.py``.

    python bench/sweeps/sweep_fp32_wgmma.py --out DIR      # fp32_wgmma_sweep_<gpu>.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.lib.forcing import forcing  # noqa: E402
from bench.lib.results import slugify, text_table, write_json  # noqa: E402
from bench.lib.timing import per_call_ms  # noqa: E402

# name -> (Nq, Lq, Nd, Ld, packed): d = 128, unit vectors
CELLS = {
    "1q32x1000x300": (1, 32, 1000, 300, False),
    "32q32x1000x180": (32, 32, 1000, 180, False),
    "colpali-1x1000": (1, 1024, 1000, 1024, False),
    "colpali-1x16": (1, 1024, 16, 1024, False),
    "1q32x1000x300-packed": (1, 32, 1000, 300, True),
    "1q32x1000x1024": (1, 32, 1000, 1024, False),
    "1q128x1000x1024": (1, 128, 1000, 1024, False),
}


def _variants(base):
    """One-shot wgmma tiles around dispatch's choice: both warpgroup counts, 64/96/128-token
    stages, 2-6 stages, TMA or not, that fit the shared memory of an sm_90 block."""
    from lik_cupy._dispatch.config import SMEM_PER_BLOCK

    out = {}
    for warps in (4, 8):
        for bn in (64, 96, 128):
            for stages in (2, 3, 4, 5, 6):
                for tma in (False, True):
                    c = replace(base, warps=warps, bn=bn, stages=stages, tma=tma)
                    if c.multi and 2 * 32 > c.bm:
                        continue
                    if c.smem_bytes <= SMEM_PER_BLOCK[90]:
                        out[c.name] = c
    return list(out.values())


def _compile(cfg):
    from lik_cupy._runtime.nvrtc import cubin_path

    t = time.time()
    try:
        cubin_path("maxsim_fwd.cu", cfg.defines(), cfg.target(90))
        return cfg.name, None, time.time() - t
    except Exception as e:  # noqa: BLE001 - reported per configuration
        return cfg.name, str(e)[-2000:], time.time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--tf32-only", action="store_true", help="TF32 tiles alone (not the refined ones)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--time-budget", type=float, default=420)
    args = ap.parse_args()
    t0 = time.time()
    import torch

    import lik_cupy
    from lik_cupy._dispatch import choose_forward

    gpu = torch.cuda.get_device_name()
    cells, jobs = {}, {}
    for name in args.cells.split(","):
        nq, lq, nd, ld, packed = CELLS[name]
        for x3 in (False,) if args.tf32_only else (False, True):
            base = choose_forward(90, "float32", 128, lq, False, True, True, nq, ld, packed, True, x3)
            vs = _variants(base)
            cells[(name, x3)] = (base, vs)
            jobs.update((c.name, c) for c in vs)
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
        failed = {n: err for n, err, _ in ex.map(_compile, jobs.values()) if err}
    print(f"compiled {len(jobs)} kernels in {time.time() - t0:.0f} s, {len(failed)} failed", flush=True)
    for n, err in list(failed.items())[:3]:
        print("COMPILE FAILED", n, err, flush=True)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for (name, x3), (base, vs) in cells.items():
        if time.time() - t0 > args.time_budget:
            print("time budget spent; skipping", name, flush=True)
            continue
        nq, lq, nd, ld, packed = CELLS[name]
        q = torch.nn.functional.normalize(torch.randn(nq, lq, 128, device="cuda", generator=g), dim=-1)
        d = torch.nn.functional.normalize(torch.randn(nd, ld, 128, device="cuda", generator=g), dim=-1)
        prec = "fp32" if x3 else "tf32"
        if packed:
            off = torch.arange(0, (nd + 1) * ld, ld, device="cuda", dtype=torch.int64)
            tok = d.reshape(-1, 128)
            call = lambda: lik_cupy.maxsim_varlen(q, tok, off, precision=prec)  # noqa: E731
        else:
            call = lambda: lik_cupy.maxsim(q, d, precision=prec)  # noqa: E731
        ref = call()
        times = {}
        for c in vs:
            if c.name in failed:
                continue
            with forcing(c):
                try:
                    out = call()
                    err = float((out - ref).abs().max())
                    times[c.name] = (per_call_ms(torch, call, args.reps, spin_cycles=20_000_000), err)
                except Exception as e:  # noqa: BLE001
                    times[c.name] = (None, str(e)[:200])
        best = min((t for t in times.items() if t[1][0] is not None), key=lambda t: t[1][0])
        rows.append({"case": name, "precision": prec, "dispatch": base.name,
                     "dispatch_ms": times.get(base.name, (None,))[0], "best": best[0], "best_ms": best[1][0],
                     "tiles": [{"config": k, "ms": v[0], "max_diff": v[1]} for k, v in sorted(times.items())]})
        print(name, prec, "dispatch", base.name, times.get(base.name), "best", best, flush=True)
        del q, d
        torch.cuda.empty_cache()
    path = Path(args.out) / f"fp32_wgmma_sweep_{slugify(gpu)}.json"
    write_json(path, {"gpu": gpu, "rows": rows, "compile_failed": failed})
    print("\n".join(text_table(["case", "precision", "dispatch_ms", "best_ms", "best"],
                               [[r["case"], r["precision"], r["dispatch_ms"], r["best_ms"], r["best"]] for r in rows],
                               ["case", "precision", "dispatch_ms", "best_ms", "best"])))


if __name__ == "__main__":
    main()
