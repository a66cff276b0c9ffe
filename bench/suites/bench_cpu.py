"""CPU suite (issue 48): ``lik_cupy``'s NumPy path against the Rust SIMD libraries and NumPy, and
``PlaidIndex.rerank`` against decompressing its candidates by hand and scoring them with
``maxsim_varlen``. float32, d = 128, unit-length tokens, on the four cells of the issue's table:

    1 q (32 tokens) x 1,000 docs (180 tokens)
    1 q (32 tokens) x 1,000 docs of 16-512 tokens (packed; padded to 512 for the batched contenders)
    32 q (32 tokens) x 1,000 docs (180 tokens)
    1 q (1,024 tokens) x 16 pages (1,024 tokens)

Contenders: ``ours`` (``maxsim`` / ``maxsim_varlen``, ``backend="cpu"``; ``ours_argmax`` beside it,
not counted among the others); ``maxsim-cpu`` 0.1.0, ``fast-maxsim`` 0.2.0 and ``maxsim-fast`` 0.1.1
from PyPI (``maxsim_scores(q, D)`` / ``maxsim_scores_variable(q, docs)`` per query; each skipped when
it does not import: ``pip install maxsim-cpu==0.1.0 fast-maxsim==0.2.0 maxsim-fast==0.1.1``);
``numpy_batched`` (one GEMM per query against every padded document token, max, sum) and
``numpy_loop`` (a float32 GEMM per query and document). Each contender's scores, ours included, are
checked against float64 MaxSim of the same tokens (``max_rel_err_vs_float64``; ``max_rel_err_vs_ours``
beside it); an other past ``WRONG`` (or with a NaN score) is listed as wrong and not counted (maxsim-cpu
past 32 query tokens), and where ours is past it (``ours_wrong``) the cell has no ratio.

Each cell also carries its floor on this machine (``floor``): its multiply-adds as float32 FLOPs
at the machine's sgemm rate (a large square float32 ``np.matmul`` with NumPy's BLAS threads,
measured at the start, ``machine.rates``) and its document bytes read once at the machine's read
bandwidth (a NumPy sum over an array far past the caches), the larger of the two; ``ours`` is
given as a multiple of it.

``ours`` runs as installed: with Numba (the ``[cpu]`` extra) its chunks fold in one compiled pass
(``lik_cupy/_cpu/fold.py``; ``machine.compiled_fold`` says whether it did), else NumPy's passes.

All contenders run in one process, in a rotating order round by round, so that a busy machine slows
them alike. Each call starts ``--settle`` seconds (0.15) after the one before it, the calling thread
busy meanwhile: the threads a library leaves spinning after its call (OpenBLAS's idle workers, for
about 0.1 s) would otherwise share the cores with whichever contender comes next, and a core left
idle clocks down. Each cell gives the median and best of the rounds and the ratio of ours to the fastest
other by each. The load average before and after is recorded, and ``quiet`` says whether the
1-minute load stayed under a quarter of the cores: a loaded machine's times say little, and no
target should be read from them.

    python bench/suites/bench_cpu.py            # -> cpu_<machine>.json (result_name) in --out, else $OUT, else bench/results/
    python bench/suites/bench_cpu.py --smoke    # tiny shapes, 2 rounds (the suite's own test)

OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, where the environment sets them, can slow NumPy's BLAS: unset
them for the command alone and check the kernel in the JSON's "blas". Imports nothing from the other
suites; its JSON is written by bench.lib.results (which stamps the sources' provenance).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout this script lives in, not an installed copy
import lik_cupy  # noqa: E402
from bench.lib.results import out_dir, write_json  # noqa: E402
from lik_cupy._cpu import fold  # noqa: E402
from lik_cupy.plaid import PlaidIndex, decompress_residuals  # noqa: E402

DIM = 128
RUST = ("maxsim_cpu", "fast_maxsim", "maxsim_fast")  # the import names of maxsim-cpu, fast-maxsim, maxsim-fast
# name: (queries, query tokens, documents, shortest and longest document tokens)
CASES = {
    "1q32 x 1000d180": (1, 32, 1000, 180, 180),
    "1q32 x 1000d16-512": (1, 32, 1000, 16, 512),
    "32q32 x 1000d180": (32, 32, 1000, 180, 180),
    "1q1024 x 16d1024": (1, 1024, 16, 1024, 1024),
}
SMOKE = {"1q8 x 20d12": (1, 8, 20, 12, 12), "1q8 x 20d2-30": (1, 8, 20, 2, 30), "3q40 x 9d16": (3, 40, 9, 16, 16)}
# the PLAID reranks: documents, their shortest and longest, queries, query tokens, candidates per query drawn
# from the first `pool` documents (every query's own, or largely shared), nbits
RERANK = [(5000, 16, 256, 16, 32, 200, 5000, 2), (5000, 16, 256, 16, 32, 200, 300, 2)]
RERANK_SMOKE = [(60, 2, 20, 3, 8, 10, 60, 2), (60, 2, 20, 3, 8, 10, 12, 2)]
WRONG = 1e-4  # a contender whose scores stray further from ours is wrong, not a contender
SETTLE_S = 0.15  # seconds between calls: past OpenBLAS's idle workers' spin (about 0.1 s on a 3 GHz core)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def rust_libraries() -> dict:
    out = {}
    for name in RUST:
        try:
            out[name] = importlib.import_module(name)
        except ImportError:
            pass
    return out


def padded(docs: list):
    """Documents ``[L_j, d]`` padded with zeros to the longest: ``[N, L, d]`` and bool valid ``[N, L]``."""
    longest = max(len(d) for d in docs)
    D = np.zeros((len(docs), longest, DIM), np.float32)
    valid = np.zeros((len(docs), longest), bool)
    for j, d in enumerate(docs):
        D[j, :len(d)], valid[j, :len(d)] = d, True
    return D, valid


def numpy_batched(Q: np.ndarray, D: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
    """One float32 GEMM per query against every token of the padded documents ``D [N, L, d]``
    (``valid`` [N, L] or None: padding never wins), max, sum."""
    n, length, d = D.shape
    flat = D.reshape(-1, d)
    out = []
    for q in Q:
        s = (q @ flat.T).reshape(q.shape[0], n, length)
        if valid is not None:
            s = np.where(valid[None], s, -np.inf)
        out.append(s.max(axis=2).sum(axis=0))
    return np.stack(out)


def numpy_loop(Q: np.ndarray, docs: list) -> np.ndarray:
    """One float32 GEMM per query and document, max, sum."""
    return np.array([[(q @ d.T).max(axis=1).sum() for d in docs] for q in Q])


def cell_contenders(Q, lens, rng, libs):
    """One cell's contenders, ours and the others (name -> function returning scores [Nq, N]), and its
    documents (a list of [L_j, d])."""
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = unit(rng.standard_normal((int(off[-1]), DIM), dtype=np.float32))
    docs = [tokens[off[j]:off[j + 1]] for j in range(lens.size)]
    same = bool((lens == lens[0]).all())
    if same:
        D = tokens.reshape(lens.size, int(lens[0]), DIM)
        valid = None
        ours = {"ours": lambda: lik_cupy.maxsim(Q, D, backend="cpu"),
                "ours_argmax": lambda: lik_cupy.maxsim(Q, D, backend="cpu", return_argmax=True)[0]}
    else:
        D, valid = padded(docs)
        ours = {"ours": lambda: lik_cupy.maxsim_varlen(Q, tokens, off, backend="cpu"),
                "ours_argmax": lambda: lik_cupy.maxsim_varlen(Q, tokens, off, backend="cpu", return_argmax=True)[0]}
    others = {"numpy_batched": lambda: numpy_batched(Q, D, valid), "numpy_loop": lambda: numpy_loop(Q, docs)}
    for name, lib in libs.items():
        if same:
            others[name] = lambda lib=lib: np.stack([lib.maxsim_scores(q, D) for q in Q])
        else:
            others[name] = lambda lib=lib: np.stack([lib.maxsim_scores_variable(q, docs) for q in Q])
    return ours, others, docs


def rerank_contenders(spec, rng, where: Path):
    """A fast-plaid index directory of random documents, its queries and candidates, and the two ways
    to rerank them: ``PlaidIndex.rerank`` and by hand (the candidates' union decompressed, scored by
    ``maxsim_varlen``, gathered)."""
    nd, lo, hi, nq, lq, k, pool, nbits = spec
    lens = rng.integers(lo, hi + 1, nd)
    n_cent = 1024
    np.save(where / "centroids.npy", unit(rng.standard_normal((n_cent, DIM))).astype(np.float16))
    np.save(where / "bucket_weights.npy", np.linspace(-0.05, 0.05, 1 << nbits).astype(np.float16))
    (where / "metadata.json").write_text(json.dumps({"num_chunks": 1, "nbits": nbits, "num_documents": nd}))
    (where / "doclens.0.json").write_text(json.dumps([int(n) for n in lens]))
    np.save(where / "0.codes.npy", rng.integers(0, n_cent, int(lens.sum())).astype(np.int64))
    np.save(where / "0.residuals.npy", rng.integers(0, 256, (int(lens.sum()), DIM * nbits // 8), dtype=np.uint8))
    idx = PlaidIndex.open(where)
    Q = unit(rng.standard_normal((nq, lq, DIM), dtype=np.float32))
    cand = np.stack([rng.choice(pool, k, replace=False) for _ in range(nq)])

    def by_hand():
        u, inv = np.unique(cand, return_inverse=True)
        codes, bits, off = idx.residuals(u)
        D = decompress_residuals(codes, bits, idx.centroids, idx.bucket_weights, idx.nbits)
        return np.take_along_axis(lik_cupy.maxsim_varlen(Q, D, off, backend="cpu"), inv.reshape(cand.shape), axis=1)

    return {"rerank": lambda: idx.rerank(Q, cand, backend="cpu"), "decompress_maxsim_varlen": by_hand}


def cpuinfo_fields(text: str | None = None) -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (``text``: its contents; default: read it), or {}."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model(fields: dict[str, str]) -> str:
    return fields.get("model name") or platform.processor() or platform.machine()


def cpu_id(fields: dict[str, str]) -> str | None:
    """``f<family>m<model>`` of an x86 CPU from its /proc/cpuinfo fields, else None.

    Virtual machines often name every AMD host "AMD EPYC"; the family and model tell a Zen 3 (AVX2)
    from a Zen 4 or 5 (AVX-512), whose GEMM rates differ 2-3x, so each gets its own result file.
    """
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    return f"f{family}m{model}" if family.isdigit() and model.isdigit() else None


def result_name(info: dict, smoke: bool) -> str:
    """The suite's file name: ``cpu_<model>[-<family and model>]-<cores>c.json`` (runs before the family
    and model were recorded are named without them)."""
    cpu = slug(info["cpu"]) + (f"-{info['cpu_id']}" if info.get("cpu_id") else "")
    return f"cpu_{cpu}-{info['cores']}c{'_smoke' if smoke else ''}.json"


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


def machine(libs: dict) -> dict:
    from importlib import metadata

    versions = {}
    for name in libs:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        numba = metadata.version("numba")
    except metadata.PackageNotFoundError:
        numba = None
    cpu = cpuinfo_fields()
    return {"cpu": cpu_model(cpu), "cpu_id": cpu_id(cpu), "cores": os.cpu_count(), "numpy": np.__version__, "blas": blas_info(),
            "python": platform.python_version(), "lik_cupy": lik_cupy.__version__, "rust_libraries": versions,
            "numba": numba, "compiled_fold": fold.available(),
            "openblas_env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                        "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ}}


def rates(smoke: bool) -> dict:
    """The machine's float32 GEMM rate (GFLOP/s, best of 3) and read bandwidth (GB/s, best of 3)."""
    rng = np.random.default_rng(1)
    n = 256 if smoke else 3072
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.empty((n, n), np.float32)
    x = np.ones((4 if smoke else 64) << 20, np.float32)  # 256 MB: far past the caches
    gemm, read = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        gemm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        x.sum()
        read.append(time.perf_counter() - t0)
    return {"sgemm_gflops": round(2 * n**3 / min(gemm) / 1e9, 1), "sgemm_shape": [n, n, n],
            "read_gbs": round(x.nbytes / min(read) / 1e9, 2)}


def floor(nq: int, lq: int, ntok: int, r: dict) -> dict:
    """A cell's FLOPs (2 per multiply-add of every query token with every document token) and bytes
    (the document tokens, float32, read once), and the time each takes at the machine's rates."""
    flops = 2 * nq * lq * ntok * DIM
    nbytes = ntok * DIM * 4
    gemm_ms, read_ms = flops / r["sgemm_gflops"] / 1e6, nbytes / r["read_gbs"] / 1e6
    # (four significant digits: the smoke run's tiny cells take microseconds, which two decimals of a
    # millisecond rounded to 0 on a fast machine)
    return {"gflop": round(flops / 1e9, 3), "mbytes": round(nbytes / 1e6, 1), "sgemm_ms": float(f"{gemm_ms:.4g}"),
            "read_ms": float(f"{read_ms:.4g}"), "floor_ms": float(f"{max(gemm_ms, read_ms):.4g}")}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def time_round_robin(contenders: dict, rounds: int, settle: float = 0.0) -> dict:
    """Median and best milliseconds of each contender, run interleaved in a rotating order, each call
    after ``settle`` seconds of busy-waiting on the calling thread (module docstring)."""
    names = list(contenders)
    times = {n: [] for n in names}
    for fn in contenders.values():  # warm-up: first-touch allocations, BLAS threads
        fn()
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            until = time.perf_counter() + settle
            while time.perf_counter() < until:  # (busy, not asleep: an idle core clocks down)
                pass
            t0 = time.perf_counter()
            contenders[n]()
            times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: {"median_ms": round(float(np.median(t)), 3), "best_ms": round(min(t), 3)} for n, t in times.items()}


def summary(times: dict, ours: str, others: list) -> dict:
    """Ours against the fastest other (right) contender, by median and by best (None where no other is
    right)."""
    out = {"median": None, "best": None}
    for stat in ("median_ms", "best_ms"):
        if not others:
            continue
        fastest = min(others, key=lambda n: times[n][stat])
        out[stat.replace("_ms", "")] = {"fastest_other": fastest,
                                        "ratio": round(times[ours][stat] / times[fastest][stat], 3)}
    return out


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / |want|; NaN when any score of ``got`` is NaN (a NaN score is wrong, not skipped)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.max(np.abs(np.asarray(got, np.float64) - want) / np.maximum(np.abs(want), 1e-30)))


def exact(Q: np.ndarray, docs: list) -> np.ndarray:
    """float64 MaxSim [Nq, N] of the same float32 tokens: the reference every contender is checked against."""
    Q64 = Q.astype(np.float64)
    return np.array([[(q @ d.astype(np.float64).T).max(axis=1).sum() for d in docs] for q in Q64])


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help="seconds each call waits, busy, after the one before it (0: none)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and 2 rounds: checks the suite runs")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default $OUT, else bench/results)")
    args = ap.parse_args(argv)
    cases, rerank, rounds = (SMOKE, RERANK_SMOKE, 2) if args.smoke else (CASES, RERANK, args.rounds)
    settle = 0.0 if args.smoke else args.settle

    libs = rust_libraries()
    info = machine(libs)
    info["rates"] = rates(args.smoke)
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    cells = []
    for case, (nq, lq, nd, lo, hi) in cases.items():
        Q = unit(rng.standard_normal((nq, lq, DIM), dtype=np.float32))
        lens = rng.integers(lo, hi + 1, nd)
        ours, others, docs = cell_contenders(Q, lens, rng, libs)
        got, f64 = {n: f() for n, f in {**ours, **others}.items()}, exact(Q, docs)
        errors = {n: rel_err(got[n], got["ours"]) for n in others}
        exact_err = {n: rel_err(g, f64) for n, g in got.items()}
        times = time_round_robin({**ours, **others}, rounds, settle)
        right = [n for n in others if exact_err[n] <= WRONG]  # (a NaN error fails the comparison: wrong)
        ours_wrong = not exact_err["ours"] <= WRONG
        fl = floor(nq, lq, int(lens.sum()), info["rates"])
        fl["ours_median_x"] = round(times["ours"]["median_ms"] / fl["floor_ms"], 2)
        cell = {"case": case, "times": times, "max_rel_err_vs_ours": errors, "max_rel_err_vs_float64": exact_err,
                "ours_wrong": ours_wrong, "wrong": sorted(set(others) - set(right)),
                **summary(times, "ours", [] if ours_wrong else right), "floor": fl}
        cells.append(cell)
        vs = (f"fastest other {cell['median']['fastest_other']} x{cell['median']['ratio']:.3f} (median), "
              f"{cell['best']['fastest_other']} x{cell['best']['ratio']:.3f} (best)" if cell["median"] else
              f"no ratio: {'ours' if ours_wrong else 'every other'} wrong against float64")
        print(f"{case:<22} ours {times['ours']['median_ms']:9.2f} / {times['ours']['best_ms']:8.2f} ms   "
              f"{vs}; floor {fl['floor_ms']} ms")
    plaid = []
    for spec in rerank:
        with tempfile.TemporaryDirectory() as where:
            contenders = rerank_contenders(spec, rng, Path(where))
            a, b = contenders["rerank"](), contenders["decompress_maxsim_varlen"]()
            assert np.array_equal(a, b), "PlaidIndex.rerank and decompress + maxsim_varlen disagree"
            times = time_round_robin(contenders, rounds, settle)
        nd, lo, hi, nq, lq, k, pool, nbits = spec
        case = f"{nq} q ({lq}) x {k} candidates of the first {pool} of {nd} docs ({lo}-{hi} tokens), nbits {nbits}"
        plaid.append({"case": case, "times": times, **summary(times, "rerank", ["decompress_maxsim_varlen"])})
        print(f"{plaid[-1]['case']}: rerank x{plaid[-1]['median']['ratio']:.3f} of decompress + maxsim_varlen (median)")
    load_after = os.getloadavg()
    out = {"suite": "cpu", "dtype": "float32", "dim": DIM, "rounds": rounds, "settle_s": settle, "smoke": args.smoke,
           "timing": "median and best of the rounds, contenders interleaved in a rotating order in one process",
           "machine": info, "skipped": [n for n in RUST if n not in libs],
           "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]},
           "quiet": max(load_before[0], load_after[0]) < 0.25 * (os.cpu_count() or 1),
           "cells": cells, "plaid_rerank": plaid}
    path = out_dir(args.out) / result_name(info, args.smoke)
    write_json(path, out)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
