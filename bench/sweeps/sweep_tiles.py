"""Sweep the d=128 tile tables: time lik_cupy.maxsim for each candidate forced in turn,
one query against B documents: Hopper (wgmma) tiles (bn, stages) at Lq = 128, 512, 1024,
and the portable short-query tiles (warps, mt, bn, stages) at Lq = 32.

    python bench/sweep_tiles.py --out DIR      -> DIR/sweep_tiles_<gpu>.json + a table

The winning order becomes dispatch._WGMMA_BN_COST (and the stage counts in
dispatch._wgmma_tiles); the JSON is committed under bench/results/ as the
measurement behind it.
"""

import argparse
import contextlib
import json
import os

import cupy

import lik_cupy
from lik_cupy import dispatch
from bench_forward import slugify
from lik_cupy.device import device_properties
from timing import per_call_ms

CANDIDATES = [(64, 4), (64, 3), (128, 2), (128, 3)]
SHAPES = [(128, 1024, 1000), (512, 1024, 1000), (1024, 1024, 1000)]
# Short queries (one query, portable mma.sync tiles): (warps, mt, bn, stages).
SHORT_CANDIDATES = [(2, 1, 64, 3), (2, 1, 64, 4), (2, 1, 128, 3), (2, 1, 128, 2), (2, 1, 32, 4)]
SHORT_SHAPES = [(32, 300, 1000), (32, 1024, 1000)]


def time_ms(fn):
    """Device ms per call (a spin kernel queued first hides launch overhead; CuPy and torch
    share the legacy default stream)."""
    import torch

    return per_call_ms(torch, fn, 20, spin_cycles=20_000_000)


@contextlib.contextmanager
def forcing(cfg):
    """Inside the block, dispatch picks ``cfg`` for every forward call."""
    chosen = dispatch.choose_forward
    dispatch.choose_forward = lambda *a, **k: cfg
    try:
        yield
    finally:
        dispatch.choose_forward = chosen


def forced(cfg, fn):
    """Device ms per call of ``fn`` with ``cfg`` forced."""
    with forcing(cfg):
        return time_ms(fn)


def sweep_setup():
    """What every sweep starts from: the output directory (``--out``), this GPU's properties
    and a seeded CuPy generator."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    return args.out, device_properties(cupy.cuda.runtime.getDevice()), cupy.random.default_rng(0)


def write_sweep(out: str, name: str, props, rows: list) -> str:
    """Write ``out/<name>_<gpu>.json`` (GPU, compute capability, rows); returns its path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}_{slugify(props.name)}.json")
    with open(path, "w") as f:
        json.dump({"gpu": props.name, "cc": props.cc, "rows": rows}, f, indent=1)
    return path


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
                    cfg = dispatch.FwdConfig(0, 128, 8, 1, bn, stages, False, False, True, True)
                else:
                    w, mt, bn, stages = cand
                    cfg = dispatch.FwdConfig(0, 128, w, mt, bn, stages, dispatch._qreg(0, 128, mt), False, True)
                ms = forced(cfg, lambda: lik_cupy.maxsim(q, d))
                rows.append({"kind": kind, "lq": lq, "ld": ld, "B": b, "config": cfg.name, "bn": bn,
                             "stages": stages, "ms": ms, "tflops": flops / ms / 1e9,
                             "gbs": b * ld * 128 * 2 / ms / 1e6})
                print(f"{kind:5s} {lq}x{ld}@{b}  {cfg.name:50s} {ms:.4f} ms  {flops / ms / 1e9:6.1f} TF/s", flush=True)

    write_sweep(out, "sweep_tiles", props, rows)


if __name__ == "__main__":
    main()
