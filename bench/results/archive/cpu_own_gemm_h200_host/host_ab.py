"""gemm_kernels.tokens_by_rows on a CPU with AVX-512: the kernel against OpenBLAS alone by rows and in whole
maxsim_varlen calls (forced), with two chunk threads and two BLAS threads, as on the 2-core hosts (the AVX2
EPYC's scripts, ../cpu_own_gemm_amd-epyc-avx2/). Run on the H200 device host's CPU:
    python host_ab.py > host_ab.txt                  tiles of 8-lane vectors
    python host_ab.py wide > wide/host_ab_wide.txt   tiles of 16-lane vectors beside them, each forced in turn"""
import json, os, platform, sys
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))
sys.path.insert(0, str(HERE.parent / "cpu_own_gemm_amd-epyc-avx2"))
import numpy as np
from llvmlite import binding
from threadpoolctl import threadpool_info, threadpool_limits
from lik_cupy._cpu import cores
from ab_calls import CELLS, ab
from gemm_rows import rates

wide = sys.argv[1:] == ["wide"]
model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
features = binding.get_host_cpu_features()
print("cpu:", model, "| avx512f:", features.get("avx512f"), "| blas:", [(i["internal_api"], i.get("architecture")) for i in threadpool_info()])
rng = np.random.default_rng(0)
print("rows: (one thread, two threads) GFLOP/s, best of three alternating rounds")
for R in (32, 64, 128, 512, 1024):
    print(R, rates(R, rng, lanes=(8, 16) if wide else (8,)), flush=True)
cores.chunk_threads = lambda: 2
out = {"cpu": model, "avx512f": bool(features.get("avx512f"))}
names = ("1q32x1000d180", "1q32x1000d16-512", "16q32x300d16-256") + (("1q1024x16d1024",) if wide else ())
with threadpool_limits(2):
    for lanes in (16, 8) if wide else (8,):
        if wide:
            print(f"-- whole calls, {lanes}-lane tiles", flush=True)
        res = ab({k: CELLS[k] for k in names}, 15, rng, lanes)
        out |= {f"lanes_{lanes}": res} if wide else res
name = "host_ab_wide.json" if wide else "host_ab.json"
(Path(os.environ["OUT"]) if "OUT" in os.environ else HERE / ("wide" if wide else "")).joinpath(name).write_text(json.dumps(out, indent=1))
