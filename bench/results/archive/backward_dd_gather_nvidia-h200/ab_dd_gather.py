"""Kernel-level A/B of the backward of in-batch documents on one GPU: dD gathered per document without atomics
(lik_bwd_dq without its dD part, then lik_bwd_dd_gather) against the atomic method as dispatched before (dD's
fp32 copy cleared, lik_bwd_dq with its atomics, lik_bwd_cast for 16-bit dD; float32 dD cleared and summed into
directly) and the CSR method (keys, CuPy's sort, row starts, lik_bwd_dd_csr), all built by lik_cupy's NVRTC path from
maxsim_bwd_gather.cu beside this file (cuda_src/maxsim_bwd.cu with lik_bwd_dd_gather added; not taken), alternating
in one process. GPU ms per backward (CUDA events around 50), median of 7
rounds; dQ compared bitwise, the gathered dD bitwise against CSR's and within rounding against the atomics'.

    python ab_dd_gather.py OUT.json
"""
import json
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from lik_cupy._runtime import nvrtc  # noqa: E402

THREADS, WARPS = 256, 8
CELLS = [("N=32 (32 x 80)", 32, 32, 80), ("N=64 (32 x 300)", 64, 32, 300), ("N=128 (32 x 300)", 128, 32, 300),
         ("N=256 (32 x 300)", 256, 32, 300), ("ColPali N=64 (1024 x 1024)", 64, 1024, 1024)]
ELEMS = {0: np.float16, 2: np.float32}
cc = cupy.cuda.Device().compute_capability
rng = np.random.default_rng(0)
out = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": []}
null = np.uint64(0)
for elem, dt in ELEMS.items():
    sources = nvrtc.kernel_sources("maxsim_bwd.cu")
    sources["maxsim_bwd.cu"] = (Path(__file__).resolve().parent / "maxsim_bwd_gather.cu").read_bytes()
    built = nvrtc.nvrtc_compile("maxsim_bwd.cu", {"LIK_ELEM": elem, "LIK_VEC": 1}, cc, sources)
    mod = cupy.cuda.function.Module()
    mod.load(built.cubin)
    f = {k: mod.get_function(k) for k in ("lik_bwd_dq", "lik_bwd_keys", "lik_bwd_dd_csr", "lik_bwd_dd_gather",
                                          "lik_bwd_cast")}
    out.setdefault("registers", {})[str(elem)] = {k: nvrtc.resource_usage(built.log, k)["registers"] for k in f}
    for name, n, lq, ld in CELLS:
        nq = nd = n
        dim, rows = 128, n * ld
        a = rng.integers(0, ld, (nq, nd, lq)).astype(np.int32)
        a[rng.random(a.shape) < 0.02] = -1
        Q = cupy.asarray(rng.standard_normal((nq * lq, dim)).astype(dt))
        D = cupy.asarray(rng.standard_normal((rows, dim)).astype(dt))
        g = cupy.asarray(rng.standard_normal((nq, nd)).astype(np.float32))
        am = cupy.asarray(a)
        common = (np.int32(nq), np.int32(nd), np.int32(lq))
        dq_grid = (-(-nq * lq // WARPS), 1, 1)
        m = nq * nd * lq

        def atomic():
            dq = cupy.empty((nq * lq, dim), dt)
            if dt == np.float32:
                dd = cupy.zeros((rows, dim), dt)
                acc = dd
            else:
                dd = cupy.empty((rows, dim), dt)
                acc = cupy.zeros((rows, dim), np.float32)
            f["lik_bwd_dq"](dq_grid, (THREADS,), (Q, D, g, am, null, dq, acc, *common, np.int32(ld), np.int32(dim),
                                                 np.int32(0), np.int64(rows)))
            if dt != np.float32:
                f["lik_bwd_cast"]((min(-(-rows * dim // THREADS), 65535 * 8),), (THREADS,), (acc, dd, np.int64(rows * dim)))
            return dq, dd

        def gather():
            dq = cupy.empty((nq * lq, dim), dt)
            dd = cupy.empty((rows, dim), dt)
            f["lik_bwd_dq"](dq_grid, (THREADS,), (Q, D, g, am, null, dq, null, *common, np.int32(ld), np.int32(dim),
                                                 np.int32(0), np.int64(rows)))
            f["lik_bwd_dd_gather"]((nd, -(-ld // 64), 1), (THREADS,), (Q, g, am, dd, *common, np.int32(ld), np.int32(dim)))
            return dq, dd

        def csr():
            dq = cupy.empty((nq * lq, dim), dt)
            dd = cupy.empty((rows, dim), dt)
            f["lik_bwd_dq"](dq_grid, (THREADS,), (Q, D, g, am, null, dq, null, *common, np.int32(ld), np.int32(dim),
                                                 np.int32(0), np.int64(rows)))
            key = cupy.empty((m,), np.int64)
            f["lik_bwd_keys"]((min(-(-m // THREADS), 65535 * 8),), (THREADS,),
                              (am, null, key, *common, np.int32(ld), np.int32(0), np.int64(rows)))
            key.sort()
            start = cupy.searchsorted(key, cupy.arange(rows + 1, dtype=cupy.int64) * m)
            f["lik_bwd_dd_csr"]((-(-rows // WARPS), 1), (THREADS,), (Q, g, key, start, dd, *common, np.int32(dim),
                                                                    np.int64(rows)))
            return dq, dd

        ways = {"atomic": atomic, "gather": gather, "csr": csr}
        res = {w: fn() for w, fn in ways.items()}
        times = {w: [] for w in ways}
        for r in range(7):
            for w in (list(ways) if r % 2 else list(ways)[::-1]):
                ways[w]()
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record()
                for _ in range(50):
                    ways[w]()
                e1.record()
                e1.synchronize()
                times[w].append(cupy.cuda.get_elapsed_time(e0, e1) / 50)
        scale = float(cupy.abs(res["csr"][1].astype(np.float32)).max()) or 1.0
        row = {"cell": name, "dtype": np.dtype(dt).name,
               "dq_bitwise": all(bool(cupy.array_equal(res[w][0], res["csr"][0])) for w in ways),
               "gather_dd_bitwise_csr": bool(cupy.array_equal(res["gather"][1], res["csr"][1])),
               "atomic_dd_max_rel_diff": float(cupy.abs(res["atomic"][1].astype(np.float32)
                                                        - res["csr"][1].astype(np.float32)).max()) / scale}
        for w in ways:
            row[f"{w}_ms"] = float(np.median(times[w]))
        row["gather_over_atomic"] = row["gather_ms"] / row["atomic_ms"]
        out["rows"].append(row)
        print(f"{row['dtype']:8s} {name:28s} atomic {row['atomic_ms']:.4f}  gather {row['gather_ms']:.4f}  csr "
              f"{row['csr_ms']:.4f} ms  gather/atomic x{row['gather_over_atomic']:.3f}  dQ bitwise {row['dq_bitwise']}, "
              f"gather = csr {row['gather_dd_bitwise_csr']}, atomic rel diff {row['atomic_dd_max_rel_diff']:.1e}",
              flush=True)
print("registers", out["registers"])
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
