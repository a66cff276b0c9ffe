"""Sweep the Hopper (wgmma) tile table: time lik_cupy.maxsim for each candidate
(bn, stages) at the canonical shapes, one query against B documents, d=128.

    python bench/sweep_tiles.py --out DIR      -> DIR/sweep_tiles_<gpu>.json + a table

The winning order becomes dispatch._WGMMA_BN_COST (and the stage counts in
dispatch._wgmma_tiles); the JSON is committed under bench/results/ as the
measurement behind it.
"""

import argparse
import json
import os
import re

import cupy
import numpy as np

import lik_cupy
from lik_cupy import dispatch
from lik_cupy.device import device_properties

CANDIDATES = [(64, 4), (64, 3), (128, 2), (128, 3)]
SHAPES = [(128, 1024, 1000), (512, 1024, 1000), (1024, 1024, 1000)]


def time_ms(fn, reps=50):
    # Synchronous per call: includes host launch latency, so compare rows with each other only.
    fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    props = device_properties(cupy.cuda.runtime.getDevice())
    rows = []
    rng = cupy.random.default_rng(0)
    for lq, ld, b in SHAPES:
        q = rng.standard_normal((lq, 128), dtype=cupy.float32).astype(cupy.float16)
        d = rng.standard_normal((b, ld, 128), dtype=cupy.float32).astype(cupy.float16)
        flops = 2.0 * lq * ld * 128 * b
        for bn, stages in CANDIDATES:
            cfg = dispatch.FwdConfig(0, 128, 8, 1, bn, stages, False, False, True, True)
            chosen = dispatch.choose_forward
            dispatch.choose_forward = lambda *a, **k: cfg  # forced for this measurement
            try:
                ms = time_ms(lambda: lik_cupy.maxsim(q, d))
            finally:
                dispatch.choose_forward = chosen
            rows.append({"lq": lq, "ld": ld, "B": b, "bn": bn, "stages": stages, "ms": ms, "tflops": flops / ms / 1e9})
            print(f"{lq}x{ld}@{b}  bn={bn:3d} stages={stages}  {ms:.4f} ms  {flops / ms / 1e9:6.1f} TF/s", flush=True)
    slug = re.sub(r"[^a-z0-9]+", "-", props.name.lower()).strip("-")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"sweep_tiles_{slug}.json"), "w") as f:
        json.dump({"gpu": props.name, "cc": props.cc, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
