import sys, time, tempfile
from pathlib import Path
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
import numpy as np
import bench.suites.bench_cpu as bc
import lik_cupy._cpu.residual as R
rng = np.random.default_rng(1)
def setb(b):
    R._BLOCK_BYTES = b
with tempfile.TemporaryDirectory() as w:
    c = bc.rerank_contenders(bc.RERANK[1], rng, Path(w))
    fs = {"r64": lambda: (setb(64 << 20), c["rerank"]()), "r128": lambda: (setb(128 << 20), c["rerank"]()),
          "hand": c["decompress_maxsim_varlen"]}
    for f in fs.values(): f()
    tot = {k: [] for k in fs}
    keys = list(fs)
    for i in range(int(sys.argv[1])):
        for k in keys[i % 3:] + keys[:i % 3]:
            t = time.perf_counter(); fs[k](); tot[k].append(time.perf_counter() - t); time.sleep(0.15)
    print({k: (round(np.median(v) * 1e3, 2), round(min(v) * 1e3, 2), round(np.mean(v) * 1e3, 2)) for k, v in tot.items()})
    a, b, h = (np.array(tot[k]) for k in keys)
    print("r64/hand paired median", np.median(a / h), "r128/hand", np.median(b / h))
