"""A/B of the folded blocks' budget (lik_cupy/_cpu/maxsim.py, _Budget.of(..., folded=)): the same calls with
_fewer_blocks forced to the per-token budget ("plain", as before) and as dispatched ("folded"), alternating in
one process, each call 0.15 s after the one before it (bench_cpu.py's --settle). Same bits checked.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python ab_folded_budget.py OUT.json [rounds]
"""
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "suites"))
import bench_cpu as B  # noqa: E402
import lik_cupy  # noqa: E402
from lik_cupy._cpu import maxsim as M  # noqa: E402

rng = np.random.default_rng(0)
folded = M._fewer_blocks
blocks = []
real_block = M._block_maxima
M._block_maxima = lambda *a: blocks.append(1) or real_block(*a)


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


cells = {}
for name, (nq, lq, nd, lo, hi) in B.CASES.items():
    Q = unit(rng.standard_normal((nq, lq, 128), dtype=np.float32))
    lens = rng.integers(lo, hi + 1, nd)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tok = unit(rng.standard_normal((int(off[-1]), 128), dtype=np.float32))
    if lo == hi:
        D = tok.reshape(nd, lo, 128)
        cells[name] = (lambda Q=Q, D=D: lik_cupy.maxsim(Q, D, backend="cpu"))
    else:
        cells[name] = (lambda Q=Q, tok=tok, off=off: lik_cupy.maxsim_varlen(Q, tok, off, backend="cpu"))
tmp = tempfile.TemporaryDirectory()
for i, spec in enumerate(B.RERANK):
    c = B.rerank_contenders(spec, rng, Path(tmp.name) if i == 0 else Path(tempfile.mkdtemp(dir=tmp.name)))
    cells[f"plaid rerank, pool {spec[6]}"] = c["rerank"]
    cells[f"plaid by hand, pool {spec[6]}"] = c["decompress_maxsim_varlen"]

modes = {"plain": lambda plain, f, tokens, docs, block_bytes: plain, "folded": folded}
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
out = {"machine": B.cpu_model(), "rounds": rounds, "cells": {}}
for name, fn in cells.items():
    res = {}
    for m, rule in modes.items():
        M._fewer_blocks = rule
        blocks.clear()
        res[m] = fn()
        out["cells"].setdefault(name, {})[m] = {"blocks": len(blocks), "ms": []}
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        *(r if isinstance(r, tuple) else (r,) for r in res.values())))
    out["cells"][name]["same_bits"] = bool(same)
    for r in range(rounds):
        for m in (modes if r % 2 else list(modes)[::-1]):
            M._fewer_blocks = modes[m]
            until = time.perf_counter() + 0.15
            while time.perf_counter() < until:
                pass
            t = time.perf_counter()
            fn()
            out["cells"][name][m]["ms"].append((time.perf_counter() - t) * 1e3)
    row = out["cells"][name]
    for m in modes:
        row[m]["median_ms"] = float(np.median(row[m]["ms"]))
        row[m]["best_ms"] = float(np.min(row[m]["ms"]))
    row["folded_over_plain_median"] = row["folded"]["median_ms"] / row["plain"]["median_ms"]
    print(f"{name:34s} blocks {row['plain']['blocks']:3d} -> {row['folded']['blocks']:3d}  "
          f"plain {row['plain']['median_ms']:8.2f}  folded {row['folded']['median_ms']:8.2f} ms  "
          f"x{row['folded_over_plain_median']:.3f}  same bits {same}", flush=True)
M._fewer_blocks = folded
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
