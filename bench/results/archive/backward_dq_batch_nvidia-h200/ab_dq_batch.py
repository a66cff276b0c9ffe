"""A/B of the backward's dQ kernel (lik_bwd_dq, cuda_src/maxsim_bwd.cu: one document's loads after the last
one's atomics) against a variant with the documents' loads in flight kBatch = 8 at a time (maxsim_bwd_batched.cu
beside this file, not taken), both built here by lik_cupy's NVRTC path and launched alike, alternating in one
process on one GPU (the run in ab_dq_batch.json was made with the package's kernel as "before"). Kernel ms per launch (CUDA events, 100 launches), median of 7 rounds; dQ compared bitwise and
dD (fp32 atomics, whose order varies) within rounding.

    python ab_dq_batch.py OUT.json
"""
import json
import sys
from pathlib import Path

import cupy
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))
from lik_cupy._runtime import nvrtc  # noqa: E402

THREADS = 256
CELLS = [  # (name, Nq, Nd, Lq, Ld, packed)
    ("in-batch N=32 (32 x 80)", 32, 32, 32, 80, False),
    ("in-batch N=64 (32 x 300)", 64, 64, 32, 300, False),
    ("in-batch N=128 (32 x 300)", 128, 128, 32, 300, False),
    ("in-batch N=256 (32 x 300)", 256, 256, 32, 300, False),
    ("ColPali in-batch N=64 (1024 x 1024)", 64, 64, 1024, 1024, False),
    ("packed, 16 queries x 1,000 docs (32 x 16-512)", 16, 1000, 32, 512, True),
]
ELEMS = {0: np.float16, 2: np.float32}
cc = cupy.cuda.Device().compute_capability
arch = "90" if cc == "90" else cc
before = nvrtc.kernel_sources("maxsim_bwd.cu")
current = dict(before)  # (the batched variant)
current["maxsim_bwd.cu"] = (HERE / "maxsim_bwd_batched.cu").read_bytes()


def kernel(sources, elem):
    built = nvrtc.nvrtc_compile("maxsim_bwd.cu", {"LIK_ELEM": elem, "LIK_VEC": 1}, arch, sources)
    mod = cupy.cuda.function.Module()
    mod.load(built.cubin)
    return mod, mod.get_function("lik_bwd_dq"), nvrtc.resource_usage(built.log, "lik_bwd_dq")


rng = np.random.default_rng(0)
out = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": []}
for elem, dt in ELEMS.items():
    ways = {"before": kernel(before, elem), "batched": kernel(current, elem)}
    out.setdefault("registers", {})[str(elem)] = {w: v[2]["registers"] for w, v in ways.items()}
    for name, nq, nd, lq, ld, packed in CELLS:
        dim = 128
        if packed:
            lens = rng.integers(16, ld + 1, nd)
            off = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
            rows = int(lens.sum())
            a = (rng.random((nq, nd, lq)) * lens[None, :, None]).astype(np.int32)
        else:
            off, rows = None, nd * ld
            a = rng.integers(0, ld, (nq, nd, lq)).astype(np.int32)
        a[rng.random(a.shape) < 0.02] = -1  # masked tokens
        Q = cupy.asarray(rng.standard_normal((nq * lq, dim)).astype(dt))
        D = cupy.asarray(rng.standard_normal((rows, dim)).astype(dt))
        g = cupy.asarray(rng.standard_normal((nq, nd)).astype(np.float32))
        am = cupy.asarray(a)
        warps = THREADS // 32
        grid = (-(-nq * lq // warps), -(-dim // 128), 1)
        res, times = {}, {}
        for w, (_, f, _) in ways.items():
            dq = cupy.empty((nq * lq, dim), dt)
            dd = cupy.zeros((rows, dim), np.float32)
            args = (Q, D, g, am, off if off is not None else np.uint64(0), dq, dd, np.int32(nq), np.int32(nd),
                    np.int32(lq), np.int32(ld), np.int32(dim), np.int32(0), np.int64(rows))
            f(grid, (THREADS,), args)
            cupy.cuda.Device().synchronize()
            res[w] = (dq.copy(), dd.copy())
            times[w] = (f, args, [])
        for r in range(7):
            for w in (list(ways) if r % 2 else list(ways)[::-1]):
                f, args, ts = times[w]
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                f(grid, (THREADS,), args)
                e0.record()
                for _ in range(100):
                    f(grid, (THREADS,), args)
                e1.record()
                e1.synchronize()
                ts.append(cupy.cuda.get_elapsed_time(e0, e1) / 100)
        row = {"cell": name, "dtype": np.dtype(dt).name,
               "dq_bitwise": bool(cupy.array_equal(res["before"][0], res["batched"][0])),
               "dd_max_abs_diff": float(cupy.abs(res["before"][1] - res["batched"][1]).max())}
        for w in ways:
            row[f"{w}_ms"] = float(np.median(times[w][2]))
        row["batched_over_before"] = row["batched_ms"] / row["before_ms"]
        out["rows"].append(row)
        print(f"{row['dtype']:8s} {name:46s} {row['before_ms']:.4f} -> {row['batched_ms']:.4f} ms "
              f"(x{row['batched_over_before']:.3f}) dQ bitwise {row['dq_bitwise']}, dD diff {row['dd_max_abs_diff']:.1e}",
              flush=True)
print("registers", out["registers"])
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
