"""One query against a ragged packed corpus: tile and grid choices, on one GPU.

The single-query ragged shape of ``bench_corpus.py`` (1,000 documents of 16..512 tokens, Lq=32,
d=128, fp16) reads 64 MiB in tens of microseconds, so how the tokens are split over CTAs and
how deep each CTA's ring is decide how close it gets to the HBM rate. This forces, in turn:

- the one-warpgroup Hopper tiles at 64 and 128 tokens and 2..6 stages (CTAs per SM follow from
  their shared memory), staged by cp.async or by TMA;
- CTAs over the tokens: the launch plan's count, and multiples of the resident CTAs;
- the portable mma.sync tiles;

each alternated over rounds with a sleep queued first (device time), with flash-maxsim's packed
kernel timed beside them, and checks that every variant gives the same scores bit for bit.

Writes ``sweep_ragged_single_<gpu>.json`` to $OUT (or bench/results) and prints a table last.

    python bench/sweeps/sweep_ragged_single.py
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402
from lik_cupy._base.device import device_properties  # noqa: E402

from bench.lib.baselines import packed_calls  # noqa: E402
from bench.lib.forcing import rebind  # noqa: E402
from bench.lib.results import out_dir, write_result  # noqa: E402
from bench.lib.timing import count_mismatches, per_call_ms  # noqa: E402

_plan, _tma = dispatch.plan_launch, dispatch.select._wgmma_tma
_stages, _cost = dict(dispatch.tables.SHORT_WGMMA_STAGES), {k: dict(v) for k, v in dispatch.tables.SHORT_WGMMA_COST.items()}


def force(tile=None, grid_y=None, portable=False, tma=False):
    """tile: (bn, stages) of the one-warpgroup Hopper tile, or None for dispatch's; grid_y: CTAs
    over the documents (int), a multiple of the resident CTAs ("2x"), or None for the plan's;
    tma: stage the documents by TMA."""
    rebind(dispatch.select, "_wgmma_tma", (lambda *a: True) if tma else _tma)
    stages, cost = dict(_stages), {k: dict(v) for k, v in _cost.items()}
    if tile is not None:
        bn, st = tile
        stages, cost = {bn: (st,)}, {dtype: {bn: 1.0} for dtype in _cost}
    rebind(dispatch.tables, "SHORT_WGMMA_STAGES", stages)
    rebind(dispatch.tables, "SHORT_WGMMA_COST", cost)
    dispatch.clear_caches()
    os.environ["LIK_DISABLE_WGMMA"] = "1" if portable else ""

    def plan(cfg, cc, num_sms, nq, nd, lq, shared=1, ntok=0):
        p = _plan(cfg, cc, num_sms, nq, nd, lq, shared, ntok)
        if grid_y is None:
            return p
        gy = grid_y if isinstance(grid_y, int) else int(float(grid_y[:-1]) * num_sms * dispatch.ctas_per_sm(cfg, cc))
        gy = max(1, min(gy, nd))
        return dispatch.Launch(n_qt=p.n_qt, qb=p.qb, docs_per_cta=-(-nd // gy), grid=(p.grid[0], gy, 1))

    rebind(dispatch, "plan_launch", plan)


def variants():
    out = [("plan", {})]
    for tile in ((64, 2), (64, 3), (64, 4), (64, 5), (64, 6), (128, 2), (128, 3)):
        out.append((f"bn{tile[0]} s{tile[1]}", {"tile": tile}))
    for tile in ((64, 4), (64, 5), (128, 2)):
        out.append((f"bn{tile[0]} s{tile[1]} TMA", {"tile": tile, "tma": True}))
    for gy in ("0.5x", "2x", "4x", "8x", 1000):
        out.append((f"plan tile, grid.y {gy}", {"grid_y": gy}))
    for tile in ((64, 3), (64, 5)):
        for gy in ("2x", "4x"):
            out.append((f"bn{tile[0]} s{tile[1]}, grid.y {gy}", {"tile": tile, "grid_y": gy}))
    out.append(("portable mma.sync", {"portable": True}))
    return out


def main():
    out = out_dir()
    props = device_properties(0)
    rng = np.random.default_rng(303)
    nd, lq, d = 1000, 32, 128
    lens = rng.integers(16, 513, size=nd)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(off[-1])
    q = cp.asarray(rng.standard_normal((1, lq, d), dtype=np.float32).astype(np.float16))
    n_sets = 6  # distinct corpora in turn, so no call finds D in L2
    toks = [cp.asarray(rng.standard_normal((T, d), dtype=np.float32).astype(np.float16)) for _ in range(n_sets)]
    off_d = cp.asarray(off)
    nbytes = T * d * 2
    ours, flash = packed_calls(torch, q, toks, off_d)

    vs = variants()
    mismatches = count_mismatches(cp, vs, lambda v: force(**v[1]),
                                  lambda: lik_cupy.maxsim_varlen(q, toks[0], off_d, validate_offsets=False),
                                  lambda v: v[0])
    try:
        flash()
        have_flash = True
    except Exception as e:  # noqa: BLE001
        print(f"flash-maxsim not timed: {e}", flush=True)
        have_flash = False
    times = {name: [] for name, _ in vs}
    times["flash-maxsim packed"] = []
    for _ in range(5):
        for name, kw in vs:
            force(**kw)
            times[name].append(per_call_ms(torch, ours, 60, rounds=1, spin_cycles=50_000_000))
        if have_flash:
            times["flash-maxsim packed"].append(per_call_ms(torch, flash, 60, rounds=1, spin_cycles=50_000_000))
    force()
    rows = []
    fl = float(np.median(times["flash-maxsim packed"])) if have_flash else None
    for name, ts in times.items():
        if not ts:
            continue
        ms = float(np.median(ts))
        rows.append({"variant": name, "ms": ms, "runs": ts, "gbs": nbytes / ms / 1e6,
                     "flash_over_this": (fl / ms) if fl else None})
    write_result(out, "sweep_ragged_single", props, case=f"1 q x {lq} vs {nd} packed docs 16..512, d {d} fp16",
                 tokens=T, rows=rows, mismatches=mismatches)
    print(f"\n{'variant':34s} {'ms':>8s} {'GB/s':>7s} {'flash/this':>10s}")
    for r in rows:
        f = f"{r['flash_over_this']:.3f}" if r["flash_over_this"] else "-"
        print(f"{r['variant']:34s} {r['ms']:8.4f} {r['gbs']:7.0f} {f:>10s}")
    print(f"score mismatches: {mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
