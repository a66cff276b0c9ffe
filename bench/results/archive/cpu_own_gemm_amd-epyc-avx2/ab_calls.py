"""Whole maxsim_varlen calls with the argmax on the CPU, the folded path's GEMM by gemm_kernels (forced:
fold._gemm set, whatever the host's rule and its row limit) and by OpenBLAS alternating call by call in
one process, the same bits checked first; median ms of the rounds. python ab_calls.py [ROUNDS] > ab_calls.txt"""
import json, sys
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))
sys.path.insert(0, str(HERE.parent / "fold_unmasked_amd-epyc-avx2"))
import numpy as np
import lik_cupy
from lik_cupy._cpu import fold, gemm_kernels
from _ab import alternate, packed_cell

CELLS = {"1q32x1000d180": (1, 32, 1000, 180, 180), "1q32x1000d16-512": (1, 32, 1000, 16, 512),
         "1q1024x16d1024": (1, 1024, 16, 1024, 1024), "16q32x300d16-256": (16, 32, 300, 16, 256)}


def ab(cells: dict, rounds: int, rng, lanes: int = 8) -> dict:
    """{cell: same bits, median ms of each way, their ratio, every call's ms}, printed as they finish; the
    kernel's tiles of ``lanes``-wide vectors."""
    assert fold.available()
    ways = {"openblas": False, "gemm_kernels": (gemm_kernels.tokens_by_rows, lanes, 1 << 30)}
    out = {}
    try:
        for name, (nq, lq, nd, lo, hi) in cells.items():
            Q, D, off = packed_cell(rng, nq, lq, nd, lo, hi)
            call = lambda: lik_cupy.maxsim_varlen(Q, D, off, backend="cpu", return_argmax=True)  # noqa: E731
            got = {}
            for k, v in ways.items():
                fold._gemm = v; got[k] = call(); call()
            same = all(np.array_equal(a, b) for a, b in zip(got["openblas"], got["gemm_kernels"]))
            t = alternate(call, lambda k: setattr(fold, "_gemm", ways[k]), tuple(ways), rounds)
            med = {k: round(float(np.median(v)), 1) for k, v in t.items()}
            out[name] = {"same_bits": same, "median_ms": med, "ratio": round(med["gemm_kernels"] / med["openblas"], 3), "ms": t}
            print(name, "same bits", same, "median ms", med, "gemm_kernels / openblas", out[name]["ratio"], flush=True)
    finally:
        fold._gemm = None
    return out


if __name__ == "__main__":
    res = ab(CELLS, int(sys.argv[1]) if sys.argv[1:] else 15, np.random.default_rng(7))
    (HERE / "ab_calls.json").write_text(json.dumps(res, indent=1))
