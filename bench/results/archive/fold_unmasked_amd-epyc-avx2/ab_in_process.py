"""The fold kernel before (one runner-up buffer, masked loads and stores in its row loop) and after (two
runner-up buffers, every store unconditional), in one process, alternating call by call: whole
maxsim_varlen calls on the CPU, the same bits checked.

    python ab_in_process.py OLD_FOLD_KERNELS.py [rounds] [out.json]   (git show 14a7a61:lik_cupy/_cpu/fold_kernels.py)
"""
import json, statistics, sys
from pathlib import Path
from _ab import alternate, fold_ways, packed_cell
import numpy as np
import lik_cupy
from lik_cupy._cpu import fold

ways = fold_ways(sys.argv[1])
def use(k):
    fold._kernel, fold.DocumentFold = ways[k]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
rng = np.random.default_rng(7)
cells = {"1q32x1000d180": (1, 32, 1000, 180, 180), "1q32x1000d16-512": (1, 32, 1000, 16, 512),
         "32q32x1000d180": (32, 32, 1000, 180, 180), "1q1024x16d1024": (1, 1024, 16, 1024, 1024),
         "16q32x300d16-256": (16, 32, 300, 16, 256)}
out = {"cpu_flags": sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx2", "avx512f"))}),
       "rounds": rounds, "cells": {}}
for name, (nq, lq, nd, lo, hi) in cells.items():
    Q, D, off = packed_cell(rng, nq, lq, nd, lo, hi)
    call = lambda: lik_cupy.maxsim_varlen(Q, D, off, backend="cpu", return_argmax=True)
    got = {}
    for k in ways:
        use(k)
        got[k] = call()
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(got["before"], got["after"]))
    t = alternate(call, use, ("before", "after"), rounds)
    m = {k: statistics.median(v) for k, v in t.items()}
    out["cells"][name] = {"before_ms": round(m["before"], 2), "after_ms": round(m["after"], 2),
                          "before_best_ms": round(min(t["before"]), 2), "after_best_ms": round(min(t["after"]), 2),
                          "after_over_before": round(m["after"] / m["before"], 3), "same_bits": True}
    print(name, out["cells"][name], flush=True)
use("after")
out["machine"] = "AMD EPYC (family 25, model 1), 2 cores, AVX2 without AVX-512, OpenBLAS 0.3.31 (Haswell kernels)"
if len(sys.argv) > 3:
    Path(sys.argv[3]).write_text(json.dumps(out, indent=1) + "\n")
