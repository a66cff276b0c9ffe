"""gemm_kernels.tokens_by_rows on a CPU with AVX-512, where fold.py's rule keeps BLAS: the kernel forced
(fold._gemm set), against OpenBLAS, alone by rows (one thread, two at once) and in whole maxsim_varlen
calls (alternating, the same bits checked), with the chunk threads and BLAS held to two threads as on
the 2-core hosts. Run on the H200 device host's CPU:
    python host_ab.py > host_ab.txt"""
import os
import json, platform, subprocess, sys, threading, time
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))
sys.path.insert(0, str(HERE.parent / "fold_unmasked_amd-epyc-avx2"))
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits
from llvmlite import binding
import lik_cupy
from lik_cupy._cpu import cores, fold, gemm_kernels as G
from _ab import packed_cell

model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
features = binding.get_host_cpu_features()
print("cpu:", model, "| avx512f:", features.get("avx512f"), "| blas:", [(i["internal_api"], i.get("architecture")) for i in threadpool_info()])
cores.chunk_threads = lambda: 2
assert fold.available()
rng = np.random.default_rng(0)
d = 128
print("rows: (one thread, two threads) GFLOP/s, best of three alternating rounds")
for R in (32, 64, 128, 512, 1024):
    n = max(20000, 180000 * 32 // R)
    Ts = [rng.standard_normal((n, d)).astype(np.float32) for _ in range(2)]
    A = rng.standard_normal((R, d)).astype(np.float32)
    At, Ap = A.T, G.pack(A)
    outs = [np.empty((n, R), np.float32) for _ in range(2)]
    step = max(1024, (2 << 20) // ((R + d) * 4))
    flop = 2 * n * R * d

    def pieces(f, T, out):
        for p0 in range(0, n, step):
            f(T[p0:p0 + step], out[p0:p0 + step])
    ways = {"openblas": lambda T, o: np.matmul(T, At, out=o), "gemm_kernels": lambda T, o: G.tokens_by_rows(T, Ap, o)}
    res = {}
    with threadpool_limits(1):
        for _ in range(3):
            for name, f in ways.items():
                pieces(f, Ts[0], outs[0])
                t = time.perf_counter(); pieces(f, Ts[0], outs[0]); one = time.perf_counter() - t
                th = [threading.Thread(target=pieces, args=(f, Ts[k], outs[k])) for k in range(2)]
                t0 = time.perf_counter(); [x.start() for x in th]; [x.join() for x in th]
                res.setdefault(name, []).append((flop / one / 1e9, 2 * flop / (time.perf_counter() - t0) / 1e9))
    print(R, {k: (round(max(a for a, _ in v), 1), round(max(b for _, b in v), 1)) for k, v in res.items()}, flush=True)

cells = {"1q32x1000d180": (1, 32, 1000, 180, 180), "1q32x1000d16-512": (1, 32, 1000, 16, 512),
         "16q32x300d16-256": (16, 32, 300, 16, 256)}
out = {"cpu": model, "avx512f": bool(features.get("avx512f"))}
with threadpool_limits(2):
    for name, (nq, lq, nd, lo, hi) in cells.items():
        Q, D, off = packed_cell(rng, nq, lq, nd, lo, hi)
        call = lambda: lik_cupy.maxsim_varlen(Q, D, off, backend="cpu", return_argmax=True)
        arms = (("openblas", False), ("gemm_kernels", G.tokens_by_rows))
        got = {}
        for k, v in arms:
            fold._gemm = v; got[k] = call(); call()
        same = all(np.array_equal(a, b) for a, b in zip(got["openblas"], got["gemm_kernels"]))
        t = {k: [] for k, _ in arms}
        for r in range(15):
            for k, v in (arms if r % 2 else arms[::-1]):
                fold._gemm = v; time.sleep(0.05); t0 = time.perf_counter(); call(); t[k].append(1e3 * (time.perf_counter() - t0))
        med = {k: round(float(np.median(v)), 1) for k, v in t.items()}
        out[name] = {"same_bits": same, "median_ms": med, "ratio": round(med["gemm_kernels"] / med["openblas"], 3)}
        print(name, "same bits", same, "median ms", med, "gemm_kernels / openblas", out[name]["ratio"], flush=True)
(Path(os.environ.get("OUT", HERE)) / "host_ab.json").write_text(json.dumps(out, indent=1))
