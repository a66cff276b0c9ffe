"""Whole maxsim_varlen calls with the argmax on the CPU, the folded path's GEMM by gemm_kernels and by
OpenBLAS alternating call by call in one process (fold._gemm set between them), the same bits checked
first; median ms of the rounds. python ab_calls.py [ROUNDS] > ab_calls.txt"""
import json, sys, time
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))
sys.path.insert(0, str(HERE.parent / "fold_unmasked_amd-epyc-avx2"))
import numpy as np
import lik_cupy
from lik_cupy._cpu import fold
from _ab import packed_cell

rng = np.random.default_rng(7)
cells = {"1q32x1000d180": (1, 32, 1000, 180, 180), "1q32x1000d16-512": (1, 32, 1000, 16, 512),
         "1q1024x16d1024": (1, 1024, 16, 1024, 1024), "16q32x300d16-256": (16, 32, 300, 16, 256)}
assert fold.available()
fold.tokens_first_gemm(np.zeros((1, 1), np.float32))
own = fold._gemm
assert own, "this host keeps BLAS (fold._OWN_GEMM_NEEDS, _UNLESS)"
rounds = int(sys.argv[1]) if sys.argv[1:] else 15
out = {}
for name, (nq, lq, nd, lo, hi) in cells.items():
    Q, D, off = packed_cell(rng, nq, lq, nd, lo, hi)
    call = lambda: lik_cupy.maxsim_varlen(Q, D, off, backend="cpu", return_argmax=True)
    got = {}
    for k, v in (("openblas", False), ("gemm_kernels", own)):
        fold._gemm = v; got[k] = call(); call()
    same = all(np.array_equal(a, b) for a, b in zip(got["openblas"], got["gemm_kernels"]))
    t = {"openblas": [], "gemm_kernels": []}
    for r in range(rounds):
        order = (("openblas", False), ("gemm_kernels", own))
        for k, v in (order if r % 2 else order[::-1]):
            fold._gemm = v; time.sleep(0.05); t0 = time.perf_counter(); call(); t[k].append(1e3 * (time.perf_counter() - t0))
    med = {k: round(float(np.median(v)), 1) for k, v in t.items()}
    out[name] = {"same_bits": same, "median_ms": med, "ratio": round(med["gemm_kernels"] / med["openblas"], 3), "ms": t}
    print(name, "same bits", same, "median ms", med, "gemm_kernels / openblas", out[name]["ratio"], flush=True)
(HERE / "ab_calls.json").write_text(json.dumps(out, indent=1))
