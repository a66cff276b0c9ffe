"""Short queries on Hopper: the portable mma.sync tiles against one- and two-warpgroup wgmma tiles.

    python bench/sweeps/sweep_short.py --out DIR      -> DIR/sweep_short_<gpu>.json + a table

One query of Lq <= 64 tokens against B documents is memory-bound: its time is the time to
stream D. For each shape the configuration dispatch picks is timed, then every candidate
forced in turn: portable tiles (warps, mt, bn, stages), and wgmma tiles of 4 warps (one
warpgroup, 64 query rows) or 8 warps (128 rows) with (bn, stages), each with TMA staging on
and off. Every candidate's scores are compared with the dispatch pick's (same sums, maybe in
another order: the JSON records the largest relative difference). The fastest rows back
``dispatch.tables.SHORT_WGMMA_COST``; the committed H200 run is tests/data/sweep_short_nvidia-h200.json
(tests/test_compile.py::test_short_query_tiles_match_the_committed_sweep).
"""

import concurrent.futures
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy  # noqa: E402
import numpy as np  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402
from lik_cupy._runtime import nvrtc as kcompile  # noqa: E402

from bench.lib.forcing import forcing, picked  # noqa: E402
from bench.lib.sweep import forced, sweep_setup, time_ms, write_sweep  # noqa: E402

PORTABLE = [(2, 1, 64, 4), (2, 1, 128, 2)]
WGMMA = [(4, 64, 3), (4, 64, 4), (4, 64, 6), (4, 96, 4), (4, 128, 2), (4, 128, 3), (4, 128, 4), (4, 256, 2),
         (8, 128, 2), (8, 128, 3), (8, 64, 4)]


def _cases(rng):
    def unit(*shape, dtype=cupy.float16):
        x = rng.standard_normal(shape, dtype=cupy.float32)
        return (x / cupy.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)

    for lq, ld, b in ((32, 300, 1000), (32, 1024, 1000), (64, 300, 1000), (64, 1024, 1000), (32, 180, 10000),
                      (32, 1024, 10000)):
        q, d = unit(lq, 128), unit(b, ld, 128)
        yield f"fp16 {lq}x{ld} B={b}", b * ld * 256, "float16", False, (lambda q=q, d=d: lik_cupy.maxsim(q, d))
    lens = np.random.default_rng(1).integers(16, 513, size=1000)
    off = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    toks, qr = unit(int(lens.sum()), 128), unit(32, 128)
    yield "fp16 ragged 1q x 1000 (16..512)", int(lens.sum()) * 256, "float16", True, (
        lambda: lik_cupy.maxsim_varlen(qr, toks, off, validate_offsets=False))
    q8, qs = lik_cupy.quantize_int8(unit(32, 128, dtype=cupy.float32))
    d8, ds = lik_cupy.quantize_int8(unit(10000, 1024, 128, dtype=cupy.float32))
    yield "int8 32x1024 B=10000", 10000 * 1024 * 132, "int8", False, (
        lambda: lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs))


def _candidates(elem: int, packed: bool) -> list:
    out = []
    for tma in (True, False):
        for warps, mt, bn, stages in PORTABLE:
            out.append(dispatch.FwdConfig(elem=elem, dp=128, warps=warps, mt=mt, bn=bn, stages=stages,
                                          qreg=dispatch.select._qreg(dispatch.elem_of_code(elem), 128, mt), argmax=False,
                                          vec=True, packed=packed, tma=tma))
        for warps, bn, stages in WGMMA:
            if dispatch.elem_of_code(elem).scaled and tma and bn == 256:
                continue  # a TMA box holds at most 256 scales
            out.append(dispatch.FwdConfig(elem=elem, dp=128, warps=warps, mt=1, bn=bn, stages=stages, qreg=False,
                                          argmax=False, vec=True, wgmma=True, packed=packed, tma=tma))
    return [c for c in out if c.smem_bytes <= 227 * 1024]


def main():
    out, props, rng = sweep_setup()
    # Build every candidate first, in parallel (NVRTC is single-threaded per kernel).
    cands = {(e, pk): _candidates(e, pk) for e, pk in ((0, False), (0, True), (3, False))}
    with concurrent.futures.ThreadPoolExecutor(max(1, (os.cpu_count() or 4) - 2)) as ex:
        list(ex.map(lambda c: kcompile.cubin_path("maxsim_fwd.cu", c.defines(), c.target(90)),
                    [c for cs in cands.values() for c in cs]))
    rows = []
    for name, nbytes, dtype, packed, fn in _cases(rng):
        pick = picked(fn)
        ref = cupy.asnumpy(fn()).astype(np.float64)
        base = time_ms(fn)
        row = {"case": name, "bytes": nbytes, "dispatch": {"config": pick.name, "ms": base,
                                                           "tb_s": nbytes / base / 1e9}, "tiles": []}
        print(f"{name:34s} dispatch {base:8.4f} ms {nbytes / base / 1e9:5.2f} TB/s  {pick.name}", flush=True)
        for c in cands[(dispatch.elem_spec(dtype).code, packed)]:
            try:
                ms = forced(c, fn)
                with forcing(c):
                    got = cupy.asnumpy(fn()).astype(np.float64)
            except Exception as e:  # a tile that does not build or launch is reported, not fatal
                row["tiles"].append({"config": c.name, "error": str(e)[:200]})
                continue
            rel = float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), 1e-6)))
            row["tiles"].append({"config": c.name, "warps": c.warps, "bn": c.bn, "stages": c.stages,
                                 "wgmma": c.wgmma, "tma": c.tma, "ms": ms, "tb_s": nbytes / ms / 1e9,
                                 "max_rel_diff_vs_dispatch": rel})
            print(f"    {c.name:58s} {ms:8.4f} ms {nbytes / ms / 1e9:5.2f} TB/s  rel {rel:.1e}", flush=True)
        best = min((t for t in row["tiles"] if "ms" in t), key=lambda t: t["ms"])
        print(f"  best {best['config']} {best['ms']:.4f} ms (dispatch x{base / best['ms']:.3f})", flush=True)
        rows.append(row)
    print("wrote", write_sweep(out, "sweep_short", props, rows))


if __name__ == "__main__":
    main()
