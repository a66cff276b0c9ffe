"""INT8 tiles whose wgmma ptxas serialized on main (C7520): kernel ms and a digest of the outputs, for the
tree on PYTHONPATH. Run by ab.sh once per tree and round."""
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
for nq, lq, nd, ld, dim, packed in ((4, 32, 10000, 180, 128, False), (2, 32, 10000, 180, 256, False),
                                    (1, 1024, 1000, 300, 128, True), (1, 1024, 1000, 300, 256, True)):
    q, d = unit(nq, lq, dim), unit(nd, ld, dim)
    q8, qs = lik_cupy.quantize_int8(q); d8, ds = lik_cupy.quantize_int8(d)
    if packed:
        off = torch.arange(0, (nd + 1) * ld, ld, device='cuda')
        f = lambda: lik_cupy.maxsim_int8_varlen(q8, d8.reshape(-1, dim), ds.reshape(-1), off, q_scales=qs)
    else:
        f = lambda: lik_cupy.maxsim_int8(q8, d8, ds, q_scales=qs)
    out["cells"].append({"cell": f"{nq} q ({lq}) x {nd} ({ld}) d {dim}{' packed' if packed else ''}",
                         "cfg": picked(f).name, "ms": per_call_ms(torch, f, 20, rounds=3, spin_cycles=20_000_000),
                         "digest": digest(f())})
    del d, d8, ds
    torch.cuda.empty_cache()
print(json.dumps(out), flush=True)
