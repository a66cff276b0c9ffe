import sys, os
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import numpy as np, cupy as cp
import lik_cupy
from lik_cupy import _dispatch
import lik_cupy._dispatch.tables as t
from lik_cupy._dispatch.select import choose_forward
def run(q, d, lens, late):
    t.REFINE_LATE = late; _dispatch.clear_caches()
    s, a = lik_cupy.maxsim(cp.asarray(q), cp.asarray(d), d_lengths=cp.asarray(lens), return_argmax=True)
    return cp.asnumpy(s), cp.asnumpy(a)
for dim, nq, lq in [(64, 9, 32), (128, 9, 32), (64, 1, 32), (128, 1, 100), (96, 2, 100), (128, 1, 1024)]:
    print("cfg", dim, nq, lq, choose_forward(90, "float32", dim, lq, True, True, tma=True, x3=True, shared_queries=nq, ld=66).name)
    bad = 0
    for seed in range(12 if lq < 1024 else 3):
        rng = np.random.default_rng(seed)
        nd, ld = 29, int(rng.integers(1, 260))
        q = rng.standard_normal((nq, lq, dim)).astype(np.float32)
        d = rng.standard_normal((nd, ld, dim)).astype(np.float32)
        lens = rng.integers(0, ld + 1, nd).astype(np.int32)
        lens[0] = 0 if seed % 2 else lens[0]
        s0, a0 = run(q, d, lens, False)
        s1, a1 = run(q, d, lens, True)
        diff = np.argwhere(a0 != a1)
        sd = np.argwhere(s0.view(np.uint32) != s1.view(np.uint32))
        if len(diff) or len(sd):
            bad += 1
            print(" seed", seed, "argmax diffs", len(diff), "score diffs", len(sd), "first", diff[:4].tolist())
            for i, j, r in diff[:4]:
                sims = q[i, r].astype(np.float64) @ d[j, :lens[j]].astype(np.float64).T
                print("   q", i, "doc", j, "row", r, "len", lens[j], "inloop", a0[i, j, r], "late", a1[i, j, r],
                      "vals", sims[a0[i, j, r]] if a0[i,j,r] >= 0 else None, sims[a1[i, j, r]] if a1[i,j,r] >= 0 else None, "max", sims.max() if lens[j] else None, "argmax", sims.argmax() if lens[j] else None)
    print(" bad seeds", bad, flush=True)
t.REFINE_LATE = False
