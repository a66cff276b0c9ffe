"""host_ab.py with gemm_kernels' tiles of 16-lane (AVX-512) vectors beside the 8-lane ones: alone by rows,
and in whole calls with each forced in turn against OpenBLAS. python host_ab_wide.py > host_ab_wide.txt"""
import json, os, platform, sys
from pathlib import Path
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[4]))
sys.path.insert(0, str(HERE.parents[1] / "cpu_own_gemm_amd-epyc-avx2"))
import numpy as np
from llvmlite import binding
from threadpoolctl import threadpool_info, threadpool_limits
from lik_cupy._cpu import cores
from ab_calls import CELLS, ab
from gemm_rows import rates

model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
features = binding.get_host_cpu_features()
print("cpu:", model, "| avx512f:", features.get("avx512f"), "| blas:", [(i["internal_api"], i.get("architecture")) for i in threadpool_info()])
rng = np.random.default_rng(0)
print("rows: (one thread, two threads) GFLOP/s, best of three alternating rounds")
for R in (32, 64, 128, 512, 1024):
    print(R, rates(R, rng, lanes=(8, 16)), flush=True)
cores.chunk_threads = lambda: 2
out = {"cpu": model, "avx512f": bool(features.get("avx512f"))}
cells = {k: CELLS[k] for k in ("1q32x1000d180", "1q32x1000d16-512", "16q32x300d16-256", "1q1024x16d1024")}
with threadpool_limits(2):
    for lanes in (16, 8):
        print(f"-- whole calls, {lanes}-lane tiles", flush=True)
        out[f"lanes_{lanes}"] = ab(cells, 15, rng, lanes)
(Path(os.environ.get("OUT", HERE)) / "host_ab_wide.json").write_text(json.dumps(out, indent=1))
