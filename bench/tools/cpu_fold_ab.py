"""The CPU path's compiled fold (``lik_cupy/_cpu/fold.py``) against its NumPy passes, in one process:
issue 48's four cells (float32, d = 128, unit-norm tokens) and the first in float16 and bfloat16 (whose
tokens the same build widens to float32), each call alternating between the two
(``LIK_DISABLE_NUMBA`` flipped before it, a switch read per call), back to back, with the scores
checked bit for bit alike. Needs Numba (the ``[cpu]`` extra).

Unlike ``bench/suites/bench_cpu.py``, no other contender runs between the calls, so neither side
shares the cores with another library's BLAS or Rust threads as they wind down: this is the
difference the fold makes, not the gate. ``after`` times what the suite's rotation adds: the first
cell's call (the fold) back to back, right after NumPy's batched contender on BLAS's own threads,
and right after it on one BLAS thread. Run it once more with ``OPENBLAS_THREAD_TIMEOUT=4`` in the
environment (read when OpenBLAS starts: its idle workers then sleep at once instead of spinning).

    python3 bench/tools/cpu_fold_ab.py --rounds 16 --json OUT.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.lib, lik_cupy
import lik_cupy  # noqa: E402
from bench.lib.results import write_json  # noqa: E402
from lik_cupy._cpu import fold  # noqa: E402


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _cells(rng) -> dict:
    one = _unit(rng.standard_normal((1, 32, 128), dtype=np.float32))
    docs = _unit(rng.standard_normal((1000, 180, 128), dtype=np.float32))
    lens = rng.integers(16, 513, 1000)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tok = _unit(rng.standard_normal((int(off[-1]), 128), dtype=np.float32))
    many = _unit(rng.standard_normal((32, 32, 128), dtype=np.float32))
    long_q = _unit(rng.standard_normal((1, 1024, 128), dtype=np.float32))
    pages = _unit(rng.standard_normal((16, 1024, 128), dtype=np.float32))
    one16, docs16 = one.astype(np.float16), docs.astype(np.float16)
    one_bf, docs_bf = one.astype(ml_dtypes.bfloat16), docs.astype(ml_dtypes.bfloat16)
    return {"1q32 x 1000d180": lambda: lik_cupy.maxsim(one, docs, backend="cpu"),
            "1q32 x 1000d180 float16": lambda: lik_cupy.maxsim(one16, docs16, backend="cpu"),
            "1q32 x 1000d180 bfloat16": lambda: lik_cupy.maxsim(one_bf, docs_bf, backend="cpu"),
            "1q32 x 1000d16-512": lambda: lik_cupy.maxsim_varlen(one, tok, off, backend="cpu"),
            "32q32 x 1000d180": lambda: lik_cupy.maxsim(many, docs, backend="cpu"),
            "1q1024 x 16d1024": lambda: lik_cupy.maxsim(long_q, pages, backend="cpu")}


def _run(call, mode: str):
    os.environ["LIK_DISABLE_NUMBA"] = "1" if mode == "numpy" else "0"
    t0 = time.perf_counter()
    out = call()
    return out, (time.perf_counter() - t0) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    if not fold.available():
        sys.exit("cpu_fold_ab: the compiled fold is not available here (install the [cpu] extra)")
    load_before = os.getloadavg()
    cells = {}
    for name, call in _cells(np.random.default_rng(0)).items():
        first = {m: _run(call, m)[0] for m in ("numpy", "fold")}  # (and each side's warm-up)
        assert np.array_equal(first["numpy"], first["fold"]), f"{name}: the fold changed the scores"
        times = {"numpy": [], "fold": []}
        for r in range(args.rounds):
            for mode in ("numpy", "fold") if r % 2 == 0 else ("fold", "numpy"):
                times[mode].append(_run(call, mode)[1])
        cell = {m: {"median_ms": round(float(np.median(v)), 3), "best_ms": round(min(v), 3)} for m, v in times.items()}
        cell["fold_over_numpy_median"] = round(cell["fold"]["median_ms"] / cell["numpy"]["median_ms"], 3)
        cells[name] = cell
        print(f"{name:22s} NumPy passes {cell['numpy']['median_ms']:8.2f} ms   compiled fold "
              f"{cell['fold']['median_ms']:8.2f} ms   x{cell['fold_over_numpy_median']:.3f} (median; same bits)")
    os.environ.pop("LIK_DISABLE_NUMBA", None)
    after = _after_others(args.rounds)
    write_json(args.json, {"tool": "cpu_fold_ab", "rounds": args.rounds, "cores": os.cpu_count(),
                           "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),
                           "load_average": {"before": load_before, "after": os.getloadavg()}, "cells": cells,
                           "after": after})


def _after_others(rounds: int) -> dict:
    """The first cell's call (ms, median and best) after each of: itself, NumPy's batched contender
    (one GEMM on BLAS's threads, then max and sum), and that contender on one BLAS thread."""
    import threadpoolctl

    rng = np.random.default_rng(0)
    q = _unit(rng.standard_normal((1, 32, 128), dtype=np.float32))
    docs = _unit(rng.standard_normal((1000, 180, 128), dtype=np.float32))
    flat = docs.reshape(-1, 128)

    def batched():
        (q[0] @ flat.T).reshape(32, 1000, 180).max(axis=2).sum(axis=0)

    def batched_one_thread():
        with threadpoolctl.threadpool_limits(1, user_api="blas"):
            batched()
    before = {"ours": lambda: None, "numpy_batched": batched, "numpy_batched_one_blas_thread": batched_one_thread}
    out = {}
    for name, first in before.items():
        times = []
        for _ in range(rounds):
            first()
            times.append(_run(lambda: lik_cupy.maxsim(q, docs, backend="cpu"), "fold")[1])
        out[name] = {"median_ms": round(float(np.median(times)), 3), "best_ms": round(min(times), 3)}
        print(f"1q32 x 1000d180 right after {name:30s} {out[name]['median_ms']:8.2f} ms (median)")
    return out


if __name__ == "__main__":
    main()
