"""Sweep the Hopper document-tile width (BN) for short queries packed several to a tile.

Backs ``dispatch.tables.WGMMA_BN_COST_MULTI``: times ``lik_cupy.maxsim`` for 32 queries
(Lq=32) against documents of several lengths with each BN forced in turn, and
writes ``sweep_bn_multiquery_<gpu>.json`` to $OUT (or bench/results).

    python bench/sweeps/sweep_bn_multiquery.py
Device time: a sleep kernel is queued first so host overhead stays hidden.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, and this checkout's lik_cupy
import cupy as cp  # noqa: E402
import torch  # noqa: E402

import lik_cupy  # noqa: E402
from lik_cupy import _dispatch as dispatch  # noqa: E402
from lik_cupy._base.device import device_properties  # noqa: E402

from bench.lib.results import out_dir, write_result  # noqa: E402
from bench.lib.timing import per_call_ms  # noqa: E402


def main():
    out = out_dir()
    props = device_properties(0)
    rng = cp.random.default_rng(0)
    nq, lq, d = 32, 32, 128
    q = rng.standard_normal((nq, lq, d), dtype=cp.float32).astype(cp.float16)
    table = dispatch.tables.WGMMA_BN_COST_MULTI
    saved = dict(table)
    rows = []
    for ld, nd in ((180, 1024), (180, 20000), (128, 20000), (300, 10000), (512, 5000)):
        docs = rng.standard_normal((nd, ld, d), dtype=cp.float32).astype(cp.float16)
        flops = 2 * nq * lq * nd * ld * d
        for bn in (64, 96, 128):
            table.clear()
            table.update({b: (1.0 if b == bn else 100.0) for b in saved})
            dispatch.clear_caches()
            ms = per_call_ms(torch, lambda: lik_cupy.maxsim(q, docs), 20, rounds=1, spin_cycles=50_000_000)
            rows.append({"nq": nq, "lq": lq, "ld": ld, "nd": nd, "bn": bn, "ms": ms, "tflops": flops / ms / 1e9})
            print(f"Ld={ld:4d} B={nd:6d} BN={bn:3d}: {ms:.4f} ms {flops / ms / 1e9:6.1f} TF/s", flush=True)
        del docs
    table.update(saved)
    dispatch.clear_caches()
    write_result(out, "sweep_bn_multiquery", props, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
