"""The fold kernel before (one runner-up buffer, masked loads and stores in its row loop) and after (two
runner-up buffers, every store unconditional), in one process, alternating call by call: whole
maxsim_varlen calls on the CPU, the same bits checked.

    python ab_in_process.py OLD_FOLD_KERNELS.py [rounds] [out.json]   (git show 14a7a61:lik_cupy/_cpu/fold_kernels.py)
"""
import importlib.util, json, statistics, sys, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
import numpy as np
import lik_cupy
from lik_cupy._cpu import fold
assert fold.available()
spec = importlib.util.spec_from_file_location("old_fold_kernels", sys.argv[1])
old = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = old  # (Numba's on-disk cache finds its module by name)
spec.loader.exec_module(old)


class OldFold(fold.DocumentFold):
    """The old kernel's arguments: one runner-up buffer (the state's second element unused)."""
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        squares, top, runner, _, at, nan, offset = self._run
        self._run = (squares, top, runner, at, nan, offset)


NewFold = fold.DocumentFold
ways = {"before": (old.piece, OldFold), "after": (fold._kernel, NewFold)}
def use(k):
    fold._kernel, fold.DocumentFold = ways[k]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
rng = np.random.default_rng(7)
def unit(x): return x / np.linalg.norm(x, axis=-1, keepdims=True)
cells = {"1q32x1000d180": (1, 32, 1000, 180, 180), "1q32x1000d16-512": (1, 32, 1000, 16, 512),
         "32q32x1000d180": (32, 32, 1000, 180, 180), "1q1024x16d1024": (1, 1024, 16, 1024, 1024),
         "16q32x300d16-256": (16, 32, 300, 16, 256)}
out = {"cpu_flags": sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx2", "avx512f"))}),
       "rounds": rounds, "cells": {}}
for name, (nq, lq, nd, lo, hi) in cells.items():
    Q = unit(rng.standard_normal((nq, lq, 128), dtype=np.float32))
    lens = rng.integers(lo, hi + 1, nd)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    D = unit(rng.standard_normal((int(off[-1]), 128), dtype=np.float32))
    call = lambda: lik_cupy.maxsim_varlen(Q, D, off, backend="cpu", return_argmax=True)
    got = {}
    for k in ways:
        use(k)
        got[k] = call()
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(got["before"], got["after"]))
    t = {k: [] for k in ways}
    for r in range(rounds):
        for k in (["before", "after"] if r % 2 else ["after", "before"]):
            use(k)
            time.sleep(0.15)
            t0 = time.perf_counter(); call(); t[k].append(1e3 * (time.perf_counter() - t0))
    m = {k: statistics.median(v) for k, v in t.items()}
    out["cells"][name] = {"before_ms": round(m["before"], 2), "after_ms": round(m["after"], 2),
                          "before_best_ms": round(min(t["before"]), 2), "after_best_ms": round(min(t["after"]), 2),
                          "after_over_before": round(m["after"] / m["before"], 3), "same_bits": True}
    print(name, out["cells"][name], flush=True)
use("after")
out["machine"] = "AMD EPYC (family 25, model 1), 2 cores, AVX2 without AVX-512, OpenBLAS 0.3.31 (Haswell kernels)"
if len(sys.argv) > 3:
    Path(sys.argv[3]).write_text(json.dumps(out, indent=1) + "\n")
