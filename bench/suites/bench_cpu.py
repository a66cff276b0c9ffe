"""CPU path benchmark: ``lik_cupy.maxsim(..., backend="cpu")`` against a plain NumPy matmul loop
(``Q[i] @ D.reshape(-1, d).T``, then max and sum: the same float32 BLAS, no blocking, no exact
argmax) and, where torch is installed, ``torch.einsum`` on the CPU, on the shapes of issue 34's
table (float32, d = 128):

    1 q (32 tokens) x 1,000 docs (180 tokens)
    32 q (32 tokens) x 1,000 docs (180 tokens)
    1 q (1,024 tokens) x 16 pages (1,024 tokens)

Each case also runs with ``return_argmax=True``, against the same loop taking ``argmax`` instead of
``max`` (the argmax of the float32 products, where ours is float64's exactly). All contenders run
in one process, interleaved round by round in a rotating order, so a busy machine slows them
alike; a cell's time is the best of the rounds (the median is kept beside it). The load average
before and after the run is recorded: other work on the machine makes every time longer and the
ratios noisier.

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, where the environment sets them, can slow NumPy's BLAS:
for a benchmark, unset them for the command alone and check the kernel in the JSON's "blas":

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/suites/bench_cpu.py
    # -> bench/results/latest/cpu_<machine>.json

Self-contained: imports nothing from the other bench scripts.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import platform
import re
import sys
import time
from pathlib import Path


import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout this script lives in, not an installed copy
import lik_cupy  # noqa: E402

DIM = 128
# name: (queries, query tokens, documents, document tokens)
CASES = {
    "1q32 x 1000d180": (1, 32, 1000, 180),
    "32q32 x 1000d180": (32, 32, 1000, 180),
    "1q1024 x 16d1024": (1, 1024, 16, 1024),
}


def numpy_loop(Q: np.ndarray, D: np.ndarray) -> np.ndarray:
    """The reference: one float32 GEMM per query against every document token, max, sum."""
    nd, ld, d = D.shape
    flat = D.reshape(-1, d)
    return np.stack([(q @ flat.T).reshape(q.shape[0], nd, ld).max(axis=2).sum(axis=0) for q in Q])


def numpy_loop_argmax(Q: np.ndarray, D: np.ndarray):
    """The reference with the argmax: the first maximum of the float32 products, and the scores."""
    nd, ld, d = D.shape
    flat = D.reshape(-1, d)
    scores, amax = [], []
    for q in Q:
        s3 = (q @ flat.T).reshape(q.shape[0], nd, ld)
        idx = s3.argmax(axis=2)
        scores.append(np.take_along_axis(s3, idx[:, :, None], axis=2)[:, :, 0].sum(axis=0))
        amax.append(idx.T)
    return np.stack(scores), np.stack(amax)


def torch_einsum(torch):
    def run(Q, D):
        with torch.no_grad():
            return torch.stack([torch.einsum("sk,ntk->nst", q, D).amax(dim=2).sum(dim=1) for q in Q])

    return run


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_info() -> dict:
    """NumPy's BLAS: from threadpoolctl when installed, else asked of a bundled OpenBLAS directly."""
    try:
        import threadpoolctl

        pools = [p for p in threadpoolctl.threadpool_info() if p.get("user_api") == "blas"]
        if pools:
            p = pools[0]
            return {"source": "threadpoolctl", "library": p.get("internal_api"), "version": p.get("version"),
                    "kernel": p.get("architecture"), "threads": p.get("num_threads")}
    except ImportError:
        pass
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__) + ".libs", "lib*openblas*.so*"))
    for path in libs:
        lib = ctypes.CDLL(path)
        names = {n: [s for s in (f"scipy_openblas_{n}64_", f"openblas_{n}64_", f"openblas_{n}") if hasattr(lib, s)]
                 for n in ("get_corename", "get_config", "get_num_threads")}
        if names["get_corename"]:
            core, config = (getattr(lib, names[n][0]) for n in ("get_corename", "get_config"))
            core.restype = config.restype = ctypes.c_char_p
            threads = getattr(lib, names["get_num_threads"][0])() if names["get_num_threads"] else None
            return {"source": "ctypes", "library": "openblas", "config": config().decode(),
                    "kernel": core().decode(), "threads": threads}
    return {"source": "unknown"}


def machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "numpy": np.__version__, "blas": blas_info(),
            "python": platform.python_version(), "lik_cupy": lik_cupy.__version__,
            "openblas_env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                        "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ}}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def time_round_robin(contenders: dict, rounds: int) -> dict:
    """Best and median milliseconds of each contender, run interleaved in a rotating order."""
    names = list(contenders)
    times = {n: [] for n in names}
    for fn in contenders.values():  # warm-up: first-touch allocations, BLAS threads
        fn()
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            contenders[n]()
            times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: {"best": min(t), "median": float(np.median(t))} for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "latest")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        torch = None
    info = machine()
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    cells = []
    for case in args.cases:
        nq, lq, nd, ld = CASES[case]
        Q = rng.standard_normal((nq, lq, DIM), dtype=np.float32)
        D = rng.standard_normal((nd, ld, DIM), dtype=np.float32)
        Q /= np.linalg.norm(Q, axis=-1, keepdims=True)
        D /= np.linalg.norm(D, axis=-1, keepdims=True)
        want, want_idx = numpy_loop_argmax(Q, D)
        got, got_idx = lik_cupy.maxsim(Q, D, backend="cpu", return_argmax=True)
        assert np.allclose(got, want, rtol=1e-5), f"{case}: lik_cupy and the NumPy loop disagree"
        differ = int(np.count_nonzero(got_idx != want_idx))  # near-ties float32 alone resolves differently
        contenders = {
            "ours": lambda: lik_cupy.maxsim(Q, D, backend="cpu"),
            "ours_argmax": lambda: lik_cupy.maxsim(Q, D, backend="cpu", return_argmax=True),
            "numpy_loop": lambda: numpy_loop(Q, D),
            "numpy_loop_argmax": lambda: numpy_loop_argmax(Q, D),
        }
        if torch is not None:
            tq, td, run = torch.from_numpy(Q), torch.from_numpy(D), torch_einsum(torch)
            contenders["torch_einsum"] = lambda: run(tq, td)
        t = time_round_robin(contenders, args.rounds)
        for argmax in (False, True):
            ours = t["ours_argmax" if argmax else "ours"]
            loop = t["numpy_loop_argmax" if argmax else "numpy_loop"]
            cell = {"case": case + (", argmax" if argmax else ""), "ours_ms": round(ours["best"], 2),
                    "numpy_loop_ms": round(loop["best"], 2), "ratio": round(ours["best"] / loop["best"], 3),
                    "ours_median_ms": round(ours["median"], 2), "numpy_loop_median_ms": round(loop["median"], 2)}
            if argmax:
                cell["argmax_entries_unlike_float32_loop"] = differ
            if "torch_einsum" in t and not argmax:
                cell["torch_einsum_ms"] = round(t["torch_einsum"]["best"], 2)
            cells.append(cell)
            print(f"{cell['case']:<28} ours {cell['ours_ms']:9.2f} ms   numpy loop {cell['numpy_loop_ms']:9.2f} ms"
                  f"   ratio {cell['ratio']:.3f}" + (f"   torch.einsum {cell['torch_einsum_ms']:.2f} ms"
                                                     if "torch_einsum_ms" in cell else ""))
    out = {"suite": "cpu", "dtype": "float32", "dim": DIM, "rounds": args.rounds,
           "timing": "best of the rounds, contenders interleaved in one process", "machine": info,
           "torch": None if torch is None else torch.__version__,
           "load_average": {"before": [round(x, 2) for x in load_before],
                            "after": [round(x, 2) for x in os.getloadavg()]},
           "cells": cells}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cpu_{slug(info['cpu'])}-{info['cores']}c.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
