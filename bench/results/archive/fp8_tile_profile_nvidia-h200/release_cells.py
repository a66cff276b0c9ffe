"""FP8 and INT8 cells, kernel ms and output digests, for the tree on PYTHONPATH (argv[1] names it)."""
import hashlib, json, os, sys
sys.path.append(os.environ.get("BENCH_ROOT", "."))
import torch
import lik_cupy
from bench.lib.forcing import picked
from bench.lib.timing import per_call_ms

g = torch.Generator(device='cuda').manual_seed(0)
def unit(*s):
    return torch.nn.functional.normalize(torch.randn(*s, device='cuda', generator=g), dim=-1)
def digest(r):
    h = hashlib.sha256()
    for x in (r if isinstance(r, tuple) else (r,)):
        h.update(x.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
out = {"tree": sys.argv[1], "gpu": torch.cuda.get_device_name(), "cells": []}
for kind in ("fp8", "int8"):
    quant = lik_cupy.quantize_fp8 if kind == "fp8" else lik_cupy.quantize_int8
    fn = lik_cupy.maxsim_fp8 if kind == "fp8" else lik_cupy.maxsim_int8
    fnv = lik_cupy.maxsim_fp8_varlen if kind == "fp8" else lik_cupy.maxsim_int8_varlen
    for lq, nd, ld, packed, am in ((1024, 1000, 1024, False, False), (1024, 1000, 1024, False, True),
                                   (1024, 1000, 1024, True, False), (32, 10000, 180, False, False),
                                   (32, 1000, 300, True, False), (512, 2000, 512, False, False),
                                   (32, 10000, 180, False, True)):
        q, d = unit(1, lq, 128), unit(nd, ld, 128)
        q8, qs = quant(q); d8, ds = quant(d)
        if packed:
            off = torch.arange(0, (nd + 1) * ld, ld, device='cuda')
            f = lambda: fnv(q8, d8.reshape(-1, 128), ds.reshape(-1), off, q_scales=qs, return_argmax=am)
        else:
            f = lambda: fn(q8, d8, ds, q_scales=qs, return_argmax=am)
        out["cells"].append({"cell": f"{kind} 1 q ({lq}) x {nd} ({ld}){' packed' if packed else ''}{' argmax' if am else ''}",
                             "cfg": picked(f).name, "ms": per_call_ms(torch, f, 20, rounds=3, spin_cycles=20_000_000),
                             "digest": digest(f())})
        del d, d8, ds
        torch.cuda.empty_cache()
print(json.dumps(out), flush=True)
