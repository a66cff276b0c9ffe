import sys, json, os
sys.path.insert(0, os.getcwd())
import numpy as np, cupy as cp, torch
from triton.testing import do_bench
import lik_cupy
from lik_cupy import _dispatch
import lik_cupy._dispatch.tables as t
rng = cp.random.default_rng(1)
def unit(*s):
    x = rng.standard_normal(s, dtype=cp.float32); return x / cp.linalg.norm(x, axis=-1, keepdims=True)
cells = {
  "colpali-1000": ((1, 1024), (1000, 1024)), "visual": ((1, 512), (1000, 1024)), "medium": ((1, 128), (1000, 1024)),
  "32q-1000": ((32, 32), (1000, 180)), "few-long-64": ((1, 1024), (64, 1024)), "few-long-256": ((1, 1024), (256, 1024)),
  "train-64": ((64, 32), (64, 300)), "64q-ld300": ((1, 64), (1000, 300)),
}
only = sys.argv[1:]
out = {}
for name, ((nq, lq), (nd, ld)) in cells.items():
    if only and name not in only: continue
    Q, D = unit(nq, lq, 128), unit(nd, ld, 128)
    res = {}
    for mode in ("argmax", "plain", "packed"):
        if mode == "packed" and nq > 1: continue
        if mode == "packed":
            lens = cp.asarray(np.random.default_rng(2).integers(ld // 4, ld + 1, nd))
            off = cp.concatenate([cp.zeros(1, cp.int64), cp.cumsum(lens)])
            tok = unit(int(off[-1]), 128)
            f = lambda: lik_cupy.maxsim_varlen(Q, tok, off)
        elif mode == "argmax":
            f = lambda: lik_cupy.maxsim(Q, D, return_argmax=True)
        else:
            f = lambda: lik_cupy.maxsim(Q, D)
        r = {}
        outs = {}
        for late in (False, True, False, True):
            t.REFINE_LATE = late; _dispatch.clear_caches()
            o = f(); cp.cuda.Device().synchronize()
            ms = do_bench(f, warmup=25, rep=200)
            r.setdefault(str(late), []).append(ms)
            outs[late] = o
        def bits(o):
            return [cp.asnumpy(x) for x in (o if isinstance(o, tuple) else (o,))]
        same = all(np.array_equal(a.view(np.uint32) if a.dtype == np.float32 else a, b.view(np.uint32) if b.dtype == np.float32 else b)
                   for a, b in zip(bits(outs[False]), bits(outs[True])))
        res[mode] = {"ms_inloop": min(r["False"]), "ms_late": min(r["True"]), "ratio": min(r["True"]) / min(r["False"]), "same_bits": same}
        print(f"{name:14s} {mode:7s} inloop {min(r['False']):.4f} late {min(r['True']):.4f} ratio {min(r['True'])/min(r['False']):.3f} same {same}", flush=True)
    out[name] = res
t.REFINE_LATE = False
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump({"gpu": torch.cuda.get_device_name(), "cells": out}, open(os.path.join(os.environ.get("OUT", "."), "late_ab.json"), "w"), indent=1)
